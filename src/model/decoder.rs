//! The Llama-family decoder (Llama/SmolLM2, Qwen2, Qwen3) as immutable weights plus one batched
//! forward pass over a caller-owned paged KV cache.
//!
//! One forward call takes a batch in which every sequence brings its own new tokens (a prefill
//! chunk, an extend or a single decode token) at its own position. All new tokens of the batch
//! go through the matmuls together as one `[tokens, hidden]` matrix; attention reads each
//! sequence's blocks in place. The call returns, per sequence, the logits of its last new
//! position and, on request, the final (post-norm) hidden state there. The model keeps no
//! per-request state and knows nothing of scheduling.

use candle_core::{DType, Device, Tensor};

use super::config::ModelConfig;
use super::error::{ModelError, Result};
use super::kv_cache::KvCache;
use super::weights::{FusedLinear, Linear, MatmulBackend, RmsNorm, Weight, WeightSource};
use crate::kernels::attention::AttentionSeq;
use crate::kernels::rope::{inverse_frequencies, RotaryAngles};

/// One sequence of a forward batch.
#[derive(Clone, Copy, Debug)]
pub struct SeqInput<'a> {
    /// Tokens to run, at positions `start_pos..start_pos + tokens.len()`.
    pub tokens: &'a [u32],
    pub start_pos: usize,
    /// KV block ids of the sequence, in order; must already hold `start_pos + tokens.len()`
    /// positions (see [`KvCache::reserve`]).
    pub blocks: &'a [u32],
}

pub struct ForwardOutput {
    /// `[sequences, vocab]`, `f32`: logits at each sequence's last new position.
    pub logits: Tensor,
    /// `[sequences, hidden]`: the final normalised hidden state there, when asked for.
    pub hidden: Option<Tensor>,
}

struct Attention {
    /// q, k and v.
    qkv: FusedLinear,
    o: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
}

struct Mlp {
    /// gate and up.
    gate_up: FusedLinear,
    down: Linear,
}

struct DecoderLayer {
    attn_norm: RmsNorm,
    attn: Attention,
    ffn_norm: RmsNorm,
    mlp: Mlp,
}

pub struct Model {
    config: ModelConfig,
    embed: Weight,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear,
    inv_freq: Vec<f32>,
    device: Device,
    streamed_bytes: usize,
}

/// Counts the bytes of every matrix a decode step streams from memory.
struct CountingSource<'a> {
    inner: &'a mut dyn WeightSource,
    bytes: usize,
    backend: MatmulBackend,
}

impl WeightSource for CountingSource<'_> {
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Weight> {
        let w = self.inner.matrix(name, rows, cols)?;
        self.bytes += w.storage_bytes();
        Ok(w)
    }
    fn vector(&mut self, name: &str, len: usize) -> Result<Tensor> {
        let v = self.inner.vector(name, len)?;
        self.bytes += len * 4;
        Ok(v)
    }
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }
    fn backend(&self) -> MatmulBackend {
        self.backend
    }
}

impl DecoderLayer {
    fn load(src: &mut dyn WeightSource, c: &ModelConfig, i: usize) -> Result<Self> {
        let p = format!("blk.{i}");
        let h = c.hidden_size;
        let eps = c.rms_norm_eps;
        let head_norm = |src: &mut dyn WeightSource, name: &str| {
            RmsNorm::load(src, &format!("{p}.{name}.weight"), c.head_dim, eps)
        };
        let attn = Attention {
            qkv: FusedLinear::load(
                src,
                &[
                    (&format!("{p}.attn_q"), c.q_dim()),
                    (&format!("{p}.attn_k"), c.kv_dim()),
                    (&format!("{p}.attn_v"), c.kv_dim()),
                ],
                h,
                c.qkv_bias,
            )?,
            o: Linear::load(src, &format!("{p}.attn_output"), h, c.q_dim(), false)?,
            q_norm: c
                .qk_norm
                .then(|| head_norm(src, "attn_q_norm"))
                .transpose()?,
            k_norm: c
                .qk_norm
                .then(|| head_norm(src, "attn_k_norm"))
                .transpose()?,
        };
        let ffn = c.intermediate_size;
        Ok(Self {
            attn_norm: RmsNorm::load(src, &format!("{p}.attn_norm.weight"), h, eps)?,
            attn,
            ffn_norm: RmsNorm::load(src, &format!("{p}.ffn_norm.weight"), h, eps)?,
            mlp: Mlp {
                gate_up: FusedLinear::load(
                    src,
                    &[
                        (&format!("{p}.ffn_gate"), ffn),
                        (&format!("{p}.ffn_up"), ffn),
                    ],
                    h,
                    false,
                )?,
                down: Linear::load(src, &format!("{p}.ffn_down"), h, ffn, false)?,
            },
        })
    }
}

