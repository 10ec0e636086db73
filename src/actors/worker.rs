//! One model's serving state and its step, as a plain struct: the model actor only delivers
//! messages to it and the peer messages it queues. Owns the KV cache, the scheduler, the
//! requests present here (running or pending) and the co-located routing function.
//!
//! Guarantees: a request removed here (finished, failed, aborted, or whose listener is gone)
//! gives back all its blocks and is remembered for a while, so a handoff still in flight for it
//! is dropped instead of leaking; only the request's home model counts it in the active-request
//! estimate, once in and once out. Peers learn that a request ended from its request actor
//! alone (one abort each, whoever ended it), so a model that ends a request tells no peer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::messages::{
    Handoff, LinkStats, PeerBody, PeerMessage, RequestMeta, TokenEvent, Tombstones,
};
use crate::kernels::routing_features::{entropy_rows, max_prob_rows, top_logits_rows};
use crate::model::runner::FinishReason;
use crate::model::{Distribution, KvCache, KvDtype, LoadedModel, Sampler, SeqInput};
use crate::routing::{
    Arrival, BatchFeatures, Candidate, ModelIndex, Resume, Route, RoutingAlgorithm, Speculation,
    StepView,
};
use crate::scheduler::{
    DelayedBatching, Known, LaunchPolicy, LockStep, Plan, PublishedPrefixes, ReadyQueue, RequestId,
    Scheduler, SchedulerLimits, StepAsk,
};
use crate::tuning::online::{LatencyProfile, OnlineThresholds, OperatingPoint};

/// What a worker asks its device for: steps by its own launch policy, or in lock-step with its
/// peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stepping {
    Async(LaunchPolicy),
    Sync,
}

pub struct WorkerSetup {
    pub index: ModelIndex,
    pub name: String,
    pub num_models: usize,
    pub model: Arc<LoadedModel>,
    pub router: Arc<dyn RoutingAlgorithm>,
    pub limits: SchedulerLimits,
    /// What the model's KV cache stores.
    pub kv_dtype: KvDtype,
    pub stepping: Stepping,
    /// Cleared when a forward pass panics, so the server can report the model unhealthy.
    pub healthy: Arc<AtomicBool>,
    /// Where the cached prefixes are published after each step.
    pub prefixes: Arc<PublishedPrefixes>,
    /// Thresholds re-solved online by the throughput model (`thresholds = "auto"`).
    pub online: Option<OnlineThresholds>,
}

/// Counters a model reports (for tests, logs and metrics).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WorkerStats {
    pub name: String,
    pub total_blocks: usize,
    /// Free blocks, cached-but-unused ones included.
    pub free_blocks: usize,
    pub cached_blocks: usize,
    /// Tokens whose K/V came from the prefix cache instead of being computed.
    pub prefix_hit_tokens: u64,
    /// Tokens of the requests that looked up the prefix cache.
    pub prefix_lookup_tokens: u64,
    /// Requests with state here, running or pending.
    pub requests: usize,
    /// Requests with work to do here (the queue a step draws from).
    pub ready: usize,
    /// Requests away at a peer, keeping their blocks here.
    pub pending: usize,
    pub steps: u64,
    pub batched_requests: u64,
    /// Tokens computed without sampling from them: prompt prefills and catch-up extends, all
    /// but the last (sampled) token of each.
    pub extend_tokens: u64,
    pub tokens_committed: u64,
    pub handoffs_out: u64,
    /// Aborts received: one per request that ended after its submission, whoever ended it.
    pub releases: u64,
    pub preemptions: u64,
    pub active_estimate: i64,
    /// The delayed-batching threshold in force.
    pub threshold: usize,
    /// Operating points the online tuner has solved.
    pub tuned_points: usize,
    /// The link to the subserver computing the model, if it is remote.
    pub link: Option<LinkStats>,
}

struct Local {
    meta: Arc<RequestMeta>,
    /// Committed tokens, then `drafts` drafted ones.
    tokens: Vec<u32>,
    sampler: Sampler,
    tokens_here: usize,
    /// A peer's best proposal for the next position, until the next routing decision.
    carried: Option<Candidate>,
    /// Trailing tokens that are drafts (speculative decoding): drafted here and away for
    /// verification, or brought here to verify.
    drafts: usize,
    /// The model that drafted them.
    drafter: ModelIndex,
    /// The distributions they were drawn from (sampling with temperature > 0 only).
    dists: Vec<Distribution>,
    speculation: Speculation,
}

