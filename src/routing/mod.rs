//! The routing interface: algorithms written from one request's point of view.
//!
//! * [`RoutingAlgorithm::route`]: after a forward pass on some model, where each request's next
//!   step runs. The runtime calls it once per batch with the batch's features.
//! * [`RoutingAlgorithm::send`]: what crosses when a request moves: whether the token just
//!   sampled is kept (committed here, extended by the peer) or dropped (the peer regenerates
//!   that position).
//! * [`RoutingAlgorithm::receive`]: how the peer resumes: extend its KV with the tokens produced
//!   elsewhere (the default) or recompute the whole prefix.
//!
//! Algorithms know nothing of actors, KV blocks or HTTP; they see plain numbers.
//!
//! One file per algorithm: [`SingleModel`], [`entropy()`], [`RStitch`], the learned
//! routers [`r2r`], [`citer`] and [`co_llm`] (a [`LearnedDeferral`] over a [`head`] trained by
//! [`train`]), [`QueryLevel`], the multi-model [`Ensemble`], and [`Bernoulli`], the seeded
//! benchmark router.

mod bernoulli;
mod citer;
mod co_llm;
mod ensemble;
mod entropy;
pub mod head;
mod learned;
mod query_level;
mod r2r;
mod rstitch;
mod share;
mod single;
mod speculative;
#[cfg(feature = "train")]
pub mod train;

use std::sync::Arc;

pub use bernoulli::Bernoulli;
pub use citer::citer;
pub use co_llm::co_llm;
pub use ensemble::Ensemble;
pub use entropy::entropy;
pub use learned::LearnedDeferral;
pub use query_level::QueryLevel;
pub use r2r::r2r;
pub use rstitch::RStitch;
pub use share::Cut;
pub use single::SingleModel;
pub use speculative::Speculative;

use crate::config::{Config, DraftTokens, Role, RoutingConfig};
pub use crate::tuning::RowCosts;

/// A model's position in `[[models]]`.
pub type ModelIndex = usize;

/// Which model is the small one and which the large one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pair {
    pub slm: ModelIndex,
    pub llm: ModelIndex,
}

/// The features an algorithm needs computed for every routed row.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FeatureNeeds {
    pub entropy: bool,
    /// The model's final normalised hidden state at the sampled position.
    pub hidden: bool,
    /// The input embedding of the token just sampled.
    pub token_embedding: bool,
    /// How many of the largest logits (0: none).
    pub top_logits: usize,
    /// The probability of the most likely next token (softmax of the raw logits).
    pub max_prob: bool,
    /// Tokens drawn from the sampler's whole distribution, which is kept with each draft
    /// (speculative sampling with temperature > 0 needs it to verify).
    pub distribution: bool,
}

/// Features of one batch, row `i` for the batch's `i`-th routed request (row-major for the
/// vector features); a feature the algorithm did not ask for is empty.
#[derive(Debug, Clone, Copy, Default)]
pub struct BatchFeatures<'a> {
    /// Entropy of the next-token distribution (softmax of the raw logits), in nats.
    pub entropy: &'a [f32],
    /// `[rows, hidden_size]`.
    pub hidden: &'a [f32],
    /// `[rows, hidden_size]`.
    pub token_embedding: &'a [f32],
    /// `[rows, top_logits]`, largest first.
    pub top_logits: &'a [f32],
    pub max_prob: &'a [f32],
}

/// A token proposed for a position by one model, with the score it won or lost by.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Candidate {
    pub token: u32,
    pub model: ModelIndex,
    pub score: f32,
}

/// A request's speculative decoding so far: drafted tokens, and of those verified, how many
/// were accepted and in how many verifications a draft was rejected.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Speculation {
    pub drafted: u32,
    pub accepted: u32,
    pub rejections: u32,
    pub verifications: u32,
}

impl Speculation {
    /// A verifier examined `drafted` drafts and accepted the first `accepted`.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        self.drafted += drafted as u32;
        self.accepted += accepted as u32;
        self.rejections += u32::from(accepted < drafted);
        self.verifications += 1;
    }

    /// The share of the drafts a verifier examined that it accepted (the drafts after a
    /// rejected one are never examined), with a prior of three accepted in four.
    pub fn acceptance(&self) -> f64 {
        (self.accepted as f64 + 3.0) / ((self.accepted + self.rejections) as f64 + 4.0)
    }
}

