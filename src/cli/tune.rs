//! `tokenrouter tune`: the throughput model's thresholds for delayed batching. Profiles each
//! configured model's decode-step latency per batch size and extend cost per token on this
//! machine (or reads a saved profile); measures the routing probabilities and the tokens each
//! model extends per request (prompt prefills less prefix-cache hits, and catch-ups) with a
//! routed run of the requests the validation runs (flags can set the probabilities); and prints
//! the predicted throughput of every threshold vector and the best one per concurrency. With
//! `--validate K` it also runs the best K vectors (and eager) through the in-process runtime and
//! prints, and plots, the measured steady-state throughput beside the predicted.

use std::path::PathBuf;
use std::rc::Rc;

use clap::Args;
use serde::{Deserialize, Serialize};
use tokenrouter::actors::{load_models, Runtime};
use tokenrouter::config::{Config, CoreSplit, Role, SchedulingMode, ThresholdSource};
use tokenrouter::model::LoadedModel;
use tokenrouter::tuning::{optimize, Candidate, ChainInputs};

use tokenrouter::model::profile::step_latencies;

use super::bench::chart;
use super::bench_runtime::{run_level, Timeline};

#[derive(Args)]
pub struct TuneArgs {
    #[arg(long, env = "TOKENROUTER_CONFIG", default_value = "config.toml")]
    config: PathBuf,
    /// Concurrency levels (N) to solve for.
    #[arg(long, value_delimiter = ',', default_value = "4,8,16")]
    concurrency: Vec<usize>,
    /// Probability that the SLM hands a token to the LLM, instead of the measured one.
    #[arg(long)]
    p_up: Option<f64>,
    /// Probability that the LLM hands back after a token, instead of the measured one.
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
    /// the runtime in delayed mode, 3N requests from N clients, timed from the first
    /// request's end to the last request's start (while all N are in flight).
    #[arg(long, default_value_t = 0)]
    validate: usize,
    /// Output tokens per request of the routing and validation runs.
    #[arg(long, default_value_t = 32)]
    validate_tokens: usize,
    /// Write the measured-vs-predicted plot of the validation runs here (SVG).
    #[arg(long)]
    plot: Option<PathBuf>,
}

/// Decode-step seconds per batch size (index 0: batch 1), and extend seconds per token, per
/// model.
#[derive(Debug, Serialize, Deserialize)]
struct Profile {
    models: Vec<String>,
    latency: Vec<Vec<f64>>,
    /// Empty in profiles saved before it was measured: catch-ups then cost the decode slope.
    #[serde(default)]
    extend_token: Vec<f64>,
}

