//! Building the reachable chain for one threshold vector and solving it.

use std::collections::HashMap;

use super::ChainInputs;

#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// Committed tokens per second in the steady state.
    pub tokens_per_s: f64,
    /// Reachable states of the chain.
    pub states: usize,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ChainError {
    #[error("thresholds {thresholds:?} can deadlock: with queues {queues:?} no model launches")]
    Deadlock {
        thresholds: Vec<usize>,
        queues: Vec<usize>,
    },
    #[error("the chain has more than {0} states; lower the resolution or the concurrency")]
    TooLarge(usize),
    #[error("invalid throughput-model inputs: {0}")]
    Invalid(String),
}

const MAX_STATES: usize = 400_000;

/// Per model `[queue, batch, residual quanta]`, flattened; on a shared device followed by the
/// model that launched last.
type State = Vec<u16>;

/// One transition: probability, next state, tokens committed, time taken (seconds).
type Edge = (f64, State, f64, f64);

struct Chain<'a> {
    inputs: &'a ChainInputs,
    thresholds: Vec<u16>,
    quantum: f64,
}

/// Predicted throughput of the system under `thresholds` (one per model).
pub fn solve(inputs: &ChainInputs, thresholds: &[usize]) -> Result<Prediction, ChainError> {
    let chain = Chain::new(inputs, thresholds)?;
    let extra = usize::from(inputs.shared_compute);
    let mut start = vec![0u16; 3 * inputs.latency.len() + extra];
    start[0] = inputs.concurrency as u16;
    chain.launch(&mut start)?;
    let (edges, reward, time) = chain.explore(start)?;
    let pi = stationary(&edges);
    let tokens: f64 = pi.iter().zip(&reward).map(|(p, r)| p * r).sum();
    let seconds: f64 = pi.iter().zip(&time).map(|(p, t)| p * t).sum();
    Ok(Prediction {
        tokens_per_s: tokens / seconds.max(f64::MIN_POSITIVE),
        states: edges.len(),
    })
}

impl<'a> Chain<'a> {
    fn new(inputs: &'a ChainInputs, thresholds: &[usize]) -> Result<Self, ChainError> {
        let m = inputs.latency.len();
        let bad = |why: String| Err(ChainError::Invalid(why));
        if m == 0 || inputs.routing.len() != m || inputs.drops.len() != m || thresholds.len() != m {
            return bad(format!(
                "{m} latency tables, {} routing rows, {} drop flags, {} thresholds",
                inputs.routing.len(),
                inputs.drops.len(),
                thresholds.len()
            ));
        }
        if inputs.concurrency == 0 || inputs.concurrency > u16::MAX as usize {
            return bad("concurrency must be at least 1".into());
        }
        for (i, row) in inputs.routing.iter().enumerate() {
            let sum: f64 = row.iter().sum();
            if row.len() != m
                || row.iter().any(|p| !(0.0..=1.0).contains(p))
                || (sum - 1.0).abs() > 1e-9
            {
                return bad(format!(
                    "routing row {i} must hold {m} probabilities summing to 1"
                ));
            }
        }
        let steps = inputs.latency.iter().flatten();
        if inputs.latency.iter().any(Vec::is_empty)
            || steps.clone().any(|l| l.is_nan() || *l <= 0.0)
        {
            return bad("every model needs positive step latencies for batch 1 and up".into());
        }
        if !inputs.arrival_s.is_empty()
            && (inputs.arrival_s.len() != m
                || inputs.arrival_s.iter().any(|a| a.is_nan() || *a < 0.0))
        {
            return bad(format!("arrival_s needs {m} non-negative seconds"));
        }
        let (start_s, per_request) = inputs.request_s;
        if !(start_s >= 0.0 && per_request >= 0.0 && start_s.is_finite()) {
            return bad("request_s needs non-negative seconds and tokens".into());
        }
        let shortest = steps.copied().fold(f64::INFINITY, f64::min);
        let n = inputs.concurrency;
        Ok(Self {
            inputs,
            thresholds: thresholds.iter().map(|&b| b.clamp(1, n) as u16).collect(),
            quantum: shortest / inputs.resolution.max(1) as f64,
        })
    }

    fn models(&self) -> usize {
        self.inputs.latency.len()
    }

