//! Query-level routing, the baseline token-level routing is measured against: the whole
//! request runs on one model. By prompt length or by a hashed fraction the model is chosen
//! before prefill; by entropy the SLM prefills and, when its first-token entropy (how unsure
//! it is where to start) exceeds the threshold, the LLM takes the request over for good.

use std::hash::{DefaultHasher, Hash, Hasher};

use super::{route_rows, BatchFeatures, FeatureNeeds, ModelIndex, Pair, Route, RoutingAlgorithm};
use super::{SendPlan, StepView};
use crate::config::QueryRule;

pub struct QueryLevel {
    pair: Pair,
    rule: QueryRule,
    threshold: f64,
}

impl QueryLevel {
    pub fn new(pair: Pair, rule: QueryRule, threshold: f64) -> Self {
        Self {
            pair,
            rule,
            threshold,
        }
    }

    /// A prompt's place in [0, 1), the same on every run.
    fn position(prompt: &[u32]) -> f64 {
        let mut h = DefaultHasher::new();
        prompt.hash(&mut h);
        (h.finish() >> 11) as f64 / (1u64 << 53) as f64
    }
}

impl RoutingAlgorithm for QueryLevel {
    fn name(&self) -> &'static str {
        "query-level"
    }

    fn needs(&self) -> FeatureNeeds {
        FeatureNeeds {
            entropy: self.rule == QueryRule::Entropy,
            ..Default::default()
        }
    }

    fn first_model(&self, prompt: &[u32]) -> ModelIndex {
        let llm = match self.rule {
            QueryRule::Length => prompt.len() as f64 > self.threshold,
            QueryRule::Fraction => !prompt.is_empty() && Self::position(prompt) < self.threshold,
            QueryRule::Entropy => false,
        };
        if llm {
            self.pair.llm
        } else {
            self.pair.slm
        }
    }

    fn route(
        &self,
        model: ModelIndex,
        features: &BatchFeatures,
        batch: &[StepView],
        out: &mut Vec<Route>,
    ) {
        let decides = model == self.pair.slm && self.rule == QueryRule::Entropy;
        route_rows(batch, out, |i, step| {
            let first = step.generated == 0 && step.tokens_here == 0;
            match features.entropy.get(i) {
                Some(&h) if decides && first && h as f64 > self.threshold => {
                    Route::Move(self.pair.llm)
                }
                _ => Route::Stay,
            }
        });
    }

    fn send(&self, _from: ModelIndex, _to: ModelIndex, _step: &StepView) -> SendPlan {
        // The LLM answers from the start: it regenerates the first token.
        SendPlan { keep_token: false }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAIR: Pair = Pair { slm: 0, llm: 1 };

    fn first_step() -> StepView {
        StepView {
            request: 0,
            model: 0,
            token: 5,
            tokens_here: 0,
            generated: 0,
            carried: None,
            ..Default::default()
        }
    }

    #[test]
    fn long_prompts_go_to_the_llm() {
        let q = QueryLevel::new(PAIR, QueryRule::Length, 4.0);
        assert_eq!(q.first_model(&[1, 2, 3, 4]), 0);
        assert_eq!(q.first_model(&[1, 2, 3, 4, 5]), 1);
    }

    #[test]
    fn a_fraction_of_prompts_goes_to_the_llm() {
        let q = QueryLevel::new(PAIR, QueryRule::Fraction, 0.3);
        let to_llm = (0..2000u32)
            .filter(|&i| q.first_model(&[i, i + 1]) == 1)
            .count();
        assert!((500..700).contains(&to_llm), "{to_llm} of 2000");
        assert_eq!(
            q.first_model(&[7, 8]),
            q.first_model(&[7, 8]),
            "stable per prompt"
        );
        assert_eq!(
            QueryLevel::new(PAIR, QueryRule::Fraction, 0.0).first_model(&[1]),
            0
        );
    }

    #[test]
    fn an_unsure_first_token_hands_the_whole_request_over() {
        let q = QueryLevel::new(PAIR, QueryRule::Entropy, 1.0);
        assert!(q.needs().entropy);
        let mut out = Vec::new();
        let batch = [
            first_step(),
            StepView {
                request: 0,
                generated: 3,
                tokens_here: 3,
                ..first_step()
            },
        ];
        q.route(
            0,
            &BatchFeatures {
                entropy: &[2.0, 2.0],
                ..Default::default()
            },
            &batch,
            &mut out,
        );
        assert_eq!(
            out,
            [Route::Move(1), Route::Stay],
            "only the first token decides"
        );
        q.route(
            0,
            &BatchFeatures {
                entropy: &[0.5, 0.5],
                ..Default::default()
            },
            &batch,
            &mut out,
        );
        assert_eq!(out, [Route::Stay, Route::Stay]);
        q.route(
            1,
            &BatchFeatures {
                entropy: &[9.0, 9.0],
                ..Default::default()
            },
            &batch,
            &mut out,
        );
        assert_eq!(out, [Route::Stay, Route::Stay], "the LLM keeps it");
    }
}
