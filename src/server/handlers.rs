//! Endpoint handlers: read and validate the body, take an admission slot, submit, respond.

use std::sync::Arc;

use super::bodies::{
    CacheMatch, ChatChoice, ChatStreamEvent, Completion, GenerateResponse, GenerateStreamEvent,
    ModelCard, ModelInfo, ModelList, SchedulerInfo, ServerInfo, TextChoice, TextStreamEvent,
    Unhealthy,
};
use super::choices::Choices;
use super::error::ApiError;
use super::respond::{Api, Responder};
use super::schema::{parse, ChatRequest, CompletionRequest, GenerateBody, RequestApi};
use super::{kv_events, read_body, AppState};
use crate::actors::model_actor::GetStats;
use crate::actors::{GenerateRequest, Prompt};
use crate::model::SamplingParams;
use actix_web::http::StatusCode;
use actix_web::web;
use actix_web::HttpResponse;

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
        .route("/cache/events", web::get().to(kv_events::cache_events))
        .route(
            "/cache/vocabulary",
            web::get().to(kv_events::cache_vocabulary),
        )
        .route("/openapi.json", web::get().to(openapi))
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

#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    request_body = ChatRequest,
    responses((
        status = 200,
        description = "The completion; with `stream`, server-sent events of its chunks.",
        content(
            (Completion<ChatChoice> = "application/json"),
            (ChatStreamEvent = "text/event-stream")
        )
    ))
)]
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

#[utoipa::path(
    post,
    path = "/v1/completions",
    request_body = CompletionRequest,
    responses((
        status = 200,
        description = "The completion; with `stream`, server-sent events of its chunks.",
        content(
            (Completion<TextChoice> = "application/json"),
            (TextStreamEvent = "text/event-stream")
        )
    ))
)]
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

#[utoipa::path(
    post,
    path = "/generate",
    request_body = GenerateBody,
    responses((
        status = 200,
        description = "SGLang's answer; with `stream`, server-sent events of it (the text so \
            far).",
        content(
            (GenerateResponse = "application/json"),
            (GenerateStreamEvent = "text/event-stream")
        )
    ))
)]
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

#[derive(serde::Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct MatchQuery {
    /// The endpoint the body is for.
    api: RequestApi,
}

/// How much of a request's prompt the first model holds in its prefix cache: the exact answer
/// a gateway uses instead of guessing from text. The body is the request as it would be sent
/// to `?api=chat` (`/v1/chat/completions`), `completion` or `generate`.
#[utoipa::path(
    post,
    path = "/cache/match",
    params(MatchQuery),
    request_body(content = Object, description = "A chat, completion or generate request."),
    responses((status = 200, body = CacheMatch))
)]
async fn cache_match(
    state: State,
    req: actix_web::HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let query = web::Query::<MatchQuery>::from_query(req.query_string()).map_err(|e| {
        let message = format!("api: give ?api=chat, completion or generate ({e})");
        ApiError::invalid("api", message)
    })?;
    let body = read_body(payload, state.settings.max_body_bytes).await?;
    let request = query.api.parse_request(&body)?;
    let (prompt_tokens, cached_tokens) = state.runtime.cached_prefix(&request)?;
    Ok(HttpResponse::Ok().json(CacheMatch {
        prompt_tokens,
        cached_tokens,
        block_size: state.runtime.block_size,
    }))
}

#[utoipa::path(get, path = "/v1/models", responses((status = 200, body = ModelList)))]
async fn models(state: State) -> HttpResponse {
    let card = |id: &str, parent: Option<&str>| ModelCard {
        id: id.to_string(),
        object: "model",
        created: state.created,
        owned_by: "tokenrouter",
        parent: parent.map(str::to_string),
    };
    let served = std::iter::once(card(&state.served_model, None));
    let routed = (state.config.models.iter()).map(|m| card(&m.name, Some(&state.served_model)));
    HttpResponse::Ok().json(ModelList {
        object: "list",
        data: served.chain(routed).collect(),
    })
}

#[utoipa::path(
    get,
    path = "/health",
    responses(
        (status = 200, description = "Every model is up."),
        (status = 503, description = "A model is down.", body = Unhealthy)
    )
)]
async fn health(state: State) -> HttpResponse {
    match state.runtime.unhealthy_model() {
        None => HttpResponse::Ok().finish(),
        Some(name) => HttpResponse::ServiceUnavailable().json(Unhealthy {
            status: "unhealthy",
            model: name.to_string(),
        }),
    }
}

#[utoipa::path(
    get,
    path = "/health_generate",
    responses(
        (status = 200, description = "One token went through the runtime."),
        (status = 503, description = "It did not.", body = super::bodies::ErrorBody),
        (status = 504, description = "Not in the request timeout.", body = super::bodies::ErrorBody)
    )
)]
/// Health that proves generation works: one greedy token through the runtime.
async fn health_generate(state: State) -> Result<HttpResponse, ApiError> {
    let request = GenerateRequest::new(Prompt::Text("ping".into()), SamplingParams::greedy(), 1);
    let mut request = request;
    request.ignore_eos = true;
    let state = state.into_inner();
    run(state, Api::Generate, vec![request], false, false).await?;
    Ok(HttpResponse::Ok().finish())
}

#[utoipa::path(get, path = "/get_server_info", responses((status = 200, body = ServerInfo)))]
async fn server_info(state: State) -> HttpResponse {
    let c = &state.config;
    let models = (c.models.iter().zip(&state.kv))
        .map(|(m, kv)| ModelInfo {
            name: m.name.clone(),
            path: m.path.display().to_string(),
            role: m.role.map(|r| format!("{r:?}").to_lowercase()),
            batch_threshold: m.batch_threshold,
            remote: m.remote.clone(),
            kv_blocks: kv.as_ref().map(|k| k.blocks),
            kv_tokens: kv.as_ref().map(|k| k.tokens),
            kv_bytes: kv.as_ref().map(|k| k.bytes),
        })
        .collect();
    HttpResponse::Ok().json(ServerInfo {
        served_model: state.served_model.clone(),
        models,
        routing: format!("{:?}", c.routing),
        scheduler: SchedulerInfo {
            mode: format!("{:?}", c.scheduler.mode).to_lowercase(),
            thresholds: format!("{:?}", c.scheduler.thresholds).to_lowercase(),
            max_wait_ms: c.scheduler.max_wait_ms,
            max_batch_tokens: c.scheduler.max_batch_tokens,
            max_batch_requests: c.scheduler.max_batch_requests,
        },
        kv_budget_mb: c.memory.kv_budget_mb,
        block_size: c.kv_cache.block_size,
        max_context: state.runtime.max_context,
        max_requests: state.settings.max_requests,
    })
}

/// This API's OpenAPI document.
#[utoipa::path(
    get,
    path = "/openapi.json",
    responses((status = 200, description = "The OpenAPI 3.1 document.", body = Object))
)]
async fn openapi(state: State) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("application/json")
        .body(state.openapi.clone())
}

#[utoipa::path(
    get,
    path = "/metrics",
    responses((status = 200, description = "Prometheus text format.", body = String, content_type = "text/plain"))
)]
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
