//! The prefixes a model holds in its KV cache, published by the model's actor after the steps
//! that change them, so that readers on other threads (the HTTP server answering a gateway's
//! "how much of this prompt do you hold?") never wait for a forward pass. Readers see the set
//! as of the last publication: exact up to one step.
//!
//! A publication costs what changed since the last one, not the size of the set: the pool's
//! journal of index changes is replayed onto the published set (copied first only if a reader
//! holds it at that moment); only when the journal no longer reaches back that far is the set
//! rebuilt from the whole index.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use super::block_pool::{chain_hash, BlockPool, Pool, PrefixChange, PrefixHash};

#[derive(Default)]
pub struct PublishedPrefixes {
    set: RwLock<Arc<HashSet<PrefixHash>>>,
    /// Pool generation of the published set (0 before the first publication).
    generation: AtomicU64,
}

impl PublishedPrefixes {
    /// Brings the set up to the pool's when the pool changed since the last publication:
    /// by replaying the changes since, or by reading the whole index when they are no longer
    /// journaled.
    pub fn publish(&self, pool: &BlockPool) {
        pool.with(|pool| self.update(pool));
    }

    fn update(&self, pool: &Pool) {
        let published = self.generation.load(Ordering::Acquire);
        if published == pool.generation() {
            return;
        }
        let mut set = self.set.write().unwrap_or_else(|e| e.into_inner());
        match pool.changes_since(published) {
            Some(changes) => {
                let set = Arc::make_mut(&mut set);
                for change in changes {
                    match change {
                        PrefixChange::Added(hash) => set.insert(hash),
                        PrefixChange::Removed(hash) => set.remove(&hash),
                    };
                }
            }
            None => *set = Arc::new(pool.indexed().collect()),
        }
        self.generation.store(pool.generation(), Ordering::Release);
    }

    /// Tokens of `prompt` a new request would find cached: whole leading blocks, leaving at
    /// least one token to compute (the scheduler's rule).
    pub fn cached_tokens(&self, prompt: &[u32], block_size: usize) -> usize {
        if prompt.is_empty() || block_size == 0 {
            return 0;
        }
        let set = self.set.read().unwrap_or_else(|e| e.into_inner()).clone();
        let usable = (prompt.len() - 1) / block_size;
        let mut parent = None;
        let mut blocks = 0;
        for block in prompt.chunks_exact(block_size).take(usable) {
            let hash = chain_hash(parent, block);
            if !set.contains(&hash) {
                break;
            }
            parent = Some(hash);
            blocks += 1;
        }
        blocks * block_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_tokens_are_the_leading_indexed_blocks() {
        let mut pool = Pool::new(4);
        let prompt: Vec<u32> = (0..10).collect();
        let h1 = chain_hash(None, &prompt[0..4]);
        let h2 = chain_hash(Some(h1), &prompt[4..8]);
        let published = PublishedPrefixes::default();
        assert_eq!(published.cached_tokens(&prompt, 4), 0);
        let a = pool.allocate().unwrap();
        pool.register(a, h1);
        published.update(&pool);
        assert_eq!(published.cached_tokens(&prompt, 4), 4);
        let b = pool.allocate().unwrap();
        pool.register(b, h2);
        published.update(&pool);
        assert_eq!(published.cached_tokens(&prompt, 4), 8);
        // One token must stay to compute: an 8-token prompt can reuse only its first block.
        assert_eq!(published.cached_tokens(&prompt[..8], 4), 4);
        // A prompt that differs in the first block shares nothing.
        let other: Vec<u32> = (1..11).collect();
        assert_eq!(published.cached_tokens(&other, 4), 0);
    }

    /// Published after every change, after several, or after more than the journal keeps:
    /// the set is always the pool's index.
    #[test]
    fn publications_follow_the_index_however_far_apart() {
        let mut pool = Pool::new(8);
        let published = PublishedPrefixes::default();
        let mut held = Vec::new();
        for i in 0..200u32 {
            // Some blocks stay referenced for a while, so evictions skip them.
            let id = pool.allocate().unwrap();
            pool.register(id, chain_hash(None, &[i % 50]));
            if i % 3 == 0 {
                held.push(id);
            } else {
                pool.release(id);
            }
            if held.len() > 2 {
                pool.release(held.remove(0));
            }
            // Publication gaps of 1 to 12 steps; the journal keeps 8 changes.
            if i % (1 + i % 12) == 0 {
                published.update(&pool);
                let set = published.set.read().unwrap().clone();
                assert_eq!(*set, pool.indexed().collect::<HashSet<_>>(), "step {i}");
            }
        }
    }

    #[test]
    fn evicted_prefixes_disappear_on_the_next_publication() {
        let mut pool = Pool::new(1);
        let prompt = [1, 2, 3];
        let id = pool.allocate().unwrap();
        pool.register(id, chain_hash(None, &prompt[..2]));
        let published = PublishedPrefixes::default();
        published.update(&pool);
        assert_eq!(published.cached_tokens(&prompt, 2), 2);
        pool.release(id);
        let _reused = pool.allocate().unwrap();
        published.update(&pool);
        assert_eq!(published.cached_tokens(&prompt, 2), 0);
    }
}
