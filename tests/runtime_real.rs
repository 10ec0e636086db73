//! The actor runtime on the shipped pair (Qwen2.5-Coder 0.5B + 1.5B, quantized as fetched): with
//! R-Stitch, 64 greedy tokens routed across both models equal the full-recompute oracle, and
//! both models really produced tokens; with speculative decoding, 64 greedy tokens on each of
//! three prompts are exactly the LLM's own, recomputed from nothing, most of them drafts the
//! SLM made and the LLM accepted.

mod common;

use std::sync::Arc;

use common::oracle::{routed_greedy, OracleToken, Rule};
use common::*;
use tokenrouter::actors::{GenerateRequest, Prompt, Runtime};
use tokenrouter::config::Config;
use tokenrouter::model::runner::{logits_row, score_text};
use tokenrouter::model::{LoadedModel, SamplingParams};

/// The shipped pair, loaded, and a config over it routed by the `[routing]` keys `routing`.
fn real_pair(routing: &str) -> (Config, Arc<LoadedModel>, Arc<LoadedModel>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.toml");
    let text = format!(
        "[[models]]\nname = \"slm\"\npath = {:?}\n[[models]]\nname = \"llm\"\npath = {:?}\n\
         [routing]\n{routing}\n[memory]\nkv_budget_mb = 64\n",
        real_model(QWEN_05B),
        real_model(QWEN_15B)
    );
    std::fs::write(&path, text).unwrap();
    let config = Config::load(&path).unwrap();
    let slm = Arc::new(load(&real_model(QWEN_05B)));
    let llm = Arc::new(load(&real_model(QWEN_15B)));
    (config, slm, llm)
}

#[test]
fn rstitch_on_the_real_pair_equals_the_full_recompute_oracle_for_64_tokens() {
    let (high, low) = (0.6, 0.3);
    let (config, slm, llm) = real_pair(&format!(
        "algorithm = \"r-stitch\"\nhigh = {high}\nlow = {low}"
    ));
    let prompt = slm
        .encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
        .unwrap();
    let max_tokens = 64;
    let want = routed_greedy(
        [&slm.model, &llm.model],
        Rule::RStitch { high, low },
        &prompt,
        max_tokens,
        &[],
    );
    let mut request = GenerateRequest::new(
        Prompt::Tokens(prompt.clone()),
        SamplingParams::greedy(),
        max_tokens,
    );
    request.ignore_eos = true;
    let mut got = Vec::new();
    Runtime::run(&config, vec![slm.clone(), llm.clone()], async |runtime| {
        let summary = runtime.submit(request).finish(|_, tokens| {
            got.extend(
                tokens
                    .iter()
                    .map(|&(token, model)| OracleToken { token, model }),
            )
        });
        summary.await.unwrap().unwrap();
        let stats = runtime.stats().await;
        assert!(
            stats.iter().all(|s| s.free_blocks == s.total_blocks),
            "{stats:?}"
        );
    })
    .unwrap();
    let per_model = |m| got.iter().filter(|t| t.model == m).count();
    assert!(
        per_model(0) > 0 && per_model(1) > 0,
        "both models must take part: {got:?}"
    );
    assert_eq!(
        got, want.tokens,
        "closest entropy call {}, closest top-2 tie {}",
        want.closest_call, want.closest_tie
    );
}

#[test]
fn speculative_decoding_on_the_real_pair_gives_the_llms_own_64_tokens() {
    let (config, slm, llm) = real_pair("algorithm = \"speculative\"\ndraft_tokens = 4");
    let max_tokens = 64;
    let prompts: Vec<Vec<u32>> = [
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        PROMPTS[0],
        "import json\n\ndef load_config(path):\n",
    ]
    .iter()
    .map(|t| llm.encode(t).unwrap())
    .collect();
    let mut got: Vec<Vec<OracleToken>> = vec![Vec::new(); prompts.len()];
    Runtime::run(&config, vec![slm.clone(), llm.clone()], async |runtime| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let mut request = GenerateRequest::new(
                    Prompt::Tokens(p.clone()),
                    SamplingParams::greedy(),
                    max_tokens,
                );
                request.ignore_eos = true;
                runtime.submit(request)
            })
            .collect();
        for (handle, out) in handles.into_iter().zip(got.iter_mut()) {
            let summary = handle.finish(|_, tokens| {
                out.extend(
                    tokens
                        .iter()
                        .map(|&(token, model)| OracleToken { token, model }),
                )
            });
            let s = summary.await.unwrap().unwrap();
            assert!(s.speculation.verifications > 0, "{s:?}");
        }
        let stats = runtime.stats().await;
        assert!(
            stats.iter().all(|s| s.free_blocks == s.total_blocks),
            "{stats:?}"
        );
    })
    .unwrap();
    // The oracle: one teacher-forced pass over each prompt and its output, whose logits at
    // every position are what the LLM alone computes there from nothing.
    for (prompt, tokens) in prompts.iter().zip(&got) {
        assert_eq!(tokens.len(), max_tokens);
        let mut text = prompt.clone();
        text.extend(tokens.iter().map(|t| t.token));
        let logits = score_text(&llm.model, &text).unwrap().logits;
        for (i, t) in tokens.iter().enumerate() {
            let row = logits_row(&logits, prompt.len() - 1 + i).unwrap();
            assert_eq!(
                t.token,
                tokenrouter::model::sampler::argmax(&row),
                "position {i}: not the LLM's own token (top-2 gap {})",
                top2_gap(&row)
            );
        }
    }
    let accepted = got.iter().flatten().filter(|t| t.model == 0).count();
    assert!(
        accepted > got.iter().flatten().count() / 2,
        "most tokens should be accepted drafts: {accepted}"
    );
}
