//! The gateway's exact view of every worker's prefix cache, kept from the KV-cache events the
//! workers publish (`GET /cache/events`): which chained block hashes each worker holds.
//!
//! Owns: per worker, the set of prefix hashes it holds, the sequence number of the last event
//! applied and the instance it came from; per prefix hash, the workers holding it as a bitset
//! over dense worker slots, so that one request's overlap with every worker costs one map
//! lookup and a few word operations per block, whatever the fleet size.
//!
//! Besides what the workers hold, the index counts what they are about to hold: the blocks of
//! requests routed to a worker and not finished yet ([`Pending`]), so that requests sharing a
//! prefix that arrive before the first of them is computed follow it rather than scatter.
//!
//! Guarantees: after [`KvIndex::snapshot`] and the events that follow it without a gap, a
//! worker's entry equals the worker's own index. An event whose sequence number does not
//! follow the last one is refused ([`Applied::Gap`]) and changes nothing: the caller resyncs
//! with a fresh snapshot. A worker that restarts shows a new instance in its snapshot, which
//! replaces everything held for it.
//!
//! Must not know: HTTP, tokenizers, or how overlap is weighed against load.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::tree::WorkerId;
use crate::scheduler::{chain_hash, PrefixHash};

/// The chained hashes of `tokens`' full blocks, as a worker's prefix cache keys them.
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<PrefixHash> {
    let mut parent = None;
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    if block_size == 0 {
        return out;
    }
    for block in tokens.chunks_exact(block_size) {
        let hash = chain_hash(parent, block);
        out.push(hash);
        parent = Some(hash);
    }
    out
}

/// Which workers hold one prefix: bit `slot % 64` of word `slot / 64`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Holders(Vec<u64>);

impl Holders {
    fn set(&mut self, slot: usize) {
        let word = slot / 64;
        if self.0.len() <= word {
            self.0.resize(word + 1, 0);
        }
        self.0[word] |= 1 << (slot % 64);
    }

    /// Clears `slot`; true when no worker is left.
    fn clear(&mut self, slot: usize) -> bool {
        if let Some(w) = self.0.get_mut(slot / 64) {
            *w &= !(1 << (slot % 64));
        }
        self.0.iter().all(|&w| w == 0)
    }

    fn word(&self, i: usize) -> u64 {
        self.0.get(i).copied().unwrap_or(0)
    }
}

/// Takes `slot` out of `hash`'s holders, dropping the entry when no worker is left.
fn unset(holders: &mut HashMap<PrefixHash, Holders>, hash: PrefixHash, slot: usize) {
    if let Some(h) = holders.get_mut(&hash) {
        if h.clear(slot) {
            holders.remove(&hash);
        }
    }
}

/// What the index holds for one worker.
#[derive(Debug, Default)]
struct Held {
    slot: usize,
    hashes: HashSet<PrefixHash>,
    /// Sequence number of the last change applied (the worker's index generation).
    seq: u64,
    /// The worker process the state came from; a new one means it restarted.
    instance: String,
    /// Whether a snapshot was applied since the worker joined.
    synced: bool,
    /// Blocks the worker's cache holds at most (0: not known).
    capacity: usize,
}

#[derive(Debug, Default)]
struct Inner {
    holders: HashMap<PrefixHash, Holders>,
    /// Blocks of requests in flight: per (slot, prefix) how many, and per prefix the slots.
    pending: HashMap<(usize, PrefixHash), u32>,
    pending_holders: HashMap<PrefixHash, Holders>,
    /// Per slot: distinct blocks of its requests in flight.
    pending_blocks: Vec<usize>,
    workers: HashMap<WorkerId, Held>,
    /// Worker per slot (`None`: free).
    slots: Vec<Option<WorkerId>>,
}

impl Inner {
    fn held(&mut self, worker: WorkerId) -> &mut Held {
        if !self.workers.contains_key(&worker) {
            let slot = match self.slots.iter().position(Option::is_none) {
                Some(free) => free,
                None => {
                    self.slots.push(None);
                    self.slots.len() - 1
                }
            };
            self.slots[slot] = Some(worker);
            let held = Held {
                slot,
                ..Held::default()
            };
            self.workers.insert(worker, held);
        }
        self.workers.get_mut(&worker).expect("inserted above")
    }

    fn store(&mut self, worker: WorkerId, hash: PrefixHash) {
        let held = self.held(worker);
        if held.hashes.insert(hash) {
            let slot = held.slot;
            self.holders.entry(hash).or_default().set(slot);
        }
    }

    fn remove(&mut self, worker: WorkerId, hash: PrefixHash) {
        let held = self.held(worker);
        if held.hashes.remove(&hash) {
            let slot = held.slot;
            unset(&mut self.holders, hash, slot);
        }
    }

