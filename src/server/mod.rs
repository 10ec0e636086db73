//! The HTTP server: OpenAI-compatible (`/v1/chat/completions`, `/v1/completions`,
//! `/v1/models`) and SGLang-compatible (`/generate`, `/health`, `/health_generate`,
//! `/get_server_info`) endpoints plus Prometheus `/metrics`, in front of the actor runtime.
//! Model actors start before the HTTP workers; handlers only parse, submit and format, so no
//! forward pass ever runs on an HTTP worker thread. Knows nothing of tensors.

pub(crate) mod auth;
mod bodies;
mod choices;
pub mod error;
mod handlers;
pub mod kv_events;
mod metrics;
pub mod openapi;
mod respond;
mod sampling;
pub mod schema;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix_web::body::{BoxBody, EitherBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::middleware::{from_fn, Next};
use actix_web::web::{Bytes, BytesMut};
use actix_web::{web, App, HttpServer};
use futures_util::StreamExt;

use crate::actors::runtime::KvShare;
use crate::actors::{load_models, Runtime, RuntimeShared};
use crate::config::Config;
use error::ApiError;
pub use metrics::Metrics;

/// Where and how the server listens; flags and environment override the config file.
#[derive(Debug, Clone)]
pub struct ServeSettings {
    pub host: String,
    pub port: u16,
    pub api_key: Option<String>,
    /// Requests admitted at once (running or queued); beyond it, 503 with `Retry-After`.
    pub max_requests: usize,
    pub request_timeout: Option<Duration>,
    pub max_body_bytes: usize,
    pub workers: usize,
    /// How long an idle keep-alive connection stays open.
    pub keep_alive: Duration,
    /// How long shutdown waits for in-flight requests.
    pub shutdown_timeout: Duration,
}

/// What every handler shares.
pub struct AppState {
    pub runtime: Arc<RuntimeShared>,
    pub served_model: String,
    pub config: Config,
    pub kv: Vec<Option<KvShare>>,
    pub metrics: Arc<Metrics>,
    pub settings: ServeSettings,
    /// This server's OpenAPI document (`GET /openapi.json`).
    pub openapi: String,
    /// This server process, new at every start (KV-cache event streams carry it).
    pub instance: String,
    /// Set when shutdown begins: the streams that never end on their own (KV-cache events)
    /// end then, so they do not hold shutdown for its whole timeout.
    pub stopping: tokio::sync::watch::Sender<bool>,
    admitted: AtomicUsize,
    created: u64,
}

/// An id for this process: its start time and pid, unique across restarts.
fn instance_id() -> String {
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{started:x}-{}", std::process::id())
}

/// A place among the admitted requests; given back on drop.
pub struct AdmissionSlot(Arc<AppState>);

impl Drop for AdmissionSlot {
    fn drop(&mut self) {
        self.0.admitted.fetch_sub(1, Ordering::AcqRel);
        self.0.metrics.active.dec();
    }
}

impl AppState {
    /// Takes a slot, or fails with 503 when the server is full.
    pub fn admit(self: &Arc<Self>) -> Result<AdmissionSlot, ApiError> {
        let limit = self.settings.max_requests;
        let taken = self
            .admitted
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            });
        match taken {
            Ok(_) => {
                self.metrics.active.inc();
                Ok(AdmissionSlot(self.clone()))
            }
            Err(_) => {
                self.metrics.observe_rejected();
                Err(ApiError::overloaded(limit))
            }
        }
    }

    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m)
                if m != self.served_model && !self.config.models.iter().any(|e| e.name == m) =>
            {
                Err(ApiError::model_not_found(m, &self.served_model))
            }
            _ => Ok(()),
        }
    }
}

