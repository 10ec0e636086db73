//! `tokenrouter bench`: a serving benchmark client, like SGLang's `bench_serving`. Closed-loop
//! clients at each concurrency send generated, seeded workloads over the OpenAI streaming API
//! and measure throughput, TTFT, inter-token and end-to-end latency, and the LLM's token share.
//! `--compare-modes` starts `tokenrouter serve` in each scheduling mode in turn;
//! `--compare-policies` starts `serve --dp-size N` (a gateway over N servers) with each
//! gateway policy in turn. Each level also reports the servers' own prefix-cache hit rate.
//! `--simulate-fleet N` compares the gateway's policies on simulated fleets instead.

mod client;
mod fleet;
mod report;
pub(super) use report::chart;
mod workload;

use std::cell::{Cell, RefCell};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::rc::Rc;
use std::time::{Duration, Instant};

use clap::Args;
use report::LevelResult;
use tokenrouter::config::Role;
use workload::{chat_body, load_prompts, PrefixShape, Workload, DEFAULT_DATASET};

#[derive(Args)]
pub struct BenchArgs {
    /// Server to measure (ignored with --compare-modes or --compare-policies, which start
    /// their own).
    #[arg(
        long,
        env = "TOKENROUTER_URL",
        default_value = "http://127.0.0.1:30000"
    )]
    url: String,
    #[arg(long, value_enum, default_value = "short")]
    workload: Workload,
    /// Concurrent clients, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    concurrency: Vec<usize>,
    /// Sessions per concurrency level (default: twice the concurrency).
    #[arg(long)]
    num_requests: Option<usize>,
    /// Output tokens per request (default: the workload's).
    #[arg(long)]
    max_tokens: Option<usize>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Words in each shared system prompt of the shared-prefix workload.
    #[arg(long, default_value_t = 400)]
    prefix_words: usize,
    /// System prompts (groups) of the shared-prefix workload.
    #[arg(long, default_value_t = 4)]
    prefix_groups: usize,
    /// Prompts of the human-eval workload: JSONL with a "prompt" field per line.
    #[arg(long, env = "TOKENROUTER_DATASET", default_value = DEFAULT_DATASET)]
    dataset: PathBuf,
    /// The dataset's prompts, read once at start.
    #[arg(skip)]
    prompts: Rc<Vec<String>>,
    /// Write every level's results here as JSON.
    #[arg(long)]
    output: Option<PathBuf>,
    /// Write `throughput.svg` and `latency.svg` into this folder.
    #[arg(long)]
    plot_dir: Option<PathBuf>,
    /// Start `tokenrouter serve --config CONFIG` in each of --modes in turn.
    #[arg(long)]
    compare_modes: bool,
    #[arg(long, default_value = "config.toml")]
    config: PathBuf,
    #[arg(long, value_delimiter = ',', default_value = "sync,eager,delayed")]
    modes: Vec<String>,
    /// With --compare-modes: also serve the SLM alone and the LLM alone (the config's models
    /// by role, with `serve --single`), as `slm-alone` and `llm-alone`.
    #[arg(long, requires = "compare_modes")]
    baselines: bool,
    /// Repeat every server run this many times, alternating them (A B C, A B C, ...); the
    /// table shows each level's median and range.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Start `tokenrouter serve --config CONFIG --dp-size N` with each of --policies in turn.
    #[arg(long, conflicts_with = "compare_modes")]
    compare_policies: bool,
    /// Gateway policies to compare; `cache_aware+exact` adds --exact-prefix-match.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "cache_aware,round_robin,shortest_queue"
    )]
    policies: Vec<String>,
    /// Servers behind the gateway with --compare-policies.
    #[arg(long, default_value_t = 2)]
    dp_size: usize,
    #[arg(long, default_value_t = 30111)]
    port: u16,
    #[arg(long, env = "TOKENROUTER_API_KEY")]
    api_key: Option<String>,
    #[command(flatten)]
    fleet: fleet::FleetArgs,
}

