//! Timing a batch: prefill and decode throughput of `batch` sequences decoding together, and,
//! on request, where the time went. The serving core ([`super::step_latencies`]) uses it at
//! start-up; `bench-model` reports it (behind the `profiling` feature).

use std::time::Instant;

use rand::{Rng, SeedableRng};

use crate::model::error::Result;
use crate::model::kv_cache::KvDtype;
use crate::model::runner::{step, with_f32_values, Sequence};
use crate::model::sampler::argmax;
use crate::model::timing::{take_breakdown, Breakdown, KernelTime};
use crate::model::{KvCache, Model};
use crate::scheduler::BlockPool;

/// What one measurement runs: prompts of `prompt_len` random ids, then `decode_steps` greedy
/// steps, then (when `extend` > 0) [`EXTEND_STEPS`] steps each extending every sequence by
/// `extend` random ids: the shape of the catch-ups a routed model runs on the tokens
/// produced elsewhere.
#[derive(Debug, Clone, Copy)]
pub struct Workload {
    pub prompt_len: usize,
    pub decode_steps: usize,
    pub extend: usize,
    /// When > 0 (with `extend`), each extend step is followed by a batch-1 prefill of this
    /// many random ids on a cache of its own: the long prefill the catch-up is read against,
    /// timed in turn with it so the machine's drift falls on both.
    pub against_prefill: usize,
    pub seed: u64,
    pub kv_dtype: KvDtype,
}

/// Extend steps a workload with `extend` > 0 times: one step is a fraction of a second, so
/// the rate reported is their median.
pub const EXTEND_STEPS: usize = 3;

/// Without `profiling` the server reads only `decode_tok_s`; the rest is `bench-model`'s.
#[cfg_attr(not(feature = "profiling"), allow(dead_code))]
#[derive(Debug, Clone)]
pub struct Throughput {
    /// Tokens the prefill read (`batch` × the prompt's length).
    pub batch_tokens: usize,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    /// New tokens a second of the extend steps (their median), when the workload has them.
    pub extend_tok_s: Option<f64>,
    /// With `against_prefill`: the prefills' tokens a second and each extend step's rate
    /// over the prefill after it (medians).
    pub extend_against: Option<(f64, f64)>,
    /// Seconds of each timed decode step, in order.
    pub step_secs: Vec<f64>,
    /// Where the decode steps' time went, when [`set_breakdown`](crate::model::timing::set_breakdown) is on.
    pub breakdown: Option<Breakdown>,
    /// Where the prefill's time went, likewise.
    pub prefill_breakdown: Option<Breakdown>,
    /// On a GPU with the breakdown on: device time per kernel of the prefill, and of the
    /// timed decode steps.
    pub prefill_kernels: Vec<KernelTime>,
    pub decode_kernels: Vec<KernelTime>,
}