    /// Per slot, how many leading blocks of `hashes` its worker holds or is about to.
    fn matched(&self, hashes: &[PrefixHash]) -> Vec<usize> {
        let mut matched = vec![0; self.slots.len()];
        let Some(first) = hashes.first() else {
            return matched;
        };
        // Workers still matching, as a bitset over slots; a worker's overlap is the block at
        // which its bit drops out.
        let words = self.slots.len().div_ceil(64);
        let mut alive: Vec<u64> = (0..words).map(|i| self.word(first, i)).collect();
        for (slot, m) in matched.iter_mut().enumerate() {
            if (alive[slot / 64] >> (slot % 64)) & 1 == 1 {
                *m = hashes.len();
            }
        }
        for (i, hash) in hashes.iter().enumerate().skip(1) {
            if alive.iter().all(|&w| w == 0) {
                break;
            }
            for (w, word) in alive.iter_mut().enumerate() {
                let next = *word & self.word(hash, w);
                let mut dropped = *word & !next;
                while dropped != 0 {
                    matched[w * 64 + dropped.trailing_zeros() as usize] = i;
                    dropped &= dropped - 1;
                }
                *word = next;
            }
        }
        matched
    }

    /// Word `i` of the workers holding `hash` or about to.
    fn word(&self, hash: &PrefixHash, i: usize) -> u64 {
        self.holders.get(hash).map_or(0, |h| h.word(i))
            | self.pending_holders.get(hash).map_or(0, |h| h.word(i))
    }

    fn clear(&mut self, worker: WorkerId) {
        let Some(held) = self.workers.get_mut(&worker) else {
            return;
        };
        let slot = held.slot;
        for hash in std::mem::take(&mut held.hashes) {
            unset(&mut self.holders, hash, slot);
        }
    }
}

/// What the index says of one worker for one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerView {
    /// Leading blocks of the request it holds or is about to.
    pub cached: usize,
    /// Distinct prompt blocks of its requests in flight (a shared prefix counts once).
    pub pending: usize,
    /// Blocks its cache could still take without evicting a cached prefix (its capacity
    /// less what it holds and is about to); `None` when the capacity is not known.
    pub free: Option<usize>,
}

/// One change a worker published: prefixes stored or removed, numbered from `seq` on (one
/// number per prefix).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    Stored { seq: u64, hashes: Vec<PrefixHash> },
    Removed { seq: u64, hashes: Vec<PrefixHash> },
}

impl KvEvent {
    fn first_seq(&self) -> u64 {
        match self {
            Self::Stored { seq, .. } | Self::Removed { seq, .. } => *seq,
        }
    }
}

/// The outcome of applying one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    Ok,
    /// The event does not follow the last one applied (or no snapshot came first): nothing
    /// changed; resync from a snapshot.
    Gap {
        expected: u64,
        got: u64,
    },
}

/// A worker's state as the index holds it, for comparison and the gateway's `/cache/index`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct WorkerIndex {
    pub worker: WorkerId,
    pub instance: String,
    pub seq: u64,
    pub synced: bool,
    pub blocks: usize,
    /// Order-independent digest of the held hashes ([`digest`]).
    pub digest: u64,
}

/// An order-independent digest of a set of prefix hashes (sum of a mix of each), so that two
/// copies of an index can be compared without shipping them.
pub fn digest<'a>(hashes: impl IntoIterator<Item = &'a PrefixHash>) -> u64 {
    hashes.into_iter().fold(0u64, |acc, &h| {
        let mut x = h ^ 0x9E37_79B9_7F4A_7C15;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        acc.wrapping_add(x ^ (x >> 31))
    })
}

/// Blocks of one routed request counted as about to be held, until dropped (when the
/// request ends).
#[derive(Debug)]
pub struct Pending {
    index: Arc<KvIndex>,
    slot: usize,
    hashes: Vec<PrefixHash>,
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.index.remove_pending(self.slot, &self.hashes);
    }
}

/// The exact per-worker index of cached prefixes (see the module docs).
#[derive(Debug, Default)]
pub struct KvIndex {
    inner: RwLock<Inner>,
}

impl KvIndex {
    pub fn new() -> Self {
        Self::default()
    }

    fn read(&self) -> RwLockReadGuard<'_, Inner> {
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Inner> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Replaces everything held for `worker` with `hashes`, as of sequence number `seq`.
    pub fn snapshot(&self, worker: WorkerId, instance: &str, seq: u64, hashes: &[PrefixHash]) {
        let mut inner = self.write();
        inner.clear(worker);
        for &hash in hashes {
            inner.store(worker, hash);
        }
        let held = inner.held(worker);
        held.seq = seq;
        held.instance = instance.to_string();
        held.synced = true;
    }

