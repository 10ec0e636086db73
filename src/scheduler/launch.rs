//! When a model launches its next step: eagerly, or by delayed batching (wait until at least
//! `threshold` requests are ready, or until the oldest ready one has waited `max_wait`). The
//! threshold never exceeds the number of requests active in the whole system, since more could
//! never become ready.

use std::time::{Duration, Instant};

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launch {
    /// Nothing is ready.
    Idle,
    Now,
    /// Launch at this time unless more requests become ready first.
    At(Instant),
}

impl LaunchPolicy {
    /// `ready`: requests with work here; `oldest`: when the longest-waiting of them became
    /// ready; `active`: this model's estimate of the requests active system-wide.
    pub fn decide(
        &self,
        ready: usize,
        oldest: Option<Instant>,
        now: Instant,
        active: usize,
    ) -> Launch {
        let Some(oldest) = oldest.filter(|_| ready > 0) else {
            return Launch::Idle;
        };
        match self {
            Self::Eager => Launch::Now,
            Self::Delayed(d) => {
                let deadline = oldest + d.max_wait;
                if ready >= d.threshold.min(active.max(1)) || deadline <= now {
                    Launch::Now
                } else {
                    Launch::At(deadline)
                }
            }
        }
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

    #[test]
    fn delayed_batching_waits_for_the_threshold_or_the_deadline() {
        let t0 = Instant::now();
        let p = delayed(4);
        assert_eq!(p.decide(0, None, t0, 8), Launch::Idle);
        assert_eq!(p.decide(2, Some(t0), t0, 8), Launch::At(t0 + WAIT));
        assert_eq!(p.decide(4, Some(t0), t0, 8), Launch::Now);
        assert_eq!(p.decide(2, Some(t0), t0 + WAIT, 8), Launch::Now);
    }

    #[test]
    fn the_threshold_is_capped_by_the_active_requests() {
        let t0 = Instant::now();
        assert_eq!(delayed(4).decide(2, Some(t0), t0, 2), Launch::Now);
        assert_eq!(delayed(4).decide(1, Some(t0), t0, 0), Launch::Now);
    }

    #[test]
    fn eager_launches_whenever_anything_is_ready() {
        let t0 = Instant::now();
        assert_eq!(LaunchPolicy::Eager.decide(1, Some(t0), t0, 16), Launch::Now);
    }
}
