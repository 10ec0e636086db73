//! The actor runtime on two tiny random models that share a tokenizer: token-routed greedy
//! output equals the full-recompute oracle in every scheduling mode, the models sharing one
//! device or on two that compute side by side; no workload (cancelled,
//! stopped, preempted, prefix-cached requests) leaks a KV block or a terminal event, and each
//! model is told once of each request's end.

mod common;

use std::sync::Arc;

use candle_core::Device;
use common::oracle::routed_greedy;
use common::runtime::{
    collect, config, config_on, every_prompt, greedy, prompts, rules, tiny_pair, with_runtime,
};
use tokenrouter::actors::{GenerateRequest, Prompt, RequestEvent, Runtime};
use tokenrouter::model::{LoadedModel, SamplingParams};

#[test]
fn routed_greedy_output_equals_the_full_recompute_oracle_in_every_mode() {
    let pair = tiny_pair();
    let models = [&pair.models[0].model, &pair.models[1].model];
    let max_tokens = 20;
    for (rule, routing) in rules(&pair) {
        let expected: Vec<_> = prompts()
            .iter()
            .map(|p| routed_greedy(models, rule, p, max_tokens, &[]))
            .collect();
        let routed: usize = expected
            .iter()
            .flat_map(|t| &t.tokens)
            .filter(|t| t.model == 1)
            .count();
        assert!(routed > 0, "{rule:?}: the oracle never used the LLM");
        // The model on a core of its own each: two devices that compute side by side.
        let cores = tokenrouter::kernels::parallel::process_cores();
        assert!(cores.len() >= 2, "this test needs two cores: {cores:?}");
        let apart = [format!("cpu:{}", cores[0]), format!("cpu:{}", cores[1])];
        let apart = [apart[0].as_str(), apart[1].as_str()];
        // The last shared entry adds `thresholds = "auto"` to delayed batching.
        let runs = [
            (["cpu", "cpu"], "delayed"),
            (["cpu", "cpu"], "eager"),
            (["cpu", "cpu"], "sync"),
            (["cpu", "cpu"], "delayed\"\nthresholds = \"auto"),
            (apart, "delayed"),
            (apart, "eager"),
        ];
        for (devices, mode) in runs {
            let config = config_on(
                pair.dir.path(),
                devices,
                &format!("{routing}[scheduler]\nmode = \"{mode}\"\n"),
            );
            let (outcomes, stats) = with_runtime(&config, &pair, async |rt| {
                every_prompt(rt, max_tokens).await
            });
            if mode.contains("auto") {
                assert!(
                    stats.iter().all(|s| s.tuned_points > 0),
                    "no thresholds solved: {stats:?}"
                );
            }
            // Every model computes the prompt of each request it serves (less the prefix
            // cache's hits) without sampling from any of it but the last token.
            for (m, stat) in stats.iter().enumerate() {
                let prompts: u64 = outcomes
                    .iter()
                    .filter_map(|o| match o.terminals.as_slice() {
                        [RequestEvent::Finished(s)] if m == 0 || s.tokens_per_model[m] > 0 => {
                            Some(s.prompt_tokens as u64 - 1)
                        }
                        _ => None,
                    })
                    .sum();
                assert!(
                    stat.extend_tokens + stat.prefix_hit_tokens >= prompts && prompts > 0,
                    "{rule:?}, mode {mode}, model {m}: {} tokens extended, {} cached, prompts {prompts}",
                    stat.extend_tokens,
                    stat.prefix_hit_tokens
                );
            }
            for (i, (got, want)) in outcomes.iter().zip(&expected).enumerate() {
                assert_eq!(
                    got.tokens, want.tokens,
                    "{rule:?}, mode {mode}, devices {devices:?}, prompt {i}"
                );
                assert!(
                    matches!(got.terminals.as_slice(), [RequestEvent::Finished(s)] if s.completion_tokens == max_tokens),
                    "{:?}",
                    got.terminals
                );
            }
        }
    }
}