/// One request at routing time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepView {
    /// The request's id, unique within a runtime.
    pub request: u64,
    /// The model that just ran the step.
    pub model: ModelIndex,
    /// The token it sampled.
    pub token: u32,
    /// Tokens this model committed since the request last arrived here.
    pub tokens_here: usize,
    /// Output tokens committed so far, on any model.
    pub generated: usize,
    /// The best candidate for this position that the request brought along
    /// ([`Route::Pass`]), if any.
    pub carried: Option<Candidate>,
    /// Drafted tokens the request holds here, not counting the one just sampled
    /// ([`Route::Draft`]).
    pub drafts: usize,
    pub speculation: Speculation,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Route {
    /// Commit the sampled token here and go on here.
    Stay,
    /// Go to another model (what happens to the sampled token is [`RoutingAlgorithm::send`]'s
    /// decision).
    Move(ModelIndex),
    /// Commit nothing for this position yet: the request moves on carrying `best`, so that
    /// the next model can weigh its own token against it (ensembles).
    Pass { to: ModelIndex, best: Candidate },
    /// Commit `best` (whichever model proposed it) for this position, then go on at `next`.
    Decide { best: Candidate, next: ModelIndex },
    /// Speculative decoding: keep the sampled token as a draft (not committed, not shown to
    /// the client) and, with `send`, hand every draft to `verifier`, which checks them in
    /// one forward pass, commits the accepted ones and one token of its own. The runtime
    /// sends at once a draft that would end the request (a stop token, the length limit).
    Draft { verifier: ModelIndex, send: bool },
}

/// What [`RoutingAlgorithm::send`] decides about the token just sampled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendPlan {
    /// Commit it here before moving; otherwise the peer generates this position itself.
    pub keep_token: bool,
}

/// A request arriving at a model it has visited before, as [`RoutingAlgorithm::receive`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrival {
    pub from: ModelIndex,
    pub to: ModelIndex,
    /// Tokens the arriving model already holds in its KV cache.
    pub cached: usize,
    /// Tokens of the sequence now.
    pub total: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resume {
    /// Keep the cached prefix and extend it with the tokens produced elsewhere.
    Extend,
    /// Drop the cached prefix and prefill the whole sequence again.
    Recompute,
}

pub trait RoutingAlgorithm: Send + Sync {
    fn name(&self) -> &'static str;

    fn needs(&self) -> FeatureNeeds {
        FeatureNeeds::default()
    }

    /// The model that prefills the prompt and produces the first token.
    fn first_model(&self, prompt: &[u32]) -> ModelIndex;

    /// One route per request of `batch`, all produced by `model`, written into `out`.
    fn route(
        &self,
        model: ModelIndex,
        features: &BatchFeatures,
        batch: &[StepView],
        out: &mut Vec<Route>,
    );

    fn send(&self, from: ModelIndex, to: ModelIndex, step: &StepView) -> SendPlan;

    fn receive(&self, _arrival: &Arrival) -> Resume {
        Resume::Extend
    }

    /// Where the algorithm prices its choices by what steps cost on this machine: the rows of
    /// the multi-row step to time each model at ([`RowCosts`]), measured once at start-up.
    fn priced_rows(&self) -> Option<usize> {
        None
    }

    /// The measured costs, per model (`None` for a model not measured here: a remote one).
    fn price(&self, _costs: &[Option<RowCosts>]) {}
}

#[derive(Debug, thiserror::Error)]
pub enum RoutingError {
    #[error("routing: {0}")]
    Config(String),
}

/// What an algorithm may know of each loaded model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelFacts {
    pub hidden_size: usize,
    /// Weight bytes one decode step streams (its cost where decoding is memory-bound).
    pub weight_bytes: usize,
}

