//! The device executor: one actor per device, ordering the steps of the models placed there
//! like a GPU's stream scheduler orders kernels. Model actors stay autonomous (routing, KV,
//! handoffs and peer messages never pass through here); they only ask for a step and report
//! its end. The decision logic is [`DeviceQueue`]'s; this actor delivers asks and grants.

use std::time::Instant;

use actix::{Actor, Context, Handler, Message, Recipient};

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
}

impl DeviceExecutor {
    pub fn new(name: String, queue: DeviceQueue) -> Self {
        Self {
            name,
            queue,
            models: Vec::new(),
        }
    }

    fn dispatch(&mut self) {
        if let Decision::Grant(slot) = self.queue.decide(Instant::now()) {
            match self.models.get(slot) {
                Some(model) => model.do_send(Grant),
                None => {
                    tracing::error!(device = %self.name, slot, "grant for a model not attached");
                    self.queue.finished(slot);
                }
            }
        }
    }
}

impl Actor for DeviceExecutor {
    type Context = Context<Self>;
}

impl Handler<Attach> for DeviceExecutor {
    type Result = ();
    fn handle(&mut self, msg: Attach, _: &mut Context<Self>) {
        self.models = msg.0;
        self.dispatch();
    }
}

impl Handler<Ask> for DeviceExecutor {
    type Result = ();
    fn handle(&mut self, msg: Ask, _: &mut Context<Self>) {
        self.queue.ask(msg.slot, msg.ask);
        self.dispatch();
    }
}

impl Handler<StepDone> for DeviceExecutor {
    type Result = ();
    fn handle(&mut self, msg: StepDone, _: &mut Context<Self>) {
        let now = Instant::now();
        self.queue.finished(msg.slot);
        self.queue.ask(msg.slot, msg.ask);
        for (slot, n) in msg.handed {
            self.queue.credit(slot, n, now);
        }
        self.dispatch();
    }
}
