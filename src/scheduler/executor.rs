//! The order of steps on one device: which of the models placed there computes next.
//!
//! Models on one CPU device share its cores, and two steps running at once only slow each
//! other down (their compute threads preempt each other mid-chunk, their weight streams share
//! one memory bus), so a device runs one step at a time, each on every core. A model with work
//! asks for a step ([`StepAsk`]); [`DeviceQueue::decide`] grants one when the device is free.
//! The granted model plans its batch only then, so work that reached it while it waited joins
//! the batch.
//!
//! Policies: `first-come` grants the eligible ask that has waited longest (eager and lock-step
//! use it with a threshold of 1); an ask is eligible once its model has `threshold` requests
//! ready or its oldest ready request has waited until `deadline` (delayed batching). When no
//! ask is eligible the device would idle, so the queue is work-conserving: it grants the ask
//! whose deadline comes first. Holding a model back only pays while another model computes:
//! that is when its batch grows.
//!
//! A GPU admits concurrent streams: each model there computes on a stream of its own, so its
//! queue ([`Admission::PerModel`]) grants every model a step of its own at once, and the policy
//! only holds a model back while its peer computes, until it is eligible (delayed batching);
//! with nothing running the device never idles while an ask waits.
//!
//! Guarantees: at most one step is granted at a time on a CPU device, at most one per model
//! on a GPU; every ask is granted within the steps of the asks ahead of it, so no model
//! starves; a model's requests handed to a peer on the same device count as ready there at
//! once ([`DeviceQueue::credit`]), before the peer has read its mailbox. Pure logic over
//! counts and instants: no threads, no tensors.

use std::time::{Duration, Instant};

/// What a model with work asks of its device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepAsk {
    /// Requests with work ready there.
    pub ready: usize,
    /// Eligible once this many are ready (1: at once).
    pub threshold: usize,
    /// Eligible from this instant whatever the count (the oldest ready request's visit start
    /// plus the model's longest wait).
    pub deadline: Instant,
    /// When the model started waiting for the device: the order of `first-come`.
    pub since: Instant,
}

impl StepAsk {
    pub fn eligible(&self, now: Instant) -> bool {
        self.ready >= self.threshold || self.deadline <= now
    }
}

/// How many steps a device runs at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// One step at a time, on every core (a CPU device).
    OneStep,
    /// One step per model at a time, each on its model's stream (a GPU).
    PerModel,
}

/// The executor's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// This model (by slot) computes now.
    Grant(usize),
    /// Steps are running and no other may start now.
    Busy,
    /// Nothing to do.
    Idle,
}

#[derive(Debug, Clone)]
struct Slot {
    ask: Option<StepAsk>,
    /// The model's delayed-batching settings, for asks made on its behalf by [`credit`].
    threshold: usize,
    max_wait: Duration,
}

/// The step queue of one device.
#[derive(Debug, Clone)]
pub struct DeviceQueue {
    slots: Vec<Slot>,
    admission: Admission,
    /// Whether each slot's granted step is running.
    running: Vec<bool>,
    grants: Vec<u64>,
}

impl DeviceQueue {
    /// A queue for models with these delayed-batching settings (threshold, longest wait), by
    /// slot, on a device that admits steps as `admission` says.
    pub fn new(admission: Admission, settings: &[(usize, Duration)]) -> Self {
        Self {
            admission,
            running: vec![false; settings.len()],
            slots: settings
                .iter()
                .map(|&(threshold, max_wait)| Slot {
                    ask: None,
                    threshold: threshold.max(1),
                    max_wait,
                })
                .collect(),
            grants: vec![0; settings.len()],
        }
    }

    /// The model in `slot` asks for a step (replacing its earlier ask), or withdraws with
    /// `None`.
    pub fn ask(&mut self, slot: usize, ask: Option<StepAsk>) {
        let s = &mut self.slots[slot];
        if let Some(a) = &ask {
            s.threshold = a.threshold.max(1);
        }
        s.ask = ask;
    }

