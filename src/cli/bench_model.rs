//! `tokenrouter bench-model`: prefill and decode tokens/s per batch size, next to the batch-1
//! decode roofline: the bytes one sequence's decode step must read (every weight it streams
//! and the sequence's K/V at its context) ÷ the memory read bandwidth. The bandwidth of a
//! shared machine drifts over seconds, so every timed decode step is followed by a plain read
//! of as many bytes, and each row reports the median of those pairs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use clap::Args;

use tokenrouter::kernels::parallel::for_each_range;
use tokenrouter::model::profile::{
    measure, measure_with, set_breakdown, warm_up, Breakdown, Workload,
};
use tokenrouter::model::{KvDtype, MatmulBackend};

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: super::ModelArg,
    /// Batch sizes to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    batch: Vec<usize>,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 64)]
    prompt_len: usize,
    /// Decode steps timed per batch size.
    #[arg(long, default_value_t = 16)]
    decode_steps: usize,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// What the KV cache stores.
    #[arg(long, value_enum, default_value_t = KvDtype::default())]
    kv_dtype: KvDtype,
    /// Also measure the same model with candle's quantized matmul for every weight type, and
    /// print our speed-up over it.
    #[arg(long)]
    pub baseline_candle: bool,
    /// Also print where the decode steps' time goes: the quantized matmuls (and the LM head
    /// among them), attention, and everything else; and the rate the matmuls stream weights.
    #[arg(long)]
    breakdown: bool,
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    if args.batch.is_empty() || args.batch.contains(&0) {
        anyhow::bail!("--batch needs positive batch sizes, e.g. --batch 1,4,16");
    }
    if args.prompt_len == 0 || args.decode_steps == 0 {
        anyhow::bail!("--prompt-len and --decode-steps must be positive");
    }
    let lm = args.model.load()?;
    let model = &lm.model;
    let needed = args.prompt_len + args.decode_steps;
    if needed > model.config().context_length {
        anyhow::bail!(
            "--prompt-len + --decode-steps = {needed} exceeds the model's context length {}",
            model.config().context_length
        );
    }
    let baseline = match args.baseline_candle {
        true => Some(args.model.load_with(MatmulBackend::Candle)?),
        false => None,
    };
    warm_up(model)?;
    if let Some(b) = &baseline {
        warm_up(&b.model)?;
    }
    let bytes = model.streamed_weight_bytes() as f64;
    let config = model.config();
    let kv_per_position =
        (2 * config.num_layers * config.kv_dim() * args.kv_dtype.size_in_bytes()) as f64;
    // Decode step `s` attends to `prompt_len + s + 1` positions.
    let step_bytes = |s: usize| bytes + kv_per_position * (args.prompt_len + s + 1) as f64;
    let probe = ReadProbe::new();
    let bandwidth = probe.bandwidth(5);
    let name = lm
        .path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if !args.json {
        println!(
            "model {name}: {:.1} MB of weights streamed per decode step (+{:.2} MB of K/V at the mean context), best read bandwidth {:.2} GB/s, batch-1 roofline {:.1} tok/s, kernels {}",
            bytes / 1e6,
            (step_bytes(args.decode_steps / 2) - bytes) / 1e6,
            bandwidth / 1e9,
            bandwidth / step_bytes(args.decode_steps / 2),
            tokenrouter::model::MatmulBackend::from_env().kernels()
        );
        println!(
            "(each decode step is paired with a plain read of its bytes just after it; read GB/s, roofline and % roofline are the medians over a row's steps)"
        );
        print!(
            "{:>6} {:>14} {:>14} {:>10} {:>10} {:>10}",
            "batch", "prefill tok/s", "decode tok/s", "read GB/s", "roofline", "% roofline"
        );
        if baseline.is_some() {
            print!(
                " {:>15} {:>15} {:>9}",
                "candle prefill", "candle decode", "speed-up"
            );
        }
        println!();
    }
    let workload = Workload {
        prompt_len: args.prompt_len,
        decode_steps: args.decode_steps,
        seed: args.seed,
        kv_dtype: args.kv_dtype,
    };
    for &batch in &args.batch {
        let mut rates = Vec::with_capacity(args.decode_steps);
        set_breakdown(args.breakdown);
        let row = measure_with(model, batch, &workload, &mut |s| {
            rates.push(probe.read_rate(step_bytes(s) as usize))
        });
        set_breakdown(false);
        let row = row?;
        // Per step: the read rate, the roofline (batch-1 steps per second at that rate) and
        // this step's tokens per second against it.
        let read = median(rates.clone());
        let rooflines: Vec<f64> = rates
            .iter()
            .enumerate()
            .map(|(s, rate)| rate / step_bytes(s))
            .collect();
        let fraction = median(
            rooflines
                .iter()
                .zip(&row.step_secs)
                .map(|(roofline, secs)| batch as f64 / secs / roofline)
                .collect(),
        );
        let roofline = median(rooflines);
        let base = match &baseline {
            Some(b) => Some(measure(&b.model, batch, &workload)?),
            None => None,
        };
        if args.json {
            let mut obj = serde_json::json!({
                "model": name,
                "batch": batch,
                "prefill_tok_s": row.prefill_tok_s,
                "decode_tok_s": row.decode_tok_s,
                "roofline_tok_s": roofline,
                "roofline_fraction": fraction,
                "read_gb_s": read / 1e9,
                "kernels": tokenrouter::model::MatmulBackend::from_env().kernels(),
            });
            if let Some(b) = &base {
                obj["candle_prefill_tok_s"] = b.prefill_tok_s.into();
                obj["candle_decode_tok_s"] = b.decode_tok_s.into();
            }
            if let Some(parts) = &row.breakdown {
                let shares = Shares::new(parts, &row.step_secs, bytes);
                obj["breakdown"] = serde_json::json!({
                    "matmul": shares.matmul,
                    "lm_head": shares.lm_head,
                    "attention": shares.attention,
                    "other": shares.other,
                    "matmul_gb_s": shares.matmul_gb_s,
                });
            }
            println!("{obj}");
        } else {
            print!(
                "{:>6} {:>14.1} {:>14.1} {:>10.2} {:>10.1} {:>9.0}%",
                batch,
                row.prefill_tok_s,
                row.decode_tok_s,
                read / 1e9,
                roofline,
                100.0 * fraction
            );
            if let Some(b) = &base {
                print!(
                    " {:>15.1} {:>15.1} {:>8.1}x",
                    b.prefill_tok_s,
                    b.decode_tok_s,
                    row.decode_tok_s / b.decode_tok_s
                );
            }
            println!();
            if let Some(parts) = &row.breakdown {
                let s = Shares::new(parts, &row.step_secs, bytes);
                println!(
                    "{:>6} decode step: matmuls {:.1} % (LM head {:.1} %), attention {:.1} %, other {:.1} %; the matmuls stream weights at {:.2} GB/s",
                    "",
                    100.0 * s.matmul,
                    100.0 * s.lm_head,
                    100.0 * s.attention,
                    100.0 * s.other,
                    s.matmul_gb_s
                );
            }
        }
    }
    Ok(())
}

