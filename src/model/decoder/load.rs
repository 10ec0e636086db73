//! Loading the decoder's weights: every matrix and vector read by name from a
//! [`WeightSource`], counted as the bytes a decode step streams, and made ready by the backend.

use candle_core::Tensor;

use super::{Attention, Decoder, DecoderLayer, Inner, Mlp, Model};
use crate::model::backend::Backend;
use crate::model::config::ModelConfig;
use crate::model::error::{ModelError, Result};
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

impl Model {
    /// Gives [`Model::forward`] an LM head over the first `n` token ids only, read from `src`
    /// (the file the model was loaded from): every other id gets -inf. For a model that only
    /// drafts for speculative decoding, whose LM head over a large vocabulary is a large part
    /// of its step: the drafts lose the rare tokens, the verified output nothing.
    /// `forward_all_positions` keeps the whole head.
    pub fn set_draft_vocab(&mut self, n: usize, src: &mut dyn WeightSource) -> Result<()> {
        let c = self.config();
        let (vocab, hidden) = (c.vocab_size, c.hidden_size);
        if n == 0 || n > vocab {
            return Err(ModelError::Device(format!(
                "draft_vocab = {n}: the model's vocabulary has {vocab} tokens"
            )));
        }
        let name = if src.contains("output.weight") {
            "output.weight"
        } else {
            "token_embd.weight"
        };
        let rows = src.matrix(name, vocab, hidden)?.first_rows(n)?;
        match &mut self.inner {
            Inner::Cpu(d) => d.set_draft_head(rows, n),
            #[cfg(feature = "cuda")]
            Inner::Cuda(d) => d.set_draft_head(rows, n),
        }
    }
}

impl<B: Backend> Decoder<B> {
    /// The draft head over `rows` (the LM head's first `n`), counted in what a step streams.
    fn set_draft_head(&mut self, rows: Weight, n: usize) -> Result<()> {
        let bytes = rows.storage_bytes();
        self.draft_head = Some((self.backend.linear(&[rows], &[], &[n])?, n));
        self.streamed_bytes = self.streamed_bytes - self.lm_head_bytes + bytes;
        self.lm_head_bytes = bytes;
        Ok(())
    }
}
