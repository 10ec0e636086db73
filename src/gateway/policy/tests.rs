use std::sync::Arc;

use super::*;
use crate::gateway::workers::{HealthPolicy, InFlight, WorkerSet};

fn workers(n: usize) -> (WorkerSet, Vec<Arc<Worker>>) {
    let set = WorkerSet::new(HealthPolicy::default());
    let list = (0..n)
        .map(|i| set.add(&format!("http://w{i}"), true))
        .collect();
    (set, list)
}

/// Puts `load` requests in flight on a worker; they end when the guards drop.
fn load(set: &WorkerSet, w: &Arc<Worker>, load: usize) -> Vec<InFlight> {
    (0..load).map(|_| set.start(w, 1)).collect()
}

fn req(text: &str) -> RouteRequest<'_> {
    RouteRequest {
        text,
        ..RouteRequest::default()
    }
}

fn cache_aware(settings: CacheAwareSettings) -> CacheAware {
    CacheAware::new(settings, 7)
}

const SYSTEM_A: &str = "You are a careful assistant for the billing team. Answer in one line. ";
const SYSTEM_B: &str = "Eres un asistente que responde siempre en castellano y sin rodeos. ";

#[test]
fn round_robin_cycles_through_workers() {
    let (_, ws) = workers(3);
    let p = RoundRobin::default();
    let picks: Vec<usize> = (0..6).map(|_| p.select(&ws, &req("")).index).collect();
    assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
}

#[test]
fn shortest_queue_picks_the_fewest_in_flight() {
    let (set, ws) = workers(3);
    let _a = load(&set, &ws[0], 3);
    let _b = load(&set, &ws[1], 1);
    let _c = load(&set, &ws[2], 2);
    assert_eq!(ShortestQueue.select(&ws, &req("")).index, 1);
}

#[test]
fn power_of_two_never_picks_the_busier_of_two() {
    let (set, ws) = workers(2);
    let _a = load(&set, &ws[0], 5);
    let p = PowerOfTwo::new(1);
    assert!((0..50).all(|_| p.select(&ws, &req("")).index == 1));
}

#[test]
fn random_choice_is_seeded_and_covers_every_worker() {
    let (_, ws) = workers(3);
    let draw = |seed| -> Vec<usize> {
        let p = RandomChoice::new(seed);
        (0..60).map(|_| p.select(&ws, &req("")).index).collect()
    };
    assert_eq!(draw(3), draw(3));
    let picks = draw(3);
    assert!((0..3).all(|i| picks.contains(&i)));
}

#[test]
fn requests_sharing_a_prefix_follow_the_first_one() {
    let (set, ws) = workers(2);
    let p = cache_aware(CacheAwareSettings::default());
    let first = p
        .select(&ws, &req(&format!("{SYSTEM_A}question one")))
        .index;
    // Even when that worker is now somewhat busier, affinity wins below the balance threshold.
    let _busy = load(&set, &ws[first], 3);
    for q in ["question two", "question three"] {
        let s = p.select(&ws, &req(&format!("{SYSTEM_A}{q}")));
        assert_eq!(s.index, first);
        assert!(s.matched.unwrap().0 >= SYSTEM_A.chars().count());
    }
}

#[test]
fn a_miss_goes_to_the_least_loaded_worker() {
    let (set, ws) = workers(3);
    let p = cache_aware(CacheAwareSettings::default());
    let _a = load(&set, &ws[0], 2);
    let _b = load(&set, &ws[2], 1);
    let s = p.select(&ws, &req(SYSTEM_B));
    assert_eq!(s.index, 1);
    assert_eq!(s.matched.unwrap().0, 0);
    // A different group after it goes where the load is lowest, not where the tree is smallest.
    let _c = load(&set, &ws[1], 5);
    assert_eq!(p.select(&ws, &req("something else entirely")).index, 2);
}

#[test]
fn imbalance_overrides_cache_affinity() {
    let (set, ws) = workers(2);
    let settings = CacheAwareSettings {
        balance_abs_threshold: 4,
        balance_rel_threshold: 1.5,
        ..Default::default()
    };
    let p = cache_aware(settings);
    let first = p.select(&ws, &req(&format!("{SYSTEM_A}q1"))).index;
    let _busy = load(&set, &ws[first], 8);
    let s = p.select(&ws, &req(&format!("{SYSTEM_A}q2")));
    assert_eq!(s.index, 1 - first, "8 vs 0 in flight is imbalanced");
    // The text was recorded for the worker that took it, so both now hold the prefix.
    let found = p.tree.prefix_match(SYSTEM_A);
    assert_eq!(found.matched.len(), 2);
}

