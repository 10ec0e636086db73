//! Entropy threshold: the SLM generates until its next-token entropy exceeds `threshold`; that
//! token is dropped and the LLM generates it instead, then hands the request straight back.
//! That is R-Stitch whose LLM always hands back (its `low` threshold is infinite), so it is
//! built as one. With a target share instead of a threshold, the cut-off follows the
//! entropies served ([`super::share::ShareControl`]).

use super::rstitch::RStitch;
use super::share::Cut;
use super::Pair;

/// The entropy algorithm with its cut-off: a threshold in nats, or a target share of the
/// SLM's tokens ([`super::share::ShareControl`]).
pub fn entropy(pair: Pair, cut: Cut) -> RStitch {
    RStitch::named("entropy", pair, cut, f32::INFINITY)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::share::ShareControl;
    use crate::routing::{BatchFeatures, ModelIndex, Route, RoutingAlgorithm, StepView};

    fn view(model: ModelIndex) -> StepView {
        StepView {
            request: 0,
            model,
            token: 7,
            tokens_here: 0,
            generated: 3,
            carried: None,
            ..Default::default()
        }
    }

    #[test]
    fn uncertain_slm_tokens_go_to_the_llm_which_returns_after_one() {
        let algo = entropy(Pair { slm: 0, llm: 1 }, Cut::Threshold(1.0));
        let mut out = Vec::new();
        let entropy = [0.5, 1.5];
        let features = BatchFeatures {
            entropy: &entropy,
            ..Default::default()
        };
        algo.route(0, &features, &[view(0), view(0)], &mut out);
        assert_eq!(out, [Route::Stay, Route::Move(1)]);
        assert!(!algo.send(0, 1, &view(0)).keep_token);
        algo.route(1, &features, &[view(1), view(1)], &mut out);
        assert_eq!(out, [Route::Move(0), Route::Move(0)]);
        assert!(algo.send(1, 0, &view(1)).keep_token);
    }

    #[test]
    fn a_share_sends_the_most_uncertain_tokens() {
        let algo = entropy(Pair { slm: 0, llm: 1 }, Cut::Share(ShareControl::new(0.25)));
        let mut out = Vec::new();
        let entropy = [0.5, 3.0, 1.0, 2.0];
        let features = BatchFeatures {
            entropy: &entropy,
            ..Default::default()
        };
        algo.route(0, &features, &[view(0); 4], &mut out);
        assert_eq!(out, [Route::Stay, Route::Move(1), Route::Stay, Route::Stay]);
    }
}