pub fn run(mut args: BenchArgs) -> anyhow::Result<()> {
    if !args.fleet.simulate_fleet.is_empty() {
        return fleet::run(&args.fleet, args.output.as_ref(), args.plot_dir.as_ref());
    }
    if args.concurrency.is_empty() || args.concurrency.contains(&0) {
        anyhow::bail!("--concurrency needs positive levels, e.g. --concurrency 1,4,16");
    }
    if args.workload == Workload::HumanEval {
        args.prompts = Rc::new(load_prompts(&args.dataset)?);
    }
    let results = actix_web::rt::System::new().block_on(async {
        let mut builder = awc::Client::builder().timeout(Duration::from_secs(3600));
        if let Some(key) = &args.api_key {
            builder = builder.bearer_auth(key);
        }
        let client = builder.finish();
        let mut results = Vec::new();
        let runs = args.runs()?;
        for _ in 0..args.repeat.max(1) {
            if runs.is_empty() {
                results.extend(run_levels(&client, &args.url, &args, "server").await?);
                continue;
            }
            for (label, serve_args) in &runs {
                let mut server = start_server(&args, label, serve_args)?;
                let url = format!("http://127.0.0.1:{}", args.port);
                let outcome = async {
                    wait_healthy(&client, &url, &mut server).await?;
                    run_levels(&client, &url, &args, label).await
                }
                .await;
                stop_server(server);
                results.extend(outcome?);
            }
        }
        anyhow::Ok(report::medians(results))
    })?;
    println!("{}", report::table(&results));
    if let Some(path) = &args.output {
        std::fs::write(path, serde_json::to_string_pretty(&results)?)?;
    }
    if let Some(dir) = &args.plot_dir {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("throughput.svg"), report::throughput_svg(&results))?;
        std::fs::write(dir.join("latency.svg"), report::latency_svg(&results))?;
    }
    Ok(())
}

impl BenchArgs {
    /// The servers to start in turn (label, extra `serve` flags); none to measure --url.
    fn runs(&self) -> anyhow::Result<Vec<(String, Vec<String>)>> {
        if self.compare_modes {
            let mut runs: Vec<(String, Vec<String>)> = self
                .modes
                .iter()
                .map(|m| (m.clone(), vec!["--mode".into(), m.clone()]))
                .collect();
            if self.baselines {
                let config = tokenrouter::config::Config::load(&self.config)?;
                for (label, role) in [("slm-alone", Role::Slm), ("llm-alone", Role::Llm)] {
                    let Some(i) = config.role_index(role) else {
                        anyhow::bail!(
                            "--baselines needs an SLM and an LLM in {} (role = \"slm\" / \"llm\")",
                            self.config.display()
                        );
                    };
                    let name = config.models[i].name.clone();
                    runs.push((label.into(), vec!["--single".into(), name]));
                }
            }
            return Ok(runs);
        }
        if self.compare_policies {
            let dp = self.dp_size.to_string();
            // `cache_aware+exact` is cache-aware routing on the servers' KV-cache events.
            let runs = self.policies.iter().map(|p| {
                let (policy, exact) = match p.strip_suffix("+exact") {
                    Some(policy) => (policy, true),
                    None => (p.as_str(), false),
                };
                let mut flags = ["--dp-size", &dp, "--policy", policy]
                    .map(String::from)
                    .to_vec();
                if exact {
                    flags.push("--exact-prefix-match".into());
                }
                (p.clone(), flags)
            });
            return Ok(runs.collect());
        }
        Ok(Vec::new())
    }
}

/// What a level reads from the servers' `/metrics` before and after it runs.
#[derive(Default)]
struct ServerCounters {
    /// Prefix-cache hit and looked-up tokens.
    prefix: (f64, f64),
    /// Per remote model: its link's frames and bytes (both ways) and last round trip (s).
    links: std::collections::BTreeMap<String, (f64, f64, f64)>,
}

