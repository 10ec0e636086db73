//! The decoder's hyper-parameters, read from GGUF metadata or a Hugging Face `config.json`.
//! One [`ModelConfig`] describes every supported member of the Llama decoder family; the
//! per-architecture differences are plain options (qkv bias, q/k norm, rotary layout).

use super::error::{ModelError, Result};
pub use crate::kernels::rope::RopeStyle;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
    Qwen3,
}

impl Architecture {
    /// Accepts the names GGUF (`general.architecture`) and Hugging Face (`model_type`) use.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "llama" | "mistral" => Ok(Self::Llama),
            "qwen2" => Ok(Self::Qwen2),
            "qwen3" => Ok(Self::Qwen3),
            other => Err(ModelError::UnsupportedArchitecture(other.to_string())),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub context_length: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    pub qkv_bias: bool,
    pub qk_norm: bool,
    pub tied_embeddings: bool,
}

impl ModelConfig {
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Rejects configurations the decoder cannot run, naming the offending key.
    pub fn validate(&self) -> Result<()> {
        let bad = |key: &str, reason: String| {
            Err(ModelError::InvalidMetadata {
                key: key.to_string(),
                reason,
            })
        };
        for (key, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("context_length", self.context_length),
        ] {
            if v == 0 {
                return bad(key, "must be positive".into());
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(
                "num_kv_heads",
                format!(
                    "{} query heads are not a multiple of {} KV heads",
                    self.num_heads, self.num_kv_heads
                ),
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(
                "head_dim",
                format!("{} is odd; rotary needs pairs", self.head_dim),
            );
        }
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if !positive(self.rms_norm_eps) || !positive(self.rope_theta as f64) {
            return bad("rms_norm_eps/rope_theta", "must be positive".into());
        }
        Ok(())
    }
}
