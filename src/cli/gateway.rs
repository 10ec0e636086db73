//! `tokenrouter gateway`: the cache-aware router in front of running servers (router-only
//! mode). Every flag can also be set through the environment (`TOKENROUTER_GATEWAY_*`).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use tokenrouter::gateway::policy::{CacheAwareSettings, PolicyKind};
use tokenrouter::gateway::workers::HealthPolicy;
use tokenrouter::gateway::{GatewaySettings, QueueSettings, RetrySettings};

#[derive(Args, Clone)]
pub struct GatewayArgs {
    /// Worker servers, e.g. http://127.0.0.1:30001 (more can be added with POST /workers).
    #[arg(long, num_args = 1.., env = "TOKENROUTER_GATEWAY_WORKER_URLS", value_delimiter = ',')]
    pub worker_urls: Vec<String>,
    #[arg(long, env = "TOKENROUTER_GATEWAY_HOST", default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, env = "TOKENROUTER_GATEWAY_PORT", default_value_t = 30000)]
    pub port: u16,
    /// Require `Authorization: Bearer <key>` on every route but /health (the metrics and the
    /// worker list included); several keys, comma-separated, are each accepted.
    #[arg(long, env = "TOKENROUTER_GATEWAY_API_KEY", value_delimiter = ',')]
    pub api_key: Vec<String>,
    /// More accepted keys, one per line (blank lines and lines starting with # are skipped).
    #[arg(long, env = "TOKENROUTER_GATEWAY_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// The workers' API key, shown to their KV-cache event streams with
    /// --exact-prefix-match (clients' requests pass their own key through).
    #[arg(long, env = "TOKENROUTER_GATEWAY_WORKER_API_KEY")]
    pub worker_api_key: Option<String>,
    #[command(flatten)]
    pub routing: GatewayRouting,
}

impl GatewayArgs {
    /// The accepted keys: `--api-key`'s, then the key file's.
    fn api_keys(&self) -> anyhow::Result<Vec<String>> {
        let mut keys: Vec<String> = self.api_key.iter().map(|k| k.trim().to_string()).collect();
        if let Some(path) = &self.api_key_file {
            let text = std::fs::read_to_string(path).map_err(|e| {
                anyhow::anyhow!("--api-key-file {}: cannot read it ({e})", path.display())
            })?;
            keys.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(String::from),
            );
            if keys.is_empty() {
                anyhow::bail!("--api-key-file {} holds no key", path.display());
            }
        }
        if keys.iter().any(String::is_empty) {
            anyhow::bail!("--api-key: an empty key would accept anyone; remove it");
        }
        Ok(keys)
    }
}

