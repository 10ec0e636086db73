//! What the learned routers (R2R, CITER, Co-LLM) share: a [`RouterHead`] scores every token
//! the SLM samples, a [`Cut`] turns the score into "the LLM produces this token", and the
//! LLM, after producing it, hands the request straight back. The SLM's token is dropped when
//! deferring (the LLM regenerates that position); the LLM's is kept.
//!
//! The cut is a fixed threshold (the head kind's rule, `HeadKind::defers`) or a share of
//! tokens kept on the LLM (`super::share::ShareControl`).

use super::head::{HeadInputs, RouterHead};
use super::share::Cut;
use super::{
    route_rows, BatchFeatures, FeatureNeeds, ModelIndex, Pair, Route, RoutingAlgorithm, SendPlan,
    StepView,
};

/// A learned token-level deferral from the SLM to the LLM.
pub struct LearnedDeferral {
    pub name: &'static str,
    pub pair: Pair,
    pub head: RouterHead,
    pub cut: Cut,
}

impl LearnedDeferral {
    /// The head's scores for a batch the SLM sampled; a head that fails keeps every token
    /// on the SLM (and says so in the log) rather than failing the requests.
    fn scores(&self, features: &BatchFeatures, rows: usize) -> Vec<f32> {
        let inputs = HeadInputs {
            rows,
            hidden: features.hidden,
            token_embedding: features.token_embedding,
            top_logits: features.top_logits,
        };
        self.head.scores(&inputs).unwrap_or_else(|e| {
            tracing::error!(router = self.name, "router head failed: {e}");
            Vec::new()
        })
    }
}

impl RoutingAlgorithm for LearnedDeferral {
    fn name(&self) -> &'static str {
        self.name
    }

    fn needs(&self) -> FeatureNeeds {
        self.head.needs()
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
        if model != self.pair.slm {
            // The LLM produced its one token: back to the SLM.
            return route_rows(batch, out, |_, _| Route::Move(self.pair.slm));
        }
        let scores = self.scores(features, batch.len());
        let kind = self.head.config.kind;
        let defer = self
            .cut
            .decide(&scores, |s, t| kind.defers(s, t), |s| kind.urgency(s));
        route_rows(batch, out, |i, _| match defer.get(i) {
            Some(true) => Route::Move(self.pair.llm),
            _ => Route::Stay,
        });
    }

    fn send(&self, from: ModelIndex, _to: ModelIndex, _step: &StepView) -> SendPlan {
        SendPlan {
            keep_token: from != self.pair.slm,
        }
    }
}
