//! The routing algorithms on the tiny model pair: learned routers (R2R, CITER, Co-LLM) with
//! heads of known weights send exactly the positions an independent f64 re-implementation of
//! the head predicts, and the runtime's output equals the full-recompute oracle in every
//! scheduling mode; query-level routing runs each request wholly on the model its rule picks;
//! the seeded Bernoulli router routes alike in every mode, each token the oracle's.

mod common;

use common::heads::{self, HeadWeights};
use common::oracle::{deferral_greedy, fresh_features, fresh_logits, routed_greedy};
use common::oracle::{OracleToken, Rule};
use common::runtime::{
    collect, config, draft_pair, greedy, prompts, tiny_pair, with_runtime, Pair,
};
use tokenrouter::actors::{RequestEvent, Runtime};
use tokenrouter::routing::head::{HeadConfig, HeadKind, RouterHead};

const MAX_TOKENS: usize = 16;

#[test]
fn the_reference_erf_matches_known_values() {
    let known = [
        (0.0, 0.0),
        (0.5, 0.520_499_877_813_046_5),
        (1.0, 0.842_700_792_949_714_9),
        (-2.0, -0.995_322_265_018_952_7),
        (3.5, 0.999_999_256_901_627_7),
    ];
    for (x, want) in known {
        assert!((heads::erf(x) - want).abs() < 1e-12, "erf({x})");
    }
}

fn head_config(kind: HeadKind, hidden: usize) -> HeadConfig {
    match kind {
        HeadKind::R2r => HeadConfig::new(kind, hidden).with_r2r_shape(20, 8, 32, 2),
        _ => HeadConfig::new(kind, hidden),
    }
}

/// Heads reading the hidden state as it is, or also the confidence over the 6 largest logits
/// with the whole state standardised.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Inputs {
    Hidden,
    Confident,
}

/// Writes a seeded head for the SLM; returns its file name and an independent scorer.
fn write_head(
    pair: &Pair,
    kind: HeadKind,
) -> (String, impl Fn(&common::oracle::TokenFeatures) -> f32) {
    write_head_reading(pair, kind, Inputs::Hidden)
}

fn write_head_reading(
    pair: &Pair,
    kind: HeadKind,
    inputs: Inputs,
) -> (String, impl Fn(&common::oracle::TokenFeatures) -> f32) {
    use candle_core::{Device, Tensor};
    let hidden = pair.models[0].model.config().hidden_size;
    let config = match inputs {
        Inputs::Hidden => head_config(kind, hidden),
        Inputs::Confident => head_config(kind, hidden).with_confidence(6).standardized(),
    };
    let (head, vars) = RouterHead::init(config.clone(), 42).unwrap();
    if inputs == Inputs::Confident {
        // A standardisation that moves every feature (training measures it; here it is set).
        let width = hidden + 2;
        let values = |f: fn(usize) -> f32| (0..width).map(f).collect::<Vec<f32>>();
        let data = vars.data().lock().unwrap();
        for (name, v) in [
            ("standardize.mean", values(|i| (i as f32 * 0.7).sin())),
            ("standardize.scale", values(|i| 0.5 + (i % 5) as f32 * 0.3)),
        ] {
            data[name]
                .set(&Tensor::from_vec(v, width, &Device::Cpu).unwrap())
                .unwrap();
        }
    }
    let name = match inputs {
        Inputs::Hidden => format!("{kind:?}.safetensors"),
        Inputs::Confident => format!("{kind:?}-confident.safetensors"),
    }
    .to_lowercase();
    let path = pair.dir.path().join(&name);
    head.save(&vars, &path).unwrap();
    let weights = HeadWeights::read(&path);
    let k = config.confidence_top_k;
    let scorer = move |f: &common::oracle::TokenFeatures| match kind {
        HeadKind::R2r => heads::r2r(&weights, f, config.top_k, config.blocks, k),
        HeadKind::Citer => heads::citer(&weights, f, k),
        HeadKind::CoLlm => heads::co_llm(&weights, f, k),
    };
    (name, scorer)
}

