//! Paged attention throughput: decode (one query token per sequence) over contexts of
//! different lengths, with the cache in f32 and in f16, reported as GB/s of f32 K/V (so the
//! two types' rates compare directly), with a dense dot-product pass over the f32 bytes as the
//! in-run baseline; decode over a cold f16 cache (GB/s of the f16 bytes), against a plain
//! cold read; and a prefill, a prompt attending to itself (prompt tokens a second).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::{Rng, SeedableRng};
use rayon::prelude::*;
use tokenrouter::kernels::attention::{paged_attention, AttentionSeq, PagedKv};
use tokenrouter::kernels::KvElem;

const HEAD_DIM: usize = 64;
const BLOCK: usize = 16;

/// One decode token per sequence, the last of `ctx` positions held in its blocks.
fn decode_seqs(tables: &[Vec<u32>], ctx: usize) -> Vec<AttentionSeq<'_>> {
    tables
        .iter()
        .map(|t| AttentionSeq {
            blocks: t,
            start_pos: ctx - 1,
            num_tokens: 1,
        })
        .collect()
}

/// `heads` random query heads.
fn query(rng: &mut impl Rng, heads: usize) -> Vec<f32> {
    (0..heads * HEAD_DIM)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect()
}

/// A layer's cache of `kv_heads` heads in this bench's block and head sizes.
fn paged<'a, T: KvElem>(k: &'a [T], v: &'a [T], kv_heads: usize) -> PagedKv<'a, T> {
    PagedKv {
        k,
        v,
        block_size: BLOCK,
        num_kv_heads: kv_heads,
        head_dim: HEAD_DIM,
    }
}

fn decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("paged_attention_decode");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    // (query heads, KV heads): Qwen2.5-0.5B's 14 / 2 and SmolLM2-135M's 9 / 3.
    let cases = [
        (14, 2, 1usize, 512usize),
        (14, 2, 16, 512),
        (14, 2, 4, 4096),
        (9, 3, 1, 128),
        (9, 3, 16, 128),
    ];
    for (heads, kv_heads, batch, ctx) in cases {
        let blocks_per_seq = ctx.div_ceil(BLOCK);
        let row = kv_heads * BLOCK * HEAD_DIM;
        let n_blocks = batch * blocks_per_seq;
        let k: Vec<f32> = (0..n_blocks * row)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let v: Vec<f32> = (0..n_blocks * row)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|s| ((s * blocks_per_seq) as u32..((s + 1) * blocks_per_seq) as u32).collect())
            .collect();
        let seqs = decode_seqs(&tables, ctx);
        let q = query(&mut rng, batch * heads);
        let mut out = vec![0f32; q.len()];
        let kv = paged(&k, &v, kv_heads);
        let bytes = (batch * ctx * kv_heads * HEAD_DIM * 2 * 4) as u64;
        group.throughput(Throughput::Bytes(bytes));
        let id = format!("h{heads}_kv{kv_heads}_b{batch}_ctx{ctx}");
        group.bench_with_input(BenchmarkId::new("paged", &id), &(), |bench, _| {
            bench.iter(|| paged_attention(&q, heads, &kv, &seqs, 0.125, &mut out))
        });
        // The same values stored as f16 (the default cache type): half the bytes.
        let k16: Vec<half::f16> = k.iter().map(|&x| half::f16::from_f32(x)).collect();
        let v16: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
        let kv16 = paged(&k16, &v16, kv_heads);
        group.bench_with_input(BenchmarkId::new("paged_f16", &id), &(), |bench, _| {
            bench.iter(|| paged_attention(&q, heads, &kv16, &seqs, 0.125, &mut out))
        });
        group.bench_with_input(
            BenchmarkId::new("dense_read_baseline", &id),
            &(),
            |bench, _| {
                bench.iter(|| {
                    let s: f32 = k
                        .par_chunks(1 << 14)
                        .zip(v.par_chunks(1 << 14))
                        .map(|(a, b)| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>())
                        .sum();
                    std::hint::black_box(s)
                })
            },
        );
    }
    group.finish();
}

