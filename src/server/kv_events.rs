//! KV-cache events: the prefixes one model's cache stores and removes, streamed to a gateway
//! that keeps an exact index of every server's cache (`GET /cache/events`), and the
//! vocabulary the gateway tokenizes requests with to look them up (`GET /cache/vocabulary`).
//!
//! A stream opens with a snapshot (every prefix held, the sequence number it is at, and this
//! server process's instance id, new at every start), then sends each published change as a
//! `stored` or `removed` event of chained block hashes numbered on from the snapshot, one
//! number per hash. A subscriber that fell further behind than the published changes kept gets
//! a new snapshot in the same stream; one that sees a gap in the numbers reconnects.

use std::sync::Arc;
use std::time::Duration;

use actix_web::web::{self, Bytes};
use actix_web::HttpResponse;
use serde::{Deserialize, Serialize};

use super::error::ApiError;
use super::AppState;
use crate::actors::remote::vocabulary::WireVocabulary;
use crate::scheduler::{PrefixChange, PrefixHash, PublishedPrefixes};

/// One event of the stream, as its `data`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum KvStreamEvent {
    /// Everything the model's prefix cache holds, as of change number `seq`.
    Snapshot {
        /// This server process; a new one after every restart.
        instance: String,
        model: String,
        /// Tokens per block: the hashes chain this many tokens each.
        block_size: usize,
        /// Blocks the cache holds at most (0: not known, a remote model's).
        #[serde(default)]
        capacity: usize,
        /// The hash of a fixed block: a subscriber whose own differs hashes blocks otherwise
        /// and cannot look its requests up in these hashes.
        #[serde(default)]
        hash_check: u64,
        seq: u64,
        hashes: Vec<PrefixHash>,
    },
    /// Prefixes stored, numbered `seq`, `seq + 1`, ...
    Stored { seq: u64, hashes: Vec<PrefixHash> },
    /// Prefixes removed (evicted), numbered `seq`, `seq + 1`, ...
    Removed { seq: u64, hashes: Vec<PrefixHash> },
}

impl KvStreamEvent {
    fn name(&self) -> &'static str {
        match self {
            Self::Snapshot { .. } => "snapshot",
            Self::Stored { .. } => "stored",
            Self::Removed { .. } => "removed",
        }
    }

    /// The event as server-sent-event text.
    pub fn to_sse(&self) -> String {
        let data = serde_json::to_string(self).expect("events serialize");
        format!("event: {}\ndata: {data}\n\n", self.name())
    }
}

/// Published changes as events: each run of stores or removals becomes one event.
pub fn change_events(changes: &[(u64, PrefixChange)]) -> Vec<KvStreamEvent> {
    let mut out: Vec<KvStreamEvent> = Vec::new();
    for &(seq, change) in changes {
        let (hash, stored) = match change {
            PrefixChange::Added(h) => (h, true),
            PrefixChange::Removed(h) => (h, false),
        };
        match out.last_mut() {
            Some(KvStreamEvent::Stored { hashes, .. }) if stored => hashes.push(hash),
            Some(KvStreamEvent::Removed { hashes, .. }) if !stored => hashes.push(hash),
            _ => out.push(if stored {
                KvStreamEvent::Stored {
                    seq,
                    hashes: vec![hash],
                }
            } else {
                KvStreamEvent::Removed {
                    seq,
                    hashes: vec![hash],
                }
            }),
        }
    }
    out
}

/// How long a quiet stream waits before a comment line keeps the connection alive.
const KEEPALIVE: Duration = Duration::from_secs(10);

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(super) struct EventsQuery {
    /// The model whose cache to follow (default: the one that computes prompts first).
    model: Option<String>,
}

/// Where one stream stands.
struct Follower {
    prefixes: Arc<PublishedPrefixes>,
    published: tokio::sync::watch::Receiver<u64>,
    /// The server's shutdown: the stream ends.
    stopping: tokio::sync::watch::Receiver<bool>,
    /// The change number sent last; `None` until a snapshot went out.
    seq: Option<u64>,
    instance: String,
    model: String,
    block_size: usize,
    capacity: usize,
}

