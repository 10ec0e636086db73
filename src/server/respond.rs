//! Response bodies: OpenAI chat / text completions and SGLang `/generate`, whole or as SSE
//! streams (`data: {...}` events ending with `data: [DONE]`). Every response carries the
//! routing outcome in a `routing` field: tokens per model, the LLM's share, handoffs; stream
//! chunks name the model of their tokens.

use std::collections::BTreeMap;
use std::sync::Arc;

use actix_web::web::Bytes;
use actix_web::HttpResponse;
use serde_json::{json, Value};

use super::choices::{ChoiceResult, Choices};
use super::error::ApiError;
use super::AppState;
use crate::actors::{RequestEvent, Summary};
use crate::config::Role;
use crate::model::runner::FinishReason;
use crate::routing::Speculation;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completion,
    Generate,
}

pub struct Responder {
    api: Api,
    id: String,
    created: u64,
    model: String,
    names: Vec<String>,
    llm: Option<usize>,
    include_usage: bool,
}

fn finish_reason(s: &Summary) -> &'static str {
    match s.finish {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

fn sse(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

impl Responder {
    pub fn new(api: Api, state: &Arc<AppState>, include_usage: bool) -> Self {
        let prefix = match api {
            Api::Chat => "chatcmpl",
            Api::Completion => "cmpl",
            Api::Generate => "gen",
        };
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        Self {
            api,
            id: format!("{prefix}-{nanos:x}"),
            created: (nanos / 1_000_000_000) as u64,
            model: state.served_model.clone(),
            names: state.config.models.iter().map(|m| m.name.clone()).collect(),
            llm: state.config.role_index(Role::Llm),
            include_usage,
        }
    }

    /// Tokens per model, the LLM's share of them, and handoffs, summed over `summaries`;
    /// with speculative decoding, the drafts, the share accepted and the mean accepted per
    /// verification too.
    fn routing<'a>(&self, summaries: impl Iterator<Item = &'a Summary>) -> Value {
        let mut per_model = vec![0usize; self.names.len()];
        let mut handoffs = 0;
        let mut spec = Speculation::default();
        for s in summaries {
            for (t, n) in per_model.iter_mut().zip(&s.tokens_per_model) {
                *t += n;
            }
            handoffs += s.handoffs;
            spec.drafted += s.speculation.drafted;
            spec.accepted += s.speculation.accepted;
            spec.verifications += s.speculation.verifications;
        }
        let total: usize = per_model.iter().sum();
        let by_name: BTreeMap<&str, usize> = self
            .names
            .iter()
            .map(String::as_str)
            .zip(per_model.iter().copied())
            .collect();
        let share = self.llm.map(|l| per_model[l] as f64 / total.max(1) as f64);
        let mut routing =
            json!({ "tokens_per_model": by_name, "llm_token_share": share, "handoffs": handoffs });
        if spec.verifications > 0 {
            routing["speculative"] = json!({
                "drafted_tokens": spec.drafted,
                "accepted_tokens": spec.accepted,
                "verifications": spec.verifications,
                "acceptance_rate": spec.accepted as f64 / spec.drafted.max(1) as f64,
                "mean_accepted_length": spec.accepted as f64 / spec.verifications as f64,
            });
        }
        routing
    }

    fn usage(&self, results: &[ChoiceResult]) -> Value {
        let prompt = results.first().map_or(0, |r| r.prompt_tokens);
        let completion: usize = results
            .iter()
            .filter_map(|r| r.summary.as_ref())
            .map(|s| s.completion_tokens)
            .sum();
        json!({ "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion })
    }

    /// Runs every choice to the end and answers with one JSON body.
    pub async fn complete(self, choices: Choices) -> Result<HttpResponse, ApiError> {
        let results = choices.collect().await?;
        let summaries = || results.iter().filter_map(|r| r.summary.as_ref());
        let body = match self.api {
            Api::Generate => self.generate_body(&results[0], true),
            Api::Chat | Api::Completion => {
                let choices: Vec<Value> = results
                    .iter()
                    .enumerate()
                    .map(|(i, r)| {
                        let reason = r.summary.as_ref().map(finish_reason);
                        match self.api {
                            Api::Chat => json!({"index": i, "message": {"role": "assistant", "content": r.text}, "logprobs": null, "finish_reason": reason}),
                            _ => json!({"index": i, "text": r.text, "logprobs": null, "finish_reason": reason}),
                        }
                    })
                    .collect();
                json!({
                    "id": self.id, "object": self.object(false), "created": self.created, "model": self.model,
                    "choices": choices, "usage": self.usage(&results), "routing": self.routing(summaries()),
                })
            }
        };
        Ok(HttpResponse::Ok().json(body))
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.api, chunk) {
            (Api::Chat, false) => "chat.completion",
            (Api::Chat, true) => "chat.completion.chunk",
            _ => "text_completion",
        }
    }

    /// SGLang's `/generate` body: text so far, output ids, and `meta_info`.
    fn generate_body(&self, r: &ChoiceResult, done: bool) -> Value {
        let finish = r.summary.as_ref().filter(|_| done).map(|s| match &s.stop {
            Some(stop) => json!({"type": "stop", "matched": stop}),
            None if s.finish == FinishReason::Stop => {
                json!({"type": "stop", "matched": r.tokens.last().map(|t| t.0)})
            }
            None => json!({"type": "length", "length": s.completion_tokens}),
        });
        json!({
            "text": r.text,
            "output_ids": r.tokens.iter().map(|t| t.0).collect::<Vec<_>>(),
            "meta_info": {
                "id": self.id,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.tokens.len(),
                "finish_reason": finish,
                "e2e_latency": r.summary.as_ref().map(|s| s.e2e.as_secs_f64()),
                "routing": r.summary.as_ref().map(|s| self.routing(std::iter::once(s))),
            }
        })
    }

    /// A chunk of the OpenAI stream for choice `i`.
    fn chunk(&self, i: usize, delta: Value, reason: Option<&str>, extra: Option<Value>) -> Value {
        let choice = match self.api {
            Api::Chat => {
                json!({"index": i, "delta": delta, "logprobs": null, "finish_reason": reason})
            }
            _ => {
                json!({"index": i, "text": delta.get("content").cloned().unwrap_or(json!("")), "logprobs": null, "finish_reason": reason})
            }
        };
        let mut chunk = json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model, "choices": [choice]});
        if let Some(extra) = extra {
            chunk["routing"] = extra;
        }
        chunk
    }

    /// Answers with an SSE stream once every choice is admitted (so a bad request still gets
    /// its 4xx status).
    pub async fn stream(self, mut choices: Choices) -> Result<HttpResponse, ApiError> {
        let mut results = vec![ChoiceResult::default(); choices.n];
        choices.admitted(&mut results).await?;
        let mut first = Vec::new();
        if self.api == Api::Chat {
            for i in 0..choices.n {
                first.extend_from_slice(&sse(&self.chunk(
                    i,
                    json!({"role": "assistant", "content": ""}),
                    None,
                    None,
                )));
            }
        }
        let open = choices.n;
        let state = StreamState {
            responder: self,
            choices,
            results,
            open,
            done: false,
        };
        let body = futures_util::stream::unfold(state, |mut st| async move {
            let bytes = st.next_bytes().await?;
            Some((Ok::<_, actix_web::Error>(bytes), st))
        });
        let head = futures_util::stream::iter((!first.is_empty()).then(|| Ok(Bytes::from(first))));
        Ok(HttpResponse::Ok()
            .content_type("text/event-stream")
            .insert_header(("Cache-Control", "no-cache"))
            .streaming(futures_util::StreamExt::chain(head, body)))
    }
}