/// How the gateway routes; shared by `gateway` and `serve --dp-size`.
#[derive(Args, Clone)]
pub struct GatewayRouting {
    /// random, round_robin, shortest_queue, power_of_two or cache_aware.
    #[arg(
        long,
        env = "TOKENROUTER_GATEWAY_POLICY",
        default_value = "cache_aware"
    )]
    pub policy: PolicyKind,
    /// Prefix-match ratio above which cache affinity decides.
    #[arg(
        long,
        env = "TOKENROUTER_GATEWAY_CACHE_THRESHOLD",
        default_value_t = 0.5
    )]
    pub cache_threshold: f64,
    /// Load difference (requests) beyond which the least-loaded worker wins...
    #[arg(
        long,
        env = "TOKENROUTER_GATEWAY_BALANCE_ABS_THRESHOLD",
        default_value_t = 32
    )]
    pub balance_abs_threshold: usize,
    /// ...when the busiest also has more than this many times the least load.
    #[arg(
        long,
        env = "TOKENROUTER_GATEWAY_BALANCE_REL_THRESHOLD",
        default_value_t = 1.5
    )]
    pub balance_rel_threshold: f64,
    /// Share of requests routed by cache affinity; the rest go to the least-loaded worker.
    #[arg(
        long,
        env = "TOKENROUTER_GATEWAY_CACHE_ROUTING_PROB",
        default_value_t = 1.0
    )]
    pub cache_routing_prob: f64,
    /// Characters of routing text kept per worker in the prefix tree.
    #[arg(long, env = "TOKENROUTER_GATEWAY_MAX_TREE_SIZE", default_value_t = 1 << 22)]
    pub max_tree_size: usize,
    /// Route cache-aware on an exact index of every worker's prefix cache, kept from the
    /// KV-cache events the workers publish (`GET /cache/events`), with each request tokenized
    /// once with the workers' vocabulary, instead of the approximate text tree.
    #[arg(long, env = "TOKENROUTER_GATEWAY_EXACT_PREFIX_MATCH")]
    pub exact_prefix_match: bool,
    /// With --exact-prefix-match: a worker's cost is this weight times the blocks it would
    /// still have to prefill, plus the blocks of the requests in flight there.
    #[arg(
        long,
        env = "TOKENROUTER_GATEWAY_OVERLAP_WEIGHT",
        default_value_t = 4.0
    )]
    pub overlap_weight: f64,
    /// With --exact-prefix-match: the weight of a cached block a request would evict on a
    /// server whose cache is full (its new blocks beyond the server's free room).
    #[arg(
        long,
        env = "TOKENROUTER_GATEWAY_EVICTION_WEIGHT",
        default_value_t = 1.0
    )]
    pub eviction_weight: f64,
    /// Seconds between prefix-tree evictions.
    #[arg(
        long,
        env = "TOKENROUTER_GATEWAY_EVICTION_INTERVAL",
        default_value_t = 60.0
    )]
    pub eviction_interval: f64,
    /// Seconds between health checks.
    #[arg(
        long,
        env = "TOKENROUTER_GATEWAY_HEALTH_CHECK_INTERVAL",
        default_value_t = 10.0
    )]
    pub health_check_interval: f64,
    /// Failed checks in a row that take a worker out.
    #[arg(
        long,
        env = "TOKENROUTER_GATEWAY_HEALTH_FAILURE_THRESHOLD",
        default_value_t = 3
    )]
    pub health_failure_threshold: u32,
    /// Passed checks in a row that put it back.
    #[arg(
        long,
        env = "TOKENROUTER_GATEWAY_HEALTH_SUCCESS_THRESHOLD",
        default_value_t = 2
    )]
    pub health_success_threshold: u32,
    /// Failed requests in a row that open a worker's circuit breaker.
    #[arg(
        long,
        env = "TOKENROUTER_GATEWAY_BREAKER_FAILURES",
        default_value_t = 5
    )]
    pub breaker_failures: u32,
    /// Seconds an open breaker refuses requests.
    #[arg(
        long,
        env = "TOKENROUTER_GATEWAY_BREAKER_TIMEOUT",
        default_value_t = 30.0
    )]
    pub breaker_timeout: f64,
    /// Retries on another worker after connect errors or 502/503/504.
    #[arg(long, env = "TOKENROUTER_GATEWAY_MAX_RETRIES", default_value_t = 3)]
    pub max_retries: u32,
    /// Milliseconds before the first retry (doubled each time).
    #[arg(
        long,
        env = "TOKENROUTER_GATEWAY_RETRY_BACKOFF_MS",
        default_value_t = 50
    )]
    pub retry_backoff_ms: u64,
    /// Seconds a proxied request may take, streaming included.
    #[arg(
        long,
        env = "TOKENROUTER_GATEWAY_UPSTREAM_TIMEOUT",
        default_value_t = 1800.0
    )]
    pub upstream_timeout: f64,
    /// In-flight requests per worker before it counts as saturated (0: no limit).
    #[arg(
        long,
        env = "TOKENROUTER_GATEWAY_WORKER_MAX_LOAD",
        default_value_t = 256
    )]
    pub worker_max_load: usize,
    /// Requests that may wait for a saturated worker; more get 429.
    #[arg(long, env = "TOKENROUTER_GATEWAY_QUEUE_SIZE", default_value_t = 128)]
    pub queue_size: usize,
    /// Seconds a queued request waits before a 503.
    #[arg(
        long,
        env = "TOKENROUTER_GATEWAY_QUEUE_TIMEOUT",
        default_value_t = 60.0
    )]
    pub queue_timeout: f64,
    /// HTTP threads.
    #[arg(long, env = "TOKENROUTER_GATEWAY_THREADS", default_value_t = 2)]
    pub threads: usize,
    /// Seed of the random policies.
    #[arg(long, env = "TOKENROUTER_GATEWAY_SEED", default_value_t = 0)]
    pub seed: u64,
}