impl ServerCounters {
    /// Each link's traffic from `before` to `self`.
    fn links_since(&self, before: &Self) -> Vec<report::LinkLevel> {
        self.links
            .iter()
            .map(|(model, &(frames, bytes, rtt))| {
                let (f0, b0, _) = before.links.get(model).copied().unwrap_or_default();
                report::LinkLevel {
                    model: model.clone(),
                    frames: (frames - f0).max(0.0) as u64,
                    bytes: (bytes - b0).max(0.0) as u64,
                    rtt_us: (rtt * 1e6).round() as u64,
                }
            })
            .collect()
    }
}

/// The value of label `name` in a `/metrics` line.
fn label<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let start = line.find(&format!("{name}=\""))? + name.len() + 2;
    line[start..].split('"').next()
}

/// Counters summed over the servers behind `url`: the gateway's workers when `url` is a
/// gateway, else the server itself.
async fn server_counters(client: &awc::Client, url: &str) -> Option<ServerCounters> {
    let mut servers = vec![url.to_string()];
    if let Ok(mut r) = client.get(format!("{url}/workers")).send().await {
        if r.status().is_success() {
            let list: serde_json::Value = r.json().await.ok()?;
            servers = list["workers"]
                .as_array()?
                .iter()
                .filter_map(|w| Some(w["url"].as_str()?.to_string()))
                .collect();
        }
    }
    let mut out = ServerCounters::default();
    for server in servers {
        let mut r = client.get(format!("{server}/metrics")).send().await.ok()?;
        let text = String::from_utf8_lossy(&r.body().limit(1 << 24).await.ok()?).to_string();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some(value) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else {
                continue;
            };
            let (counter, model) = (label(line, "counter"), label(line, "model"));
            if line.starts_with("tokenrouter_model_counters{") {
                match counter {
                    Some("prefix_hit_tokens") => out.prefix.0 += value,
                    Some("prefix_lookup_tokens") => out.prefix.1 += value,
                    _ => {}
                }
            } else if let (true, Some(model)) = (line.starts_with("tokenrouter_link{"), model) {
                let link = out.links.entry(model.to_string()).or_default();
                match counter {
                    Some("frames_in" | "frames_out") => link.0 += value,
                    Some("bytes_in" | "bytes_out") => link.1 += value,
                    _ => {}
                }
            } else if let (true, Some(model)) =
                (line.starts_with("tokenrouter_link_rtt_seconds{"), model)
            {
                out.links.entry(model.to_string()).or_default().2 = value;
            }
        }
    }
    Some(out)
}

/// Every concurrency level against one server.
async fn run_levels(
    client: &awc::Client,
    url: &str,
    args: &BenchArgs,
    mode: &str,
) -> anyhow::Result<Vec<LevelResult>> {
    let mut results = Vec::new();
    // Each level sends sessions of its own, so a later level does not find the earlier
    // levels' prompts in the server's prefix cache.
    let mut first = 0;
    for &c in &args.concurrency {
        let sessions = args.num_requests.unwrap_or(2 * c).max(1);
        let before = server_counters(client, url).await;
        let started = Instant::now();
        let (samples, failed) = run_level(client, url, args, c, first..first + sessions).await;
        first += sessions;
        let mut r = report::summarize(
            mode,
            c,
            &samples,
            failed.len(),
            started.elapsed().as_secs_f64(),
        );
        if let (Some(b), Some(a)) = (before, server_counters(client, url).await) {
            r.prefix_hit_rate =
                Some((a.prefix.0 - b.prefix.0) / (a.prefix.1 - b.prefix.1).max(1.0));
            r.links = a.links_since(&b);
        }
        for l in &r.links {
            eprintln!(
                "{mode} c={c}: link to '{}': {} frames, {:.1} KiB, round trip {} us",
                l.model,
                l.frames,
                l.bytes as f64 / 1024.0,
                l.rtt_us
            );
        }
        eprintln!(
            "{mode} c={c}: {:.1} output tok/s, {} requests, {} failed{}",
            r.output_tok_s,
            r.requests,
            r.failed,
            failed
                .first()
                .map(|e| format!(" (first: {e})"))
                .unwrap_or_default()
        );
        results.push(r);
    }
    Ok(results)
}

