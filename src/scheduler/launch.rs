//! What a model asks of its device's executor: eagerly (a step as soon as anything is ready),
//! or by delayed batching (a step once at least `threshold` requests are ready, or once the
//! oldest ready one has waited `max_wait` since it arrived for this visit). The wait counts per
//! visit, not per step: a request that stays for k tokens waits at most `max_wait` in all. The
//! threshold never exceeds the number of requests active in the whole system, since more could
//! never become ready.

use std::time::{Duration, Instant};

use super::executor::StepAsk;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaunchPolicy {
    Eager,
    Delayed(DelayedBatching),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DelayedBatching {
    pub threshold: usize,
    pub max_wait: Duration,
}

/// A model's queue as its launch policy reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadyQueue {
    /// Requests with work here.
    pub ready: usize,
    /// When the longest-waiting of them arrived for its current visit.
    pub oldest: Option<Instant>,
    /// This model's estimate of the requests active system-wide.
    pub active: usize,
}

impl LaunchPolicy {
    /// The step this model asks for, waiting for the device since `since`; `None` when
    /// nothing is ready.
    pub fn ask(&self, queue: ReadyQueue, since: Instant) -> Option<StepAsk> {
        let oldest = queue.oldest.filter(|_| queue.ready > 0)?;
        let (threshold, deadline) = match self {
            Self::Eager => (1, oldest),
            Self::Delayed(d) => (d.threshold.min(queue.active.max(1)), oldest + d.max_wait),
        };
        Some(StepAsk {
            ready: queue.ready,
            threshold,
            deadline,
            since,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WAIT: Duration = Duration::from_millis(20);

    fn delayed(threshold: usize) -> LaunchPolicy {
        LaunchPolicy::Delayed(DelayedBatching {
            threshold,
            max_wait: WAIT,
        })
    }

    fn queue(ready: usize, oldest: Instant, active: usize) -> ReadyQueue {
        ReadyQueue {
            ready,
            oldest: Some(oldest),
            active,
        }
    }

    #[test]
    fn delayed_batching_waits_for_the_threshold_or_the_visit_deadline() {
        let t0 = Instant::now();
        let p = delayed(4);
        let empty = ReadyQueue {
            ready: 0,
            oldest: None,
            active: 8,
        };
        assert_eq!(p.ask(empty, t0), None);
        let a = p.ask(queue(2, t0, 8), t0 + WAIT / 2).unwrap();
        assert_eq!(
            (a.threshold, a.deadline, a.since),
            (4, t0 + WAIT, t0 + WAIT / 2)
        );
        assert!(!a.eligible(t0 + WAIT / 2));
        assert!(a.eligible(t0 + WAIT), "the visit's deadline passed");
        assert!(p.ask(queue(4, t0, 8), t0).unwrap().eligible(t0));
    }

    #[test]
    fn the_threshold_is_capped_by_the_active_requests() {
        let t0 = Instant::now();
        assert!(delayed(4).ask(queue(2, t0, 2), t0).unwrap().eligible(t0));
        assert!(delayed(4).ask(queue(1, t0, 0), t0).unwrap().eligible(t0));
    }

    #[test]
    fn eager_asks_are_eligible_at_once() {
        let t0 = Instant::now();
        let a = LaunchPolicy::Eager.ask(queue(1, t0, 16), t0).unwrap();
        assert!(a.eligible(t0));
    }
}
