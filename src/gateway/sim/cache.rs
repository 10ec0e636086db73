//! A simulated server's KV cache: a fixed number of blocks, prefix blocks indexed by their
//! chained hash and kept after use until their room is needed (least recently released
//! first), as the real block pool does; every store and eviction is recorded as the event a
//! real server would publish.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};

use crate::gateway::kv_index::KvEvent;
use crate::scheduler::PrefixHash;

#[derive(Debug)]
pub struct BlockCache {
    capacity: usize,
    /// Blocks allocated: cached ones (used or not) and private ones.
    used: usize,
    /// Cached prefix → (users, release tick while unused).
    cached: HashMap<PrefixHash, (u32, Option<u64>)>,
    /// Unused cached blocks by release tick, oldest first.
    evictable: BTreeMap<u64, PrefixHash>,
    tick: u64,
    /// Changes since the last [`BlockCache::drain_events`], numbered on from `seq`.
    events: Vec<KvEvent>,
    seq: u64,
}

impl BlockCache {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            used: 0,
            cached: HashMap::new(),
            evictable: BTreeMap::new(),
            tick: 0,
            events: Vec::new(),
            seq: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Leading blocks of `blocks` held.
    pub fn hit(&self, blocks: &[PrefixHash]) -> usize {
        blocks
            .iter()
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }

    /// Takes a use of each of `blocks` (all cached).
    pub fn pin(&mut self, blocks: &[PrefixHash]) {
        for h in blocks {
            let entry = self.cached.get_mut(h).expect("pinned blocks are cached");
            entry.0 += 1;
            if let Some(tick) = entry.1.take() {
                self.evictable.remove(&tick);
            }
        }
    }

    /// Gives back a use of each of `blocks`; unused ones become evictable, the last block
    /// first so that a prefix's tail goes before its head.
    pub fn unpin(&mut self, blocks: &[PrefixHash]) {
        for h in blocks.iter().rev() {
            let Some(entry) = self.cached.get_mut(h) else {
                continue;
            };
            entry.0 -= 1;
            if entry.0 == 0 {
                self.tick += 1;
                entry.1 = Some(self.tick);
                self.evictable.insert(self.tick, *h);
            }
        }
    }

    /// Whether `n` more blocks can be allocated (evicting unused cached ones).
    pub fn fits(&self, n: usize) -> bool {
        self.capacity - self.used + self.evictable.len() >= n
    }

    /// Allocates `n` blocks, evicting the least recently released cached ones as needed.
    pub fn take(&mut self, n: usize) {
        debug_assert!(self.fits(n));
        let mut removed = Vec::new();
        while self.capacity - self.used < n {
            let (_, h) = self.evictable.pop_first().expect("fits() was checked");
            self.cached.remove(&h);
            self.used -= 1;
            removed.push(h);
        }
        self.used += n;
        self.record(removed, false);
    }

    /// Frees `n` private blocks.
    pub fn free(&mut self, n: usize) {
        self.used -= n;
    }

    /// Indexes computed blocks (already allocated, in use by their request); returns those
    /// that were new. The others were indexed first by another request: their copies stay
    /// private to this one, freed when it ends.
    pub fn register(&mut self, blocks: &[PrefixHash]) -> Vec<PrefixHash> {
        let mut stored = Vec::new();
        for &h in blocks {
            if let Entry::Vacant(e) = self.cached.entry(h) {
                e.insert((1, None));
                stored.push(h);
            }
        }
        self.record(stored.clone(), true);
        stored
    }

    fn record(&mut self, hashes: Vec<PrefixHash>, stored: bool) {
        if hashes.is_empty() {
            return;
        }
        let seq = self.seq + 1;
        self.seq += hashes.len() as u64;
        self.events.push(match stored {
            true => KvEvent::Stored { seq, hashes },
            false => KvEvent::Removed { seq, hashes },
        });
    }

    /// The events since the last call, in order.
    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Every cached prefix.
    pub fn held(&self) -> impl Iterator<Item = &PrefixHash> {
        self.cached.keys()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unused_prefixes_stay_until_their_room_is_needed_oldest_first() {
        let mut c = BlockCache::new(4);
        c.take(2);
        assert_eq!(c.register(&[1, 2]), [1, 2]);
        c.unpin(&[1, 2]);
        c.take(2);
        assert_eq!(c.register(&[3, 4, 3]), [3, 4]);
        c.unpin(&[3, 4]);
        assert_eq!(c.hit(&[1, 2, 5]), 2);
        // Pinned blocks are safe; the oldest unused ones (2 before 1: tails first) go.
        c.pin(&[3]);
        assert!(c.fits(3) && !c.fits(4));
        c.take(1);
        assert_eq!(c.hit(&[1, 2]), 1);
        let events = c.drain_events();
        assert_eq!(
            events.last(),
            Some(&KvEvent::Removed {
                seq: 5,
                hashes: vec![2]
            })
        );
        assert_eq!(c.held().count(), 3);
    }
}