    /// `n` requests were handed to the model in `slot` by a peer of the device at `now`: they
    /// count as ready there until that model's own next ask replaces the estimate.
    pub fn credit(&mut self, slot: usize, n: usize, now: Instant) {
        if n == 0 {
            return;
        }
        let s = &mut self.slots[slot];
        match &mut s.ask {
            Some(a) => a.ready += n,
            None => {
                s.ask = Some(StepAsk {
                    ready: n,
                    threshold: s.threshold,
                    deadline: now + s.max_wait,
                    since: now,
                })
            }
        }
    }

    /// The step granted to `slot` ended.
    pub fn finished(&mut self, slot: usize) {
        self.running[slot] = false;
    }

    /// Grants the next step if the device admits one: the eligible ask that waited longest,
    /// or, when none is eligible and nothing runs, the one whose deadline comes first. A GPU
    /// device may grant again at once (call until it answers otherwise).
    pub fn decide(&mut self, now: Instant) -> Decision {
        let busy = self.running.iter().any(|&r| r);
        if busy && self.admission == Admission::OneStep {
            return Decision::Busy;
        }
        let asks = || {
            self.slots
                .iter()
                .enumerate()
                .filter(|(i, _)| !self.running[*i])
                .filter_map(|(i, s)| s.ask.map(|a| (i, a)))
        };
        let pick = asks()
            .filter(|(_, a)| a.eligible(now))
            .min_by_key(|(i, a)| (a.since, *i))
            .or_else(|| {
                (!busy)
                    .then(|| asks().min_by_key(|(i, a)| (a.deadline, *i)))
                    .flatten()
            });
        match pick {
            Some((slot, _)) => {
                self.slots[slot].ask = None;
                self.running[slot] = true;
                self.grants[slot] += 1;
                Decision::Grant(slot)
            }
            None if busy => Decision::Busy,
            None => Decision::Idle,
        }
    }

    /// The first instant an ask held back now becomes eligible by its deadline: when the
    /// executor must decide again though no step ended. A CPU device decides again only when
    /// its step ends (it holds nothing back while free).
    pub fn next_deadline(&self, now: Instant) -> Option<Instant> {
        if self.admission == Admission::OneStep {
            return None;
        }
        self.slots
            .iter()
            .enumerate()
            .filter(|(i, _)| !self.running[*i])
            .filter_map(|(_, s)| s.ask)
            .filter(|a| !a.eligible(now))
            .map(|a| a.deadline)
            .min()
    }

