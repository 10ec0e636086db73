//! Approximate, concurrent radix tree over raw request text, shared by every worker the gateway
//! balances over.
//!
//! Owns: which backend worker ("tenant") is believed to hold which prefix of past request text
//! in its KV cache, with a last-access time per tenant and node, and the number of characters
//! each worker holds. Text is compared by Unicode `char`, with no tokenizer.
//!
//! Guarantees:
//! * A tenant of a node is a tenant of all its ancestors; `prefix_match` relies on it.
//! * Inserts run in parallel with each other: they take the structure lock shared and then only
//!   the per-child entry lock of the node they are at. [`RadixTree::evict`] and
//!   [`RadixTree::remove_worker`] remove nodes and take the structure lock exclusively.
//! * [`RadixTree::prefix_match`] takes no global lock: it only reads map shards and the
//!   label / tenant locks of single nodes, each for a moment. A node that is concurrently split
//!   or removed gives a slightly stale, under-estimated answer, never a panic or corruption. The
//!   answer is a routing hint, not a promise.
//! * Memory is bounded by the caller calling [`RadixTree::evict`], which drops the least
//!   recently inserted leaves of each worker above a character budget and recounts the per-worker
//!   sizes exactly.
//!
//! Must not know: HTTP, workers' URLs or health, tokenizers, or how the ratio is weighed against
//! load; workers are plain [`WorkerId`]s.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use dashmap::mapref::entry::Entry;
use dashmap::DashMap;

/// A backend worker, as numbered by the gateway.
pub type WorkerId = u32;

/// Shards of an inner node's child map: few, to keep per-node memory down.
const NODE_SHARDS: usize = 4;
/// Shards of the root's child map, where every request starts.
const ROOT_SHARDS: usize = 32;

/// Characters of the request that matched, per worker holding a prefix of it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PrefixMatch {
    /// Chars in the request text.
    pub text_chars: usize,
    /// (worker, chars of the text matched by what that worker holds), longest first; ties by
    /// worker id ascending. Workers with 0 matched are absent.
    pub matched: Vec<(WorkerId, usize)>,
}

impl PrefixMatch {
    /// Best worker and its match ratio (matched / text_chars, 0.0 for empty text), if any.
    pub fn best(&self) -> Option<(WorkerId, f64)> {
        self.matched
            .first()
            .map(|&(worker, chars)| (worker, self.ratio_of(chars)))
    }

    /// Ratio for one worker (0.0 if absent).
    pub fn ratio(&self, worker: WorkerId) -> f64 {
        self.matched
            .iter()
            .find(|(w, _)| *w == worker)
            .map_or(0.0, |&(_, chars)| self.ratio_of(chars))
    }

    fn ratio_of(&self, chars: usize) -> f64 {
        if self.text_chars == 0 {
            0.0
        } else {
            chars as f64 / self.text_chars as f64
        }
    }
}

fn read<T: ?Sized>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<T: ?Sized>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}

/// Length of the common prefix of `label` and `text`, in chars and in bytes of `text`.
fn common_prefix(label: &[char], text: &str) -> (usize, usize) {
    let mut chars = 0;
    let mut bytes = 0;
    for (a, b) in label.iter().zip(text.chars()) {
        if *a != b {
            break;
        }
        chars += 1;
        bytes += b.len_utf8();
    }
    (chars, bytes)
}

/// One edge of the tree and the node below it.
struct Node {
    /// Edge label; a split shortens it (only under the parent's entry lock for it).
    label: RwLock<Arc<[char]>>,
    /// Children keyed by the first char of their label.
    children: DashMap<char, Arc<Node>>,
    /// Workers holding this node's text, with their last access (logical clock).
    tenants: RwLock<Vec<(WorkerId, AtomicU64)>>,
}

impl Node {
    fn new(label: Arc<[char]>, tenants: Vec<(WorkerId, AtomicU64)>, shards: usize) -> Self {
        Node {
            label: RwLock::new(label),
            children: DashMap::with_shard_amount(shards),
            tenants: RwLock::new(tenants),
        }
    }