/// A prompt of `ctx` tokens attending to itself (a prefill), f16 cache, in the 0.5B's and
/// SmolLM2-135M's head shapes.
fn prefill(c: &mut Criterion) {
    let mut group = c.benchmark_group("paged_attention_prefill");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    for (heads, kv_heads, ctx) in [(14usize, 2usize, 512usize), (14, 2, 2048), (9, 3, 512)] {
        let blocks = ctx.div_ceil(BLOCK);
        let row = kv_heads * BLOCK * HEAD_DIM;
        let k: Vec<half::f16> = (0..blocks * row)
            .map(|_| half::f16::from_f32(rng.random_range(-1.0..1.0)))
            .collect();
        let v = k.clone();
        let table: Vec<u32> = (0..blocks as u32).collect();
        let seqs = [AttentionSeq {
            blocks: &table,
            start_pos: 0,
            num_tokens: ctx,
        }];
        let q = query(&mut rng, ctx * heads);
        let mut out = vec![0f32; q.len()];
        let kv = paged(&k, &v, kv_heads);
        group.throughput(Throughput::Elements(ctx as u64));
        let id = format!("h{heads}_kv{kv_heads}_ctx{ctx}");
        group.bench_with_input(BenchmarkId::new("paged_f16", &id), &(), |bench, _| {
            bench.iter(|| paged_attention(&q, heads, &kv, &seqs, 0.125, &mut out))
        });
    }
    group.finish();
}

/// Decode over a cache that is not in any CPU cache, as in a real decode step (the weights
/// have streamed through since the last one): every iteration reads another copy of the
/// sequences' blocks, out of 128 MB of K and as much of V. The baseline is a plain parallel
/// read of as many bytes, also cold.
fn decode_cold(c: &mut Criterion) {
    let mut group = c.benchmark_group("paged_attention_decode_cold");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    for (heads, kv_heads, batch, ctx) in [(14, 2, 1usize, 1024usize), (9, 3, 4, 1024)] {
        let blocks_per_seq = ctx.div_ceil(BLOCK);
        let row = kv_heads * BLOCK * HEAD_DIM;
        let copy_elems = batch * blocks_per_seq * row;
        let copies = (128 << 20) / (copy_elems * 2);
        let k: Vec<half::f16> = (0..copies * copy_elems)
            .map(|_| half::f16::from_f32(rng.random_range(-1.0..1.0)))
            .collect();
        let v = k.clone();
        let tables: Vec<Vec<Vec<u32>>> = (0..copies)
            .map(|c| {
                (0..batch)
                    .map(|s| {
                        let first = (c * batch + s) * blocks_per_seq;
                        (first as u32..(first + blocks_per_seq) as u32).collect()
                    })
                    .collect()
            })
            .collect();
        let seqs: Vec<Vec<AttentionSeq>> = tables.iter().map(|t| decode_seqs(t, ctx)).collect();
        let q = query(&mut rng, batch * heads);
        let mut out = vec![0f32; q.len()];
        let kv = paged(&k, &v, kv_heads);
        group.throughput(Throughput::Bytes((copy_elems * 2 * 2) as u64));
        let id = format!("h{heads}_kv{kv_heads}_b{batch}_ctx{ctx}");
        let mut next = 0;
        group.bench_with_input(BenchmarkId::new("paged_f16", &id), &(), |bench, _| {
            bench.iter(|| {
                next = (next + 1) % copies;
                paged_attention(&q, heads, &kv, &seqs[next], 0.125, &mut out)
            })
        });
        let as_u16 = |x: &[half::f16]| {
            x.iter()
                .fold(0u32, |a, h| a.wrapping_add(h.to_bits() as u32))
        };
        group.bench_with_input(
            BenchmarkId::new("dense_read_baseline", &id),
            &(),
            |bench, _| {
                bench.iter(|| {
                    next = (next + 1) % copies;
                    let range = next * copy_elems..(next + 1) * copy_elems;
                    let s: u32 = k[range.clone()]
                        .par_chunks(1 << 14)
                        .zip(v[range].par_chunks(1 << 14))
                        .map(|(a, b)| as_u16(a).wrapping_add(as_u16(b)))
                        .reduce(|| 0, u32::wrapping_add);
                    std::hint::black_box(s)
                })
            },
        );
    }
    group.finish();
}

criterion_group!(benches, decode, decode_cold, prefill);
criterion_main!(benches);
