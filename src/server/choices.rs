//! Running the choices of one HTTP request: `n` runtime requests whose events are forwarded,
//! tagged with the choice index, into one channel. Dropping the [`Choices`] (the client went
//! away, the response stream ended) cancels every request still running, which frees its KV
//! blocks on every model. A configured timeout cancels and fails the request.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::error::ApiError;
use super::metrics::Metrics;
use super::AdmissionSlot;
use crate::actors::request::{ErrorKind, RequestError};
use crate::actors::RuntimeShared;
use crate::actors::{GenerateRequest, RequestEvent, Summary};
use crate::routing::ModelIndex;
use std::sync::Arc;

pub struct Choices {
    rx: UnboundedReceiver<(usize, RequestEvent)>,
    /// Events that arrived while waiting for admissions, replayed by `next`.
    backlog: VecDeque<(usize, RequestEvent)>,
    pub n: usize,
    _slot: AdmissionSlot,
}

/// What one choice produced.
#[derive(Debug, Clone, Default)]
pub struct ChoiceResult {
    pub text: String,
    pub tokens: Vec<(u32, ModelIndex)>,
    pub prompt_tokens: usize,
    pub summary: Option<Summary>,
}

impl Choices {
    /// Submits every request on the current arbiter.
    pub fn start(
        runtime: &Arc<RuntimeShared>,
        metrics: &Arc<Metrics>,
        requests: Vec<GenerateRequest>,
        timeout: Option<Duration>,
        slot: AdmissionSlot,
    ) -> Self {
        let (tx, rx) = unbounded_channel();
        let n = requests.len();
        for (i, request) in requests.into_iter().enumerate() {
            let mut handle = runtime.submit(request);
            let (tx, metrics) = (tx.clone(), metrics.clone());
            actix_web::rt::spawn(async move {
                // Without a timeout the deadline never fires.
                let deadline = async {
                    match timeout {
                        Some(t) => tokio::time::sleep(t).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::pin!(deadline);
                loop {
                    tokio::select! {
                        event = handle.events.recv() => {
                            let Some(event) = event else { break };
                            metrics.observe_event(&event);
                            let terminal = event.is_terminal();
                            if tx.send((i, event)).is_err() {
                                handle.cancel();
                                metrics.observe_cancelled();
                                break;
                            }
                            if terminal {
                                break;
                            }
                        }
                        _ = tx.closed() => {
                            handle.cancel();
                            metrics.observe_cancelled();
                            break;
                        }
                        _ = &mut deadline => {
                            handle.cancel();
                            let error = RequestError {
                                kind: ErrorKind::Timeout,
                                message: format!("the request exceeded the server's timeout of {:?}", timeout.unwrap_or_default()),
                            };
                            metrics.observe_event(&RequestEvent::Failed(error.clone()));
                            let _ = tx.send((i, RequestEvent::Failed(error)));
                            break;
                        }
                    }
                }
            });
        }
        Self {
            rx,
            backlog: VecDeque::new(),
            n,
            _slot: slot,
        }
    }

    pub async fn next(&mut self) -> Option<(usize, RequestEvent)> {
        match self.backlog.pop_front() {
            Some(event) => Some(event),
            None => self.rx.recv().await,
        }
    }

    /// Waits until every choice is admitted (tokenized and validated); the first failure is
    /// returned instead, so that a stream can still answer with a 4xx status.
    pub async fn admitted(&mut self, results: &mut [ChoiceResult]) -> Result<(), ApiError> {
        let mut waiting = self.n;
        while waiting > 0 {
            match self.rx.recv().await {
                Some((i, RequestEvent::Admitted { prompt_tokens, .. })) => {
                    results[i].prompt_tokens = prompt_tokens;
                    waiting -= 1;
                }
                Some((_, RequestEvent::Failed(e))) => return Err(e.into()),
                Some(other) => self.backlog.push_back(other),
                None => {
                    return Err(ApiError::from(RequestError {
                        kind: ErrorKind::Internal,
                        message: "the runtime dropped the request".into(),
                    }))
                }
            }
        }
        Ok(())
    }

    /// Runs every choice to the end (non-streaming responses).
    pub async fn collect(mut self) -> Result<Vec<ChoiceResult>, ApiError> {
        let mut results = vec![ChoiceResult::default(); self.n];
        self.admitted(&mut results).await?;
        let mut open = self.n;
        while open > 0 {
            let Some((i, event)) = self.next().await else {
                break;
            };
            let r = &mut results[i];
            match event {
                RequestEvent::Text { text, tokens } => {
                    r.text.push_str(&text);
                    r.tokens.extend(tokens);
                }
                RequestEvent::Finished(s) => {
                    r.summary = Some(s);
                    open -= 1;
                }
                RequestEvent::Failed(e) => return Err(e.into()),
                RequestEvent::Cancelled => {
                    return Err(ApiError::from(RequestError {
                        kind: ErrorKind::Internal,
                        message: "the request was cancelled".into(),
                    }))
                }
                RequestEvent::Admitted { .. } | RequestEvent::Moved { .. } => {}
            }
        }
        Ok(results)
    }
}
