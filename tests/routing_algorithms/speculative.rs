//! Speculative decoding: greedy output is the LLM's, sampled output follows its distribution.

use super::*;

/// Speculative decoding with greedy sampling gives exactly the LLM's greedy output,
/// recomputed from nothing, in every mode and with a fixed or adaptive draft length: on the
/// tiny pair, whose drafts are mostly rejected, and on a pair whose drafts are mostly
/// accepted (and some not).
#[test]
fn speculative_decoding_gives_the_llms_greedy_output_in_every_mode() {
    for (name, pair) in [("tiny", tiny_pair()), ("draft", draft_pair())] {
        let expected: Vec<Vec<u32>> = prompts()
            .iter()
            .map(|p| {
                let mut context = p.clone();
                (0..MAX_TOKENS)
                    .map(|_| {
                        let logits = fresh_logits(&pair.models[1].model, &context);
                        let best = tokenrouter::model::sampler::argmax(&logits);
                        context.push(best);
                        best
                    })
                    .collect()
            })
            .collect();
        for draft in ["3", "\"auto\""] {
            let routing =
                format!("[routing]\nalgorithm = \"speculative\"\ndraft_tokens = {draft}\n");
            for mode in ["eager", "delayed", "sync"] {
                let got = run_all(&pair, &routing, mode);
                for (i, (g, want)) in got.iter().zip(&expected).enumerate() {
                    let tokens: Vec<u32> = g.iter().map(|t| t.token).collect();
                    assert_eq!(
                        &tokens, want,
                        "{name} pair, draft_tokens {draft}, mode {mode}, prompt {i}"
                    );
                }
                let accepted = got.iter().flatten().filter(|t| t.model == 0).count();
                let own = got.iter().flatten().filter(|t| t.model == 1).count();
                // "auto" prices drafts by this machine's timings of the tiny pair, which may
                // make one draft per verification the best: it drafts, at some length.
                let drafted_enough = if draft == "3" {
                    accepted > own
                } else {
                    accepted > 0
                };
                if name == "draft" {
                    assert!(
                        drafted_enough && own > 0,
                        "draft_tokens {draft}, mode {mode}: {accepted} accepted drafts, {own} LLM tokens"
                    );
                }
            }
        }
    }
}

/// Draws `requests` outputs of `max_tokens` tokens at temperature 1, one seed each, from
/// the runtime configured with `routing`.
fn sampled_outputs(
    pair: &Pair,
    routing: &str,
    prompt: &[u32],
    requests: u64,
    max_tokens: usize,
) -> Vec<Vec<u32>> {
    let config = config(pair.dir.path(), routing);
    with_runtime(&config, pair, async |rt: &Runtime| {
        let mut out = Vec::new();
        for seeds in (0..requests).collect::<Vec<_>>().chunks(64) {
            let handles: Vec<_> = seeds
                .iter()
                .map(|&seed| {
                    let params = tokenrouter::model::SamplingParams {
                        temperature: 1.0,
                        seed: Some(seed),
                        ..Default::default()
                    };
                    let mut req = tokenrouter::actors::GenerateRequest::new(
                        tokenrouter::actors::Prompt::Tokens(prompt.to_vec()),
                        params,
                        max_tokens,
                    );
                    req.ignore_eos = true;
                    rt.submit(req)
                })
                .collect();
            for h in handles {
                let outcome = collect(h, None).await;
                out.push(outcome.tokens.iter().map(|t| t.token).collect());
            }
        }
        out
    })
}

/// Pearson's statistic of each output token against the LLM's own distribution at its
/// position, recomputed from nothing: every token is mapped to its randomised probability
/// integral transform under that distribution (uniform on [0, 1) exactly when the tokens
/// follow it), and the transforms are counted in 20 equal bins. Returns the statistic
/// (19 degrees of freedom).
fn chi_square_against_llm(pair: &Pair, prompt: &[u32], outputs: &[Vec<u32>]) -> f64 {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(99);
    let mut cache = std::collections::HashMap::new();
    let mut bins = [0usize; 20];
    let mut n = 0;
    for output in outputs {
        let mut context = prompt.to_vec();
        for &t in output {
            let probs: &Vec<f64> = cache.entry(context.clone()).or_insert_with(|| {
                let logits = fresh_logits(&pair.models[1].model, &context);
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let w: Vec<f64> = logits.iter().map(|&l| (l as f64 - max).exp()).collect();
                let total: f64 = w.iter().sum();
                w.iter().map(|w| w / total).collect()
            });
            let below: f64 = probs[..t as usize].iter().sum();
            let u = below + rng.random::<f64>() * probs[t as usize];
            bins[((u * 20.0) as usize).min(19)] += 1;
            n += 1;
            context.push(t);
        }
    }
    let expected = n as f64 / 20.0;
    bins.iter()
        .map(|&c| (c as f64 - expected).powi(2) / expected)
        .sum()
}

