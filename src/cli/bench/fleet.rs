//! `tokenrouter bench --simulate-fleet N[,N...]`: the gateway's policies compared on fleets of
//! simulated servers (see `tokenrouter::gateway::sim`), on the generated shared-prefix and
//! multi-turn traces or a Mooncake-format trace file. Prints one table per trace and fleet
//! size, and with --plot-dir writes throughput and TTFT p90 against fleet size as SVG.

use std::path::PathBuf;

use clap::Args;
use tokenrouter::gateway::policy::KvAwareSettings;
use tokenrouter::gateway::sim::trace::{self, Trace, TraceShape};
use tokenrouter::gateway::sim::{self, FleetResult, LatencyModel, ServerShape};

use super::report::chart;

#[derive(Args, Clone)]
pub struct FleetArgs {
    /// Simulate fleets of these sizes instead of measuring a server, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub simulate_fleet: Vec<usize>,
    /// Policies to compare on the simulated fleet; `cache_aware+exact` routes on the exact
    /// index kept from the simulated servers' KV-cache events.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "round_robin,shortest_queue,cache_aware,cache_aware+exact"
    )]
    pub fleet_policies: Vec<String>,
    /// cache_aware+exact's weight of a block still to prefill against a block in flight.
    #[arg(long, default_value_t = 4.0)]
    pub fleet_overlap_weight: f64,
    /// cache_aware+exact's weight of a cached block a request would evict.
    #[arg(long, default_value_t = 1.0)]
    pub fleet_eviction_weight: f64,
    /// Generated traces to simulate: shared-prefix, multi-turn (ignored with --trace).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "shared-prefix,multi-turn"
    )]
    pub fleet_traces: Vec<String>,
    /// A Mooncake-format trace (JSONL: timestamp in ms, input_length, output_length,
    /// hash_ids) to simulate instead of the generated ones.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Tokens per hash id of --trace (512 in the published Mooncake traces).
    #[arg(long, default_value_t = 512)]
    pub trace_block_size: usize,
    /// Stretch (> 1) or compress (< 1) --trace's timestamps.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// `bench-model --json` output to fit the step-time model to (default: the built-in fit
    /// of the 0.5B model on a 2-core machine, docs/fleet.md).
    #[arg(long)]
    pub latency_from: Option<PathBuf>,
    /// Share of the machine bench-model measured that each simulated server gets (0.5: two
    /// servers sharing it).
    #[arg(long, default_value_t = 1.0)]
    pub compute_share: f64,
    /// KV blocks per simulated server.
    #[arg(long, default_value_t = 512)]
    pub cache_blocks: usize,
    /// Tokens per block of the generated traces.
    #[arg(long, default_value_t = 16)]
    pub fleet_block_size: usize,
    #[arg(long, default_value_t = 32)]
    pub max_batch: usize,
    /// Requests per simulated server in the generated traces (enough that the caches' warm-up
    /// does not dominate).
    #[arg(long, default_value_t = 200)]
    pub requests_per_server: usize,
    /// Prefix groups (shared-prefix) or conversations (multi-turn) per server.
    #[arg(long, default_value_t = 3)]
    pub groups_per_server: usize,
    /// Tokens of each group's shared prefix (or each conversation's system prompt).
    #[arg(long, default_value_t = 1024)]
    pub prefix_tokens: usize,
    /// Tokens of each request's own question.
    #[arg(long, default_value_t = 32)]
    pub question_tokens: usize,
    /// Output tokens per request of the generated traces.
    #[arg(long, default_value_t = 16)]
    pub output_tokens: usize,
    /// Requests per second per server of the generated traces (Poisson); default: ten times
    /// what a server computes without any prefix reuse, so that every policy is saturated and
    /// throughput measures capacity.
    #[arg(long)]
    pub request_rate: Option<f64>,
}

/// The step-time model measured on the development machine (`bench-model --json --batch
/// 1,2,4 --prompt-len 256` on Qwen2.5-Coder-0.5B, 2 cores).
const DEFAULT_FIT: &str = r#"{"batch":1,"decode_tok_s":105.7,"prefill_tok_s":546.0}
{"batch":2,"decode_tok_s":194.3,"prefill_tok_s":552.7}
{"batch":4,"decode_tok_s":288.0,"prefill_tok_s":548.0}"#;

impl FleetArgs {
    fn latency(&self) -> anyhow::Result<LatencyModel> {
        let text = match &self.latency_from {
            Some(path) => std::fs::read_to_string(path).map_err(|e| {
                anyhow::anyhow!("--latency-from {}: cannot read it ({e})", path.display())
            })?,
            None => DEFAULT_FIT.to_string(),
        };
        if !(self.compute_share > 0.0 && self.compute_share <= 1.0) {
            anyhow::bail!("--compute-share must lie in (0, 1]");
        }
        LatencyModel::fit(&text, self.compute_share)
    }

