//! Forwarding one request: pick a worker (waiting in a bounded queue when every worker is
//! saturated), send, retry with backoff on connect errors and 502/503/504 on another worker,
//! then pass the response through as it arrives. The worker's load is held by an
//! [`InFlight`] guard that lives inside the response stream, so it ends with the stream; when
//! the client disconnects the stream is dropped, which drops the upstream connection, and the
//! worker cancels the request.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use actix_web::http::{header, StatusCode};
use actix_web::web::Bytes;
use actix_web::{HttpRequest, HttpResponse};
use futures_util::StreamExt;

use super::policy::RouteRequest;
use super::request_text::{routing_text, Endpoint};
use super::tree::WorkerId;
use super::workers::{HealthPolicy, InFlight, Worker};
use super::GatewayState;
use crate::server::error::ApiError;

/// Limits of the wait for a worker with room.
#[derive(Debug, Clone)]
pub struct QueueSettings {
    /// In-flight requests a worker takes before it counts as saturated (0: no limit).
    pub worker_max_load: usize,
    /// Requests that may wait at once; beyond it, 429.
    pub size: usize,
    /// How long a request waits before a 503.
    pub timeout: Duration,
}

/// Retries after failed attempts.
#[derive(Debug, Clone)]
pub struct RetrySettings {
    pub max_retries: u32,
    /// Wait before the first retry; doubled each time, capped at 2 s.
    pub backoff: Duration,
    /// Time for a whole upstream exchange, body included.
    pub request_timeout: Duration,
}

/// A place in the queue; given back on drop.
struct QueueTicket<'a>(&'a AtomicUsize);

impl Drop for QueueTicket<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn unavailable(message: impl Into<String>) -> ApiError {
    let mut e = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message);
    e.retry_after = Some(1);
    e
}

impl GatewayState {
    /// A worker for this request, counted as loaded; waits while every worker is saturated.
    async fn acquire(
        &self,
        request: &RouteRequest<'_>,
        tried: &[WorkerId],
    ) -> Result<InFlight, ApiError> {
        let limits = &self.queue_settings;
        let deadline = Instant::now() + limits.timeout;
        let mut ticket: Option<QueueTicket> = None;
        loop {
            let mut candidates = self.workers.routable(tried);
            if candidates.is_empty() && !tried.is_empty() {
                candidates = self.workers.routable(&[]);
            }
            if candidates.is_empty() {
                return Err(unavailable("no healthy worker is available; retry shortly"));
            }
            let max = limits.worker_max_load;
            candidates.retain(|w| max == 0 || w.load() < max);
            if !candidates.is_empty() {
                let selection = self.policy.select(&candidates, request);
                if let Some((matched, total)) = selection.matched {
                    self.metrics.cache(matched, total);
                }
                // Each request's own blocks beyond its prompt's full ones (which exact routing
                // counts, shared, in its index): about one.
                let blocks = usize::from(request.blocks.is_some());
                let guard = self.workers.start(&candidates[selection.index], blocks);
                return Ok(guard.holding(selection.pending));
            }
            if ticket.is_none() {
                ticket = Some(self.enter_queue()?);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(unavailable(format!(
                    "every worker is saturated ({max} requests each) and none freed up within {:?}",
                    limits.timeout
                )));
            }
            self.workers
                .released(left.min(Duration::from_millis(100)))
                .await;
        }
    }

    fn enter_queue(&self) -> Result<QueueTicket<'_>, ApiError> {
        let size = self.queue_settings.size;
        let taken = self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < size).then_some(n + 1)
            });
        if taken.is_err() {
            let mut e = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!("every worker is saturated and {size} requests are already waiting"),
            );
            e.retry_after = Some(1);
            return Err(e);
        }
        Ok(QueueTicket(&self.queued))
    }
}

/// Whether a status means "try another worker".
fn retryable(status: StatusCode) -> bool {
    matches!(status.as_u16(), 502..=504)
}

/// Headers that describe one hop, not the message.
fn hop_by_hop(name: &header::HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection" | "keep-alive" | "transfer-encoding" | "content-length" | "upgrade" | "te"
    )
}

/// Sends `body` to one worker; `Ok` carries any response, `Err` a transport failure.
async fn send(
    client: &awc::Client,
    worker: &Worker,
    path: &str,
    req: &HttpRequest,
    body: Bytes,
    timeout: Duration,
) -> Result<
    awc::ClientResponse<impl futures_util::Stream<Item = Result<Bytes, awc::error::PayloadError>>>,
    String,
