//! Router heads: the small neural scorers that learned routers (R2R, CITER, Co-LLM) run on the
//! SLM's features of each sampled token, once per batch.
//!
//! A head is a safetensors file plus a JSON config next to it (same stem, `.json`) that gives
//! its kind, its widths and its decision threshold, so heads of any width and depth load.
//! The same module definitions serve inference (weights from the file) and training
//! (`tokenrouter train-router`, weights from a `VarMap`), so what is trained is what runs.
//!
//! * `r2r`: [hidden ‖ embedding of the sampled token ‖ Linear(top-k logits → logits_dim)] →
//!   Linear → `blocks` × (x + fc2(GELU(fc1(LayerNorm(x))))) → LayerNorm → Linear → 1.
//! * `citer`: hidden → 2·hidden (ReLU) → hidden (ReLU) → 1.
//! * `co_llm`: a linear probe, hidden → 1.
//!
//! A head whose config sets `confidence_top_k` also reads the SLM's confidence beside the
//! hidden state: the entropy of the softmax over its `confidence_top_k` largest logits and the
//! margin between the two largest, appended to the hidden state (R2R: to its concatenated
//! input). A linear probe cannot compute an entropy from the hidden state, and the entropy
//! alone ranks the positions that need the LLM better than heads trained on little data. A
//! head whose config sets `standardized` standardises that state (hidden state and confidence)
//! by the training positions' mean and spread, kept with its weights, so that the hidden
//! state's widest dimensions do not drown the rest.
//!
//! Every head ends in a sigmoid; what the score means (defer when above, or confidence that
//! keeps the token when above) is the algorithm's business.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{layer_norm, linear, LayerNorm, LayerNormConfig, Linear, VarBuilder, VarMap};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::RoutingError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeadKind {
    R2r,
    Citer,
    CoLlm,
}

impl HeadKind {
    /// Whether a token scored `score` goes to the LLM at `threshold`: R2R defers at or above
    /// it, Co-LLM's gate above it, CITER's confidence below it.
    pub fn defers(self, score: f32, threshold: f32) -> bool {
        match self {
            Self::R2r => score >= threshold,
            Self::CoLlm => score > threshold,
            Self::Citer => score < threshold,
        }
    }

    /// The score as an urgency, higher meaning more in need of the LLM: CITER's confidence
    /// counts the other way.
    pub fn urgency(self, score: f32) -> f32 {
        match self {
            Self::R2r | Self::CoLlm => score,
            Self::Citer => -score,
        }
    }

    /// The name in file names and flags.
    pub fn name(self) -> &'static str {
        match self {
            Self::R2r => "r2r",
            Self::Citer => "citer",
            Self::CoLlm => "co_llm",
        }
    }
}

