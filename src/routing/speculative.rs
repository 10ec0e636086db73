//! Speculative decoding as a routing algorithm: the SLM drafts `k` tokens, the LLM verifies
//! them in one forward pass, commits the longest prefix its own sampling agrees with and one
//! token of its own, and hands back; the SLM takes back its rejected drafts and drafts on.
//! Greedy decoding gives exactly the LLM's output; with temperature > 0 the verification is
//! speculative sampling's (accept with min(1, p/q), else draw from max(0, p - q)), so the
//! output follows the LLM's distribution exactly. The lossless point of the speed–quality
//! frontier, in the same runtime as the lossy routers.
//!
//! The runtime does the verifying and the rollback ([`Route::Draft`]); the algorithm only
//! says how many tokens to draft. With a fixed `k` it drafts `k`. With
//! [`DraftLength::Auto`] it picks per request, each step, the `k` in `0..=max` with the most
//! expected tokens per unit of time for a request in a batch of `B` alike (`B` the step's
//! batch), for the request's measured acceptance `a` ([`Speculation::acceptance`]):
//!
//! `B (1 - a^(k+1)) / (1 - a)  /  (1 + (B (k + 1) - 1) r  +  k c (1 + (B - 1) r_d))`
//!
//! in units of a one-row step of the verifier: the verification of `B` requests is one step
//! of `B (k + 1)` rows, each row past the first adding `r`; the `k` draft steps of `B` rows
//! cost `c` each plus `r_d` of the drafter's own step per row past the first. `k = 0` is the
//! verifier decoding alone (one token per step of `B` rows): where the batch makes verified
//! rows cost more than they save (a busy CPU, whose batched decode already shares the weight
//! reads) the request stays on the verifier until the batch shrinks. A poor acceptance alone
//! shortens the drafts to one but never stops them, or it would never be measured again.
//! The runtime times both models at start-up ([`RoutingAlgorithm::price`]): on a GPU rows
//! are nearly free (`r` ≈ 0), on a CPU each costs a fifth of a decode step or more. Until
//! then `c` is the models' weight-byte ratio (decoding is memory-bound) and `r`, `r_d` are 0.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use super::{route_rows, BatchFeatures, FeatureNeeds, ModelIndex, Pair, Route, RowCosts};
use super::{RoutingAlgorithm, SendPlan, Speculation, StepView};
use crate::config::MAX_DRAFT_TOKENS;

/// The cost of a draft step relative to a verification when the models' sizes are unknown.
pub const DEFAULT_DRAFT_COST: f64 = 0.3;

/// The most tokens [`DraftLength::Auto`] drafts.
pub const MAX_AUTO_DRAFT: usize = 8;

/// What drafting costs, in one-row steps of the verifier: `draft` a draft step (`c`), `row`
/// each verified row past the first (`r`), `draft_row` each drafted row past the first in a
/// draft step, relative to that step (`r_d`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DraftPrices {
    pub draft: f64,
    pub row: f64,
    pub draft_row: f64,
}

