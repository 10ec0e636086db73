//! Cache-aware routing on the exact index: the worker whose cost is lowest, where a worker's
//! cost is the prefill it would still have to compute for this request (blocks not in its
//! prefix cache, as the workers' own KV-cache events say) weighed against the decode load it
//! already carries (blocks of the requests in flight there). This is the cost NVIDIA Dynamo's
//! KV router uses: `overlap_weight × prefill blocks + active blocks`.
//!
//! A request the gateway could not tokenize (no blocks) goes to the least-loaded worker.

use std::sync::Arc;

use super::{least_loaded, Policy, RouteRequest, Selection};
use crate::gateway::kv_index::KvIndex;
use crate::gateway::tree::WorkerId;
use crate::gateway::workers::Worker;

#[derive(Debug, Clone)]
pub struct KvAwareSettings {
    /// Weight of a block of prefill still to compute against a block of decode load.
    pub overlap_weight: f64,
}

impl Default for KvAwareSettings {
    fn default() -> Self {
        Self {
            overlap_weight: 1.0,
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
        let mut cached = Vec::with_capacity(ids.len());
        self.index.overlaps(blocks, &ids, &mut cached);
        let cost = |i: usize| {
            let prefill = (blocks.len() - cached[i]) as f64;
            self.settings.overlap_weight * prefill + workers[i].active_blocks() as f64
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
                cached[index] * block_size,
                request.prompt_tokens.max(blocks.len() * block_size),
            )),
        }
    }

    fn kv_index(&self) -> Option<&Arc<KvIndex>> {
        Some(&self.index)
    }

    fn remove_worker(&self, worker: WorkerId) {
        self.index.remove_worker(worker);
    }
}
