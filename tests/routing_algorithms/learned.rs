//! Learned routers (R2R, CITER, Co-LLM): heads of known weights route exactly where an
//! independent f64 re-implementation says, and `train-router` writes heads that serve.

use super::*;

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
