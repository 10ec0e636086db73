//! `tokenrouter bench-model`: prefill and decode tokens/s per batch size, next to the batch-1
//! decode roofline: the bytes one sequence's decode step must read (every weight it streams
//! and the sequence's K/V at its context) ÷ the memory read bandwidth. The bandwidth of a
//! shared machine drifts over seconds, so every timed decode step is followed by a plain read
//! of as many bytes, and each row reports the median of those pairs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use clap::Args;

use tokenrouter::kernels::large_buf::{self, LargeBuf};
use tokenrouter::kernels::parallel::for_each_range;
use tokenrouter::kernels::qmatmul::{peak, Isa};
use tokenrouter::model::profile::{
    measure, measure_with, median, warm_up, Throughput, Workload, EXTEND_STEPS,
};
use tokenrouter::model::random::{self, RandomSource};
use tokenrouter::model::timing::{set_breakdown, KernelTime, PROJECTIONS};
use tokenrouter::model::{KvDtype, MatmulBackend, Model};

mod shares;
use shares::{projection_macs, DecodeShares, PrefillShares};

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: super::ModelArg,
    /// Measure a random-weight model of a published shape instead of a file, made in memory:
    /// `qwen2.5-0.5b`, `qwen2.5-1.5b`, `qwen3-0.6b`, `qwen3-8b` or `qwen3-32b`, optionally
    /// with the matrices' format (`qwen3-8b:q4_k`; default Q4_K).
    #[arg(long, value_name = "SHAPE[:FORMAT]")]
    random: Option<String>,
    /// Batch sizes to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    batch: Vec<usize>,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 64)]
    prompt_len: usize,
    /// Decode steps timed per batch size.
    #[arg(long, default_value_t = 16)]
    decode_steps: usize,
    /// After the decode steps, also time three steps each extending every sequence by this
    /// many new tokens (a routed model's catch-up on the tokens produced elsewhere), as
    /// "extend tok/s" (their median).
    #[arg(long, default_value_t = 0)]
    extend: usize,
    /// With --extend: after each extend step, time a batch-1 prefill of this many tokens (on
    /// a cache of its own), the long prefill the catch-up is read against, and print the
    /// extend's rate over it ("extend/prefill", the median of the steps' ratios) beside the
    /// prefill's tok/s.
    #[arg(long, default_value_t = 0, value_name = "TOKENS")]
    against_prefill: usize,
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
    /// among them), attention, the residual adds and norms, rotary and the K/V write, SiLU
    /// (where it runs after the gate/up matmul rather than in it), and everything else; the
    /// rate the matmuls stream weights (all of them, the layers', the LM head's); and each of
    /// the layers' projections (q/k/v, o, gate/up, down): its share and its rate. The same
    /// for the prefill, whose rates are multiply-adds a second against the peak of the
    /// kernels' inner product, measured first on data held in registers.
    #[arg(long)]
    breakdown: bool,
    /// On a GPU, run every decode step launch by launch instead of replaying CUDA graphs
    /// (as `--breakdown` does, whose events time each launch).
    #[arg(long)]
    eager: bool,
}

