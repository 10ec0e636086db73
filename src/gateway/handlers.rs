//! Gateway endpoints: the generation routes are proxied, the model list and server info are
//! read from a worker, and `/health`, `/metrics` and `/workers` are the gateway's own.

use actix_web::http::StatusCode;
use actix_web::web::{self, Bytes};
use actix_web::{HttpRequest, HttpResponse};
use serde::Deserialize;
use serde_json::json;

use super::proxy::{self, forward, forward_get};
use super::request_text::Endpoint;
use super::GatewayState;
use crate::server::error::ApiError;
use crate::server::read_body;

type State = web::Data<GatewayState>;
type Client = web::Data<awc::Client>;

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/v1/chat/completions", proxy(Endpoint::Chat))
        .route("/v1/completions", proxy(Endpoint::Completion))
        .route("/generate", proxy(Endpoint::Generate))
        .route("/v1/models", forwarded_get("/v1/models"))
        .route("/get_server_info", forwarded_get("/get_server_info"))
        .route("/health", web::get().to(health))
        .route("/health_generate", forwarded_get("/health_generate"))
        .route("/metrics", web::get().to(metrics))
        .route("/workers", web::get().to(list_workers))
        .route("/workers", web::post().to(add_worker))
        .route("/workers", web::delete().to(remove_worker))
        .default_service(web::to(not_found));
}

/// The route of a GET passed to one server (model list, server info, a generation check).
fn forwarded_get(path: &'static str) -> actix_web::Route {
    web::get().to(move |s: State, c: Client, r: HttpRequest| async move {
        forward_get(&s, &c, &r, path).await
    })
}

/// The route of a proxied generation endpoint.
fn proxy(endpoint: Endpoint) -> actix_web::Route {
    web::post().to(
        move |s: State, c: Client, r: HttpRequest, p: web::Payload| proxied(s, c, r, p, endpoint),
    )
}

async fn proxied(
    state: State,
    client: Client,
    req: HttpRequest,
    payload: web::Payload,
    endpoint: Endpoint,
) -> Result<HttpResponse, ApiError> {
    let result = async {
        let body = read_body(payload, state.max_body_bytes).await?;
        forward(&state, &client, &req, endpoint, body).await
    }
    .await;
    if let Err(e) = &result {
        if e.status.is_client_error() || e.status == StatusCode::SERVICE_UNAVAILABLE {
            state.metrics.outcome("rejected");
        }
    }
    result
}

/// Healthy while at least one worker can take requests.
async fn health(state: State) -> HttpResponse {
    let routable = state.workers.routable(&[]).len();
    if routable > 0 {
        HttpResponse::Ok().json(json!({"status": "ok", "routable_workers": routable}))
    } else {
        HttpResponse::ServiceUnavailable()
            .json(json!({"status": "unhealthy", "routable_workers": 0}))
    }
}

async fn metrics(state: State) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(state.metrics.render(
            &state.workers,
            state.policy.as_ref(),
            state.queued.load(std::sync::atomic::Ordering::Acquire),
        ))
}

async fn list_workers(state: State) -> HttpResponse {
    let sizes = state.policy.tree_sizes();
    let indexed = (state.exact.as_ref()).map_or_else(Vec::new, |e| e.index.workers());
    let workers: Vec<_> = state
        .workers
        .all()
        .iter()
        .map(|w| {
            json!({
                "url": w.url,
                "healthy": w.is_healthy(),
                "in_flight": w.load(),
                "breaker_open": w.breaker_open(),
                "selected": w.selected.load(std::sync::atomic::Ordering::Relaxed),
                "retries": w.retries.load(std::sync::atomic::Ordering::Relaxed),
                "tree_chars": sizes.iter().find(|(id, _)| *id == w.id).map_or(0, |s| s.1),
                "kv_index": indexed.iter().find(|i| i.worker == w.id),
            })
        })
        .collect();
    HttpResponse::Ok().json(json!({
        "policy": state.policy.name(),
        "workers": workers,
        "cache_hit_rate": state.metrics.cache_hit_rate(),
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkerUrl {
    url: String,
}

/// The worker URL from `?url=` or a JSON body `{"url": ...}`.
fn worker_url(req: &HttpRequest, body: &[u8]) -> Result<String, ApiError> {
    let from_query = web::Query::<WorkerUrl>::from_query(req.query_string()).ok();
    let url = match from_query {
        Some(q) => q.into_inner().url,
        None => {
            serde_json::from_slice::<WorkerUrl>(body)
                .map_err(|e| {
                    ApiError::invalid(
                        "url",
                        format!("send {{\"url\": \"http://host:port\"}} or ?url=: {e}"),
                    )
                })?
                .url
        }
    };
    if !url.starts_with("http://") || url.len() <= "http://".len() {
        return Err(ApiError::invalid(
            "url",
            format!("url: '{url}' is not an http:// URL"),
        ));
    }
    Ok(url.trim_end_matches('/').to_string())
}

/// Adds a worker; it takes requests once it answers `/health`.
async fn add_worker(
    state: State,
    client: Client,
    req: HttpRequest,
    body: Bytes,
) -> Result<HttpResponse, ApiError> {
    let url = worker_url(&req, &body)?;
    let healthy = proxy::probe(&client, &url, state.health_check_timeout).await;
    let worker = state.add_worker(&url, healthy);
    tracing::info!(worker = %url, healthy, "worker added");
    Ok(HttpResponse::Ok().json(json!({"url": worker.url, "healthy": worker.is_healthy()})))
}

async fn remove_worker(
    state: State,
    req: HttpRequest,
    body: Bytes,
) -> Result<HttpResponse, ApiError> {
    let url = worker_url(&req, &body)?;
    let policy = state.clone();
    let removed = web::block(move || policy.remove_worker(&url))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    if removed {
        Ok(HttpResponse::Ok().json(json!({"removed": true})))
    } else {
        Err(ApiError::new(StatusCode::NOT_FOUND, "url: no such worker"))
    }
}

async fn not_found(req: HttpRequest) -> Result<HttpResponse, ApiError> {
    let message = format!("no route for {} {}", req.method(), req.path());
    Err(ApiError::new(StatusCode::NOT_FOUND, message))
}
