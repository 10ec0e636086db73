//! Batch planning for one model: continuous batching, chunked prefill under a per-step token
//! budget, extends for requests handed back by a peer, KV block accounting and preemption.
//! Pure logic over numbers: no tensors, no actors.
//!
//! The contract follows vLLM's: [`Scheduler::add`] / [`Scheduler::resume`] bring work in,
//! [`Scheduler::schedule`] returns a [`Plan`] (which requests compute how many tokens, which were
//! preempted), and the caller reports back with [`Scheduler::advance`] and, per sampled request,
//! [`Scheduler::commit`], [`Scheduler::leave`] or [`Scheduler::finish`].
//!
//! Guarantees: the blocks the plan accounts for never exceed the pool, so the caller's KV
//! reservations cannot fail; a request away at a peer ("pending") keeps its blocks until memory
//! runs short, then it is preempted first; when blocks run out the newest requests are preempted
//! (their blocks freed, their prefix recomputed later), never the one being planned for an older
//! request. A request that fits the pool on its own always makes progress.

mod launch;
mod lockstep;

use std::collections::HashMap;
use std::time::Instant;

pub use launch::{DelayedBatching, Launch, LaunchPolicy};
pub use lockstep::LockStep;

pub type RequestId = u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerLimits {
    pub block_size: usize,
    pub num_blocks: usize,
    pub max_batch_tokens: usize,
    pub max_batch_requests: usize,
}

/// One request's share of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanItem {
    pub id: RequestId,
    /// First position computed in this step.
    pub start: usize,
    pub num_tokens: usize,
    /// The step computes the request's last known token, so its logits are sampled.
    pub samples: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub items: Vec<PlanItem>,
    /// Requests whose blocks were taken back; the caller releases their KV.
    pub preempted: Vec<RequestId>,
}

#[derive(Debug, Clone)]
struct Entry {
    /// Tokens known here.
    len: usize,
    /// Tokens whose K/V are in the cache.
    computed: usize,
    blocks: usize,
    away: bool,
    ready_since: Instant,
    /// Admission order: lower is older and goes first.
    arrival: u64,
}

impl Entry {
    fn ready(&self) -> bool {
        !self.away && self.computed < self.len
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub ready: usize,
    pub away: usize,
    pub free_blocks: usize,
    pub preemptions: u64,
}

pub struct Scheduler {
    limits: SchedulerLimits,
    free_blocks: usize,
    entries: HashMap<RequestId, Entry>,
    next_arrival: u64,
    preemptions: u64,
}

impl Scheduler {
    pub fn new(limits: SchedulerLimits) -> Self {
        Self {
            free_blocks: limits.num_blocks,
            limits,
            entries: HashMap::new(),
            next_arrival: 0,
            preemptions: 0,
        }
    }

    /// Tokens a single request may hold here: the whole pool.
    pub fn capacity_tokens(&self) -> usize {
        self.limits.num_blocks * self.limits.block_size
    }

    pub fn contains(&self, id: RequestId) -> bool {
        self.entries.contains_key(&id)
    }

    /// A request seen here for the first time, with `len` known tokens, none computed.
    pub fn add(&mut self, id: RequestId, len: usize, now: Instant) {
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        let entry = Entry {
            len,
            computed: 0,
            blocks: 0,
            away: false,
            ready_since: now,
            arrival,
        };
        if let Some(old) = self.entries.insert(id, entry) {
            self.free_blocks += old.blocks;
        }
    }

    /// A pending request comes back with `len` tokens; with `recompute` its cached prefix is
    /// dropped and prefilled again.
    pub fn resume(&mut self, id: RequestId, len: usize, recompute: bool, now: Instant) {
        let Some(e) = self.entries.get_mut(&id) else {
            return self.add(id, len, now);
        };
        if recompute || len < e.computed {
            self.free_blocks += e.blocks;
            e.blocks = 0;
            e.computed = 0;
        }
        e.len = len;
        e.away = false;
        e.ready_since = now;
    }

    /// Tokens already computed for `id` here (0 when unknown).
    pub fn computed(&self, id: RequestId) -> usize {
        self.entries.get(&id).map_or(0, |e| e.computed)
    }