impl DraftPrices {
    /// A draft step's cost alone, rows free: what the models' sizes say before timing.
    pub fn unmeasured(draft: f64) -> Self {
        Self {
            draft,
            row: 0.0,
            draft_row: 0.0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DraftLength {
    Fixed(usize),
    /// Chosen per request and step from its acceptance so far and the step's batch, at most
    /// `max` (a verification computes `k + 1` positions in one step, within the step's token
    /// budget), with `prices` until measured.
    Auto {
        prices: DraftPrices,
        max: usize,
    },
}

pub struct Speculative {
    pair: Pair,
    draft: DraftLength,
    /// [`DraftLength::Auto`]'s prices as measured on this machine.
    measured: OnceLock<DraftPrices>,
    /// Requests in the verifier's latest step: where that batch stops drafts, a new request
    /// starts on the verifier rather than prefilling its prompt on both models.
    verifier_batch: AtomicUsize,
}

impl Speculative {
    pub fn new(pair: Pair, draft: DraftLength) -> Self {
        Self {
            pair,
            draft,
            measured: OnceLock::new(),
            verifier_batch: AtomicUsize::new(0),
        }
    }

    /// How many tokens to draft before the next verification, for a request in a step of
    /// `batch` requests; 0: none, the verifier decodes.
    pub fn draft_length(&self, speculation: &Speculation, batch: usize) -> usize {
        match self.draft {
            DraftLength::Fixed(k) => k.clamp(1, MAX_DRAFT_TOKENS),
            DraftLength::Auto { prices, max } => {
                let prices = self.measured.get().unwrap_or(&prices);
                best_draft_length(speculation.acceptance(), prices, batch, max)
            }
        }
    }
}

/// The number of drafts with the most expected tokens per unit of time (see the module's
/// text) for acceptance `a` and a batch of `batch` requests: 0 where none pays even at an
/// acceptance of at least the prior's (a new request's [`Speculation::acceptance`]: the
/// batch's cost alone decides that, since a request that stopped drafting for its
/// acceptance would never measure it again), else the best in `1..=max`.
fn best_draft_length(a: f64, prices: &DraftPrices, batch: usize, max: usize) -> usize {
    let b = batch.max(1) as f64;
    let best = |a: f64, ks: std::ops::RangeInclusive<usize>| {
        let a = a.clamp(0.0, 0.999);
        let rate = |k: usize| {
            let k = k as f64;
            let tokens = (1.0 - a.powf(k + 1.0)) / (1.0 - a);
            let verify = 1.0 + (b * (k + 1.0) - 1.0) * prices.row;
            let drafts = k * prices.draft * (1.0 + (b - 1.0) * prices.draft_row);
            b * tokens / (verify + drafts)
        };
        ks.max_by(|&x, &y| rate(x).total_cmp(&rate(y))).unwrap_or(0)
    };
    if best(a.max(Speculation::default().acceptance()), 0..=max) == 0 {
        0
    } else {
        best(a, 1..=max.max(1))
    }
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
        let batch = self.verifier_batch.load(Ordering::Relaxed);
        // A new request's acceptance is the prior.
        if batch > 0 && self.draft_length(&Speculation::default(), batch) == 0 {
            self.pair.llm
        } else {
            self.pair.slm
        }
    }

    fn route(
        &self,
        model: ModelIndex,
        _: &BatchFeatures,
        batch: &[StepView],
        out: &mut Vec<Route>,
    ) {
        if model == self.pair.llm {
            self.verifier_batch.store(batch.len(), Ordering::Relaxed);
        }
        route_rows(batch, out, |_, step| {
            let k = self.draft_length(&step.speculation, batch.len());
            if model == self.pair.slm {
                // The token just drafted is one draft, even where none pays: it is sent.
                Route::Draft {
                    verifier: self.pair.llm,
                    send: step.drafts + 1 >= k,
                }
            } else if k == 0 {
                Route::Stay
            } else {
                Route::Move(self.pair.slm)
            }
        });
    }

    /// The verifier's own token is committed before the request goes back to draft.
    fn send(&self, _: ModelIndex, _: ModelIndex, _: &StepView) -> SendPlan {
        SendPlan { keep_token: true }
    }

    /// The verifier is timed at its longest verification.
    fn priced_rows(&self) -> Option<usize> {
        match self.draft {
            DraftLength::Auto { max, .. } => Some(max + 1),
            DraftLength::Fixed(_) => None,
        }
    }

    fn price(&self, costs: &[Option<RowCosts>]) {
        let at = |m: ModelIndex| costs.get(m).copied().flatten();
        let (Some(slm), Some(llm)) = (at(self.pair.slm), at(self.pair.llm)) else {
            return;
        };
        if llm.step_s > 0.0 && slm.step_s > 0.0 {
            let measured = DraftPrices {
                draft: slm.step_s / llm.step_s,
                row: llm.row_s / llm.step_s,
                draft_row: slm.row_s / slm.step_s,
            };
            tracing::info!(
                draft = measured.draft,
                row = measured.row,
                draft_row = measured.draft_row,
                "speculative decoding prices drafts in one-row steps of the verifier"
            );
            let _ = self.measured.set(measured);
        }
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

    fn auto(draft: f64) -> Speculative {
        Speculative::new(
            PAIR,
            DraftLength::Auto {
                prices: DraftPrices::unmeasured(draft),
                max: MAX_AUTO_DRAFT,
            },
        )
    }

    /// 360 of 400 examined drafts accepted: a = 363 / 404 with the prior.
    const GOOD: Speculation = Speculation {
        drafted: 400,
        accepted: 360,
        rejections: 40,
        verifications: 90,
    };

    /// The expected tokens per cost, checked by hand with rows free (`r = 0`) and one
    /// request: at a = 0.9 and c = 0.35, k = 4 gives 4.10 / 2.4 = 1.71 against 1.68 at k = 3
    /// and 1.70 at k = 5. At a = 0.2 one draft gives 1.2 / 1.35 = 0.89 tokens per step, fewer
    /// than the verifier decoding alone, but at the prior's 0.75 it gives 1.75 / 1.35: it
    /// drafts one, and goes on measuring.
    #[test]
    fn auto_drafts_more_the_more_is_accepted() {
        let free = DraftPrices::unmeasured(0.35);
        assert_eq!(best_draft_length(0.9, &free, 1, MAX_AUTO_DRAFT), 4);
        assert_eq!(best_draft_length(0.2, &free, 1, MAX_AUTO_DRAFT), 1);
        let cheap = DraftPrices::unmeasured(0.05);
        assert_eq!(
            best_draft_length(0.99, &cheap, 1, MAX_AUTO_DRAFT),
            MAX_AUTO_DRAFT
        );
        assert_eq!(
            best_draft_length(0.99, &cheap, 1, 3),
            3,
            "the step's token budget caps it"
        );
        let poor = Speculation {
            accepted: 10,
            rejections: 40,
            ..GOOD
        };
        let algo = auto(0.35);
        assert!(algo.draft_length(&GOOD, 1) > algo.draft_length(&poor, 1));
    }

    /// Measured costs replace the defaults: c = 0.27, r = 0.22, r_d = 0.3 (as timed on a
    /// 2-core CPU), a = 363 / 404, by hand. One request: k = 3 gives 3.43 / 2.47 = 1.39 against
    /// 1.37 at k = 2 and 1.38 at k = 4 (with rows free, k = 5: 4.67 / 2.35 = 1.99). Four: k = 1
    /// gives 4 · 1.90 / 3.05 = 2.49 against 2.41 decoding alone and 2.43 at k = 2. Sixteen:
    /// decoding alone gives 16 / 4.3 = 3.72 against 3.27 at k = 1, so the request stays.
    #[test]
    fn measured_row_costs_shorten_the_drafts_and_a_busy_verifier_decodes() {
        let algo = auto(0.27);
        assert_eq!(algo.priced_rows(), Some(MAX_AUTO_DRAFT + 1));
        assert_eq!(
            Speculative::new(PAIR, DraftLength::Fixed(4)).priced_rows(),
            None
        );
        assert_eq!(algo.draft_length(&GOOD, 1), 5);
        // A remote verifier is not timed: the defaults stay.
        let slm = RowCosts {
            step_s: 0.0081,
            row_s: 0.00243,
        };
        algo.price(&[Some(slm), None]);
        assert_eq!(algo.draft_length(&GOOD, 1), 5);
        let llm = RowCosts {
            step_s: 0.03,
            row_s: 0.0066,
        };
        algo.price(&[Some(slm), Some(llm)]);
        assert_eq!(algo.draft_length(&GOOD, 1), 3);
        assert_eq!(algo.draft_length(&GOOD, 4), 1);
        assert_eq!(algo.draft_length(&GOOD, 16), 0);
        // In a batch of 16, the verifier keeps the request; the drafter sends its draft.
        let view = |model| StepView {
            model,
            speculation: GOOD,
            ..StepView::default()
        };
        let mut out = Vec::new();
        algo.route(1, &BatchFeatures::default(), &[view(1); 16], &mut out);
        assert!(out.iter().all(|r| *r == Route::Stay), "{out:?}");
        algo.route(0, &BatchFeatures::default(), &[view(0); 16], &mut out);
        let sent = Route::Draft {
            verifier: 1,
            send: true,
        };
        assert!(out.iter().all(|r| *r == sent), "{out:?}");
        // While the verifier's batch is that large, new requests start on it.
        assert_eq!(algo.first_model(&[1, 2]), 1);
        algo.route(1, &BatchFeatures::default(), &[view(1)], &mut out);
        assert_eq!(out, [Route::Move(0)]);
        assert_eq!(algo.first_model(&[1, 2]), 0);
    }
}