struct StreamState {
    responder: Responder,
    choices: Choices,
    results: Vec<ChoiceResult>,
    open: usize,
    done: bool,
}

impl StreamState {
    /// The next bytes of the stream; `None` once `[DONE]` went out.
    async fn next_bytes(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        let r = &self.responder;
        while self.open > 0 {
            let Some((i, event)) = self.choices.next().await else {
                let error = ApiError::new(
                    actix_web::http::StatusCode::INTERNAL_SERVER_ERROR,
                    "the runtime dropped the request",
                );
                self.open = 0;
                return Some(sse(&error.body()));
            };
            match event {
                RequestEvent::Text { text, tokens } => {
                    let res = &mut self.results[i];
                    res.text.push_str(&text);
                    let models: Vec<&str> = tokens.iter().map(|t| r.names[t.1].as_str()).collect();
                    res.tokens.extend(tokens);
                    if text.is_empty() {
                        continue;
                    }
                    return Some(sse(&match r.api {
                        Api::Generate => r.generate_body(res, false),
                        _ => r.chunk(
                            i,
                            json!({"content": text}),
                            None,
                            Some(json!({"models": models})),
                        ),
                    }));
                }
                RequestEvent::Finished(s) => {
                    self.open -= 1;
                    let routing = r.routing(std::iter::once(&s));
                    let reason = finish_reason(&s);
                    self.results[i].summary = Some(s);
                    return Some(sse(&match r.api {
                        Api::Generate => r.generate_body(&self.results[i], true),
                        _ => r.chunk(i, json!({}), Some(reason), Some(routing)),
                    }));
                }
                RequestEvent::Failed(e) => {
                    self.open = 0;
                    return Some(sse(&ApiError::from(e).body()));
                }
                RequestEvent::Cancelled => {
                    self.open = 0;
                }
                RequestEvent::Admitted { .. } | RequestEvent::Moved { .. } => {}
            }
        }
        self.done = true;
        let mut tail = Vec::new();
        if r.include_usage && r.api != Api::Generate {
            let usage = json!({"id": r.id, "object": r.object(true), "created": r.created, "model": r.model,
                "choices": [], "usage": r.usage(&self.results)});
            tail.extend_from_slice(&sse(&usage));
        }
        tail.extend_from_slice(b"data: [DONE]\n\n");
        Some(Bytes::from(tail))
    }
}