/// The JSON next to a head's weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeadConfig {
    pub kind: HeadKind,
    /// Hidden size of the model whose features the head reads.
    pub hidden_size: usize,
    /// R2R: how many of the largest logits it reads.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub top_k: usize,
    /// R2R: width the top-k logits are projected to.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub logits_dim: usize,
    /// R2R: width of the residual MLP.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub width: usize,
    /// R2R: residual blocks.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub blocks: usize,
    /// How many of the largest logits the confidence features are taken over (0: the head
    /// reads no confidence features).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub confidence_top_k: usize,
    /// Whether the head standardises what it reads beside R2R's embedding and logits (the
    /// hidden state and the confidence features) by the training positions' mean and
    /// standard deviation, kept with its weights (`standardize.mean`, `standardize.scale`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub standardized: bool,
    /// The decision threshold on the sigmoid score.
    pub threshold: f32,
    /// What training measured (free-form; reported, never read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report: Option<serde_json::Value>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl HeadConfig {
    /// A head of `kind` reading hidden states of `hidden_size`, threshold 0.5; an R2R head
    /// also needs [`HeadConfig::with_r2r_shape`].
    pub fn new(kind: HeadKind, hidden_size: usize) -> Self {
        Self {
            kind,
            hidden_size,
            top_k: 0,
            logits_dim: 0,
            width: 0,
            blocks: 0,
            confidence_top_k: 0,
            standardized: false,
            threshold: 0.5,
            report: None,
        }
    }

    /// The R2R widths: logits read, their projection, the MLP width and its blocks.
    pub fn with_r2r_shape(
        self,
        top_k: usize,
        logits_dim: usize,
        width: usize,
        blocks: usize,
    ) -> Self {
        Self {
            top_k,
            logits_dim,
            width,
            blocks,
            ..self
        }
    }

    /// The head reading the confidence features over the `top_k` largest logits (0: none).
    pub fn with_confidence(self, top_k: usize) -> Self {
        Self {
            confidence_top_k: top_k,
            ..self
        }
    }

    /// The head standardising its inputs (see [`HeadConfig::standardized`]).
    pub fn standardized(self) -> Self {
        Self {
            standardized: true,
            ..self
        }
    }

    /// How many of the largest logits the head reads, for R2R's projection and for the
    /// confidence features together.
    pub fn top_width(&self) -> usize {
        let r2r = if self.kind == HeadKind::R2r {
            self.top_k
        } else {
            0
        };
        r2r.max(self.confidence_top_k)
    }

    /// The width of the hidden state with the confidence features appended.
    fn state_width(&self) -> usize {
        self.hidden_size
            + if self.confidence_top_k > 0 {
                CONFIDENCE_FEATURES
            } else {
                0
            }
    }

    pub(crate) fn check(&self) -> Result<(), String> {
        if self.hidden_size == 0 {
            return Err("hidden_size must be positive".into());
        }
        if !(0.0..=1.0).contains(&self.threshold) {
            return Err(format!("threshold {} is not in [0, 1]", self.threshold));
        }
        if self.kind == HeadKind::R2r
            && [self.top_k, self.logits_dim, self.width, self.blocks].contains(&0)
        {
            return Err("an r2r head needs top_k, logits_dim, width and blocks".into());
        }
        if self.confidence_top_k == 1 {
            return Err(
                "confidence_top_k must be 0 (none) or at least 2: the margin needs two logits"
                    .into(),
            );
        }
        Ok(())
    }
}

/// The confidence features: the entropy over the largest logits and the top-1 margin.
const CONFIDENCE_FEATURES: usize = 2;

/// `[rows, 2]`: the entropy (nats) of the softmax over each row's first `k` logits of `top`
/// (largest first) and the margin between its two largest.
fn confidence(top: &Tensor, k: usize) -> candle_core::Result<Tensor> {
    let top = top.narrow(1, 0, k)?;
    let log_p = candle_nn::ops::log_softmax(&top, 1)?;
    let entropy = (log_p.exp()? * &log_p)?.sum_keepdim(1)?.neg()?;
    let margin = (top.narrow(1, 0, 1)? - top.narrow(1, 1, 1)?)?;
    Tensor::cat(&[entropy, margin], 1)
}

struct Block {
    norm: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

/// Names of the standardisation's tensors in a head's weights.
pub const STANDARDIZE_MEAN: &str = "standardize.mean";
pub const STANDARDIZE_SCALE: &str = "standardize.scale";

/// Whether a weight is part of the standardisation (measured on the data, never trained).
pub fn is_standardization(name: &str) -> bool {
    name == STANDARDIZE_MEAN || name == STANDARDIZE_SCALE
}

enum Net {
    R2r {
        logits_proj: Linear,
        input: Linear,
        blocks: Vec<Block>,
        norm: LayerNorm,
        output: Linear,
    },
    Citer {
        fc1: Linear,
        fc2: Linear,
        out: Linear,
    },
    CoLlm {
        probe: Linear,
    },
}

/// Features of a batch's sampled rows, row-major.
#[derive(Debug, Clone, Copy)]
pub struct HeadInputs<'a> {
    pub rows: usize,
    /// `[rows, hidden]`: the final normalised hidden state at the sampled position.
    pub hidden: &'a [f32],
    /// `[rows, hidden]`: input embedding of the sampled token (R2R).
    pub token_embedding: &'a [f32],
    /// `[rows, top_width]`: the largest logits, descending (R2R and the confidence features).
    pub top_logits: &'a [f32],
}

pub struct RouterHead {
    pub config: HeadConfig,
    /// `(mean, 1 / standard deviation)` of the state the head reads, when it standardises it.
    standardize: Option<(Tensor, Tensor)>,
    net: Net,
}

