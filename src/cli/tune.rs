//! `tokenrouter tune`: the throughput model's thresholds for delayed batching. Profiles each
//! configured model's decode-step latency per batch size on this machine (or reads a saved
//! profile), takes the routing probabilities from flags or measures them with a short routed
//! run, and prints the predicted throughput of every threshold vector and the best one per
//! concurrency. With `--validate K` it also runs the best K vectors (and eager) through the
//! in-process runtime and prints, and plots, measured beside predicted throughput.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use serde::{Deserialize, Serialize};
use tokenrouter::actors::{load_models, GenerateRequest, Prompt, Runtime};
use tokenrouter::config::{Config, CoreSplit, Role, SchedulingMode, ThresholdSource};
use tokenrouter::model::{ChatMessage, LoadedModel, SamplingParams};
use tokenrouter::tuning::{optimize, Candidate, ChainInputs};

use tokenrouter::model::profile::step_latencies;

use super::bench::chart;
use super::bench_runtime::run_level;

#[derive(Args)]
pub struct TuneArgs {
    #[arg(long, env = "TOKENROUTER_CONFIG", default_value = "config.toml")]
    config: PathBuf,
    /// Concurrency levels (N) to solve for.
    #[arg(long, value_delimiter = ',', default_value = "4,8,16")]
    concurrency: Vec<usize>,
    /// Probability that the SLM hands a token to the LLM (measured when absent).
    #[arg(long)]
    p_up: Option<f64>,
    /// Probability that the LLM hands back after a token (measured when absent).
    #[arg(long)]
    p_down: Option<f64>,
    /// Read step latencies from this profile instead of measuring them.
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Write the measured profile here.
    #[arg(long)]
    save_profile: Option<PathBuf>,
    /// Print the best vectors only, one JSON object per concurrency.
    #[arg(long)]
    json: bool,
    /// Model each model on its own device, running side by side, even where the config places
    /// them on one (by default the config's placement decides).
    #[arg(long)]
    separate_devices: bool,
    /// Also measure the best K predicted vectors and eager, B = (1, 1), at each concurrency:
    /// the runtime in delayed mode, 2N requests from N clients.
    #[arg(long, default_value_t = 0)]
    validate: usize,
    /// Output tokens per request of the validation runs.
    #[arg(long, default_value_t = 32)]
    validate_tokens: usize,
    /// Write the measured-vs-predicted plot of the validation runs here (SVG).
    #[arg(long)]
    plot: Option<PathBuf>,
}

/// Decode-step seconds per batch size (index 0: batch 1), per model.
#[derive(Debug, Serialize, Deserialize)]
struct Profile {
    models: Vec<String>,
    latency: Vec<Vec<f64>>,
}

pub fn run(args: TuneArgs, backend: tokenrouter::model::MatmulBackend) -> anyhow::Result<()> {
    let config = Config::load(&args.config)?;
    let (slm, llm) = match (config.role_index(Role::Slm), config.role_index(Role::Llm)) {
        (Some(s), Some(l)) if config.models.len() == 2 => (s, l),
        _ => anyhow::bail!(
            "tune needs exactly two models with an SLM and an LLM role in {}",
            args.config.display()
        ),
    };
    let max_n = args.concurrency.iter().copied().max().unwrap_or(0);
    if max_n == 0 || max_n > 64 {
        anyhow::bail!("--concurrency needs levels between 1 and 64");
    }
    config.require_local("tune").map_err(anyhow::Error::msg)?;
    let models = load_models(&config, backend)?;
    let profile = match &args.profile {
        Some(path) => serde_json::from_str(&std::fs::read_to_string(path)?)
            .map_err(|e| anyhow::anyhow!("{}: not a profile: {e}", path.display()))?,
        None => profile_models(&config, &models, max_n)?,
    };
    if let Some(path) = &args.save_profile {
        std::fs::write(path, serde_json::to_string_pretty(&profile)?)?;
    }
    let (p_up, p_down) = match (args.p_up, args.p_down) {
        (Some(u), Some(d)) => (u, d),
        _ => measure_routing(&config, models.clone(), slm, llm)?,
    };
    if !(0.0..=1.0).contains(&p_up) || !(0.0..=1.0).contains(&p_down) {
        anyhow::bail!("--p-up and --p-down are probabilities between 0 and 1");
    }
    eprintln!("routing: P(slm→llm) = {p_up:.3}, P(llm→slm) = {p_down:.3}");
    let mut to_validate = Vec::new();
    for &n in &args.concurrency {
        let latency = [
            profile.latency[slm][..n.min(profile.latency[slm].len())].to_vec(),
            profile.latency[llm][..n.min(profile.latency[llm].len())].to_vec(),
        ];
        let mut inputs = ChainInputs::two_models(n, p_up, p_down, latency);
        let one_device = config.models[slm].device == config.models[llm].device
            && config.compute.split == CoreSplit::Shared;
        if one_device && !args.separate_devices {
            inputs.shared_compute = true;
            inputs = inputs.with_catch_up();
        }
        let (all, best) = optimize(&inputs);
        report(n, &all, best.as_deref(), args.json);
        to_validate.push((n, validation_candidates(&all, args.validate)));
    }
    if args.validate > 0 {
        let points = validate(&config, &models, &to_validate, args.validate_tokens)?;
        if let Some(path) = &args.plot {
            std::fs::write(path, validation_svg(&points))?;
            eprintln!("wrote {}", path.display());
        }
    }
    Ok(())
}

