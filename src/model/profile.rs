//! Measuring a model on this machine. Serving needs the decode-step latency per batch size
//! (the throughput model's input, measured at start-up for `thresholds = "auto"`) and a warm-up
//! pass; `bench-model`'s reporting API ([`measure`], [`Throughput`], [`Workload`]) is public
//! only with the `profiling` feature (on by default; a server built without it has neither
//! that API nor the command).

mod measure;

#[cfg(feature = "profiling")]
pub use measure::{measure, measure_with, Throughput, Workload};
#[cfg(not(feature = "profiling"))]
use measure::{measure, Workload};

use super::error::Result;
use super::kv_cache::KvDtype;
use super::runner::{step, Sequence};
use super::Model;
use crate::scheduler::BlockPool;
use crate::tuning::StepLatencies;

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