/// Reads a body up to `limit` bytes; larger bodies get a 413.
pub async fn read_body(mut payload: web::Payload, limit: usize) -> Result<Bytes, ApiError> {
    let mut body = BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk =
            chunk.map_err(|e| ApiError::invalid("body", format!("reading the body: {e}")))?;
        if body.len() + chunk.len() > limit {
            return Err(ApiError::new(
                actix_web::http::StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body exceeds the limit of {limit} bytes"),
            ));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

/// Loads the models, starts the actors, then serves HTTP until SIGINT/SIGTERM.
pub fn serve(
    config: Config,
    settings: ServeSettings,
    backend: crate::model::MatmulBackend,
) -> anyhow::Result<()> {
    let models = load_models(&config, backend)?;
    if let Some(files) = raise_open_files_limit() {
        tracing::info!(files, "open files limit");
    }
    actix_web::rt::System::new().block_on(async move {
        let runtime = Runtime::start(&config, models)?;
        let names: Vec<String> = config.models.iter().map(|m| m.name.clone()).collect();
        let served_model = String::from("tokenrouter");
        let answers_to: Vec<String> = std::iter::once(&served_model)
            .chain(&names)
            .cloned()
            .collect();
        let state = Arc::new(AppState {
            openapi: openapi::document(&answers_to, runtime.shared().vocab_size),
            runtime: runtime.shared().clone(),
            served_model,
            kv: runtime.kv_shares().to_vec(),
            metrics: Arc::new(Metrics::new(names)?),
            settings: settings.clone(),
            admitted: AtomicUsize::new(0),
            instance: instance_id(),
            stopping: tokio::sync::watch::Sender::new(false),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            config,
        });
        let stopping = state.stopping.clone();
        let data = web::Data::from(state);
        let server = HttpServer::new(move || {
            App::new()
                .app_data(data.clone())
                .wrap(from_fn(authorize))
                .configure(handlers::routes)
        })
        .disable_signals()
        .workers(settings.workers)
        .keep_alive(settings.keep_alive)
        .max_connections(MAX_CONNECTIONS)
        .shutdown_timeout(settings.shutdown_timeout.as_secs())
        .bind((settings.host.as_str(), settings.port))
        .map_err(|e| {
            anyhow::anyhow!("cannot listen on {}:{}: {e}", settings.host, settings.port)
        })?;
        tracing::info!(host = %settings.host, port = settings.port, "serving");
        eprintln!(
            "tokenrouter serving on http://{}:{}",
            settings.host, settings.port
        );
        let server = server.run();
        actix_web::rt::spawn(stop_on_signal(server.handle(), stopping));
        server.await?;
        runtime.stop();
        anyhow::Ok(())
    })
}

/// Waits for SIGINT or SIGTERM, then ends the event streams and stops the server gracefully
/// (in-flight requests finish within the shutdown timeout).
async fn stop_on_signal(
    server: actix_web::dev::ServerHandle,
    stopping: tokio::sync::watch::Sender<bool>,
) {
    use actix_web::rt::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        tracing::warn!("cannot listen for SIGINT/SIGTERM");
        return;
    };
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
    }
    tracing::info!("stopping: finishing in-flight requests");
    stopping.send_replace(true);
    server.stop(true).await;
}

/// Open connections per HTTP worker, at most; the process's descriptor limit is raised to
/// match where the system allows ([`raise_open_files_limit`]).
pub const MAX_CONNECTIONS: usize = 25_000;

/// Raises the soft limit on open files to the hard one: the usual soft limit (1024) caps a
/// server at about a thousand connections, idle keep-alive ones included. Returns the limit
/// now in force.
pub fn raise_open_files_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read and write the one struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return None;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                ..limit
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                limit = raised;
            }
        }
    }
    Some(limit.rlim_cur)
}

/// Checks the API key, when one is set (see [`auth`]).
async fn authorize(
    req: ServiceRequest,
    next: Next<BoxBody>,
) -> Result<ServiceResponse<EitherBody<BoxBody>>, actix_web::Error> {
    let key = req
        .app_data::<web::Data<AppState>>()
        .and_then(|s| s.settings.api_key.clone());
    if !auth::authorized(&req, key.as_slice()) {
        return Ok(auth::unauthorized(req));
    }
    Ok(next.call(req).await?.map_into_left_body())
}