impl Throughput {
    /// Seconds the prefill took.
    pub fn prefill_secs(&self) -> f64 {
        self.batch_tokens as f64 / self.prefill_tok_s
    }
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
    let per_seq = (work.prompt_len + work.decode_steps + EXTEND_STEPS * work.extend + 1)
        .div_ceil(block_size)
        * block_size;
    let mut kv = model.kv_cache_for(block_size, batch * per_seq, work.kv_dtype)?;
    let pool = BlockPool::new(kv.num_blocks());
    if model.on_gpu() {
        // On a GPU the first pass of a shape grows the memory pool and asks cuBLASLt for its
        // algorithms, once per process, and a decode step's second pass at a batch size is
        // recorded as a CUDA graph: a server pays those at its first requests, so an untimed
        // pass of this batch's shapes keeps them out of the figures.
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
    // One step of every sequence together; its logits.
    let mut step_all = |seqs: &mut [Sequence]| {
        step(
            model,
            &mut kv,
            &pool,
            &mut seqs.iter_mut().collect::<Vec<_>>(),
            false,
        )
        .map(|out| out.logits)
    };
    take_breakdown();
    let started = Instant::now();
    let mut logits = step_all(&mut seqs)?;
    let prefill = started.elapsed().as_secs_f64();
    let mut step_secs = Vec::with_capacity(work.decode_steps);
    let prefill_breakdown = take_breakdown();
    let prefill_kernels = model.take_kernel_times()?;
    for s in 0..work.decode_steps {
        let started = Instant::now();
        let vocab = config.vocab_size;
        with_f32_values(&logits, |rows| {
            for (seq, row) in seqs.iter_mut().zip(rows.chunks_exact(vocab)) {
                seq.tokens.push(argmax(row));
            }
        })?;
        logits = step_all(&mut seqs)?;
        step_secs.push(started.elapsed().as_secs_f64());
        between(s);
    }
    let breakdown = take_breakdown();
    let decode_kernels = model.take_kernel_times()?;
    let decode: f64 = step_secs.iter().sum();
    let (extend_tok_s, extend_against) = match work.extend {
        0 => (None, None),
        n => {
            let mut reference = match work.against_prefill {
                0 => None,
                len => Some(LongPrefill::new(model, len, work.kv_dtype)?),
            };
            let (mut rates, mut prefills, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..EXTEND_STEPS {
                for seq in &mut seqs {
                    seq.tokens
                        .extend((0..n).map(|_| rng.random_range(id_range.clone())));
                }
                let started = Instant::now();
                step_all(&mut seqs)?;
                let rate = (batch * n) as f64 / started.elapsed().as_secs_f64();
                rates.push(rate);
                if let Some(long) = &mut reference {
                    let prompt = (0..long.len)
                        .map(|_| rng.random_range(id_range.clone()))
                        .collect();
                    let p = long.tok_s(model, prompt)?;
                    prefills.push(p);
                    ratios.push(rate / p);
                }
            }
            take_breakdown();
            model.take_kernel_times()?;
            let against = reference.map(|_| (median(prefills), median(ratios)));
            (Some(median(rates)), against)
        }
    };
    Ok(Throughput {
        batch_tokens: batch * work.prompt_len,
        prefill_tok_s: (batch * work.prompt_len) as f64 / prefill,
        decode_tok_s: (batch * work.decode_steps) as f64 / decode,
        extend_tok_s,
        extend_against,
        step_secs,
        breakdown,
        prefill_breakdown,
        prefill_kernels,
        decode_kernels,
    })
}

/// The median of `xs` (the mean of the two middle values for an even count; NaN for none).
pub fn median(mut xs: Vec<f64>) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    (xs[(n - 1) / 2] + xs[n / 2]) / 2.0
}

/// A batch-1 prefill of `len` tokens on a cache of its own, timed again and again.
struct LongPrefill {
    len: usize,
    kv: KvCache,
    pool: BlockPool,
}

impl LongPrefill {
    fn new(model: &Model, len: usize, kv_dtype: KvDtype) -> Result<Self> {
        let block_size = 16;
        let kv =
            model.kv_cache_for(block_size, (len + 1).next_multiple_of(block_size), kv_dtype)?;
        let pool = BlockPool::new(kv.num_blocks());
        Ok(Self { len, kv, pool })
    }

    /// Prefill tokens a second of `prompt` (`len` ids); its blocks go back to the pool after.
    fn tok_s(&mut self, model: &Model, prompt: Vec<u32>) -> Result<f64> {
        let mut seq = Sequence::new(prompt);
        let started = Instant::now();
        step(model, &mut self.kv, &self.pool, &mut [&mut seq], false)?;
        Ok(self.len as f64 / started.elapsed().as_secs_f64())
    }
}

/// A prefill of `batch` prompts of the workload's length and two decode steps, on blocks
/// returned to `pool` after.
fn untimed_pass(
    model: &Model,
    batch: usize,
    work: &Workload,
    pool: &BlockPool,
    kv: &mut KvCache,
) -> Result<()> {
    let mut seqs: Vec<Sequence> = (0..batch)
        .map(|_| Sequence::new(vec![1; work.prompt_len]))
        .collect();
    for decode in [false, true, true] {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
    }
}