    /// Device seconds of the requests' prompt prefills per committed token (shared device).
    fn prompt_s_per_token(&self) -> f64 {
        match self.inputs.request_s {
            (s, tokens) if self.inputs.shared_compute && tokens > 0.0 => s / tokens,
            _ => 0.0,
        }
    }

    fn quanta(&self, model: usize, batch: u16) -> u16 {
        let l = self.inputs.latency[model][batch as usize - 1];
        (l / self.quantum).round().clamp(1.0, u16::MAX as f64) as u16
    }

    /// Model `i` launches a batch of its queue (up to its largest batch).
    fn start(&self, s: &mut State, i: usize) {
        let batch = s[3 * i].min(self.inputs.latency[i].len() as u16);
        s[3 * i] -= batch;
        s[3 * i + 1] = batch;
        s[3 * i + 2] = self.quanta(i, batch);
    }

    /// On a shared device: when it is free, the next model after the last to launch whose
    /// queue reached its threshold launches, else the next with any queue.
    fn launch_exclusive(&self, s: &mut State) -> Result<(), ChainError> {
        let m = self.models();
        if (0..m).any(|i| s[3 * i + 1] > 0) {
            return Ok(());
        }
        let last = s[3 * m] as usize;
        let order = || (1..=m).map(move |k| (last + k) % m);
        let pick = order()
            .find(|&i| s[3 * i] > 0 && s[3 * i] >= self.thresholds[i])
            .or_else(|| order().find(|&i| s[3 * i] > 0));
        let Some(i) = pick else {
            return Err(ChainError::Invalid("no request is active".into()));
        };
        self.start(s, i);
        s[3 * m] = i as u16;
        Ok(())
    }

    /// Every idle model whose queue reached its threshold launches (up to its largest batch).
    fn launch(&self, s: &mut State) -> Result<(), ChainError> {
        if self.inputs.shared_compute {
            return self.launch_exclusive(s);
        }
        for i in 0..self.models() {
            let (q, b) = (s[3 * i], s[3 * i + 1]);
            if b == 0 && q > 0 && q >= self.thresholds[i] {
                self.start(s, i);
            }
        }
        if (0..self.models()).all(|i| s[3 * i + 1] == 0) {
            return Err(ChainError::Deadlock {
                thresholds: self.thresholds.iter().map(|&t| t as usize).collect(),
                queues: (0..self.models()).map(|i| s[3 * i] as usize).collect(),
            });
        }
        Ok(())
    }

    /// The transitions out of `s`: advance to the next completion, route the completing
    /// batches, launch.
    fn transitions(&self, s: &State) -> Result<Vec<Edge>, ChainError> {
        let m = self.models();
        let running = (0..m).filter(|&i| s[3 * i + 1] > 0);
        let t = running
            .clone()
            .map(|i| s[3 * i + 2])
            .min()
            .expect("launch() leaves one running");
        let mut base = s.clone();
        // (probability, arrivals per model, tokens, seconds)
        type Outcome = (f64, Vec<u16>, f64, f64);
        let mut outcomes: Vec<Outcome> = vec![(1.0, vec![0; m], 0.0, 0.0)];
        for i in running {
            base[3 * i + 2] -= t;
            if base[3 * i + 2] > 0 {
                continue;
            }
            let batch = base[3 * i + 1];
            base[3 * i + 1] = 0;
            // On a shared device the step is the only one running: its whole latency passes,
            // exactly, and so do the catch-up extends of the requests it sends away.
            let own = if self.inputs.shared_compute {
                self.inputs.latency[i][batch as usize - 1]
            } else {
                0.0
            };
            let mut next = Vec::new();
            for (p, split) in splits(batch, &self.inputs.routing[i]) {
                let moved = batch - split[i];
                let tokens = batch as f64
                    - if self.inputs.drops[i] {
                        moved as f64
                    } else {
                        0.0
                    };
                let catch_up: f64 = if self.inputs.shared_compute {
                    (0..m)
                        .filter(|&j| j != i)
                        .map(|j| split[j] as f64 * self.inputs.arrival_s.get(j).unwrap_or(&0.0))
                        .sum()
                } else {
                    0.0
                };
                for (q, arrivals, r, sec) in &outcomes {
                    let mut a = arrivals.clone();
                    a.iter_mut().zip(&split).for_each(|(x, y)| *x += y);
                    let prompts = tokens * self.prompt_s_per_token();
                    next.push((q * p, a, r + tokens, sec + own + catch_up + prompts));
                }
            }
            outcomes = next;
        }
        let elapsed = if self.inputs.shared_compute {
            0.0
        } else {
            t as f64 * self.quantum
        };
        outcomes
            .into_iter()
            .map(|(p, arrivals, tokens, seconds)| {
                let mut n = base.clone();
                for (i, a) in arrivals.iter().enumerate() {
                    n[3 * i] += a;
                }
                self.launch(&mut n)?;
                Ok((p, n, tokens, elapsed + seconds))
            })
            .collect()
    }