/// A threshold vector and its predicted tokens/s.
type Predicted = (Vec<usize>, f64);

/// The `k` best feasible vectors by prediction, and eager, with their predictions.
fn validation_candidates(all: &[Candidate], k: usize) -> Vec<Predicted> {
    let mut ranked: Vec<Predicted> = all
        .iter()
        .filter_map(|(b, r)| r.as_ref().ok().map(|p| (b.clone(), p.tokens_per_s)))
        .collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
    let eager = ranked
        .iter()
        .find(|(b, _)| b.iter().all(|&t| t == 1))
        .cloned();
    ranked.truncate(k);
    if let Some(eager) = eager.filter(|e| !ranked.contains(e)) {
        ranked.push(eager);
    }
    ranked
}

/// One measured vector: concurrency, thresholds, predicted and measured tokens/s.
struct Validated {
    n: usize,
    thresholds: Vec<usize>,
    predicted: f64,
    measured: f64,
}

/// Runs every candidate through the runtime in delayed mode and prints measured beside
/// predicted throughput, and whether the predicted best is the measured best.
fn validate(
    config: &Config,
    models: &[std::sync::Arc<LoadedModel>],
    candidates: &[(usize, Vec<Predicted>)],
    max_tokens: usize,
) -> anyhow::Result<Vec<Validated>> {
    let mut points = Vec::new();
    for (n, vectors) in candidates {
        for (thresholds, predicted) in vectors {
            let mut config = config.clone();
            config.scheduler.mode = SchedulingMode::Delayed;
            config.scheduler.thresholds = ThresholdSource::Fixed;
            for (model, &b) in config.models.iter_mut().zip(thresholds) {
                model.batch_threshold = b;
            }
            let measured = Runtime::run(&config, models.to_vec(), async |runtime| {
                // One short request first, so lazy set-up is not timed.
                run_level(runtime, 1, 1, 4).await?;
                let started = Instant::now();
                let done = run_level(runtime, *n, 2 * n, max_tokens).await?;
                let tokens: usize = done.iter().map(|s| s.completion_tokens).sum();
                anyhow::Ok(tokens as f64 / started.elapsed().as_secs_f64())
            })??;
            eprintln!(
                "N = {n}, B = {thresholds:?}: predicted {predicted:.2} tok/s, measured {measured:.2} tok/s"
            );
            points.push(Validated {
                n: *n,
                thresholds: thresholds.clone(),
                predicted: *predicted,
                measured,
            });
        }
    }
    for (n, _) in candidates {
        let at_n: Vec<&Validated> = points.iter().filter(|p| p.n == *n).collect();
        let best_by = |key: fn(&Validated) -> f64| {
            at_n.iter()
                .max_by(|a, b| key(a).total_cmp(&key(b)))
                .map(|p| (p.thresholds.clone(), p.measured))
        };
        if let (Some((predicted, got)), Some((measured, top))) =
            (best_by(|p| p.predicted), best_by(|p| p.measured))
        {
            println!(
                "N = {n}: predicted best B = {predicted:?} measured {got:.2} tok/s; measured best B = {measured:?} {top:.2} tok/s ({:.0}% of it)",
                100.0 * got / top
            );
        }
    }
    Ok(points)
}