/// Whether `score` sends the token to the LLM under each algorithm's rule.
fn defers(kind: HeadKind, score: f32, threshold: f32) -> bool {
    match kind {
        HeadKind::R2r => score >= threshold,
        HeadKind::Citer => score < threshold,
        HeadKind::CoLlm => score > threshold,
    }
}

/// A threshold in a wide gap between the scores the SLM produces, so that routing happens on
/// a fair share of tokens and no decision sits on a knife's edge.
fn threshold_in_a_gap(pair: &Pair, scorer: &dyn Fn(&common::oracle::TokenFeatures) -> f32) -> f32 {
    let mut scores = Vec::new();
    for p in prompts().iter().take(3) {
        let mut tokens = p.clone();
        for _ in 0..MAX_TOKENS {
            let (token, _, features) = fresh_features(&pair.models[0].model, &tokens);
            scores.push(scorer(&features));
            tokens.push(token);
        }
    }
    scores.sort_by(|a, b| a.total_cmp(b));
    let n = scores.len();
    let (lo, hi) = (n / 4, 3 * n / 4);
    let at = (lo..hi)
        .max_by(|&i, &j| (scores[i + 1] - scores[i]).total_cmp(&(scores[j + 1] - scores[j])))
        .unwrap();
    (scores[at] + scores[at + 1]) / 2.0
}

fn algorithm(kind: HeadKind) -> &'static str {
    match kind {
        HeadKind::R2r => "r2r",
        HeadKind::Citer => "citer",
        HeadKind::CoLlm => "co-llm",
    }
}

/// Runs every prompt greedily through a runtime configured with `routing` and `mode`.
fn run_all(pair: &Pair, routing: &str, mode: &str) -> Vec<Vec<OracleToken>> {
    let config = config(
        pair.dir.path(),
        &format!("{routing}[scheduler]\nmode = \"{mode}\"\n"),
    );
    run_with(pair, &config)
}

/// Runs every prompt greedily (EOS ignored) through a runtime over `pair`'s models.
fn run_with(pair: &Pair, config: &tokenrouter::config::Config) -> Vec<Vec<OracleToken>> {
    run_greedy(pair, config, &prompts(), |_| MAX_TOKENS)
}

/// Runs `prompts` greedily (EOS ignored, `max_tokens` of each) through a runtime over
/// `pair`'s models; each must finish.
fn run_greedy(
    pair: &Pair,
    config: &tokenrouter::config::Config,
    prompts: &[Vec<u32>],
    max_tokens: impl Fn(&[u32]) -> usize,
) -> Vec<Vec<OracleToken>> {
    with_runtime(config, pair, async |rt: &Runtime| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let mut req = greedy(p, max_tokens(p));
                req.ignore_eos = true;
                rt.submit(req)
            })
            .collect();
        let mut out = Vec::new();
        for h in handles {
            let outcome = collect(h, None).await;
            assert!(matches!(
                outcome.terminals.as_slice(),
                [RequestEvent::Finished(_)]
            ));
            out.push(outcome.tokens);
        }
        out
    })
}

