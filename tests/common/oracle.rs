//! The routing oracle: runs the models one token at a time from scratch (a fresh KV cache and a
//! full prefill for every token, so no KV is ever reused) and applies a routing rule written
//! here independently of `src/routing/`. Token-routed output of the runtime must equal it.

use tokenrouter::model::runner::{logits_row, step, Sequence};
use tokenrouter::model::sampler::argmax;
use tokenrouter::model::{KvCache, Model};
use tokenrouter::scheduler::BlockPool;

/// A two-model rule over the next-token entropy (nats); the SLM is model 0, the LLM model 1.
#[derive(Debug, Clone, Copy)]
pub enum Rule {
    /// SLM → LLM above `threshold`, dropping the token; the LLM returns after one token.
    Entropy { threshold: f32 },
    /// SLM → LLM above `high` (token dropped), LLM → SLM below `low` (token kept).
    RStitch { high: f32, low: f32 },
}

/// One generated token, the model that produced it, and that model's entropy there.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OracleToken {
    pub token: u32,
    pub model: usize,
}

/// Entropy of softmax(logits) in nats, in f64.
pub fn entropy(logits: &[f32]) -> f32 {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = logits.iter().map(|&x| (x as f64 - m).exp()).sum();
    let mut h = 0.0;
    for &x in logits {
        let p = (x as f64 - m).exp() / z;
        if p > 0.0 {
            h -= p * p.ln();
        }
    }
    h as f32
}

/// Greedy next-token logits of `model` for `context`, recomputed from nothing.
pub fn fresh_logits(model: &Model, context: &[u32]) -> Vec<f32> {
    let mut kv =
        KvCache::with_capacity(model.config(), 16, context.len(), super::kv_dtype()).unwrap();
    let pool = BlockPool::new(kv.num_blocks());
    let mut seq = Sequence::new(context.to_vec());
    let out = step(model, &mut kv, &pool, &mut [&mut seq], false).unwrap();
    logits_row(&out.logits, 0).unwrap()
}

/// Every entropy the oracle saw, per model, and the closest any came to a threshold.
#[derive(Debug, Default)]
pub struct OracleTrace {
    pub tokens: Vec<OracleToken>,
    /// Smallest |entropy − threshold| over the decisions taken.
    pub closest_call: f32,
    /// Smallest gap between the top two logits over the tokens kept.
    pub closest_tie: f32,
}

/// Greedy token-routed generation by full recomputation.
pub fn routed_greedy(
    models: [&Model; 2],
    rule: Rule,
    prompt: &[u32],
    max_tokens: usize,
    stop_ids: &[u32],
) -> OracleTrace {
    let mut tokens = prompt.to_vec();
    let mut trace = OracleTrace {
        closest_call: f32::INFINITY,
        closest_tie: f32::INFINITY,
        ..OracleTrace::default()
    };
    let mut model = 0;
    while trace.tokens.len() < max_tokens {
        let logits = fresh_logits(models[model], &tokens);
        let token = argmax(&logits);
        let h = entropy(&logits);
        trace.closest_tie = trace.closest_tie.min(super::top2_gap(&logits));
        let (next, keep) = match (rule, model) {
            (Rule::Entropy { threshold }, 0) => {
                trace.closest_call = trace.closest_call.min((h - threshold).abs());
                if h > threshold {
                    (1, false)
                } else {
                    (0, true)
                }
            }
            (Rule::Entropy { .. }, _) => (0, true),
            (Rule::RStitch { high, .. }, 0) => {
                trace.closest_call = trace.closest_call.min((h - high).abs());
                if h > high {
                    (1, false)
                } else {
                    (0, true)
                }
            }
            (Rule::RStitch { low, .. }, _) => {
                trace.closest_call = trace.closest_call.min((h - low).abs());
                if h < low {
                    (0, true)
                } else {
                    (1, true)
                }
            }
        };
        if keep {
            tokens.push(token);
            trace.tokens.push(OracleToken { token, model });
            if stop_ids.contains(&token) {
                break;
            }
        }
        model = next;
    }
    trace
}

/// Entropies of a model's own greedy continuation (to place thresholds where routing happens).
pub fn greedy_entropies(model: &Model, prompt: &[u32], n: usize) -> Vec<f32> {
    let mut tokens = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..n {
        let logits = fresh_logits(model, &tokens);
        out.push(entropy(&logits));
        tokens.push(argmax(&logits));
    }
    out
}

/// The `q`-quantile of `values`.
pub fn quantile(values: &[f32], q: f32) -> f32 {
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f32 * q).round() as usize]
}

/// What a learned router head reads at one SLM position, recomputed from nothing.
#[derive(Debug, Clone)]
pub struct TokenFeatures {
    /// The final normalised hidden state at the last position.
    pub hidden: Vec<f32>,
    /// Input embedding of the greedy token.
    pub embedding: Vec<f32>,
    /// All logits, largest first.
    pub sorted_logits: Vec<f32>,
}

/// Greedy token, logits and head features of `model` after `context`, from a fresh cache.
pub fn fresh_features(model: &Model, context: &[u32]) -> (u32, Vec<f32>, TokenFeatures) {
    let mut kv =
        KvCache::with_capacity(model.config(), 16, context.len(), super::kv_dtype()).unwrap();
    let pool = BlockPool::new(kv.num_blocks());
    let mut seq = Sequence::new(context.to_vec());
    let out = step(model, &mut kv, &pool, &mut [&mut seq], true).unwrap();
    let logits = logits_row(&out.logits, 0).unwrap();
    let hidden = out
        .hidden
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let token = argmax(&logits);
    let mut sorted_logits = logits.clone();
    sorted_logits.sort_by(|a, b| b.total_cmp(a));
    let embedding = model.embed(&[token]).unwrap();
    let features = TokenFeatures {
        hidden,
        embedding,
        sorted_logits,
    };
    (token, logits, features)
}

/// Greedy token-level deferral by full recomputation: at every SLM position `score` rates the
/// features and `defers(score)` sends that position to the LLM (the SLM's token dropped), which
/// produces one token and hands back. Also returns every score the SLM produced.
pub fn deferral_greedy(
    models: [&Model; 2],
    score: &dyn Fn(&TokenFeatures) -> f32,
    defers: &dyn Fn(f32) -> bool,
    prompt: &[u32],
    max_tokens: usize,
) -> (Vec<OracleToken>, Vec<f32>) {
    let mut tokens = prompt.to_vec();
    let (mut out, mut scores) = (Vec::new(), Vec::new());
    while out.len() < max_tokens {
        let (token, _, features) = fresh_features(models[0], &tokens);
        let s = score(&features);
        scores.push(s);
        let (token, model) = if defers(s) {
            (argmax(&fresh_logits(models[1], &tokens)), 1)
        } else {
            (token, 0)
        };
        tokens.push(token);
        out.push(OracleToken { token, model });
    }
    (out, scores)
}