pub fn run(args: BenchArgs, backend: MatmulBackend) -> anyhow::Result<()> {
    if args.batch.is_empty() || args.batch.contains(&0) {
        anyhow::bail!("--batch needs positive batch sizes, e.g. --batch 1,4,16");
    }
    if args.prompt_len == 0 || args.decode_steps == 0 {
        anyhow::bail!("--prompt-len and --decode-steps must be positive");
    }
    if args.against_prefill > 0 && args.extend == 0 {
        anyhow::bail!("--against-prefill compares with the extend steps: give --extend too");
    }
    if args.random.is_some() && args.model.quantize.is_some() {
        anyhow::bail!(
            "--quantize applies to a file's weights; with --random, give the format as NAME:FORMAT"
        );
    }
    // The model, and its name in the report.
    let load = |backend: MatmulBackend| -> anyhow::Result<(Model, String)> {
        Ok(match &args.random {
            Some(spec) => {
                let (config, dtype) = random::parse(spec)?;
                let mut src = RandomSource::new(&config, dtype, args.seed);
                let model = Model::load_on(config, &mut src, args.model.target(backend)?)?;
                (model, format!("random {spec}"))
            }
            None => {
                let lm = args.model.load_with(backend)?;
                let name = lm
                    .path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned());
                (lm.model, name.unwrap_or_default())
            }
        })
    };
    let (model, name) = load(backend)?;
    model.set_cuda_graphs(!args.eager);
    let model = &model;
    let needed = (args.prompt_len + args.decode_steps + EXTEND_STEPS * args.extend)
        .max(args.against_prefill);
    if needed > model.config().context_length {
        anyhow::bail!(
            "--prompt-len + --decode-steps + {EXTEND_STEPS} × --extend (or --against-prefill) = {needed} exceeds the model's context length {}",
            model.config().context_length
        );
    }
    let baseline = match args.baseline_candle {
        true => Some(load(MatmulBackend::Candle)?.0),
        false => None,
    };
    warm_up(model)?;
    if let Some(b) = &baseline {
        warm_up(b)?;
    }
    let config = model.config();
    let bytes = StepBytes {
        weights: model.streamed_weight_bytes() as f64,
        lm_head: model.lm_head_bytes() as f64,
        projections: model.projection_bytes().map(|b| b as f64),
        kv_per_position: (2 * config.num_layers * config.kv_dim() * args.kv_dtype.size_in_bytes())
            as f64,
        prompt_len: args.prompt_len,
    };
    let probe = ReadProbe::new(model.device_copy_rate()?);
    let bandwidth = probe.bandwidth(5);
    let device = model.describe_device();
    let kernels = match probe.device_rate {
        Some(_) => "cuda",
        None => backend.kernels(),
    };
    let scale = args.breakdown.then(|| ComputeScale {
        macs: projection_macs(config),
        // On a GPU the prefill's kernels are listed with their device time instead.
        peak: probe
            .device_rate
            .is_none()
            .then(|| peak::int8_macs_per_s(Isa::best(), 0.5))
            .flatten(),
    });
    if !args.json {
        // The middle step's bytes stand for the row's.
        let middle = bytes.at(args.decode_steps / 2);
        println!(
            "model {name}: {:.1} MB of weights streamed per decode step (+{:.2} MB of K/V at the middle step's context), best read bandwidth {:.2} GB/s, batch-1 roofline {:.1} tok/s, on {device}",
            bytes.weights / 1e6,
            (middle - bytes.weights) / 1e6,
            bandwidth / 1e9,
            bandwidth / middle,
        );
        if let Some(c) = large_buf::coverage().filter(|c| c.region_bytes > 0) {
            println!(
                "2 MB pages back {:.0} of the {:.0} MB reserved for the repacked weights, the K/V caches and the read buffer (the rest is on 4 KB pages, or not touched)",
                c.huge_bytes as f64 / 1e6,
                c.region_bytes as f64 / 1e6,
            );
        }
        println!(
            "(each decode step is paired with a plain read of a batch-1 step's bytes just after it; read GB/s, roofline and % roofline are the medians over a row's steps)"
        );
        if let Some(peak) = scale.as_ref().and_then(|s| s.peak) {
            println!(
                "peak of the kernels' inner product ({} 8-bit multiply-adds on registers, {} threads): {:.1} G/s",
                Isa::best().name(),
                tokenrouter::kernels::parallel::current_threads(),
                peak / 1e9
            );
        }
        print!(
            "{:>6} {:>14} {:>14} {:>10} {:>10} {:>10}",
            "batch", "prefill tok/s", "decode tok/s", "read GB/s", "roofline", "% roofline"
        );
        if args.extend > 0 {
            print!(" {:>13}", "extend tok/s");
        }
        if args.against_prefill > 0 {
            print!(" {:>14} {:>15}", "prefill tok/s", "extend/prefill");
        }
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
        extend: args.extend,
        against_prefill: args.against_prefill,
        seed: args.seed,
        kv_dtype: args.kv_dtype,
    };
    for &batch in &args.batch {
        let row = Row::measure(model, batch, &workload, &probe, &bytes, scale.as_ref())?;
        let base = match &baseline {
            Some(b) => Some(measure(b, batch, &workload)?),
            None => None,
        };
        if args.json {
            let mut obj = row.json(&name, batch, kernels);
            obj["device"] = device.as_str().into();
            obj["eager"] = args.eager.into();
            if let Some(b) = &base {
                obj["candle_prefill_tok_s"] = b.prefill_tok_s.into();
                obj["candle_decode_tok_s"] = b.decode_tok_s.into();
            }
            println!("{obj}");
        } else {
            row.print(batch, base.as_ref());
        }
    }
    Ok(())
}

