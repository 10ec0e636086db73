//! A subserver's side of its link to the front server: it delivers the front's frames to the
//! hosted model's actor, as the front's model actors and request actors would send them in
//! one process, and sends back what that actor emits (its peer messages, and each request's
//! token events in place of the request's sink). The session (the model actor, its KV cache
//! and its device) lives as long as the link: when the link ends it stops, so nothing it held
//! outlives the front that asked for it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use actix::{
    Actor, ActorContext, ActorFutureExt, Addr, Arbiter, AsyncContext, Context, Handler, Message,
    Recipient, WrapFuture,
};
use tokio_util::codec::Framed;

use super::codec::Codec;
use super::connection::{Connection, Incoming, HEARTBEAT};
use super::handshake::SESSION_START_TIMEOUT;
use super::protocol::{Bounds, Frame, WirePeer};
use super::tls::Io;
use crate::actors::messages::{Abort, EventSink, PeerMessage, Submit, TokenEvent};
use crate::actors::model_actor::{GetStats, ModelActor};
use crate::routing::ModelIndex;
use crate::scheduler::RequestId;

/// A token event of a request the front owns.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Emit {
    pub id: RequestId,
    pub event: TokenEvent,
}

/// A request's sink on a subserver: its events go back over the link.
struct LinkSink {
    id: RequestId,
    front: Recipient<Emit>,
}

impl EventSink for LinkSink {
    fn send(&self, event: TokenEvent) -> bool {
        self.front.connected() && {
            self.front.do_send(Emit { id: self.id, event });
            true
        }
    }
}

/// A subserver taken by one front: released when dropped, whatever ends the session.
pub struct Claim(Arc<AtomicBool>);

impl Claim {
    /// Takes `busy`, unless another front holds it.
    pub fn take(busy: &Arc<AtomicBool>) -> Option<Self> {
        (!busy.swap(true, Ordering::AcqRel)).then(|| Self(busy.clone()))
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl Session {
    /// Stops the model actor and its device, and frees the subserver for another front.
    pub fn stop(&mut self) {
        for arbiter in self.arbiters.drain(..) {
            arbiter.stop();
            let _ = arbiter.join();
        }
        self.claim = None;
    }
}

/// The hosted model's session, as the link owns it.
pub struct Session {
    pub index: ModelIndex,
    pub model: Addr<ModelActor>,
    pub bounds: Bounds,
    /// The model actor's and its device's threads, stopped with the link.
    pub arbiters: Vec<Arbiter>,
    /// Released when the session ends, so that another front may connect.
    pub claim: Option<Claim>,
    /// Cleared when the model fails (a forward pass panicked).
    pub healthy: Arc<AtomicBool>,
}

pub struct FrontLink {
    session: Session,
    /// Whether the front has been told the model failed.
    told_unhealthy: bool,
    link: Option<Connection>,
    opened: Option<(Framed<Io, Codec<Frame>>, String)>,
}

impl FrontLink {
    /// Serves `link` to the front at `peer`.
    pub fn new(session: Session, link: Framed<Io, Codec<Frame>>, peer: String) -> Self {
        Self {
            session,
            told_unhealthy: false,
            link: None,
            opened: Some((link, peer)),
        }
    }

    fn close(&mut self, reason: &str, ctx: &mut Context<Self>) {
        if let Some(link) = self.link.take() {
            tracing::warn!(front = %link.peer, "link to the front server closed: {reason}");
        }
        ctx.stop();
    }

    fn sink(&self, id: RequestId, ctx: &Context<Self>) -> Arc<dyn EventSink> {
        Arc::new(LinkSink {
            id,
            front: ctx.address().recipient(),
        })
    }

    fn deliver(&mut self, frame: Frame, ctx: &mut Context<Self>) {
        if let Err(e) = frame.validate(self.session.bounds) {
            return self.close(&format!("malformed frame: {e}"), ctx);
        }
        let model = &self.session.model;
        match frame {
            Frame::Submit { meta, prompt } => {
                let sink = self.sink(meta.id, ctx);
                model.do_send(Submit {
                    meta: Arc::new(meta.with_sink(sink)),
                    prompt,
                });
            }
            Frame::Peer(p) if p.to == self.session.index && p.from != p.to => {
                let msg = p.into_message(|m| {
                    let sink = self.sink(m.id, ctx);
                    Some(Arc::new(m.with_sink(sink)))
                });
                self.session.model.do_send(msg);
            }
            Frame::Peer(p) => self.close(
                &format!(
                    "malformed frame: a message from model {} to model {} (this subserver hosts model {})",
                    p.from, p.to, self.session.index
                ),
                ctx,
            ),
            Frame::Abort(id) => model.do_send(Abort { id }),
            Frame::StatsRequest(seq) => {
                let asked = model.send(GetStats);
                ctx.spawn(asked.into_actor(self).map(move |stats, act, _| {
                    if let Some(link) = &act.link {
                        link.send(Frame::Stats(seq, stats.unwrap_or_default()));
                    }
                }));
            }
            Frame::Ping(_) | Frame::Pong(_) => {}
            Frame::Event { .. } | Frame::Stats(..) | Frame::Unhealthy => {
                self.close("the front sent a frame only a subserver sends", ctx)
            }
        }
    }
}

impl Actor for FrontLink {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let (link, peer) = self.opened.take().expect("opened once");
        let link = Connection::open(
            link,
            peer,
            1,
            ctx.address().recipient(),
            Arc::default(),
            SESSION_START_TIMEOUT,
        );
        tracing::info!(front = %link.peer, "serving a front server");
        self.link = Some(link);
        ctx.run_interval(HEARTBEAT, |act, ctx| match &act.link {
            Some(link) if link.silent() => act.close("the front server fell silent", ctx),
            Some(link) => {
                link.ping();
                if !act.told_unhealthy && !act.session.healthy.load(Ordering::Acquire) {
                    link.send(Frame::Unhealthy);
                    act.told_unhealthy = true;
                }
            }
            None => {}
        });
    }

    fn stopped(&mut self, _: &mut Context<Self>) {
        self.link = None;
        self.session.stop();
        tracing::info!(
            "session ended: its requests and KV cache are dropped; waiting for a front server"
        );
    }
}

impl Handler<Incoming> for FrontLink {
    type Result = ();
    fn handle(&mut self, msg: Incoming, ctx: &mut Context<Self>) {
        match msg.frame {
            Ok(frame) => {
                self.deliver(frame, ctx);
            }
            Err(reason) => self.close(&reason, ctx),
        }
    }
}

impl Handler<PeerMessage> for FrontLink {
    type Result = ();
    fn handle(&mut self, msg: PeerMessage, _: &mut Context<Self>) {
        if let Some(link) = &self.link {
            link.send(Frame::Peer(WirePeer::of(msg)));
        }
    }
}

impl Handler<Emit> for FrontLink {
    type Result = ();
    fn handle(&mut self, msg: Emit, _: &mut Context<Self>) {
        if let Some(link) = &self.link {
            link.send(Frame::Event {
                id: msg.id,
                event: msg.event,
            });
        }
    }
}
