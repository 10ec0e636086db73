//! R2R (Roads to Rome): a neural router on the SLM side reads, for every token the SLM
//! samples, its last hidden state, the embedding of the sampled token and its top-k logits,
//! and sends the token to the LLM when the score is at least the threshold; the LLM produces
//! that one token and returns.

use super::head::{HeadKind, RouterHead};
use super::learned::LearnedDeferral;
use super::share::Cut;
use super::Pair;

/// The head kind this algorithm loads.
pub const KIND: HeadKind = HeadKind::R2r;

pub fn r2r(pair: Pair, head: RouterHead, cut: Cut) -> LearnedDeferral {
    LearnedDeferral {
        name: "r2r",
        pair,
        head,
        cut,
    }
}
