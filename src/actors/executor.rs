//! The device executor: one actor per device, ordering the steps of the models placed there
//! like a GPU's stream scheduler orders kernels. Model actors stay autonomous (routing, KV,
//! handoffs and peer messages never pass through here); they only ask for a step and report
//! its end. The decision logic is [`DeviceQueue`]'s; this actor delivers asks and grants, and
//! decides again when a held-back ask's deadline comes while steps run.

use std::time::Instant;

use actix::{Actor, AsyncContext, Context, Handler, Message, Recipient, SpawnHandle};

use crate::scheduler::{Decision, DeviceQueue, StepAsk};

/// The device's answer to an ask: compute one step now.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Grant;

/// A model asks for a step, or withdraws its ask with `None`.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Ask {
    pub slot: usize,
    pub ask: Option<StepAsk>,
}

/// The step granted to `slot` ended: its next ask, and how many requests it handed to each
/// model of this device (by slot), which count as ready there at once.
#[derive(Message)]
#[rtype(result = "()")]
pub struct StepDone {
    pub slot: usize,
    pub ask: Option<StepAsk>,
    pub handed: Vec<(usize, usize)>,
}

/// Gives the executor its models' grant recipients, by slot.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Attach(pub Vec<Recipient<Grant>>);

pub struct DeviceExecutor {
    name: String,
    queue: DeviceQueue,
    models: Vec<Recipient<Grant>>,
    /// The wake-up at the next held-back deadline, if one is set.
    wake: Option<SpawnHandle>,
}

impl DeviceExecutor {
    pub fn new(name: String, queue: DeviceQueue) -> Self {
        Self {
            name,
            queue,
            models: Vec::new(),
            wake: None,
        }
    }

    fn dispatch(&mut self, ctx: &mut Context<Self>) {
        let now = Instant::now();
        while let Decision::Grant(slot) = self.queue.decide(now) {
            match self.models.get(slot) {
                Some(model) => model.do_send(Grant),
                None => {
                    tracing::error!(device = %self.name, slot, "grant for a model not attached");
                    self.queue.finished(slot);
                }
            }
        }
        if let Some(handle) = self.wake.take() {
            ctx.cancel_future(handle);
        }
        if let Some(deadline) = self.queue.next_deadline(now) {
            self.wake = Some(ctx.run_later(deadline - now, |this, ctx| {
                this.wake = None;
                this.dispatch(ctx);
            }));
        }
    }
}

impl Actor for DeviceExecutor {
    type Context = Context<Self>;
}

impl Handler<Attach> for DeviceExecutor {
    type Result = ();
    fn handle(&mut self, msg: Attach, ctx: &mut Context<Self>) {
        self.models = msg.0;
        self.dispatch(ctx);
    }
}

impl Handler<Ask> for DeviceExecutor {
    type Result = ();
    fn handle(&mut self, msg: Ask, ctx: &mut Context<Self>) {
        self.queue.ask(msg.slot, msg.ask);
        self.dispatch(ctx);
    }
}

impl Handler<StepDone> for DeviceExecutor {
    type Result = ();
    fn handle(&mut self, msg: StepDone, ctx: &mut Context<Self>) {
        let now = Instant::now();
        self.queue.finished(msg.slot);
        self.queue.ask(msg.slot, msg.ask);
        for (slot, n) in msg.handed {
            self.queue.credit(slot, n, now);
        }
        self.dispatch(ctx);
    }
}
