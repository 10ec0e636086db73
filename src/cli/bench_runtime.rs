//! `tokenrouter bench-runtime`: the configured models and routing algorithm under closed-loop
//! load, in every scheduling mode (`sync`, `eager`, `delayed`) in one run, at several
//! concurrency levels. Prints output tokens/s, the share of tokens per model and each mode's
//! ratio to `sync` measured in the same run. Greedy decoding with end-of-sequence ignored, so
//! every mode generates the same tokens and the comparison is of scheduling alone.

use std::cell::{Cell, RefCell};
use std::path::PathBuf;
use std::rc::Rc;
use std::time::{Duration, Instant};

use clap::Args;
use tokenrouter::actors::{load_models, GenerateRequest, Prompt, Runtime, Summary};
use tokenrouter::config::{Config, SchedulingMode};
use tokenrouter::model::{ChatMessage, MatmulBackend, SamplingParams};

#[derive(Args)]
pub struct BenchRuntimeArgs {
    #[arg(long, env = "TOKENROUTER_CONFIG", default_value = "config.toml")]
    config: PathBuf,
    /// Concurrent clients, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    concurrency: Vec<usize>,
    /// Scheduling modes to compare; `sync` is the baseline of the ratios.
    #[arg(long, value_delimiter = ',', default_value = "sync,eager,delayed")]
    modes: Vec<String>,
    /// Output tokens per request.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Requests per concurrency level (default: as many as the concurrency).
    #[arg(long)]
    requests: Option<usize>,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
    /// Every model on this device (`cpu`, `cpu:A-B`, `cuda:N`) instead of its configured one.
    #[arg(long, env = "TOKENROUTER_DEVICE")]
    device: Option<String>,
}

const PROMPTS: &[&str] = &[
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash map is and write a tiny one in Rust.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Implement binary search in C and explain its complexity.",
    "Write a bash script that counts the lines of every .py file in a directory tree.",
    "What is the difference between a process and a thread? Give a Python example.",
    "Write a JavaScript function that debounces another function.",
    "Implement a stack with a max() operation in O(1) in Java.",
];

struct Measured {
    mode: String,
    concurrency: usize,
    requests: usize,
    output_tokens: usize,
    secs: f64,
    tokens_per_model: Vec<usize>,
    handoffs: usize,
    mean_ttft: Duration,
}

impl Measured {
    fn tok_s(&self) -> f64 {
        self.output_tokens as f64 / self.secs.max(1e-9)
    }
}

pub fn run(args: BenchRuntimeArgs, backend: MatmulBackend) -> anyhow::Result<()> {
    if args.concurrency.is_empty() || args.concurrency.contains(&0) || args.max_tokens == 0 {
        anyhow::bail!("--concurrency needs positive levels and --max-tokens must be positive");
    }
    let modes: Vec<SchedulingMode> = args
        .modes
        .iter()
        .map(|m| m.parse().map_err(|e| anyhow::anyhow!("--modes: {e}")))
        .collect::<anyhow::Result<_>>()?;
    let mut config = Config::load(&args.config)?;
    super::override_device(&mut config, args.device.as_deref())?;
    let models = load_models(&config, backend)?;
    let names: Vec<String> = config.models.iter().map(|m| m.name.clone()).collect();
    let mut results = Vec::new();
    for (mode_name, mode) in args.modes.iter().zip(modes) {
        let mut config = config.clone();
        config.scheduler.mode = mode;
        Runtime::run(&config, models.clone(), async |runtime| {
            // One short request first, so page faults and lazy set-up are not timed.
            run_level(runtime, 1, 1, 4, false, None).await?;
            for &c in &args.concurrency {
                let n = args.requests.unwrap_or(c).max(c);
                let started = Instant::now();
                let summaries = run_level(runtime, c, n, args.max_tokens, false, None).await?;
                let m = measure(mode_name, c, &summaries, started.elapsed(), names.len());
                report_progress(&m, &names);
                results.push(m);
            }
            anyhow::Ok(())
        })??;
    }
    print_results(&results, &names, args.json);
    Ok(())
}

/// When a closed-loop run submitted each request and received each piece of output.
#[derive(Default)]
pub(super) struct Timeline {
    submitted: RefCell<Vec<Instant>>,
    tokens: RefCell<Vec<(Instant, usize)>>,
}

impl Timeline {
    /// Output tokens/s while every client had a request in flight: from the first request's
    /// end (the `concurrency + 1`-th submission) to the last submission. `None` when the run
    /// had no such window (fewer than `concurrency + 2` requests).
    pub(super) fn steady_rate(&self, concurrency: usize) -> Option<f64> {
        let submitted = self.submitted.borrow();
        let (&start, &end) = (submitted.get(concurrency)?, submitted.last()?);
        let secs = end.saturating_duration_since(start).as_secs_f64();
        if secs <= 0.0 {
            return None;
        }
        let tokens: usize = self
            .tokens
            .borrow()
            .iter()
            .filter(|(t, _)| *t > start && *t <= end)
            .map(|(_, n)| n)
            .sum();
        Some(tokens as f64 / secs)
    }
}

