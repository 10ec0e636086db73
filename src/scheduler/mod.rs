//! Batch planning for one model: continuous batching, chunked prefill under a per-step token
//! budget, extends for requests handed back by a peer, KV block accounting and preemption.
//! Pure logic over numbers: no tensors, no actors.
//!
//! The contract follows vLLM's: [`Scheduler::add`] / [`Scheduler::resume`] bring work in,
//! [`Scheduler::schedule`] returns a [`Plan`] (which requests compute how many tokens, which were
//! preempted), and the caller reports back with [`Scheduler::advance`] and, per sampled request,
//! [`Scheduler::commit`], [`Scheduler::leave`] or [`Scheduler::finish`].
//!
//! The scheduler owns the model's KV block ids ([`BlockPool`], with prefix caching): a request
//! starting from nothing (new, preempted or recomputing) first takes the longest cached prefix
//! of its tokens and computes only the rest; [`Scheduler::blocks`] gives the caller the ids to
//! read and write.
//!
//! Guarantees: a plan never needs more blocks than the pool holds; a request away at a peer
//! ("pending") keeps its blocks until memory runs short, then it is preempted first; when blocks
//! run out the newest requests are preempted (their blocks released, their prefix recomputed
//! later, cheaply when still cached), never the one being planned for an older request. A
//! request that fits the pool on its own always makes progress.

mod block_pool;
mod executor;
mod launch;
mod lockstep;
mod published;

use std::collections::HashMap;
use std::time::Instant;

pub use block_pool::{
    chain_hash, hash_check, BlockPool, Blocks, OutOfBlocks, PrefixChange, PrefixHash,
};
pub use executor::{Admission, Decision, DeviceQueue, StepAsk};
pub use launch::{DelayedBatching, LaunchPolicy, ReadyQueue};
pub use lockstep::LockStep;
pub use published::PublishedPrefixes;

pub type RequestId = u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerLimits {
    pub block_size: usize,
    pub num_blocks: usize,
    pub max_batch_tokens: usize,
    pub max_batch_requests: usize,
}

/// A sequence's known tokens as a model holds them. The last `drafts` are proposed, not
/// committed (speculative decoding): computed like the others, never indexed as a cached
/// prefix, and taken back with [`Scheduler::rollback`] when rejected. `logits`: how many of
/// the last positions the step that reaches the end returns logits for (1, or `drafts + 1` to
/// verify the drafts); a chunk never ends inside them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Known<'a> {
    pub tokens: &'a [u32],
    pub drafts: usize,
    pub logits: usize,
}

impl<'a> From<&'a [u32]> for Known<'a> {
    fn from(tokens: &'a [u32]) -> Self {
        Self {
            tokens,
            drafts: 0,
            logits: 1,
        }
    }
}

impl<'a, const N: usize> From<&'a [u32; N]> for Known<'a> {
    fn from(tokens: &'a [u32; N]) -> Self {
        Self::from(tokens.as_slice())
    }
}

impl<'a> From<&'a Vec<u32>> for Known<'a> {
    fn from(tokens: &'a Vec<u32>) -> Self {
        Self::from(tokens.as_slice())
    }
}

/// One request's share of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanItem {
    pub id: RequestId,
    /// First position computed in this step.
    pub start: usize,
    pub num_tokens: usize,
    /// How many of the last positions computed give logits to sample from: 0 unless the step
    /// reaches the request's last known token (then the `logits` its [`Known`] asked for).
    pub logits: usize,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub items: Vec<PlanItem>,
    /// Requests whose blocks were taken back; the caller releases their KV.
    pub preempted: Vec<RequestId>,
}

#[derive(Debug)]
struct Entry {
    /// Tokens known here.
    len: usize,
    /// Logits rows wanted when the last known token is computed.
    logits: usize,
    /// Tokens whose K/V are in the cache.
    computed: usize,
    blocks: Blocks,
    /// Prefix hash of every full block of the known tokens.
    hashes: Vec<PrefixHash>,
    /// Leading blocks already offered to the prefix index.
    registered: usize,
    away: bool,
    /// When the current visit began (admission or the return from a peer): delayed batching
    /// holds a request at most its longest wait per visit, not per step.
    visit_since: Instant,
    /// Admission order: lower is older and goes first.
    arrival: u64,
}

impl Entry {
    fn ready(&self) -> bool {
        !self.away && self.computed < self.len
    }

    /// Takes the sequence's tokens as they are now (they only grow, but for drafts taken back
    /// with [`Scheduler::rollback`] first).
    fn set_tokens(&mut self, known: Known, block_size: usize) {
        let tokens = known.tokens;
        self.len = tokens.len();
        self.logits = known.logits.clamp(1, tokens.len().max(1));
        let committed = tokens.len() - known.drafts.min(tokens.len());
        while self.hashes.len() < committed / block_size {
            let i = self.hashes.len();
            let block = &tokens[i * block_size..(i + 1) * block_size];
            self.hashes
                .push(chain_hash(self.hashes.last().copied(), block));
        }
    }

