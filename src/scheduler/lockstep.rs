//! The `sync` baseline: a barrier between model actors built from the step-done messages they
//! send each other. A model starts round `r + 1` only when every peer has finished round `r`,
//! so every round lasts as long as the slowest model's step, the way a server that batches all
//! models in one loop behaves. A model with nothing to do still takes part (an empty step) once
//! any peer has moved ahead; when no model has work, all of them go idle.

/// One model's view of the rounds.
#[derive(Debug, Clone)]
pub struct LockStep {
    me: usize,
    /// Rounds finished, per model (this one included).
    finished: Vec<u64>,
}

impl LockStep {
    pub fn new(num_models: usize, me: usize) -> Self {
        Self {
            me,
            finished: vec![0; num_models],
        }
    }

    /// A peer reports that it finished `round`.
    pub fn peer_finished(&mut self, peer: usize, round: u64) {
        let r = &mut self.finished[peer];
        *r = (*r).max(round);
    }

    /// Whether this model may run its next round now.
    pub fn may_start(&self, has_work: bool) -> bool {
        let mine = self.finished[self.me];
        let peers = || {
            self.finished
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != self.me)
        };
        peers().all(|(_, &r)| r >= mine) && (has_work || peers().any(|(_, &r)| r > mine))
    }

    /// Marks this model's round done; returns its number, to be sent to every peer.
    pub fn finish_round(&mut self) -> u64 {
        self.finished[self.me] += 1;
        self.finished[self.me]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_waits_for_every_peer_to_finish_the_round() {
        let mut a = LockStep::new(2, 0);
        assert!(a.may_start(true));
        assert_eq!(a.finish_round(), 1);
        assert!(!a.may_start(true), "peer 1 has not finished round 1");
        a.peer_finished(1, 1);
        assert!(a.may_start(true));
    }

    #[test]
    fn an_idle_model_follows_a_peer_that_moved_ahead_and_rests_otherwise() {
        let mut b = LockStep::new(2, 1);
        assert!(!b.may_start(false));
        b.peer_finished(0, 1);
        assert!(b.may_start(false), "an empty step keeps the rounds in step");
        b.finish_round();
        assert!(!b.may_start(false));
    }
}
