//! A simulated fleet: the gateway's real policies (and, for exact routing, its real index fed
//! by KV-cache events) in front of N simulated servers, in virtual time, so that policies can
//! be compared on tens of servers from one process.
//!
//! A simulated server batches continuously as the real one does: at each step it admits
//! waiting requests (first come, first served) while its batch has room and its KV cache has
//! the blocks, computes their uncached prompt tokens, and advances every running request by
//! one token. A step takes `decode_base + decode_per_seq × decoding + prefill_per_token ×
//! prefill tokens` ([`LatencyModel`], fitted to `bench-model`'s measurements of the real
//! engine). Its cache ([`cache::BlockCache`]) keys blocks by the same chained hashes and
//! publishes its stores and evictions after every step, which exact routing's index applies.

pub mod cache;
pub mod trace;

use std::cmp::Ordering as CmpOrdering;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;

use super::kv_index::{digest, Applied, KvIndex};
use super::policy::RouteRequest;
use super::policy::{self, CacheAwareSettings, KvAware, KvAwareSettings, Policy, PolicyKind};
use super::workers::{HealthPolicy, InFlight, Worker, WorkerSet};
use cache::BlockCache;
use trace::Trace;

/// Seconds one server's step takes.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct LatencyModel {
    pub prefill_per_token: f64,
    pub decode_base: f64,
    pub decode_per_seq: f64,
}

impl LatencyModel {
    fn step(&self, decoding: usize, prefill_tokens: usize) -> f64 {
        self.decode_base
            + self.decode_per_seq * decoding as f64
            + self.prefill_per_token * prefill_tokens as f64
    }

    /// Fits the model to `bench-model --json` lines (prefill and decode rates per batch
    /// size); `share` is the part of the measured machine one simulated server gets.
    pub fn fit(lines: &str, share: f64) -> anyhow::Result<Self> {
        let mut prefill = Vec::new();
        let mut points = Vec::new();
        for (n, line) in lines
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let v: serde_json::Value = serde_json::from_str(line)
                .map_err(|e| anyhow::anyhow!("bench-model line {}: not JSON ({e})", n + 1))?;
            let field = |k: &str| {
                v[k].as_f64().filter(|x| *x > 0.0).ok_or_else(|| {
                    anyhow::anyhow!("bench-model line {}: no positive \"{k}\"", n + 1)
                })
            };
            let batch = field("batch")?;
            prefill.push(field("prefill_tok_s")?);
            points.push((batch, batch / field("decode_tok_s")?));
        }
        if points.is_empty() {
            anyhow::bail!("no bench-model measurements: run `tokenrouter bench-model --json`");
        }
        // Least squares of step time against batch size; one point gives a flat step.
        let n = points.len() as f64;
        let (mx, my) = (
            points.iter().map(|p| p.0).sum::<f64>() / n,
            points.iter().map(|p| p.1).sum::<f64>() / n,
        );
        let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
        let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        let slope = if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 };
        let base = (my - slope * mx).max(0.0);
        let share = share.clamp(1e-3, 1.0);
        let prefill_rate = prefill.iter().sum::<f64>() / prefill.len() as f64;
        Ok(Self {
            prefill_per_token: 1.0 / prefill_rate / share,
            decode_base: base / share,
            decode_per_seq: slope / share,
        })
    }
}

/// What every simulated server is.
#[derive(Debug, Clone, Copy)]
pub struct ServerShape {
    /// KV blocks of each server's cache.
    pub cache_blocks: usize,
    /// Requests running at once.
    pub max_batch: usize,
    pub latency: LatencyModel,
}

/// One request on a server.
struct Running {
    request: usize,
    /// The prompt's full blocks this request holds a use of (cached ones), and how many
    /// more blocks it holds privately (its tail, its output, duplicates of cached ones).
    shared: Vec<u64>,
    private: usize,
    /// Prompt tokens to compute (0 once prefilled).
    prefill: usize,
    generated: usize,
    _load: InFlight,
}

struct Server {
    cache: BlockCache,
    waiting: VecDeque<(usize, InFlight)>,
    running: Vec<Running>,
    busy: bool,
    busy_time: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Event {
    time: f64,
    /// Arrival of request `index`, or the end of server `index`'s step.
    arrival: bool,
    index: usize,
}

impl Eq for Event {}

impl Ord for Event {
    /// Earliest first (the heap is a max-heap); ties by kind and index, so runs repeat.
    fn cmp(&self, other: &Self) -> CmpOrdering {
        (other.time.total_cmp(&self.time))
            .then(other.arrival.cmp(&self.arrival))
            .then(other.index.cmp(&self.index))
    }
}

impl PartialOrd for Event {
    fn partial_cmp(&self, other: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(other))
    }
}

