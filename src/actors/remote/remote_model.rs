//! The front server's stand-in for a model hosted by a subserver: it takes the messages a
//! model actor takes and sends them as frames, and delivers what comes back (token events to
//! request actors, handoffs and counters to this side's models). It remembers every request it
//! carried until that request's abort, so that when the link is lost each of them fails at
//! once with an error naming the model; it then reconnects with backoff, and new requests fail
//! until it is back.
//!
//! It also keeps the peers' shared counts whole across a loss: what the lost session had
//! counted into the active-request estimates is taken back, what this side's models had told
//! it is told again to the next session, and, in lock-step, it finishes the absent model's
//! rounds so that the others do not wait for it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::{
    Actor, ActorFutureExt, AsyncContext, Context, Handler, Recipient, ResponseFuture, WrapFuture,
};
use tokio::sync::oneshot;
use tokio_util::codec::Framed;

use super::codec::{Codec, LinkCounters};
use super::connection::{Connection, Incoming, HEARTBEAT, LINK_TIMEOUT};
use super::handshake::{dial, Hello, LinkAuth, RemoteFacts};
use super::protocol::{Bounds, Frame, WirePeer};
use super::tls::Io;
use crate::actors::messages::{
    Abort, PeerBody, PeerMessage, RequestMeta, Submit, TokenEvent, Tombstones,
};
use crate::actors::model_actor::{GetStats, Wire};
use crate::actors::worker::WorkerStats;
use crate::routing::{ModelFacts, ModelIndex};
use crate::scheduler::RequestId;

const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// How long a counters request waits for the subserver's answer.
const STATS_TIMEOUT: Duration = Duration::from_secs(2);
/// Aborted requests remembered, so that a handoff an abort overtook is not carried again.
const TOMBSTONES: usize = 8192;

/// A link opened (on the link runtime, [`super::link_runtime`]) before its actor started.
pub type Handover = Framed<Io, Codec<Frame>>;

/// What the front needs to open (and reopen) the link to one subserver.
pub struct RemoteSpec {
    pub index: ModelIndex,
    pub name: String,
    pub addr: String,
    pub auth: LinkAuth,
    pub hello: Hello,
    /// Every model's facts, as the handshake's last message gives them.
    pub facts: Vec<ModelFacts>,
    /// The subserver's model, as first seen: a subserver that comes back with another is
    /// not taken.
    pub expected: RemoteFacts,
    pub bounds: Bounds,
}

pub struct RemoteModel {
    spec: Arc<RemoteSpec>,
    /// Whether the link is up.
    up: Arc<AtomicBool>,
    /// Whether the link is up and the subserver's model has not failed.
    health: Arc<AtomicBool>,
    peers: Vec<Option<Recipient<PeerMessage>>>,
    /// Requests sent to the subserver and not aborted yet, with their event sinks.
    requests: HashMap<RequestId, Arc<RequestMeta>>,
    aborted: Tombstones,
    /// Active-request deltas this side's models sent the remote one, by sender, summed since
    /// the start: a new session starts from zero and is told the sums.
    told: Vec<i64>,
    /// Deltas the current session sent, by addressee: taken back when it is lost.
    heard: Vec<i64>,
    /// Lock-step: the last round each model said it finished, told to a new session.
    rounds: Vec<u64>,
    link: Option<Connection>,
    /// The first link, opened while the runtime started.
    opened: Option<Handover>,
    /// Links opened so far (the first included).
    generation: u64,
    counters: Arc<LinkCounters>,
    stats: HashMap<u64, oneshot::Sender<WorkerStats>>,
    next_stats: u64,
    backoff: Duration,
}

impl RemoteModel {
    /// `opened`: the link the runtime opened.
    /// `up` and `health`: flags this actor keeps (see the fields).
    pub fn new(
        spec: RemoteSpec,
        opened: Handover,
        up: Arc<AtomicBool>,
        health: Arc<AtomicBool>,
    ) -> Self {
        Self {
            spec: Arc::new(spec),
            up,
            health,
            peers: Vec::new(),
            requests: HashMap::new(),
            aborted: Tombstones::new(TOMBSTONES),
            told: Vec::new(),
            heard: Vec::new(),
            rounds: Vec::new(),
            link: None,
            opened: Some(opened),
            generation: 0,
            counters: Arc::default(),
            stats: HashMap::new(),
            next_stats: 0,
            backoff: FIRST_BACKOFF,
        }
    }

