//! The prefixes a model holds in its KV cache, published by the model's actor after the steps
//! that change them, so that readers on other threads never wait for a forward pass: the HTTP
//! server answering "how much of this prompt do you hold?", and the KV-cache event streams a
//! gateway follows. Readers see the set as of the last publication: exact up to one step.
//!
//! A publication costs what changed since the last one, not the size of the set: the pool's
//! journal of index changes is replayed onto the published set (copied first only if a reader
//! holds it at that moment) and appended to a bounded log of published changes, numbered by
//! the pool's generation, that event streams read from; only when the pool's journal no longer
//! reaches back that far is the set rebuilt from the whole index, and the log restarts (a
//! stream behind it resends the whole set).

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, RwLock, RwLockReadGuard};

use tokio::sync::watch;

use super::block_pool::{chain_hash, BlockPool, Pool, PrefixChange, PrefixHash};

/// Published changes kept for event streams that fall behind; one further behind resends the
/// whole set.
const LOG_CHANGES: usize = 1 << 16;

#[derive(Default)]
struct Published {
    set: Arc<HashSet<PrefixHash>>,
    /// Pool generation of the set (0 before the first publication).
    generation: u64,
    /// The latest published changes, oldest first: (generation it made, change). Changes
    /// are consecutive generations up to `generation`.
    log: VecDeque<(u64, PrefixChange)>,
}

/// The published prefixes of one model, and the changes that made them.
pub struct PublishedPrefixes {
    state: RwLock<Published>,
    /// The generation of every publication, for event streams to wait on.
    published: watch::Sender<u64>,
}

impl Default for PublishedPrefixes {
    fn default() -> Self {
        Self {
            state: RwLock::default(),
            published: watch::Sender::new(0),
        }
    }
}

impl PublishedPrefixes {
    /// Brings the set up to the pool's when the pool changed since the last publication:
    /// by replaying the changes since, or by reading the whole index when they are no longer
    /// journaled.
    pub fn publish(&self, pool: &BlockPool) {
        pool.with(|pool| self.update(pool));
    }

    fn read(&self) -> RwLockReadGuard<'_, Published> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn update(&self, pool: &Pool) {
        if self.read().generation == pool.generation() {
            return;
        }
        let mut state = self.state.write().unwrap_or_else(|e| e.into_inner());
        let state = &mut *state;
        match pool.changes_since(state.generation) {
            Some(changes) => {
                let set = Arc::make_mut(&mut state.set);
                for (change, generation) in changes.zip(state.generation + 1..) {
                    match change {
                        PrefixChange::Added(hash) => set.insert(hash),
                        PrefixChange::Removed(hash) => set.remove(&hash),
                    };
                    if state.log.len() == LOG_CHANGES {
                        state.log.pop_front();
                    }
                    state.log.push_back((generation, change));
                }
            }
            None => {
                state.set = Arc::new(pool.indexed().collect());
                state.log.clear();
            }
        }
        state.generation = pool.generation();
        self.published.send_replace(state.generation);
    }

    /// The whole set and the generation it is at, read together.
    pub fn snapshot(&self) -> (u64, Vec<PrefixHash>) {
        let state = self.read();
        (state.generation, state.set.iter().copied().collect())
    }

    /// The published changes after generation `since` (each with the generation it made),
    /// oldest first; `None` when they are no longer all kept (read [`Self::snapshot`]).
    pub fn changes_since(&self, since: u64) -> Option<Vec<(u64, PrefixChange)>> {
        let state = self.read();
        if since == state.generation {
            return Some(Vec::new());
        }
        let oldest = state.log.front()?.0;
        if since + 1 < oldest || since > state.generation {
            return None;
        }
        let skip = (since + 1 - oldest) as usize;
        Some(state.log.iter().skip(skip).copied().collect())
    }

    /// Resolves at every publication that changes the set.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.published.subscribe()
    }

    /// Tokens of `prompt` a new request would find cached: whole leading blocks, leaving at
    /// least one token to compute (the scheduler's rule).
    pub fn cached_tokens(&self, prompt: &[u32], block_size: usize) -> usize {
        if prompt.is_empty() || block_size == 0 {
            return 0;
        }
        let set = self.read().set.clone();
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

    /// Brings a copy of the set, at a generation, up to the published one as an event stream
    /// does: the changes since, or the whole set when they are gone.
    fn follow(published: &PublishedPrefixes, copy: &mut (u64, HashSet<PrefixHash>)) {
        match published.changes_since(copy.0) {
            Some(changes) => {
                for (generation, change) in changes {
                    assert_eq!(generation, copy.0 + 1, "changes are consecutive");
                    copy.0 = generation;
                    match change {
                        PrefixChange::Added(h) => assert!(copy.1.insert(h)),
                        PrefixChange::Removed(h) => assert!(copy.1.remove(&h)),
                    }
                }
            }
            None => {
                let (generation, set) = published.snapshot();
                *copy = (generation, set.into_iter().collect());
            }
        }
    }

    /// Published after every change, after several, or after more than the journal keeps:
    /// the set is always the pool's index.
    #[test]
    fn publications_follow_the_index_however_far_apart() {
        let mut pool = Pool::new(8);
        let published = PublishedPrefixes::default();
        let mut follower = (0, HashSet::new());
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
                let set: HashSet<_> = published.snapshot().1.into_iter().collect();
                assert_eq!(set, pool.indexed().collect::<HashSet<_>>(), "step {i}");
                // A follower of the published changes, resyncing when they are gone.
                if i % 5 != 0 {
                    follow(&published, &mut follower);
                    assert_eq!(follower.1, set, "follower at step {i}");
                }
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