    fn label(&self) -> Arc<[char]> {
        Arc::clone(&read(&self.label))
    }

    fn label_len(&self) -> usize {
        read(&self.label).len()
    }

    fn last_access(&self, worker: WorkerId) -> Option<u64> {
        read(&self.tenants)
            .iter()
            .find(|(w, _)| *w == worker)
            .map(|(_, t)| t.load(Ordering::Relaxed))
    }

    fn has_tenant(&self, worker: WorkerId) -> bool {
        self.last_access(worker).is_some()
    }

    /// Refreshes `worker`'s access time, adding it as a tenant if needed; true if it was added.
    fn touch(&self, worker: WorkerId, now: u64) -> bool {
        let refresh =
            |tenants: &[(WorkerId, AtomicU64)]| match tenants.iter().find(|(w, _)| *w == worker) {
                Some((_, t)) => {
                    t.fetch_max(now, Ordering::Relaxed);
                    true
                }
                None => false,
            };
        if refresh(&read(&self.tenants)) {
            return false;
        }
        let mut tenants = write(&self.tenants);
        if refresh(&tenants) {
            return false;
        }
        tenants.push((worker, AtomicU64::new(now)));
        true
    }

    /// Removes `worker` from the tenants; returns true if no tenant is left.
    fn remove_tenant(&self, worker: WorkerId) -> bool {
        let mut tenants = write(&self.tenants);
        tenants.retain(|(w, _)| *w != worker);
        tenants.is_empty()
    }

    fn tenants_copy(&self) -> Vec<(WorkerId, AtomicU64)> {
        read(&self.tenants)
            .iter()
            .map(|(w, t)| (*w, AtomicU64::new(t.load(Ordering::Relaxed))))
            .collect()
    }

    /// Splits `self` (whose label is `label`) after `k` chars: returns the new mid node holding
    /// the first `k` chars, the same tenants and `self` as its only child. The caller replaces
    /// `self` by the mid node in the parent while still holding the parent's entry lock.
    fn split(self: &Arc<Self>, label: &[char], k: usize) -> Node {
        let mid = Node::new(label[..k].into(), self.tenants_copy(), NODE_SHARDS);
        *write(&self.label) = label[k..].into();
        mid.children.insert(label[k], Arc::clone(self));
        mid
    }
}

/// A node seen by a traversal under the exclusive structure lock.
struct Slot {
    node: Arc<Node>,
    /// Index of the parent slot (`usize::MAX` for the root); always below the slot's own.
    parent: usize,
    /// Key of the node in its parent's children.
    key: char,
    children: Vec<usize>,
}

/// The shared radix tree; see the module header.
pub struct RadixTree {
    root: Arc<Node>,
    /// Shared by inserts, exclusive for evict / remove_worker (which remove nodes).
    structure: RwLock<()>,
    /// Logical clock, one tick per insert.
    clock: AtomicU64,
    /// Chars held per worker; incremental on insert, recounted exactly by `evict`.
    sizes: DashMap<WorkerId, usize>,
}

impl Default for RadixTree {
    fn default() -> Self {
        Self::new()
    }
}

impl RadixTree {
    pub fn new() -> Self {
        RadixTree {
            root: Arc::new(Node::new(Arc::from(Vec::new()), Vec::new(), ROOT_SHARDS)),
            structure: RwLock::new(()),
            clock: AtomicU64::new(0),
            sizes: DashMap::new(),
        }
    }

    /// Records that `worker` now holds `text` (and so every prefix of it); refreshes the
    /// worker's last-access time on every node of the path.
    pub fn insert(&self, text: &str, worker: WorkerId) {
        if text.is_empty() {
            return;
        }
        let _shared = read(&self.structure);
        let now = self.clock.fetch_add(1, Ordering::Relaxed) + 1;
        let mut node = Arc::clone(&self.root);
        let mut rest = text;
        while let Some(first) = rest.chars().next() {
            match self.insert_step(&node, first, rest, worker, now) {
                Some((child, bytes)) => {
                    node = child;
                    rest = &rest[bytes..];
                }
                None => break,
            }
        }
    }

