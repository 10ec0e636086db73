//! Measuring a model on this machine. Serving needs the decode-step latency per batch size
//! (the throughput model's input, measured at start-up for `thresholds = "auto"`), the cost of
//! a step by its rows (for algorithms that price multi-row steps) and a warm-up pass;
//! `bench-model`'s reporting API ([`measure`], [`Throughput`], [`Workload`]) is public only
//! with the `profiling` feature (on by default; a server built without it has neither that
//! API nor the command).

mod measure;

#[cfg(feature = "profiling")]
pub use measure::{measure, measure_with, median, Throughput, Workload, EXTEND_STEPS};
#[cfg(not(feature = "profiling"))]
use measure::{measure, Workload};

use std::time::Instant;

use super::batch::SeqInput;
use super::error::Result;
use super::kv_cache::KvDtype;
use super::runner::{logits_row, step, Sequence};
use super::Model;
use crate::scheduler::BlockPool;
use crate::tuning::{RowCosts, StepLatencies};

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

/// Decode-step seconds at every batch size `1..=max_batch`, measured at powers of two (and
/// `max_batch`), linear in between; and the per-token seconds of the prefill at `max_batch`
/// (16 tokens each), the marginal cost of extend tokens in a step.
pub fn step_latencies(model: &Model, max_batch: usize, kv_dtype: KvDtype) -> Result<StepLatencies> {
    let work = Workload {
        prompt_len: 16,
        decode_steps: 4,
        extend: 0,
        against_prefill: 0,
        seed: 0,
        kv_dtype,
    };
    warm_up(model)?;
    let mut points = Vec::new();
    let mut extend_token;
    let mut b = 1;
    loop {
        let batch = b.min(max_batch.max(1));
        let t = measure(model, batch, &work)?;
        // The largest batch's prefill: extends run inside steps whose weights are read anyway.
        extend_token = t.prefill_secs() / t.batch_tokens as f64;
        points.push((batch, batch as f64 / t.decode_tok_s));
        if batch == max_batch.max(1) {
            break;
        }
        b *= 2;
    }
    Ok(StepLatencies {
        decode: (1..=max_batch.max(1))
            .map(|n| interpolate(&points, n))
            .collect(),
        extend_token,
    })
}

/// What a step of one sequence with a short context costs `model` by its rows
/// ([`RowCosts`]): a one-row step against one of `rows` rows that reads the logits of every
/// row (a verification's shape), at the same positions, the fastest of five of each (the
/// first pass of a shape may pay for set-up, and a noisy machine only ever adds time).
pub fn row_costs(model: &Model, rows: usize, kv_dtype: KvDtype) -> Result<RowCosts> {
    const CONTEXT: usize = 32;
    let rows = rows.max(2);
    let mut kv = model.kv_cache_for(16, CONTEXT + rows, kv_dtype)?;
    // The cache holds this one sequence: its blocks in order.
    let blocks: Vec<u32> = (0..kv.num_blocks() as u32).collect();
    let vocab = (model.config().vocab_size as u32).min(10_000);
    let tokens: Vec<u32> = (0..(CONTEXT + rows) as u32)
        .map(|i| (7 * i + 3) % vocab)
        .collect();
    let mut pass = |start: usize, len: usize| -> Result<f64> {
        let input = SeqInput {
            tokens: &tokens[start..start + len],
            start_pos: start,
            blocks: &blocks,
            logits: len,
        };
        let started = Instant::now();
        let out = model.forward(&[input], &mut kv, false)?;
        // Reading a row back waits for a device's queued work.
        logits_row(&out.logits, 0)?;
        Ok(started.elapsed().as_secs_f64())
    };
    pass(0, CONTEXT)?;
    let (mut one, mut many) = (f64::MAX, f64::MAX);
    for _ in 0..5 {
        // Each pass rewrites the cache positions from CONTEXT on.
        one = one.min(pass(CONTEXT, 1)?);
        many = many.min(pass(CONTEXT, rows)?);
    }
    Ok(RowCosts {
        step_s: one,
        row_s: ((many - one) / (rows - 1) as f64).max(0.0),
    })
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

    /// Timings are the machine's, so only their form is checked: a one-row step takes time,
    /// further rows add a finite share each, and a context longer than a block is no problem.
    #[test]
    fn row_costs_time_one_row_and_many() {
        use crate::model::random::{shape, RandomSource};
        use crate::model::{ComputeTarget, MatmulBackend};
        let mut config = shape("qwen3-0.6b").unwrap();
        config.num_layers = 1;
        config.vocab_size = 512;
        let mut src = RandomSource::new(&config, candle_core::quantized::GgmlDType::Q8_0, 3);
        let target = ComputeTarget::Cpu(MatmulBackend::Native);
        let model = Model::load_on(config, &mut src, target).unwrap();
        let costs = row_costs(&model, 9, KvDtype::default()).unwrap();
        assert!(costs.step_s > 0.0 && costs.step_s.is_finite(), "{costs:?}");
        assert!(costs.row_s >= 0.0 && costs.row_s.is_finite(), "{costs:?}");
    }
}