    /// Plans one step: decodes first, then extends and prefill chunks in arrival order, within
    /// the token and request budgets, preempting newer requests when blocks run out.
    pub fn schedule(&mut self) -> Plan {
        let mut candidates: Vec<(bool, u64, RequestId)> = self
            .entries
            .iter()
            .filter(|(_, e)| e.ready())
            .map(|(&id, e)| (e.len - e.computed > 1, e.arrival, id))
            .collect();
        candidates.sort_unstable();
        let mut plan = Plan::default();
        let mut budget = self.limits.max_batch_tokens;
        for (_, _, id) in candidates {
            if budget == 0 || plan.items.len() == self.limits.max_batch_requests {
                break;
            }
            let e = &self.entries[&id];
            if !e.ready() {
                continue;
            }
            let want = (e.len - e.computed).min(budget);
            let Some(n) = self.fit(id, want, &mut plan) else {
                continue;
            };
            let e = self.entries.get_mut(&id).expect("candidate exists");
            let blocks = (e.computed + n).div_ceil(self.limits.block_size);
            self.free_blocks -= blocks - e.blocks;
            e.blocks = blocks;
            budget -= n;
            plan.items.push(PlanItem {
                id,
                start: e.computed,
                num_tokens: n,
                samples: e.computed + n == e.len,
            });
        }
        plan
    }

    /// How many of `want` tokens `id` can compute, preempting lower-priority requests for
    /// blocks as needed; `None` when not even one fits.
    fn fit(&mut self, id: RequestId, want: usize, plan: &mut Plan) -> Option<usize> {
        let bs = self.limits.block_size;
        loop {
            let e = &self.entries[&id];
            let held = e.blocks + self.free_blocks;
            if (e.computed + want).div_ceil(bs) <= held {
                return Some(want);
            }
            match self.victim(id, plan) {
                Some(victim) => self.preempt(victim, plan),
                None => {
                    let e = &self.entries[&id];
                    let fits = (held * bs).saturating_sub(e.computed).min(want);
                    return (fits > 0).then_some(fits);
                }
            }
        }
    }

    /// A request whose blocks may be taken for `id`: pending ones first, then ready ones that
    /// arrived after `id`; newest first; never one already in the plan.
    fn victim(&self, id: RequestId, plan: &Plan) -> Option<RequestId> {
        let arrival = self.entries[&id].arrival;
        let planned = |v: &RequestId| plan.items.iter().any(|it| it.id == *v);
        self.entries
            .iter()
            .filter(|(v, e)| **v != id && e.blocks > 0 && !planned(v))
            .filter(|(_, e)| e.away || e.arrival > arrival)
            .max_by_key(|(_, e)| (e.away, e.arrival))
            .map(|(&v, _)| v)
    }

    fn preempt(&mut self, id: RequestId, plan: &mut Plan) {
        let e = self.entries.get_mut(&id).expect("victim exists");
        self.free_blocks += e.blocks;
        e.blocks = 0;
        e.computed = 0;
        self.preemptions += 1;
        plan.preempted.push(id);
    }

    /// The plan ran: every item's tokens are now in the cache.
    pub fn advance(&mut self, plan: &Plan) {
        for item in &plan.items {
            if let Some(e) = self.entries.get_mut(&item.id) {
                e.computed = item.start + item.num_tokens;
            }
        }
    }

    /// `id` committed its sampled token here and stays: ready for the next decode.
    pub fn commit(&mut self, id: RequestId, now: Instant) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.len += 1;
            e.ready_since = now;
        }
    }

    /// `id` moves to a peer and stays pending here with its blocks; `kept_token` says whether
    /// the sampled token was committed here first.
    pub fn leave(&mut self, id: RequestId, kept_token: bool) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.len += kept_token as usize;
            e.away = true;
        }
    }

    /// `id` is done here (finished, aborted or failed): its blocks return to the pool.
    pub fn finish(&mut self, id: RequestId) {
        if let Some(e) = self.entries.remove(&id) {
            self.free_blocks += e.blocks;
        }
    }

    /// Requests ready here and when the longest-waiting of them became ready.
    pub fn ready(&self) -> (usize, Option<Instant>) {
        let ready = self.entries.values().filter(|e| e.ready());
        let (n, oldest) = ready.fold((0, None::<Instant>), |(n, o), e| {
            (
                n + 1,
                Some(o.map_or(e.ready_since, |o| o.min(e.ready_since))),
            )
        });
        (n.min(self.limits.max_batch_requests), oldest)
    }

    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            ready: self.entries.values().filter(|e| e.ready()).count(),
            away: self.entries.values().filter(|e| e.away).count(),
            free_blocks: self.free_blocks,
            preemptions: self.preemptions,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests;