/// The bytes a batch-1 decode step must read: every weight it streams, and the sequence's K/V.
struct StepBytes {
    weights: f64,
    /// The LM head's part of `weights`.
    lm_head: f64,
    /// The layers' projections' parts of `weights` (in the order of [`PROJECTIONS`]).
    projections: [f64; PROJECTIONS.len()],
    kv_per_position: f64,
    prompt_len: usize,
}

impl StepBytes {
    /// At decode step `s`, which attends to `prompt_len + s + 1` positions.
    fn at(&self, s: usize) -> f64 {
        self.weights + self.kv_per_position * (self.prompt_len + s + 1) as f64
    }
}

/// One batch size's measurement, against the reads paired with its steps.
struct Row {
    throughput: Throughput,
    /// Medians over the steps: read rate (bytes/s), batch-1 roofline (steps/s), and each
    /// step's tokens/s over its own roofline.
    read: f64,
    roofline: f64,
    fraction: f64,
    shares: Option<DecodeShares>,
    prefill_shares: Option<PrefillShares>,
}

/// What `--breakdown` reads the prefill against: each projection's multiply-adds a token
/// ([`projection_macs`]) and the kernels' inner product's peak on this CPU.
struct ComputeScale {
    macs: [f64; PROJECTIONS.len()],
    peak: Option<f64>,
}

impl Row {
    fn measure(
        model: &Model,
        batch: usize,
        workload: &Workload,
        probe: &ReadProbe,
        bytes: &StepBytes,
        breakdown: Option<&ComputeScale>,
    ) -> anyhow::Result<Self> {
        let mut rates = Vec::with_capacity(workload.decode_steps);
        set_breakdown(breakdown.is_some());
        let throughput = measure_with(model, batch, workload, &mut |s| {
            rates.push(probe.read_rate(bytes.at(s) as usize))
        });
        set_breakdown(false);
        let throughput = throughput?;
        let rooflines: Vec<f64> = rates
            .iter()
            .enumerate()
            .map(|(s, rate)| rate / bytes.at(s))
            .collect();
        let fraction = median(
            rooflines
                .iter()
                .zip(&throughput.step_secs)
                .map(|(roofline, secs)| batch as f64 / secs / roofline)
                .collect(),
        );
        let shares = throughput
            .breakdown
            .map(|parts| DecodeShares::new(&parts, &throughput.step_secs, bytes));
        let prefill_shares = throughput
            .prefill_breakdown
            .zip(breakdown)
            .map(|(parts, scale)| PrefillShares::new(&parts, &throughput, scale));
        Ok(Self {
            read: median(rates),
            roofline: median(rooflines),
            fraction,
            shares,
            prefill_shares,
            throughput,
        })
    }

    fn json(&self, model: &str, batch: usize, kernels: &str) -> serde_json::Value {
        let t = &self.throughput;
        let mut obj = serde_json::json!({
            "model": model,
            "batch": batch,
            "prefill_tok_s": t.prefill_tok_s,
            "decode_tok_s": t.decode_tok_s,
            "roofline_tok_s": self.roofline,
            "roofline_fraction": self.fraction,
            "read_gb_s": self.read / 1e9,
            "kernels": kernels,
        });
        if let Some(rate) = t.extend_tok_s {
            obj["extend_tok_s"] = rate.into();
        }
        if let Some((prefill, ratio)) = t.extend_against {
            obj["against_prefill_tok_s"] = prefill.into();
            obj["extend_over_prefill"] = ratio.into();
        }
        if let Some(s) = &self.shares {
            obj["breakdown"] = s.json();
        }
        if let Some(s) = &self.prefill_shares {
            obj["prefill_breakdown"] = s.json();
        }
        if !t.decode_kernels.is_empty() {
            let list = |times: &[KernelTime]| {
                times
                    .iter()
                    .map(|k| serde_json::json!({"name": k.name, "secs": k.secs, "launches": k.launches}))
                    .collect::<Vec<_>>()
            };
            obj["prefill_kernels"] = list(&t.prefill_kernels).into();
            obj["decode_kernels"] = list(&t.decode_kernels).into();
        }
        obj
    }