#[test]
fn learned_routers_defer_exactly_where_their_heads_say() {
    let pair = tiny_pair();
    let models = [&pair.models[0].model, &pair.models[1].model];
    let kinds = [HeadKind::R2r, HeadKind::Citer, HeadKind::CoLlm];
    let heads = kinds
        .iter()
        .flat_map(|&k| [(k, Inputs::Hidden), (k, Inputs::Confident)]);
    for (kind, inputs) in heads {
        let (file, scorer) = write_head_reading(&pair, kind, inputs);
        let threshold = threshold_in_a_gap(&pair, &scorer);
        let mut closest = f32::INFINITY;
        let expected: Vec<Vec<OracleToken>> = prompts()
            .iter()
            .map(|p| {
                let decide = |s: f32| defers(kind, s, threshold);
                let (tokens, scores) = deferral_greedy(models, &scorer, &decide, p, MAX_TOKENS);
                closest = scores
                    .iter()
                    .fold(closest, |c, s| c.min((s - threshold).abs()));
                tokens
            })
            .collect();
        assert!(
            closest > 1e-5,
            "{kind:?} {inputs:?}: a decision within {closest} of the threshold"
        );
        let deferred = expected.iter().flatten().filter(|t| t.model == 1).count();
        let total = expected.iter().flatten().count();
        assert!(
            deferred > 0 && deferred < total,
            "{kind:?} {inputs:?}: {deferred} of {total} tokens deferred"
        );
        let routing = format!(
            "[routing]\nalgorithm = \"{}\"\nrouter = \"{file}\"\nthreshold = {threshold}\n",
            algorithm(kind)
        );
        // The scheduling modes do not touch a head's arithmetic: its inputs are tried in one.
        let modes = match inputs {
            Inputs::Hidden => &["delayed", "eager", "sync"][..],
            Inputs::Confident => &["delayed"][..],
        };
        for mode in modes {
            let got = run_all(&pair, &routing, mode);
            for (i, (g, w)) in got.iter().zip(&expected).enumerate() {
                assert_eq!(g, w, "{kind:?} {inputs:?}, mode {mode}, prompt {i}");
            }
        }
    }
}

#[test]
fn the_threshold_in_the_router_file_applies_unless_the_config_overrides_it() {
    let pair = tiny_pair();
    let (file, _) = write_head(&pair, HeadKind::CoLlm);
    // The file says 0.5; a gate never above 1.0 defers nothing, one always above 0.0 everything.
    for (threshold, all_llm) in [("threshold = 1.0\n", false), ("threshold = 0.0\n", true)] {
        let routing =
            format!("[routing]\nalgorithm = \"co-llm\"\nrouter = \"{file}\"\n{threshold}");
        let got = run_all(&pair, &routing, "eager");
        let on_llm = got.iter().flatten().filter(|t| t.model == 1).count();
        let total = got.iter().flatten().count();
        assert_eq!(on_llm == total, all_llm, "{threshold}: {on_llm} of {total}");
        assert!(all_llm || on_llm == 0);
    }
}

#[test]
fn a_share_target_sends_that_share_of_tokens_to_the_llm() {
    let pair = tiny_pair();
    for kind in [HeadKind::R2r, HeadKind::Citer, HeadKind::CoLlm] {
        let (file, _) = write_head(&pair, kind);
        for share in [0.25, 0.5] {
            let routing = format!(
                "[routing]\nalgorithm = \"{}\"\nrouter = \"{file}\"\nshare = {share}\n",
                algorithm(kind)
            );
            let got = run_all(&pair, &routing, "delayed");
            let on_llm = got.iter().flatten().filter(|t| t.model == 1).count();
            let total = got.iter().flatten().count();
            let routed = on_llm as f64 / total as f64;
            // The cut-off starts from the first batch's scores alone, so the share is close,
            // not exact, over this few tokens (80).
            assert!(
                (routed - share).abs() < 0.1,
                "{kind:?}, share {share}: {on_llm} of {total} tokens on the LLM"
            );
        }
    }
}

#[test]
fn query_level_runs_each_request_wholly_on_one_model() {
    let pair = tiny_pair();
    let models = [&pair.models[0].model, &pair.models[1].model];
    let alone = |model: usize, prompt: &[u32]| -> Vec<OracleToken> {
        // A rule that never leaves the starting model: greedy on that model alone.
        let trace = routed_greedy(
            [models[model], models[model]],
            Rule::Entropy {
                threshold: f32::INFINITY,
            },
            prompt,
            MAX_TOKENS,
            &[],
        );
        trace
            .tokens
            .into_iter()
            .map(|t| OracleToken { model, ..t })
            .collect()
    };
    // By length: the prompts are 3, 8, 13, 18 and 23 tokens long.
    let routing = "[routing]\nalgorithm = \"query-level\"\nrule = \"length\"\nthreshold = 10\n";
    let got = run_all(&pair, routing, "eager");
    for (p, g) in prompts().iter().zip(&got) {
        let model = usize::from(p.len() > 10);
        assert_eq!(g, &alone(model, p), "prompt of {} tokens", p.len());
    }
    // By the SLM's first-token entropy: a threshold between the prompts' entropies.
    let entropies: Vec<f32> = prompts()
        .iter()
        .map(|p| common::oracle::entropy(&common::oracle::fresh_logits(models[0], p)))
        .collect();
    let mut sorted = entropies.clone();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let threshold = (sorted[1] + sorted[2]) / 2.0;
    let routing = format!(
        "[routing]\nalgorithm = \"query-level\"\nrule = \"entropy\"\nthreshold = {threshold}\n"
    );
    for mode in ["delayed", "sync"] {
        let got = run_all(&pair, &routing, mode);
        for ((p, g), h) in prompts().iter().zip(&got).zip(&entropies) {
            let model = usize::from(*h > threshold);
            assert_eq!(
                g,
                &alone(model, p),
                "mode {mode}, first-token entropy {h} vs {threshold}"
            );
        }
    }
}

