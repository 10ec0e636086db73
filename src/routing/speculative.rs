//! Speculative decoding as a routing algorithm: the SLM drafts `k` tokens, the LLM verifies
//! them in one forward pass, commits the longest prefix its own sampling agrees with and one
//! token of its own, and hands back; the SLM takes back its rejected drafts and drafts on.
//! Greedy decoding gives exactly the LLM's output; with temperature > 0 the verification is
//! speculative sampling's (accept with min(1, p/q), else draw from max(0, p - q)), so the
//! output follows the LLM's distribution exactly. The lossless point of the speed–quality
//! frontier, in the same runtime as the lossy routers.
//!
//! The runtime does the verifying and the rollback ([`Route::Draft`]); the algorithm only
//! says how many tokens to draft. With a fixed `k` it drafts `k`; with
//! [`DraftLength::Auto`] it picks per request the `k` that maximises the expected tokens
//! per unit of cost, `(1 - a^(k+1)) / ((1 - a) (1 + c k))`, for the request's measured
//! acceptance `a` ([`Speculation::acceptance`]) and the cost `c` of a draft step relative to a
//! verification (the models' streamed weight bytes: decoding is memory-bound).

use super::{route_rows, BatchFeatures, FeatureNeeds, ModelIndex, Pair, Route};
use super::{RoutingAlgorithm, SendPlan, Speculation, StepView};
use crate::config::MAX_DRAFT_TOKENS;

/// The cost of a draft step relative to a verification when the models' sizes are unknown.
pub const DEFAULT_DRAFT_COST: f64 = 0.3;

/// The most tokens [`DraftLength::Auto`] drafts.
pub const MAX_AUTO_DRAFT: usize = 8;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DraftLength {
    Fixed(usize),
    /// Chosen per request from its acceptance so far, at most `max` (a verification computes
    /// `k + 1` positions in one step, within the step's token budget); `cost` is a draft
    /// step's cost relative to a verification.
    Auto {
        cost: f64,
        max: usize,
    },
}

pub struct Speculative {
    pair: Pair,
    draft: DraftLength,
}

impl Speculative {
    pub fn new(pair: Pair, draft: DraftLength) -> Self {
        Self { pair, draft }
    }

    /// How many tokens to draft before the next verification.
    pub fn draft_length(&self, speculation: &Speculation) -> usize {
        match self.draft {
            DraftLength::Fixed(k) => k.clamp(1, MAX_DRAFT_TOKENS),
            DraftLength::Auto { cost, max } => {
                best_draft_length(speculation.acceptance(), cost, max)
            }
        }
    }
}

/// The `k` in `1..=max` with the most expected tokens per unit of cost, for acceptance `a`
/// and a draft step costing `cost` verifications.
fn best_draft_length(a: f64, cost: f64, max: usize) -> usize {
    let a = a.clamp(0.0, 0.999);
    let rate = |k: usize| (1.0 - a.powi(k as i32 + 1)) / ((1.0 - a) * (1.0 + cost * k as f64));
    (1..=max.max(1))
        .max_by(|&x, &y| rate(x).total_cmp(&rate(y)))
        .unwrap_or(1)
}

impl RoutingAlgorithm for Speculative {
    fn name(&self) -> &'static str {
        "speculative"
    }

    fn needs(&self) -> FeatureNeeds {
        FeatureNeeds {
            distribution: true,
            ..FeatureNeeds::default()
        }
    }

    fn first_model(&self, _prompt: &[u32]) -> ModelIndex {
        self.pair.slm
    }

    fn route(
        &self,
        model: ModelIndex,
        _: &BatchFeatures,
        batch: &[StepView],
        out: &mut Vec<Route>,
    ) {
        route_rows(batch, out, |_, step| {
            if model == self.pair.slm {
                Route::Draft {
                    verifier: self.pair.llm,
                    send: step.drafts + 1 >= self.draft_length(&step.speculation),
                }
            } else {
                Route::Move(self.pair.slm)
            }
        });
    }

    /// The verifier's own token is committed before the request goes back to draft.
    fn send(&self, _: ModelIndex, _: ModelIndex, _: &StepView) -> SendPlan {
        SendPlan { keep_token: true }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAIR: Pair = Pair { slm: 0, llm: 1 };

    fn routes(algo: &Speculative, model: ModelIndex, drafts: usize) -> Route {
        let view = StepView {
            model,
            drafts,
            ..StepView::default()
        };
        let mut out = Vec::new();
        algo.route(model, &BatchFeatures::default(), &[view], &mut out);
        out[0]
    }

    #[test]
    fn the_slm_drafts_k_tokens_then_the_llm_verifies_and_hands_back() {
        let algo = Speculative::new(PAIR, DraftLength::Fixed(3));
        let draft = |send| Route::Draft { verifier: 1, send };
        assert_eq!(routes(&algo, 0, 0), draft(false));
        assert_eq!(routes(&algo, 0, 1), draft(false));
        assert_eq!(routes(&algo, 0, 2), draft(true));
        assert_eq!(routes(&algo, 1, 0), Route::Move(0));
        assert_eq!(algo.first_model(&[1, 2]), 0);
    }

    /// The expected tokens per cost, checked by hand: at a = 0.9 and c = 0.35, k = 4 gives
    /// 4.10 / 2.4 = 1.71 against 1.68 at k = 3 and 1.70 at k = 5; poor acceptance drafts one.
    #[test]
    fn auto_drafts_more_the_more_is_accepted() {
        assert_eq!(best_draft_length(0.9, 0.35, MAX_AUTO_DRAFT), 4);
        assert_eq!(best_draft_length(0.2, 0.35, MAX_AUTO_DRAFT), 1);
        assert_eq!(
            best_draft_length(0.99, 0.05, MAX_AUTO_DRAFT),
            MAX_AUTO_DRAFT
        );
        assert_eq!(
            best_draft_length(0.99, 0.05, 3),
            3,
            "the step's token budget caps it"
        );
        let algo = Speculative::new(
            PAIR,
            DraftLength::Auto {
                cost: 0.35,
                max: MAX_AUTO_DRAFT,
            },
        );
        let good = Speculation {
            drafted: 400,
            accepted: 360,
            rejections: 40,
            verifications: 90,
        };
        let poor = Speculation {
            accepted: 10,
            rejections: 40,
            ..good
        };
        assert!(algo.draft_length(&good) > algo.draft_length(&poor));
    }
}
