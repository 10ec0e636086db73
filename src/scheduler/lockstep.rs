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

    /// Marks this model's round done; returns its number, to be sent to every peer. An
    /// empty round (nothing computed) catches up with the slowest peer at once, as that many
    /// empty rounds in a row would: a model that joins late (a subserver's new session)
    /// does not replay every round it missed.
    pub fn finish_round(&mut self, empty: bool) -> u64 {
        let slowest = (0..self.finished.len())
            .filter(|&i| i != self.me)
            .map(|i| self.finished[i])
            .min()
            .unwrap_or(0);
        let mine = &mut self.finished[self.me];
        let next = mine.saturating_add(1);
        *mine = if empty { next.max(slowest) } else { next };
        *mine
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_waits_for_every_peer_to_finish_the_round() {
        let mut a = LockStep::new(2, 0);
        assert!(a.may_start(true));
        assert_eq!(a.finish_round(false), 1);
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
        b.finish_round(true);
        assert!(!b.may_start(false));
    }

    #[test]
    fn a_late_joiner_catches_up_in_one_empty_round() {
        let mut late = LockStep::new(3, 2);
        late.peer_finished(0, 40);
        late.peer_finished(1, 41);
        assert!(late.may_start(false));
        assert_eq!(late.finish_round(true), 40, "as far as the slowest peer");
        assert!(late.may_start(false), "peer 1 is still ahead");
        assert_eq!(late.finish_round(true), 41);
        assert!(!late.may_start(false));
        assert_eq!(late.finish_round(false), 42, "a computed round counts one");
    }
}