/// The policies a fleet can be simulated with: the gateway's, and cache-aware routing on the
/// exact index (`cache_aware+exact`, with `exact` settings).
pub fn build_policy(
    name: &str,
    exact: KvAwareSettings,
    seed: u64,
) -> anyhow::Result<Arc<dyn Policy>> {
    if name == "cache_aware+exact" {
        let index = Arc::new(KvIndex::new());
        return Ok(Arc::new(KvAware::new(index, exact)));
    }
    let kind: PolicyKind = name.parse().map_err(|e: String| anyhow::anyhow!(e))?;
    Ok(policy::build(kind, CacheAwareSettings::default(), seed))
}

/// What one simulated run measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FleetResult {
    pub policy: String,
    pub servers: usize,
    pub requests: usize,
    /// Output tokens per second of virtual time, first arrival to last completion.
    pub throughput: f64,
    pub ttft_p50: f64,
    pub ttft_p90: f64,
    pub e2e_p50: f64,
    pub e2e_p90: f64,
    /// Prompt tokens found cached / prompt tokens.
    pub hit_rate: f64,
    /// Busiest server's busy time over the mean.
    pub imbalance: f64,
    /// With an exact index: whether, at the end, it equals every server's cache.
    #[serde(skip)]
    pub index_agrees: Option<bool>,
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// What a run counts as it goes.
struct Counts {
    hit_tokens: usize,
    prompt_tokens: usize,
    output_tokens: usize,
    /// Time of the last completion.
    last: f64,
    /// Per request (NaN until known).
    ttft: Vec<f64>,
    e2e: Vec<f64>,
}

impl Server {
    fn new(shape: &ServerShape) -> Self {
        Self {
            cache: BlockCache::new(shape.cache_blocks),
            waiting: VecDeque::new(),
            running: Vec::new(),
            busy: false,
            busy_time: 0.0,
        }
    }

    /// Admits what fits and starts a step; returns how long it takes (`None`: no work).
    fn start_step(
        &mut self,
        trace: &Trace,
        shape: &ServerShape,
        counts: &mut Counts,
    ) -> Option<f64> {
        let bs = trace.block_size.max(1);
        let mut prefill = 0;
        while self.running.len() < shape.max_batch {
            let Some(&(request, _)) = self.waiting.front() else {
                break;
            };
            let r = &trace.requests[request];
            // Leave at least one token to compute, as the real scheduler does.
            let usable = (r.prompt_tokens - 1) / bs;
            let hit = self.cache.hit(&r.blocks[..usable.min(r.blocks.len())]);
            let total = (r.prompt_tokens + r.output_tokens).div_ceil(bs);
            self.cache.pin(&r.blocks[..hit]);
            if !self.cache.fits(total - hit) {
                self.cache.unpin(&r.blocks[..hit]);
                break;
            }
            self.cache.take(total - hit);
            let (_, load) = self.waiting.pop_front().expect("looked at above");
            let compute = r.prompt_tokens - hit * bs;
            counts.hit_tokens += hit * bs;
            counts.prompt_tokens += r.prompt_tokens;
            prefill += compute;
            self.running.push(Running {
                request,
                shared: r.blocks[..hit].to_vec(),
                private: total - r.blocks.len(),
                prefill: compute,
                generated: 0,
                _load: load,
            });
        }
        self.busy = !self.running.is_empty();
        if !self.busy {
            return None;
        }
        let decoding = self.running.iter().filter(|r| r.prefill == 0).count();
        let took = shape.latency.step(decoding, prefill);
        self.busy_time += took;
        Some(took)
    }

    /// Ends the step at `now`: prefills are done (their blocks indexed), every running
    /// request has one more token, and finished ones give their blocks back.
    fn end_step(&mut self, now: f64, trace: &Trace, counts: &mut Counts) {
        let mut k = 0;
        while k < self.running.len() {
            let run = &mut self.running[k];
            let r = &trace.requests[run.request];
            if run.prefill > 0 {
                run.prefill = 0;
                let new = &r.blocks[run.shared.len()..];
                let stored = self.cache.register(new);
                // A block another request indexed first stays this request's own.
                run.private += new.len() - stored.len();
                run.shared.extend(stored);
                counts.ttft[run.request] = now - r.arrival;
            }
            run.generated += 1;
            if run.generated >= r.output_tokens {
                let run = self.running.swap_remove(k);
                self.cache.unpin(&run.shared);
                self.cache.free(run.private);
                counts.e2e[run.request] = now - r.arrival;
                counts.output_tokens += r.output_tokens;
                counts.last = counts.last.max(now);
                continue;
            }
            k += 1;
        }
        self.busy = false;
    }
}

