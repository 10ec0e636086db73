//! Prometheus metrics: request outcomes, latency histograms, tokens per model, handoffs, and
//! per-model runtime state (KV blocks, queues, batch sizes, delayed-batching thresholds) read
//! from the model actors when `/metrics` is scraped.

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

use crate::actors::worker::WorkerStats;
use crate::actors::RequestEvent;

pub struct Metrics {
    registry: Registry,
    names: Vec<String>,
    requests: IntCounterVec,
    ttft: Histogram,
    inter_token: Histogram,
    e2e: Histogram,
    tokens: IntCounterVec,
    handoffs: IntCounter,
    drafted: IntCounter,
    accepted: IntCounter,
    verifications: IntCounter,
    pub active: IntGauge,
    model_state: IntGaugeVec,
    model_totals: IntGaugeVec,
    batch_size: prometheus::GaugeVec,
    link: IntGaugeVec,
    link_rtt: prometheus::GaugeVec,
}

const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

impl Metrics {
    pub fn new(names: Vec<String>) -> prometheus::Result<Self> {
        let registry = Registry::new_custom(Some("tokenrouter".into()), None)?;
        let histogram = |name: &str, help: &str| {
            Histogram::with_opts(HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()))
        };
        let m = Self {
            requests: IntCounterVec::new(
                Opts::new("requests_total", "Requests by outcome"),
                &["outcome"],
            )?,
            ttft: histogram("time_to_first_token_seconds", "Time to first token")?,
            inter_token: histogram("inter_token_seconds", "Mean time between output tokens, per request")?,
            e2e: histogram("e2e_request_seconds", "End-to-end request time")?,
            tokens: IntCounterVec::new(
                Opts::new("generated_tokens_total", "Output tokens by the model that produced them"),
                &["model"],
            )?,
            handoffs: IntCounter::new("handoffs_total", "Requests moved between models")?,
            drafted: IntCounter::new(
                "spec_drafted_tokens_total",
                "Speculative decoding: drafted tokens verified",
            )?,
            accepted: IntCounter::new(
                "spec_accepted_tokens_total",
                "Speculative decoding: drafted tokens accepted",
            )?,
            verifications: IntCounter::new(
                "spec_verifications_total",
                "Speculative decoding: verification passes",
            )?,
            active: IntGauge::new("active_requests", "Requests admitted and not ended")?,
            model_state: IntGaugeVec::new(
                Opts::new("model_state", "Per-model runtime state (kv_blocks_free, kv_blocks_used, kv_blocks_cached, requests_ready, requests_pending, batch_threshold, active_estimate)"),
                &["model", "state"],
            )?,
            model_totals: IntGaugeVec::new(
                Opts::new("model_counters", "Per-model running totals (steps, preemptions, prefix_hit_tokens, prefix_lookup_tokens, handoffs_out)"),
                &["model", "counter"],
            )?,
            batch_size: prometheus::GaugeVec::new(
                Opts::new("mean_batch_size", "Requests per forward pass, averaged since start"),
                &["model"],
            )?,
            link: IntGaugeVec::new(
                Opts::new("link", "Per remote model, its link to the subserver (up, frames_in, frames_out, bytes_in, bytes_out, reconnects)"),
                &["model", "counter"],
            )?,
            link_rtt: prometheus::GaugeVec::new(
                Opts::new("link_rtt_seconds", "Per remote model, the last heartbeat's round trip"),
                &["model"],
            )?,
            registry,
            names,
        };
        m.registry.register(Box::new(m.requests.clone()))?;
        m.registry.register(Box::new(m.ttft.clone()))?;
        m.registry.register(Box::new(m.inter_token.clone()))?;
        m.registry.register(Box::new(m.e2e.clone()))?;
        m.registry.register(Box::new(m.tokens.clone()))?;
        m.registry.register(Box::new(m.handoffs.clone()))?;
        m.registry.register(Box::new(m.drafted.clone()))?;
        m.registry.register(Box::new(m.accepted.clone()))?;
        m.registry.register(Box::new(m.verifications.clone()))?;
        m.registry.register(Box::new(m.active.clone()))?;
        m.registry.register(Box::new(m.model_state.clone()))?;
        m.registry.register(Box::new(m.model_totals.clone()))?;
        m.registry.register(Box::new(m.batch_size.clone()))?;
        m.registry.register(Box::new(m.link.clone()))?;
        m.registry.register(Box::new(m.link_rtt.clone()))?;
        Ok(m)
    }

    pub fn observe_event(&self, event: &RequestEvent) {
        match event {
            RequestEvent::Finished(s) => {
                self.requests.with_label_values(&["finished"]).inc();
                if let Some(ttft) = s.ttft {
                    self.ttft.observe(ttft.as_secs_f64());
                    if s.completion_tokens > 1 {
                        let rest = (s.e2e - ttft).as_secs_f64();
                        self.inter_token
                            .observe(rest / (s.completion_tokens - 1) as f64);
                    }
                }
                self.e2e.observe(s.e2e.as_secs_f64());
                for (name, &n) in self.names.iter().zip(&s.tokens_per_model) {
                    self.tokens.with_label_values(&[name]).inc_by(n as u64);
                }
                self.handoffs.inc_by(s.handoffs as u64);
                self.drafted.inc_by(s.speculation.drafted.into());
                self.accepted.inc_by(s.speculation.accepted.into());
                self.verifications
                    .inc_by(s.speculation.verifications.into());
            }
            RequestEvent::Failed(_) => self.requests.with_label_values(&["failed"]).inc(),
            RequestEvent::Cancelled => self.observe_cancelled(),
            _ => {}
        }
    }

    pub fn observe_cancelled(&self) {
        self.requests.with_label_values(&["cancelled"]).inc();
    }

    /// A request refused before it reached the runtime (bad input, overload).
    pub fn observe_rejected(&self) {
        self.requests.with_label_values(&["rejected"]).inc();
    }

    /// The text exposition, with per-model state taken from `stats` (in model order).
    pub fn render(&self, stats: &[WorkerStats]) -> String {
        for (s, name) in stats.iter().zip(&self.names) {
            let set =
                |state: &str, v: i64| self.model_state.with_label_values(&[name, state]).set(v);
            set("kv_blocks_free", s.free_blocks as i64);
            set("kv_blocks_used", (s.total_blocks - s.free_blocks) as i64);
            set("kv_blocks_cached", s.cached_blocks as i64);
            set("requests_ready", s.ready as i64);
            set("requests_pending", s.pending as i64);
            set("batch_threshold", s.threshold as i64);
            set("active_estimate", s.active_estimate);
            let total = |c: &str, v: u64| {
                self.model_totals
                    .with_label_values(&[name, c])
                    .set(v as i64)
            };
            total("steps", s.steps);
            total("preemptions", s.preemptions);
            total("prefix_hit_tokens", s.prefix_hit_tokens);
            total("prefix_lookup_tokens", s.prefix_lookup_tokens);
            total("handoffs_out", s.handoffs_out);
            let mean = s.batched_requests as f64 / s.steps.max(1) as f64;
            self.batch_size.with_label_values(&[name]).set(mean);
            if let Some(l) = &s.link {
                let set = |c: &str, v: u64| self.link.with_label_values(&[name, c]).set(v as i64);
                set("up", l.up.into());
                set("frames_in", l.frames_in);
                set("frames_out", l.frames_out);
                set("bytes_in", l.bytes_in);
                set("bytes_out", l.bytes_out);
                set("reconnects", l.reconnects);
                self.link_rtt
                    .with_label_values(&[name])
                    .set(l.rtt_us as f64 * 1e-6);
            }
        }
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}