/// A [`Breakdown`] as shares of the decode steps' time, and the matmuls' weight rate.
struct Shares {
    matmul: f64,
    lm_head: f64,
    attention: f64,
    other: f64,
    matmul_gb_s: f64,
}

impl Shares {
    /// `weight_bytes`: what every step's matmuls read together.
    fn new(parts: &Breakdown, step_secs: &[f64], weight_bytes: f64) -> Self {
        let total: f64 = step_secs.iter().sum();
        Self {
            matmul: parts.matmul / total,
            lm_head: parts.lm_head / total,
            attention: parts.attention / total,
            other: (total - parts.matmul - parts.attention).max(0.0) / total,
            matmul_gb_s: weight_bytes * step_secs.len() as f64 / parts.matmul / 1e9,
        }
    }
}

/// A buffer far larger than the caches, for timing plain reads of memory.
struct ReadProbe {
    buf: Vec<u64>,
}

impl ReadProbe {
    /// Words per work item.
    const CHUNK: usize = 1 << 16;

    fn new() -> Self {
        let words = 64 << 20; // 512 MiB of u64
        Self {
            buf: (0..words as u64).collect(),
        }
    }

    /// Best-of-`passes` read bandwidth in bytes/s of the whole buffer.
    fn bandwidth(&self, passes: usize) -> f64 {
        (0..passes)
            .map(|_| self.read_rate(self.buf.len() * 8))
            .fold(0f64, f64::max)
    }

    /// Bytes/s of one plain read of `bytes` (whole chunks, at least one), with the same thread
    /// pool the kernels use; past the buffer's end the read wraps to its start (the buffer is
    /// far larger than the caches, so a wrapped read still comes from memory).
    fn read_rate(&self, bytes: usize) -> f64 {
        let chunk = Self::CHUNK;
        let chunks = self.buf.len() / chunk;
        let items = (bytes / 8 / chunk).max(1);
        let total = AtomicU64::new(0);
        let started = Instant::now();
        for_each_range(items, |range| {
            let part = range.fold(0u64, |acc, i| {
                let c = i % chunks;
                self.buf[c * chunk..(c + 1) * chunk]
                    .iter()
                    .fold(acc, |a, &x| a.wrapping_add(x))
            });
            total.fetch_add(part, Ordering::Relaxed);
        });
        let secs = started.elapsed().as_secs_f64();
        std::hint::black_box(total.load(Ordering::Relaxed));
        (items * chunk * 8) as f64 / secs
    }
}

/// The median of `xs` (the mean of the middle two for an even count); NaN when empty.
fn median(mut xs: Vec<f64>) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    (xs[(n - 1) / 2] + xs[n / 2]) / 2.0
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
    }
}
