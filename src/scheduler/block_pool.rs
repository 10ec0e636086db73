//! KV block ids for one model, with prefix caching: every full block whose K/V are computed is
//! indexed by the hash of the whole token prefix it ends (the hash of its parent block chained
//! with its own tokens), so the index is a radix tree over token blocks flattened into one map.
//! A request whose leading blocks are already in the index shares them instead of computing
//! them again.
//!
//! [`BlockPool`] is the only allocator of a model's block ids: what a sequence holds is a
//! [`Blocks`], which gives its ids back when dropped or cleared, so no path can leak a block or
//! release it twice.
//!
//! Guarantees: allocation and release are O(1) (amortised); a block is writable by at most one
//! request (shared blocks are full and never written again); a cached block nobody uses stays
//! reusable until memory is needed, then the least recently released one is evicted first;
//! `available()` counts free and evictable blocks, so a pool with no users is entirely
//! available. Every change to the index bumps a generation counter and is journaled (the last
//! `num_blocks` of them), so a copy of the index kept elsewhere can follow it change by change
//! ([`Pool::changes_since`]) instead of being rebuilt whole.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};

/// Hash of a token prefix that ends at a block boundary.
pub type PrefixHash = u64;

/// Chains `parent` (the hash of everything before) with one block's tokens.
pub fn chain_hash(parent: Option<PrefixHash>, tokens: &[u32]) -> PrefixHash {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// A fixed chain hash: equal on two processes exactly when they hash blocks alike (the
/// standard hasher is not guaranteed to stay the same across Rust releases), so that a
/// gateway can tell whether a server's block hashes are comparable with its own.
pub fn hash_check() -> PrefixHash {
    chain_hash(Some(0x746f_6b65_6e72_6f75), &[0x7465, 0x7221])
}

#[derive(Debug, Clone, Default)]
struct BlockState {
    refs: u32,
    /// Set once the block is full, computed and indexed.
    hash: Option<PrefixHash>,
    /// Position in the eviction order while unreferenced and cached.
    lru_tick: Option<u64>,
}

/// The pool's state: which blocks are free, referenced or cached, and the prefix index.
#[derive(Debug, Clone)]
pub(super) struct Pool {
    blocks: Vec<BlockState>,
    free: Vec<u32>,
    index: HashMap<PrefixHash, u32>,
    /// Unreferenced cached blocks by release time (oldest first).
    evictable: BTreeMap<u64, u32>,
    tick: u64,
    /// Bumped whenever the index gains or loses a prefix.
    generation: u64,
    /// The latest index changes, oldest first: (generation it made, prefix, added). At most
    /// `num_blocks` are kept: replaying more would cost more than reading the whole index.
    journal: VecDeque<(u64, PrefixHash, bool)>,
}

/// One change to the indexed prefixes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixChange {
    Added(PrefixHash),
    Removed(PrefixHash),
}

impl Pool {
    pub fn new(num_blocks: usize) -> Self {
        Self {
            blocks: vec![BlockState::default(); num_blocks],
            free: (0..num_blocks as u32).rev().collect(),
            index: HashMap::new(),
            evictable: BTreeMap::new(),
            tick: 0,
            generation: 0,
            journal: VecDeque::new(),
        }
    }

    /// Blocks an allocation may take: free ones and cached ones nobody uses.
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Cached blocks (in use or not).
    pub fn cached(&self) -> usize {
        self.index.len()
    }

    /// A block for exclusive use; evicts the least recently released cached block when no
    /// free one is left.
    pub fn allocate(&mut self) -> Option<u32> {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let (_, id) = self.evictable.pop_first()?;
                let state = &mut self.blocks[id as usize];
                state.lru_tick = None;
                if let Some(hash) = state.hash.take() {
                    self.index.remove(&hash);
                    self.record(hash, false);
                }
                id
            }
        };
        self.blocks[id as usize].refs = 1;
        Some(id)
    }

    /// Drops one reference; an unreferenced block becomes free, or evictable if cached.
    pub fn release(&mut self, id: u32) {
        let state = &mut self.blocks[id as usize];
        debug_assert!(state.refs > 0, "block {id} released twice");
        state.refs -= 1;
        if state.refs > 0 {
            return;
        }
        if state.hash.is_some() {
            self.tick += 1;
            state.lru_tick = Some(self.tick);
            self.evictable.insert(self.tick, id);
        } else {
            self.free.push(id);
        }
    }

    /// Indexes a full, computed block under the hash of the prefix it ends. A prefix already
    /// indexed keeps its first block.
    pub fn register(&mut self, id: u32, hash: PrefixHash) {
        if self.blocks[id as usize].hash.is_some() || self.index.contains_key(&hash) {
            return;
        }
        self.index.insert(hash, id);
        self.blocks[id as usize].hash = Some(hash);
        self.record(hash, true);
    }

    /// Counts one change to the index and journals it.
    fn record(&mut self, hash: PrefixHash, added: bool) {
        self.generation += 1;
        if self.journal.len() == self.blocks.len().max(1) {
            self.journal.pop_front();
        }
        self.journal.push_back((self.generation, hash, added));
    }

    /// Changes whenever the set of indexed prefixes does.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The index's changes since it was at generation `since`, oldest first; `None` when the
    /// journal no longer reaches back that far (read [`Pool::indexed`] instead).
    pub fn changes_since(&self, since: u64) -> Option<impl Iterator<Item = PrefixChange> + '_> {
        let oldest = self
            .journal
            .front()
            .map_or(self.generation + 1, |&(g, ..)| g);
        if since > self.generation || since + 1 < oldest {
            return None;
        }
        let skip = (since + 1 - oldest) as usize;
        Some(self.journal.iter().skip(skip).map(|&(_, hash, added)| {
            if added {
                PrefixChange::Added(hash)
            } else {
                PrefixChange::Removed(hash)
            }
        }))
    }

    /// Every indexed prefix.
    pub fn indexed(&self) -> impl Iterator<Item = PrefixHash> + '_ {
        self.index.keys().copied()
    }

    /// The blocks of the longest indexed prefix of `hashes`, each with a new reference.
    pub fn lookup(&mut self, hashes: &[PrefixHash]) -> Vec<u32> {
        let mut out = Vec::new();
        for hash in hashes {
            let Some(&id) = self.index.get(hash) else {
                break;
            };
            let state = &mut self.blocks[id as usize];
            if let Some(tick) = state.lru_tick.take() {
                self.evictable.remove(&tick);
            }
            state.refs += 1;
            out.push(id);
        }
        out
    }
}

