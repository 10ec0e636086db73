//! The decoder's row-wise kernels and the routing features, in GB/s of the values they read
//! and write, each next to its plain form in the same run: residual add + RMS norm in one
//! row-parallel pass against the three single-thread passes it replaced, SiLU·gate rows spread
//! over the pool against one row after another, rotary embedding, and the routing features
//! (entropy, largest probability, top logits) against a softmax materialised, or a row
//! sorted, per row. Shapes are the 1.5B model's (hidden 1536, FFN 8960, 12 heads of 128,
//! vocabulary 151 936).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokenrouter::kernels::routing_features::{entropy_rows, max_prob_rows, top_logits_rows};
use tokenrouter::kernels::{
    add_in_place, add_rms_norm_rows, rms_norm_in_place, silu_mul, silu_mul_rows, RopeStyle,
    RotaryAngles,
};

const HIDDEN: usize = 1536;
const FFN: usize = 8960;
const HEADS: usize = 12;
const HEAD_DIM: usize = 128;
const VOCAB: usize = 151_936;
const EPS: f32 = 1e-6;

fn random(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-2.0..2.0)).collect()
}

fn add_norm(c: &mut Criterion) {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let weight = random(&mut rng, HIDDEN);
    let mut group = c.benchmark_group("add_rms_norm");
    for rows in [1usize, 16, 64] {
        let mut x = random(&mut rng, rows * HIDDEN);
        let add = random(&mut rng, rows * HIDDEN);
        let mut out = vec![0f32; rows * HIDDEN];
        // x read and written, the addend read, the output written.
        group.throughput(Throughput::Bytes((4 * rows * HIDDEN * 4) as u64));
        group.bench_with_input(BenchmarkId::new("fused_rows", rows), &rows, |b, _| {
            b.iter(|| add_rms_norm_rows(&mut x, Some(&add), &weight, EPS, &mut out))
        });
        group.bench_with_input(BenchmarkId::new("three_passes", rows), &rows, |b, _| {
            b.iter(|| {
                add_in_place(&mut x, &add);
                out.copy_from_slice(&x);
                rms_norm_in_place(&mut out, &weight, EPS);
            })
        });
    }
    group.finish();
}

fn silu(c: &mut Criterion) {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let mut group = c.benchmark_group("silu_mul");
    for rows in [1usize, 16, 64] {
        let gate = random(&mut rng, rows * FFN);
        let up = random(&mut rng, rows * FFN);
        let mut out = vec![0f32; rows * FFN];
        let row = |r: usize| (&gate[r * FFN..(r + 1) * FFN], &up[r * FFN..(r + 1) * FFN]);
        group.throughput(Throughput::Bytes((3 * rows * FFN * 4) as u64));
        group.bench_with_input(BenchmarkId::new("rows_parallel", rows), &rows, |b, _| {
            b.iter(|| silu_mul_rows(&mut out, FFN, row))
        });
        group.bench_with_input(BenchmarkId::new("one_thread", rows), &rows, |b, _| {
            b.iter(|| {
                for (r, o) in out.chunks_exact_mut(FFN).enumerate() {
                    let (g, u) = row(r);
                    silu_mul(g, u, o);
                }
            })
        });
    }
    group.finish();
}

fn rope(c: &mut Criterion) {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let inv_freq = tokenrouter::kernels::rope::inverse_frequencies(HEAD_DIM, 1e6);
    let mut group = c.benchmark_group("rotary");
    for tokens in [1usize, 16, 64] {
        let positions: Vec<u32> = (0..tokens as u32).map(|t| 100 + t).collect();
        let angles = RotaryAngles::new(&positions, &inv_freq, RopeStyle::Neox);
        let mut x = random(&mut rng, tokens * HEADS * HEAD_DIM);
        group.throughput(Throughput::Bytes((2 * x.len() * 4) as u64));
        group.bench_with_input(BenchmarkId::new("apply", tokens), &tokens, |b, _| {
            b.iter(|| angles.apply(&mut x, HEADS))
        });
    }
    group.finish();
}

/// Entropy with the softmax written out first: the plain form of `entropy_rows`.
fn entropy_materialised(row: &[f32]) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f64> = row.iter().map(|&x| ((x - max) as f64).exp()).collect();
    let z: f64 = exps.iter().sum();
    -exps
        .iter()
        .map(|&e| e / z)
        .filter(|&p| p > 0.0)
        .map(|p| p * p.ln())
        .sum::<f64>() as f32
}

fn routing(c: &mut Criterion) {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let mut group = c.benchmark_group("routing_features");
    for rows in [1usize, 16] {
        let logits = random(&mut rng, rows * VOCAB);
        let ids: Vec<usize> = (0..rows).collect();
        let mut out = vec![0f32; rows * 8];
        group.throughput(Throughput::Bytes((rows * VOCAB * 4) as u64));
        group.bench_with_input(BenchmarkId::new("entropy", rows), &rows, |b, _| {
            b.iter(|| entropy_rows(&logits, VOCAB, &ids, &mut out[..rows]))
        });
        group.bench_with_input(
            BenchmarkId::new("entropy_materialised", rows),
            &rows,
            |b, _| {
                b.iter(|| {
                    for (r, o) in out[..rows].iter_mut().enumerate() {
                        *o = entropy_materialised(&logits[r * VOCAB..(r + 1) * VOCAB]);
                    }
                })
            },
        );
        group.bench_with_input(BenchmarkId::new("max_prob", rows), &rows, |b, _| {
            b.iter(|| max_prob_rows(&logits, VOCAB, &ids, &mut out[..rows]))
        });
        group.bench_with_input(BenchmarkId::new("top8", rows), &rows, |b, _| {
            b.iter(|| top_logits_rows(&logits, VOCAB, &ids, 8, &mut out))
        });
        group.bench_with_input(BenchmarkId::new("top8_sorted", rows), &rows, |b, _| {
            b.iter(|| {
                for (r, o) in out.chunks_exact_mut(8).enumerate() {
                    let mut row = logits[r * VOCAB..(r + 1) * VOCAB].to_vec();
                    row.sort_unstable_by(|a, b| b.total_cmp(a));
                    o.copy_from_slice(&row[..8]);
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, add_norm, silu, rope, routing);
criterion_main!(benches);