/// Builds the algorithm `config.routing` names, resolving model roles and names to indices;
/// `models` (per model) checks learned routers against the model they read.
pub fn build(
    config: &Config,
    models: &[ModelFacts],
) -> Result<Arc<dyn RoutingAlgorithm>, RoutingError> {
    let hidden_sizes: Vec<usize> = models.iter().map(|m| m.hidden_size).collect();
    let hidden_sizes = hidden_sizes.as_slice();
    let pair = || match (config.role_index(Role::Slm), config.role_index(Role::Llm)) {
        (Some(slm), Some(llm)) if slm != llm => Ok(Pair { slm, llm }),
        _ => Err(RoutingError::Config(
            "this algorithm needs models with role = \"slm\" and role = \"llm\"".into(),
        )),
    };
    Ok(match &config.routing {
        RoutingConfig::Single { model } => {
            let index = match model {
                Some(name) => config
                    .models
                    .iter()
                    .position(|m| &m.name == name)
                    .ok_or_else(|| RoutingError::Config(format!("no model named '{name}'")))?,
                None => 0,
            };
            Arc::new(SingleModel::new(index))
        }
        RoutingConfig::Entropy { threshold, share } => Arc::new(entropy(
            pair()?,
            cut(*threshold, *share).unwrap_or(Cut::Threshold(f32::INFINITY)),
        )),
        RoutingConfig::RStitch { high, low } => Arc::new(RStitch::new(pair()?, *high, *low)),
        RoutingConfig::R2r {
            router,
            threshold,
            share,
        }
        | RoutingConfig::Citer {
            router,
            threshold,
            share,
        }
        | RoutingConfig::CoLlm {
            router,
            threshold,
            share,
        } => {
            let (kind, make): (_, fn(Pair, head::RouterHead, Cut) -> LearnedDeferral) =
                match &config.routing {
                    RoutingConfig::R2r { .. } => (r2r::KIND, r2r),
                    RoutingConfig::Citer { .. } => (citer::KIND, citer),
                    _ => (co_llm::KIND, co_llm),
                };
            learned(
                pair()?,
                router,
                cut(*threshold, *share),
                hidden_sizes,
                kind,
                make,
            )?
        }
        RoutingConfig::QueryLevel { rule, threshold } => {
            Arc::new(QueryLevel::new(pair()?, *rule, *threshold))
        }
        RoutingConfig::Ensemble { weights } => Arc::new(Ensemble::new(weights.clone())),
        RoutingConfig::Bernoulli { p, seed } => Arc::new(Bernoulli::new(pair()?, *p, *seed)),
        RoutingConfig::Speculative { draft_tokens, .. } => {
            let pair = pair()?;
            let draft = match *draft_tokens {
                DraftTokens::Fixed(k) => speculative::DraftLength::Fixed(k),
                DraftTokens::Auto => {
                    let bytes = |m: ModelIndex| models.get(m).map_or(0, |f| f.weight_bytes);
                    let cost = match (bytes(pair.slm), bytes(pair.llm)) {
                        (s, l) if s > 0 && l > 0 => s as f64 / l as f64,
                        _ => speculative::DEFAULT_DRAFT_COST,
                    };
                    // A verification computes k + 1 positions in one step.
                    let budget = config.scheduler.max_batch_tokens.saturating_sub(1);
                    let max = speculative::MAX_AUTO_DRAFT.min(budget);
                    speculative::DraftLength::Auto {
                        prices: speculative::DraftPrices::unmeasured(cost),
                        max,
                    }
                }
            };
            Arc::new(Speculative::new(pair, draft))
        }
    })
}

/// A cut-off as configured: a target share, or a threshold (`None`: neither; a learned router
/// then takes the one trained into its head's file).
fn cut(threshold: Option<f32>, share: Option<f64>) -> Option<Cut> {
    match (share, threshold) {
        (Some(share), _) => Some(Cut::Share(share::ShareControl::new(share))),
        (None, Some(t)) => Some(Cut::Threshold(t)),
        (None, None) => None,
    }
}

/// Loads a learned router's head for the SLM and wraps it with its cut-off.
fn learned(
    pair: Pair,
    router: &std::path::Path,
    cut: Option<Cut>,
    hidden_sizes: &[usize],
    kind: head::HeadKind,
    make: fn(Pair, head::RouterHead, Cut) -> LearnedDeferral,
) -> Result<Arc<dyn RoutingAlgorithm>, RoutingError> {
    let hidden = hidden_sizes.get(pair.slm).copied().unwrap_or(0);
    let head = head::RouterHead::load(router, kind, hidden)?;
    let cut = cut.unwrap_or(Cut::Threshold(head.config.threshold));
    Ok(Arc::new(make(pair, head, cut)))
}

/// Applies a per-row rule to a batch, for algorithms whose decisions are independent per row.
fn route_rows(
    batch: &[StepView],
    out: &mut Vec<Route>,
    mut rule: impl FnMut(usize, &StepView) -> Route,
) {
    out.clear();
    out.extend(batch.iter().enumerate().map(|(i, s)| rule(i, s)));
}
