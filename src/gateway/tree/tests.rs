use super::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::sync::Barrier;

/// Sizes recomputed by walking the nodes directly, independently of `evict`.
fn recount(tree: &RadixTree) -> Vec<(WorkerId, usize)> {
    fn walk(node: &Node, sizes: &mut HashMap<WorkerId, usize>) {
        for child in node.children.iter() {
            let len = child.label_len();
            for (w, _) in read(&child.tenants).iter() {
                *sizes.entry(*w).or_insert(0) += len;
            }
            walk(child.value(), sizes);
        }
    }
    let mut sizes = HashMap::new();
    walk(&tree.root, &mut sizes);
    let mut sizes: Vec<_> = sizes.into_iter().filter(|&(_, n)| n > 0).collect();
    sizes.sort_unstable();
    sizes
}

/// Every tenant of a node is a tenant of its parent, and every node has a tenant.
fn assert_tenant_invariant(tree: &RadixTree) {
    let slots = tree.snapshot();
    for slot in &slots[1..] {
        let tenants: Vec<WorkerId> = read(&slot.node.tenants).iter().map(|t| t.0).collect();
        assert!(!tenants.is_empty(), "node without tenant");
        if slot.parent != 0 {
            let parent = &slots[slot.parent].node;
            for w in tenants {
                assert!(parent.has_tenant(w), "worker {w} missing on an ancestor");
            }
        }
    }
}

fn chars_of(m: &PrefixMatch, w: WorkerId) -> usize {
    m.matched
        .iter()
        .find(|(x, _)| *x == w)
        .map_or(0, |&(_, n)| n)
}

#[test]
fn tree_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<RadixTree>();
    check::<Arc<RadixTree>>();
}

#[test]
fn match_of_inserted_text_is_whole() {
    let tree = RadixTree::new();
    tree.insert("hello world", 1);
    let m = tree.prefix_match("hello world");
    assert_eq!(m.text_chars, 11);
    assert_eq!(m.matched, vec![(1, 11)]);
    assert_eq!(m.best(), Some((1, 1.0)));
    assert_eq!(m.ratio(1), 1.0);
    assert_eq!(m.ratio(2), 0.0);
}

#[test]
fn partial_match_counts_common_chars() {
    let tree = RadixTree::new();
    tree.insert("hello world", 1);
    let m = tree.prefix_match("help me");
    assert_eq!(m.text_chars, 7);
    assert_eq!(m.matched, vec![(1, 3)]);
    assert!((m.ratio(1) - 3.0 / 7.0).abs() < 1e-12);
    let shorter = tree.prefix_match("hello");
    assert_eq!(shorter.matched, vec![(1, 5)]);
}

#[test]
fn empty_text_matches_nothing_and_inserts_nothing() {
    let tree = RadixTree::new();
    tree.insert("", 1);
    assert_eq!(tree.node_count(), 0);
    assert!(tree.sizes().is_empty());
    tree.insert("abc", 1);
    let m = tree.prefix_match("");
    assert_eq!(m, PrefixMatch::default());
    assert_eq!(m.best(), None);
    assert_eq!(m.ratio(1), 0.0);
}

#[test]
fn miss_on_first_char_matches_nothing() {
    let tree = RadixTree::new();
    tree.insert("abc", 1);
    let m = tree.prefix_match("xyz");
    assert_eq!(m.text_chars, 3);
    assert!(m.matched.is_empty());
    assert_eq!(m.best(), None);
}

#[test]
fn split_keeps_both_workers() {
    let tree = RadixTree::new();
    tree.insert("abcdef", 1);
    tree.insert("abcxyz", 2);
    assert_eq!(tree.node_count(), 3);
    assert_eq!(tree.prefix_match("abcdef").matched, vec![(1, 6), (2, 3)]);
    assert_eq!(tree.prefix_match("abcxyz").matched, vec![(2, 6), (1, 3)]);
    assert_eq!(tree.prefix_match("abc").matched, vec![(1, 3), (2, 3)]);
    assert_eq!(tree.sizes(), vec![(1, 6), (2, 6)]);
    assert_tenant_invariant(&tree);
}

