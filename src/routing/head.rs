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

    fn check(&self) -> Result<(), String> {
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
        Ok(())
    }
}

struct Block {
    norm: LayerNorm,
    fc1: Linear,
    fc2: Linear,
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
    /// `[rows, top_k]`: the largest logits, descending (R2R).
    pub top_logits: &'a [f32],
}

pub struct RouterHead {
    pub config: HeadConfig,
    net: Net,
}

fn ln_config() -> LayerNormConfig {
    LayerNormConfig::from(1e-5)
}

impl RouterHead {
    /// Builds the head's layers from `vb` (a file's tensors, or a training `VarMap`).
    pub fn build(config: HeadConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        let h = config.hidden_size;
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
                    input: linear(2 * h + config.logits_dim, w, vb.pp("input"))?,
                    blocks,
                    norm: layer_norm(w, ln_config(), vb.pp("norm"))?,
                    output: linear(w, 1, vb.pp("output"))?,
                }
            }
            HeadKind::Citer => Net::Citer {
                fc1: linear(h, 2 * h, vb.pp("fc1"))?,
                fc2: linear(2 * h, h, vb.pp("fc2"))?,
                out: linear(h, 1, vb.pp("out"))?,
            },
            HeadKind::CoLlm => Net::CoLlm {
                probe: linear(h, 1, vb.pp("probe"))?,
            },
        };
        Ok(Self { config, net })
    }

    /// A head with fresh weights drawn from `seed` (uniform in ±1/√fan-in; layer norms start
    /// as the identity), and the variables that train it.
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
            let values: Vec<f32> = if name.contains("norm") {
                let one = if name.ends_with("weight") { 1.0 } else { 0.0 };
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

    /// Pre-sigmoid scores, `[rows]`, from feature tensors (`embedding` and `top` only for R2R).
    pub fn logits(
        &self,
        hidden: &Tensor,
        embedding: Option<&Tensor>,
        top: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
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
                let projected = logits_proj.forward(top.ok_or_else(missing)?)?;
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
        let (embedding, top) = match c.kind {
            HeadKind::R2r => (
                Some(tensor(inputs.token_embedding, c.hidden_size)?),
                Some(tensor(inputs.top_logits, c.top_k)?),
            ),
            _ => (None, None),
        };
        let logits = self.logits(&hidden, embedding.as_ref(), top.as_ref())?;
        candle_nn::ops::sigmoid(&logits)?.to_vec1()
    }

    /// The features the head reads.
    pub fn needs(&self) -> super::FeatureNeeds {
        let r2r = self.config.kind == HeadKind::R2r;
        super::FeatureNeeds {
            hidden: true,
            token_embedding: r2r,
            top_logits: if r2r { self.config.top_k } else { 0 },
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(kind: HeadKind, hidden: usize) -> HeadConfig {
        match kind {
            HeadKind::R2r => HeadConfig::new(kind, hidden).with_r2r_shape(8, 4, 12, 2),
            _ => HeadConfig::new(kind, hidden),
        }
    }

    fn inputs(rows: usize, hidden: usize, top: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let f = |n: usize, k: f32| (0..n).map(|i| (i as f32 * k).sin()).collect::<Vec<f32>>();
        (
            f(rows * hidden, 0.37),
            f(rows * hidden, 0.91),
            f(rows * top, 1.7),
        )
    }

    #[test]
    fn every_kind_saves_and_loads_to_the_same_scores() {
        let dir = tempfile::tempdir().unwrap();
        for kind in [HeadKind::R2r, HeadKind::Citer, HeadKind::CoLlm] {
            let (head, vars) = RouterHead::init(config(kind, 6), 3).unwrap();
            let path = dir.path().join(format!("{kind:?}.safetensors"));
            head.save(&vars, &path).unwrap();
            let loaded = RouterHead::load(&path, kind, 6).unwrap();
            let (h, e, t) = inputs(5, 6, 8);
            let batch = HeadInputs {
                rows: 5,
                hidden: &h,
                token_embedding: &e,
                top_logits: &t,
            };
            let (a, b) = (head.scores(&batch).unwrap(), loaded.scores(&batch).unwrap());
            assert_eq!(a.len(), 5);
            assert_eq!(a, b, "{kind:?}");
            assert!(a.iter().all(|s| (0.0..=1.0).contains(s)));
            assert!(loaded.needs().hidden);
            assert_eq!(loaded.needs().top_logits > 0, kind == HeadKind::R2r);
        }
    }

    #[test]
    fn init_is_seeded() {
        let (a, _) = RouterHead::init(config(HeadKind::Citer, 4), 9).unwrap();
        let (b, _) = RouterHead::init(config(HeadKind::Citer, 4), 9).unwrap();
        let (h, e, t) = inputs(3, 4, 0);
        let batch = HeadInputs {
            rows: 3,
            hidden: &h,
            token_embedding: &e,
            top_logits: &t,
        };
        assert_eq!(a.scores(&batch).unwrap(), b.scores(&batch).unwrap());
    }

    #[test]
    fn malformed_router_files_get_errors_naming_file_and_mismatch() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("router.safetensors");
        let (head, vars) = RouterHead::init(config(HeadKind::Citer, 6), 1).unwrap();
        head.save(&vars, &path).unwrap();
        let err = |r: Result<RouterHead, RoutingError>| r.err().expect("refused").to_string();

        let e = err(RouterHead::load(&path, HeadKind::Citer, 8));
        assert!(
            e.contains("router.json") && e.contains("hidden size is 8"),
            "{e}"
        );
        let e = err(RouterHead::load(&path, HeadKind::CoLlm, 6));
        assert!(e.contains("Citer head, not CoLlm"), "{e}");

        // Weights of another shape than the config says.
        let wrong = HeadConfig {
            hidden_size: 7,
            ..config(HeadKind::Citer, 7)
        };
        std::fs::write(
            RouterHead::config_path(&path),
            serde_json::to_string(&wrong).unwrap(),
        )
        .unwrap();
        let e = err(RouterHead::load(&path, HeadKind::Citer, 7));
        assert!(
            e.contains("router.safetensors") && e.contains("shape"),
            "{e}"
        );

        let json = r#"{"kind": "citer", "hidden_size": 6}"#;
        std::fs::write(RouterHead::config_path(&path), json).unwrap();
        let e = err(RouterHead::load(&path, HeadKind::Citer, 6));
        assert!(e.contains("missing field `threshold`"), "{e}");

        std::fs::write(
            RouterHead::config_path(&path),
            r#"{"kind": "r2r", "hidden_size": 6, "threshold": 0.5}"#,
        )
        .unwrap();
        let e = err(RouterHead::load(&path, HeadKind::R2r, 6));
        assert!(e.contains("needs top_k"), "{e}");

        std::fs::remove_file(RouterHead::config_path(&path)).unwrap();
        let e = err(RouterHead::load(&path, HeadKind::Citer, 6));
        assert!(
            e.contains("router.json") && e.contains("cannot read"),
            "{e}"
        );
        let e = err(RouterHead::load(
            &dir.path().join("none.safetensors"),
            HeadKind::Citer,
            6,
        ));
        assert!(e.contains("none.json"), "{e}");
    }
}