fn ln_config() -> LayerNormConfig {
    LayerNormConfig::from(1e-5)
}

impl RouterHead {
    /// Builds the head's layers from `vb` (a file's tensors, or a training `VarMap`).
    pub fn build(config: HeadConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        let h = config.hidden_size;
        let state = config.state_width();
        let standardize = if config.standardized {
            Some((
                vb.get(state, STANDARDIZE_MEAN)?,
                vb.get(state, STANDARDIZE_SCALE)?,
            ))
        } else {
            None
        };
        let net = match config.kind {
            HeadKind::R2r => {
                let w = config.width;
                let blocks = (0..config.blocks)
                    .map(|i| {
                        let vb = vb.pp(format!("blocks.{i}"));
                        Ok(Block {
                            norm: layer_norm(w, ln_config(), vb.pp("norm"))?,
                            fc1: linear(w, w, vb.pp("fc1"))?,
                            fc2: linear(w, w, vb.pp("fc2"))?,
                        })
                    })
                    .collect::<candle_core::Result<_>>()?;
                Net::R2r {
                    logits_proj: linear(config.top_k, config.logits_dim, vb.pp("logits_proj"))?,
                    input: linear(h + state + config.logits_dim, w, vb.pp("input"))?,
                    blocks,
                    norm: layer_norm(w, ln_config(), vb.pp("norm"))?,
                    output: linear(w, 1, vb.pp("output"))?,
                }
            }
            HeadKind::Citer => Net::Citer {
                fc1: linear(state, 2 * h, vb.pp("fc1"))?,
                fc2: linear(2 * h, h, vb.pp("fc2"))?,
                out: linear(h, 1, vb.pp("out"))?,
            },
            HeadKind::CoLlm => Net::CoLlm {
                probe: linear(state, 1, vb.pp("probe"))?,
            },
        };
        Ok(Self {
            config,
            standardize,
            net,
        })
    }

