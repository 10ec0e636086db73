//! Cache-aware routing on the exact index: the worker whose cost is lowest, where a worker's
//! cost is the prefill it would still have to compute for this request (blocks not in its
//! prefix cache, as the workers' own KV-cache events say) weighed against the decode load it
//! already carries (blocks of the requests in flight there). This is the cost NVIDIA Dynamo's
//! KV router uses: `overlap_weight × prefill blocks + active blocks`, where the active blocks
//! are the distinct prompt blocks of the requests in flight there plus each one's own (its
//! tail and output, which the gateway counts on the worker's load). Where a worker's cache
//! capacity is known, the cached blocks a request's new blocks would evict there are added
//! at `eviction_weight`: without it, every worker holding some common first block looks
//! cheaper than an idle empty one, and a fleet's cold servers stay unused while the warm
//! ones evict each other's prefixes.
//!
//! A request counts as held by the worker it was sent to until it ends (see
//! [`crate::gateway::kv_index::Pending`]): requests sharing a prefix that arrive before the
//! first of them is computed follow it. A request the gateway could not tokenize (no blocks)
//! goes to the least-loaded worker.

use std::sync::Arc;

use super::{least_loaded, Policy, RouteRequest, Selection};
use crate::gateway::kv_index::KvIndex;
use crate::gateway::tree::WorkerId;
use crate::gateway::workers::Worker;

#[derive(Debug, Clone)]
pub struct KvAwareSettings {
    /// Weight of a block of prefill still to compute against a block of decode load.
    pub overlap_weight: f64,
    /// Weight of a cached block the request would evict (its new blocks beyond the worker's
    /// free room) against a block of decode load.
    pub eviction_weight: f64,
}

impl Default for KvAwareSettings {
    /// A block still to prefill weighs four blocks in flight: on a compute-bound engine a
    /// prefill block costs more than holding one, and Dynamo's 1.0 lets load scatter groups
    /// whose prefix is not yet computed (docs/fleet.md).
    fn default() -> Self {
        Self {
            overlap_weight: 4.0,
            eviction_weight: 1.0,
        }
    }
}

pub struct KvAware {
    index: Arc<KvIndex>,
    settings: KvAwareSettings,
}

impl KvAware {
    pub fn new(index: Arc<KvIndex>, settings: KvAwareSettings) -> Self {
        Self { index, settings }
    }
}

impl Policy for KvAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn select(&self, workers: &[Arc<Worker>], request: &RouteRequest) -> Selection {
        let Some(blocks) = request.blocks.filter(|b| !b.is_empty()) else {
            return Selection::plain(least_loaded(workers));
        };
        let ids: Vec<WorkerId> = workers.iter().map(|w| w.id).collect();
        let mut views = Vec::with_capacity(ids.len());
        self.index.view(blocks, &ids, &mut views);
        let cost = |i: usize| {
            let view = &views[i];
            let prefill = blocks.len() - view.cached;
            // Cached prefixes the new blocks would push out, where the worker's room is known.
            let evicted = prefill.saturating_sub(view.free.unwrap_or(usize::MAX));
            // Decode load in blocks: the distinct prompt blocks in flight there (shared
            // prefixes once) and each request's own blocks beyond them.
            let active = view.pending + workers[i].active_blocks();
            self.settings.overlap_weight * prefill as f64
                + self.settings.eviction_weight * evicted as f64
                + active as f64
        };
        let index = (0..workers.len())
            .min_by(|&a, &b| {
                cost(a).total_cmp(&cost(b)).then_with(|| {
                    let key = |w: &Worker| (w.load(), w.selected());
                    key(&workers[a]).cmp(&key(&workers[b]))
                })
            })
            .unwrap_or(0);
        let block_size = request.block_size.max(1);
        Selection {
            index,
            matched: Some((
                views[index].cached * block_size,
                request.prompt_tokens.max(blocks.len() * block_size),
            )),
            pending: Some(self.index.add_pending(workers[index].id, blocks)),
        }
    }

    fn kv_index(&self) -> Option<&Arc<KvIndex>> {
        Some(&self.index)
    }

    fn remove_worker(&self, worker: WorkerId) {
        self.index.remove_worker(worker);
    }
}