    /// One step of `insert` under the entry lock of `parent`'s child starting with `first`.
    /// Returns the child to descend into and the bytes of `rest` it covers, or `None` when
    /// `rest` was stored whole as a new leaf.
    fn insert_step(
        &self,
        parent: &Node,
        first: char,
        rest: &str,
        worker: WorkerId,
        now: u64,
    ) -> Option<(Arc<Node>, usize)> {
        match parent.children.entry(first) {
            Entry::Vacant(slot) => {
                let label: Arc<[char]> = rest.chars().collect();
                self.grow(worker, label.len());
                let tenants = vec![(worker, AtomicU64::new(now))];
                slot.insert(Arc::new(Node::new(label, tenants, NODE_SHARDS)));
                None
            }
            Entry::Occupied(mut slot) => {
                let child = Arc::clone(slot.get());
                let label = child.label();
                let (k, bytes) = common_prefix(&label, rest);
                // The key is the label's first char and labels change only under this lock.
                debug_assert!(k > 0, "child label does not start with its key");
                if k == 0 {
                    return None;
                }
                let child = if k < label.len() {
                    let mid = Arc::new(child.split(&label, k));
                    slot.insert(Arc::clone(&mid));
                    mid
                } else {
                    child
                };
                // Still under the entry lock, so a later split of `child` copies `worker`.
                if child.touch(worker, now) {
                    self.grow(worker, k);
                }
                Some((child, bytes))
            }
        }
    }

    fn grow(&self, worker: WorkerId, chars: usize) {
        *self.sizes.entry(worker).or_insert(0) += chars;
    }

    /// How much of `text` each worker holds as a prefix. Takes no global lock, so it never
    /// waits for an insert, evict or remove_worker beyond a per-node moment.
    pub fn prefix_match(&self, text: &str) -> PrefixMatch {
        let text_chars = text.chars().count();
        let mut matched: Vec<(WorkerId, usize)> = Vec::new();
        let mut node = Arc::clone(&self.root);
        let mut rest = text;
        let mut depth = 0;
        while let Some(first) = rest.chars().next() {
            let Some(child) = node.children.get(&first).map(|c| Arc::clone(c.value())) else {
                break;
            };
            let label = child.label();
            let (k, bytes) = common_prefix(&label, rest);
            if k == 0 {
                break; // split or removed under our feet: stop with what we have
            }
            depth += k;
            for (worker, _) in read(&child.tenants).iter() {
                match matched.iter_mut().find(|(w, _)| w == worker) {
                    Some((_, chars)) => *chars = depth,
                    None => matched.push((*worker, depth)),
                }
            }
            if k < label.len() {
                break;
            }
            rest = &rest[bytes..];
            node = child;
        }
        matched.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        PrefixMatch {
            text_chars,
            matched,
        }
    }

    /// All nodes, root first, each after its parent (breadth first).
    fn snapshot(&self) -> Vec<Slot> {
        let mut slots = vec![Slot {
            node: Arc::clone(&self.root),
            parent: usize::MAX,
            key: '\0',
            children: Vec::new(),
        }];
        let mut i = 0;
        while i < slots.len() {
            let children: Vec<(char, Arc<Node>)> = slots[i]
                .node
                .children
                .iter()
                .map(|e| (*e.key(), Arc::clone(e.value())))
                .collect();
            for (key, node) in children {
                let index = slots.len();
                slots[i].children.push(index);
                slots.push(Slot {
                    node,
                    parent: i,
                    key,
                    children: Vec::new(),
                });
            }
            i += 1;
        }
        slots
    }