    fn attach(&mut self, link: Handover, ctx: &mut Context<Self>) {
        self.generation += 1;
        let link = Connection::open(
            link,
            self.spec.addr.clone(),
            self.generation,
            ctx.address().recipient(),
            self.counters.clone(),
            LINK_TIMEOUT,
        );
        // The first round trip is known at once, not a heartbeat later.
        link.ping();
        // The session starts from zero: it learns where this side's models stand.
        for from in (0..self.told.len()).filter(|&i| i != self.spec.index) {
            let delta = self.told[from];
            if let Some(body) = standing(delta, self.rounds[from]) {
                link.send(Frame::Peer(WirePeer::of(PeerMessage {
                    from,
                    to: self.spec.index,
                    active_delta: delta,
                    route_prob: None,
                    body,
                })));
            }
        }
        self.link = Some(link);
        // A new session is a new model actor.
        self.up.store(true, Ordering::Release);
        self.health.store(true, Ordering::Release);
        self.backoff = FIRST_BACKOFF;
    }

    fn unavailable(&self, why: &str) -> TokenEvent {
        TokenEvent::Failed {
            message: format!(
                "model '{}' is unavailable: {why} (its subserver at {})",
                self.spec.name, self.spec.addr
            ),
        }
    }

    /// The link failed: every request it carried fails, and reconnecting starts.
    fn lost(&mut self, reason: &str, ctx: &mut Context<Self>) {
        if self.link.take().is_none() {
            return;
        }
        self.up.store(false, Ordering::Release);
        self.health.store(false, Ordering::Release);
        tracing::error!(model = %self.spec.name, addr = %self.spec.addr, requests = self.requests.len(),
            "link to the subserver lost: {reason}");
        let event = self.unavailable(&format!("the link was lost: {reason}"));
        for (_, meta) in self.requests.drain() {
            meta.sink.send(event.clone());
        }
        // The requests the session counted as active have failed, and nothing else will
        // count them out; in lock-step, the rounds its peers wait for are finished for it.
        for to in (0..self.heard.len()).filter(|&i| i != self.spec.index) {
            let delta = std::mem::take(&mut self.heard[to]);
            if let Some(body) = standing(-delta, self.rounds[to]) {
                self.answer(to, -delta, body);
            }
        }
        self.stats.clear();
        self.reconnect(ctx);
    }

    fn reconnect(&mut self, ctx: &mut Context<Self>) {
        let delay = self.backoff;
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        let spec = self.spec.clone();
        ctx.run_later(delay, move |act, ctx| {
            let opening = async move {
                let greeted = dial(&spec.addr, &spec.auth, &spec.hello)
                    .await
                    .map_err(|e| e.to_string())?;
                if greeted.welcome.facts != spec.expected {
                    return Err(format!(
                        "it now hosts a different model ({:?}, expected {:?})",
                        greeted.welcome.facts, spec.expected
                    ));
                }
                greeted
                    .start(spec.facts.clone())
                    .await
                    .map_err(|e| e.to_string())
            };
            ctx.spawn(opening.into_actor(act).map(
                |opened, act: &mut Self, ctx| match opened {
                    Ok(link) => {
                        tracing::info!(model = %act.spec.name, addr = %act.spec.addr, "link to the subserver open again");
                        act.attach(link, ctx);
                    }
                    Err(e) => {
                        tracing::warn!(model = %act.spec.name, addr = %act.spec.addr, "reconnecting failed: {e}");
                        act.reconnect(ctx);
                    }
                },
            ));
        });
    }

    /// A message to this side's model `to`, as if from the remote model.
    fn answer(&self, to: ModelIndex, active_delta: i64, body: PeerBody) {
        if let Some(Some(peer)) = self.peers.get(to) {
            peer.do_send(PeerMessage {
                from: self.spec.index,
                to,
                active_delta,
                route_prob: None,
                body,
            });
        }
    }

    fn deliver(&mut self, frame: Frame, ctx: &mut Context<Self>) {
        if let Err(e) = frame.validate(self.spec.bounds) {
            return self.lost(&format!("malformed frame: {e}"), ctx);
        }
        match frame {
            Frame::Event { id, event } => {
                if let Some(meta) = self.requests.get(&id) {
                    meta.sink.send(event);
                }
            }
            Frame::Peer(p) if p.from != self.spec.index || p.to == self.spec.index => self.lost(
                &format!(
                    "malformed frame: a message from model {} to model {}",
                    p.from, p.to
                ),
                ctx,
            ),
            Frame::Peer(p) => {
                let to = p.to;
                if let Some(heard) = self.heard.get_mut(to) {
                    *heard += p.active_delta;
                }
                let requests = &self.requests;
                let msg = p.into_message(|w| requests.get(&w.id).cloned());
                if let Some(Some(peer)) = self.peers.get(to).filter(|_| to != self.spec.index) {
                    peer.do_send(msg);
                }
            }
            Frame::Stats(seq, stats) => {
                if let Some(reply) = self.stats.remove(&seq) {
                    let _ = reply.send(stats);
                }
            }
            Frame::Unhealthy => {
                tracing::error!(model = %self.spec.name, addr = %self.spec.addr, "the subserver's model failed");
                self.health.store(false, Ordering::Release);
            }
            Frame::Ping(_) | Frame::Pong(_) => {}
            Frame::Submit { .. } | Frame::Abort(_) | Frame::StatsRequest(_) => {
                self.lost("the subserver sent a frame only a front sends", ctx)
            }
        }
    }
}