    fn traces(&self, servers: usize, latency: &LatencyModel) -> anyhow::Result<Vec<Trace>> {
        if let Some(path) = &self.trace {
            return Ok(vec![trace::mooncake(
                path,
                self.trace_block_size,
                self.time_scale,
            )?]);
        }
        let shape = TraceShape {
            requests: self.requests_per_server * servers,
            groups: self.groups_per_server * servers,
            prefix_tokens: self.prefix_tokens,
            question_tokens: self.question_tokens,
            output_tokens: self.output_tokens,
            block_size: self.fleet_block_size,
            seed: 0,
        };
        let uncached = latency.prefill_per_token
            * (self.prefix_tokens + self.question_tokens) as f64
            + latency.decode_base * self.output_tokens as f64;
        let rate = self.request_rate.unwrap_or(10.0 / uncached) * servers as f64;
        (self.fleet_traces.iter())
            .map(|name| match name.as_str() {
                "shared-prefix" => Ok(trace::shared_prefix(shape, rate)),
                "multi-turn" => Ok(trace::multi_turn(shape, rate)),
                other => anyhow::bail!(
                    "--fleet-traces: unknown trace '{other}': use shared-prefix or multi-turn"
                ),
            })
            .collect()
    }
}

/// One number of a simulated run.
type Metric = fn(&FleetResult) -> f64;

fn table(trace: &str, servers: usize, rows: &[FleetResult]) -> String {
    let base = rows
        .iter()
        .find(|r| r.policy == "round_robin")
        .map(|r| r.throughput);
    let mut out = format!(
        "\n{trace}, {servers} servers\n| policy | output tok/s | vs round robin | TTFT p50 s | TTFT p90 s | E2E p50 s | E2E p90 s | cache hit | imbalance |\n|---|---|---|---|---|---|---|---|---|\n"
    );
    for r in rows {
        let ratio = base.map_or("-".to_string(), |b| format!("{:.2}x", r.throughput / b));
        out.push_str(&format!(
            "| {} | {:.0} | {ratio} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1}% | {:.2} |\n",
            r.policy,
            r.throughput,
            r.ttft_p50,
            r.ttft_p90,
            r.e2e_p50,
            r.e2e_p90,
            r.hit_rate * 100.0,
            r.imbalance
        ));
    }
    out
}

pub fn run(
    args: &FleetArgs,
    output: Option<&PathBuf>,
    plot_dir: Option<&PathBuf>,
) -> anyhow::Result<()> {
    if args.simulate_fleet.contains(&0) || args.cache_blocks == 0 || args.max_batch == 0 {
        anyhow::bail!("--simulate-fleet, --cache-blocks and --max-batch must be positive");
    }
    let latency = args.latency()?;
    println!(
        "step model: {:.3} ms + {:.3} ms per sequence decoding + {:.3} ms per prefill token",
        latency.decode_base * 1e3,
        latency.decode_per_seq * 1e3,
        latency.prefill_per_token * 1e3
    );
    let shape = ServerShape {
        cache_blocks: args.cache_blocks,
        max_batch: args.max_batch,
        latency,
    };
    // (trace, servers, results)
    let mut all: Vec<(String, usize, Vec<FleetResult>)> = Vec::new();
    for &servers in &args.simulate_fleet {
        for trace in args.traces(servers, &latency)? {
            let mut rows = Vec::new();
            for name in &args.fleet_policies {
                let exact = KvAwareSettings {
                    overlap_weight: args.fleet_overlap_weight,
                    eviction_weight: args.fleet_eviction_weight,
                };
                let policy = sim::build_policy(name, exact, 0)?;
                rows.push(sim::simulate(&trace, servers, shape, &policy, name));
            }
            print!("{}", table(&trace.name, servers, &rows));
            all.push((trace.name.clone(), servers, rows));
        }
    }
    if let Some(path) = output {
        let rows: Vec<_> = (all.iter())
            .flat_map(|(t, _, rows)| {
                rows.iter()
                    .map(move |r| serde_json::json!({"trace": t, "result": r}))
            })
            .collect();
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)?;
    }
    if let Some(dir) = plot_dir {
        std::fs::create_dir_all(dir)?;
        let mut traces: Vec<&String> = all.iter().map(|a| &a.0).collect();
        traces.dedup();
        for t in traces {
            let series = |metric: Metric| -> Vec<(String, Vec<(f64, f64)>)> {
                (args.fleet_policies.iter())
                    .map(|p| {
                        let points = (all.iter().filter(|a| &a.0 == t))
                            .filter_map(|(_, n, rows)| {
                                rows.iter()
                                    .find(|r| &r.policy == p)
                                    .map(|r| (*n as f64, metric(r)))
                            })
                            .collect();
                        (p.clone(), points)
                    })
                    .collect()
            };
            let charts: [(&str, &str, &str, Metric); 2] = [
                ("throughput", "Output throughput", "output tokens/s", |r| {
                    r.throughput
                }),
                ("ttft-p90", "TTFT p90", "seconds", |r| r.ttft_p90),
            ];
            for (file, what, unit, metric) in charts {
                let svg = chart(
                    &format!("{what}, {t} trace"),
                    "servers",
                    unit,
                    &series(metric),
                );
                std::fs::write(dir.join(format!("fleet-{t}-{file}.svg")), svg)?;
            }
        }
    }
    Ok(())
}
