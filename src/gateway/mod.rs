//! The gateway: one HTTP front for many tokenrouter servers (data parallelism).
//!
//! It serves the same API as a server (OpenAI and `/generate`, streaming passed through) and
//! sends each request to one worker chosen by a [`policy`]; the default is cache-aware, which
//! follows an approximate radix [`tree`] of the text each worker has seen, or, in exact mode,
//! an index of every worker's prefix cache kept from the KV-cache events the workers publish
//! ([`kv_index`], [`kv_follow`]), looked up with each request tokenized once. Around the choice:
//! periodic health checks, per-worker circuit breakers, retries with backoff on another
//! worker, a bounded queue when every worker is saturated, runtime `POST`/`DELETE /workers`,
//! Prometheus metrics, and API keys checked before anything is routed. Knows nothing of
//! tensors; talks to workers only over HTTP.

mod handlers;
pub mod kv_follow;
pub mod kv_index;
mod metrics;
pub mod policy;
pub mod proxy;
pub mod request_text;
pub mod sim;
pub mod tree;
pub mod workers;

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use actix_web::body::{BoxBody, EitherBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::middleware::{from_fn, Next};
use actix_web::{web, App, HttpServer};

use crate::server::auth;
use kv_follow::ExactRouting;
use metrics::GatewayMetrics;
use policy::{CacheAwareSettings, Policy, PolicyKind};
pub use proxy::{QueueSettings, RetrySettings};
use workers::{HealthPolicy, WorkerSet};

/// Everything `tokenrouter gateway` is told.
#[derive(Debug, Clone)]
pub struct GatewaySettings {
    pub host: String,
    pub port: u16,
    pub worker_urls: Vec<String>,
    pub policy: PolicyKind,
    pub cache: CacheAwareSettings,
    /// How often the prefix tree is trimmed to `max_tree_size`.
    pub eviction_interval: Duration,
    pub health: HealthPolicy,
    pub health_check_interval: Duration,
    pub health_check_timeout: Duration,
    pub retry: RetrySettings,
    pub queue: QueueSettings,
    pub max_body_bytes: usize,
    /// HTTP worker threads.
    pub threads: usize,
    /// Seed of the random policies.
    pub seed: u64,
    /// Keys accepted in `Authorization: Bearer` on every route but `/health` (none: open).
    pub api_keys: Vec<String>,
    /// The key the gateway shows the workers' KV-cache event streams (exact mode).
    pub worker_api_key: Option<String>,
}

/// What every handler shares.
pub struct GatewayState {
    pub workers: WorkerSet,
    pub policy: Arc<dyn Policy>,
    /// Exact mode: the workers' KV-cache events followed into the policy's index.
    pub exact: Option<Arc<ExactRouting>>,
    metrics: GatewayMetrics,
    queue_settings: QueueSettings,
    retry_settings: RetrySettings,
    queued: AtomicUsize,
    max_body_bytes: usize,
    health_check_timeout: Duration,
    api_keys: Vec<String>,
}

impl GatewayState {
    pub fn new(settings: &GatewaySettings) -> anyhow::Result<Self> {
        let policy = policy::build(settings.policy, settings.cache.clone(), settings.seed);
        let exact = (policy.kv_index()).map(|index| {
            Arc::new(ExactRouting::new(
                index.clone(),
                settings.worker_api_key.clone(),
            ))
        });
        Ok(Self {
            workers: WorkerSet::new(settings.health.clone()),
            policy,
            exact,
            metrics: GatewayMetrics::new()?,
            queue_settings: settings.queue.clone(),
            retry_settings: settings.retry.clone(),
            queued: AtomicUsize::new(0),
            max_body_bytes: settings.max_body_bytes,
            health_check_timeout: settings.health_check_timeout,
            api_keys: settings.api_keys.clone(),
        })
    }

    /// Adds a worker (see [`WorkerSet::add`]) and, in exact mode, starts following its
    /// KV-cache events; must run inside the gateway's runtime.
    pub fn add_worker(&self, url: &str, healthy: bool) -> Arc<workers::Worker> {
        let (worker, new) = self.workers.insert(url, healthy);
        if let Some(exact) = self.exact.as_ref().filter(|_| new) {
            actix_web::rt::spawn(kv_follow::follow(exact.clone(), worker.clone()));
        }
        worker
    }

    /// Forgets a worker: out of the list and out of the policy's state.
    pub fn remove_worker(&self, url: &str) -> bool {
        match self.workers.remove(url) {
            Some(worker) => {
                self.policy.remove_worker(worker.id);
                tracing::info!(worker = %worker.url, "worker removed");
                true
            }
            None => false,
        }
    }
}

fn client(timeout: Duration) -> awc::Client {
    awc::Client::builder()
        .connector(awc::Connector::new().timeout(Duration::from_secs(5)))
        .timeout(timeout)
        .finish()
}

/// Health checks every worker, forever.
async fn check_health(state: Arc<GatewayState>, every: Duration) {
    let client = client(state.health_check_timeout);
    let mut tick = tokio::time::interval(every);
    loop {
        tick.tick().await;
        for worker in state.workers.all() {
            let ok = proxy::probe(&client, &worker.url, state.health_check_timeout).await;
            worker.record_check(ok, &state.workers.policy);
        }
    }
}

/// Trims the policy's state (the prefix tree) forever.
async fn maintain(state: Arc<GatewayState>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    loop {
        tick.tick().await;
        let policy = state.policy.clone();
        if let Ok(Some(done)) = web::block(move || policy.maintain()).await {
            tracing::info!("{done}");
        }
    }
}

/// Checks the API key before a request is routed, when keys are set (see `server::auth`).
async fn authorize(
    req: ServiceRequest,
    next: Next<BoxBody>,
) -> Result<ServiceResponse<EitherBody<BoxBody>>, actix_web::Error> {
    let allowed = req
        .app_data::<web::Data<GatewayState>>()
        .is_none_or(|state| auth::authorized(&req, &state.api_keys));
    if !allowed {
        return Ok(auth::unauthorized(req));
    }
    Ok(next.call(req).await?.map_into_left_body())
}

/// Checks the workers once, then serves until SIGINT/SIGTERM.
pub fn run(settings: GatewaySettings) -> anyhow::Result<()> {
    // A gateway holds a client's connection and one to a worker for each request.
    if let Some(files) = crate::server::raise_open_files_limit() {
        tracing::info!(files, "open files limit");
    }
    actix_web::rt::System::new().block_on(async move {
        let state = Arc::new(GatewayState::new(&settings)?);
        let probe_client = client(settings.health_check_timeout);
        for url in &settings.worker_urls {
            let healthy = proxy::probe(&probe_client, url.trim_end_matches('/'), settings.health_check_timeout).await;
            if !healthy {
                tracing::warn!(worker = %url, "worker not healthy yet; it joins when its checks pass");
            }
            state.add_worker(url, healthy);
        }
        actix_web::rt::spawn(check_health(state.clone(), settings.health_check_interval));
        actix_web::rt::spawn(maintain(state.clone(), settings.eviction_interval));
        let data = web::Data::from(state);
        let timeout = settings.retry.request_timeout;
        let server = HttpServer::new(move || {
            App::new()
                .app_data(data.clone())
                .app_data(web::Data::new(client(timeout)))
                .wrap(from_fn(authorize))
                .configure(handlers::routes)
        })
        .workers(settings.threads)
        .bind((settings.host.as_str(), settings.port))
        .map_err(|e| anyhow::anyhow!("cannot listen on {}:{}: {e}", settings.host, settings.port))?;
        eprintln!(
            "tokenrouter gateway on http://{}:{} ({} workers, policy {})",
            settings.host,
            settings.port,
            settings.worker_urls.len(),
            settings.policy.name()
        );
        server.run().await?;
        anyhow::Ok(())
    })
}