    /// Applies one event of `worker`, unless it does not follow the last one applied.
    pub fn apply(&self, worker: WorkerId, event: &KvEvent) -> Applied {
        let mut inner = self.write();
        let held = inner.held(worker);
        let expected = held.seq + 1;
        if !held.synced || event.first_seq() != expected {
            return Applied::Gap {
                expected,
                got: event.first_seq(),
            };
        }
        let (hashes, stored) = match event {
            KvEvent::Stored { hashes, .. } => (hashes, true),
            KvEvent::Removed { hashes, .. } => (hashes, false),
        };
        for &hash in hashes {
            if stored {
                inner.store(worker, hash);
            } else {
                inner.remove(worker, hash);
            }
        }
        inner.held(worker).seq += hashes.len() as u64;
        Applied::Ok
    }

    /// Marks `worker` as no longer followed (its stream broke): routing stops counting on
    /// what it held until a new snapshot arrives.
    pub fn unsync(&self, worker: WorkerId) {
        let mut inner = self.write();
        inner.clear(worker);
        inner.held(worker).synced = false;
    }

    /// Forgets `worker` entirely and frees its slot.
    pub fn remove_worker(&self, worker: WorkerId) {
        let mut inner = self.write();
        inner.clear(worker);
        if let Some(held) = inner.workers.remove(&worker) {
            inner.slots[held.slot] = None;
            let slot = held.slot;
            let gone: Vec<(usize, PrefixHash)> = (inner.pending.keys())
                .filter(|k| k.0 == slot)
                .copied()
                .collect();
            if let Some(n) = inner.pending_blocks.get_mut(slot) {
                *n = 0;
            }
            for key in gone {
                inner.pending.remove(&key);
                unset(&mut inner.pending_holders, key.1, slot);
            }
        }
    }

    /// For each of `workers`, how many leading blocks of `hashes` (a request's chained block
    /// hashes) it holds or is about to, written into `out` in the same order.
    pub fn overlaps(&self, hashes: &[PrefixHash], workers: &[WorkerId], out: &mut Vec<usize>) {
        let mut views = Vec::with_capacity(workers.len());
        self.view(hashes, workers, &mut views);
        out.clear();
        out.extend(views.iter().map(|v| v.cached));
    }

    /// What the index says of each of `workers` for a request of `hashes`, read at once:
    /// written into `out` in the same order.
    pub fn view(&self, hashes: &[PrefixHash], workers: &[WorkerId], out: &mut Vec<WorkerView>) {
        out.clear();
        out.resize(workers.len(), WorkerView::default());
        let inner = self.read();
        let matched = inner.matched(hashes);
        for (o, worker) in out.iter_mut().zip(workers) {
            let Some(held) = inner.workers.get(worker) else {
                continue;
            };
            let pending = inner.pending_blocks.get(held.slot).copied().unwrap_or(0);
            *o = WorkerView {
                cached: matched.get(held.slot).copied().unwrap_or(0),
                pending,
                free: (held.capacity > 0)
                    .then(|| held.capacity.saturating_sub(held.hashes.len() + pending)),
            };
        }
    }

    /// Counts `hashes` as about to be held by `worker` until the returned guard drops.
    pub fn add_pending(self: &Arc<Self>, worker: WorkerId, hashes: &[PrefixHash]) -> Pending {
        let mut inner = self.write();
        let slot = inner.held(worker).slot;
        for &h in hashes {
            let count = inner.pending.entry((slot, h)).or_insert(0);
            *count += 1;
            if *count == 1 {
                inner.pending_holders.entry(h).or_default().set(slot);
                if inner.pending_blocks.len() <= slot {
                    inner.pending_blocks.resize(slot + 1, 0);
                }
                inner.pending_blocks[slot] += 1;
            }
        }
        Pending {
            index: self.clone(),
            slot,
            hashes: hashes.to_vec(),
        }
    }

    fn remove_pending(&self, slot: usize, hashes: &[PrefixHash]) {
        let mut inner = self.write();
        for &h in hashes {
            let Some(count) = inner.pending.get_mut(&(slot, h)) else {
                continue;
            };
            *count -= 1;
            if *count == 0 {
                inner.pending.remove(&(slot, h));
                inner.pending_blocks[slot] -= 1;
                unset(&mut inner.pending_holders, h, slot);
            }
        }
    }

    /// Records how many blocks `worker`'s cache holds at most (0: not known).
    pub fn set_capacity(&self, worker: WorkerId, capacity: usize) {
        self.write().held(worker).capacity = capacity;
    }

    /// Every worker's state, by worker id.
    pub fn workers(&self) -> Vec<WorkerIndex> {
        let inner = self.read();
        let mut out: Vec<WorkerIndex> = inner
            .workers
            .iter()
            .map(|(&worker, held)| WorkerIndex {
                worker,
                instance: held.instance.clone(),
                seq: held.seq,
                synced: held.synced,
                blocks: held.hashes.len(),
                digest: digest(&held.hashes),
            })
            .collect();
        out.sort_by_key(|w| w.worker);
        out
    }