impl Local {
    /// The tokens as the scheduler holds them: drafts brought here are verified, so the
    /// step that reaches them returns the logits of every one and of the position after.
    fn known(&self, here: ModelIndex) -> Known<'_> {
        let verify = self.drafts > 0 && self.drafter != here;
        Known {
            tokens: &self.tokens,
            drafts: self.drafts,
            logits: if verify { self.drafts + 1 } else { 1 },
        }
    }

    /// Output tokens committed so far.
    fn generated(&self) -> usize {
        self.tokens.len() - self.drafts - self.meta.prompt_len
    }
}

impl Local {
    /// Takes what a handoff from `from` brings: the tokens, drafts and carried proposal.
    fn arrive(&mut self, handoff: Handoff, from: ModelIndex) {
        self.tokens = handoff.tokens;
        self.tokens_here = 0;
        self.carried = handoff.carried;
        self.drafts = handoff.drafts;
        self.drafter = from;
        self.dists = handoff.dists;
        self.speculation = handoff.speculation;
    }
}

const TOMBSTONES: usize = 8192;
const COUNTER_FLUSH: Duration = Duration::from_millis(50);

pub struct ModelWorker {
    index: ModelIndex,
    name: String,
    model: Arc<LoadedModel>,
    router: Arc<dyn RoutingAlgorithm>,
    kv: KvCache,
    sched: Scheduler,
    stepping: Stepping,
    lockstep: LockStep,
    requests: HashMap<RequestId, Local>,
    ended: Tombstones,
    max_len: usize,
    active: i64,
    unsent: Vec<i64>,
    last_sent: Vec<Instant>,
    outbox: Vec<(ModelIndex, PeerMessage)>,
    /// Requests handed to each model since the last [`ModelWorker::take_handed`].
    handed: Vec<usize>,
    stats: WorkerStats,
    healthy: Arc<AtomicBool>,
    prefixes: Arc<PublishedPrefixes>,
    /// Test hook: a forward pass over this token id panics (`TOKENROUTER_FAILPOINT_TOKEN`, in
    /// a build with the `failpoints` feature).
    #[cfg(feature = "failpoints")]
    failpoint: Option<u32>,
    online: Option<OnlineThresholds>,
    /// The operating point being solved off-thread, if any.
    solving: Option<OperatingPoint>,
}

impl ModelWorker {
    pub fn new(setup: WorkerSetup) -> crate::model::Result<Self> {
        let config = setup.model.model.config();
        let limits = setup.limits;
        let kv =
            setup
                .model
                .model
                .kv_cache(limits.block_size, limits.num_blocks, setup.kv_dtype)?;
        let max_len = config
            .context_length
            .min(limits.num_blocks * limits.block_size);
        let now = Instant::now();
        Ok(Self {
            index: setup.index,
            stats: WorkerStats {
                name: setup.name.clone(),
                total_blocks: limits.num_blocks,
                ..WorkerStats::default()
            },
            name: setup.name,
            router: setup.router,
            kv,
            sched: Scheduler::new(limits),
            stepping: setup.stepping,
            lockstep: LockStep::new(setup.num_models, setup.index),
            requests: HashMap::new(),
            ended: Tombstones::new(TOMBSTONES),
            max_len,
            active: 0,
            unsent: vec![0; setup.num_models],
            last_sent: vec![now; setup.num_models],
            outbox: Vec::new(),
            handed: vec![0; setup.num_models],
            healthy: setup.healthy,
            prefixes: setup.prefixes,
            online: setup.online,
            solving: None,
            #[cfg(feature = "failpoints")]
            failpoint: std::env::var("TOKENROUTER_FAILPOINT_TOKEN")
                .ok()
                .and_then(|v| v.parse().ok()),
            model: setup.model,
        })
    }

