//! The model actor: delivers mailbox messages to its [`ModelWorker`] and computes a step when
//! its device's executor grants one. It runs on its own arbiter thread and drains its mailbox
//! while it waits for a grant, so the batch it plans at grant time holds every request that
//! reached it meanwhile. Its handoffs leave before it reports the step's end, so a peer on the
//! same device has them in its mailbox before the executor can grant it a step.

use std::time::Instant;

use actix::{Actor, Addr, AsyncContext, Context, Handler, Message, Recipient};

use super::executor::{Ask, DeviceExecutor, Grant, StepDone};
use super::messages::{Abort, PeerMessage, Submit};
use super::worker::{ModelWorker, WorkerStats};
use crate::scheduler::StepAsk;
use crate::tuning::online::{solve_point, OperatingPoint};

/// A model's place on its device: the executor and its slot there, and the slot of every
/// model (by index) that shares the device.
#[derive(Clone)]
pub struct DeviceSeat {
    pub executor: Addr<DeviceExecutor>,
    pub slot: usize,
    pub peer_slots: Vec<Option<usize>>,
}

pub struct ModelActor {
    worker: ModelWorker,
    peers: Vec<Option<Recipient<PeerMessage>>>,
    seat: DeviceSeat,
    /// The ask the executor holds for this model (`None`: none, or a step granted and not yet
    /// reported).
    asked: Option<StepAsk>,
    /// When this model started waiting for the device.
    waiting_since: Option<Instant>,
}

/// A model as the rest of the runtime reaches it: its actor in this process, or the stand-in
/// for the subserver that hosts it.
#[derive(Clone)]
pub struct ModelAddr {
    pub submit: Recipient<Submit>,
    pub peer: Recipient<PeerMessage>,
    pub abort: Recipient<Abort>,
    pub stats: Recipient<GetStats>,
    pub wire: Recipient<Wire>,
}

impl ModelAddr {
    pub fn of<A>(addr: &Addr<A>) -> Self
    where
        A: Actor<Context = Context<A>>
            + Handler<Submit>
            + Handler<PeerMessage>
            + Handler<Abort>
            + Handler<GetStats>
            + Handler<Wire>,
    {
        Self {
            submit: addr.clone().recipient(),
            peer: addr.clone().recipient(),
            abort: addr.clone().recipient(),
            stats: addr.clone().recipient(),
            wire: addr.clone().recipient(),
        }
    }
}

/// Gives a model actor its peers, indexed by model (its own slot is ignored).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Wire(pub Vec<Recipient<PeerMessage>>);

#[derive(Message)]
#[rtype(result = "WorkerStats")]
pub struct GetStats;

/// A threshold solution computed off the actor's thread.
#[derive(Message)]
#[rtype(result = "()")]
struct Solved {
    point: OperatingPoint,
    best: (usize, usize),
}

impl ModelActor {
    pub fn new(worker: ModelWorker, seat: DeviceSeat) -> Self {
        Self {
            worker,
            peers: Vec::new(),
            seat,
            asked: None,
            waiting_since: None,
        }
    }

    /// Delivers queued peer messages, starts any threshold solve, runs any empty lock-step
    /// round, and keeps the executor's ask current.
    fn settle(&mut self, ctx: &mut Context<Self>) {
        let ask = self.catch_up(ctx);
        if ask.map(Key::of) != self.asked.map(Key::of) {
            self.asked = ask;
            self.seat.executor.do_send(Ask {
                slot: self.seat.slot,
                ask,
            });
        }
    }

    /// Starts any threshold solve, runs any empty lock-step round, and sends the queued peer
    /// messages; returns the ask the worker has now.
    fn catch_up(&mut self, ctx: &mut Context<Self>) -> Option<StepAsk> {
        self.start_retune(ctx);
        while self.worker.empty_round_due() {
            self.worker.step();
        }
        let ask = self.next_ask(Instant::now());
        self.flush(ask.is_none());
        ask
    }

    fn start_retune(&mut self, ctx: &mut Context<Self>) {
        if let Some((point, profile)) = self.worker.retune() {
            // Solving takes up to a second; the actor keeps serving with its current threshold.
            let addr = ctx.address();
            std::thread::spawn(move || {
                let best = solve_point(&profile, point);
                addr.do_send(Solved { point, best });
            });
        }
    }

    /// The worker's ask, waiting since the first time it had one.
    fn next_ask(&mut self, now: Instant) -> Option<StepAsk> {
        let since = *self.waiting_since.get_or_insert(now);
        let ask = self.worker.step_ask(since);
        if ask.is_none() {
            self.waiting_since = None;
        }
        ask
    }

    /// Sends the queued peer messages.
    fn flush(&mut self, idle: bool) {
        for (to, msg) in self.worker.take_outbox(idle) {
            if let Some(Some(peer)) = self.peers.get(to) {
                peer.do_send(msg);
            }
        }
    }
}

/// What makes an ask new to the executor (the wait start stays while the model waits).
#[derive(PartialEq, Eq)]
struct Key(usize, usize, Instant);

impl Key {
    fn of(a: StepAsk) -> Self {
        Self(a.ready, a.threshold, a.deadline)
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

impl Handler<Grant> for ModelActor {
    type Result = ();
    fn handle(&mut self, _: Grant, ctx: &mut Context<Self>) {
        self.asked = None;
        self.waiting_since = None;
        {
            let _span = tracing::debug_span!("step", model = self.worker.name()).entered();
            self.worker.step();
        }
        // Handoffs leave before the step's end is reported (see the module header).
        let ask = self.catch_up(ctx);
        let handed = self
            .worker
            .take_handed()
            .into_iter()
            .enumerate()
            .filter(|&(_, n)| n > 0)
            .filter_map(|(to, n)| Some((self.seat.peer_slots.get(to).copied().flatten()?, n)))
            .collect();
        self.asked = ask;
        self.seat.executor.do_send(StepDone {
            slot: self.seat.slot,
            ask,
            handed,
        });
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
