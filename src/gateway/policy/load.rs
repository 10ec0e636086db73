//! Policies that look only at load (or at nothing): random, round robin, shortest queue and
//! the power of two choices.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{least_loaded, Policy, RouteRequest, Selection};
use crate::gateway::workers::Worker;

/// A seeded generator shared by the HTTP workers.
pub(super) struct SharedRng(Mutex<ChaCha8Rng>);

impl SharedRng {
    pub(super) fn new(seed: u64) -> Self {
        Self(Mutex::new(ChaCha8Rng::seed_from_u64(seed)))
    }

    pub(super) fn below(&self, n: usize) -> usize {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .random_range(0..n)
    }

    pub(super) fn chance(&self, p: f64) -> bool {
        p >= 1.0
            || self
                .0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .random_bool(p.max(0.0))
    }
}

pub struct RandomChoice(SharedRng);

impl RandomChoice {
    pub fn new(seed: u64) -> Self {
        Self(SharedRng::new(seed))
    }
}

impl Policy for RandomChoice {
    fn name(&self) -> &'static str {
        "random"
    }

    fn select(&self, workers: &[Arc<Worker>], _request: &RouteRequest) -> Selection {
        Selection::plain(self.0.below(workers.len()))
    }
}

#[derive(Default)]
pub struct RoundRobin(AtomicUsize);

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn select(&self, workers: &[Arc<Worker>], _request: &RouteRequest) -> Selection {
        Selection::plain(self.0.fetch_add(1, Ordering::Relaxed) % workers.len())
    }
}

/// Fewest requests in flight.
pub struct ShortestQueue;

impl Policy for ShortestQueue {
    fn name(&self) -> &'static str {
        "shortest_queue"
    }

    fn select(&self, workers: &[Arc<Worker>], _request: &RouteRequest) -> Selection {
        Selection::plain(least_loaded(workers))
    }
}

/// Two workers drawn at random; the less loaded one wins.
pub struct PowerOfTwo(SharedRng);

impl PowerOfTwo {
    pub fn new(seed: u64) -> Self {
        Self(SharedRng::new(seed))
    }
}

impl Policy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "power_of_two"
    }

    fn select(&self, workers: &[Arc<Worker>], _request: &RouteRequest) -> Selection {
        let n = workers.len();
        if n == 1 {
            return Selection::plain(0);
        }
        let a = self.0.below(n);
        let b = (a + 1 + self.0.below(n - 1)) % n;
        Selection::plain(if workers[b].load() < workers[a].load() {
            b
        } else {
            a
        })
    }
}