#[test]
fn text_that_is_a_prefix_of_an_edge_splits_it() {
    let tree = RadixTree::new();
    tree.insert("abcdef", 1);
    tree.insert("abc", 2);
    assert_eq!(tree.node_count(), 2);
    assert_eq!(tree.prefix_match("abcdef").matched, vec![(1, 6), (2, 3)]);
    assert_eq!(tree.sizes(), vec![(1, 6), (2, 3)]);
    assert_eq!(tree.sizes(), recount(&tree));
}

#[test]
fn deepest_worker_wins_and_others_get_their_share() {
    let tree = RadixTree::new();
    tree.insert("hello world", 1);
    tree.insert("hello there", 2);
    let m = tree.prefix_match("hello world!");
    assert_eq!(m.text_chars, 12);
    assert_eq!(m.matched, vec![(1, 11), (2, 6)]);
    assert_eq!(m.best().map(|b| b.0), Some(1));
}

#[test]
fn ties_are_ordered_by_worker_id() {
    let tree = RadixTree::new();
    tree.insert("same text", 7);
    tree.insert("same text", 3);
    tree.insert("same text", 5);
    let m = tree.prefix_match("same text");
    assert_eq!(m.matched, vec![(3, 9), (5, 9), (7, 9)]);
}

#[test]
fn unicode_text_is_matched_by_chars() {
    let tree = RadixTree::new();
    tree.insert("你好，世界🌍!", 1);
    tree.insert("你好，朋友😀", 2);
    let m = tree.prefix_match("你好，世界🌍?");
    assert_eq!(m.text_chars, 7);
    assert_eq!(m.matched, vec![(1, 6), (2, 3)]);
    assert_eq!(tree.worker_chars(1), 7);
    assert_eq!(tree.worker_chars(2), 6);
    assert_eq!(tree.prefix_match("🌍").matched, vec![]);
}

#[test]
fn reinserting_does_not_grow() {
    let tree = RadixTree::new();
    tree.insert("system prompt: be nice", 1);
    tree.insert("system prompt: be brief", 1);
    let nodes = tree.node_count();
    let sizes = tree.sizes();
    for _ in 0..3 {
        tree.insert("system prompt: be nice", 1);
        tree.insert("system prompt", 1);
    }
    assert_eq!(
        tree.node_count(),
        nodes + 1,
        "only the split at 'system prompt'"
    );
    assert_eq!(tree.sizes(), sizes);
    assert_eq!(tree.sizes(), recount(&tree));
}

#[test]
fn eviction_removes_least_recent_first_until_under_limit() {
    let tree = RadixTree::new();
    tree.insert("aaaa", 1);
    tree.insert("bbbb", 1);
    tree.insert("cccc", 1);
    assert_eq!(tree.worker_chars(1), 12);
    assert_eq!(tree.evict(8), 4);
    assert_eq!(tree.worker_chars(1), 8);
    assert!(tree.prefix_match("aaaa").matched.is_empty());
    assert_eq!(tree.prefix_match("bbbb").matched, vec![(1, 4)]);
    assert_eq!(tree.prefix_match("cccc").matched, vec![(1, 4)]);
    assert_eq!(tree.node_count(), 2);
}

#[test]
fn eviction_follows_recency_not_insertion_order() {
    let tree = RadixTree::new();
    tree.insert("aaaa", 1);
    tree.insert("bbbb", 1);
    tree.insert("aaaa", 1); // refreshes "aaaa"
    assert_eq!(tree.evict(4), 4);
    assert_eq!(tree.prefix_match("aaaa").matched, vec![(1, 4)]);
    assert!(tree.prefix_match("bbbb").matched.is_empty());
}