    /// Steps granted so far, by slot.
    pub fn grants(&self) -> &[u64] {
        &self.grants
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WAIT: Duration = Duration::from_millis(20);

    fn ask(ready: usize, threshold: usize, since: Instant) -> Option<StepAsk> {
        Some(StepAsk {
            ready,
            threshold,
            deadline: since + WAIT,
            since,
        })
    }

    #[test]
    fn one_step_at_a_time_and_first_come_first_served() {
        let t0 = Instant::now();
        let mut q = DeviceQueue::new(Admission::OneStep, &[(1, WAIT), (1, WAIT)]);
        q.ask(1, ask(1, 1, t0));
        q.ask(0, ask(1, 1, t0 + WAIT / 4));
        assert_eq!(q.decide(t0), Decision::Grant(1));
        assert_eq!(
            q.decide(t0),
            Decision::Busy,
            "the device runs one step at a time"
        );
        q.ask(1, ask(1, 1, t0 + WAIT / 2));
        q.finished(1);
        assert_eq!(q.decide(t0), Decision::Grant(0), "model 0 asked first");
        q.finished(0);
        assert_eq!(q.decide(t0), Decision::Grant(1));
        q.finished(1);
        assert_eq!(q.decide(t0), Decision::Idle);
        assert_eq!(q.grants(), &[1, 2]);
    }

    #[test]
    fn a_model_below_its_threshold_yields_to_one_that_is_eligible() {
        let t0 = Instant::now();
        let mut q = DeviceQueue::new(Admission::OneStep, &[(1, WAIT), (4, WAIT)]);
        q.ask(1, ask(2, 4, t0));
        q.ask(0, ask(3, 1, t0 + WAIT / 2));
        assert_eq!(q.decide(t0 + WAIT / 2), Decision::Grant(0));
        q.ask(0, ask(3, 1, t0 + WAIT / 2));
        q.finished(0);
        assert_eq!(
            q.decide(t0 + WAIT),
            Decision::Grant(1),
            "the deadline made it eligible, and it asked first"
        );
    }

    #[test]
    fn the_device_never_idles_while_an_ask_waits() {
        let t0 = Instant::now();
        let mut q = DeviceQueue::new(Admission::OneStep, &[(3, WAIT), (4, WAIT)]);
        q.ask(0, ask(1, 3, t0 + WAIT / 2));
        q.ask(1, ask(1, 4, t0));
        assert_eq!(q.decide(t0), Decision::Grant(1), "earliest deadline first");
    }

    #[test]
    fn handed_requests_count_at_the_peer_before_it_asks() {
        let t0 = Instant::now();
        let mut q = DeviceQueue::new(Admission::OneStep, &[(1, WAIT), (3, WAIT)]);
        q.ask(1, ask(1, 3, t0));
        q.ask(0, ask(2, 1, t0 + WAIT / 4));
        q.credit(1, 2, t0 + WAIT / 4);
        assert_eq!(
            q.decide(t0 + WAIT / 4),
            Decision::Grant(1),
            "1 + 2 reach its threshold"
        );
        q.finished(1);
        q.credit(1, 1, t0 + WAIT / 2);
        let credited = q.slots[1].ask.unwrap();
        assert_eq!((credited.ready, credited.threshold), (1, 3));
        assert_eq!(credited.deadline, t0 + WAIT / 2 + WAIT);
    }

    #[test]
    fn a_gpu_runs_a_step_per_model_at_once_and_holds_back_only_while_busy() {
        let t0 = Instant::now();
        let mut q = DeviceQueue::new(Admission::PerModel, &[(1, WAIT), (4, WAIT)]);
        q.ask(0, ask(1, 1, t0));
        q.ask(1, ask(4, 4, t0));
        assert_eq!(q.decide(t0), Decision::Grant(0));
        assert_eq!(
            q.decide(t0),
            Decision::Grant(1),
            "each model has its own stream"
        );
        assert_eq!(q.decide(t0), Decision::Busy);
        q.ask(0, ask(1, 1, t0));
        assert_eq!(q.decide(t0), Decision::Busy, "one step per model at a time");
        q.finished(1);
        q.ask(1, ask(2, 4, t0));
        assert_eq!(
            q.decide(t0),
            Decision::Busy,
            "below its threshold while its peer computes: held back"
        );
        assert_eq!(q.next_deadline(t0), Some(t0 + WAIT));
        assert_eq!(q.decide(t0 + WAIT), Decision::Grant(1), "its deadline came");
        assert_eq!(q.next_deadline(t0 + WAIT), None);
        q.finished(0);
        q.ask(0, None);
        q.finished(1);
        q.ask(1, ask(1, 4, t0 + WAIT));
        assert_eq!(
            q.decide(t0 + WAIT),
            Decision::Grant(1),
            "nothing runs: the device does not idle while an ask waits"
        );
        q.finished(1);
        assert_eq!(q.decide(t0 + WAIT), Decision::Idle);
        assert_eq!(q.grants(), &[1, 3]);
    }

    #[test]
    fn a_withdrawn_ask_is_never_granted() {
        let t0 = Instant::now();
        let mut q = DeviceQueue::new(Admission::OneStep, &[(1, WAIT)]);
        q.ask(0, ask(1, 1, t0));
        q.ask(0, None);
        assert_eq!(q.decide(t0), Decision::Idle);
    }
}