fn seconds(flag: &str, value: f64) -> anyhow::Result<Duration> {
    if !value.is_finite() || value <= 0.0 {
        anyhow::bail!("--{flag} must be a positive number of seconds, not {value}");
    }
    Ok(Duration::from_secs_f64(value))
}

impl GatewayRouting {
    pub fn settings(
        &self,
        host: &str,
        port: u16,
        worker_urls: Vec<String>,
        api_keys: Vec<String>,
        worker_api_key: Option<String>,
    ) -> anyhow::Result<GatewaySettings> {
        for url in &worker_urls {
            if !url.starts_with("http://") {
                anyhow::bail!("--worker-urls: '{url}' is not an http:// URL");
            }
        }
        if !(0.0..=1.0).contains(&self.cache_threshold)
            || !(0.0..=1.0).contains(&self.cache_routing_prob)
        {
            anyhow::bail!("--cache-threshold and --cache-routing-prob must lie in [0, 1]");
        }
        for (flag, w) in [
            ("overlap-weight", self.overlap_weight),
            ("eviction-weight", self.eviction_weight),
        ] {
            if !w.is_finite() || w < 0.0 {
                anyhow::bail!("--{flag} must be a number >= 0, not {w}");
            }
        }
        if self.balance_rel_threshold < 1.0
            || self.health_failure_threshold == 0
            || self.health_success_threshold == 0
            || self.breaker_failures == 0
        {
            anyhow::bail!(
                "--balance-rel-threshold must be >= 1 and the health/breaker thresholds >= 1"
            );
        }
        Ok(GatewaySettings {
            host: host.to_string(),
            port,
            worker_urls,
            policy: self.policy,
            cache: CacheAwareSettings {
                cache_threshold: self.cache_threshold,
                balance_abs_threshold: self.balance_abs_threshold,
                balance_rel_threshold: self.balance_rel_threshold,
                cache_routing_prob: self.cache_routing_prob,
                max_tree_size: self.max_tree_size,
                exact: self.exact_prefix_match,
                overlap_weight: self.overlap_weight,
                eviction_weight: self.eviction_weight,
            },
            eviction_interval: seconds("eviction-interval", self.eviction_interval)?,
            health: HealthPolicy {
                failure_threshold: self.health_failure_threshold,
                success_threshold: self.health_success_threshold,
                breaker_failures: self.breaker_failures,
                breaker_open: seconds("breaker-timeout", self.breaker_timeout)?,
            },
            health_check_interval: seconds("health-check-interval", self.health_check_interval)?,
            health_check_timeout: Duration::from_secs(5),
            retry: RetrySettings {
                max_retries: self.max_retries,
                backoff: Duration::from_millis(self.retry_backoff_ms),
                request_timeout: seconds("upstream-timeout", self.upstream_timeout)?,
            },
            queue: QueueSettings {
                worker_max_load: self.worker_max_load,
                size: self.queue_size,
                timeout: seconds("queue-timeout", self.queue_timeout)?,
            },
            max_body_bytes: 64 << 20,
            threads: self.threads.max(1),
            seed: self.seed,
            api_keys,
            worker_api_key,
        })
    }
}

pub fn run(args: GatewayArgs) -> anyhow::Result<()> {
    if args.worker_urls.is_empty() {
        anyhow::bail!("--worker-urls needs at least one http://host:port");
    }
    let settings = args.routing.settings(
        &args.host,
        args.port,
        args.worker_urls.clone(),
        args.api_keys()?,
        args.worker_api_key.clone(),
    )?;
    tokenrouter::gateway::run(settings)
}