#[test]
fn eviction_climbs_to_parents_once_their_leaves_are_gone() {
    let tree = RadixTree::new();
    tree.insert("shared-x", 1);
    tree.insert("shared-y", 1);
    tree.insert("other", 1);
    // 7 ("shared-") + 1 + 1 + 5 = 14; keep only "other".
    assert_eq!(tree.worker_chars(1), 14);
    assert_eq!(tree.evict(5), 9);
    assert_eq!(tree.node_count(), 1);
    assert_eq!(tree.prefix_match("other").matched, vec![(1, 5)]);
    assert_eq!(tree.sizes(), vec![(1, 5)]);
}

#[test]
fn eviction_of_one_worker_keeps_the_shared_path_of_others() {
    let tree = RadixTree::new();
    tree.insert("shared-a", 1); // worker 1's oldest
    tree.insert("shared-b", 2);
    tree.insert("zzzzzzzzzz", 1);
    assert_eq!(tree.sizes(), vec![(1, 18), (2, 8)]);
    // Worker 1 loses "a", then "shared-" becomes its oldest leaf and goes too.
    assert_eq!(tree.evict(10), 1 + 7);
    assert_eq!(tree.sizes(), vec![(1, 10), (2, 8)]);
    assert_eq!(tree.prefix_match("shared-b").matched, vec![(2, 8)]);
    assert_eq!(tree.prefix_match("shared-a").matched, vec![(2, 7)]);
    assert_eq!(tree.prefix_match("zzzzzzzzzz").matched, vec![(1, 10)]);
    assert_eq!(
        tree.node_count(),
        3,
        "\"shared-\", \"b\" and \"zzzzzzzzzz\""
    );
    assert_eq!(tree.sizes(), recount(&tree));
    assert_tenant_invariant(&tree);
}

#[test]
fn eviction_to_zero_empties_the_tree() {
    let tree = RadixTree::new();
    tree.insert("abc", 1);
    tree.insert("abd", 2);
    assert_eq!(tree.evict(0), 2 + 1 + 2 + 1);
    assert_eq!(tree.node_count(), 0);
    assert!(tree.sizes().is_empty());
    assert_eq!(tree.evict(0), 0);
}

#[test]
fn remove_worker_forgets_it_and_prunes_nodes() {
    let tree = RadixTree::new();
    tree.insert("common prefix then one", 1);
    tree.insert("common prefix then two", 2);
    tree.insert("only one", 1);
    tree.remove_worker(1);
    assert_eq!(tree.worker_chars(1), 0);
    assert_eq!(tree.sizes(), vec![(2, 22)]);
    assert!(tree.prefix_match("only one").matched.is_empty());
    assert_eq!(
        tree.prefix_match("common prefix then one").matched,
        vec![(2, 19)]
    );
    assert_eq!(tree.node_count(), 2, "shared mid node and worker 2's leaf");
    tree.remove_worker(2);
    assert_eq!(tree.node_count(), 0);
    assert!(tree.sizes().is_empty());
}

#[test]
fn sizes_match_a_recount() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let tree = RadixTree::new();
    for _ in 0..500 {
        let len = rng.random_range(1..20);
        let text: String = (0..len)
            .map(|_| ['a', 'b', 'é', '字'][rng.random_range(0..4)])
            .collect();
        tree.insert(&text, rng.random_range(0..4));
    }
    assert_eq!(tree.sizes(), recount(&tree));
    for (w, n) in tree.sizes() {
        assert_eq!(tree.worker_chars(w), n);
    }
    tree.evict(30);
    assert_eq!(tree.sizes(), recount(&tree));
    assert!(tree.sizes().iter().all(|&(_, n)| n <= 30));
    assert_tenant_invariant(&tree);
}

