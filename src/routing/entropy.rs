//! Entropy threshold: the SLM generates until its next-token entropy exceeds `threshold`; that
//! token is dropped and the LLM generates it instead, then hands the request straight back.

use super::{
    BatchFeatures, FeatureNeeds, ModelIndex, Pair, Route, RoutingAlgorithm, SendPlan, StepView,
};

pub struct EntropyThreshold {
    pair: Pair,
    threshold: f32,
}

impl EntropyThreshold {
    pub fn new(pair: Pair, threshold: f32) -> Self {
        Self { pair, threshold }
    }
}

impl RoutingAlgorithm for EntropyThreshold {
    fn name(&self) -> &'static str {
        "entropy"
    }

    fn needs(&self) -> FeatureNeeds {
        FeatureNeeds { entropy: true }
    }

    fn first_model(&self, _prompt: &[u32]) -> ModelIndex {
        self.pair.slm
    }

    fn route(
        &self,
        model: ModelIndex,
        features: &BatchFeatures,
        batch: &[StepView],
        out: &mut Vec<Route>,
    ) {
        let Pair { slm, llm } = self.pair;
        super::route_rows(batch, out, |i, _| {
            if model == llm {
                Route::Move(slm)
            } else if features.entropy[i] > self.threshold {
                Route::Move(llm)
            } else {
                Route::Stay
            }
        });
    }

    fn send(&self, from: ModelIndex, _to: ModelIndex, _step: &StepView) -> SendPlan {
        SendPlan {
            keep_token: from == self.pair.llm,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(model: ModelIndex) -> StepView {
        StepView {
            model,
            token: 7,
            tokens_here: 0,
            generated: 3,
        }
    }

    #[test]
    fn uncertain_slm_tokens_go_to_the_llm_which_returns_after_one() {
        let algo = EntropyThreshold::new(Pair { slm: 0, llm: 1 }, 1.0);
        let mut out = Vec::new();
        let entropy = [0.5, 1.5];
        let features = BatchFeatures { entropy: &entropy };
        algo.route(0, &features, &[view(0), view(0)], &mut out);
        assert_eq!(out, [Route::Stay, Route::Move(1)]);
        assert!(!algo.send(0, 1, &view(0)).keep_token);
        algo.route(1, &features, &[view(1), view(1)], &mut out);
        assert_eq!(out, [Route::Move(0), Route::Move(0)]);
        assert!(algo.send(1, 0, &view(1)).keep_token);
    }
}
