//! The throughput model behind delayed batching, and the threshold optimizer. Pure logic: the
//! inputs are numbers (concurrency, routing probabilities, per-step latencies), the output a
//! predicted throughput per threshold vector.
//!
//! The model is a discrete-time Markov chain observed at batch-completion events. Its state is,
//! per model, the waiting-queue length, the running batch size and the residual time of the
//! running step in a common time quantum. From a state, time advances to the next completion;
//! every request of a completing batch commits a token and moves to another model with its
//! routing probability (a move that drops the sampled token commits nothing); then models
//! launch. The chain is closed: `N` requests are active at all times. Throughput is expected
//! committed tokens per transition over expected time per transition under the stationary
//! distribution.
//!
//! Two kinds of device. Separate devices (GPUs, disjoint core sets): every idle model whose
//! queue holds at least its threshold `B_i` launches; a threshold vector is infeasible when
//! some reachable state leaves every model idle with no queue at its threshold (without a
//! timeout the system would deadlock there). One shared device (`shared_compute`, the models on
//! one CPU): one step at a time, as its executor grants them. When the device frees, the next
//! model after the one that just ran (cyclically: first come, first served) whose queue reached
//! its threshold launches, or, when none has, the next with any queue at all (the executor never
//! idles while a request waits). Steps then add up in time, so each request arriving at a model
//! also costs that model's catch-up extend (`arrival_s`), paid serially on the device; or,
//! where a routed run measured them, every request costs the extends (prompt prefills and
//! catch-ups) it made (`request_s`), spread over the tokens it commits.

mod chain;
pub mod online;

pub use chain::{solve, ChainError, Prediction};

/// What one model's steps cost on a machine, as measured there: the throughput model's input.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepLatencies {
    /// Seconds of one decode step at every batch size `1..` (index 0: batch 1).
    pub decode: Vec<f64>,
    /// Seconds per token of an extend (a catch-up on the tokens produced at another model, or
    /// a prompt's prefill) in a step of many rows (0: not measured).
    #[serde(default)]
    pub extend_token: f64,
}

/// What one step of a single sequence costs a model, by its rows: the price of a
/// verification of `k` drafts (`k + 1` rows) is `step_s + k · row_s`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowCosts {
    /// Seconds of a one-row step (a decode).
    pub step_s: f64,
    /// Seconds each further row adds to that step (an extend's rows past the first).
    pub row_s: f64,
}

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
    /// The models share one device that runs one step at a time (see the module header).
    /// Off: every model has its own device.
    pub shared_compute: bool,
    /// `arrival_s[i]`: seconds model `i` spends catching up on the tokens a request produced
    /// elsewhere, per request arriving there (counted on a shared device only; empty: none).
    pub arrival_s: Vec<f64>,
    /// `extend_s[i]`: seconds per token of an extend on model `i`, for [`Self::with_catch_up`]
    /// (empty: the slope of its step latency over the batch).
    pub extend_s: Vec<f64>,
    /// Device seconds each request costs outside the decode steps and catch-ups (its
    /// prompt's prefill at every model it visits), and the tokens it commits: on a shared
    /// device every committed token also costs `request_s.0 / request_s.1` (none when 0).
    pub request_s: (f64, f64),
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
            arrival_s: Vec::new(),
            extend_s: Vec::new(),
            request_s: (0.0, 0.0),
        }
    }
}

impl ChainInputs {
    /// Sets `arrival_s` for models on one device: a request arriving at a model extends the
    /// tokens its visit elsewhere committed (a geometric run of `1 / p` steps, less a dropped
    /// token), each costing `extend_s` there, or without it what one more row costs in a step
    /// there (the slope of its step latency over the batch).
    pub fn with_catch_up(mut self) -> Self {
        let slope = |l: &[f64]| match l.len() {
            0 => 0.0,
            1 => l[0],
            n => ((l[n - 1] - l[0]) / (n - 1) as f64).max(0.0),
        };
        let visit_tokens = |i: usize| {
            let leave = 1.0 - self.routing[i][i];
            if leave <= 0.0 {
                0.0
            } else {
                (1.0 / leave - f64::from(u8::from(self.drops[i]))).max(0.0)
            }
        };
        let m = self.latency.len();
        // Tokens reaching model j per arrival: those of the visit at the model it came from,
        // weighted by where arrivals at j come from.
        self.arrival_s = (0..m)
            .map(|j| {
                let inflow: Vec<f64> = (0..m)
                    .map(|i| if i == j { 0.0 } else { self.routing[i][j] })
                    .collect();
                let total: f64 = inflow.iter().sum();
                if total <= 0.0 {
                    return 0.0;
                }
                let tokens: f64 = (0..m).map(|i| inflow[i] / total * visit_tokens(i)).sum();
                let per_token = match self.extend_s.get(j) {
                    Some(&s) if s > 0.0 => s,
                    _ => slope(&self.latency[j]),
                };
                tokens * per_token
            })
            .collect();
        self
    }

    /// Sets `request_s` for requests that commit `output_tokens` each and extend (prefill
    /// or catch up, computing tokens they do not sample from) `extend_tokens[i]` tokens at
    /// model `i`, at `extend_s[i]` a token. With the extends a routed run measured, this
    /// replaces [`Self::with_catch_up`]'s estimate; without them, it can add the prompts'
    /// prefills to it.
    pub fn with_extends(mut self, extend_tokens: &[f64], output_tokens: f64) -> Self {
        let at = |v: &[f64], i: usize| v.get(i).copied().unwrap_or(0.0);
        let seconds = (0..self.latency.len())
            .map(|i| at(extend_tokens, i).max(0.0) * at(&self.extend_s, i))
            .sum();
        self.request_s = (seconds, output_tokens);
        self
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
