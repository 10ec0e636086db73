//! Publishing a model's cached prefixes after a step that changed them: a pool whose blocks
//! are all cached (as on a busy server, 2048 and 8192 blocks), where each step fills one new
//! block (allocating it evicts the least recently used prefix, registering it adds one) and
//! then publishes, as the worker does after every step.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use tokenrouter::scheduler::{chain_hash, BlockPool, Blocks, PublishedPrefixes};

fn publish(c: &mut Criterion) {
    let mut group = c.benchmark_group("publish_after_one_new_block");
    for blocks in [2048usize, 8192] {
        let pool = BlockPool::new(blocks);
        let published = PublishedPrefixes::default();
        let mut next = 0u32;
        let mut fill = |pool: &BlockPool| {
            let mut block = Blocks::default();
            pool.grow(&mut block, 1)
                .expect("every block is free or evictable");
            pool.register(block.ids()[0], chain_hash(None, &[next]));
            next += 1;
        };
        for _ in 0..blocks {
            fill(&pool);
        }
        published.publish(&pool);
        group.bench_with_input(BenchmarkId::from_parameter(blocks), &blocks, |b, _| {
            b.iter(|| {
                fill(&pool);
                published.publish(&pool);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, publish);
criterion_main!(benches);
