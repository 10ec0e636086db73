//! Exact routing's decision at fleet scale: one request of 1056 tokens (a 1024-token shared
//! prefix and a question, 66 blocks of 16) routed over 64 workers whose exact index holds 192
//! such prefixes, each on 4 workers, plus 8 requests in flight per worker. Timed: hashing the
//! prompt's blocks, the index lookup for every worker, the cost and the choice (`select`,
//! which also counts the request as pending until its selection drops), and the lookup
//! alone. Baseline, in the same run: the approximate tree's `select` on the same request as
//! text, prefilled with the same prefixes.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokenrouter::gateway::kv_index::{block_hashes, KvIndex};
use tokenrouter::gateway::policy::{
    CacheAware, CacheAwareSettings, KvAware, KvAwareSettings, Policy, RouteRequest,
};
use tokenrouter::gateway::tree::WorkerId;
use tokenrouter::gateway::workers::{HealthPolicy, WorkerSet};

const WORKERS: usize = 64;
const PREFIXES: usize = 192;
const COPIES: usize = 4;
const BLOCK: usize = 16;

fn bench(c: &mut Criterion) {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let prefixes: Vec<Vec<u32>> = (0..PREFIXES)
        .map(|_| (0..1024).map(|_| rng.random_range(0..150_000)).collect())
        .collect();
    let set = WorkerSet::new(HealthPolicy::default());
    let workers: Vec<_> = (0..WORKERS)
        .map(|i| set.add(&format!("http://w{i}"), true))
        .collect();
    let ids: Vec<WorkerId> = workers.iter().map(|w| w.id).collect();
    let index = Arc::new(KvIndex::new());
    let mut held: Vec<Vec<u64>> = vec![Vec::new(); WORKERS];
    for (p, prefix) in prefixes.iter().enumerate() {
        for k in 0..COPIES {
            held[(p * 7 + k * 13) % WORKERS].extend(block_hashes(prefix, BLOCK));
        }
    }
    for (w, hashes) in held.iter().enumerate() {
        index.snapshot(ids[w], "bench", 0, hashes);
    }
    let (mut pending, mut loads) = (Vec::new(), Vec::new());
    for (w, &id) in ids.iter().enumerate() {
        for k in 0..8 {
            let blocks = block_hashes(&prefixes[(w + k * 31) % PREFIXES], BLOCK);
            pending.push(index.add_pending(id, &blocks));
            loads.push(set.start(&workers[w], 1));
        }
    }
    let exact = KvAware::new(index.clone(), KvAwareSettings::default());
    let tree = CacheAware::new(CacheAwareSettings::default(), 1);
    let text = |tokens: &[u32]| tokens.iter().map(|t| format!("{t} ")).collect::<String>();
    for (p, prefix) in prefixes.iter().enumerate() {
        for k in 0..COPIES {
            let w = (p * 7 + k * 13) % WORKERS;
            let one = [workers[w].clone()];
            tree.select(
                &one,
                &RouteRequest {
                    text: &text(prefix),
                    ..Default::default()
                },
            );
        }
    }
    let mut prompt = prefixes[17].clone();
    prompt.extend((0..32).map(|_| rng.random_range(0..150_000)));
    let prompt_text = text(&prompt);

    let mut group = c.benchmark_group("gateway_kv_index");
    group.bench_function("exact decision (hash + lookup + cost), 64 workers", |b| {
        b.iter(|| {
            let blocks = block_hashes(black_box(&prompt), BLOCK);
            let route = RouteRequest {
                text: "",
                blocks: Some(&blocks),
                prompt_tokens: prompt.len(),
                block_size: BLOCK,
            };
            black_box(exact.select(&workers, &route).index)
        })
    });
    let blocks = block_hashes(&prompt, BLOCK);
    let mut out = Vec::new();
    group.bench_function("index lookup alone, 64 workers", |b| {
        b.iter(|| {
            index.overlaps(black_box(&blocks), &ids, &mut out);
            black_box(out[0])
        })
    });
    group.bench_function("baseline: approximate tree select, 64 workers", |b| {
        b.iter(|| {
            let route = RouteRequest {
                text: black_box(&prompt_text),
                ..Default::default()
            };
            black_box(tree.select(&workers, &route).index)
        })
    });
    group.finish();
    drop((pending, loads));
}

criterion_group!(benches, bench);
criterion_main!(benches);
