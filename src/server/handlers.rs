//! Endpoint handlers: read and validate the body, take an admission slot, submit, respond.

use std::sync::Arc;

use actix_web::http::StatusCode;
use actix_web::web;
use actix_web::HttpResponse;
use serde_json::json;

use super::choices::Choices;
use super::error::ApiError;
use super::respond::{Api, Responder};
use super::schema::{parse, ChatRequest, CompletionRequest, GenerateBody};
use super::{read_body, AppState};
use crate::actors::model_actor::GetStats;
use crate::actors::{GenerateRequest, Prompt};
use crate::model::SamplingParams;

type State = web::Data<AppState>;

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/v1/chat/completions", web::post().to(chat))
        .route("/v1/completions", web::post().to(completions))
        .route("/generate", web::post().to(generate))
        .route("/v1/models", web::get().to(models))
        .route("/health", web::get().to(health))
        .route("/health_generate", web::get().to(health_generate))
        .route("/get_server_info", web::get().to(server_info))
        .route("/metrics", web::get().to(metrics))
        .route("/cache/match", web::post().to(cache_match))
        .default_service(web::to(not_found));
}

/// `n` copies of a request; with a seed, copy `i` draws from `seed + i`.
fn copies(request: GenerateRequest, n: usize) -> Vec<GenerateRequest> {
    (0..n)
        .map(|i| {
            let mut r = request.clone();
            r.params.seed = request.params.seed.map(|s| s.wrapping_add(i as u64));
            r
        })
        .collect()
}

/// Admits, submits and answers, streamed or whole.
async fn run(
    state: Arc<AppState>,
    api: Api,
    requests: Vec<GenerateRequest>,
    stream: bool,
    usage: bool,
) -> Result<HttpResponse, ApiError> {
    let slot = state.admit()?;
    let timeout = state.settings.request_timeout;
    let choices = Choices::start(&state.runtime, &state.metrics, requests, timeout, slot);
    let responder = Responder::new(api, &state, usage);
    if stream {
        responder.stream(choices).await
    } else {
        responder.complete(choices).await
    }
}

fn rejected(state: &AppState) -> impl Fn(ApiError) -> ApiError + '_ {
    |e| {
        state.metrics.observe_rejected();
        e
    }
}

async fn chat(state: State, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let state = state.into_inner();
    let prepared = async {
        let body = read_body(payload, state.settings.max_body_bytes).await?;
        let req = ChatRequest::parse(&body)?;
        state.check_model(req.model.as_deref())?;
        let n = req.sampling.n()?;
        Ok((copies(req.to_request()?, n), req))
    };
    let (requests, req) = prepared.await.map_err(rejected(&state))?;
    let usage = req.stream_options.is_some_and(|o| o.include_usage);
    run(state, Api::Chat, requests, req.stream, usage).await
}

async fn completions(state: State, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let state = state.into_inner();
    let prepared = async {
        let body = read_body(payload, state.settings.max_body_bytes).await?;
        let req = CompletionRequest::parse(&body)?;
        state.check_model(req.model.as_deref())?;
        let n = req.sampling.n()?;
        let mut request = req.to_request()?;
        // The OpenAI default for completions is 16 tokens.
        request.max_tokens = Some(req.max_tokens.unwrap_or(16));
        Ok((copies(request, n), req))
    };
    let (requests, req) = prepared.await.map_err(rejected(&state))?;
    let usage = req.stream_options.is_some_and(|o| o.include_usage);
    run(state, Api::Completion, requests, req.stream, usage).await
}

