//! Online thresholds (`thresholds = "auto"`): each model keeps a decayed estimate of its own
//! routing probability, learns its peer's from the messages they exchange, reads the active
//! request count from its piggybacked counter, and looks up (or solves) the throughput-optimal
//! threshold for the current operating point. Solutions are cached per operating point, with
//! probabilities bucketed to 0.05 so that noise does not trigger re-solving.

use std::collections::HashMap;
use std::sync::Arc;

use super::{optimize, ChainInputs, StepLatencies};

/// Largest concurrency the tuner solves for; beyond it the solution for this value is used.
pub const MAX_TUNED_CONCURRENCY: usize = 16;

/// Step latencies of the SLM and the LLM, shared by both models' tuners.
#[derive(Debug, Clone, PartialEq)]
pub struct LatencyProfile {
    pub slm: StepLatencies,
    pub llm: StepLatencies,
    /// Whether the models share one device (see [`ChainInputs::shared_compute`]).
    pub shared_compute: bool,
}

/// A point the thresholds are solved for: concurrency and the two routing probabilities in
/// twentieths.
pub type OperatingPoint = (usize, u8, u8);

pub struct OnlineThresholds {
    profile: Arc<LatencyProfile>,
    is_slm: bool,
    /// Decayed counts of sampled steps and of moves out, on this model.
    samples: f64,
    moves: f64,
    peer_p: f64,
    cache: HashMap<OperatingPoint, (usize, usize)>,
    current: usize,
}

const DECAY: f64 = 0.995;

fn bucket(p: f64) -> u8 {
    (p.clamp(0.0, 1.0) * 20.0).round() as u8
}

impl OnlineThresholds {
    /// Starts from eager launching until routing has been observed.
    pub fn new(profile: Arc<LatencyProfile>, is_slm: bool) -> Self {
        Self {
            profile,
            is_slm,
            samples: 0.0,
            moves: 0.0,
            peer_p: 0.0,
            cache: HashMap::new(),
            current: 1,
        }
    }

    /// This model sampled `samples` requests in a step, of which `moves` left for the peer.
    pub fn observe(&mut self, samples: usize, moves: usize) {
        let keep = DECAY.powi(samples as i32);
        self.samples = self.samples * keep + samples as f64;
        self.moves = self.moves * keep + moves as f64;
    }

    /// This model's routing probability (to be sent to the peer).
    pub fn own_p(&self) -> f64 {
        if self.samples < 1.0 {
            0.0
        } else {
            self.moves / self.samples
        }
    }

    pub fn set_peer_p(&mut self, p: f64) {
        self.peer_p = p;
    }

    pub fn current(&self) -> usize {
        self.current
    }

    /// The operating point for `active` requests system-wide.
    pub fn point(&self, active: usize) -> OperatingPoint {
        let (up, down) = if self.is_slm {
            (self.own_p(), self.peer_p)
        } else {
            (self.peer_p, self.own_p())
        };
        (
            active.clamp(1, MAX_TUNED_CONCURRENCY),
            bucket(up),
            bucket(down),
        )
    }

    /// Moves to the cached solution for `point`; returns false when it still has to be
    /// solved (then the current threshold stays).
    pub fn update(&mut self, point: OperatingPoint) -> bool {
        match self.cache.get(&point) {
            Some(&(slm, llm)) => {
                self.current = if self.is_slm { slm } else { llm };
                true
            }
            None => false,
        }
    }

    /// Records a solution (from [`solve_point`]) and applies it.
    pub fn insert(&mut self, point: OperatingPoint, best: (usize, usize)) {
        self.cache.insert(point, best);
        self.update(point);
    }

    /// Operating points solved so far.
    pub fn solved_points(&self) -> usize {
        self.cache.len()
    }

    pub fn profile(&self) -> &Arc<LatencyProfile> {
        &self.profile
    }
}

/// The throughput-optimal `(slm, llm)` thresholds at `point` (eager if nothing is feasible).
pub fn solve_point(profile: &LatencyProfile, point: OperatingPoint) -> (usize, usize) {
    let (n, up, down) = point;
    let cut = |l: &StepLatencies| l.decode[..n.min(l.decode.len())].to_vec();
    let mut inputs = ChainInputs::two_models(
        n,
        up as f64 / 20.0,
        down as f64 / 20.0,
        [cut(&profile.slm), cut(&profile.llm)],
    );
    inputs.extend_s = vec![profile.slm.extend_token, profile.llm.extend_token];
    if profile.shared_compute {
        inputs.shared_compute = true;
        inputs = inputs.with_catch_up();
    }
    match optimize(&inputs).1.as_deref() {
        Some(&[slm, llm]) => (slm, llm),
        _ => (1, 1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> Arc<LatencyProfile> {
        Arc::new(LatencyProfile {
            slm: StepLatencies {
                decode: (1..=8).map(|b| 0.02 + 0.002 * b as f64).collect(),
                extend_token: 0.002,
            },
            llm: StepLatencies {
                decode: (1..=8).map(|b| 0.2 + 0.001 * b as f64).collect(),
                extend_token: 0.004,
            },
            shared_compute: false,
        })
    }

    #[test]
    fn routing_probabilities_are_estimated_from_decayed_counts() {
        let mut t = OnlineThresholds::new(profile(), true);
        assert_eq!(t.own_p(), 0.0);
        for _ in 0..100 {
            t.observe(4, 1);
        }
        assert!((t.own_p() - 0.25).abs() < 1e-9);
        t.set_peer_p(0.5);
        assert_eq!(t.point(40), (16, 5, 10));
    }

    #[test]
    fn solutions_are_cached_and_applied_per_model() {
        let mut slm = OnlineThresholds::new(profile(), true);
        let mut llm = OnlineThresholds::new(profile(), false);
        let point = (6, 4, 10);
        assert!(!slm.update(point));
        let best = solve_point(&profile(), point);
        slm.insert(point, best);
        llm.insert(point, best);
        assert_eq!((slm.current(), llm.current()), best);
        assert!(slm.update(point));
    }
}
