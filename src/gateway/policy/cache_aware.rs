//! Cache-aware routing: send a request where its prefix most likely sits in the KV cache,
//! unless that would let one worker drown.
//!
//! Every routed text is recorded in one approximate radix tree shared by all workers. A
//! request goes to the worker holding the longest prefix of it when that prefix covers more
//! than `cache_threshold` of the text; otherwise to the least-loaded worker (not the one with
//! the smallest tree, which would pile every miss on one worker). When load is imbalanced
//! (max − min > `balance_abs_threshold` and max > min × `balance_rel_threshold`) the
//! least-loaded worker wins regardless. `cache_routing_prob` mixes in plain load-based choice.
//! The text is recorded for whichever worker is chosen, so later requests follow it.
//!
//! With `exact`, cache-aware routing is [`super::KvAware`] instead: exact, on the workers'
//! own KV-cache events.

use std::sync::Arc;

use super::load::SharedRng;
use super::{least_loaded, Policy, RouteRequest, Selection};
use crate::gateway::tree::{RadixTree, WorkerId};
use crate::gateway::workers::Worker;

#[derive(Debug, Clone)]
pub struct CacheAwareSettings {
    /// Match ratio above which the cache decides.
    pub cache_threshold: f64,
    pub balance_abs_threshold: usize,
    pub balance_rel_threshold: f64,
    /// Share of requests routed by cache affinity (the rest by load).
    pub cache_routing_prob: f64,
    /// Characters of routing text kept per worker; eviction trims beyond it.
    pub max_tree_size: usize,
    /// Route on the exact index kept from the workers' KV-cache events ([`super::KvAware`])
    /// instead of the text tree.
    pub exact: bool,
    /// With `exact`: weight of a block of prefill still to compute against a block of load.
    pub overlap_weight: f64,
    /// With `exact`: weight of a cached block a request would evict.
    pub eviction_weight: f64,
}

impl Default for CacheAwareSettings {
    fn default() -> Self {
        Self {
            cache_threshold: 0.5,
            balance_abs_threshold: 32,
            balance_rel_threshold: 1.5,
            cache_routing_prob: 1.0,
            max_tree_size: 1 << 22,
            exact: false,
            overlap_weight: 4.0,
            eviction_weight: 1.0,
        }
    }
}

pub struct CacheAware {
    pub(super) tree: RadixTree,
    settings: CacheAwareSettings,
    rng: SharedRng,
}

impl CacheAware {
    pub fn new(settings: CacheAwareSettings, seed: u64) -> Self {
        Self {
            tree: RadixTree::new(),
            settings,
            rng: SharedRng::new(seed),
        }
    }

    fn imbalanced(&self, workers: &[Arc<Worker>]) -> bool {
        let loads = workers.iter().map(|w| w.load());
        let (min, max) = loads.fold((usize::MAX, 0), |(lo, hi), l| (lo.min(l), hi.max(l)));
        max - min > self.settings.balance_abs_threshold
            && max as f64 > min as f64 * self.settings.balance_rel_threshold
    }
}

impl Policy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn select(&self, workers: &[Arc<Worker>], request: &RouteRequest) -> Selection {
        let text = request.text;
        let found = self.tree.prefix_match(text);
        let text_chars = found.text_chars;
        // (matched, total) characters of routing text per worker.
        let matched = |w: &Worker| {
            let chars = (found.matched.iter())
                .find(|m| m.0 == w.id)
                .map_or(0, |m| m.1);
            (chars, text_chars.max(1))
        };
        let ratio = |w: &Worker| {
            let (m, t) = matched(w);
            m as f64 / t as f64
        };
        let by_load =
            self.imbalanced(workers) || !self.rng.chance(self.settings.cache_routing_prob);
        // The worker with the longest match among those routable; ties to the less loaded.
        let best = workers
            .iter()
            .enumerate()
            .map(|(i, w)| (i, ratio(w)))
            .filter(|&(_, r)| r > 0.0)
            .max_by(|a, b| {
                a.1.total_cmp(&b.1)
                    .then(workers[b.0].load().cmp(&workers[a.0].load()))
            });
        let index = match best {
            Some((i, ratio)) if !by_load && ratio > self.settings.cache_threshold => i,
            _ => least_loaded(workers),
        };
        self.tree.insert(text, workers[index].id);
        Selection {
            index,
            matched: Some(matched(&workers[index])),
            pending: None,
        }
    }

    fn remove_worker(&self, worker: WorkerId) {
        self.tree.remove_worker(worker);
    }

    fn maintain(&self) -> Option<String> {
        let evicted = self.tree.evict(self.settings.max_tree_size);
        (evicted > 0).then(|| format!("evicted {evicted} characters from the prefix tree"))
    }

    fn tree_sizes(&self) -> Vec<(WorkerId, usize)> {
        self.tree.sizes()
    }
}
