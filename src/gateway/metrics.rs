//! Gateway metrics: selections, retries, outcomes and the approximate cache-hit rate, plus
//! per-worker load, health and tree size read when `/metrics` is scraped.

use prometheus::{
    Encoder, Gauge, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

use super::policy::Policy;
use super::workers::WorkerSet;

pub struct GatewayMetrics {
    registry: Registry,
    requests: IntCounterVec,
    retries: IntCounterVec,
    matched_chars: IntCounter,
    request_chars: IntCounter,
    queued: IntGauge,
    selections: IntGaugeVec,
    worker_state: IntGaugeVec,
    tree_chars: IntGaugeVec,
    hit_rate: Gauge,
}

impl GatewayMetrics {
    pub fn new() -> prometheus::Result<Self> {
        let registry = Registry::new_custom(Some("tokenrouter_gateway".into()), None)?;
        let m = Self {
            requests: IntCounterVec::new(
                Opts::new(
                    "requests_total",
                    "Requests by outcome (proxied, rejected, failed)",
                ),
                &["outcome"],
            )?,
            retries: IntCounterVec::new(
                Opts::new(
                    "retries_total",
                    "Requests sent again after a worker failed them",
                ),
                &["worker"],
            )?,
            matched_chars: IntCounter::new(
                "cache_matched_total",
                "Routing-text characters (tokens, with exact reports) the chosen worker was believed to hold",
            )?,
            request_chars: IntCounter::new(
                "cache_request_total",
                "Routing-text characters (tokens, with exact reports) of requests routed by a cache-tracking policy",
            )?,
            queued: IntGauge::new("queued_requests", "Requests waiting for a worker with room")?,
            selections: IntGaugeVec::new(
                Opts::new(
                    "worker_selections",
                    "Requests sent to each worker, retries included",
                ),
                &["worker"],
            )?,
            worker_state: IntGaugeVec::new(
                Opts::new(
                    "worker_state",
                    "Per-worker in_flight, healthy and breaker_open",
                ),
                &["worker", "state"],
            )?,
            tree_chars: IntGaugeVec::new(
                Opts::new(
                    "tree_chars",
                    "Routing-text characters held per worker in the prefix tree",
                ),
                &["worker"],
            )?,
            hit_rate: Gauge::new(
                "cache_hit_rate",
                "Approximate prefix-cache hit rate: matched / request characters of routing text",
            )?,
            registry,
        };
        m.registry.register(Box::new(m.hit_rate.clone()))?;
        m.registry.register(Box::new(m.requests.clone()))?;
        m.registry.register(Box::new(m.retries.clone()))?;
        m.registry.register(Box::new(m.matched_chars.clone()))?;
        m.registry.register(Box::new(m.request_chars.clone()))?;
        m.registry.register(Box::new(m.queued.clone()))?;
        m.registry.register(Box::new(m.selections.clone()))?;
        m.registry.register(Box::new(m.worker_state.clone()))?;
        m.registry.register(Box::new(m.tree_chars.clone()))?;
        Ok(m)
    }

    pub fn outcome(&self, outcome: &str) {
        self.requests.with_label_values(&[outcome]).inc();
    }

    pub fn retry(&self, worker: &str) {
        self.retries.with_label_values(&[worker]).inc();
    }

    pub fn cache(&self, matched: usize, total: usize) {
        self.matched_chars.inc_by(matched as u64);
        self.request_chars.inc_by(total as u64);
    }

    /// Matched ÷ request characters so far (0 before any request).
    pub fn cache_hit_rate(&self) -> f64 {
        self.matched_chars.get() as f64 / self.request_chars.get().max(1) as f64
    }

    /// The exposition; `queued` is the number of requests waiting right now.
    pub fn render(&self, workers: &WorkerSet, policy: &dyn Policy, queued: usize) -> String {
        self.queued.set(queued as i64);
        let sizes = policy.tree_sizes();
        self.worker_state.reset();
        self.selections.reset();
        self.tree_chars.reset();
        for w in workers.all() {
            let url = w.url.as_str();
            let set =
                |state: &str, v: i64| self.worker_state.with_label_values(&[url, state]).set(v);
            set("in_flight", w.load() as i64);
            set("healthy", w.is_healthy() as i64);
            set("breaker_open", w.breaker_open() as i64);
            let selected = w.selected.load(std::sync::atomic::Ordering::Relaxed);
            self.selections
                .with_label_values(&[url])
                .set(selected as i64);
            let chars = sizes.iter().find(|(id, _)| *id == w.id).map_or(0, |s| s.1);
            self.tree_chars.with_label_values(&[url]).set(chars as i64);
        }
        self.hit_rate.set(self.cache_hit_rate());
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}
