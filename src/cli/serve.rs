//! `tokenrouter serve`: the HTTP server in front of the actor runtime. Flags (and their
//! `TOKENROUTER_*` environment variables) override `[server]` in the config file.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
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
    /// Seconds shutdown waits for in-flight requests.
    #[arg(long, env = "TOKENROUTER_SHUTDOWN_TIMEOUT", default_value_t = 10)]
    shutdown_timeout: u64,
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let mut config = Config::load(&args.config)?;
    if let Some(mode) = args.mode {
        config.scheduler.mode = mode;
    }
    let s = &config.server;
    let timeout = args.request_timeout.unwrap_or(s.request_timeout_s);
    let settings = ServeSettings {
        host: args.host.clone().unwrap_or_else(|| s.host.clone()),
        port: args.port.unwrap_or(s.port),
        api_key: args
            .api_key
            .clone()
            .or_else(|| s.api_key.clone())
            .filter(|k| !k.is_empty()),
        max_requests: args.max_requests.unwrap_or(s.max_requests),
        request_timeout: (timeout > 0.0).then(|| Duration::from_secs_f64(timeout)),
        max_body_bytes: s.max_body_mb << 20,
        workers: s.workers,
        shutdown_timeout: Duration::from_secs(args.shutdown_timeout),
    };
    if settings.max_requests == 0 {
        anyhow::bail!("--max-requests must be at least 1");
    }
    if !timeout.is_finite() || timeout < 0.0 {
        anyhow::bail!("--request-timeout must be a number of seconds >= 0");
    }
    serve(config, settings)
}
