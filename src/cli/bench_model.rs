//! `tokenrouter bench-model`: prefill and decode tokens/s per batch size, next to the batch-1
//! decode roofline (bytes of weights a decode step streams ÷ memory read bandwidth measured in
//! the same run).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use clap::Args;

use tokenrouter::kernels::parallel::for_each_range;
use tokenrouter::model::profile::{measure, warm_up, Workload};
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
    let probe = ReadProbe::new();
    let bandwidth = probe.bandwidth(5);
    let name = lm
        .path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if !args.json {
        println!(
            "model {name}: {:.1} MB streamed per decode step, read bandwidth {:.2} GB/s, batch-1 roofline {:.1} tok/s, kernels {}",
            bytes / 1e6,
            bandwidth / 1e9,
            bandwidth / bytes,
            tokenrouter::model::MatmulBackend::from_env().kernels()
        );
        println!(
            "(the bandwidth drifts on a shared machine: each row's roofline is the mean of the read rates just before and just after it)"
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
        let before = probe.bandwidth(3);
        let row = measure(model, batch, &workload)?;
        let roofline = (before + probe.bandwidth(3)) / 2.0 / bytes;
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
                "kernels": tokenrouter::model::MatmulBackend::from_env().kernels(),
            });
            if let Some(b) = &base {
                obj["candle_prefill_tok_s"] = b.prefill_tok_s.into();
                obj["candle_decode_tok_s"] = b.decode_tok_s.into();
            }
            println!("{obj}");
        } else {
            print!(
                "{:>6} {:>14.1} {:>14.1} {:>10.2} {:>10.1} {:>9.0}%",
                batch,
                row.prefill_tok_s,
                row.decode_tok_s,
                roofline * bytes / 1e9,
                roofline,
                100.0 * row.decode_tok_s / roofline
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
        }
    }
    Ok(())
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

    /// Best-of-`passes` read bandwidth in bytes/s, read with the same thread pool the kernels
    /// use.
    fn bandwidth(&self, passes: usize) -> f64 {
        let chunk = Self::CHUNK;
        let items = self.buf.len() / chunk;
        let mut best = 0f64;
        for _ in 0..passes {
            let total = AtomicU64::new(0);
            let started = Instant::now();
            for_each_range(items, |chunks| {
                let part = self.buf[chunks.start * chunk..chunks.end * chunk]
                    .iter()
                    .fold(0u64, |a, &x| a.wrapping_add(x));
                total.fetch_add(part, Ordering::Relaxed);
            });
            let secs = started.elapsed().as_secs_f64();
            std::hint::black_box(total.load(Ordering::Relaxed));
            best = best.max((items * chunk * 8) as f64 / secs);
        }
        best
    }
}
