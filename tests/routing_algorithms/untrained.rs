//! Routers with no trained head: query-level routing, the multi-model ensemble and the
//! seeded Bernoulli router.

use super::*;

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
