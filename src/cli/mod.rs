//! Command-line interface: `serve`, `gateway`, `generate`, `tune`, `train-router`, `bench`,
//! `bench-model` and `bench-runtime`. Every flag can also be set through
//! the environment (`TOKENROUTER_<FLAG>`).

mod bench;
mod bench_model;
mod bench_runtime;
mod gateway;
mod generate;
mod serve;
mod serve_dp;
mod train_router;
mod tune;

use std::path::PathBuf;

use clap::{Parser, Subcommand};
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
}

#[derive(Subcommand)]
enum Command {
    /// Serve the configured models over HTTP (OpenAI- and SGLang-compatible API).
    Serve(serve::ServeArgs),
    /// Generate text, streaming it to stdout: token-routed across the models of --config, or
    /// from one model with --model.
    Generate(generate::GenerateArgs),
    /// Measure prefill and decode throughput per batch size against the memory roofline.
    BenchModel(bench_model::BenchArgs),
    /// Benchmark a running server (or every scheduling mode with --compare-modes).
    Bench(bench::BenchArgs),
    /// Delayed-batching thresholds from the throughput model, on profiled step latencies.
    Tune(tune::TuneArgs),
    /// Cache-aware gateway in front of running servers (data parallelism).
    Gateway(gateway::GatewayArgs),
    /// Train R2R / CITER / Co-LLM router heads for the configured SLM/LLM pair.
    TrainRouter(train_router::TrainRouterArgs),
    /// Token-routed serving throughput of the configured models in every scheduling mode.
    BenchRuntime(bench_runtime::BenchRuntimeArgs),
}

impl Cli {
    /// Whether candle's kernels do heavy work in this command (candle's matmul backend, or a
    /// `bench-model` baseline run), so candle keeps its own compute threads.
    pub fn candle_computes(&self) -> bool {
        MatmulBackend::from_env() == MatmulBackend::Candle
            || matches!(&self.command, Command::BenchModel(args) if args.baseline_candle)
    }
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    // A bad instruction-set override is a start-up error, not a warning deep in a kernel.
    tokenrouter::kernels::qmatmul::Isa::from_env()?;
    match cli.command {
        Command::Serve(args) => serve::run(args),
        Command::Gateway(args) => gateway::run(args),
        Command::TrainRouter(args) => train_router::run(args),
        Command::Tune(args) => tune::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Generate(args) => generate::run(args),
        Command::BenchModel(args) => bench_model::run(args),
        Command::BenchRuntime(args) => bench_runtime::run(args),
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
    /// `cpu`, or `cuda:N` in a build with the `cuda` feature.
    #[arg(long, env = "TOKENROUTER_DEVICE", default_value = "cpu")]
    device: String,
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
    fn load(&self) -> anyhow::Result<LoadedModel> {
        self.load_with(MatmulBackend::from_env())
    }

    fn load_with(&self, backend: MatmulBackend) -> anyhow::Result<LoadedModel> {
        Ok(LoadedModel::load_on(&self.path()?, self.target(backend)?)?)
    }

    /// Where `--device` says the model computes, with `backend`'s kernels on a CPU.
    fn target(&self, backend: MatmulBackend) -> anyhow::Result<ComputeTarget> {
        parse_device(&self.device, backend)
    }
}
