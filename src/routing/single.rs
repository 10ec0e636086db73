//! Single-model pass-through: every request stays on one model. The baseline every routed
//! configuration is compared with.

use super::{BatchFeatures, ModelIndex, Route, RoutingAlgorithm, SendPlan, StepView};

pub struct SingleModel {
    model: ModelIndex,
}

impl SingleModel {
    pub fn new(model: ModelIndex) -> Self {
        Self { model }
    }
}

impl RoutingAlgorithm for SingleModel {
    fn name(&self) -> &'static str {
        "single"
    }

    fn first_model(&self, _prompt: &[u32]) -> ModelIndex {
        self.model
    }

    fn route(&self, _: ModelIndex, _: &BatchFeatures, batch: &[StepView], out: &mut Vec<Route>) {
        super::route_rows(batch, out, |_, _| Route::Stay);
    }

    fn send(&self, _: ModelIndex, _: ModelIndex, _: &StepView) -> SendPlan {
        SendPlan { keep_token: true }
    }
}