fn random_text(rng: &mut ChaCha8Rng, alphabet: &[char], max_len: usize) -> String {
    let len = rng.random_range(0..=max_len);
    (0..len)
        .map(|_| alphabet[rng.random_range(0..alphabet.len())])
        .collect()
}

#[test]
fn prefix_match_agrees_with_a_naive_scan() {
    let alphabet = ['a', 'b', 'c', 'ß'];
    for seed in 0..20 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let tree = RadixTree::new();
        let mut stored: Vec<(WorkerId, Vec<char>)> = Vec::new();
        for _ in 0..rng.random_range(1..60) {
            let text = random_text(&mut rng, &alphabet, 12);
            let w = rng.random_range(0..4);
            tree.insert(&text, w);
            stored.push((w, text.chars().collect()));
        }
        for _ in 0..200 {
            let query = random_text(&mut rng, &alphabet, 14);
            let q: Vec<char> = query.chars().collect();
            let mut naive: HashMap<WorkerId, usize> = HashMap::new();
            for (w, s) in &stored {
                let n = s.iter().zip(&q).take_while(|(a, b)| a == b).count();
                let e = naive.entry(*w).or_insert(0);
                *e = (*e).max(n);
            }
            let mut expected: Vec<_> = naive.into_iter().filter(|&(_, n)| n > 0).collect();
            expected.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
            let got = tree.prefix_match(&query);
            assert_eq!(got.text_chars, q.len());
            assert_eq!(got.matched, expected, "seed {seed} query {query:?}");
        }
        assert_eq!(tree.sizes(), recount(&tree));
        assert_tenant_invariant(&tree);
    }
}

/// One thread of the concurrency test: a seeded mix of inserts, matches and evictions on
/// shared prompts, then (after the barrier, with no more evictions anywhere) inserts and
/// matches only. Returns the texts inserted in the second phase.
fn mixed_worker(tree: &RadixTree, barrier: &Barrier, worker: WorkerId) -> Vec<String> {
    let mut rng = ChaCha8Rng::seed_from_u64(100 + u64::from(worker));
    let text = |rng: &mut ChaCha8Rng| {
        let prompt = rng.random_range(0..3);
        let tail = random_text(rng, &['x', 'y', 'z', '✓'], 8);
        format!("system prompt {prompt}: {tail}")
    };
    for _ in 0..3000 {
        let s = text(&mut rng);
        match rng.random_range(0..100) {
            0..50 => tree.insert(&s, worker),
            50..98 => {
                let m = tree.prefix_match(&s);
                assert!(m.matched.iter().all(|&(_, n)| n <= m.text_chars));
            }
            _ => {
                tree.evict(rng.random_range(20..200));
            }
        }
    }
    barrier.wait();
    let mut kept = Vec::new();
    for _ in 0..500 {
        let s = text(&mut rng);
        if rng.random_bool(0.5) {
            tree.insert(&s, worker);
            kept.push(s);
        } else {
            tree.prefix_match(&s);
        }
    }
    kept
}

#[test]
fn concurrent_inserts_matches_and_evictions_stay_consistent() {
    const THREADS: u32 = 4;
    let tree = RadixTree::new();
    let barrier = Barrier::new(THREADS as usize);
    let kept: Vec<Vec<String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|w| {
                let (tree, barrier) = (&tree, &barrier);
                s.spawn(move || mixed_worker(tree, barrier, w))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("worker thread panicked"))
            .collect()
    });
    // Incremental counting is exact in this design; evict's recount must agree too.
    assert_eq!(tree.sizes(), recount(&tree), "incremental sizes drifted");
    assert_eq!(tree.evict(usize::MAX), 0);
    assert_eq!(tree.sizes(), recount(&tree));
    assert_tenant_invariant(&tree);
    for (worker, texts) in kept.iter().enumerate() {
        for s in texts {
            let m = tree.prefix_match(s);
            assert_eq!(chars_of(&m, worker as WorkerId), m.text_chars, "{s:?}");
        }
    }
}