> {
    let upstream = client
        .post(format!("{}{path}", worker.url))
        .timeout(timeout)
        .insert_header((header::CONTENT_TYPE, "application/json"));
    with_client_headers(upstream, req)
        .send_body(body)
        .await
        .map_err(|e| e.to_string())
}

/// Proxies a generation request (`/v1/chat/completions`, `/v1/completions`, `/generate`).
pub async fn forward(
    state: &GatewayState,
    client: &awc::Client,
    req: &HttpRequest,
    endpoint: Endpoint,
    body: Bytes,
) -> Result<HttpResponse, ApiError> {
    let json: serde_json::Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::invalid("body", format!("the body is not valid JSON: {e}")))?;
    let text = routing_text(endpoint, &json);
    let blocks = (state.exact.as_ref()).and_then(|exact| exact.blocks(endpoint, &body));
    let route = RouteRequest {
        text: &text,
        blocks: blocks.as_ref().map(|b| b.hashes.as_slice()),
        prompt_tokens: blocks.as_ref().map_or(0, |b| b.prompt_tokens),
        block_size: blocks.as_ref().map_or(0, |b| b.block_size),
    };
    let retry = &state.retry_settings;
    let mut tried: Vec<WorkerId> = Vec::new();
    let mut attempt = 0;
    loop {
        let guard = state.acquire(&route, &tried).await?;
        let worker = guard.worker().clone();
        let last = attempt >= retry.max_retries;
        if !worker.breaker_allows(Instant::now()) {
            tried.push(worker.id);
            continue;
        }
        let outcome = send(
            client,
            &worker,
            endpoint.path(),
            req,
            body.clone(),
            retry.request_timeout,
        )
        .await;
        let policy = &state.workers.policy;
        let failure = match outcome {
            Ok(response) if !retryable(response.status()) || last => {
                let status = response.status();
                // A worker at its own request limit is busy, not broken.
                if status != StatusCode::SERVICE_UNAVAILABLE {
                    worker.record_outcome(!retryable(status), policy, Instant::now());
                }
                state.metrics.outcome(if retryable(status) {
                    "failed"
                } else {
                    "proxied"
                });
                return Ok(pass_through(response, guard, policy.clone()));
            }
            Ok(response) => {
                if response.status() != StatusCode::SERVICE_UNAVAILABLE {
                    worker.record_outcome(false, policy, Instant::now());
                }
                format!("HTTP {}", response.status())
            }
            Err(e) => {
                worker.record_outcome(false, policy, Instant::now());
                if last {
                    state.metrics.outcome("failed");
                    return Err(ApiError::new(
                        StatusCode::BAD_GATEWAY,
                        format!(
                            "worker {} failed after {} attempts: {e}",
                            worker.url,
                            attempt + 1
                        ),
                    ));
                }
                e
            }
        };
        tracing::warn!(worker = %worker.url, attempt, %failure, "retrying on another worker");
        worker.retries.fetch_add(1, Ordering::Relaxed);
        state.metrics.retry(&worker.url);
        tried.push(worker.id);
        drop(guard);
        let backoff = retry.backoff * 2u32.saturating_pow(attempt);
        tokio::time::sleep(backoff.min(Duration::from_secs(2))).await;
        attempt += 1;
    }
}

/// The worker's response, streamed through as it arrives, holding the load guard. An event
/// stream is passed on whole events at a time, so that a worker failing mid-stream (its
/// connection lost, or the stream ending without `[DONE]`) leaves the client a final error
/// event and `[DONE]`, as a server's own failures end a stream, never half an event; the
/// failure counts against the worker.
fn pass_through<S>(
    response: awc::ClientResponse<S>,
    guard: InFlight,
    health: HealthPolicy,
) -> HttpResponse
where
    S: futures_util::Stream<Item = Result<Bytes, awc::error::PayloadError>> + Unpin + 'static,
{
    let mut out = HttpResponse::build(response.status());
    for (name, value) in response.headers() {
        if !hop_by_hop(name) {
            out.insert_header((name.clone(), value.clone()));
        }
    }
    let events = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.starts_with("text/event-stream"));
    let relay = Relay {
        upstream: response,
        events,
        pending: Vec::new(),
        finished: false,
        done: false,
        guard,
        health,
    };
    out.streaming(futures_util::stream::unfold(relay, Relay::next))
}