impl Follower {
    /// The next piece of the stream: a snapshot, the changes since the last piece, or a
    /// keep-alive comment after a quiet while; `None` when the server stops.
    async fn next(mut self) -> Option<(Result<Bytes, actix_web::Error>, Self)> {
        loop {
            if *self.stopping.borrow() {
                return None;
            }
            self.published.borrow_and_update();
            let Some(seq) = self.seq else {
                let (seq, hashes) = self.prefixes.snapshot();
                self.seq = Some(seq);
                let snapshot = KvStreamEvent::Snapshot {
                    instance: self.instance.clone(),
                    model: self.model.clone(),
                    block_size: self.block_size,
                    capacity: self.capacity,
                    hash_check: crate::scheduler::hash_check(),
                    seq,
                    hashes,
                };
                return Some((Ok(Bytes::from(snapshot.to_sse())), self));
            };
            match self.prefixes.changes_since(seq) {
                None => self.seq = None,
                Some(changes) if !changes.is_empty() => {
                    self.seq = changes.last().map(|c| c.0);
                    let text: String = change_events(&changes)
                        .iter()
                        .map(KvStreamEvent::to_sse)
                        .collect();
                    return Some((Ok(Bytes::from(text)), self));
                }
                Some(_) => {
                    let published = tokio::time::timeout(KEEPALIVE, self.published.changed());
                    tokio::select! {
                        changed = published => match changed {
                            Ok(Ok(())) => {}
                            Ok(Err(_)) => return None,
                            Err(_) => {
                                let keepalive = Bytes::from_static(b": keepalive\n\n");
                                return Some((Ok(keepalive), self));
                            }
                        },
                        _ = self.stopping.changed() => return None,
                    }
                }
            }
        }
    }
}

/// The KV-cache events of one model: a snapshot, then every change as it is published.
#[utoipa::path(
    get,
    path = "/cache/events",
    params(EventsQuery),
    responses((status = 200, description = "Server-sent events; each `data` is one event.",
        content_type = "text/event-stream", body = KvStreamEvent))
)]
pub(super) async fn cache_events(
    state: web::Data<AppState>,
    req: actix_web::HttpRequest,
) -> Result<HttpResponse, ApiError> {
    let query = web::Query::<EventsQuery>::from_query(req.query_string())
        .map_err(|e| ApiError::invalid("model", format!("model: {e}")))?;
    let runtime = &state.runtime;
    let model = match &query.model {
        None => runtime.router.first_model(&[]),
        Some(name) => (runtime.model_names.iter().position(|n| n == name)).ok_or_else(|| {
            let names = runtime.model_names.join(", ");
            ApiError::invalid(
                "model",
                format!("model: no model '{name}' (serving {names})"),
            )
        })?,
    };
    let prefixes = runtime.prefixes[model].clone();
    let follower = Follower {
        published: prefixes.subscribe(),
        stopping: state.stopping.subscribe(),
        prefixes,
        seq: None,
        instance: state.instance.clone(),
        model: runtime.model_names[model].clone(),
        block_size: runtime.block_size,
        capacity: (state.kv.get(model))
            .and_then(|k| k.as_ref())
            .map_or(0, |k| k.blocks),
    };
    Ok(HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header(("Cache-Control", "no-cache"))
        .streaming(futures_util::stream::unfold(follower, Follower::next)))
}

/// The tokenizer and chat template requests are read with, for a gateway to tokenize alike.
#[utoipa::path(
    get,
    path = "/cache/vocabulary",
    responses((status = 200, description = "The tokenizer (its JSON) and the chat template.",
        body = Object))
)]
pub(super) async fn cache_vocabulary(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let wire = WireVocabulary::of(&state.runtime.lead).map_err(|e| {
        let message = format!("the vocabulary does not serialize: {e}");
        ApiError::new(actix_web::http::StatusCode::INTERNAL_SERVER_ERROR, message)
    })?;
    Ok(HttpResponse::Ok().json(wire))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_changes_become_numbered_events() {
        use PrefixChange::{Added, Removed};
        let changes = [(5, Added(1)), (6, Added(2)), (7, Removed(1)), (8, Added(3))];
        let events = change_events(&changes);
        assert_eq!(
            events,
            [
                KvStreamEvent::Stored {
                    seq: 5,
                    hashes: vec![1, 2]
                },
                KvStreamEvent::Removed {
                    seq: 7,
                    hashes: vec![1]
                },
                KvStreamEvent::Stored {
                    seq: 8,
                    hashes: vec![3]
                },
            ]
        );
        let text = events[1].to_sse();
        assert_eq!(
            text,
            "event: removed\ndata: {\"type\":\"removed\",\"seq\":7,\"hashes\":[1]}\n\n"
        );
    }
}
