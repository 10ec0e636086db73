//! The request actor: one per request, its home for the whole generation. It tokenizes and
//! validates, submits to the first model, turns token events into text (incrementally, never
//! splitting a UTF-8 character, holding back what may begin a stop string), applies the stop
//! conditions, times the request, attributes every token to its model, and ends with exactly
//! one terminal event: finished, failed or cancelled. However a submitted request ends, this
//! actor alone tells the models: one abort to each, sent before the terminal event, so that
//! whatever the listener does next finds the request's blocks already freed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::{Actor, ActorContext, AsyncContext, Context, Handler, Message, Recipient};
use tokio::sync::mpsc::UnboundedSender;

use super::messages::{Abort, EventSink, RequestMeta, Submit, TokenEvent};
use crate::model::runner::FinishReason;
use crate::model::{ChatMessage, IncrementalDecoder, SamplingParams};
use crate::routing::{ModelIndex, Speculation};
use crate::scheduler::RequestId;

#[derive(Debug, Clone)]
pub enum Prompt {
    Text(String),
    /// Rendered with the model's chat template, generation prompt appended.
    Chat(Vec<ChatMessage>),
    Tokens(Vec<u32>),
}

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    pub params: SamplingParams,
    /// `None`: until the context is full.
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
}

impl GenerateRequest {
    pub fn new(prompt: Prompt, params: SamplingParams, max_tokens: usize) -> Self {
        Self {
            prompt,
            params,
            max_tokens: Some(max_tokens),
            stop: Vec::new(),
            ignore_eos: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request itself is wrong (a 4xx for HTTP clients).
    InvalidRequest,
    /// The server failed (a 5xx).
    Internal,
    /// The request ran past the server's time limit.
    Timeout,
    /// A model it needs is unavailable for now (a subserver's link is down): retry later.
    Unavailable,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct RequestError {
    pub kind: ErrorKind,
    pub message: String,
}

impl RequestError {
    pub fn invalid(message: impl Into<String>) -> Self {
        Self {
            kind: ErrorKind::InvalidRequest,
            message: message.into(),
        }
    }
}

/// How a request went, reported with its terminal event.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub finish: FinishReason,
    /// The stop string that ended it, if one did.
    pub stop: Option<String>,
    /// Output tokens committed by each model, by model index.
    pub tokens_per_model: Vec<usize>,
    pub handoffs: usize,
    /// Speculative decoding: drafts verified, accepted, and the verifications.
    pub speculation: Speculation,
    pub ttft: Option<Duration>,
    pub e2e: Duration,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RequestEvent {
    Admitted {
        id: RequestId,
        prompt_tokens: usize,
    },
    /// Text that became final with these tokens (empty while a character or a possible stop
    /// string is incomplete).
    Text {
        text: String,
        tokens: Vec<(u32, ModelIndex)>,
    },
    Moved {
        from: ModelIndex,
        to: ModelIndex,
    },
    Finished(Summary),
    Failed(RequestError),
    Cancelled,
}

impl RequestEvent {
    pub fn is_terminal(&self) -> bool {
        matches!(self, Self::Finished(_) | Self::Failed(_) | Self::Cancelled)
    }
}

/// Asks a request actor to cancel its request.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct Cancel;

mod shared;
mod state;
pub use shared::{prompt_tokens, Admitted, RequestHandle, RuntimeShared};
pub use state::RequestState;

pub struct RequestActor {
    shared: Arc<RuntimeShared>,
    id: RequestId,
    request: Option<GenerateRequest>,
    state: Option<RequestState>,
    events: UnboundedSender<RequestEvent>,
    /// The request went to a model, so its end must be told to every model.
    submitted: bool,
    ended: bool,
}

impl RequestActor {
    pub fn new(
        shared: Arc<RuntimeShared>,
        id: RequestId,
        request: GenerateRequest,
        events: UnboundedSender<RequestEvent>,
    ) -> Self {
        Self {
            shared,
            id,
            request: Some(request),
            state: None,
            events,
            submitted: false,
            ended: false,
        }
    }

    /// Sends to the listener; a listener that is gone cancels the request.
    fn emit(&mut self, event: RequestEvent, ctx: &mut Context<Self>) {
        if self.ended {
            return;
        }
        let terminal = event.is_terminal();
        if self.events.send(event).is_err() && !terminal {
            return self.end(RequestEvent::Cancelled, ctx);
        }
        if terminal {
            self.ended = true;
            ctx.stop();
        }
    }

    /// Emits the terminal event, once; a submitted request is first aborted on every model,
    /// including one that ended it already (it alone does not tell its peers).
    fn end(&mut self, event: RequestEvent, ctx: &mut Context<Self>) {
        if self.ended {
            return;
        }
        if self.submitted {
            for model in &self.shared.models {
                model.abort.do_send(Abort { id: self.id });
            }
        }
        self.emit(event, ctx);
    }
}

struct ActorSink(Recipient<TokenEvent>);

impl EventSink for ActorSink {
    fn send(&self, event: TokenEvent) -> bool {
        self.0.connected() && {
            self.0.do_send(event);
            true
        }
    }
}

impl Actor for RequestActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let Some(request) = self.request.take() else {
            return;
        };
        let _span = tracing::debug_span!("request", id = self.id).entered();
        let admitted = match self.shared.prepare(&request) {
            Ok(a) => a,
            Err(e) => return self.end(RequestEvent::Failed(e), ctx),
        };
        let first = self.shared.router.first_model(&admitted.prompt);
        let meta = Arc::new(RequestMeta {
            id: self.id,
            prompt_len: admitted.prompt.len(),
            params: request.params,
            max_tokens: admitted.max_tokens,
            stop_ids: if request.ignore_eos {
                Vec::new()
            } else {
                self.shared.eos.clone()
            },
            home: first,
            sink: Arc::new(ActorSink(ctx.address().recipient())),
        });
        self.state = Some(RequestState::new(
            self.shared.clone(),
            &meta,
            request.stop,
            Instant::now(),
        ));
        self.emit(
            RequestEvent::Admitted {
                id: self.id,
                prompt_tokens: admitted.prompt.len(),
            },
            ctx,
        );
        if self.ended {
            // The listener is gone already: no model hears of the request.
            return;
        }
        self.submitted = true;
        self.shared.models[first].submit.do_send(Submit {
            meta,
            prompt: admitted.prompt,
        });
    }
}

impl Handler<TokenEvent> for RequestActor {
    type Result = ();
    fn handle(&mut self, event: TokenEvent, ctx: &mut Context<Self>) {
        let Some(state) = self.state.as_mut() else {
            return;
        };
        match event {
            TokenEvent::Token { token, model } => {
                let (text, ending) = state.on_token(token, model, Instant::now());
                self.emit(text, ctx);
                if let Some(summary) = ending {
                    self.end(RequestEvent::Finished(summary), ctx);
                }
            }
            TokenEvent::Verified {
                drafted, accepted, ..
            } => state.on_verified(drafted, accepted),
            TokenEvent::Moved { from, to } => {
                state.on_moved();
                self.emit(RequestEvent::Moved { from, to }, ctx);
            }
            TokenEvent::Finished { reason } => {
                let (rest, summary) = state.finish(reason, Instant::now());
                if let Some(text) = rest {
                    self.emit(text, ctx);
                }
                self.end(RequestEvent::Finished(summary), ctx);
            }
            TokenEvent::Failed { message } => {
                let error = RequestError {
                    kind: ErrorKind::Internal,
                    message,
                };
                self.end(RequestEvent::Failed(error), ctx);
            }
        }
    }
}

impl Handler<Cancel> for RequestActor {
    type Result = ();
    fn handle(&mut self, _: Cancel, ctx: &mut Context<Self>) {
        self.end(RequestEvent::Cancelled, ctx);
    }
}
