//! The routing algorithms on the tiny model pair: learned routers (R2R, CITER, Co-LLM) with
//! heads of known weights send exactly the positions an independent f64 re-implementation of
//! the head predicts, and the runtime's output equals the full-recompute oracle in every
//! scheduling mode; query-level routing runs each request wholly on the model its rule picks;
//! the seeded Bernoulli router routes alike in every mode, each token the oracle's.

#[path = "../common/mod.rs"]
mod common;
mod learned;
mod speculative;
mod untrained;

use common::heads::{self, HeadWeights};
use common::oracle::{deferral_greedy, fresh_features, fresh_logits, routed_greedy};
use common::oracle::{OracleToken, Rule};
use common::runtime::{
    collect, config, draft_pair, greedy, prompts, tiny_pair, with_runtime, Pair,
};
use tokenrouter::actors::{RequestEvent, Runtime};
use tokenrouter::routing::head::{HeadConfig, HeadKind, RouterHead};

const MAX_TOKENS: usize = 16;

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