#[test]
fn cancelled_stopped_and_preempted_requests_leave_no_blocks_behind() {
    let pair = tiny_pair();
    let models = [&pair.models[0].model, &pair.models[1].model];
    let [_, (rule, routing)] = rules(&pair);
    // About 100 tokens of KV per model for 15 requests of up to 47 tokens: preemption is certain.
    let config = config(
        pair.dir.path(),
        &format!("{routing}[memory]\nkv_budget_mb = 0.2\n[scheduler]\nmode = \"eager\"\nmax_batch_tokens = 32\n"),
    );
    let max_tokens = 24;
    let (outcomes, stats) = with_runtime(&config, &pair, async |rt| {
        let mut handles = Vec::new();
        for round in 0..3 {
            for (k, p) in prompts().iter().enumerate() {
                let mut req = greedy(p, max_tokens);
                req.ignore_eos = true;
                if round == 2 {
                    req.stop = vec!["e".into()];
                }
                let cancel = (round == 1 && k % 2 == 0).then_some(3 + k);
                handles.push((rt.submit(req), cancel, k, round));
            }
        }
        // Listen to all at once, so that cancellations land while requests run.
        let tasks: Vec<_> = handles
            .into_iter()
            .map(|(h, cancel, k, round)| (actix::spawn(collect(h, cancel)), cancel, k, round))
            .collect();
        let mut out = Vec::new();
        for (task, cancel, k, round) in tasks {
            out.push((task.await.unwrap(), cancel, k, round));
        }
        (out, rt.stats().await)
    });
    assert!(
        stats.iter().map(|s| s.preemptions).sum::<u64>() > 0,
        "{stats:?}"
    );
    let cancelled = outcomes
        .iter()
        .filter(|(o, ..)| matches!(o.terminals.as_slice(), [RequestEvent::Cancelled]))
        .count();
    assert!(
        cancelled > 0,
        "no cancellation landed before its request finished"
    );
    for (outcome, cancel, k, round) in outcomes {
        assert_eq!(
            outcome.terminals.len(),
            1,
            "request {k} of round {round}: {:?}",
            outcome.terminals
        );
        let want = routed_greedy(models, rule, &prompts()[k], max_tokens, &[]).tokens;
        match (&outcome.terminals[0], cancel) {
            (RequestEvent::Cancelled, Some(n)) => {
                assert!(outcome.tokens.len() >= n);
                assert_eq!(outcome.tokens, want[..outcome.tokens.len()]);
            }
            (RequestEvent::Finished(s), None) if round == 2 && s.stop.is_some() => {
                assert!(!outcome.text.contains('e'));
                assert_eq!(outcome.tokens, want[..outcome.tokens.len()]);
            }
            // A cancellation may arrive after the last token.
            (RequestEvent::Finished(s), _) => {
                assert_eq!(s.completion_tokens, max_tokens);
                assert_eq!(
                    outcome.tokens, want,
                    "preemption changed the output of request {k}"
                );
            }
            (other, _) => panic!("request {k} of round {round} ended with {other:?}"),
        }
    }
}

/// Each model hears once of each request that ends after reaching it, whoever ends it: the
/// committing model (max_tokens, end of sequence) or the request actor (a stop string, a
/// cancellation).
#[test]
fn every_model_receives_one_release_per_ended_request() {
    let pair = tiny_pair();
    let [(_, routing), _] = rules(&pair);
    let config = config(
        pair.dir.path(),
        &format!("{routing}[memory]\nkv_budget_mb = 1\n[scheduler]\nmode = \"eager\"\n"),
    );
    let (ended, stats) = with_runtime(&config, &pair, async |rt| {
        let mut handles = Vec::new();
        for p in prompts() {
            let until_length = |max_tokens| {
                let mut req = greedy(&p, max_tokens);
                req.ignore_eos = true;
                req
            };
            handles.push((rt.submit(until_length(12)), None));
            handles.push((rt.submit(greedy(&p, 12)), None));
            let mut stopped = until_length(24);
            stopped.stop = vec!["e".into()];
            handles.push((rt.submit(stopped), None));
            handles.push((rt.submit(until_length(24)), Some(2)));
        }
        let tasks: Vec<_> = handles
            .into_iter()
            .map(|(h, cancel)| actix::spawn(collect(h, cancel)))
            .collect();
        for task in tasks {
            let out = task.await.unwrap();
            assert_eq!(out.terminals.len(), 1, "{:?}", out.terminals);
        }
        // A late second release would arrive within this.
        actix_rt::time::sleep(std::time::Duration::from_millis(200)).await;
        (4 * prompts().len() as u64, rt.stats().await)
    });
    for s in &stats {
        assert_eq!(s.releases, ended, "{}: {s:?}", s.name);
    }
}

#[test]
fn bad_requests_fail_with_the_field_named_and_leave_nothing_behind() {
    let pair = tiny_pair();
    let config = config(pair.dir.path(), "[memory]\nkv_budget_mb = 1\n");
    with_runtime(&config, &pair, async |rt| {
        let cases = [
            (greedy(&[], 4), "prompt"),
            (greedy(&[1; 4000], 4), "prompt"),
            (greedy(&[1, 2], 100_000), "max_tokens"),
            (greedy(&[1, 2], 0), "max_tokens"),
            (greedy(&[1, 999_999], 4), "input_ids"),
            (
                GenerateRequest::new(
                    Prompt::Tokens(vec![1]),
                    SamplingParams {
                        top_p: 2.0,
                        ..SamplingParams::default()
                    },
                    4,
                ),
                "top_p",
            ),
        ];
        for (req, field) in cases {
            let out = collect(rt.submit(req), None).await;
            match out.terminals.as_slice() {
                [RequestEvent::Failed(e)] => {
                    assert!(e.message.contains(field), "{e:?} should name {field}")
                }
                other => panic!("expected one failure naming {field}, got {other:?}"),
            }
        }
        let ok = collect(rt.submit(greedy(&[1, 2, 3], 4)), None).await;
        assert_eq!(
            ok.tokens.len(),
            4,
            "the runtime still serves after bad requests"
        );
    });
}

#[test]
fn models_with_different_tokenizers_cannot_be_routed_together() {
    let pair = tiny_pair();
    let smol =
        Arc::new(LoadedModel::load(&common::real_model(common::SMOLLM2), &Device::Cpu).unwrap());
    let config = config(
        pair.dir.path(),
        "[routing]\nalgorithm = \"entropy\"\nthreshold = 1.0\n",
    );
    let err = actix::System::new().block_on(async {
        match Runtime::start(&config, vec![pair.models[0].clone(), smol]) {
            Ok(runtime) => {
                runtime.stop();
                panic!("a pair with different tokenizers was accepted")
            }
            Err(e) => e.to_string(),
        }
    });
    assert!(
        err.contains("different tokenizers") && err.contains("'llm'"),
        "{err}"
    );
}
