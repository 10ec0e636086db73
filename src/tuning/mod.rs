//! The throughput model behind delayed batching, and the threshold optimizer. Pure logic: the
//! inputs are numbers (concurrency, routing probabilities, per-step latencies), the output a
//! predicted throughput per threshold vector.
//!
//! The model is a discrete-time Markov chain observed at batch-completion events. Its state is,
//! per model, the waiting-queue length, the running batch size and the residual time of the
//! running step in a common time quantum. From a state, time advances to the next completion;
//! every request of a completing batch commits a token and moves to another model with its
//! routing probability (a move that drops the sampled token commits nothing); then every idle
//! model whose queue holds at least its threshold `B_i` launches a batch. The chain is closed:
//! `N` requests are active at all times. With `shared_compute` the models share the cores:
//! while `k` models run, each progresses at `1/k` of its solo speed. Throughput is expected committed tokens per transition
//! over expected time per transition under the stationary distribution. A threshold vector is
//! infeasible when some reachable state leaves every model idle with no queue at its threshold:
//! without a timeout the system would deadlock there.

mod chain;
pub mod online;

pub use chain::{solve, ChainError, Prediction};

/// What the chain needs to know about the system.
#[derive(Debug, Clone, PartialEq)]
pub struct ChainInputs {
    /// Requests active at all times (N).
    pub concurrency: usize,
    /// `routing[i][j]`: probability that a request finishing a step on model `i` runs its next
    /// step on model `j` (each row sums to 1).
    pub routing: Vec<Vec<f64>>,
    /// `drops[i]`: a request leaving model `i` drops the token it just sampled (R-Stitch and
    /// the entropy rule drop on the SLM side).
    pub drops: Vec<bool>,
    /// `latency[i][b - 1]`: seconds of one step of model `i` with `b` requests; its length is
    /// the model's largest batch.
    pub latency: Vec<Vec<f64>>,
    /// Time quanta per shortest step; more is finer and slower to solve.
    pub resolution: usize,
    /// The models share one set of cores (a CPU): while `k` of them run, each step progresses
    /// at `1/k` of its solo speed (processor sharing). Off: every model has its own device.
    pub shared_compute: bool,
}

impl ChainInputs {
    /// Two models where the SLM (model 0) hands a request to the LLM (model 1) with
    /// probability `p_up` per step, dropping its token, and the LLM hands back with `p_down`.
    pub fn two_models(concurrency: usize, p_up: f64, p_down: f64, latency: [Vec<f64>; 2]) -> Self {
        Self {
            concurrency,
            routing: vec![vec![1.0 - p_up, p_up], vec![p_down, 1.0 - p_down]],
            drops: vec![true, false],
            latency: latency.to_vec(),
            resolution: 4,
            shared_compute: false,
        }
    }
}

/// A threshold vector and what the chain predicts for it.
pub type Candidate = (Vec<usize>, Result<Prediction, ChainError>);

/// Every candidate threshold vector (`1..=N` per model) with its prediction, and the best
/// feasible one.
pub fn optimize(inputs: &ChainInputs) -> (Vec<Candidate>, Option<Vec<usize>>) {
    let n = inputs.concurrency.max(1);
    let models = inputs.latency.len();
    let mut candidates: Vec<Vec<usize>> = vec![Vec::new()];
    for _ in 0..models {
        candidates = candidates
            .into_iter()
            .flat_map(|c| {
                (1..=n).map(move |b| {
                    let mut c = c.clone();
                    c.push(b);
                    c
                })
            })
            .collect();
    }
    let results: Vec<_> = candidates
        .into_iter()
        .map(|b| {
            let r = solve(inputs, &b);
            (b, r)
        })
        .collect();
    let best = results
        .iter()
        .filter_map(|(b, r)| r.as_ref().ok().map(|p| (b, p.tokens_per_s)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(b, _)| b.clone());
    (results, best)
}