    /// Drops the K/V from position `pos` on, with the blocks past it. A kept block that the
    /// prefix index holds is never written again: it goes back whole and its kept part is
    /// computed again.
    fn forget_from(&mut self, pos: usize, block_size: usize) {
        let mut computed = self.computed.min(pos);
        if !computed.is_multiple_of(block_size) && computed / block_size < self.registered {
            computed -= computed % block_size;
        }
        self.computed = computed;
        self.registered = self.registered.min(computed / block_size);
        self.blocks.truncate(computed.div_ceil(block_size));
    }

    /// How many tokens the next chunk computes with at most `limit`: all the rest, or a
    /// chunk that ends before the positions whose logits are wanted (`None` when no such
    /// chunk is left, as all of them must be computed in one step).
    fn chunk(&self, limit: usize) -> Option<usize> {
        let rest = self.len - self.computed;
        if rest <= limit {
            return (rest > 0).then_some(rest);
        }
        let before_logits = (self.len - self.logits).saturating_sub(self.computed);
        let n = limit.min(before_logits);
        (n > 0).then_some(n)
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub ready: usize,
    pub away: usize,
    /// Free plus cached-but-unused blocks.
    pub free_blocks: usize,
    pub cached_blocks: usize,
    pub preemptions: u64,
    /// Prompt and recompute tokens served from the prefix cache instead of computed.
    pub prefix_hit_tokens: u64,
    /// Tokens of the requests that looked up the prefix cache (the hit rate's denominator).
    pub prefix_lookup_tokens: u64,
}

pub struct Scheduler {
    limits: SchedulerLimits,
    pool: BlockPool,
    entries: HashMap<RequestId, Entry>,
    next_arrival: u64,
    preemptions: u64,
    prefix_hit_tokens: u64,
    prefix_lookup_tokens: u64,
}

impl Scheduler {
    pub fn new(limits: SchedulerLimits) -> Self {
        Self {
            pool: BlockPool::new(limits.num_blocks),
            limits,
            entries: HashMap::new(),
            next_arrival: 0,
            preemptions: 0,
            prefix_hit_tokens: 0,
            prefix_lookup_tokens: 0,
        }
    }

    /// Publishes the cached prefixes when they changed since the last publication.
    pub fn publish_prefixes(&self, to: &PublishedPrefixes) {
        to.publish(&self.pool);
    }

    /// Tokens a single request may hold here: the whole pool.
    pub fn capacity_tokens(&self) -> usize {
        self.limits.num_blocks * self.limits.block_size
    }

    pub fn contains(&self, id: RequestId) -> bool {
        self.entries.contains_key(&id)
    }

    /// A request seen here for the first time, with its known tokens, none computed.
    pub fn add<'a>(&mut self, id: RequestId, tokens: impl Into<Known<'a>>, now: Instant) {
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        let mut entry = Entry {
            len: 0,
            logits: 1,
            computed: 0,
            blocks: Blocks::default(),
            hashes: Vec::new(),
            registered: 0,
            away: false,
            visit_since: now,
            arrival,
        };
        entry.set_tokens(tokens.into(), self.limits.block_size);
        // A request added again starts over: its old blocks go back to the pool.
        self.entries.insert(id, entry);
    }