/// Sessions `indices` from `concurrency` clients; each client starts its next session when
/// the last turn of the previous one has ended.
async fn run_level(
    client: &awc::Client,
    url: &str,
    args: &BenchArgs,
    concurrency: usize,
    indices: std::ops::Range<usize>,
) -> (Vec<client::Sample>, Vec<String>) {
    let (first, sessions) = (indices.start, indices.len());
    let next = Rc::new(Cell::new(0usize));
    let done = super::progress_bar(sessions, "sessions");
    let out = Rc::new(RefCell::new((Vec::new(), Vec::new())));
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (client, url, next, done, out) = (
                client.clone(),
                url.to_string(),
                next.clone(),
                done.clone(),
                out.clone(),
            );
            let (workload, seed, max_tokens) = (args.workload, args.seed, args.max_tokens);
            let prompts = args.prompts.clone();
            let prefix = PrefixShape {
                words: args.prefix_words,
                groups: args.prefix_groups,
            };
            actix_web::rt::spawn(async move {
                while next.get() < sessions {
                    let i = next.get();
                    next.set(i + 1);
                    let session = workload.session(first + i, seed, max_tokens, prefix, &prompts);
                    let mut replies = Vec::new();
                    for turn in 0..session.turns.len() {
                        let body = chat_body(&session, turn, &replies);
                        match client::chat(&client, &url, &body).await {
                            Ok(sample) => {
                                replies.push(sample.text.clone());
                                out.borrow_mut().0.push(sample);
                            }
                            Err(e) => {
                                out.borrow_mut().1.push(e);
                                break;
                            }
                        }
                    }
                    done.inc(1);
                }
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
    done.finish_and_clear();
    Rc::try_unwrap(out)
        .map(RefCell::into_inner)
        .unwrap_or_default()
}

fn start_server(args: &BenchArgs, label: &str, serve_args: &[String]) -> anyhow::Result<Child> {
    let exe = std::env::current_exe()?;
    eprintln!("starting tokenrouter serve ({label}) on port {}", args.port);
    Ok(Command::new(exe)
        .arg("serve")
        .args(serve_args)
        .args(["--port", &args.port.to_string(), "--config"])
        .arg(&args.config)
        .stdout(Stdio::null())
        .spawn()?)
}

async fn wait_healthy(client: &awc::Client, url: &str, server: &mut Child) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        if let Some(status) = server.try_wait()? {
            anyhow::bail!("the server exited during start-up ({status})");
        }
        if let Ok(r) = client.get(format!("{url}/health")).send().await {
            if r.status().is_success() {
                return Ok(());
            }
        }
        if started.elapsed() > Duration::from_secs(900) {
            anyhow::bail!("the server did not become healthy within 15 minutes");
        }
        actix_web::rt::time::sleep(Duration::from_millis(250)).await;
    }
}

fn stop_server(mut server: Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &server.id().to_string()])
        .status();
    let _ = server.wait();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_traffic_is_the_difference_over_a_level() {
        let line = "tokenrouter_link{counter=\"bytes_in\",model=\"llm\"} 1024";
        assert_eq!(label(line, "counter"), Some("bytes_in"));
        assert_eq!(label(line, "model"), Some("llm"));
        assert_eq!(label(line, "state"), None);
        let at = |frames: f64, bytes: f64, rtt: f64| ServerCounters {
            links: [("llm".to_string(), (frames, bytes, rtt))].into(),
            ..ServerCounters::default()
        };
        let level = at(30.0, 4096.0, 0.000_150).links_since(&at(10.0, 1024.0, 0.0));
        assert_eq!(level.len(), 1);
        let l = &level[0];
        assert_eq!(
            (l.model.as_str(), l.frames, l.bytes, l.rtt_us),
            ("llm", 20, 3072, 150)
        );
    }
}