/// What carries an active-request `delta` and, in lock-step, the last `round` finished (past
/// round 0) to a peer; `None` when there is neither to tell.
fn standing(delta: i64, round: u64) -> Option<PeerBody> {
    match (delta, round) {
        (0, 0) => None,
        (_, 0) => Some(PeerBody::Counters),
        (_, round) => Some(PeerBody::RoundDone(round)),
    }
}

impl Actor for RemoteModel {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        match self.opened.take() {
            Some(link) => self.attach(link, ctx),
            None => self.reconnect(ctx),
        }
        ctx.run_interval(HEARTBEAT, |act, ctx| match &act.link {
            Some(link) if link.silent() => act.lost("no frame for 3 s", ctx),
            Some(link) => link.ping(),
            None => {}
        });
    }
}

impl Handler<Wire> for RemoteModel {
    type Result = ();
    fn handle(&mut self, msg: Wire, _: &mut Context<Self>) {
        self.peers = msg.0.into_iter().map(Some).collect();
        let n = self.peers.len();
        (self.told, self.heard, self.rounds) = (vec![0; n], vec![0; n], vec![0; n]);
    }
}

impl Handler<Incoming> for RemoteModel {
    type Result = ();
    fn handle(&mut self, msg: Incoming, ctx: &mut Context<Self>) {
        if self.link.as_ref().map(|l| l.generation) != Some(msg.generation) {
            return;
        }
        match msg.frame {
            Ok(frame) => {
                self.deliver(frame, ctx);
            }
            Err(reason) => self.lost(&reason, ctx),
        }
    }
}

impl Handler<Submit> for RemoteModel {
    type Result = ();
    fn handle(&mut self, msg: Submit, _: &mut Context<Self>) {
        let Some(link) = &self.link else {
            msg.meta.sink.send(self.unavailable("not connected"));
            return;
        };
        link.send(msg.to_frame());
        self.requests.insert(msg.meta.id, msg.meta);
    }
}

impl Handler<PeerMessage> for RemoteModel {
    type Result = ();
    fn handle(&mut self, msg: PeerMessage, _: &mut Context<Self>) {
        if let Some(told) = self.told.get_mut(msg.from) {
            *told += msg.active_delta;
        }
        let meta = match &msg.body {
            PeerBody::Handoff(h) if !self.aborted.contains(&h.meta.id) => Some(h.meta.clone()),
            PeerBody::Handoff(_) | PeerBody::Counters => None,
            PeerBody::RoundDone(round) => {
                if let Some(r) = self.rounds.get_mut(msg.from) {
                    *r = (*r).max(*round);
                }
                None
            }
        };
        let Some(link) = &self.link else {
            if let Some(meta) = meta {
                meta.sink.send(self.unavailable("not connected"));
            } else if let PeerBody::RoundDone(round) = msg.body {
                // The absent model takes part in no round: its peers do not wait for it.
                self.answer(msg.from, 0, PeerBody::RoundDone(round));
            }
            return;
        };
        link.send(Frame::Peer(WirePeer::of(msg)));
        if let Some(meta) = meta {
            self.requests.insert(meta.id, meta);
        }
    }
}

impl Handler<Abort> for RemoteModel {
    type Result = ();
    fn handle(&mut self, msg: Abort, _: &mut Context<Self>) {
        self.requests.remove(&msg.id);
        self.aborted.insert(msg.id);
        if let Some(link) = &self.link {
            link.send(Frame::Abort(msg.id));
        }
    }
}

impl Handler<GetStats> for RemoteModel {
    type Result = ResponseFuture<WorkerStats>;
    fn handle(&mut self, _: GetStats, _: &mut Context<Self>) -> Self::Result {
        let link = Some(
            self.counters
                .snapshot(self.link.is_some(), self.generation.saturating_sub(1)),
        );
        let unknown = WorkerStats {
            name: self.spec.name.clone(),
            link: link.clone(),
            ..WorkerStats::default()
        };
        let Some(open) = &self.link else {
            return Box::pin(async move { unknown });
        };
        let (reply, answer) = oneshot::channel();
        self.next_stats += 1;
        self.stats.insert(self.next_stats, reply);
        open.send(Frame::StatsRequest(self.next_stats));
        Box::pin(async move {
            match tokio::time::timeout(STATS_TIMEOUT, answer).await {
                Ok(Ok(stats)) => WorkerStats { link, ..stats },
                _ => unknown,
            }
        })
    }
}