#[test]
fn cache_routing_probability_zero_routes_by_load_only() {
    let (set, ws) = workers(2);
    let settings = CacheAwareSettings {
        cache_routing_prob: 0.0,
        ..Default::default()
    };
    let p = cache_aware(settings);
    let first = p.select(&ws, &req(SYSTEM_A)).index;
    let _busy = load(&set, &ws[first], 1);
    assert_eq!(p.select(&ws, &req(SYSTEM_A)).index, 1 - first);
}

#[test]
fn a_removed_worker_is_forgotten_by_the_tree() {
    let (_, ws) = workers(2);
    let p = cache_aware(CacheAwareSettings::default());
    let first = p.select(&ws, &req(SYSTEM_A)).index;
    p.remove_worker(ws[first].id);
    assert!(p.tree_sizes().iter().all(|(id, _)| *id != ws[first].id));
    let rest = [ws[1 - first].clone()];
    assert_eq!(p.select(&rest, &req(SYSTEM_A)).matched.unwrap().0, 0);
}

#[test]
fn maintenance_trims_the_tree_to_its_budget() {
    let (_, ws) = workers(1);
    let settings = CacheAwareSettings {
        max_tree_size: 100,
        ..Default::default()
    };
    let p = cache_aware(settings);
    for i in 0..20 {
        p.select(&ws, &req(&format!("{i:03} {SYSTEM_B}")));
    }
    assert!(p.maintain().is_some());
    assert!(p.tree_sizes()[0].1 <= 100);
}

#[test]
fn policy_names_parse_back() {
    for kind in [
        PolicyKind::Random,
        PolicyKind::RoundRobin,
        PolicyKind::ShortestQueue,
        PolicyKind::PowerOfTwo,
        PolicyKind::CacheAware,
    ] {
        assert_eq!(kind.name().parse::<PolicyKind>(), Ok(kind));
    }
    assert!("fastest"
        .parse::<PolicyKind>()
        .unwrap_err()
        .contains("cache_aware"));
}

#[test]
fn kv_aware_weighs_prefill_left_against_load() {
    use crate::gateway::kv_index::{block_hashes, KvIndex};
    let (set, ws) = workers(3);
    let index = Arc::new(KvIndex::new());
    let p = KvAware::new(index.clone(), KvAwareSettings::default());
    let tokens: Vec<u32> = (0..160).collect();
    let blocks = block_hashes(&tokens, 16);
    let route = RouteRequest {
        text: "",
        blocks: Some(&blocks),
        prompt_tokens: 160,
        block_size: 16,
    };
    // Nothing cached anywhere: the least-loaded worker.
    let _busy = set.start(&ws[0], 4);
    assert_eq!(p.select(&ws, &route).index, 1);
    // Worker 2 holds 8 of the 10 blocks: 2 to prefill plus 0 load beats 10 plus 0.
    index.snapshot(ws[2].id, "w2", 0, &blocks[..8]);
    let s = p.select(&ws, &route);
    assert_eq!((s.index, s.matched), (2, Some((128, 160))));
    drop(s);
    // Load on worker 2 beyond what its 8 blocks save (4 x 8) sends the request elsewhere.
    let heavy = set.start(&ws[2], 33);
    assert_eq!(p.select(&ws, &route).index, 1);
    drop(heavy);
    // Untokenized requests go by load.
    assert_eq!(p.select(&ws, &req("x")).index, 1);
}

#[test]
fn kv_aware_counts_the_blocks_a_full_cache_would_evict() {
    use crate::gateway::kv_index::{block_hashes, KvIndex};
    let (_, ws) = workers(2);
    let index = Arc::new(KvIndex::new());
    let p = KvAware::new(index.clone(), KvAwareSettings::default());
    let blocks = block_hashes(&(0..160).collect::<Vec<u32>>(), 16);
    let route = RouteRequest {
        text: "",
        blocks: Some(&blocks),
        prompt_tokens: 160,
        block_size: 16,
    };
    // Worker 0 holds the first block: 4 x 9 blocks to prefill against 4 x 10 on worker 1.
    index.snapshot(ws[0].id, "w0", 0, &blocks[..1]);
    assert_eq!(p.select(&ws, &route).index, 0);
    // In a cache of 2 blocks, 8 of its 9 new ones would evict: 36 + 8 against 40.
    index.set_capacity(ws[0].id, 2);
    assert_eq!(p.select(&ws, &route).index, 1);
    index.set_capacity(ws[0].id, 64);
    assert_eq!(p.select(&ws, &route).index, 0);
}