/// Serves `trace` on `servers` simulated servers behind `policy`.
pub fn simulate(
    trace: &Trace,
    servers: usize,
    shape: ServerShape,
    policy: &Arc<dyn Policy>,
    name: &str,
) -> FleetResult {
    let bs = trace.block_size.max(1);
    let set = WorkerSet::new(HealthPolicy::default());
    let workers: Vec<Arc<Worker>> = (0..servers)
        .map(|i| set.add(&format!("http://sim-{i}"), true))
        .collect();
    let index = policy.kv_index().cloned();
    for w in &workers {
        if let Some(index) = &index {
            index.snapshot(w.id, "sim", 0, &[]);
            index.set_capacity(w.id, shape.cache_blocks);
        }
    }
    let mut fleet: Vec<Server> = (0..servers).map(|_| Server::new(&shape)).collect();
    let mut queue: BinaryHeap<Event> = (trace.requests.iter().enumerate())
        .map(|(index, r)| Event {
            time: r.arrival,
            arrival: true,
            index,
        })
        .collect();
    let n = trace.requests.len();
    let mut counts = Counts {
        hit_tokens: 0,
        prompt_tokens: 0,
        output_tokens: 0,
        last: 0.0,
        ttft: vec![f64::NAN; n],
        e2e: vec![f64::NAN; n],
    };
    while let Some(event) = queue.pop() {
        let now = event.time;
        let s = if event.arrival {
            let r = &trace.requests[event.index];
            // A request larger than any cache is dropped (and counted out): it would wait
            // forever.
            if (r.prompt_tokens + r.output_tokens).div_ceil(bs) > shape.cache_blocks {
                continue;
            }
            let route = RouteRequest {
                text: &r.text,
                blocks: Some(&r.blocks),
                prompt_tokens: r.prompt_tokens,
                block_size: bs,
            };
            let selection = policy.select(&workers, &route);
            let s = selection.index;
            let own = (r.prompt_tokens + r.output_tokens).div_ceil(bs) - r.blocks.len();
            let load = (set.start(&workers[s], own)).holding(selection.pending);
            fleet[s].waiting.push_back((event.index, load));
            if fleet[s].busy {
                continue;
            }
            s
        } else {
            let s = event.index;
            fleet[s].end_step(now, trace, &mut counts);
            if let Some(index) = &index {
                for e in fleet[s].cache.drain_events() {
                    let applied = index.apply(workers[s].id, &e);
                    debug_assert_eq!(applied, Applied::Ok);
                }
            }
            s
        };
        if let Some(took) = fleet[s].start_step(trace, &shape, &mut counts) {
            queue.push(Event {
                time: now + took,
                arrival: false,
                index: s,
            });
        }
    }

    let finished = |v: &[f64]| {
        let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let (t, e) = (finished(&counts.ttft), finished(&counts.e2e));
    let busy: Vec<f64> = fleet.iter().map(|s| s.busy_time).collect();
    let mean = busy.iter().sum::<f64>() / busy.len().max(1) as f64;
    let start = trace.requests.first().map_or(0.0, |r| r.arrival);
    FleetResult {
        policy: name.to_string(),
        servers,
        requests: e.len(),
        throughput: counts.output_tokens as f64 / (counts.last - start).max(1e-9),
        ttft_p50: percentile(&t, 0.5),
        ttft_p90: percentile(&t, 0.9),
        e2e_p50: percentile(&e, 0.5),
        e2e_p90: percentile(&e, 0.9),
        hit_rate: counts.hit_tokens as f64 / counts.prompt_tokens.max(1) as f64,
        imbalance: busy.iter().copied().fold(0.0, f64::max) / mean.max(1e-12),
        index_agrees: index.map(|index| {
            let held = index.workers();
            (fleet.iter().zip(&held)).all(|(s, h)| h.digest == digest(s.cache.held()))
        }),
    }
}

#[cfg(test)]
mod tests;
