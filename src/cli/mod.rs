//! Command-line interface: `serve`, `gateway`, `generate`, `tune`, `train-router`, `bench`,
//! `bench-model` and `bench-runtime`. Every flag can also be set through
//! the environment (`TOKENROUTER_<FLAG>`).

mod bench;
#[cfg(feature = "profiling")]
mod bench_model;
mod bench_runtime;
mod gateway;
mod generate;
mod serve;
mod serve_dp;
mod subserver;
#[cfg(feature = "train")]
mod train_router;
mod tune;

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use tokenrouter::config::{Config, DeviceSpec};
use tokenrouter::kernels::qmatmul::Isa;
use tokenrouter::model::{ComputeTarget, LoadedModel, MatmulBackend};

#[derive(Parser)]
#[command(
    name = "tokenrouter",
    version,
    about = "Token-level routed LLM inference"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    kernels: KernelArgs,
}

/// How the CPU kernels run, for every command (set once, before any kernel starts).
#[derive(clap::Args)]
struct KernelArgs {
    /// Cores the CPU kernels use [default: every core the process may run on].
    #[arg(long, global = true, env = "TOKENROUTER_COMPUTE_THREADS",
        value_parser = clap::value_parser!(u16).range(1..))]
    compute_threads: Option<u16>,
    /// The quantized kernels' instruction set instead of the fastest the CPU has: scalar,
    /// avx2, avx-vnni, avx512-vnni or amx.
    #[arg(long, global = true, env = "TOKENROUTER_ISA", value_parser = parse_isa)]
    isa: Option<Isa>,
    /// Whose quantized matmul kernels run on the CPU: ours, or candle's (as candle's own
    /// `CANDLE_DEQUANTIZE_ALL` also asks).
    #[arg(long, global = true, env = "TOKENROUTER_QMATMUL", value_enum,
        default_value_t = MatmulBackend::Native)]
    qmatmul: MatmulBackend,
    /// Where compiled GPU kernels are kept between runs [default:
    /// `$XDG_CACHE_HOME/tokenrouter/kernels`, else `~/.cache/tokenrouter/kernels`].
    #[arg(long, global = true, env = "TOKENROUTER_KERNEL_CACHE")]
    kernel_cache: Option<PathBuf>,
}

fn parse_isa(name: &str) -> Result<Isa, String> {
    Isa::parse(name).map_err(|e| e.to_string())
}

impl KernelArgs {
    /// The kernels for quantized matrices: candle's also when `CANDLE_DEQUANTIZE_ALL` asks
    /// candle to dequantize everything, so a dequantized comparison dequantizes both sides.
    fn backend(&self) -> MatmulBackend {
        let dequantize_all =
            std::env::var("CANDLE_DEQUANTIZE_ALL").is_ok_and(|v| !v.is_empty() && v != "0");
        if dequantize_all {
            MatmulBackend::Candle
        } else {
            self.qmatmul
        }
    }

    /// Makes the choices the process's kernels run with.
    fn apply(&self) -> anyhow::Result<()> {
        if let Some(n) = self.compute_threads {
            tokenrouter::kernels::parallel::limit_cores(n.into()).map_err(anyhow::Error::msg)?;
        }
        if let Some(isa) = self.isa {
            isa.select()?;
        }
        #[cfg(feature = "cuda")]
        if let Some(dir) = self.kernel_cache.clone().or_else(default_kernel_cache) {
            tokenrouter::kernels::cuda::set_cache_dir(dir);
        }
        Ok(())
    }

    /// The same choices as environment variables, for the processes this one starts.
    fn env(&self) -> Vec<(&'static str, String)> {
        let mut env = vec![(
            "TOKENROUTER_QMATMUL",
            format!("{:?}", self.qmatmul).to_lowercase(),
        )];
        if let Some(n) = self.compute_threads {
            env.push(("TOKENROUTER_COMPUTE_THREADS", n.to_string()));
        }
        if let Some(isa) = self.isa {
            env.push(("TOKENROUTER_ISA", isa.name().to_string()));
        }
        if let Some(dir) = &self.kernel_cache {
            env.push(("TOKENROUTER_KERNEL_CACHE", dir.display().to_string()));
        }
        env
    }
}

#[cfg(feature = "cuda")]
fn default_kernel_cache() -> Option<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let root = var("XDG_CACHE_HOME").or_else(|| var("HOME").map(|h| h.join(".cache")))?;
    Some(root.join("tokenrouter/kernels"))
}

#[derive(Subcommand)]
enum Command {
    /// Serve the configured models over HTTP (OpenAI- and SGLang-compatible API).
    Serve(serve::ServeArgs),
    /// Generate text, streaming it to stdout: token-routed across the models of --config, or
    /// from one model with --model.
    Generate(generate::GenerateArgs),
    /// Measure prefill and decode throughput per batch size against the memory roofline.
    #[cfg(feature = "profiling")]
    BenchModel(bench_model::BenchArgs),
    /// Benchmark a running server (or every scheduling mode with --compare-modes).
    Bench(Box<bench::BenchArgs>),
    /// Delayed-batching thresholds from the throughput model, on profiled step latencies.
    Tune(tune::TuneArgs),
    /// Cache-aware gateway in front of running servers (data parallelism).
    Gateway(gateway::GatewayArgs),
    /// Train R2R / CITER / Co-LLM router heads for the configured SLM/LLM pair.
    #[cfg(feature = "train")]
    TrainRouter(train_router::TrainRouterArgs),
    /// Token-routed serving throughput of the configured models in every scheduling mode.
    BenchRuntime(bench_runtime::BenchRuntimeArgs),
    /// Host one model of the config for a front server in another process (its entry there
    /// says `remote = "HOST:PORT"`).
    Subserver(subserver::SubserverCliArgs),
}