    /// A head with fresh weights drawn from `seed` (uniform in ±1/√fan-in; layer norms and
    /// the standardisation start as the identity), and the variables that train it.
    pub fn init(config: HeadConfig, seed: u64) -> candle_core::Result<(Self, VarMap)> {
        let vars = VarMap::new();
        let head = Self::build(
            config,
            VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu),
        )?;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let data = vars.data().lock().unwrap_or_else(|e| e.into_inner());
        let mut names: Vec<&String> = data.keys().collect();
        names.sort();
        for name in names {
            let var = &data[name];
            let dims = var.dims().to_vec();
            let values: Vec<f32> = if name.contains("norm") || is_standardization(name) {
                let one = if name.ends_with("weight") || name == STANDARDIZE_SCALE {
                    1.0
                } else {
                    0.0
                };
                vec![one; var.elem_count()]
            } else {
                let bound = 1.0 / (*dims.last().unwrap_or(&1) as f32).sqrt();
                (0..var.elem_count())
                    .map(|_| rng.random_range(-bound..bound))
                    .collect()
            };
            var.set(&Tensor::from_vec(values, dims, &Device::Cpu)?)?;
        }
        drop(data);
        Ok((head, vars))
    }

    /// Writes the weights (safetensors) and the JSON config next to them.
    pub fn save(&self, vars: &VarMap, weights: &Path) -> Result<(), RoutingError> {
        let fail = |e: String| RoutingError::Config(format!("writing {}: {e}", weights.display()));
        vars.save(weights).map_err(|e| fail(e.to_string()))?;
        let json = serde_json::to_string_pretty(&self.config).map_err(|e| fail(e.to_string()))?;
        std::fs::write(Self::config_path(weights), json + "\n").map_err(|e| fail(e.to_string()))
    }

    /// The JSON config that goes with a weights file.
    pub fn config_path(weights: &Path) -> PathBuf {
        weights.with_extension("json")
    }

    /// Loads `weights` (safetensors) and its JSON config, checking both against the kind the
    /// algorithm expects and the model whose features it will read.
    pub fn load(weights: &Path, kind: HeadKind, model_hidden: usize) -> Result<Self, RoutingError> {
        let fail = |what: &Path, message: String| {
            RoutingError::Config(format!("router file {}: {message}", what.display()))
        };
        let config_path = Self::config_path(weights);
        let text = std::fs::read_to_string(&config_path)
            .map_err(|e| fail(&config_path, format!("cannot read it: {e}")))?;
        let config: HeadConfig =
            serde_json::from_str(&text).map_err(|e| fail(&config_path, e.to_string()))?;
        config.check().map_err(|e| fail(&config_path, e))?;
        if config.kind != kind {
            let message = format!("it holds a {:?} head, not {kind:?}", config.kind);
            return Err(fail(&config_path, message));
        }
        if config.hidden_size != model_hidden {
            let message = format!(
                "the head reads hidden states of size {} but the SLM's hidden size is {model_hidden}",
                config.hidden_size
            );
            return Err(fail(&config_path, message));
        }
        let tensors = candle_core::safetensors::load(weights, &Device::Cpu)
            .map_err(|e| fail(weights, format!("cannot read safetensors: {e}")))?;
        let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
        Self::build(config, vb).map_err(|e| fail(weights, e.to_string()))
    }

    /// Pre-sigmoid scores, `[rows]`, from feature tensors: `embedding` only for R2R, `top`
    /// (at least [`HeadConfig::top_width`] wide) for R2R and the confidence features.
    pub fn logits(
        &self,
        hidden: &Tensor,
        embedding: Option<&Tensor>,
        top: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        let state = self.state(hidden, top)?;
        let hidden = &match &self.standardize {
            Some((mean, scale)) => state.broadcast_sub(mean)?.broadcast_mul(scale)?,
            None => state,
        };
        let out = match &self.net {
            Net::R2r {
                logits_proj,
                input,
                blocks,
                norm,
                output,
            } => {
                let missing =
                    || candle_core::Error::Msg("r2r needs embeddings and top logits".into());
                let top = top.ok_or_else(missing)?.narrow(1, 0, self.config.top_k)?;
                let projected = logits_proj.forward(&top)?;
                let x = Tensor::cat(&[hidden, embedding.ok_or_else(missing)?, &projected], 1)?;
                let mut x = input.forward(&x)?;
                for b in blocks {
                    let y = b
                        .fc2
                        .forward(&b.fc1.forward(&b.norm.forward(&x)?)?.gelu_erf()?)?;
                    x = (x + y)?;
                }
                output.forward(&norm.forward(&x)?)?
            }
            Net::Citer { fc1, fc2, out } => {
                let x = fc1.forward(hidden)?.relu()?;
                out.forward(&fc2.forward(&x)?.relu()?)?
            }
            Net::CoLlm { probe } => probe.forward(hidden)?,
        };
        out.squeeze(1)
    }

    /// The state the head reads beside R2R's embedding and logits, before standardising: the
    /// hidden state, with the confidence features appended when the head reads them.
    pub fn state(&self, hidden: &Tensor, top: Option<&Tensor>) -> candle_core::Result<Tensor> {
        match self.config.confidence_top_k {
            0 => Ok(hidden.clone()),
            k => {
                let missing = || candle_core::Error::Msg("the head needs the top logits".into());
                Tensor::cat(&[hidden, &confidence(top.ok_or_else(missing)?, k)?], 1)
            }
        }
    }

    /// Sigmoid scores, one per row.
    pub fn scores(&self, inputs: &HeadInputs) -> candle_core::Result<Vec<f32>> {
        if inputs.rows == 0 {
            return Ok(Vec::new());
        }
        let c = &self.config;
        let rows = inputs.rows;
        let tensor =
            |data: &[f32], width: usize| Tensor::from_slice(data, (rows, width), &Device::Cpu);
        let hidden = tensor(inputs.hidden, c.hidden_size)?;
        let embedding = match c.kind {
            HeadKind::R2r => Some(tensor(inputs.token_embedding, c.hidden_size)?),
            _ => None,
        };
        let top = match c.top_width() {
            0 => None,
            width => Some(tensor(inputs.top_logits, width)?),
        };
        let logits = self.logits(&hidden, embedding.as_ref(), top.as_ref())?;
        candle_nn::ops::sigmoid(&logits)?.to_vec1()
    }

    /// The features the head reads.
    pub fn needs(&self) -> super::FeatureNeeds {
        super::FeatureNeeds {
            hidden: true,
            token_embedding: self.config.kind == HeadKind::R2r,
            top_logits: self.config.top_width(),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests;