    /// Breadth-first search of the reachable states: per state its out-edges (to state
    /// indices), expected tokens and expected time.
    #[allow(clippy::type_complexity)]
    fn explore(
        &self,
        start: State,
    ) -> Result<(Vec<Vec<(usize, f64)>>, Vec<f64>, Vec<f64>), ChainError> {
        let mut index: HashMap<State, usize> = HashMap::new();
        let mut order = vec![start.clone()];
        index.insert(start, 0);
        let (mut edges, mut reward, mut time) = (Vec::new(), Vec::new(), Vec::new());
        let mut k = 0;
        while k < order.len() {
            let mut out: Vec<(usize, f64)> = Vec::new();
            let (mut r, mut t) = (0.0, 0.0);
            for (p, next, tokens, seconds) in self.transitions(&order[k])? {
                r += p * tokens;
                t += p * seconds;
                let j = *index.entry(next.clone()).or_insert_with(|| {
                    order.push(next);
                    order.len() - 1
                });
                match out.iter_mut().find(|(x, _)| *x == j) {
                    Some(e) => e.1 += p,
                    None => out.push((j, p)),
                }
            }
            if order.len() > MAX_STATES {
                return Err(ChainError::TooLarge(MAX_STATES));
            }
            edges.push(out);
            reward.push(r);
            time.push(t);
            k += 1;
        }
        Ok((edges, reward, time))
    }
}

/// Every way `batch` requests split over the destinations of `row`, with its multinomial
/// probability (zero-probability splits left out).
fn splits(batch: u16, row: &[f64]) -> Vec<(f64, Vec<u16>)> {
    fn rec(
        left: u16,
        row: &[f64],
        at: usize,
        cur: &mut Vec<u16>,
        p: f64,
        out: &mut Vec<(f64, Vec<u16>)>,
    ) {
        if at + 1 == row.len() {
            let p = p * row[at].powi(left as i32);
            if p > 0.0 {
                cur.push(left);
                out.push((p, cur.clone()));
                cur.pop();
            }
            return;
        }
        for k in 0..=left {
            let q = p * binomial(left, k) * row[at].powi(k as i32);
            if q == 0.0 {
                continue;
            }
            cur.push(k);
            rec(left - k, row, at + 1, cur, q, out);
            cur.pop();
        }
    }
    let mut out = Vec::new();
    rec(batch, row, 0, &mut Vec::new(), 1.0, &mut out);
    out
}

fn binomial(n: u16, k: u16) -> f64 {
    (0..k).fold(1.0, |acc, i| acc * (n - i) as f64 / (i + 1) as f64)
}

/// Stationary distribution by Gauss–Seidel sweeps over the incoming edges.
fn stationary(edges: &[Vec<(usize, f64)>]) -> Vec<f64> {
    let n = edges.len();
    let mut incoming: Vec<Vec<(usize, f64)>> = vec![Vec::new(); n];
    let mut stay = vec![0.0; n];
    for (i, out) in edges.iter().enumerate() {
        for &(j, p) in out {
            if i == j {
                stay[i] += p;
            } else {
                incoming[j].push((i, p));
            }
        }
    }
    let mut pi = vec![1.0 / n as f64; n];
    for _ in 0..20_000 {
        let mut change = 0.0;
        for j in 0..n {
            let inflow: f64 = incoming[j].iter().map(|&(i, p)| pi[i] * p).sum();
            let v = if stay[j] < 1.0 {
                inflow / (1.0 - stay[j])
            } else {
                pi[j]
            };
            change += (v - pi[j]).abs();
            pi[j] = v;
        }
        let total: f64 = pi.iter().sum();
        pi.iter_mut().for_each(|x| *x /= total);
        if change / total < 1e-12 {
            break;
        }
    }
    pi
}

#[cfg(test)]
mod tests;