    /// Prefixes held by any worker.
    pub fn len(&self) -> usize {
        self.read().holders.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(seq: u64, hashes: &[PrefixHash]) -> KvEvent {
        KvEvent::Stored {
            seq,
            hashes: hashes.to_vec(),
        }
    }

    #[test]
    fn overlaps_count_leading_blocks_per_worker() {
        let index = KvIndex::new();
        let req = block_hashes(&(0..64).collect::<Vec<u32>>(), 16);
        assert_eq!(req.len(), 4);
        index.snapshot(0, "a", 0, &req[..3]);
        index.snapshot(1, "b", 0, &[req[0], req[2], req[3]]);
        index.snapshot(2, "c", 0, &req[1..]);
        let mut out = Vec::new();
        index.overlaps(&req, &[0, 1, 2, 7], &mut out);
        // Worker 1 lacks block 1, so only its first block counts; worker 2 lacks block 0.
        assert_eq!(out, [3, 1, 0, 0]);
        index.apply(0, &stored(1, &req[3..]));
        index.overlaps(&req, &[0, 1], &mut out);
        assert_eq!(out, [4, 1]);
    }

    #[test]
    fn routed_requests_count_until_they_end() {
        let index = Arc::new(KvIndex::new());
        let req = block_hashes(&(0..48).collect::<Vec<u32>>(), 16);
        index.snapshot(0, "a", 0, &req[..1]);
        index.snapshot(1, "b", 0, &[]);
        let mut out = Vec::new();
        let first = index.add_pending(1, &req[..2]);
        let second = index.add_pending(1, &req[..2]);
        index.overlaps(&req, &[0, 1], &mut out);
        assert_eq!(out, [1, 2]);
        let mut views = Vec::new();
        index.view(&req, &[1], &mut views);
        assert_eq!(views[0].pending, 2, "shared blocks count once");
        assert_eq!(views[0].free, None, "capacity not known");
        index.set_capacity(1, 5);
        index.view(&req, &[1], &mut views);
        assert_eq!(views[0].free, Some(3));
        drop(first);
        index.overlaps(&req, &[0, 1], &mut out);
        assert_eq!(out, [1, 2], "the second request still counts");
        drop(second);
        index.overlaps(&req, &[0, 1], &mut out);
        assert_eq!(out, [1, 0]);
        index.view(&req, &[1], &mut views);
        assert_eq!((views[0].pending, views[0].free), (0, Some(5)));
        let _third = index.add_pending(1, &req);
        index.remove_worker(1);
        index.overlaps(&req, &[1], &mut out);
        assert_eq!(out, [0], "a removed worker's requests are forgotten");
    }

    #[test]
    fn many_workers_use_several_words() {
        let index = KvIndex::new();
        let req = block_hashes(&(0..48).collect::<Vec<u32>>(), 16);
        let workers: Vec<WorkerId> = (0..150).collect();
        for &w in &workers {
            let n = w as usize % 4;
            index.snapshot(w, "x", 0, &req[..n]);
        }
        let mut out = Vec::new();
        index.overlaps(&req, &workers, &mut out);
        for (&w, &o) in workers.iter().zip(&out) {
            assert_eq!(o, w as usize % 4, "worker {w}");
        }
        index.remove_worker(3);
        index.overlaps(&req, &[3], &mut out);
        assert_eq!(out, [0]);
    }

    #[test]
    fn a_gap_changes_nothing_and_a_snapshot_replaces_all() {
        let index = KvIndex::new();
        assert_eq!(
            index.apply(0, &stored(1, &[5])),
            Applied::Gap {
                expected: 1,
                got: 1
            },
            "no event before the first snapshot"
        );
        index.snapshot(0, "a", 10, &[1, 2]);
        assert_eq!(index.apply(0, &stored(11, &[3, 4])), Applied::Ok);
        let removed = KvEvent::Removed {
            seq: 13,
            hashes: vec![1],
        };
        assert_eq!(index.apply(0, &removed), Applied::Ok);
        assert_eq!(
            index.apply(0, &stored(20, &[9])),
            Applied::Gap {
                expected: 14,
                got: 20
            }
        );
        let w = &index.workers()[0];
        assert_eq!((w.seq, w.blocks), (13, 3));
        assert_eq!(w.digest, digest(&[2, 3, 4]));
        index.snapshot(0, "b", 0, &[7]);
        let w = &index.workers()[0];
        assert_eq!((w.instance.as_str(), w.blocks), ("b", 1));
        assert_eq!(index.len(), 1, "hashes of the old instance are gone");
    }
}
