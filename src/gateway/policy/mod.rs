//! Load-balancing policies: which worker a request goes to. One trait, one file per policy.
//!
//! A policy sees the routable workers (never empty) and the request's routing text (the
//! whole prompt or conversation as raw characters) and picks one. Policies that keep state
//! (the cache-aware tree) are told when a worker leaves and are maintained in the background.

mod cache_aware;
mod kv_aware;
mod load;

use std::str::FromStr;
use std::sync::Arc;

pub use cache_aware::{CacheAware, CacheAwareSettings};
pub use kv_aware::{KvAware, KvAwareSettings};
pub use load::{PowerOfTwo, RandomChoice, RoundRobin, ShortestQueue};

use super::kv_index::{KvIndex, Pending};
use super::tree::WorkerId;
use super::workers::Worker;
use crate::scheduler::PrefixHash;

/// What a policy knows of a request.
#[derive(Debug, Clone, Copy, Default)]
pub struct RouteRequest<'a> {
    /// The raw routing text (the whole prompt or conversation).
    pub text: &'a str,
    /// The chained hashes of the prompt's full blocks, when the gateway tokenized it (exact
    /// mode); cache-aware routing then scores the workers' KV-cache events instead of its
    /// text tree.
    pub blocks: Option<&'a [PrefixHash]>,
    /// Prompt tokens (exact mode), and the workers' block size.
    pub prompt_tokens: usize,
    pub block_size: usize,
}

/// The choice for one request.
#[derive(Debug)]
pub struct Selection {
    /// Index into the workers the policy was given.
    pub index: usize,
    /// (matched, total) of the request the chosen worker is believed to hold, when the policy
    /// tracks caches: characters of routing text, or tokens when workers reported exactly.
    pub matched: Option<(usize, usize)>,
    /// The request's blocks counted as about to be held by the chosen worker (exact routing),
    /// until the request ends: the caller keeps this as long as the request runs.
    pub pending: Option<Pending>,
}

impl Selection {
    pub fn plain(index: usize) -> Self {
        Self {
            index,
            matched: None,
            pending: None,
        }
    }
}

pub trait Policy: Send + Sync {
    fn name(&self) -> &'static str;
    /// Picks one of `workers` (non-empty) for `request`.
    fn select(&self, workers: &[Arc<Worker>], request: &RouteRequest) -> Selection;
    /// The exact index of the workers' caches, when the policy routes on one (the gateway
    /// then follows every worker's KV-cache events into it and tokenizes each request).
    fn kv_index(&self) -> Option<&Arc<KvIndex>> {
        None
    }
    /// A worker left the gateway.
    fn remove_worker(&self, _worker: WorkerId) {}
    /// Periodic upkeep (eviction); returns what it did, for the log.
    fn maintain(&self) -> Option<String> {
        None
    }
    /// Characters of routing text held per worker, when the policy keeps a tree.
    fn tree_sizes(&self) -> Vec<(WorkerId, usize)> {
        Vec::new()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    Random,
    RoundRobin,
    ShortestQueue,
    PowerOfTwo,
    CacheAware,
}

impl PolicyKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Random => "random",
            Self::RoundRobin => "round_robin",
            Self::ShortestQueue => "shortest_queue",
            Self::PowerOfTwo => "power_of_two",
            Self::CacheAware => "cache_aware",
        }
    }
}

impl FromStr for PolicyKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.replace('-', "_").as_str() {
            "random" => Self::Random,
            "round_robin" => Self::RoundRobin,
            "shortest_queue" => Self::ShortestQueue,
            "power_of_two" => Self::PowerOfTwo,
            "cache_aware" => Self::CacheAware,
            _ => {
                return Err(format!(
                "unknown policy '{s}': use random, round_robin, shortest_queue, power_of_two or cache_aware"
            ))
            }
        })
    }
}

/// Builds a policy; `seed` makes the random choices reproducible. Cache-aware routing is
/// exact ([`KvAware`], on an index the workers' events keep) when `cache.exact` is set.
pub fn build(kind: PolicyKind, cache: CacheAwareSettings, seed: u64) -> Arc<dyn Policy> {
    match kind {
        PolicyKind::CacheAware if cache.exact => Arc::new(KvAware::new(
            Arc::new(KvIndex::new()),
            KvAwareSettings {
                overlap_weight: cache.overlap_weight,
                eviction_weight: cache.eviction_weight,
            },
        )),
        PolicyKind::Random => Arc::new(RandomChoice::new(seed)),
        PolicyKind::RoundRobin => Arc::new(RoundRobin::default()),
        PolicyKind::ShortestQueue => Arc::new(ShortestQueue),
        PolicyKind::PowerOfTwo => Arc::new(PowerOfTwo::new(seed)),
        PolicyKind::CacheAware => Arc::new(CacheAware::new(cache, seed)),
    }
}

/// Index of the least-loaded worker; ties go to the one that was sent fewer requests, so that
/// misses arriving one at a time still spread out.
pub fn least_loaded(workers: &[Arc<Worker>]) -> usize {
    workers
        .iter()
        .enumerate()
        .min_by_key(|(_, w)| (w.load(), w.selected()))
        .map_or(0, |(i, _)| i)
}

#[cfg(test)]
mod tests;