#[test]
fn a_bad_router_file_stops_start_up_with_the_file_named() {
    let pair = tiny_pair();
    let (file, _) = write_head(&pair, HeadKind::Citer);
    // A CITER head loaded as R2R, and a head for another hidden size.
    let start_error = |routing: &str| {
        let c = config(pair.dir.path(), routing);
        actix::System::new()
            .block_on(async { Runtime::start(&c, pair.models.clone()).err().unwrap() })
            .to_string()
    };
    let err = start_error(&format!(
        "[routing]\nalgorithm = \"r2r\"\nrouter = \"{file}\"\n"
    ));
    assert!(
        err.contains("citer.json") && err.contains("not R2r"),
        "{err}"
    );
    let other = head_config(HeadKind::Citer, 7);
    let (head, vars) = RouterHead::init(other, 1).unwrap();
    head.save(&vars, &pair.dir.path().join("small.safetensors"))
        .unwrap();
    let err = start_error("[routing]\nalgorithm = \"citer\"\nrouter = \"small.safetensors\"\n");
    assert!(
        err.contains("small.json") && err.contains("hidden states of size 7"),
        "{err}"
    );
}

/// `train-router` flags for heads the size of the tiny pair's.
const TINY_HEADS: [&str; 8] = [
    "--top-k",
    "10",
    "--logits-dim",
    "4",
    "--width",
    "16",
    "--blocks",
    "1",
];

