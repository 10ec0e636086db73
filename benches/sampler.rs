//! Next-token sampling over one logits row of the 1.5B model's vocabulary (151 936), per call:
//! greedy, greedy with every penalty over a 2000-token prompt and 200 output tokens,
//! temperature alone, and temperature with top-p 0.9, with min-p 0.05 and with top-k 50. The
//! logits are scaled like a real model's (a few tokens well above a wide tail) so that the
//! nucleus holds tens of tokens, not the whole vocabulary.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokenrouter::model::{Sampler, SamplingParams};

const VOCAB: usize = 151_936;

fn sampling(c: &mut Criterion) {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut logits: Vec<f32> = (0..VOCAB).map(|_| rng.random_range(-4.0..4.0)).collect();
    for _ in 0..40 {
        logits[rng.random_range(0..VOCAB)] = rng.random_range(10.0..16.0);
    }
    let prompt: Vec<u32> = (0..2000)
        .map(|_| rng.random_range(0..VOCAB as u32))
        .collect();
    let output: Vec<u32> = (0..200)
        .map(|_| rng.random_range(0..VOCAB as u32))
        .collect();
    let cases = [
        ("greedy", SamplingParams::greedy()),
        (
            "greedy_penalties",
            SamplingParams {
                repetition_penalty: 1.1,
                presence_penalty: 0.5,
                frequency_penalty: 0.5,
                ..SamplingParams::greedy()
            },
        ),
        ("temperature", SamplingParams::default()),
        (
            "top_p_0.9",
            SamplingParams {
                top_p: 0.9,
                ..SamplingParams::default()
            },
        ),
        (
            "min_p_0.05",
            SamplingParams {
                min_p: 0.05,
                ..SamplingParams::default()
            },
        ),
        (
            "top_k_50",
            SamplingParams {
                top_k: 50,
                ..SamplingParams::default()
            },
        ),
    ];
    let mut group = c.benchmark_group("sample");
    group.throughput(Throughput::Bytes((VOCAB * 4) as u64));
    for (name, params) in cases {
        let mut sampler = Sampler::new(SamplingParams {
            seed: Some(7),
            ..params
        })
        .unwrap();
        group.bench_function(name, |b| {
            b.iter(|| black_box(sampler.sample(black_box(&logits), &prompt, &output)))
        });
    }
    group.finish();
}

criterion_group!(benches, sampling);
criterion_main!(benches);