impl Cli {
    /// Whether candle's kernels do heavy work in this command (candle's matmul backend, or a
    /// `bench-model` baseline run), so candle keeps its own compute threads.
    pub fn candle_computes(&self) -> bool {
        #[cfg(feature = "profiling")]
        if matches!(&self.command, Command::BenchModel(args) if args.baseline_candle) {
            return true;
        }
        self.kernels.backend() == MatmulBackend::Candle
    }
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    cli.kernels.apply()?;
    let kernels = &cli.kernels;
    match cli.command {
        Command::Serve(args) => serve::run(args, kernels),
        Command::Gateway(args) => gateway::run(args),
        #[cfg(feature = "train")]
        Command::TrainRouter(args) => train_router::run(args, kernels.backend()),
        Command::Tune(args) => tune::run(args, kernels.backend()),
        Command::Bench(args) => bench::run(*args),
        Command::Generate(args) => generate::run(args, kernels.backend()),
        #[cfg(feature = "profiling")]
        Command::BenchModel(args) => bench_model::run(args, kernels.backend()),
        Command::BenchRuntime(args) => bench_runtime::run(args, kernels.backend()),
        Command::Subserver(args) => subserver::run(args, kernels.backend()),
    }
}

/// Which model a command runs: a path, or a name from the config file.
#[derive(clap::Args)]
struct ModelArg {
    /// GGUF file, Hugging Face model directory, or the name of a model in the config file.
    #[arg(long, env = "TOKENROUTER_MODEL")]
    model: Option<String>,
    /// Config file: the models and routing (and the file consulted when --model is a name).
    #[arg(long, env = "TOKENROUTER_CONFIG", default_value = "config.toml")]
    config: PathBuf,
    /// `cpu`, or `cuda:N` in a build with the `cuda` feature (default `cpu`). With a config,
    /// every model is placed there instead of on its `device`.
    #[arg(long, env = "TOKENROUTER_DEVICE")]
    device: Option<String>,
    /// Quantize the layer matrices to this format at load, where it stores them in fewer bits
    /// than the file does. With a config, every model's `quantize`.
    #[arg(long, value_enum)]
    quantize: Option<tokenrouter::model::Quantize>,
}

/// A progress bar over `total` `unit`s on stderr, drawn only when stderr is a terminal (in a
/// pipe or a log it stays silent).
fn progress_bar(total: usize, unit: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(total as u64);
    let template = format!("[{{bar:30}}] {{pos}}/{{len}} {unit} ({{elapsed}})");
    if let Ok(style) = indicatif::ProgressStyle::with_template(&template) {
        bar.set_style(style.progress_chars("#>."));
    }
    bar
}

/// Places every model of `config` on `--device`'s device, when given (`cuda` is `cuda:0`), and
/// checks the config again.
fn override_device(config: &mut Config, device: Option<&str>) -> anyhow::Result<()> {
    let Some(spec) = device else {
        return Ok(());
    };
    let spec: DeviceSpec = match spec {
        "cuda" => DeviceSpec::Cuda(0),
        _ => spec.parse().map_err(|e| anyhow::anyhow!("--device: {e}"))?,
    };
    for m in &mut config.models {
        m.device = spec.clone();
    }
    config.validate().map_err(anyhow::Error::msg)
}

/// Parses `cpu` / `cuda` / `cuda:N` into where the model computes with `backend`'s kernels.
fn parse_device(spec: &str, backend: MatmulBackend) -> anyhow::Result<ComputeTarget> {
    Ok(match spec {
        "cpu" => ComputeTarget::Cpu(backend),
        "cuda" => ComputeTarget::Cuda(0),
        _ => match spec.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => ComputeTarget::Cuda(n),
            _ => anyhow::bail!("--device '{spec}' is not cpu, cuda or cuda:N"),
        },
    })
}

impl ModelArg {
    fn path(&self) -> anyhow::Result<PathBuf> {
        let Some(model) = &self.model else {
            anyhow::bail!("--model is required: a model file, directory, or a name from the config")
        };
        let as_path = PathBuf::from(model);
        if as_path.exists() || model.contains('/') || model.ends_with(".gguf") {
            return Ok(as_path);
        }
        let config = tokenrouter::config::Config::load(&self.config)?;
        match config.model(model) {
            Some(entry) => Ok(entry.path.clone()),
            None => {
                let names: Vec<&str> = config.models.iter().map(|m| m.name.as_str()).collect();
                anyhow::bail!(
                    "--model '{}' is neither a file nor a model named in {} (names: {})",
                    model,
                    self.config.display(),
                    names.join(", ")
                )
            }
        }
    }

    /// Loads the model on the chosen device, naming the path in any error.
    fn load_with(&self, backend: MatmulBackend) -> anyhow::Result<LoadedModel> {
        Ok(LoadedModel::load_quantized(
            &self.path()?,
            self.target(backend)?,
            self.quantize,
        )?)
    }

    /// Where `--device` says the model computes, with `backend`'s kernels on a CPU.
    fn target(&self, backend: MatmulBackend) -> anyhow::Result<ComputeTarget> {
        parse_device(self.device.as_deref().unwrap_or("cpu"), backend)
    }

    /// The config file, with every model on `--device` when given.
    fn load_config(&self) -> anyhow::Result<Config> {
        let mut config = Config::load(&self.config)?;
        if let Some(q) = self.quantize {
            config.models.iter_mut().for_each(|m| m.quantize = Some(q));
        }
        override_device(&mut config, self.device.as_deref())?;
        Ok(config)
    }
}
