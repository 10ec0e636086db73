//! Share control: a learned router's cut-off that follows the scores it serves, so that about
//! a target share of the SLM's tokens goes to the LLM whatever the prompts are.
//!
//! A threshold picked on training text routes a different share of other text: the scores
//! of a head move with the prompts' distribution. Here the cut-off is the (1 − share) quantile
//! of the last [`WINDOW`] scores served, across requests. A token scoring exactly at the
//! cut-off goes to the LLM only while the LLM's tally is short of the target, so a head that
//! gives many tokens one saturated score still routes the share asked for.
//!
//! Scores are compared as urgencies: higher means more in need of the LLM (see
//! [`super::head::HeadKind::urgency`]).

use std::sync::Mutex;

/// Scores the quantile is taken over: enough that one long request does not set the cut-off
/// alone, few enough that it follows a change of workload within a few dozen requests.
pub const WINDOW: usize = 1024;

/// Where a router draws the line between the SLM's tokens and the LLM's.
pub enum Cut {
    /// A fixed threshold on the score.
    Threshold(f32),
    /// A cut-off that follows the scores served, so that this share goes to the LLM.
    Share(ShareControl),
}

impl Cut {
    /// Whether each of a batch's scores sends its token to the LLM: at a threshold by the
    /// router's rule `defers(score, threshold)`, under a share by rank of `urgency(score)`.
    pub fn decide(
        &self,
        scores: &[f32],
        defers: impl Fn(f32, f32) -> bool,
        urgency: impl Fn(f32) -> f32,
    ) -> Vec<bool> {
        match self {
            Self::Threshold(t) => scores.iter().map(|&s| defers(s, *t)).collect(),
            Self::Share(control) => {
                let urgency: Vec<f32> = scores.iter().map(|&s| urgency(s)).collect();
                let mut out = Vec::with_capacity(scores.len());
                control.decide(&urgency, &mut out);
                out
            }
        }
    }
}

pub struct ShareControl {
    share: f64,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The last scores, a ring of at most [`WINDOW`].
    recent: Vec<f32>,
    next: usize,
    scratch: Vec<f32>,
    decided: u64,
    deferred: u64,
}

impl ShareControl {
    /// `share` in (0, 1): the fraction of the SLM's tokens to hand to the LLM.
    pub fn new(share: f64) -> Self {
        Self {
            share,
            state: Mutex::new(State::default()),
        }
    }

    /// Whether each of a batch's tokens, in order, goes to the LLM, given their urgencies.
    pub fn decide(&self, urgency: &[f32], out: &mut Vec<bool>) {
        out.clear();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for &u in urgency.iter().filter(|u| u.is_finite()) {
            state.push(u);
        }
        let cut = state.quantile(1.0 - self.share);
        for &u in urgency {
            state.decided += 1;
            let owed = (state.deferred as f64) < self.share * state.decided as f64;
            let defer = match cut {
                Some(cut) if u.is_finite() => u > cut || (u == cut && owed),
                _ => false,
            };
            state.deferred += u64::from(defer);
            out.push(defer);
        }
    }
}

impl State {
    fn push(&mut self, u: f32) {
        if self.recent.len() < WINDOW {
            self.recent.push(u);
        } else {
            self.recent[self.next] = u;
        }
        self.next = (self.next + 1) % WINDOW;
    }

    /// The `q` quantile of the window (the smallest score with at least a `q` share of the
    /// window below it), if it holds any score.
    fn quantile(&mut self, q: f64) -> Option<f32> {
        let n = self.recent.len();
        if n == 0 {
            return None;
        }
        self.scratch.clear();
        self.scratch.extend_from_slice(&self.recent);
        let k = ((q * n as f64) as usize).min(n - 1);
        let (_, cut, _) = self.scratch.select_nth_unstable_by(k, f32::total_cmp);
        Some(*cut)
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;

    fn routed_share(control: &ShareControl, scores: &[f32], batch: usize) -> f64 {
        let mut out = Vec::new();
        let mut deferred = 0;
        for chunk in scores.chunks(batch) {
            control.decide(chunk, &mut out);
            deferred += out.iter().filter(|&&d| d).count();
        }
        deferred as f64 / scores.len() as f64
    }

    #[test]
    fn continuous_scores_route_the_share_asked_for() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        // Two workloads with different score distributions, one after the other: the share
        // holds on each, though a fixed threshold would route very different shares.
        let low: Vec<f32> = (0..8192).map(|_| rng.random::<f32>() * 0.3).collect();
        let high: Vec<f32> = (0..8192).map(|_| 0.5 + rng.random::<f32>() * 0.5).collect();
        let control = ShareControl::new(0.1);
        let first = routed_share(&control, &low, 8);
        // The change of workload over-routes until the window holds its new scores.
        routed_share(&control, &high[..WINDOW], 8);
        let second = routed_share(&control, &high[WINDOW..], 8);
        assert!((first - 0.1).abs() < 0.01, "routed {first}");
        assert!((second - 0.1).abs() < 0.01, "routed {second}");
    }

    #[test]
    fn the_highest_urgencies_are_the_ones_routed() {
        let control = ShareControl::new(0.25);
        let mut out = Vec::new();
        let warm: Vec<f32> = (0..WINDOW).map(|i| (i % 100) as f32).collect();
        for chunk in warm.chunks(16) {
            control.decide(chunk, &mut out);
        }
        control.decide(&[10.0, 99.0, 50.0, 80.0], &mut out);
        assert_eq!(out, [false, true, false, true]);
    }

    #[test]
    fn saturated_ties_are_shared_out_to_the_target() {
        // 40 % of tokens score exactly 1.0 (a saturated head): a plain threshold at the
        // quantile would route none or all of them.
        let scores: Vec<f32> = (0..10_000)
            .map(|i| {
                if i % 5 < 2 {
                    1.0
                } else {
                    (i % 97) as f32 / 200.0
                }
            })
            .collect();
        let control = ShareControl::new(0.15);
        let share = routed_share(&control, &scores, 4);
        assert!((share - 0.15).abs() < 0.005, "routed {share}");
    }

    #[test]
    fn non_finite_scores_stay_on_the_slm_and_do_not_move_the_cut() {
        let control = ShareControl::new(0.5);
        let mut out = Vec::new();
        control.decide(&[f32::NAN, f32::INFINITY], &mut out);
        assert_eq!(out, [false, false]);
        control.decide(&[0.0, 1.0, 2.0, 3.0], &mut out);
        assert_eq!(out.iter().filter(|&&d| d).count(), 2);
        assert!(out[3] && !out[0]);
    }
}
