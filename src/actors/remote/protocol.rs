//! The inter-actor protocol's frames: the in-process messages in a form that crosses a
//! socket (the event sink replaced by the request's id), framed by [`super::codec`], and
//! checked on arrival so that a malformed frame closes its link instead of reaching a model.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::actors::messages::{
    EventSink, Handoff, PeerBody, PeerMessage, RequestMeta, Submit, TokenEvent,
};
use crate::actors::worker::WorkerStats;
use crate::model::{Distribution, SamplingParams};
use crate::routing::{Candidate, ModelIndex, Speculation};
use crate::scheduler::RequestId;

/// A session's frames, in both directions (the comment says which).
#[derive(Debug, Serialize, Deserialize)]
pub enum Frame {
    /// Front → subserver: a new request whose first model is the subserver's.
    Submit {
        meta: WireMeta,
        prompt: Vec<u32>,
    },
    /// Either way: a model's message to a peer.
    Peer(WirePeer),
    /// Front → subserver: the request ended.
    Abort(RequestId),
    /// Subserver → front: a token event for the request's actor.
    Event {
        id: RequestId,
        event: TokenEvent,
    },
    /// Front → subserver: report the model's counters, answering with the same number.
    StatsRequest(u64),
    /// Subserver → front: the counters asked for.
    Stats(u64, WorkerStats),
    /// Subserver → front: its model failed (a forward pass panicked); the link stays up, the
    /// front's `/health` names the model.
    Unhealthy,
    /// Either way, every heartbeat: the sender is alive; answered with `Pong` and the same
    /// number (the sender's clock), which gives the round-trip time.
    Ping(u64),
    Pong(u64),
}

/// A request's fixed facts without its event sink.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireMeta {
    pub id: RequestId,
    pub prompt_len: usize,
    pub params: SamplingParams,
    pub max_tokens: usize,
    pub stop_ids: Vec<u32>,
    pub home: ModelIndex,
}

impl WireMeta {
    pub fn of(meta: &RequestMeta) -> Self {
        Self {
            id: meta.id,
            prompt_len: meta.prompt_len,
            params: meta.params.clone(),
            max_tokens: meta.max_tokens,
            stop_ids: meta.stop_ids.clone(),
            home: meta.home,
        }
    }

