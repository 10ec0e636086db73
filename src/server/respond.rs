//! Response bodies: OpenAI chat / text completions and SGLang `/generate`, whole or as SSE
//! streams (`data: {...}` events ending with `data: [DONE]`). Every response carries the
//! routing outcome in a `routing` field: tokens per model, the LLM's share, handoffs; stream
//! chunks name the model of their tokens.

use std::sync::Arc;

use actix_web::web::Bytes;
use actix_web::HttpResponse;
use serde::Serialize;

use super::bodies::{
    AssistantMessage, ChatChoice, ChatChunkChoice, Chunk, ChunkRouting, Completion, Delta, Finish,
    GenerateFinish, GenerateResponse, Matched, MetaInfo, Routing, SpeculativeStats, TextChoice,
    TextChunkChoice, Usage,
};
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

fn finish_reason(s: &Summary) -> Finish {
    match s.finish {
        FinishReason::Stop => Finish::Stop,
        FinishReason::Length => Finish::Length,
    }
}

fn sse(value: &impl Serialize) -> Bytes {
    let json = serde_json::to_string(value).expect("response bodies serialize");
    Bytes::from(format!("data: {json}\n\n"))
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
    fn routing<'a>(&self, summaries: impl Iterator<Item = &'a Summary>) -> Routing {
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
        Routing {
            tokens_per_model: self
                .names
                .iter()
                .cloned()
                .zip(per_model.iter().copied())
                .collect(),
            llm_token_share: self.llm.map(|l| per_model[l] as f64 / total.max(1) as f64),
            handoffs,
            speculative: (spec.verifications > 0).then(|| SpeculativeStats {
                drafted_tokens: spec.drafted,
                accepted_tokens: spec.accepted,
                verifications: spec.verifications,
                acceptance_rate: spec.accepted as f64 / spec.drafted.max(1) as f64,
                mean_accepted_length: spec.accepted as f64 / spec.verifications as f64,
            }),
        }
    }

    fn usage(&self, results: &[ChoiceResult]) -> Usage {
        let prompt = results.first().map_or(0, |r| r.prompt_tokens);
        let completion: usize = results
            .iter()
            .filter_map(|r| r.summary.as_ref())
            .map(|s| s.completion_tokens)
            .sum();
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
        }
    }

    /// Runs every choice to the end and answers with one JSON body.
    pub async fn complete(self, choices: Choices) -> Result<HttpResponse, ApiError> {
        let results = choices.collect().await?;
        let mut response = HttpResponse::Ok();
        Ok(match self.api {
            Api::Generate => response.json(self.generate_body(&results[0], true)),
            Api::Chat => {
                response.json(
                    self.completion(&results, |index, r, finish_reason| ChatChoice {
                        index,
                        message: AssistantMessage {
                            role: "assistant",
                            content: r.text.clone(),
                        },
                        logprobs: None,
                        finish_reason,
                    }),
                )
            }
            Api::Completion => response.json(self.completion(
                &results,
                |index, r, finish_reason| TextChoice {
                    index,
                    text: r.text.clone(),
                    logprobs: None,
                    finish_reason,
                },
            )),
        })
    }

    /// The whole body of an OpenAI completion, each result made a choice by `choice`.
    fn completion<C>(
        &self,
        results: &[ChoiceResult],
        choice: impl Fn(usize, &ChoiceResult, Option<Finish>) -> C,
    ) -> Completion<C> {
        let choices = results.iter().enumerate();
        Completion {
            id: self.id.clone(),
            object: self.object(false),
            created: self.created,
            model: self.model.clone(),
            choices: (choices.map(|(i, r)| choice(i, r, r.summary.as_ref().map(finish_reason))))
                .collect(),
            usage: self.usage(results),
            routing: self.routing(results.iter().filter_map(|r| r.summary.as_ref())),
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.api, chunk) {
            (Api::Chat, false) => "chat.completion",
            (Api::Chat, true) => "chat.completion.chunk",
            _ => "text_completion",
        }
    }

    /// SGLang's `/generate` body: text so far, output ids, and `meta_info`.
    fn generate_body(&self, r: &ChoiceResult, done: bool) -> GenerateResponse {
        let finish = r.summary.as_ref().filter(|_| done).map(|s| match &s.stop {
            Some(stop) => GenerateFinish::Stop {
                matched: Some(Matched::Text(stop.clone())),
            },
            None if s.finish == FinishReason::Stop => GenerateFinish::Stop {
                matched: r.tokens.last().map(|t| Matched::Token(t.0)),
            },
            None => GenerateFinish::Length {
                length: s.completion_tokens,
            },
        });
        GenerateResponse {
            text: r.text.clone(),
            output_ids: r.tokens.iter().map(|t| t.0).collect(),
            meta_info: MetaInfo {
                id: self.id.clone(),
                prompt_tokens: r.prompt_tokens,
                completion_tokens: r.tokens.len(),
                finish_reason: finish,
                e2e_latency: r.summary.as_ref().map(|s| s.e2e.as_secs_f64()),
                routing: r.summary.as_ref().map(|s| self.routing(std::iter::once(s))),
            },
        }
    }

    /// A chunk of the OpenAI stream: choice `i`'s `delta` (a chat role or text; `None`: the
    /// end, with its reason), or with no choice, the usage.
    fn chunk(
        &self,
        choice: Option<(usize, Delta, Option<Finish>)>,
        usage: Option<Usage>,
        routing: Option<ChunkRouting>,
    ) -> Bytes {
        let choices = choice.into_iter();
        match self.api {
            Api::Chat => self.chunk_of(
                choices
                    .map(|(index, delta, finish_reason)| ChatChunkChoice {
                        index,
                        delta,
                        logprobs: None,
                        finish_reason,
                    })
                    .collect(),
                usage,
                routing,
            ),
            _ => self.chunk_of(
                choices
                    .map(|(index, delta, finish_reason)| TextChunkChoice {
                        index,
                        text: delta.content.unwrap_or_default(),
                        logprobs: None,
                        finish_reason,
                    })
                    .collect(),
                usage,
                routing,
            ),
        }
    }

    fn chunk_of<C: Serialize>(
        &self,
        choices: Vec<C>,
        usage: Option<Usage>,
        routing: Option<ChunkRouting>,
    ) -> Bytes {
        sse(&Chunk {
            id: self.id.clone(),
            object: self.object(true),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
            routing,
        })
    }

    /// Answers with an SSE stream once every choice is admitted (so a bad request still gets
    /// its 4xx status).
    pub async fn stream(self, mut choices: Choices) -> Result<HttpResponse, ApiError> {
        let mut results = vec![ChoiceResult::default(); choices.n];
        choices.admitted(&mut results).await?;
        let mut first = Vec::new();
        if self.api == Api::Chat {
            for i in 0..choices.n {
                let delta = Delta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                };
                first.extend_from_slice(&self.chunk(Some((i, delta, None)), None, None));
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
                    let models = tokens.iter().map(|t| r.names[t.1].clone()).collect();
                    res.tokens.extend(tokens);
                    if text.is_empty() {
                        continue;
                    }
                    return Some(match r.api {
                        Api::Generate => sse(&r.generate_body(res, false)),
                        _ => {
                            let delta = Delta {
                                role: None,
                                content: Some(text),
                            };
                            r.chunk(
                                Some((i, delta, None)),
                                None,
                                Some(ChunkRouting::Tokens { models }),
                            )
                        }
                    });
                }
                RequestEvent::Finished(s) => {
                    self.open -= 1;
                    let routing = r.routing(std::iter::once(&s));
                    let reason = finish_reason(&s);
                    self.results[i].summary = Some(s);
                    return Some(match r.api {
                        Api::Generate => sse(&r.generate_body(&self.results[i], true)),
                        _ => r.chunk(
                            Some((i, Delta::default(), Some(reason))),
                            None,
                            Some(ChunkRouting::Outcome(routing)),
                        ),
                    });
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
            tail.extend_from_slice(&r.chunk(None, Some(r.usage(&self.results)), None));
        }
        tail.extend_from_slice(b"data: [DONE]\n\n");
        Some(Bytes::from(tail))
    }
}