    fn mark_unhealthy(&self) {
        self.healthy.store(false, Ordering::Release);
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Longest sequence a request may reach here.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// A new request whose first model is this one.
    pub fn submit(&mut self, meta: Arc<RequestMeta>, prompt: Vec<u32>, now: Instant) {
        if meta.home == self.index {
            self.count_active(1);
        }
        let handoff = Handoff {
            meta,
            tokens: prompt,
            carried: None,
            drafts: 0,
            dists: Vec::new(),
            speculation: Speculation::default(),
        };
        self.admit(handoff, self.index, now);
    }

    /// A request arriving from a peer: extend a pending one, or admit it on its first visit.
    pub fn handoff(&mut self, from: ModelIndex, mut handoff: Handoff, now: Instant) {
        let id = handoff.meta.id;
        if self.ended.contains(&id) {
            return;
        }
        // Drafts past this model's length limit are dropped: they are only proposals, and a
        // verifier computes every one it holds.
        let over = (handoff.tokens.len().saturating_sub(self.max_len)).min(handoff.drafts);
        if over > 0 {
            handoff.tokens.truncate(handoff.tokens.len() - over);
            handoff.drafts -= over;
            handoff.dists.truncate(handoff.drafts);
        }
        let Some(local) = self.requests.get_mut(&id) else {
            return self.admit(handoff, from, now);
        };
        // Only a peer in another process can get this wrong; the request cannot go on.
        if handoff.tokens.len().saturating_sub(handoff.drafts) < local.meta.prompt_len {
            local.meta.sink.send(TokenEvent::Failed {
                message: format!(
                    "model {from} handed over {} tokens of a request whose prompt has {}",
                    handoff.tokens.len(),
                    local.meta.prompt_len
                ),
            });
            return self.end(id);
        }
        // What this model holds beyond the common prefix (its drafts that were rejected) is
        // taken back.
        let common = local
            .tokens
            .iter()
            .zip(&handoff.tokens)
            .take_while(|(a, b)| a == b)
            .count();
        if common < local.tokens.len() {
            self.sched.rollback(id, common);
        }
        let cached = self.sched.computed(id);
        let arrival = Arrival {
            from,
            to: self.index,
            cached,
            total: handoff.tokens.len(),
        };
        let recompute = self.router.receive(&arrival) == Resume::Recompute;
        local.arrive(handoff, from);
        self.sched
            .resume(id, local.known(self.index), recompute, now);
    }

    /// Admits a request on its first visit here, from `from` (this model for a new one).
    fn admit(&mut self, handoff: Handoff, from: ModelIndex, now: Instant) {
        let meta = &handoff.meta;
        let committed = handoff.tokens.len() - handoff.drafts;
        let sampler = match Sampler::on_stream(meta.params.clone(), self.index as u64) {
            Ok(s) => s,
            Err(e) => {
                meta.sink.send(TokenEvent::Failed {
                    message: e.to_string(),
                });
                return self.end(meta.id);
            }
        };
        if committed == 0 || committed >= self.max_len {
            meta.sink.send(TokenEvent::Failed {
                message: format!(
                    "the sequence has {} tokens; model '{}' holds 1 to {}",
                    committed,
                    self.name,
                    self.max_len - 1
                ),
            });
            return self.end(meta.id);
        }
        let mut local = Local {
            meta: meta.clone(),
            tokens: Vec::new(),
            sampler,
            tokens_here: 0,
            carried: None,
            drafts: 0,
            drafter: from,
            dists: Vec::new(),
            speculation: Speculation::default(),
        };
        local.arrive(handoff, from);
        self.sched.add(local.meta.id, local.known(self.index), now);
        self.requests.insert(local.meta.id, local);
    }

    /// The request actor ended the request (whoever ended it first).
    pub fn abort(&mut self, id: RequestId) {
        self.stats.releases += 1;
        self.end(id);
    }

    /// Drops every trace of `id` here.
    fn end(&mut self, id: RequestId) {
        if let Some(local) = self.requests.remove(&id) {
            self.sched.finish(id);
            if local.meta.home == self.index {
                self.count_active(-1);
            }
        }
        self.ended.insert(id);
    }

    pub fn peer_message(&mut self, msg: PeerMessage, now: Instant) {
        self.active += msg.active_delta;
        if let (Some(online), Some(p)) = (self.online.as_mut(), msg.route_prob) {
            online.set_peer_p(p);
        }
        match msg.body {
            PeerBody::Handoff(h) => self.handoff(msg.from, h, now),
            PeerBody::RoundDone(round) => self.lockstep.peer_finished(msg.from, round),
            PeerBody::Counters => {}
        }
    }

    fn peers(&self) -> impl Iterator<Item = ModelIndex> {
        let me = self.index;
        (0..self.unsent.len()).filter(move |&p| p != me)
    }

    fn send(&mut self, to: ModelIndex, body: PeerBody) {
        let active_delta = std::mem::take(&mut self.unsent[to]);
        self.last_sent[to] = Instant::now();
        self.outbox.push((
            to,
            PeerMessage {
                from: self.index,
                to,
                active_delta,
                route_prob: self.online.as_ref().map(OnlineThresholds::own_p),
                body,
            },
        ));
    }

    fn count_active(&mut self, delta: i64) {
        self.active += delta;
        for p in self.peers() {
            self.unsent[p] += delta;
        }
    }

    /// Peer messages queued since the last call; counters that found no message to ride on
    /// for a while (or at all, when this model is idle) get one of their own.
    pub fn take_outbox(&mut self, idle: bool) -> Vec<(ModelIndex, PeerMessage)> {
        for p in self.peers() {
            if self.unsent[p] != 0 && (idle || self.last_sent[p].elapsed() >= COUNTER_FLUSH) {
                self.send(p, PeerBody::Counters);
            }
        }
        std::mem::take(&mut self.outbox)
    }

    /// The step this model asks its device for, having waited since `since`; `None` when it
    /// has nothing to compute (or, in lock-step, must wait for its peers' round).
    pub fn step_ask(&self, since: Instant) -> Option<StepAsk> {
        let (ready, oldest) = self.sched.ready();
        let queue = ReadyQueue {
            ready,
            oldest,
            active: self.active.max(0) as usize,
        };
        match self.stepping {
            Stepping::Async(LaunchPolicy::Delayed(d)) => {
                let threshold = self.online.as_ref().map_or(d.threshold, |o| o.current());
                LaunchPolicy::Delayed(DelayedBatching { threshold, ..d }).ask(queue, since)
            }
            Stepping::Async(policy) => policy.ask(queue, since),
            Stepping::Sync if self.lockstep.may_start(ready > 0) => {
                LaunchPolicy::Eager.ask(queue, since)
            }
            Stepping::Sync => None,
        }
    }

    /// Lock-step only: this model has nothing to compute but a peer moved a round ahead, so
    /// it takes part with an empty round (no compute, no device step).
    pub fn empty_round_due(&self) -> bool {
        self.stepping == Stepping::Sync
            && self.sched.ready().0 == 0
            && self.lockstep.may_start(false)
    }

    /// Requests handed to each model (by index) since the last call.
    pub fn take_handed(&mut self) -> Vec<usize> {
        let zero = vec![0; self.handed.len()];
        std::mem::replace(&mut self.handed, zero)
    }

    /// Online thresholds: moves to the solution for the current operating point; returns a
    /// point (and the profile) to solve off-thread when none is cached and none is in flight.
    pub fn retune(&mut self) -> Option<(OperatingPoint, Arc<LatencyProfile>)> {
        let active = self.active.max(1) as usize;
        let online = self.online.as_mut()?;
        let point = online.point(active);
        if online.update(point) || self.solving.is_some() {
            return None;
        }
        self.solving = Some(point);
        Some((point, online.profile().clone()))
    }

    /// An off-thread solution arrived.
    pub fn solved(&mut self, point: OperatingPoint, best: (usize, usize)) {
        self.solving = None;
        if let Some(online) = self.online.as_mut() {
            online.insert(point, best);
        }
    }

    /// The delayed-batching threshold in force (1 when launching eagerly).
    pub fn threshold(&self) -> usize {
        match (self.stepping, &self.online) {
            (Stepping::Async(LaunchPolicy::Delayed(_)), Some(o)) => o.current(),
            (Stepping::Async(LaunchPolicy::Delayed(d)), None) => d.threshold,
            _ => 1,
        }
    }

    pub fn stats(&self) -> WorkerStats {
        let s = self.sched.stats();
        WorkerStats {
            free_blocks: s.free_blocks,
            cached_blocks: s.cached_blocks,
            prefix_hit_tokens: s.prefix_hit_tokens,
            prefix_lookup_tokens: s.prefix_lookup_tokens,
            requests: self.requests.len(),
            ready: s.ready,
            pending: s.away,
            preemptions: s.preemptions,
            active_estimate: self.active,
            threshold: self.threshold(),
            tuned_points: self
                .online
                .as_ref()
                .map_or(0, OnlineThresholds::solved_points),
            ..self.stats.clone()
        }
    }
}

mod step;