    pub fn with_sink(self, sink: Arc<dyn EventSink>) -> RequestMeta {
        RequestMeta {
            id: self.id,
            prompt_len: self.prompt_len,
            params: self.params,
            max_tokens: self.max_tokens,
            stop_ids: self.stop_ids,
            home: self.home,
            sink,
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
pub struct WireHandoff {
    pub meta: WireMeta,
    pub tokens: Vec<u32>,
    pub carried: Option<Candidate>,
    pub drafts: usize,
    pub dists: Vec<Distribution>,
    pub speculation: Speculation,
}

#[derive(Debug, Serialize, Deserialize)]
pub enum WireBody {
    Handoff(WireHandoff),
    RoundDone(u64),
    Counters,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct WirePeer {
    pub from: ModelIndex,
    pub to: ModelIndex,
    pub active_delta: i64,
    pub route_prob: Option<f64>,
    pub body: WireBody,
}

impl WirePeer {
    pub fn of(msg: PeerMessage) -> Self {
        let body = match msg.body {
            PeerBody::Handoff(h) => WireBody::Handoff(WireHandoff {
                meta: WireMeta::of(&h.meta),
                tokens: h.tokens,
                carried: h.carried,
                drafts: h.drafts,
                dists: h.dists,
                speculation: h.speculation,
            }),
            PeerBody::RoundDone(r) => WireBody::RoundDone(r),
            PeerBody::Counters => WireBody::Counters,
        };
        Self {
            from: msg.from,
            to: msg.to,
            active_delta: msg.active_delta,
            route_prob: msg.route_prob,
            body,
        }
    }

    /// The message for the addressee; a handoff gets its request's facts from `meta`, and
    /// is dropped (the rest of the message kept) when `meta` has none for it.
    pub fn into_message(
        self,
        meta: impl FnOnce(WireMeta) -> Option<Arc<RequestMeta>>,
    ) -> PeerMessage {
        let body = match self.body {
            WireBody::Handoff(h) => match meta(h.meta) {
                Some(meta) => PeerBody::Handoff(Handoff {
                    meta,
                    tokens: h.tokens,
                    carried: h.carried,
                    drafts: h.drafts,
                    dists: h.dists,
                    speculation: h.speculation,
                }),
                None => PeerBody::Counters,
            },
            WireBody::RoundDone(r) => PeerBody::RoundDone(r),
            WireBody::Counters => PeerBody::Counters,
        };
        PeerMessage {
            from: self.from,
            to: self.to,
            active_delta: self.active_delta,
            route_prob: self.route_prob,
            body,
        }
    }
}

/// What the receiving side knows, to check a frame against before acting on it.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub num_models: usize,
    pub vocab_size: usize,
    /// The longest sequence a request may reach.
    pub max_len: usize,
}

impl Frame {
    /// Checks what in-process senders guarantee by construction: indices name models, token
    /// ids are in the vocabulary, counts fit what they count.
    pub fn validate(&self, b: Bounds) -> Result<(), String> {
        let model = |what: &str, i: ModelIndex| {
            (i < b.num_models)
                .then_some(())
                .ok_or_else(|| format!("{what} names model {i} of {}", b.num_models))
        };
        let tokens =
            |what: &str, ids: &[u32]| match ids.iter().find(|&&t| t as usize >= b.vocab_size) {
                Some(t) => Err(format!(
                    "{what}: token {t} is outside the vocabulary ({})",
                    b.vocab_size
                )),
                None if ids.len() > b.max_len => Err(format!(
                    "{what}: {} tokens exceed the longest sequence ({})",
                    ids.len(),
                    b.max_len
                )),
                None => Ok(()),
            };
        let meta = |m: &WireMeta| {
            model("home", m.home)?;
            tokens("stop ids", &m.stop_ids)?;
            (m.prompt_len > 0 && m.prompt_len <= b.max_len && m.max_tokens > 0)
                .then_some(())
                .ok_or_else(|| {
                    format!(
                        "request {}: prompt of {} tokens and {} output tokens",
                        m.id, m.prompt_len, m.max_tokens
                    )
                })?;
            m.params.validate().map_err(|e| e.to_string())
        };
        match self {
            Frame::Submit { meta: m, prompt } => {
                meta(m)?;
                tokens("prompt", prompt)?;
                (prompt.len() == m.prompt_len)
                    .then_some(())
                    .ok_or_else(|| "the prompt's length differs from its prompt_len".to_string())
            }
            Frame::Peer(p) => {
                model("from", p.from)?;
                model("to", p.to)?;
                let WireBody::Handoff(h) = &p.body else {
                    return Ok(());
                };
                meta(&h.meta)?;
                tokens("handoff", &h.tokens)?;
                if let Some(c) = &h.carried {
                    model("carried", c.model)?;
                    tokens("carried", &[c.token])?;
                }
                let committed = h.tokens.len().checked_sub(h.drafts);
                if committed.is_none_or(|c| c < h.meta.prompt_len) {
                    return Err(format!(
                        "handoff of {} tokens with {} drafts and a {}-token prompt",
                        h.tokens.len(),
                        h.drafts,
                        h.meta.prompt_len
                    ));
                }
                if !h.dists.is_empty() && h.dists.len() != h.drafts {
                    return Err(format!(
                        "{} distributions for {} drafts",
                        h.dists.len(),
                        h.drafts
                    ));
                }
                for d in &h.dists {
                    let ids: Vec<u32> = d.entries().iter().map(|&(t, _)| t).collect();
                    tokens("distribution", &ids)?;
                }
                Ok(())
            }
            Frame::Event { event, .. } => match event {
                TokenEvent::Token { token, model: m } => {
                    model("token", *m)?;
                    tokens("token", &[*token])
                }
                TokenEvent::Moved { from, to } => model("from", *from).and(model("to", *to)),
                TokenEvent::Verified {
                    model: m,
                    drafted,
                    accepted,
                } => {
                    model("verified", *m)?;
                    (*drafted <= crate::config::MAX_DRAFT_TOKENS && accepted <= drafted)
                        .then_some(())
                        .ok_or_else(|| format!("{accepted} of {drafted} drafts accepted"))
                }
                TokenEvent::Finished { .. } | TokenEvent::Failed { .. } => Ok(()),
            },
            Frame::Abort(_)
            | Frame::StatsRequest(_)
            | Frame::Stats(..)
            | Frame::Unhealthy
            | Frame::Ping(_)
            | Frame::Pong(_) => Ok(()),
        }
    }
}

impl Submit {
    /// The frame for a subserver.
    pub fn to_frame(&self) -> Frame {
        Frame::Submit {
            meta: WireMeta::of(&self.meta),
            prompt: self.prompt.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::BytesMut;
    use tokio_util::codec::{Decoder, Encoder};

    use super::*;
    use crate::actors::remote::codec::{Codec, ProtocolError};

    fn bounds() -> Bounds {
        Bounds {
            num_models: 2,
            vocab_size: 100,
            max_len: 64,
        }
    }

    fn meta(id: RequestId) -> WireMeta {
        WireMeta {
            id,
            prompt_len: 3,
            params: SamplingParams::greedy(),
            max_tokens: 8,
            stop_ids: vec![2],
            home: 0,
        }
    }

    fn handoff(tokens: Vec<u32>, drafts: usize) -> Frame {
        Frame::Peer(WirePeer {
            from: 0,
            to: 1,
            active_delta: 1,
            route_prob: None,
            body: WireBody::Handoff(WireHandoff {
                meta: meta(7),
                tokens,
                carried: None,
                drafts,
                dists: Vec::new(),
                speculation: Speculation::default(),
            }),
        })
    }

    fn round_trip(frame: Frame) -> Frame {
        let mut codec = Codec::<Frame>::default();
        let mut buf = BytesMut::new();
        codec.encode(frame, &mut buf).unwrap();
        let out = codec.decode(&mut buf).unwrap().unwrap();
        assert!(buf.is_empty());
        out
    }

    #[test]
    fn frames_survive_the_codec() {
        let Frame::Peer(p) = round_trip(handoff(vec![1, 2, 3, 4, 5], 1)) else {
            panic!("not a peer frame");
        };
        assert_eq!((p.from, p.to, p.active_delta), (0, 1, 1));
        let WireBody::Handoff(h) = p.body else {
            panic!("not a handoff");
        };
        assert_eq!((h.tokens, h.drafts, h.meta.id), (vec![1, 2, 3, 4, 5], 1, 7));
        let event = TokenEvent::Token { token: 9, model: 1 };
        match round_trip(Frame::Event {
            id: 3,
            event: event.clone(),
        }) {
            Frame::Event { id: 3, event: e } => assert_eq!(e, event),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_frame_split_across_reads_waits_for_its_end() {
        let mut codec = Codec::<Frame>::default();
        let mut whole = BytesMut::new();
        codec.encode(Frame::Abort(5), &mut whole).unwrap();
        codec.encode(Frame::Ping(9), &mut whole).unwrap();
        let mut buf = BytesMut::new();
        buf.extend_from_slice(&whole[..3]);
        assert!(codec.decode(&mut buf).unwrap().is_none());
        buf.extend_from_slice(&whole[3..]);
        assert!(matches!(
            codec.decode(&mut buf).unwrap(),
            Some(Frame::Abort(5))
        ));
        assert!(matches!(
            codec.decode(&mut buf).unwrap(),
            Some(Frame::Ping(9))
        ));
    }

    #[test]
    fn oversized_and_malformed_frames_are_errors() {
        let mut codec = Codec::<Frame>::default();
        // "GET " read as a length: an HTTP client, not a peer.
        let mut buf = BytesMut::from(&b"GET / HTTP/1.1\r\n\r\n"[..]);
        assert!(matches!(codec.decode(&mut buf), Err(ProtocolError::Io(_))));
        // A variant tag past the last one.
        let mut buf = BytesMut::from(&[0, 0, 0, 1, 200][..]);
        assert!(matches!(
            codec.decode(&mut buf),
            Err(ProtocolError::Decode(_))
        ));
        // A vector claiming more elements than any frame may hold.
        let mut buf = BytesMut::from(&[0, 0, 0, 6, 4, 7, 253, 0xff, 0xff, 0xff][..]);
        assert!(codec.decode(&mut buf).is_err());
        // A whole message followed by junk.
        let mut ok = BytesMut::new();
        Codec::<Frame>::default()
            .encode(Frame::Abort(1), &mut ok)
            .unwrap();
        let mut buf = BytesMut::new();
        buf.extend_from_slice(&[0, 0, 0, (ok.len() - 4 + 1) as u8]);
        buf.extend_from_slice(&ok[4..]);
        buf.extend_from_slice(&[0]);
        assert!(matches!(
            codec.decode(&mut buf),
            Err(ProtocolError::Trailing(1))
        ));
    }

    #[test]
    fn validation_names_what_is_wrong() {
        assert_eq!(handoff(vec![1, 2, 3, 4], 1).validate(bounds()), Ok(()));
        let err = |f: Frame| f.validate(bounds()).unwrap_err();
        assert!(err(handoff(vec![1, 2, 300], 0)).contains("token 300"));
        assert!(err(handoff(vec![1, 2, 3], 2)).contains("2 drafts"));
        assert!(err(handoff(vec![1, 2], 5)).contains("5 drafts"));
        assert!(err(handoff(vec![1; 65], 0)).contains("65 tokens"));
        let Frame::Peer(mut p) = handoff(vec![1, 2, 3], 0) else {
            unreachable!()
        };
        p.to = 2;
        assert!(err(Frame::Peer(p)).contains("names model 2"));
        let submit = Frame::Submit {
            meta: meta(1),
            prompt: vec![1, 2],
        };
        assert!(err(submit).contains("length"));
        let event = Frame::Event {
            id: 1,
            event: TokenEvent::Token { token: 1, model: 9 },
        };
        assert!(err(event).contains("model 9"));
        let verified = |drafted, accepted| Frame::Event {
            id: 1,
            event: TokenEvent::Verified {
                model: 1,
                drafted,
                accepted,
            },
        };
        assert_eq!(verified(4, 4).validate(bounds()), Ok(()));
        assert!(err(verified(4, 5)).contains("5 of 4"));
        assert!(err(verified(1000, 3)).contains("of 1000"));
    }
}