/// `n` requests from `concurrency` clients, each sending its next request when one ends;
/// recorded in `timeline` when given. With `distinct`, every prompt is numbered, so that
/// beyond the chat template's common head no request finds another's tokens in the prefix
/// cache (greedy decoding of a repeated prompt would repeat its output too).
pub(super) async fn run_level(
    runtime: &Runtime,
    concurrency: usize,
    n: usize,
    max_tokens: usize,
    distinct: bool,
    timeline: Option<Rc<Timeline>>,
) -> anyhow::Result<Vec<Summary>> {
    let next = Rc::new(Cell::new(0usize));
    let clients: Vec<_> = (0..concurrency)
        .map(|_| {
            let (next, shared) = (next.clone(), runtime.shared().clone());
            let timeline = timeline.clone();
            actix::spawn(async move {
                let mut done = Vec::new();
                while next.get() < n {
                    let i = next.get();
                    next.set(i + 1);
                    let handle = shared.submit(request(i, max_tokens, distinct));
                    let on_text = |_: &str, tokens: &[(u32, usize)]| {
                        if let Some(t) = &timeline {
                            t.tokens.borrow_mut().push((Instant::now(), tokens.len()));
                        }
                    };
                    if let Some(t) = &timeline {
                        t.submitted.borrow_mut().push(Instant::now());
                    }
                    match handle.finish(on_text).await {
                        Ok(Some(s)) => done.push(s),
                        Ok(None) => anyhow::bail!("request {i} was cancelled"),
                        Err(e) => anyhow::bail!("request {i} failed: {e}"),
                    }
                }
                Ok(done)
            })
        })
        .collect();
    let mut summaries = Vec::new();
    for client in clients {
        summaries.extend(client.await??);
    }
    Ok(summaries)
}

fn request(i: usize, max_tokens: usize, distinct: bool) -> GenerateRequest {
    let prompt = PROMPTS[i % PROMPTS.len()];
    let text = if distinct {
        format!("Task {}: {prompt}", i + 1)
    } else {
        prompt.to_string()
    };
    let messages = vec![ChatMessage::new("user", &text)];
    let mut request =
        GenerateRequest::new(Prompt::Chat(messages), SamplingParams::greedy(), max_tokens);
    request.ignore_eos = true;
    request
}

fn measure(
    mode: &str,
    concurrency: usize,
    summaries: &[Summary],
    wall: Duration,
    models: usize,
) -> Measured {
    let mut tokens_per_model = vec![0; models];
    for s in summaries {
        for (t, n) in tokens_per_model.iter_mut().zip(&s.tokens_per_model) {
            *t += n;
        }
    }
    let ttfts: Vec<Duration> = summaries.iter().filter_map(|s| s.ttft).collect();
    Measured {
        mode: mode.to_string(),
        concurrency,
        requests: summaries.len(),
        output_tokens: summaries.iter().map(|s| s.completion_tokens).sum(),
        secs: wall.as_secs_f64(),
        tokens_per_model,
        handoffs: summaries.iter().map(|s| s.handoffs).sum(),
        mean_ttft: ttfts.iter().sum::<Duration>() / ttfts.len().max(1) as u32,
    }
}

fn shares(m: &Measured, names: &[String]) -> String {
    let total = m.tokens_per_model.iter().sum::<usize>().max(1) as f64;
    names
        .iter()
        .zip(&m.tokens_per_model)
        .map(|(n, &t)| format!("{n} {:.0}%", 100.0 * t as f64 / total))
        .collect::<Vec<_>>()
        .join(", ")
}

fn report_progress(m: &Measured, names: &[String]) {
    eprintln!(
        "{:>7} c={:<3} {:>6.1} tok/s ({} tokens in {:.1} s; {})",
        m.mode,
        m.concurrency,
        m.tok_s(),
        m.output_tokens,
        m.secs,
        shares(m, names)
    );
}

fn print_results(results: &[Measured], names: &[String], json: bool) {
    let sync = |c: usize| {
        results
            .iter()
            .find(|r| r.mode == "sync" && r.concurrency == c)
            .map(Measured::tok_s)
    };
    if !json {
        println!("| mode | concurrency | output tok/s | vs sync | tokens per model | handoffs | mean TTFT ms |");
        println!("|---|---|---|---|---|---|---|");
    }
    for m in results {
        let ratio = sync(m.concurrency).map(|s| m.tok_s() / s);
        if json {
            let line = serde_json::json!({
                "mode": m.mode, "concurrency": m.concurrency, "requests": m.requests,
                "output_tokens": m.output_tokens, "seconds": m.secs, "output_tok_s": m.tok_s(),
                "ratio_to_sync": ratio, "tokens_per_model": m.tokens_per_model,
                "models": names, "handoffs": m.handoffs,
                "mean_ttft_ms": m.mean_ttft.as_secs_f64() * 1e3,
            });
            println!("{line}");
        } else {
            println!(
                "| {} | {} | {:.1} | {} | {} | {} | {:.0} |",
                m.mode,
                m.concurrency,
                m.tok_s(),
                ratio.map_or("–".into(), |r| format!("{r:.2}×")),
                shares(m, names),
                m.handoffs,
                m.mean_ttft.as_secs_f64() * 1e3
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_steady_rate_counts_the_tokens_between_the_first_end_and_the_last_start() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let timeline = Timeline::default();
        // Two clients, four requests: the third starts when the first ends (1 s), the fourth
        // at 2.5 s.
        *timeline.submitted.borrow_mut() = vec![at(0), at(0), at(1000), at(2500)];
        *timeline.tokens.borrow_mut() =
            vec![(at(500), 4), (at(1500), 6), (at(2500), 3), (at(2600), 9)];
        let rate = timeline.steady_rate(2).unwrap();
        assert!((rate - 9.0 / 1.5).abs() < 1e-9, "{rate}");
        // No request started after the first end: no window.
        assert_eq!(timeline.steady_rate(4), None);
    }
}