/// A worker's body on its way to the client (see [`pass_through`]).
struct Relay<S> {
    upstream: S,
    /// Whether the body is an event stream.
    events: bool,
    /// Bytes of an event not yet complete.
    pending: Vec<u8>,
    /// `data: [DONE]` went out.
    finished: bool,
    /// Nothing more to send.
    done: bool,
    guard: InFlight,
    health: HealthPolicy,
}

impl<S> Relay<S>
where
    S: futures_util::Stream<Item = Result<Bytes, awc::error::PayloadError>> + Unpin,
{
    async fn next(mut self) -> Option<(Result<Bytes, awc::error::PayloadError>, Self)> {
        while !self.done {
            match self.upstream.next().await {
                Some(Ok(chunk)) if !self.events => return Some((Ok(chunk), self)),
                Some(Ok(chunk)) => {
                    self.pending.extend_from_slice(&chunk);
                    let Some(end) = self.pending.windows(2).rposition(|w| w == b"\n\n") else {
                        continue;
                    };
                    let whole: Vec<u8> = self.pending.drain(..end + 2).collect();
                    self.finished |= whole.windows(12).any(|w| w == b"data: [DONE]");
                    return Some((Ok(Bytes::from(whole)), self));
                }
                // A connection lost after `[DONE]` lost nothing.
                Some(Err(_)) if self.finished => self.done = true,
                Some(Err(e)) if !self.events => {
                    self.fail();
                    return Some((Err(e), self));
                }
                Some(Err(e)) => return Some((Ok(self.fail_with(&e.to_string())), self)),
                None if !self.events || self.finished => self.done = true,
                None => return Some((Ok(self.fail_with("the stream ended early")), self)),
            }
        }
        None
    }

    fn fail(&mut self) {
        self.done = true;
        self.guard
            .worker()
            .record_outcome(false, &self.health, Instant::now());
    }

    /// Ends the stream with an error event naming the worker, then `[DONE]`.
    fn fail_with(&mut self, what: &str) -> Bytes {
        self.fail();
        let url = &self.guard.worker().url;
        tracing::warn!(worker = %url, "worker failed mid-stream: {what}");
        let error = ApiError::new(
            StatusCode::BAD_GATEWAY,
            format!("worker {url} failed mid-stream ({what}); the answer is incomplete"),
        );
        let body = serde_json::to_string(&error.body()).expect("error bodies serialize");
        Bytes::from(format!("data: {body}\n\ndata: [DONE]\n\n"))
    }
}

/// The client's `Authorization` (servers with a key accept the gateway's clients) and
/// `Accept`, on a request to a worker.
fn with_client_headers(mut upstream: awc::ClientRequest, req: &HttpRequest) -> awc::ClientRequest {
    for name in [header::AUTHORIZATION, header::ACCEPT] {
        if let Some(value) = req.headers().get(&name) {
            upstream = upstream.insert_header((name, value.clone()));
        }
    }
    upstream
}

/// Forwards a GET (model list, server info) to the least-loaded routable worker.
pub async fn forward_get(
    state: &GatewayState,
    client: &awc::Client,
    req: &HttpRequest,
    path: &str,
) -> Result<HttpResponse, ApiError> {
    let workers = state.workers.routable(&[]);
    let Some(worker) = workers.iter().min_by_key(|w| w.load()) else {
        return Err(unavailable("no healthy worker is available; retry shortly"));
    };
    let guard = state.workers.start(worker, 0);
    let upstream = client
        .get(format!("{}{path}", worker.url))
        .timeout(state.retry_settings.request_timeout);
    let response = with_client_headers(upstream, req)
        .send()
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::BAD_GATEWAY,
                format!("worker {}: {e}", worker.url),
            )
        })?;
    Ok(pass_through(response, guard, state.workers.policy.clone()))
}

/// Whether a worker answers `/health` with 200 within `timeout`.
pub async fn probe(client: &awc::Client, url: &str, timeout: Duration) -> bool {
    match client
        .get(format!("{url}/health"))
        .timeout(timeout)
        .send()
        .await
    {
        Ok(mut response) => {
            let _ = response.body().await;
            response.status().is_success()
        }
        Err(_) => false,
    }
}