/// Speculative sampling at temperature 1: the tokens follow the LLM's distribution (Pearson's
/// test at the 0.1 % level: 19 degrees of freedom, critical value 43.82), while the SLM's own
/// samples, which are what accepting every draft would give, fail the same test, so the test
/// can see a broken rejection step. The same seeds give the same outputs.
#[test]
fn speculative_sampling_follows_the_llms_distribution() {
    const CRITICAL: f64 = 43.82;
    let pair = tiny_pair();
    let prompt = prompts()[1].clone();
    let spec = "[routing]\nalgorithm = \"speculative\"\ndraft_tokens = 3\n";
    let outputs = sampled_outputs(&pair, spec, &prompt, 1500, 4);
    let again = sampled_outputs(&pair, spec, &prompt, 40, 4);
    assert_eq!(
        again[..],
        outputs[..40],
        "the same seeds give the same outputs"
    );
    let statistic = chi_square_against_llm(&pair, &prompt, &outputs);
    assert!(
        statistic < CRITICAL,
        "speculative samples: chi-square {statistic:.1} >= {CRITICAL}"
    );
    let slm = "[routing]\nalgorithm = \"single\"\nmodel = \"slm\"\n";
    let drafts_only = sampled_outputs(&pair, slm, &prompt, 1500, 4);
    let statistic = chi_square_against_llm(&pair, &prompt, &drafts_only);
    assert!(
        statistic > CRITICAL,
        "the SLM's own samples must fail the test: chi-square {statistic:.1}"
    );
}

/// Drafts never carry a request past the context: prompts that leave room for one to six
/// tokens get exactly the LLM's greedy tokens up to the context's end.
#[test]
fn speculative_decoding_ends_exactly_at_the_context() {
    let pair = draft_pair();
    let context = pair.models[1].model.config().context_length;
    let routing = "[routing]\nalgorithm = \"speculative\"\ndraft_tokens = 4\n";
    let config = config(pair.dir.path(), routing);
    let prompts: Vec<Vec<u32>> = (1..=6)
        .map(|room| {
            (0..(context - room) as u32)
                .map(|i| (i * 7) % 250)
                .collect()
        })
        .collect();
    let got = run_greedy(&pair, &config, &prompts, |p| context - p.len());
    for (prompt, tokens) in prompts.iter().zip(&got) {
        assert_eq!(prompt.len() + tokens.len(), context);
        let mut text = prompt.clone();
        for t in tokens {
            let logits = fresh_logits(&pair.models[1].model, &text);
            assert_eq!(t.token, tokenrouter::model::sampler::argmax(&logits));
            text.push(t.token);
        }
    }
}

/// A drafter restricted to the first 128 token ids drafts only those, and the output is
/// still the LLM's greedy output.
#[test]
fn a_draft_vocabulary_changes_the_drafts_not_the_output() {
    let pair = draft_pair();
    let mut slm = tokenrouter::model::LoadedModel::load(
        &pair.dir.path().join("slm.gguf"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    slm.set_draft_vocab(128).unwrap();
    let llm = pair.models[1].clone();
    let pair = Pair {
        models: vec![std::sync::Arc::new(slm), llm],
        dir: pair.dir,
    };
    let routing = "[routing]\nalgorithm = \"speculative\"\ndraft_tokens = 3\n";
    let got = run_all(&pair, routing, "eager");
    for (prompt, tokens) in prompts().iter().zip(&got) {
        let mut context = prompt.clone();
        for t in tokens {
            let logits = fresh_logits(&pair.models[1].model, &context);
            assert_eq!(t.token, tokenrouter::model::sampler::argmax(&logits));
            context.push(t.token);
        }
    }
    let drafted: Vec<u32> = got
        .iter()
        .flatten()
        .filter(|t| t.model == 0)
        .map(|t| t.token)
        .collect();
    assert!(
        !drafted.is_empty() && drafted.iter().all(|&t| t < 128),
        "{drafted:?}"
    );
}
