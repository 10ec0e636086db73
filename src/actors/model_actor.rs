//! The model actor: delivers mailbox messages to its [`ModelWorker`] and schedules its steps.
//! It runs on its own arbiter thread, so forward passes block only this model; its mailbox is
//! drained between steps (actix polls the mailbox before self-notifications).

use std::time::Instant;

use actix::{Actor, AsyncContext, Context, Handler, Message, Recipient, SpawnHandle};

use super::messages::{Abort, PeerMessage, Submit};
use super::worker::{ModelWorker, WorkerStats};
use crate::scheduler::Launch;
use crate::tuning::online::{solve_point, OperatingPoint};

pub struct ModelActor {
    worker: ModelWorker,
    peers: Vec<Option<Recipient<PeerMessage>>>,
    step_queued: bool,
    timer: Option<(Instant, SpawnHandle)>,
}

/// Gives a model actor its peers, indexed by model (its own slot is ignored).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Wire(pub Vec<Recipient<PeerMessage>>);

#[derive(Message)]
#[rtype(result = "WorkerStats")]
pub struct GetStats;

#[derive(Message)]
#[rtype(result = "()")]
struct Step;

/// A threshold solution computed off the actor's thread.
#[derive(Message)]
#[rtype(result = "()")]
struct Solved {
    point: OperatingPoint,
    best: (usize, usize),
}

impl ModelActor {
    pub fn new(worker: ModelWorker) -> Self {
        Self {
            worker,
            peers: Vec::new(),
            step_queued: false,
            timer: None,
        }
    }

    /// Delivers queued peer messages, starts any threshold solve, and arranges the next step.
    fn settle(&mut self, ctx: &mut Context<Self>) {
        if let Some((point, profile)) = self.worker.retune() {
            // Solving takes up to a second; the actor keeps serving with its current threshold.
            let addr = ctx.address();
            std::thread::spawn(move || {
                let best = solve_point(&profile, point);
                addr.do_send(Solved { point, best });
            });
        }
        let now = Instant::now();
        let launch = self.worker.next_launch(now);
        for (to, msg) in self.worker.take_outbox(launch == Launch::Idle) {
            if let Some(Some(peer)) = self.peers.get(to) {
                peer.do_send(msg);
            }
        }
        if self.step_queued {
            return;
        }
        match launch {
            Launch::Idle => {}
            Launch::Now => {
                if let Some((_, handle)) = self.timer.take() {
                    ctx.cancel_future(handle);
                }
                self.step_queued = true;
                ctx.notify(Step);
            }
            Launch::At(at) => {
                if self.timer.as_ref().is_some_and(|(t, _)| *t <= at) {
                    return;
                }
                if let Some((_, handle)) = self.timer.take() {
                    ctx.cancel_future(handle);
                }
                let handle = ctx.notify_later(Step, at.saturating_duration_since(now));
                self.timer = Some((at, handle));
            }
        }
    }
}

impl Actor for ModelActor {
    type Context = Context<Self>;
}

impl Handler<Wire> for ModelActor {
    type Result = ();
    fn handle(&mut self, msg: Wire, _: &mut Context<Self>) {
        self.peers = msg.0.into_iter().map(Some).collect();
    }
}

impl Handler<Submit> for ModelActor {
    type Result = ();
    fn handle(&mut self, msg: Submit, ctx: &mut Context<Self>) {
        self.worker.submit(msg.meta, msg.prompt, Instant::now());
        self.settle(ctx);
    }
}

impl Handler<PeerMessage> for ModelActor {
    type Result = ();
    fn handle(&mut self, msg: PeerMessage, ctx: &mut Context<Self>) {
        self.worker.peer_message(msg, Instant::now());
        self.settle(ctx);
    }
}

impl Handler<Abort> for ModelActor {
    type Result = ();
    fn handle(&mut self, msg: Abort, ctx: &mut Context<Self>) {
        self.worker.abort(msg.id);
        self.settle(ctx);
    }
}

impl Handler<Step> for ModelActor {
    type Result = ();
    fn handle(&mut self, _: Step, ctx: &mut Context<Self>) {
        self.step_queued = false;
        if self
            .timer
            .as_ref()
            .is_some_and(|(t, _)| *t <= Instant::now())
        {
            self.timer = None;
        }
        let _span = tracing::debug_span!("step", model = self.worker.name()).entered();
        self.worker.step(Instant::now());
        self.settle(ctx);
    }
}

impl Handler<Solved> for ModelActor {
    type Result = ();
    fn handle(&mut self, msg: Solved, ctx: &mut Context<Self>) {
        tracing::info!(model = self.worker.name(), point = ?msg.point, best = ?msg.best, "thresholds re-solved");
        self.worker.solved(msg.point, msg.best);
        self.settle(ctx);
    }
}

impl Handler<GetStats> for ModelActor {
    type Result = actix::MessageResult<GetStats>;
    fn handle(&mut self, _: GetStats, _: &mut Context<Self>) -> Self::Result {
        actix::MessageResult(self.worker.stats())
    }
}
