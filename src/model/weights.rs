//! Where decoder weights come from. Loaders (GGUF, safetensors) implement [`WeightSource`] with
//! tensor names in GGUF convention (`blk.0.attn_q.weight`); the decoder asks for each weight with
//! the shape it expects, so a checkpoint with a wrong shape fails at load, naming the tensor.

use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Module, Tensor};

use super::error::{ModelError, Result};

pub trait WeightSource {
    /// A `[rows, cols]` (out, in) matrix, kept quantized when the checkpoint is.
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Weight>;
    /// A 1-D `f32` vector (norm weights, biases).
    fn vector(&mut self, name: &str, len: usize) -> Result<Tensor>;
    fn contains(&self, name: &str) -> bool;
}

/// A matrix as loaded: quantized blocks or a dense `f32` tensor.
#[derive(Clone)]
pub enum Weight {
    Quantized(Arc<QTensor>),
    Dense(Tensor),
}

impl Weight {
    pub fn storage_bytes(&self) -> usize {
        match self {
            Self::Quantized(q) => q.storage_size_in_bytes(),
            Self::Dense(t) => t.elem_count() * t.dtype().size_in_bytes(),
        }
    }

    pub fn matmul(&self) -> Result<QMatMul> {
        Ok(match self {
            Self::Quantized(q) => QMatMul::from_arc(q.clone())?,
            Self::Dense(t) => QMatMul::Tensor(t.clone()),
        })
    }

    /// Rows `ids` of the matrix (embedding lookup), as `[ids, cols]` `f32`.
    pub fn rows(&self, ids: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Self::Quantized(q) => q.embedding(ids)?,
            Self::Dense(t) => t.embedding(ids)?,
        })
    }
}

/// `y = x Wᵀ (+ b)`.
pub struct Linear {
    weight: QMatMul,
    bias: Option<Tensor>,
}

impl Linear {
    pub fn load(
        src: &mut dyn WeightSource,
        name: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Self> {
        let weight = src.matrix(&format!("{name}.weight"), out, inp)?.matmul()?;
        let bias = if bias {
            Some(src.vector(&format!("{name}.bias"), out)?)
        } else {
            None
        };
        Ok(Self { weight, bias })
    }

    pub fn new(weight: QMatMul, bias: Option<Tensor>) -> Self {
        Self { weight, bias }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.weight.forward(x)?;
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// Root-mean-square layer norm over the last dimension.
pub struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    pub fn load(src: &mut dyn WeightSource, name: &str, len: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            weight: src.vector(name, len)?,
            eps: eps as f32,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::ops::rms_norm(x, &self.weight, self.eps)?)
    }
}

/// Checks a loaded shape against the expected one.
pub fn check_shape(name: &str, got: &[usize], expected: &[usize]) -> Result<()> {
    if got != expected {
        return Err(ModelError::Shape {
            tensor: name.to_string(),
            expected: expected.to_vec(),
            got: got.to_vec(),
        });
    }
    Ok(())
}
