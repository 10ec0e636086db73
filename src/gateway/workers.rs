//! The workers behind the gateway: their URLs, in-flight load, health and circuit breakers.
//!
//! A worker is routable when its health checks pass and its circuit breaker lets a request
//! through. Load is counted by [`InFlight`] guards: one per proxied request, released when the
//! response stream ends or the client goes away, so the count can never leak. The list itself
//! changes only when a worker is added or removed at runtime. Knows nothing of policies.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::kv_index::Pending;
use super::tree::WorkerId;

/// Thresholds for taking workers out and putting them back.
#[derive(Debug, Clone)]
pub struct HealthPolicy {
    /// Consecutive failed health checks that take a worker out.
    pub failure_threshold: u32,
    /// Consecutive passed health checks that put it back.
    pub success_threshold: u32,
    /// Consecutive request failures (connect errors, 502/503/504) that open the breaker.
    pub breaker_failures: u32,
    /// How long an open breaker refuses requests before letting one trial through.
    pub breaker_open: Duration,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        Self {
            failure_threshold: 3,
            success_threshold: 2,
            breaker_failures: 5,
            breaker_open: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Breaker {
    Closed {
        failures: u32,
    },
    Open {
        until: Instant,
    },
    /// One trial request is in flight; its outcome closes or re-opens the breaker.
    HalfOpen,
}

/// One backend server.
pub struct Worker {
    pub id: WorkerId,
    pub url: String,
    in_flight: AtomicUsize,
    healthy: AtomicBool,
    check_failures: AtomicU32,
    check_successes: AtomicU32,
    breaker: Mutex<Breaker>,
    /// Set when the worker leaves the gateway; its background tasks stop.
    retired: AtomicBool,
    /// KV blocks of the requests in flight (their prompts), as the gateway estimates them.
    active_blocks: AtomicUsize,
    /// Requests sent to this worker, retries included.
    pub selected: AtomicU64,
    pub retries: AtomicU64,
}

impl Worker {
    fn new(id: WorkerId, url: String, healthy: bool) -> Self {
        Self {
            id,
            url,
            in_flight: AtomicUsize::new(0),
            retired: AtomicBool::new(false),
            active_blocks: AtomicUsize::new(0),
            healthy: AtomicBool::new(healthy),
            check_failures: AtomicU32::new(0),
            check_successes: AtomicU32::new(0),
            breaker: Mutex::new(Breaker::Closed { failures: 0 }),
            selected: AtomicU64::new(0),
            retries: AtomicU64::new(0),
        }
    }

    pub fn load(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Whether the worker left the gateway.
    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    /// KV blocks of the requests in flight here.
    pub fn active_blocks(&self) -> usize {
        self.active_blocks.load(Ordering::Acquire)
    }

    /// Requests sent here so far.
    pub fn selected(&self) -> u64 {
        self.selected.load(Ordering::Relaxed)
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }

    fn breaker(&self) -> std::sync::MutexGuard<'_, Breaker> {
        self.breaker.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the breaker lets a request through now (an open breaker past its time lets one
    /// trial through and turns half-open).
    pub fn breaker_allows(&self, now: Instant) -> bool {
        let mut b = self.breaker();
        match *b {
            Breaker::Closed { .. } => true,
            Breaker::Open { until } if now >= until => {
                *b = Breaker::HalfOpen;
                true
            }
            Breaker::Open { .. } | Breaker::HalfOpen => false,
        }
    }

    /// Whether a request could go here without changing breaker state.
    pub fn routable(&self, now: Instant) -> bool {
        self.is_healthy()
            && match *self.breaker() {
                Breaker::Closed { .. } => true,
                Breaker::Open { until } => now >= until,
                Breaker::HalfOpen => false,
            }
    }

    pub fn breaker_open(&self) -> bool {
        !matches!(*self.breaker(), Breaker::Closed { .. })
    }

    /// Feeds the outcome of a proxied request to the breaker.
    pub fn record_outcome(&self, ok: bool, policy: &HealthPolicy, now: Instant) {
        let mut b = self.breaker();
        *b = match (*b, ok) {
            (_, true) => Breaker::Closed { failures: 0 },
            (Breaker::Closed { failures }, false) if failures + 1 < policy.breaker_failures => {
                Breaker::Closed {
                    failures: failures + 1,
                }
            }
            (_, false) => {
                tracing::warn!(worker = %self.url, "circuit breaker open");
                Breaker::Open {
                    until: now + policy.breaker_open,
                }
            }
        };
    }

    /// Feeds one health check; returns the new health when it changed.
    pub fn record_check(&self, ok: bool, policy: &HealthPolicy) -> Option<bool> {
        let (mine, other) = if ok {
            (&self.check_successes, &self.check_failures)
        } else {
            (&self.check_failures, &self.check_successes)
        };
        other.store(0, Ordering::Release);
        let streak = mine.fetch_add(1, Ordering::AcqRel) + 1;
        let threshold = if ok {
            policy.success_threshold
        } else {
            policy.failure_threshold
        };
        if streak >= threshold && self.healthy.swap(ok, Ordering::AcqRel) != ok {
            tracing::warn!(worker = %self.url, healthy = ok, "worker health changed");
            return Some(ok);
        }
        None
    }
}

/// Counts one request against a worker's load until dropped.
pub struct InFlight {
    worker: Arc<Worker>,
    blocks: usize,
    /// What the policy counts as coming to this worker while the request runs.
    _pending: Option<Pending>,
    released: Arc<Notify>,
}

impl InFlight {
    pub fn worker(&self) -> &Arc<Worker> {
        &self.worker
    }

    /// Keeps `pending` until the request ends.
    pub fn holding(mut self, pending: Option<Pending>) -> Self {
        self._pending = pending;
        self
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.worker.in_flight.fetch_sub(1, Ordering::AcqRel);
        (self.worker.active_blocks).fetch_sub(self.blocks, Ordering::AcqRel);
        self.released.notify_waiters();
    }
}

/// The current set of workers.
pub struct WorkerSet {
    workers: RwLock<Vec<Arc<Worker>>>,
    next_id: AtomicU32,
    /// Woken whenever a request ends, so that queued requests can look again.
    released: Arc<Notify>,
    pub policy: HealthPolicy,
}

impl WorkerSet {
    pub fn new(policy: HealthPolicy) -> Self {
        Self {
            workers: RwLock::new(Vec::new()),
            next_id: AtomicU32::new(0),
            released: Arc::new(Notify::new()),
            policy,
        }
    }

    /// Adds a worker (healthy until checks say otherwise when `healthy`); an URL already
    /// present is returned as it is.
    pub fn add(&self, url: &str, healthy: bool) -> Arc<Worker> {
        self.insert(url, healthy).0
    }

    /// [`WorkerSet::add`], and whether the worker is new.
    pub fn insert(&self, url: &str, healthy: bool) -> (Arc<Worker>, bool) {
        let url = url.trim_end_matches('/').to_string();
        let mut workers = self.workers.write().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = workers.iter().find(|w| w.url == url) {
            return (w.clone(), false);
        }
        let id = self.next_id.fetch_add(1, Ordering::AcqRel);
        let worker = Arc::new(Worker::new(id, url, healthy));
        workers.push(worker.clone());
        (worker, true)
    }

    pub fn remove(&self, url: &str) -> Option<Arc<Worker>> {
        let url = url.trim_end_matches('/');
        let mut workers = self.workers.write().unwrap_or_else(|e| e.into_inner());
        let at = workers.iter().position(|w| w.url == url)?;
        let worker = workers.remove(at);
        worker.retired.store(true, Ordering::Release);
        Some(worker)
    }

    pub fn all(&self) -> Vec<Arc<Worker>> {
        self.workers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Workers a request may go to now, minus those already tried for it.
    pub fn routable(&self, exclude: &[WorkerId]) -> Vec<Arc<Worker>> {
        let now = Instant::now();
        self.all()
            .into_iter()
            .filter(|w| !exclude.contains(&w.id) && w.routable(now))
            .collect()
    }

    /// Counts a request of `blocks` KV blocks against `worker`.
    pub fn start(&self, worker: &Arc<Worker>, blocks: usize) -> InFlight {
        worker.in_flight.fetch_add(1, Ordering::AcqRel);
        worker.active_blocks.fetch_add(blocks, Ordering::AcqRel);
        worker.selected.fetch_add(1, Ordering::Relaxed);
        InFlight {
            worker: worker.clone(),
            blocks,
            _pending: None,
            released: self.released.clone(),
        }
    }

    /// Resolves when some request ends (or after `at_most`).
    pub async fn released(&self, at_most: Duration) {
        let _ = tokio::time::timeout(at_most, self.released.notified()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> HealthPolicy {
        HealthPolicy {
            failure_threshold: 2,
            success_threshold: 2,
            breaker_failures: 2,
            breaker_open: Duration::from_millis(100),
        }
    }

    #[test]
    fn health_changes_only_after_a_streak() {
        let w = Worker::new(0, "http://a".into(), true);
        let p = policy();
        assert_eq!(w.record_check(false, &p), None);
        assert_eq!(w.record_check(true, &p), None);
        assert_eq!(w.record_check(false, &p), None);
        assert_eq!(w.record_check(false, &p), Some(false));
        assert!(!w.is_healthy());
        assert_eq!(w.record_check(true, &p), None);
        assert_eq!(w.record_check(true, &p), Some(true));
    }

    #[test]
    fn breaker_opens_then_lets_one_trial_through() {
        let w = Worker::new(0, "http://a".into(), true);
        let p = policy();
        let t0 = Instant::now();
        w.record_outcome(false, &p, t0);
        assert!(w.breaker_allows(t0));
        w.record_outcome(false, &p, t0);
        assert!(!w.breaker_allows(t0));
        assert!(!w.routable(t0));
        let later = t0 + Duration::from_millis(150);
        assert!(w.routable(later));
        assert!(w.breaker_allows(later), "one trial after the open period");
        assert!(!w.breaker_allows(later), "only one trial at a time");
        w.record_outcome(true, &p, later);
        assert!(w.breaker_allows(later) && !w.breaker_open());
    }

    #[test]
    fn load_is_released_when_the_guard_drops() {
        let set = WorkerSet::new(policy());
        let w = set.add("http://a/", true);
        assert_eq!(w.url, "http://a");
        let g1 = set.start(&w, 1);
        let g2 = set.start(&w, 1);
        assert_eq!(w.load(), 2);
        drop(g1);
        assert_eq!(w.load(), 1);
        drop(g2);
        assert_eq!(w.load(), 0);
        assert_eq!(w.selected.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn workers_are_added_once_and_removed_by_url() {
        let set = WorkerSet::new(policy());
        let a = set.add("http://a", true);
        let again = set.add("http://a/", true);
        assert_eq!(a.id, again.id);
        let b = set.add("http://b", false);
        assert_ne!(a.id, b.id);
        assert_eq!(set.routable(&[]).len(), 1, "b is not healthy yet");
        assert_eq!(set.routable(&[a.id]).len(), 0);
        assert!(set.remove("http://a").is_some());
        assert!(set.remove("http://a").is_none());
        assert_eq!(set.all().len(), 1);
    }
}
