//! Loading the decoder's weights: every matrix and vector read by name from a
//! [`WeightSource`], counted as the bytes a decode step streams, and made ready by the backend.

use candle_core::Tensor;

use super::{Attention, DecoderLayer, Mlp};
use crate::model::backend::Backend;
use crate::model::config::ModelConfig;
use crate::model::error::Result;
use crate::model::timing::{projection_of, PROJECTIONS};
use crate::model::weights::{Weight, WeightSource};

/// Counts the bytes of every matrix a decode step streams from memory.
pub(super) struct CountingSource<'a> {
    pub(super) inner: &'a mut dyn WeightSource,
    pub(super) bytes: usize,
    /// The part of `bytes` in each of the layers' projections, in the order of
    /// [`PROJECTIONS`].
    pub(super) projections: [usize; PROJECTIONS.len()],
}

impl CountingSource<'_> {
    fn count(&mut self, name: &str, bytes: usize) {
        self.bytes += bytes;
        if let Some(p) = projection_of(name) {
            self.projections[p] += bytes;
        }
    }
}

impl WeightSource for CountingSource<'_> {
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Weight> {
        let w = self.inner.matrix(name, rows, cols)?;
        self.count(name, w.storage_bytes());
        Ok(w)
    }
    fn vector(&mut self, name: &str, len: usize) -> Result<Tensor> {
        let v = self.inner.vector(name, len)?;
        self.count(name, len * 4);
        Ok(v)
    }
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }
}

/// Reads weights for the backend to make ready: each matrix, vector and norm by name.
pub(super) struct Loader<'s, 'c, B: Backend> {
    pub(super) backend: &'s B,
    pub(super) src: &'s mut CountingSource<'c>,
    pub(super) config: &'s ModelConfig,
}

impl<B: Backend> Loader<'_, '_, B> {
    pub(super) fn norm(&mut self, name: &str, len: usize) -> Result<B::Norm> {
        let w = self.src.vector(name, len)?;
        self.backend.norm(&w, self.config.rms_norm_eps)
    }

    /// Projections `parts` (name and rows) over `inp` inputs, with biases when `bias`.
    pub(super) fn linear(
        &mut self,
        parts: &[(&str, usize)],
        inp: usize,
        bias: bool,
    ) -> Result<B::Linear> {
        let mut weights = Vec::with_capacity(parts.len());
        let mut biases = Vec::with_capacity(parts.len());
        for &(name, rows) in parts {
            weights.push(self.src.matrix(&format!("{name}.weight"), rows, inp)?);
            if bias {
                biases.push(self.src.vector(&format!("{name}.bias"), rows)?);
            }
        }
        let widths: Vec<usize> = parts.iter().map(|p| p.1).collect();
        self.backend.linear(&weights, &biases, &widths)
    }

    pub(super) fn layer(&mut self, i: usize) -> Result<DecoderLayer<B>> {
        let c = self.config;
        let p = format!("blk.{i}");
        let h = c.hidden_size;
        let head_norm =
            |l: &mut Self, name: &str| l.norm(&format!("{p}.{name}.weight"), c.head_dim);
        let attn = Attention {
            qkv: self.linear(
                &[
                    (&format!("{p}.attn_q"), c.q_dim()),
                    (&format!("{p}.attn_k"), c.kv_dim()),
                    (&format!("{p}.attn_v"), c.kv_dim()),
                ],
                h,
                c.qkv_bias,
            )?,
            o: self.linear(&[(&format!("{p}.attn_output"), h)], c.q_dim(), false)?,
            q_norm: c
                .qk_norm
                .then(|| head_norm(self, "attn_q_norm"))
                .transpose()?,
            k_norm: c
                .qk_norm
                .then(|| head_norm(self, "attn_k_norm"))
                .transpose()?,
        };
        let ffn = c.intermediate_size;
        let attn_norm = self.norm(&format!("{p}.attn_norm.weight"), h)?;
        let ffn_norm = self.norm(&format!("{p}.ffn_norm.weight"), h)?;
        let gate = self.src.matrix(&format!("{p}.ffn_gate.weight"), ffn, h)?;
        let up = self.src.matrix(&format!("{p}.ffn_up.weight"), ffn, h)?;
        Ok(DecoderLayer {
            attn_norm,
            attn,
            ffn_norm,
            mlp: Mlp {
                gate_up: self.backend.gate_up(gate, up, ffn, h)?,
                down: self.linear(&[(&format!("{p}.ffn_down"), h)], ffn, false)?,
            },
        })
    }
}
