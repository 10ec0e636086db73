//! What crosses between actors. Between processes the same messages travel as frames
//! (`remote::protocol`); they carry no actor addresses except the request's event sink, which
//! a link replaces by the request's id.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;

use actix::Message;

use crate::model::runner::FinishReason;
use crate::model::{Distribution, SamplingParams};
use crate::routing::{Candidate, ModelIndex, Speculation};
use crate::scheduler::RequestId;

/// Where a request's token events go (its request actor). `send` returns false once nobody
/// listens any more, so the model actor can drop the request.
pub trait EventSink: Send + Sync {
    fn send(&self, event: TokenEvent) -> bool;
}

/// A request's fixed facts, shared by every model that serves it.
pub struct RequestMeta {
    pub id: RequestId,
    pub prompt_len: usize,
    pub params: SamplingParams,
    /// Output tokens at most (already capped by the context).
    pub max_tokens: usize,
    /// Token ids that end generation (empty with `ignore_eos`).
    pub stop_ids: Vec<u32>,
    /// The model that admitted the request; it alone counts the request as active.
    pub home: ModelIndex,
    pub sink: Arc<dyn EventSink>,
}

/// From a model actor to the request actor.
#[derive(Debug, Clone, PartialEq, Message, serde::Serialize, serde::Deserialize)]
#[rtype(result = "()")]
pub enum TokenEvent {
    /// `model` committed `token`.
    Token {
        token: u32,
        model: ModelIndex,
    },
    /// The request moved from one model to another.
    Moved {
        from: ModelIndex,
        to: ModelIndex,
    },
    /// `model` verified `drafted` drafted tokens and accepted the first `accepted` of them
    /// (speculative decoding; the accepted ones come as `Token` events).
    Verified {
        model: ModelIndex,
        drafted: usize,
        accepted: usize,
    },
    /// The model ended the request (end-of-sequence token, max tokens or context length).
    Finished {
        reason: FinishReason,
    },
    Failed {
        message: String,
    },
}

/// A new request for its first model: the whole prompt is prefilled there.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Submit {
    pub meta: Arc<RequestMeta>,
    pub prompt: Vec<u32>,
}

/// The request ended, whoever ended it (a model's stop or failure, a stop string, a
/// cancellation, its listener gone): every model drops its state. The request actor sends one
/// to each model for every request it submitted, and nothing else tells models of an end.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct Abort {
    pub id: RequestId,
}

/// Requests that ended lately, so that a message still in flight for one (a handoff that an
/// abort overtook) is dropped instead of bringing it back. The oldest are forgotten past
/// `capacity`.
pub struct Tombstones {
    ended: HashSet<RequestId>,
    order: VecDeque<RequestId>,
    capacity: usize,
}

impl Tombstones {
    pub fn new(capacity: usize) -> Self {
        Self {
            ended: HashSet::new(),
            order: VecDeque::new(),
            capacity,
        }
    }

    pub fn insert(&mut self, id: RequestId) {
        if self.ended.insert(id) {
            self.order.push_back(id);
            if self.order.len() > self.capacity {
                let old = self.order.pop_front().expect("not empty");
                self.ended.remove(&old);
            }
        }
    }

    pub fn contains(&self, id: &RequestId) -> bool {
        self.ended.contains(id)
    }
}

/// A request moving to a peer with every committed token; the peer extends (or, on a first
/// visit, prefills) what it does not hold yet, and takes back what it holds beyond them
/// (drafts it made that were rejected).
#[derive(Clone)]
pub struct Handoff {
    pub meta: Arc<RequestMeta>,
    /// Committed tokens, then the drafts.
    pub tokens: Vec<u32>,
    /// The best proposal for the next position so far, when the request is passed on
    /// without committing it (ensembles).
    pub carried: Option<Candidate>,
    /// How many of the last `tokens` are drafts for the peer to verify (speculative
    /// decoding).
    pub drafts: usize,
    /// The distributions the drafts were drawn from (sampling with temperature > 0 only).
    pub dists: Vec<Distribution>,
    /// The request's speculative decoding so far.
    pub speculation: Speculation,
}

pub enum PeerBody {
    Handoff(Handoff),
    /// Lock-step mode: the sender finished this round.
    RoundDone(u64),
    /// Nothing but the counter below.
    Counters,
}

/// Model actor to model actor. Every message carries the admissions minus completions the
/// sender counted since its last message to this peer, so each actor keeps an estimate of the
/// requests active system-wide without a coordinator.
#[derive(Message)]
#[rtype(result = "()")]
pub struct PeerMessage {
    pub from: ModelIndex,
    /// The addressee: what a link to another process forwards by.
    pub to: ModelIndex,
    pub active_delta: i64,
    /// The sender's current estimate of its routing probability (online thresholds only).
    pub route_prob: Option<f64>,
    pub body: PeerBody,
}

/// A link's counters as reported (with a model's, for `/metrics` and `bench`).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LinkStats {
    pub up: bool,
    pub frames_in: u64,
    pub frames_out: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// The last heartbeat's round trip, in µs.
    pub rtt_us: u64,
    pub reconnects: u64,
}
