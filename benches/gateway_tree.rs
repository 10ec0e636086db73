//! Gateway radix tree: cost per operation of `insert` (fresh ~1000-char texts sharing 10 system
//! prompts, 2 workers) and of `prefix_match` on a tree pre-filled with 2000 such texts, for a
//! full hit, a miss on the first char and a partial match (500-char shared prompt, then a
//! divergence), plus a 2-thread mix of 80% matches / 20% inserts reported per operation.
//! Baseline, in the same run: a naive linear scan over all 2000 stored strings answering the
//! same `prefix_match hit` query; the ratio naive / tree is printed after the group.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokenrouter::gateway::tree::{RadixTree, WorkerId};

const PROMPTS: usize = 10;
const PROMPT_CHARS: usize = 500;
const SUFFIX_CHARS: usize = 500;
const STORED: usize = 2000;
/// Fresh texts generated up front for the insert group; the tree is rebuilt (untimed) after
/// each pass so that every timed insert is of a text the tree has not seen.
const INSERT_POOL: usize = 10_000;

fn letters(rng: &mut ChaCha8Rng, n: usize) -> String {
    (0..n)
        .map(|_| rng.random_range(b'a'..=b'z') as char)
        .collect()
}

struct Corpus {
    prompts: Vec<String>,
    rng: ChaCha8Rng,
}

impl Corpus {
    fn new(seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let prompts = (0..PROMPTS)
            .map(|_| letters(&mut rng, PROMPT_CHARS))
            .collect();
        Corpus { prompts, rng }
    }

    /// A system prompt followed by a fresh random user part.
    fn text(&mut self) -> String {
        let p = self.rng.random_range(0..PROMPTS);
        format!(
            "{}{}",
            self.prompts[p],
            letters(&mut self.rng, SUFFIX_CHARS)
        )
    }
}

/// Max common-prefix chars per worker over every stored string: what the tree replaces.
fn naive_match(stored: &[(WorkerId, String)], query: &str) -> [usize; 2] {
    let mut best = [0usize; 2];
    for (w, s) in stored {
        let n = s
            .chars()
            .zip(query.chars())
            .take_while(|(a, b)| a == b)
            .count();
        let slot = &mut best[*w as usize];
        *slot = (*slot).max(n);
    }
    best
}

fn prefilled(corpus: &mut Corpus) -> (RadixTree, Vec<(WorkerId, String)>) {
    let tree = RadixTree::new();
    let stored: Vec<(WorkerId, String)> = (0..STORED)
        .map(|i| ((i % 2) as WorkerId, corpus.text()))
        .collect();
    for (w, s) in &stored {
        tree.insert(s, *w);
    }
    (tree, stored)
}

fn insert(c: &mut Criterion) {
    let mut corpus = Corpus::new(1);
    let pool: Vec<String> = (0..INSERT_POOL).map(|_| corpus.text()).collect();
    let mut group = c.benchmark_group("insert");
    group.throughput(Throughput::Bytes(pool[0].len() as u64));
    group.bench_function("fresh_1000_chars", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters as usize;
            while left > 0 {
                let n = left.min(pool.len());
                let tree = RadixTree::new();
                let start = Instant::now();
                for (i, s) in pool[..n].iter().enumerate() {
                    tree.insert(s, (i % 2) as WorkerId);
                }
                total += start.elapsed();
                left -= n;
            }
            total
        })
    });
    group.finish();
}

fn prefix_match(c: &mut Criterion) {
    let mut corpus = Corpus::new(2);
    let (tree, stored) = prefilled(&mut corpus);
    let hit = stored[STORED / 2].1.clone();
    let miss = format!("#{}", &hit[1..]);
    // Digits never appear in stored text, so the divergence is right after the prompt.
    let partial = format!("{}{}", corpus.prompts[0], "0123456789".repeat(50));
    let mut group = c.benchmark_group("prefix_match");
    for (name, query) in [("hit", &hit), ("miss", &miss), ("partial", &partial)] {
        group.throughput(Throughput::Bytes(query.len() as u64));
        group.bench_with_input(BenchmarkId::new("tree", name), query, |b, q| {
            b.iter(|| tree.prefix_match(black_box(q)))
        });
    }
    group.throughput(Throughput::Bytes(hit.len() as u64));
    group.bench_with_input(
        BenchmarkId::new("naive_scan_baseline", "hit"),
        &hit,
        |b, q| b.iter(|| naive_match(&stored, black_box(q))),
    );
    group.finish();
    print_ratio(&tree, &stored, &hit);
}

/// Quick side-by-side timing so the report carries the naive / tree ratio for a hit.
fn print_ratio(tree: &RadixTree, stored: &[(WorkerId, String)], hit: &str) {
    let per_op = |f: &dyn Fn()| {
        let reps = 200;
        let start = Instant::now();
        for _ in 0..reps {
            f();
        }
        start.elapsed() / reps
    };
    let t_tree = per_op(&|| {
        black_box(tree.prefix_match(black_box(hit)));
    });
    let t_naive = per_op(&|| {
        black_box(naive_match(stored, black_box(hit)));
    });
    println!(
        "prefix_match hit: tree {t_tree:?}/op, naive scan over {STORED} strings {t_naive:?}/op, \
         naive/tree = {:.0}x",
        t_naive.as_secs_f64() / t_tree.as_secs_f64().max(1e-12)
    );
}

fn concurrent_mixed(c: &mut Criterion) {
    let mut corpus = Corpus::new(3);
    let (tree, stored) = prefilled(&mut corpus);
    let fresh: Vec<String> = (0..4000).map(|_| corpus.text()).collect();
    let mut group = c.benchmark_group("concurrent_mixed");
    group.throughput(Throughput::Elements(1));
    group.bench_function("2_threads_80_match_20_insert", |b| {
        b.iter_custom(|iters| {
            let per_thread = (iters as usize).div_ceil(2);
            let start = Instant::now();
            std::thread::scope(|s| {
                for t in 0..2u64 {
                    let (tree, stored, fresh) = (&tree, &stored, &fresh);
                    s.spawn(move || {
                        let mut rng = ChaCha8Rng::seed_from_u64(10 + t);
                        for _ in 0..per_thread {
                            if rng.random_range(0..5) == 0 {
                                let text = &fresh[rng.random_range(0..fresh.len())];
                                tree.insert(text, t as WorkerId);
                            } else {
                                let (_, text) = &stored[rng.random_range(0..stored.len())];
                                black_box(tree.prefix_match(text));
                            }
                        }
                    });
                }
            });
            start.elapsed()
        })
    });
    group.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
}

criterion_group! {
    name = benches;
    config = config();
    targets = insert, prefix_match, concurrent_mixed
}
criterion_main!(benches);