impl Model {
    pub fn load(config: ModelConfig, src: &mut dyn WeightSource, device: &Device) -> Result<Self> {
        let backend = src.backend();
        Self::load_with(config, src, device, backend)
    }

    /// Loads with an explicit choice of quantized-matmul kernels.
    pub fn load_with(
        config: ModelConfig,
        src: &mut dyn WeightSource,
        device: &Device,
        backend: MatmulBackend,
    ) -> Result<Self> {
        config.validate()?;
        let embed = src.matrix("token_embd.weight", config.vocab_size, config.hidden_size)?;
        let mut counting = CountingSource {
            inner: src,
            bytes: 0,
            backend,
        };
        let layers = (0..config.num_layers)
            .map(|i| DecoderLayer::load(&mut counting, &config, i))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::load(
            &mut counting,
            "output_norm.weight",
            config.hidden_size,
            config.rms_norm_eps,
        )?;
        let lm_head = if config.tied_embeddings || !counting.contains("output.weight") {
            counting.bytes += embed.storage_bytes();
            Linear::new(embed.matmul(backend)?, None)
        } else {
            Linear::load(
                &mut counting,
                "output",
                config.vocab_size,
                config.hidden_size,
                false,
            )?
        };
        let streamed_bytes = counting.bytes;
        let inv_freq = inverse_frequencies(config.head_dim, config.rope_theta);
        Ok(Self {
            config,
            embed,
            layers,
            norm,
            lm_head,
            inv_freq,
            device: device.clone(),
            streamed_bytes,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Bytes of weights one decode step reads (every layer and the LM head; the embedding
    /// lookup reads one row and is not counted).
    pub fn streamed_weight_bytes(&self) -> usize {
        self.streamed_bytes
    }

    /// Input embeddings of `tokens`, `[tokens, hidden]` row-major.
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        let ids = Tensor::from_slice(tokens, tokens.len(), &self.device)?;
        let rows = self.embed.rows(&ids)?.to_dtype(DType::F32)?;
        Ok(rows.flatten_all()?.to_vec1::<f32>()?)
    }

    /// Runs every sequence's new tokens and returns their last-position logits.
    pub fn forward(
        &self,
        batch: &[SeqInput],
        kv: &mut KvCache,
        want_hidden: bool,
    ) -> Result<ForwardOutput> {
        let Some((x, last_rows)) = self.trunk(batch, kv)? else {
            return self.empty_output(want_hidden);
        };
        let last = Tensor::from_vec(last_rows, batch.len(), &self.device)?;
        let hidden = self.norm.forward(&x.index_select(&last, 0)?)?;
        let logits = self.lm_head.forward(&hidden)?;
        Ok(ForwardOutput {
            logits,
            hidden: want_hidden.then_some(hidden),
        })
    }

    /// Like [`Model::forward`], but logits and hidden states at every new position of every
    /// sequence, in order (`[tokens, vocab]`, `[tokens, hidden]`): what training a router
    /// over a text reads.
    pub fn forward_all_positions(
        &self,
        batch: &[SeqInput],
        kv: &mut KvCache,
    ) -> Result<ForwardOutput> {
        let Some((x, _)) = self.trunk(batch, kv)? else {
            return self.empty_output(true);
        };
        let hidden = self.norm.forward(&x)?;
        let logits = self.lm_head.forward(&hidden)?;
        Ok(ForwardOutput {
            logits,
            hidden: Some(hidden),
        })
    }

    fn empty_output(&self, want_hidden: bool) -> Result<ForwardOutput> {
        let c = &self.config;
        Ok(ForwardOutput {
            logits: Tensor::zeros((0, c.vocab_size), DType::F32, &self.device)?,
            hidden: want_hidden
                .then(|| Tensor::zeros((0, c.hidden_size), DType::F32, &self.device))
                .transpose()?,
        })
    }

    /// The decoder layers over every new token of the batch: the residual stream before the
    /// final norm, `[tokens, hidden]`, and each sequence's last row in it (`None` when the
    /// batch is empty).
    fn trunk(&self, batch: &[SeqInput], kv: &mut KvCache) -> Result<Option<(Tensor, Vec<u32>)>> {
        let c = &self.config;
        self.validate_batch(batch, kv)?;
        if batch.is_empty() {
            return Ok(None);
        }
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut last_rows = Vec::with_capacity(batch.len());
        for seq in batch {
            ids.extend_from_slice(seq.tokens);
            positions.extend((seq.start_pos..seq.start_pos + seq.tokens.len()).map(|p| p as u32));
            last_rows.push(ids.len() as u32 - 1);
        }
        let attn_seqs: Vec<AttentionSeq> = batch
            .iter()
            .map(|s| AttentionSeq {
                blocks: s.blocks,
                start_pos: s.start_pos,
                num_tokens: s.tokens.len(),
            })
            .collect();
        let angles = RotaryAngles::new(&positions, &self.inv_freq, c.rope_style);
        let num_tokens = ids.len();
        let ids = Tensor::from_vec(ids, num_tokens, &self.device)?;
        let mut x = self.embed.rows(&ids)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let h = layer.attn_norm.forward(&x)?;
            let a = self.attention(&layer.attn, &h, i, &angles, &attn_seqs, kv)?;
            x = (x + a)?;
            let h = layer.ffn_norm.forward(&x)?;
            let m = &layer.mlp;
            let [gate, up]: [Tensor; 2] = m
                .gate_up
                .forward(&h)?
                .try_into()
                .expect("gate and up were loaded together");
            let gated = (candle_nn::ops::silu(&gate)? * up)?;
            x = (x + m.down.forward(&gated)?)?;
        }
        Ok(Some((x, last_rows)))
    }

    fn attention(
        &self,
        attn: &Attention,
        x: &Tensor,
        layer: usize,
        angles: &RotaryAngles,
        seqs: &[AttentionSeq],
        kv: &mut KvCache,
    ) -> Result<Tensor> {
        let c = &self.config;
        let t = x.dim(0)?;
        let heads = |y: Tensor, n: usize, norm: &Option<RmsNorm>| -> Result<Vec<f32>> {
            let y = match norm {
                Some(norm) => norm.forward(&y.reshape((t, n, c.head_dim))?)?,
                None => y,
            };
            Ok(y.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
        };
        let [q, k, v]: [Tensor; 3] = attn
            .qkv
            .forward(x)?
            .try_into()
            .expect("q, k and v were loaded together");
        let mut q = heads(q, c.num_heads, &attn.q_norm)?;
        let mut k = heads(k, c.num_kv_heads, &attn.k_norm)?;
        let v = heads(v, c.num_kv_heads, &None)?;
        angles.apply(&mut q, c.num_heads);
        angles.apply(&mut k, c.num_kv_heads);
        kv.write(layer, seqs, &k, &v);
        let mut out = vec![0f32; q.len()];
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        kv.attention(layer, &q, c.num_heads, seqs, scale, &mut out);
        let out = Tensor::from_vec(out, (t, c.q_dim()), &self.device)?;
        attn.o.forward(&out)
    }

    fn validate_batch(&self, batch: &[SeqInput], kv: &KvCache) -> Result<()> {
        let c = &self.config;
        for (i, seq) in batch.iter().enumerate() {
            if seq.tokens.is_empty() {
                return Err(ModelError::InvalidBatch(format!(
                    "sequence {i} brings no tokens"
                )));
            }
            let end = seq.start_pos + seq.tokens.len();
            if end > c.context_length {
                return Err(ModelError::ContextOverflow {
                    needed: end,
                    limit: c.context_length,
                });
            }
            let capacity = seq.blocks.len() * kv.block_size();
            if capacity < end {
                return Err(ModelError::InvalidBatch(format!(
                    "sequence {i} needs {end} KV positions but its block table holds {capacity}"
                )));
            }
            if let Some(&id) = seq.tokens.iter().find(|&&id| id as usize >= c.vocab_size) {
                return Err(ModelError::TokenOutOfRange {
                    id,
                    vocab: c.vocab_size,
                });
            }
        }
        Ok(())
    }
}