/// The KV blocks of one model, and the only allocator of their ids. Clones share one pool;
/// the blocks a sequence holds ([`Blocks`]) go back to it when they are dropped or cleared.
#[derive(Clone)]
pub struct BlockPool(Arc<Mutex<Pool>>);

/// An allocation that does not fit: `needed` more blocks than the `available` ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the KV cache is full: {needed} more blocks needed, {available} available")]
pub struct OutOfBlocks {
    pub needed: usize,
    pub available: usize,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        Self(Arc::new(Mutex::new(Pool::new(num_blocks))))
    }

    /// The state; a panic elsewhere while it was held leaves it consistent (every change
    /// completes before the next can start), so a poisoned lock is taken as it is.
    fn lock(&self) -> MutexGuard<'_, Pool> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads the state (the prefix index, for publication).
    pub(super) fn with<R>(&self, f: impl FnOnce(&Pool) -> R) -> R {
        f(&self.lock())
    }

    /// Blocks an allocation may take: free ones and cached ones nobody uses.
    pub fn available(&self) -> usize {
        self.lock().available()
    }

    /// Cached blocks (in use or not).
    pub fn cached(&self) -> usize {
        self.lock().cached()
    }

    /// Grows `blocks` to `count` blocks for exclusive use, free blocks first, then the least
    /// recently released cached ones; all or nothing.
    pub fn grow(&self, blocks: &mut Blocks, count: usize) -> Result<(), OutOfBlocks> {
        let needed = count.saturating_sub(blocks.ids.len());
        if needed == 0 {
            return Ok(());
        }
        let owner = blocks.pool.get_or_insert_with(|| self.clone());
        assert!(
            Arc::ptr_eq(&owner.0, &self.0),
            "blocks grow from the pool they came from"
        );
        let mut pool = self.lock();
        let available = pool.available();
        if needed > available {
            return Err(OutOfBlocks { needed, available });
        }
        for _ in 0..needed {
            blocks
                .ids
                .push(pool.allocate().expect("availability was checked"));
        }
        Ok(())
    }

    /// The blocks of the longest indexed prefix of `hashes`, each with a new reference.
    pub fn lookup(&self, hashes: &[PrefixHash]) -> Blocks {
        Blocks {
            ids: self.lock().lookup(hashes),
            pool: Some(self.clone()),
        }
    }

    /// Indexes a full, computed block under the hash of the prefix it ends. A prefix already
    /// indexed keeps its first block.
    pub fn register(&self, id: u32, hash: PrefixHash) {
        self.lock().register(id, hash);
    }
}

/// The blocks holding one sequence's positions, in order; they return to their pool when
/// dropped or cleared.
#[derive(Default)]
pub struct Blocks {
    ids: Vec<u32>,
    /// The pool they came from; `None` while there are none.
    pool: Option<BlockPool>,
}

impl Blocks {
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Returns every block to the pool, last first, so that eviction takes the tail of a
    /// cached prefix before its head (a head without its tail is still useful; the reverse is
    /// not).
    pub fn clear(&mut self) {
        self.truncate(0);
    }

    /// Keeps the first `len` blocks and returns the others to the pool, last first.
    pub fn truncate(&mut self, len: usize) {
        if self.ids.len() <= len {
            return;
        }
        if let Some(pool) = &self.pool {
            let mut pool = pool.lock();
            for &id in self.ids[len..].iter().rev() {
                pool.release(id);
            }
        }
        self.ids.truncate(len);
    }
}

impl Drop for Blocks {
    fn drop(&mut self) {
        self.clear();
    }
}