/// Measured against predicted tokens/s, one line per concurrency, points ordered by
/// prediction (a perfect model puts them on the diagonal).
fn validation_svg(points: &[Validated]) -> String {
    let mut levels: Vec<usize> = points.iter().map(|p| p.n).collect();
    levels.dedup();
    let series: Vec<(String, Vec<(f64, f64)>)> = levels
        .iter()
        .map(|&n| {
            let mut xy: Vec<(f64, f64)> = points
                .iter()
                .filter(|p| p.n == n)
                .map(|p| (p.predicted, p.measured))
                .collect();
            xy.sort_by(|a, b| a.0.total_cmp(&b.0));
            (format!("N = {n}"), xy)
        })
        .collect();
    chart(
        "measured vs predicted throughput per threshold vector",
        "predicted output tokens/s",
        "measured output tokens/s",
        &series,
    )
}

fn report(n: usize, all: &[Candidate], best: Option<&[usize]>, json: bool) {
    let score = |b: &[usize]| {
        all.iter()
            .find(|(v, _)| v == b)
            .and_then(|(_, r)| r.as_ref().ok())
            .map(|p| p.tokens_per_s)
    };
    let eager = score(&[1, 1]);
    if json {
        let line = serde_json::json!({"concurrency": n, "best": best, "predicted_tok_s": best.and_then(score), "eager_tok_s": eager});
        println!("{line}");
        return;
    }
    println!(
        "N = {n}: predicted tokens/s per threshold vector (slm, llm); infeasible ones deadlock"
    );
    let mut ranked: Vec<_> = all
        .iter()
        .filter_map(|(b, r)| r.as_ref().ok().map(|p| (b, p)))
        .collect();
    ranked.sort_by(|a, b| b.1.tokens_per_s.total_cmp(&a.1.tokens_per_s));
    for (b, p) in &ranked {
        println!(
            "  B = {b:?}: {:.2} tok/s ({} states)",
            p.tokens_per_s, p.states
        );
    }
    let infeasible = all.len() - ranked.len();
    println!("  {infeasible} infeasible vectors");
    if let (Some(b), Some(e)) = (best, eager) {
        println!(
            "  best: B = {b:?}, {:.2} tok/s, {:.2}× eager",
            score(b).unwrap_or(0.0),
            score(b).unwrap_or(0.0) / e
        );
    }
}

/// Decode-step latency of every model at batch 1..=max_n.
fn profile_models(
    config: &Config,
    models: &[std::sync::Arc<LoadedModel>],
    max_n: usize,
) -> anyhow::Result<Profile> {
    let mut latency = Vec::new();
    for (entry, lm) in config.models.iter().zip(models) {
        let steps = step_latencies(&lm.model, max_n, config.kv_cache.dtype)?;
        let shown: Vec<String> = steps.iter().map(|s| format!("{:.0}", s * 1e3)).collect();
        eprintln!(
            "profile {}: ms per step at batch 1..={max_n}: {}",
            entry.name,
            shown.join(" ")
        );
        latency.push(steps);
    }
    Ok(Profile {
        models: config.models.iter().map(|m| m.name.clone()).collect(),
        latency,
    })
}

/// Handoff probabilities from a short routed run: per model, moves out per step sampled.
fn measure_routing(
    config: &Config,
    models: Vec<std::sync::Arc<LoadedModel>>,
    slm: usize,
    llm: usize,
) -> anyhow::Result<(f64, f64)> {
    let mut config = config.clone();
    config.scheduler.mode = SchedulingMode::Eager;
    let stats = Runtime::run(&config, models, async |runtime| {
        let prompts = [
            "Write a Python function that merges two sorted lists.",
            "Explain recursion with an example in C.",
        ];
        for text in prompts {
            let mut request = GenerateRequest::new(
                Prompt::Chat(vec![ChatMessage::new("user", text)]),
                SamplingParams::greedy(),
                48,
            );
            request.ignore_eos = true;
            if let Err(e) = runtime.submit(request).finish(|_, _| {}).await {
                anyhow::bail!("measuring routing: {e}");
            }
        }
        Ok(runtime.stats().await)
    })??;
    let (s, l) = (&stats[slm], &stats[llm]);
    // SLM moves drop the sampled token, so its samples are commits plus moves.
    let up = s.handoffs_out as f64 / (s.tokens_committed + s.handoffs_out).max(1) as f64;
    let down = l.handoffs_out as f64 / l.tokens_committed.max(1) as f64;
    Ok((up, down))
}