/// `train-router` end to end on the tiny pair: reads a corpus, writes a head of each kind
/// with its threshold and report, and the heads serve: a runtime starts with each of them.
#[test]
fn train_router_writes_heads_that_serve() {
    let pair = tiny_pair();
    let corpus = pair.dir.path().join("corpus");
    std::fs::create_dir_all(corpus.join("pkg")).unwrap();
    for i in 0..6 {
        let text: String = (0..40)
            .map(|k| format!("def f{i}_{k}(x):\n    return x * {k} + {i}\n"))
            .collect();
        std::fs::write(corpus.join("pkg").join(format!("m{i}.py")), text).unwrap();
    }
    std::fs::write(corpus.join("notes.txt"), "not python").unwrap();
    let config_path = pair.dir.path().join("config.toml");
    config(pair.dir.path(), "");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenrouter"))
        .args(["train-router", "--config"])
        .arg(&config_path)
        .arg("--corpus")
        .arg(&corpus)
        .args(["--texts", "8", "--text-tokens", "24", "--epochs", "3"])
        .args(TINY_HEADS)
        .args(["--name", "tiny", "--out"])
        .arg(pair.dir.path().join("routers"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for kind in ["r2r", "citer", "co_llm"] {
        assert!(
            stdout.contains(&format!("tiny-{kind}.safetensors")),
            "{stdout}"
        );
        let json = pair.dir.path().join(format!("routers/tiny-{kind}.json"));
        let config: HeadConfig =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let report = config.report.as_ref().expect("a training report");
        assert!(report["recall"].as_f64().unwrap() >= 0.0);
        assert!(report["share_thresholds"].as_object().unwrap().len() == 4);
        assert!((0.0..=1.0).contains(&config.threshold));
        let algorithm = kind.replace('_', "-");
        let routing = format!("[routing]\nalgorithm = \"{algorithm}\"\nrouter = \"routers/tiny-{kind}.safetensors\"\n");
        let got = run_all(&pair, &routing, "eager");
        assert_eq!(got.len(), prompts().len());
    }
    // A corpus with nothing to read is refused with the reason.
    let empty = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenrouter"))
        .args(["train-router", "--config"])
        .arg(&config_path)
        .arg("--corpus")
        .arg(empty.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--corpus"));
}

/// `train-router --prompts`: the SLM completes the prompts, the completions are labelled
/// against the LLM and kept in the cache (a second run reads them instead of running the
/// models), heads are written with thresholds measured on held-out completions, and a
/// malformed prompts file is refused with its line.
#[test]
fn train_router_learns_from_the_slms_completions_and_caches_them() {
    let pair = tiny_pair();
    let dir = pair.dir.path();
    let lines: String = (0..10)
        .map(|i| {
            format!("{{\"prompt\": \"def f{i}(x):\\n    \\\"\\\"\\\"Add {i}.\\\"\\\"\\\"\\n\"}}\n")
        })
        .collect();
    std::fs::write(dir.join("prompts.jsonl"), lines).unwrap();
    config(dir, "");
    let train = |extra: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_tokenrouter"))
            .args(["train-router", "--config"])
            .arg(dir.join("config.toml"))
            .arg("--prompts")
            .arg(dir.join("prompts.jsonl"))
            .args(["--texts", "8", "--max-new", "12", "--horizon", "4"])
            .args(["--epochs", "3"])
            .args(TINY_HEADS)
            .args(["--kinds", "r2r,co_llm", "--name", "gen", "--cache"])
            .arg(dir.join("cache"))
            .arg("--out")
            .arg(dir.join("routers"))
            .args(extra)
            .output()
            .unwrap()
    };
    let first = train(&[]);
    let stderr = String::from_utf8_lossy(&first.stderr);
    assert!(first.status.success(), "{stderr}");
    assert!(stderr.contains("collected 8 completions"), "{stderr}");
    let second = train(&[]);
    let again = String::from_utf8_lossy(&second.stderr);
    assert!(second.status.success(), "{again}");
    assert!(again.contains("read 8 completions"), "{again}");
    // Other labels are other data.
    let third = train(&["--labels", "disagreement"]);
    assert!(String::from_utf8_lossy(&third.stderr).contains("collected 8 completions"));
    for kind in ["r2r", "co_llm"] {
        let json = dir.join(format!("routers/gen-{kind}.json"));
        let config: HeadConfig =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let report = config.report.expect("a training report");
        let shares = report["shares"].as_object().unwrap();
        assert_eq!(shares.len(), 4);
        for m in shares.values() {
            assert!((0.0..=1.0).contains(&m["routed"].as_f64().unwrap()), "{m}");
        }
        assert!(report["test_positions"].as_u64().unwrap() > 0);
    }
    let routing = "[routing]\nalgorithm = \"r2r\"\nrouter = \"routers/gen-r2r.safetensors\"\n";
    assert_eq!(run_all(&pair, routing, "eager").len(), prompts().len());
    // A line that is not a prompt is named.
    std::fs::write(
        dir.join("prompts.jsonl"),
        "{\"prompt\": \"a\"}\n{\"text\": 1}\n",
    )
    .unwrap();
    let bad = train(&[]);
    assert!(!bad.status.success());
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(stderr.contains("prompts.jsonl:2"), "{stderr}");
}

/// Probability of the most likely token, in f64.
fn max_prob(logits: &[f32]) -> f64 {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    1.0 / logits.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>()
}

/// Three models (the pair and a third of another size), each position decided among all of
/// them by weighted confidence, exactly as a from-scratch re-computation decides it.
#[test]
fn an_ensemble_commits_the_best_weighted_proposal_of_every_model() {
    use candle_core::quantized::GgmlDType;
    use std::sync::Arc;
    use tokenrouter::model::tiny::{write_gguf, TinySpec};
    use tokenrouter::model::{Architecture, LoadedModel};

    let mut trio = tiny_pair();
    let spec = TinySpec {
        seed: 13,
        hidden_size: 96,
        intermediate_size: 160,
        ..TinySpec::new(Architecture::Qwen2)
    };
    let path = trio.dir.path().join("third.gguf");
    write_gguf(&spec, &path, &[GgmlDType::Q8_0, GgmlDType::Q4_0]).unwrap();
    let third = LoadedModel::load(&path, &candle_core::Device::Cpu).unwrap();
    trio.models.push(Arc::new(third));
    let weights = [1.0f64, 1.15, 0.9];

    let mut closest = f64::INFINITY;
    let expected: Vec<Vec<OracleToken>> = prompts()
        .iter()
        .map(|p| {
            let mut tokens = p.clone();
            let mut out = Vec::new();
            for _ in 0..MAX_TOKENS {
                let proposals: Vec<(u32, f64)> = trio
                    .models
                    .iter()
                    .zip(weights)
                    .map(|(m, w)| {
                        let logits = common::oracle::fresh_logits(&m.model, &tokens);
                        (
                            tokenrouter::model::sampler::argmax(&logits),
                            w * max_prob(&logits),
                        )
                    })
                    .collect();
                let mut best = 0;
                for (m, &(_, score)) in proposals.iter().enumerate().skip(1) {
                    closest = closest.min((score - proposals[best].1).abs());
                    if score > proposals[best].1 {
                        best = m;
                    }
                }
                tokens.push(proposals[best].0);
                out.push(OracleToken {
                    token: proposals[best].0,
                    model: best,
                });
            }
            out
        })
        .collect();
    assert!(closest > 1e-5, "a decision within {closest}");
    let winners: std::collections::HashSet<usize> =
        expected.iter().flatten().map(|t| t.model).collect();
    assert!(
        winners.len() >= 2,
        "every position went to one model: {winners:?}"
    );

    let path = trio.dir.path().join("config.toml");
    for mode in ["eager", "sync", "delayed"] {
        let text = format!(
            "[[models]]\nname = \"slm\"\npath = \"slm.gguf\"\n[[models]]\nname = \"llm\"\npath = \"llm.gguf\"\n\
             [[models]]\nname = \"third\"\npath = \"third.gguf\"\n[kv_cache]\nblock_size = 4\n\
             [routing]\nalgorithm = \"ensemble\"\nweights = [1.0, 1.15, 0.9]\n[scheduler]\nmode = \"{mode}\"\n"
        );
        std::fs::write(&path, text).unwrap();
        let config = tokenrouter::config::Config::load(&path).unwrap();
        let got = run_with(&trio, &config);
        for (i, (g, w)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(g, w, "mode {mode}, prompt {i}");
        }
    }
}

#[test]
fn bernoulli_routes_a_seeded_share_alike_in_every_mode() {
    let pair = tiny_pair();
    let routing = "[routing]\nalgorithm = \"bernoulli\"\np = 0.3\nseed = 5\n";
    let runs: Vec<_> = ["eager", "delayed", "sync"]
        .into_iter()
        .map(|mode| (mode, run_all(&pair, routing, mode)))
        .collect();
    let (_, first) = &runs[0];
    for (mode, got) in &runs[1..] {
        assert_eq!(got, first, "mode {mode} routed differently from eager");
    }
    let on = |m: usize| first.iter().flatten().filter(|t| t.model == m).count();
    assert!(
        on(0) > 0 && on(1) > 0,
        "both models must take part: {first:?}"
    );
    // Each token is the greedy choice of the model that produced it, recomputed from nothing.
    for (prompt, tokens) in prompts().iter().zip(first) {
        let mut context = prompt.clone();
        for t in tokens {
            let logits = fresh_logits(&pair.models[t.model].model, &context);
            let gap = common::top2_gap(&logits);
            let best = logits
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(i, _)| i as u32);
            assert_eq!(Some(t.token), best, "after {context:?} (top-2 gap {gap})");
            context.push(t.token);
        }
    }
}

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
