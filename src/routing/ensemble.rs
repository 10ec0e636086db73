//! Multi-model ensemble (ME), token by token over any number of models: every model in turn
//! proposes its token for the position with a confidence (the probability it gives its own
//! most likely token) times its configured weight; the request carries the best proposal from
//! model to model without committing anything, and the last model commits the winner (earlier,
//! cheaper models win ties) and sends the request back to the first for the next position.
//! Every position costs one step on every model: the price of asking all of them.

use super::{
    BatchFeatures, Candidate, FeatureNeeds, ModelIndex, Route, RoutingAlgorithm, SendPlan, StepView,
};

pub struct Ensemble {
    /// Weight per model, in `[[models]]` order (also the order of the round).
    weights: Vec<f32>,
}

impl Ensemble {
    pub fn new(weights: Vec<f32>) -> Self {
        Self { weights }
    }
}

impl RoutingAlgorithm for Ensemble {
    fn name(&self) -> &'static str {
        "ensemble"
    }

    fn needs(&self) -> FeatureNeeds {
        FeatureNeeds {
            max_prob: true,
            ..Default::default()
        }
    }

    fn first_model(&self, _prompt: &[u32]) -> ModelIndex {
        0
    }

    fn route(
        &self,
        model: ModelIndex,
        features: &BatchFeatures,
        batch: &[StepView],
        out: &mut Vec<Route>,
    ) {
        let weight = self.weights.get(model).copied().unwrap_or(1.0);
        let last = model + 1 >= self.weights.len();
        out.clear();
        out.extend(batch.iter().enumerate().map(|(i, step)| {
            let own = Candidate {
                token: step.token,
                model,
                score: weight * features.max_prob.get(i).copied().unwrap_or(0.0),
            };
            let best = match step.carried {
                Some(c) if c.score >= own.score => c,
                _ => own,
            };
            if last {
                Route::Decide { best, next: 0 }
            } else {
                Route::Pass {
                    to: model + 1,
                    best,
                }
            }
        }));
    }

    fn send(&self, _from: ModelIndex, _to: ModelIndex, _step: &StepView) -> SendPlan {
        SendPlan { keep_token: false }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(token: u32, carried: Option<Candidate>) -> StepView {
        StepView {
            request: 0,
            model: 0,
            token,
            tokens_here: 0,
            generated: 0,
            carried,
            ..Default::default()
        }
    }

    #[test]
    fn the_best_weighted_confidence_travels_and_the_last_model_decides() {
        let e = Ensemble::new(vec![1.0, 2.0, 0.5]);
        let mut out = Vec::new();
        let f = |p: &'static [f32]| BatchFeatures {
            max_prob: p,
            ..Default::default()
        };
        e.route(0, &f(&[0.6]), &[step(7, None)], &mut out);
        let first = Candidate {
            token: 7,
            model: 0,
            score: 0.6,
        };
        assert_eq!(out, [Route::Pass { to: 1, best: first }]);
        // Model 1: 2.0 × 0.4 = 0.8 beats 0.6.
        e.route(1, &f(&[0.4]), &[step(9, Some(first))], &mut out);
        let second = Candidate {
            token: 9,
            model: 1,
            score: 0.8,
        };
        assert_eq!(
            out,
            [Route::Pass {
                to: 2,
                best: second
            }]
        );
        // Model 2: 0.5 × 0.9 = 0.45 loses; it decides for model 1's token.
        e.route(2, &f(&[0.9]), &[step(3, Some(second))], &mut out);
        assert_eq!(
            out,
            [Route::Decide {
                best: second,
                next: 0
            }]
        );
        // A tie goes to the earlier model.
        e.route(2, &f(&[1.6]), &[step(3, Some(second))], &mut out);
        assert_eq!(
            out,
            [Route::Decide {
                best: second,
                next: 0
            }]
        );
    }
}
