//! R-Stitch: symmetric entropy switching. The SLM hands over when its entropy exceeds `high`
//! (dropping the uncertain token, which the LLM regenerates); the LLM keeps generating until
//! its own entropy falls below `low`, then commits that token and hands back.

use super::share::Cut;
use super::{
    BatchFeatures, FeatureNeeds, ModelIndex, Pair, Route, RoutingAlgorithm, SendPlan, StepView,
};

pub struct RStitch {
    name: &'static str,
    pair: Pair,
    /// When the SLM hands over: above an entropy, or among the highest share served.
    high: Cut,
    low: f32,
}

impl RStitch {
    pub fn new(pair: Pair, high: f32, low: f32) -> Self {
        Self::named("r-stitch", pair, Cut::Threshold(high), low)
    }

    /// The same rule under another algorithm's name (see `entropy.rs`).
    pub fn named(name: &'static str, pair: Pair, high: Cut, low: f32) -> Self {
        Self {
            name,
            pair,
            high,
            low,
        }
    }
}

impl RoutingAlgorithm for RStitch {
    fn name(&self) -> &'static str {
        self.name
    }

    fn needs(&self) -> FeatureNeeds {
        FeatureNeeds {
            entropy: true,
            ..FeatureNeeds::default()
        }
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
        let entropy = &features.entropy[..batch.len()];
        let up = match model {
            m if m == slm => self.high.decide(entropy, |h, t| h > t, |h| h),
            _ => Vec::new(),
        };
        super::route_rows(batch, out, |i, _| match model {
            m if m == slm && up[i] => Route::Move(llm),
            m if m == llm && entropy[i] < self.low => Route::Move(slm),
            _ => Route::Stay,
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

    #[test]
    fn switches_up_above_high_and_down_below_low() {
        let algo = RStitch::new(Pair { slm: 0, llm: 1 }, 2.0, 0.5);
        let v = |model| StepView {
            request: 0,
            model,
            token: 1,
            tokens_here: 4,
            generated: 9,
            carried: None,
            ..Default::default()
        };
        let entropy = [0.1, 1.0, 3.0];
        let features = BatchFeatures {
            entropy: &entropy,
            ..Default::default()
        };
        let mut out = Vec::new();
        algo.route(0, &features, &[v(0), v(0), v(0)], &mut out);
        assert_eq!(out, [Route::Stay, Route::Stay, Route::Move(1)]);
        algo.route(1, &features, &[v(1), v(1), v(1)], &mut out);
        assert_eq!(out, [Route::Move(0), Route::Stay, Route::Stay]);
        assert!(!algo.send(0, 1, &v(0)).keep_token);
        assert!(algo.send(1, 0, &v(1)).keep_token);
    }
}
