//! Co-LLM: a learned deferral gate (a linear probe on the SLM's hidden state, sigmoid) decides
//! per token whether the LLM generates it; above the threshold it does, then hands back.

use super::head::{HeadKind, RouterHead};
use super::learned::LearnedDeferral;
use super::share::Cut;
use super::Pair;

/// The head kind this algorithm loads.
pub const KIND: HeadKind = HeadKind::CoLlm;

pub fn co_llm(pair: Pair, head: RouterHead, cut: Cut) -> LearnedDeferral {
    LearnedDeferral {
        name: "co-llm",
        pair,
        head,
        cut,
    }
}