    /// A pending request comes back with its tokens now; with `recompute` its cached prefix
    /// is dropped and computed again.
    pub fn resume<'a>(
        &mut self,
        id: RequestId,
        tokens: impl Into<Known<'a>>,
        recompute: bool,
        now: Instant,
    ) {
        let known = tokens.into();
        let Some(e) = self.entries.get_mut(&id) else {
            return self.add(id, known, now);
        };
        if recompute || known.tokens.len() < e.computed {
            e.computed = 0;
            e.registered = 0;
            e.blocks.clear();
        }
        e.set_tokens(known, self.limits.block_size);
        // A request arriving samples here, so its last token is computed (again, if a peer
        // took back what this model had computed past it).
        if e.computed >= e.len && e.len > 0 {
            e.forget_from(e.len - 1, self.limits.block_size);
        }
        e.away = false;
        e.visit_since = now;
    }

    /// Takes back every known token of `id` from position `keep` on (rejected drafts): their
    /// K/V are dropped and the blocks past the kept positions return to the pool. A kept
    /// block that the prefix index holds is never written again: it goes back whole and its
    /// kept part is computed again.
    pub fn rollback(&mut self, id: RequestId, keep: usize) {
        let bs = self.limits.block_size;
        let Some(e) = self.entries.get_mut(&id) else {
            return;
        };
        e.len = e.len.min(keep);
        e.hashes.truncate(e.len / bs);
        e.forget_from(keep, bs);
    }

    /// The KV block ids holding `id`'s positions, in order.
    pub fn blocks(&self, id: RequestId) -> &[u32] {
        self.entries.get(&id).map_or(&[], |e| e.blocks.ids())
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
            self.reuse_cached_prefix(id);
            let e = &self.entries[&id];
            if !e.ready() {
                continue;
            }
            let Some(want) = e.chunk(budget) else {
                continue;
            };
            let Some(fits) = self.fit(id, want, &mut plan) else {
                continue;
            };
            let e = self.entries.get_mut(&id).expect("candidate exists");
            let Some(n) = e.chunk(fits) else {
                continue;
            };
            let needed = (e.computed + n).div_ceil(self.limits.block_size);
            self.pool
                .grow(&mut e.blocks, needed)
                .expect("fit() checked availability");
            budget -= n;
            plan.items.push(PlanItem {
                id,
                start: e.computed,
                num_tokens: n,
                logits: if e.computed + n == e.len { e.logits } else { 0 },
            });
        }
        plan
    }

    /// A request starting from nothing takes the longest cached prefix of its tokens, leaving
    /// the tokens whose logits it needs to compute.
    fn reuse_cached_prefix(&mut self, id: RequestId) {
        let e = self.entries.get_mut(&id).expect("candidate exists");
        if e.computed > 0 || !e.blocks.is_empty() || e.len == 0 {
            return;
        }
        let usable = ((e.len - e.logits) / self.limits.block_size).min(e.hashes.len());
        e.blocks = self.pool.lookup(&e.hashes[..usable]);
        e.registered = e.blocks.len();
        e.computed = e.blocks.len() * self.limits.block_size;
        self.prefix_hit_tokens += e.computed as u64;
        self.prefix_lookup_tokens += e.len as u64;
    }

    /// How many of `want` tokens `id` can compute, preempting lower-priority requests for
    /// blocks as needed; `None` when not even one fits.
    fn fit(&mut self, id: RequestId, want: usize, plan: &mut Plan) -> Option<usize> {
        let bs = self.limits.block_size;
        loop {
            let e = &self.entries[&id];
            let held = e.blocks.len() + self.pool.available();
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
            .filter(|(v, e)| **v != id && !e.blocks.is_empty() && !planned(v))
            .filter(|(_, e)| e.away || e.arrival > arrival)
            .max_by_key(|(_, e)| (e.away, e.arrival))
            .map(|(&v, _)| v)
    }

    fn preempt(&mut self, id: RequestId, plan: &mut Plan) {
        let e = self.entries.get_mut(&id).expect("victim exists");
        e.blocks.clear();
        e.computed = 0;
        e.registered = 0;
        self.preemptions += 1;
        plan.preempted.push(id);
    }

    /// The plan ran: every item's tokens are now in the cache, and its newly full blocks join
    /// the prefix index.
    pub fn advance(&mut self, plan: &Plan) {
        let bs = self.limits.block_size;
        for item in &plan.items {
            let Some(e) = self.entries.get_mut(&item.id) else {
                continue;
            };
            e.computed = item.start + item.num_tokens;
            let full = (e.computed / bs).min(e.hashes.len());
            for i in e.registered..full {
                self.pool.register(e.blocks.ids()[i], e.hashes[i]);
            }
            e.registered = e.registered.max(full);
        }
    }

    /// `id` committed its sampled token here (`tokens` includes it) and stays: ready for the
    /// next decode, in the same visit.
    pub fn commit<'a>(&mut self, id: RequestId, tokens: impl Into<Known<'a>>) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.set_tokens(tokens.into(), self.limits.block_size);
        }
    }

    /// `id` moves to a peer and stays pending here with its blocks; `tokens` includes the
    /// sampled token if it was committed here first.
    pub fn leave<'a>(&mut self, id: RequestId, tokens: impl Into<Known<'a>>) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.set_tokens(tokens.into(), self.limits.block_size);
            e.away = true;
        }
    }

    /// `id` is done here (finished, aborted or failed): its blocks go back to the pool, the
    /// full ones staying cached for later prefixes.
    pub fn finish(&mut self, id: RequestId) {
        self.entries.remove(&id);
    }

    /// Requests ready here and when the visit of the longest-waiting of them began.
    pub fn ready(&self) -> (usize, Option<Instant>) {
        let ready = self.entries.values().filter(|e| e.ready());
        let (n, oldest) = ready.fold((0, None::<Instant>), |(n, o), e| {
            (
                n + 1,
                Some(o.map_or(e.visit_since, |o| o.min(e.visit_since))),
            )
        });
        (n.min(self.limits.max_batch_requests), oldest)
    }

    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            ready: self.entries.values().filter(|e| e.ready()).count(),
            away: self.entries.values().filter(|e| e.away).count(),
            free_blocks: self.pool.available(),
            cached_blocks: self.pool.cached(),
            preemptions: self.preemptions,
            prefix_hit_tokens: self.prefix_hit_tokens,
            prefix_lookup_tokens: self.prefix_lookup_tokens,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests;