async fn generate(state: State, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let state = state.into_inner();
    let prepared = async {
        let body = read_body(payload, state.settings.max_body_bytes).await?;
        let req: GenerateBody = parse(&body)?;
        Ok((req.to_request()?, req.stream))
    };
    let (request, stream) = prepared.await.map_err(rejected(&state))?;
    run(state, Api::Generate, vec![request], stream, false).await
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct MatchQuery {
    api: String,
}

/// How much of a request's prompt the first model holds in its prefix cache: the exact answer
/// a gateway uses instead of guessing from text. The body is the request as it would be sent
/// to `?api=chat` (`/v1/chat/completions`), `completion` or `generate`.
async fn cache_match(
    state: State,
    query: web::Query<MatchQuery>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let body = read_body(payload, state.settings.max_body_bytes).await?;
    let request = match query.api.as_str() {
        "chat" => ChatRequest::parse(&body)?.to_request()?,
        "completion" => CompletionRequest::parse(&body)?.to_request()?,
        "generate" => parse::<GenerateBody>(&body)?.to_request()?,
        other => {
            let message = format!("api: '{other}' is not chat, completion or generate");
            return Err(ApiError::invalid("api", message));
        }
    };
    let (prompt_tokens, cached_tokens) = state.runtime.cached_prefix(&request)?;
    Ok(HttpResponse::Ok().json(json!({
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "block_size": state.runtime.block_size,
    })))
}

async fn models(state: State) -> HttpResponse {
    let mut data = vec![
        json!({"id": state.served_model, "object": "model", "created": state.created, "owned_by": "tokenrouter"}),
    ];
    for m in &state.config.models {
        data.push(json!({"id": m.name, "object": "model", "created": state.created, "owned_by": "tokenrouter", "parent": state.served_model}));
    }
    HttpResponse::Ok().json(json!({"object": "list", "data": data}))
}

async fn health(state: State) -> HttpResponse {
    match state.runtime.unhealthy_model() {
        None => HttpResponse::Ok().finish(),
        Some(name) => {
            HttpResponse::ServiceUnavailable().json(json!({"status": "unhealthy", "model": name}))
        }
    }
}

/// Health that proves generation works: one greedy token through the runtime.
async fn health_generate(state: State) -> Result<HttpResponse, ApiError> {
    let request = GenerateRequest::new(Prompt::Text("ping".into()), SamplingParams::greedy(), 1);
    let mut request = request;
    request.ignore_eos = true;
    let state = state.into_inner();
    run(state, Api::Generate, vec![request], false, false).await?;
    Ok(HttpResponse::Ok().finish())
}

async fn server_info(state: State) -> HttpResponse {
    let c = &state.config;
    let models: Vec<_> = c
        .models
        .iter()
        .zip(&state.kv)
        .map(|(m, kv)| json!({
            "name": m.name, "path": m.path, "role": m.role.map(|r| format!("{r:?}").to_lowercase()),
            "batch_threshold": m.batch_threshold, "remote": m.remote,
            "kv_blocks": kv.as_ref().map(|k| k.blocks), "kv_tokens": kv.as_ref().map(|k| k.tokens),
            "kv_bytes": kv.as_ref().map(|k| k.bytes),
        }))
        .collect();
    HttpResponse::Ok().json(json!({
        "served_model": state.served_model,
        "models": models,
        "routing": format!("{:?}", c.routing),
        "scheduler": {
            "mode": format!("{:?}", c.scheduler.mode).to_lowercase(),
            "thresholds": format!("{:?}", c.scheduler.thresholds).to_lowercase(),
            "max_wait_ms": c.scheduler.max_wait_ms,
            "max_batch_tokens": c.scheduler.max_batch_tokens,
            "max_batch_requests": c.scheduler.max_batch_requests,
        },
        "kv_budget_mb": c.memory.kv_budget_mb,
        "block_size": c.kv_cache.block_size,
        "max_context": state.runtime.max_context,
        "max_requests": state.settings.max_requests,
    }))
}

async fn metrics(state: State) -> HttpResponse {
    let mut stats = Vec::new();
    for model in &state.runtime.models {
        stats.push(model.stats.send(GetStats).await.unwrap_or_default());
    }
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(state.metrics.render(&stats))
}

async fn not_found(req: actix_web::HttpRequest) -> Result<HttpResponse, ApiError> {
    let message = format!("no route for {} {}", req.method(), req.path());
    Err(ApiError::new(StatusCode::NOT_FOUND, message))
}
