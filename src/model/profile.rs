//! Measuring a model on this machine: prefill and decode throughput of a batch, and the
//! decode-step latency per batch size that the throughput model (`tuning`) takes as input.

use std::time::Instant;

use rand::{Rng, SeedableRng};

use super::error::Result;
use super::kv_cache::KvDtype;
use super::runner::{step, with_f32_values, Sequence};
use super::sampler::argmax;
use super::timing::{take_breakdown, Breakdown, KernelTime};
use super::Model;
use crate::scheduler::BlockPool;

/// What one measurement runs: prompts of `prompt_len` random ids, then `decode_steps` greedy
/// steps.
#[derive(Debug, Clone, Copy)]
pub struct Workload {
    pub prompt_len: usize,
    pub decode_steps: usize,
    pub seed: u64,
    pub kv_dtype: KvDtype,
}

#[derive(Debug, Clone)]
pub struct Throughput {
    /// Tokens the prefill read (`batch` × the prompt's length).
    pub batch_tokens: usize,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    /// Seconds of each timed decode step, in order.
    pub step_secs: Vec<f64>,
    /// Where the decode steps' time went, when [`set_breakdown`](super::timing::set_breakdown) is on.
    pub breakdown: Option<Breakdown>,
    /// On a GPU with the breakdown on: device time per kernel of the prefill, and of the
    /// timed decode steps.
    pub prefill_kernels: Vec<KernelTime>,
    pub decode_kernels: Vec<KernelTime>,
}

/// Prefill and decode throughput of `batch` sequences decoding together.
pub fn measure(model: &Model, batch: usize, work: &Workload) -> Result<Throughput> {
    measure_with(model, batch, work, &mut |_| {})
}

/// [`measure`], calling `between(step)` after each timed decode step (untimed): for
/// measurements paired with each step, such as a plain read of as many bytes.
pub fn measure_with(
    model: &Model,
    batch: usize,
    work: &Workload,
    between: &mut dyn FnMut(usize),
) -> Result<Throughput> {
    let config = model.config();
    let block_size = 16;
    let per_seq = (work.prompt_len + work.decode_steps + 1).div_ceil(block_size) * block_size;
    let mut kv = model.kv_cache_for(block_size, batch * per_seq, work.kv_dtype)?;
    let pool = BlockPool::new(kv.num_blocks());
    if model.on_gpu() {
        // On a GPU the first pass of a shape grows the memory pool and asks cuBLASLt for its
        // algorithms, once per process: a server pays that at its first request, so one
        // untimed pass of this batch's shapes keeps it out of the figures.
        untimed_pass(model, batch, work, &pool, &mut kv)?;
        model.take_kernel_times()?;
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(work.seed);
    // Ordinary (non-special) ids from the low part of the vocabulary.
    let id_range = 0..(config.vocab_size as u32).min(10_000);
    let mut seqs: Vec<Sequence> = (0..batch)
        .map(|_| {
            Sequence::new(
                (0..work.prompt_len)
                    .map(|_| rng.random_range(id_range.clone()))
                    .collect(),
            )
        })
        .collect();
    let started = Instant::now();
    let mut logits = step(
        model,
        &mut kv,
        &pool,
        &mut seqs.iter_mut().collect::<Vec<_>>(),
        false,
    )?
    .logits;
    let prefill = started.elapsed().as_secs_f64();
    let mut step_secs = Vec::with_capacity(work.decode_steps);
    take_breakdown();
    let prefill_kernels = model.take_kernel_times()?;
    for s in 0..work.decode_steps {
        let started = Instant::now();
        let vocab = config.vocab_size;
        with_f32_values(&logits, |rows| {
            for (seq, row) in seqs.iter_mut().zip(rows.chunks_exact(vocab)) {
                seq.tokens.push(argmax(row));
            }
        })?;
        logits = step(
            model,
            &mut kv,
            &pool,
            &mut seqs.iter_mut().collect::<Vec<_>>(),
            false,
        )?
        .logits;
        step_secs.push(started.elapsed().as_secs_f64());
        between(s);
    }
    let breakdown = take_breakdown();
    let decode_kernels = model.take_kernel_times()?;
    let decode: f64 = step_secs.iter().sum();
    Ok(Throughput {
        batch_tokens: batch * work.prompt_len,
        prefill_tok_s: (batch * work.prompt_len) as f64 / prefill,
        decode_tok_s: (batch * work.decode_steps) as f64 / decode,
        step_secs,
        breakdown,
        prefill_kernels,
        decode_kernels,
    })
}

/// A prefill of `batch` prompts of the workload's length and one decode step, on blocks
/// returned to `pool` after.
fn untimed_pass(
    model: &Model,
    batch: usize,
    work: &Workload,
    pool: &BlockPool,
    kv: &mut super::KvCache,
) -> Result<()> {
    let mut seqs: Vec<Sequence> = (0..batch)
        .map(|_| Sequence::new(vec![1; work.prompt_len]))
        .collect();
    for decode in [false, true] {
        if decode {
            for seq in &mut seqs {
                seq.tokens.push(1);
            }
        }
        step(
            model,
            kv,
            pool,
            &mut seqs.iter_mut().collect::<Vec<_>>(),
            false,
        )?;
    }
    Ok(())
}

/// One prefill and one decode step before timing: thread-pool start-up, scratch buffers and
/// (for the matrices candle multiplies) weight repacking happen lazily on first use and would
/// otherwise be charged to the first batch size, or to a server's first request.
pub fn warm_up(model: &Model) -> Result<()> {
    let mut kv = model.kv_cache_for(16, 32, KvDtype::default())?;
    let pool = BlockPool::new(kv.num_blocks());
    let prompt = (1..=8).collect();
    let mut seq = Sequence::new(prompt);
    step(model, &mut kv, &pool, &mut [&mut seq], false)?;
    seq.tokens.push(5);
    step(model, &mut kv, &pool, &mut [&mut seq], false)?;
    Ok(())
}

/// Seconds of one decode step at every batch size `1..=max_batch`: measured at powers of two
/// (and `max_batch`), linear in between.
pub fn step_latencies(model: &Model, max_batch: usize, kv_dtype: KvDtype) -> Result<Vec<f64>> {
    let work = Workload {
        prompt_len: 16,
        decode_steps: 4,
        seed: 0,
        kv_dtype,
    };
    warm_up(model)?;
    let mut points = Vec::new();
    let mut b = 1;
    loop {
        let batch = b.min(max_batch.max(1));
        let t = measure(model, batch, &work)?;
        points.push((batch, batch as f64 / t.decode_tok_s));
        if batch == max_batch.max(1) {
            break;
        }
        b *= 2;
    }
    Ok((1..=max_batch.max(1))
        .map(|n| interpolate(&points, n))
        .collect())
}

/// Linear interpolation between measured `(batch, seconds)` points (sorted by batch).
fn interpolate(points: &[(usize, f64)], n: usize) -> f64 {
    let upper = points
        .iter()
        .position(|&(b, _)| b >= n)
        .unwrap_or(points.len() - 1);
    if upper == 0 || points[upper].0 == n {
        return points[upper].1;
    }
    let ((b0, l0), (b1, l1)) = (points[upper - 1], points[upper]);
    l0 + (l1 - l0) * (n - b0) as f64 / (b1 - b0) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_between_measured_batches_are_interpolated() {
        let points = [(1, 0.1), (2, 0.2), (4, 0.3)];
        assert_eq!(interpolate(&points, 1), 0.1);
        assert!((interpolate(&points, 3) - 0.25).abs() < 1e-12);
        assert_eq!(interpolate(&points, 4), 0.3);
    }
}