impl fmt::Debug for Blocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(&self.ids).finish()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn released_uncached_blocks_are_free_again() {
        let mut pool = Pool::new(2);
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        assert_ne!(a, b);
        assert_eq!(pool.allocate(), None);
        pool.release(a);
        assert_eq!(pool.available(), 1);
        assert_eq!(pool.allocate(), Some(a));
    }

    #[test]
    fn cached_blocks_are_shared_then_evicted_oldest_first() {
        let mut pool = Pool::new(3);
        let h1 = chain_hash(None, &[1, 2]);
        let h2 = chain_hash(Some(h1), &[3, 4]);
        let (a, b) = (pool.allocate().unwrap(), pool.allocate().unwrap());
        pool.register(a, h1);
        pool.register(b, h2);
        assert_eq!(
            pool.lookup(&[h1, h2, 99]),
            [a, b],
            "the longest indexed prefix"
        );
        pool.release(a);
        pool.release(b);
        assert_eq!(pool.available(), 1, "still referenced by the first user");
        pool.release(b);
        pool.release(a);
        assert_eq!(pool.available(), 3);
        assert_eq!(pool.cached(), 2);
        let c = pool.allocate().unwrap();
        assert!(c != a && c != b, "free blocks go before cached ones");
        assert_eq!(pool.allocate(), Some(b), "b was released before a");
        assert_eq!(pool.lookup(&[h1, h2]), [a], "b's prefix was evicted");
    }

    /// Replaying the journal onto an earlier copy of the index gives the index now, from
    /// any generation the journal still reaches; from older ones it says so.
    #[test]
    fn changes_since_an_earlier_generation_rebuild_the_index() {
        let mut pool = Pool::new(4);
        let mut copies = vec![(0, HashSet::new())];
        for i in 0..12u32 {
            let id = pool.allocate().unwrap();
            pool.register(id, chain_hash(None, &[i]));
            pool.release(id);
            copies.push((pool.generation(), pool.indexed().collect::<HashSet<_>>()));
        }
        let now: HashSet<_> = pool.indexed().collect();
        for (generation, mut copy) in copies {
            let Some(changes) = pool.changes_since(generation) else {
                // Four blocks keep four changes: two steps (an eviction and a registration).
                assert!(
                    generation + 4 < pool.generation(),
                    "generation {generation}"
                );
                continue;
            };
            for change in changes {
                match change {
                    PrefixChange::Added(h) => assert!(copy.insert(h)),
                    PrefixChange::Removed(h) => assert!(copy.remove(&h)),
                }
            }
            assert_eq!(copy, now, "from generation {generation}");
        }
        assert_eq!(pool.changes_since(pool.generation()).unwrap().count(), 0);
        assert!(pool.changes_since(pool.generation() + 1).is_none());
    }

    #[test]
    fn blocks_grow_all_or_nothing_and_return_when_dropped() {
        let pool = BlockPool::new(4);
        let mut a = Blocks::default();
        pool.grow(&mut a, 3).unwrap();
        pool.grow(&mut a, 2).unwrap();
        assert_eq!(a.len(), 3, "growing to fewer blocks changes nothing");
        let mut b = Blocks::default();
        pool.grow(&mut b, 1).unwrap();
        let err = pool.grow(&mut b, 3).unwrap_err();
        assert_eq!(
            err,
            OutOfBlocks {
                needed: 2,
                available: 0
            }
        );
        assert_eq!(b.len(), 1, "a failed growth keeps what it had");
        let ids: HashSet<u32> = a.ids().iter().chain(b.ids()).copied().collect();
        assert_eq!(ids.len(), 4, "no block is in two tables");
        drop(a);
        assert_eq!(pool.available(), 3);
        b.clear();
        assert!(b.is_empty());
        assert_eq!(pool.available(), 4);
        drop(b);
        assert_eq!(pool.available(), 4, "cleared blocks are not released again");
    }

    #[test]
    fn shared_prefix_blocks_stay_until_their_last_holder_drops_them() {
        let pool = BlockPool::new(3);
        let h1 = chain_hash(None, &[1]);
        let h2 = chain_hash(Some(h1), &[2]);
        let mut first = Blocks::default();
        pool.grow(&mut first, 2).unwrap();
        pool.register(first.ids()[0], h1);
        pool.register(first.ids()[1], h2);
        let second = pool.lookup(&[h1, h2]);
        assert_eq!(second.ids(), first.ids());
        drop(first);
        assert_eq!(pool.available(), 1, "still held by the second sequence");
        drop(second);
        assert_eq!((pool.available(), pool.cached()), (3, 2));
        // Released last block first: the tail of the prefix is evicted before its head.
        let mut other = Blocks::default();
        pool.grow(&mut other, 2).unwrap();
        assert_eq!(pool.lookup(&[h1, h2]).len(), 1);
    }

    #[test]
    fn the_hash_covers_the_whole_prefix() {
        let h = chain_hash(None, &[1, 2]);
        assert_ne!(chain_hash(Some(h), &[3]), chain_hash(None, &[3]));
        assert_eq!(chain_hash(Some(h), &[3]), chain_hash(Some(h), &[3]));
    }
}