    /// Removes the slot's node from its parent's children (if it is still there).
    fn unlink(slots: &[Slot], index: usize) {
        let slot = &slots[index];
        slots[slot.parent]
            .node
            .children
            .remove_if(&slot.key, |_, n| Arc::ptr_eq(n, &slot.node));
    }

    /// Evicts least-recently-used leaves of each worker until that worker holds at most
    /// `max_chars` chars; returns chars evicted in total. Also recomputes the per-worker sizes
    /// exactly.
    pub fn evict(&self, max_chars: usize) -> usize {
        let _exclusive = write(&self.structure);
        let slots = self.snapshot();
        let mut exact: BTreeMap<WorkerId, usize> = BTreeMap::new();
        for slot in &slots[1..] {
            let len = slot.node.label_len();
            for (worker, _) in read(&slot.node.tenants).iter() {
                *exact.entry(*worker).or_insert(0) += len;
            }
        }
        let mut evicted = 0;
        for (&worker, size) in exact.iter_mut() {
            if *size > max_chars {
                let freed = Self::evict_worker(&slots, worker, *size - max_chars);
                *size -= freed;
                evicted += freed;
            }
        }
        self.sizes.clear();
        for (worker, size) in exact {
            if size > 0 {
                self.sizes.insert(worker, size);
            }
        }
        evicted
    }

    /// Drops `worker`'s least recently used leaves until at least `excess` chars are freed (or
    /// nothing is left); returns the chars freed. Caller holds the exclusive structure lock.
    fn evict_worker(slots: &[Slot], worker: WorkerId, excess: usize) -> usize {
        let mut has: Vec<bool> = slots.iter().map(|s| s.node.has_tenant(worker)).collect();
        has[0] = false;
        let is_leaf = |i: usize, has: &[bool]| has[i] && slots[i].children.iter().all(|&c| !has[c]);
        let stamp = |i: usize| slots[i].node.last_access(worker).unwrap_or(0);
        let mut heap: BinaryHeap<Reverse<(u64, usize)>> = (1..slots.len())
            .filter(|&i| is_leaf(i, &has))
            .map(|i| Reverse((stamp(i), i)))
            .collect();
        let mut freed = 0;
        while freed < excess {
            let Some(Reverse((_, i))) = heap.pop() else {
                break;
            };
            let slot = &slots[i];
            freed += slot.node.label_len();
            if slot.node.remove_tenant(worker) {
                Self::unlink(slots, i);
            }
            has[i] = false;
            if slot.parent != 0 && is_leaf(slot.parent, &has) {
                heap.push(Reverse((stamp(slot.parent), slot.parent)));
            }
        }
        freed
    }

    /// Forgets a worker everywhere (nodes left with no tenant are removed).
    pub fn remove_worker(&self, worker: WorkerId) {
        let _exclusive = write(&self.structure);
        let slots = self.snapshot();
        // Children come after their parent, so walking backwards prunes bottom-up.
        for i in (1..slots.len()).rev() {
            if slots[i].node.remove_tenant(worker) {
                Self::unlink(&slots, i);
            }
        }
        self.sizes.remove(&worker);
    }

    /// Chars held by one worker (sum of the edge lengths of the nodes it is a tenant of).
    pub fn worker_chars(&self, worker: WorkerId) -> usize {
        self.sizes.get(&worker).map_or(0, |s| *s.value())
    }

    /// (worker, chars) for every worker with anything in the tree, sorted by worker id.
    pub fn sizes(&self) -> Vec<(WorkerId, usize)> {
        let mut sizes: Vec<(WorkerId, usize)> = self
            .sizes
            .iter()
            .map(|e| (*e.key(), *e.value()))
            .filter(|&(_, chars)| chars > 0)
            .collect();
        sizes.sort_unstable();
        sizes
    }

    /// Number of nodes (root excluded) — for tests/metrics.
    pub fn node_count(&self) -> usize {
        self.snapshot().len() - 1
    }
}

#[cfg(test)]
mod tests;