    /// The table's line (and the breakdown's, when measured); `base`: candle's on the same
    /// model.
    fn print(&self, batch: usize, base: Option<&Throughput>) {
        let t = &self.throughput;
        print!(
            "{:>6} {:>14.1} {:>14.1} {:>10.2} {:>10.1} {:>9.0}%",
            batch,
            t.prefill_tok_s,
            t.decode_tok_s,
            self.read / 1e9,
            self.roofline,
            100.0 * self.fraction
        );
        if let Some(rate) = t.extend_tok_s {
            print!(" {rate:>13.1}");
        }
        if let Some((prefill, ratio)) = t.extend_against {
            print!(" {prefill:>14.1} {ratio:>15.2}");
        }
        if let Some(b) = base {
            print!(
                " {:>15.1} {:>15.1} {:>8.1}x",
                b.prefill_tok_s,
                b.decode_tok_s,
                t.decode_tok_s / b.decode_tok_s
            );
        }
        println!();
        if let Some(s) = &self.prefill_shares {
            s.print();
        }
        if let Some(s) = &self.shares {
            s.print();
        }
        print_kernels("prefill", &t.prefill_kernels, t.prefill_secs(), 1);
        let decode_secs: f64 = t.step_secs.iter().sum();
        print_kernels("decode", &t.decode_kernels, decode_secs, t.step_secs.len());
    }
}

/// A GPU's device time per kernel over `wall` seconds of `steps` steps: the ten longest, in
/// milliseconds per step, and how much of the wall time the device was busy.
fn print_kernels(what: &str, times: &[KernelTime], wall: f64, steps: usize) {
    if times.is_empty() {
        return;
    }
    let busy: f64 = times.iter().map(|k| k.secs).sum();
    let launches: usize = times.iter().map(|k| k.launches).sum();
    let per_step = |secs: f64| 1e3 * secs / steps.max(1) as f64;
    let top: Vec<String> = times
        .iter()
        .take(10)
        .map(|k| {
            format!(
                "{} {:.3} ({}x)",
                k.name,
                per_step(k.secs),
                k.launches / steps.max(1)
            )
        })
        .collect();
    println!(
        "{:>6} {what}: device busy {:.2} of {:.2} ms per step ({} launches); ms per step: {}",
        "",
        per_step(busy),
        per_step(wall),
        launches / steps.max(1),
        top.join(", ")
    );
}

/// A buffer far larger than the caches, for timing plain reads of memory; placed as the
/// weights are (on huge pages where the OS offers them), so the roofline reads the way the
/// kernels can.
/// The memory rate each step is read against: a plain read of host memory paired with each
/// step, or, for a model on a GPU, its device-to-device copy rate measured once at start (a
/// GPU's memory rate does not drift with a neighbour's load as a shared host's does).
struct ReadProbe {
    device_rate: Option<f64>,
    buf: LargeBuf<u64>,
    /// The chunk the next read starts at: each read continues where the last one stopped, so
    /// none starts on lines a previous read may have left in the caches.
    next: std::cell::Cell<usize>,
}

impl ReadProbe {
    /// Words per work item.
    const CHUNK: usize = 1 << 16;

    fn new(device_rate: Option<f64>) -> Self {
        // 512 MiB of u64 (one word on a GPU's run, where the host is not read).
        let words = if device_rate.is_some() {
            1 << 16
        } else {
            64 << 20
        };
        Self {
            device_rate,
            buf: LargeBuf::from_fn(words, |i| i as u64),
            next: std::cell::Cell::new(0),
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
        if let Some(rate) = self.device_rate {
            return rate;
        }
        let chunk = Self::CHUNK;
        let chunks = self.buf.len() / chunk;
        let items = (bytes / 8 / chunk).max(1);
        let first = self.next.get();
        self.next.set((first + items) % chunks);
        let total = AtomicU64::new(0);
        let started = Instant::now();
        let buf = &self.buf;
        for_each_range(items, |range| {
            let part = range.fold(0u64, |acc, i| {
                let c = (first + i) % chunks;
                buf[c * chunk..(c + 1) * chunk]
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
