//! CITER: an MLP on the SLM's hidden state scores its confidence in the token it just sampled;
//! a token whose confidence falls below the threshold is produced by the LLM instead, which
//! then hands back.

use super::head::{HeadKind, RouterHead};
use super::learned::LearnedDeferral;
use super::share::Cut;
use super::Pair;

/// The head kind this algorithm loads.
pub const KIND: HeadKind = HeadKind::Citer;

pub fn citer(pair: Pair, head: RouterHead, cut: Cut) -> LearnedDeferral {
    LearnedDeferral {
        name: "citer",
        pair,
        head,
        cut,
    }
}