/// What the routed run measured.
struct Routing {
    p_up: f64,
    p_down: f64,
    /// Mean prompt tokens per request.
    prompt_tokens: f64,
    /// Per model (by index): mean prompt tokens computed at a request's first visit there
    /// (the rest came from the prefix cache), the share of requests that visited, and the
    /// tokens extended there per request (prompt prefills and catch-ups).
    computed: Vec<f64>,
    visit: Vec<f64>,
    extends: Vec<f64>,
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
    let routing = measure_routing(
        &config,
        models.clone(),
        [slm, llm],
        max_n,
        args.validate_tokens,
    )?;
    let (p_up, p_down) = (
        args.p_up.unwrap_or(routing.p_up),
        args.p_down.unwrap_or(routing.p_down),
    );
    if !(0.0..=1.0).contains(&p_up) || !(0.0..=1.0).contains(&p_down) {
        anyhow::bail!("--p-up and --p-down are probabilities between 0 and 1");
    }
    eprintln!(
        "routing: P(slm→llm) = {p_up:.3}, P(llm→slm) = {p_down:.3}; {:.0} prompt tokens a request, {:.0} of them computed at the SLM and {:.0} at the LLM (not cached); {:.0}% of requests visit the LLM; tokens extended a request: SLM {:.1}, LLM {:.1}",
        routing.prompt_tokens,
        routing.computed[slm],
        routing.computed[llm],
        100.0 * routing.visit[llm],
        routing.extends[slm],
        routing.extends[llm],
    );
    // The measured extends belong to the measured routing: with probabilities from flags,
    // the catch-ups are estimated from them and the prompts' prefills added.
    let flagged = args.p_up.is_some() || args.p_down.is_some();
    let mut to_validate = Vec::new();
    for &n in &args.concurrency {
        let latency = [
            profile.latency[slm][..n.min(profile.latency[slm].len())].to_vec(),
            profile.latency[llm][..n.min(profile.latency[llm].len())].to_vec(),
        ];
        let mut inputs = ChainInputs::two_models(n, p_up, p_down, latency);
        if profile.extend_token.len() == profile.latency.len() {
            inputs.extend_s = vec![profile.extend_token[slm], profile.extend_token[llm]];
        }
        let one_device = config.models[slm].device == config.models[llm].device
            && config.compute.split == CoreSplit::Shared;
        if one_device && !args.separate_devices {
            inputs.shared_compute = true;
            let output = args.validate_tokens as f64;
            inputs = if flagged {
                let prompt = |i: usize| routing.visit[i] * routing.computed[i];
                inputs
                    .with_catch_up()
                    .with_extends(&[prompt(slm), prompt(llm)], output)
            } else {
                inputs.with_extends(&[routing.extends[slm], routing.extends[llm]], output)
            };
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
                run_level(runtime, 1, 1, 4, false, None).await?;
                let timeline = Rc::new(Timeline::default());
                let run = Some(timeline.clone());
                run_level(runtime, *n, 3 * n, max_tokens, true, run).await?;
                timeline
                    .steady_rate(*n)
                    .ok_or_else(|| anyhow::anyhow!("N = {n}: the run had no steady window"))
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
    let (mut latency, mut extend_token) = (Vec::new(), Vec::new());
    for (entry, lm) in config.models.iter().zip(models) {
        let steps = step_latencies(&lm.model, max_n, config.kv_cache.dtype)?;
        let shown: Vec<String> = steps
            .decode
            .iter()
            .map(|s| format!("{:.0}", s * 1e3))
            .collect();
        eprintln!(
            "profile {}: ms per step at batch 1..={max_n}: {}; extend {:.2} ms a token",
            entry.name,
            shown.join(" "),
            steps.extend_token * 1e3
        );
        latency.push(steps.decode);
        extend_token.push(steps.extend_token);
    }
    Ok(Profile {
        models: config.models.iter().map(|m| m.name.clone()).collect(),
        latency,
        extend_token,
    })
}

/// Handoff probabilities, prompt length, prefix-cache hits, the share of requests that visit
/// each model and the tokens they extend there, from a routed run (eager) of the requests the
/// validation at the largest concurrency `n` runs: 3n of them from n clients.
fn measure_routing(
    config: &Config,
    models: Vec<std::sync::Arc<LoadedModel>>,
    [slm, llm]: [usize; 2],
    n: usize,
    max_tokens: usize,
) -> anyhow::Result<Routing> {
    let mut config = config.clone();
    config.scheduler.mode = SchedulingMode::Eager;
    let (done, stats) = Runtime::run(&config, models, async |runtime| {
        let done = run_level(runtime, n, 3 * n, max_tokens, true, None)
            .await
            .map_err(|e| anyhow::anyhow!("measuring routing: {e}"))?;
        anyhow::Ok((done, runtime.stats().await))
    })??;
    let requests = done.len().max(1) as f64;
    let prompt_tokens = done.iter().map(|d| d.prompt_tokens as f64).sum::<f64>() / requests;
    // Every request starts at the SLM; another model is visited when it committed a token.
    let visits: Vec<usize> = (0..stats.len())
        .map(|i| {
            done.iter()
                .filter(|d| i == slm || d.tokens_per_model.get(i).is_some_and(|&t| t > 0))
                .count()
        })
        .collect();
    let computed = stats
        .iter()
        .zip(&visits)
        .map(|(s, &v)| (prompt_tokens - s.prefix_hit_tokens as f64 / v.max(1) as f64).max(0.0))
        .collect();
    let extends = stats
        .iter()
        .map(|s| s.extend_tokens as f64 / requests)
        .collect();
    let (s, l) = (&stats[slm], &stats[llm]);
    // SLM moves drop the sampled token, so its samples are commits plus moves.
    Ok(Routing {
        p_up: s.handoffs_out as f64 / (s.tokens_committed + s.handoffs_out).max(1) as f64,
        p_down: l.handoffs_out as f64 / l.tokens_committed.max(1) as f64,
        prompt_tokens,
        computed,
        visit: visits.iter().map(|&v| v as f64 / requests).collect(),
        extends,
    })
}
