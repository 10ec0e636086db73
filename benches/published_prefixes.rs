//! Publishing a model's cached prefixes after a step that changed them: a pool whose blocks
//! are all cached (as on a busy server, 2048 and 8192 blocks), where each step fills one new
//! block (allocating it evicts the least recently used prefix, registering it adds one) and
//! then publishes, as the worker does after every step.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use tokenrouter::scheduler::{chain_hash, BlockPool, PublishedPrefixes};

fn publish(c: &mut Criterion) {
    let mut group = c.benchmark_group("publish_after_one_new_block");
    for blocks in [2048usize, 8192] {
        let mut pool = BlockPool::new(blocks);
        let published = PublishedPrefixes::default();
        let mut next = 0u32;
        let mut fill = |pool: &mut BlockPool| {
            let id = pool.allocate().expect("every block is free or evictable");
            pool.register(id, chain_hash(None, &[next]));
            pool.release(id);
            next += 1;
        };
        for _ in 0..blocks {
            fill(&mut pool);
        }
        published.publish(&pool);
        group.bench_with_input(BenchmarkId::from_parameter(blocks), &blocks, |b, _| {
            b.iter(|| {
                fill(&mut pool);
                published.publish(&pool);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, publish);
criterion_main!(benches);
