//! `tokenrouter serve`: the HTTP server in front of the actor runtime. Flags (and their
//! `TOKENROUTER_*` environment variables) override `[server]` in the config file.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::gateway::GatewayRouting;
use super::serve_dp;
use tokenrouter::config::{Config, SchedulingMode};
use tokenrouter::server::{serve, ServeSettings};

#[derive(Args)]
pub struct ServeArgs {
    #[arg(long, env = "TOKENROUTER_CONFIG", default_value = "config.toml")]
    config: PathBuf,
    /// Address to bind (default from the config: 127.0.0.1).
    #[arg(long, env = "TOKENROUTER_HOST")]
    host: Option<String>,
    /// Port to bind (default from the config: 30000).
    #[arg(long, env = "TOKENROUTER_PORT")]
    port: Option<u16>,
    /// Require `Authorization: Bearer <key>` on every route but /health.
    #[arg(long, env = "TOKENROUTER_API_KEY")]
    api_key: Option<String>,
    /// Requests admitted at once; more get 503 with Retry-After.
    #[arg(long, env = "TOKENROUTER_MAX_REQUESTS")]
    max_requests: Option<usize>,
    /// Seconds a request may run (0: no limit); an expired request gets 504.
    #[arg(long, env = "TOKENROUTER_REQUEST_TIMEOUT")]
    request_timeout: Option<f64>,
    /// Scheduling mode, overriding `[scheduler] mode`: delayed, eager or sync.
    #[arg(long, env = "TOKENROUTER_MODE")]
    mode: Option<SchedulingMode>,
    /// Serve only this model of the config, alone (`routing.algorithm = "single"`): the
    /// baseline a routed configuration is measured against.
    #[arg(long, env = "TOKENROUTER_SINGLE")]
    single: Option<String>,
    /// Seconds shutdown waits for in-flight requests.
    #[arg(long, env = "TOKENROUTER_SHUTDOWN_TIMEOUT", default_value_t = 10)]
    shutdown_timeout: u64,
    /// Data parallelism: start this many servers on the ports after --port, with the
    /// gateway on --port in front of them.
    #[arg(long, env = "TOKENROUTER_DP_SIZE", default_value_t = 1)]
    dp_size: usize,
    /// Gateway routing (with --dp-size > 1).
    #[command(flatten)]
    gateway: GatewayRouting,
}

impl ServeArgs {
    /// The flags each data-parallel server is started with (host and port are added).
    fn server_args(&self) -> Vec<String> {
        let mut args = vec!["--config".to_string(), self.config.display().to_string()];
        let mut flag = |name: &str, value: Option<String>| {
            if let Some(v) = value {
                args.extend([format!("--{name}"), v]);
            }
        };
        flag("api-key", self.api_key.clone());
        flag("max-requests", self.max_requests.map(|v| v.to_string()));
        flag(
            "request-timeout",
            self.request_timeout.map(|v| v.to_string()),
        );
        flag("mode", self.mode.map(|m| format!("{m:?}").to_lowercase()));
        flag("single", self.single.clone());
        flag("shutdown-timeout", Some(self.shutdown_timeout.to_string()));
        args
    }

    /// Servers on the following ports, the gateway on ours; all stop together.
    fn run_data_parallel(
        &self,
        host: &str,
        port: u16,
        api_key: Option<String>,
        kernels: &super::KernelArgs,
    ) -> anyhow::Result<()> {
        let first = port
            .checked_add(1)
            .filter(|p| p.checked_add(self.dp_size as u16).is_some());
        let Some(first) = first else {
            anyhow::bail!(
                "--port {port} leaves no room for {} servers after it",
                self.dp_size
            );
        };
        let ready_within = Duration::from_secs(900);
        let (urls, servers) = serve_dp::start(
            self.dp_size,
            first,
            &self.server_args(),
            &kernels.env(),
            ready_within,
        )?;
        // The gateway asks for the servers' key too: it is the front door, and it shows the
        // key to the servers' event streams.
        let keys = api_key.iter().cloned().collect();
        let settings = self.gateway.settings(host, port, urls, keys, api_key)?;
        let result = tokenrouter::gateway::run(settings);
        drop(servers);
        result
    }
}

pub fn run(args: ServeArgs, kernels: &super::KernelArgs) -> anyhow::Result<()> {
    let mut config = Config::load(&args.config)?;
    if let Some(mode) = args.mode {
        config.scheduler.mode = mode;
    }
    if let Some(name) = &args.single {
        config.serve_alone(name).map_err(anyhow::Error::msg)?;
    }
    let s = &config.server;
    let api_key = args
        .api_key
        .clone()
        .or_else(|| s.api_key.clone())
        .filter(|k| !k.is_empty());
    if args.dp_size > 1 {
        let host = args.host.clone().unwrap_or_else(|| s.host.clone());
        return args.run_data_parallel(&host, args.port.unwrap_or(s.port), api_key, kernels);
    }
    if args.dp_size == 0 {
        anyhow::bail!("--dp-size must be at least 1");
    }
    let timeout = args.request_timeout.unwrap_or(s.request_timeout_s);
    let settings = ServeSettings {
        host: args.host.clone().unwrap_or_else(|| s.host.clone()),
        port: args.port.unwrap_or(s.port),
        api_key,
        max_requests: args.max_requests.unwrap_or(s.max_requests),
        request_timeout: (timeout > 0.0).then(|| Duration::from_secs_f64(timeout)),
        max_body_bytes: s.max_body_mb << 20,
        workers: s.workers,
        keep_alive: Duration::from_secs_f64(s.keep_alive_s),
        shutdown_timeout: Duration::from_secs(args.shutdown_timeout),
    };
    if settings.max_requests == 0 {
        anyhow::bail!("--max-requests must be at least 1");
    }
    if !timeout.is_finite() || timeout < 0.0 {
        anyhow::bail!("--request-timeout must be a number of seconds >= 0");
    }
    serve(config, settings, kernels.backend())
}
