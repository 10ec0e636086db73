//! The Llama-family decoder (Llama/SmolLM2, Qwen2, Qwen3) as immutable weights plus one batched
//! forward pass over a caller-owned paged KV cache.
//!
//! One forward call takes a batch in which every sequence brings its own new tokens (a prefill
//! chunk, an extend or a single decode token) at its own position. All new tokens of the batch
//! go through the matmuls together as one `[tokens, hidden]` matrix; attention reads each
//! sequence's blocks in place. The call returns, for each sequence that asks for them
//! ([`SeqInput::logits`]), the logits of its last new position and, on request, the final
//! (post-norm) hidden state there; the LM head runs only over those rows, so a prefill chunk
//! that does not end its prompt costs no LM head. The model keeps no per-request state and
//! knows nothing of scheduling.

use candle_core::{DType, Device, Tensor};

use super::config::ModelConfig;
use super::error::{ModelError, Result};
use super::kv_cache::KvCache;
use super::layers::{FusedLinear, GateUp, Linear, RmsNorm};
use super::profile::{projection_of, timed, Part, PROJECTIONS};
use super::weights::{MatmulBackend, Weight, WeightSource};
use crate::kernels::add_in_place;
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
    /// Whether the caller reads the logits (and hidden state) at the last new position: false
    /// for a prefill chunk that does not end the sequence's known tokens, whose K/V are all
    /// the step is for. [`Model::forward_all_positions`] ignores it.
    pub logits: bool,
}

pub struct ForwardOutput {
    /// `[rows, vocab]`, `f32`: logits at the last new position of each sequence with
    /// [`SeqInput::logits`], in batch order (row `i` is the `i`-th such sequence, not the
    /// `i`-th of the batch).
    pub logits: Tensor,
    /// `[rows, hidden]`: the final normalised hidden state there, when asked for.
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
    /// gate and up, and the SiLU·gate between them and `down`.
    gate_up: GateUp,
    down: Linear,
}

struct DecoderLayer {
    attn_norm: RmsNorm,
    attn: Attention,
    ffn_norm: RmsNorm,
    mlp: Mlp,
}

/// Where the embedding lookup reads its rows.
enum Embedding {
    /// The token-embedding matrix as loaded.
    Weight(Weight),
    /// The tied LM head's own repacked copy (the loaded matrix is dropped rather than held
    /// twice: 30 MB for SmolLM2's Q8_0 vocabulary).
    Head,
}

pub struct Model {
    config: ModelConfig,
    embed: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear,
    inv_freq: Vec<f32>,
    device: Device,
    streamed_bytes: usize,
    /// The LM head's share of `streamed_bytes`.
    lm_head_bytes: usize,
    /// The layers' projections' shares of `streamed_bytes`, over every layer.
    projection_bytes: [usize; PROJECTIONS.len()],
}

/// Counts the bytes of every matrix a decode step streams from memory.
struct CountingSource<'a> {
    inner: &'a mut dyn WeightSource,
    bytes: usize,
    /// The part of `bytes` in each of the layers' projections, in the order of
    /// [`PROJECTIONS`].
    projections: [usize; PROJECTIONS.len()],
    backend: MatmulBackend,
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
                gate_up: GateUp::load(
                    src,
                    &format!("{p}.ffn_gate"),
                    &format!("{p}.ffn_up"),
                    ffn,
                    h,
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
            projections: [0; PROJECTIONS.len()],
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
        let tied = config.tied_embeddings || !counting.contains("output.weight");
        let before_head = counting.bytes;
        let lm_head = if tied {
            counting.bytes += embed.storage_bytes();
            Linear::new(embed.matmul(backend)?, None)?
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
        let lm_head_bytes = streamed_bytes - before_head;
        // A tied head with rows of its own serves the lookup too; the loaded copy is dropped.
        let head_has_rows = lm_head
            .own_kernel()
            .is_some_and(|k| k.dequantize_row(0, &mut vec![0f32; k.in_features()]));
        let embed = if tied && head_has_rows {
            Embedding::Head
        } else {
            Embedding::Weight(embed)
        };
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
            lm_head_bytes,
            projection_bytes: counting.projections,
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

    /// The LM head's part of [`streamed_weight_bytes`](Self::streamed_weight_bytes).
    pub fn lm_head_bytes(&self) -> usize {
        self.lm_head_bytes
    }

    /// Each of the layers' projections' part of
    /// [`streamed_weight_bytes`](Self::streamed_weight_bytes), over every layer, in the order
    /// of [`PROJECTIONS`].
    pub fn projection_bytes(&self) -> [usize; PROJECTIONS.len()] {
        self.projection_bytes
    }

    /// Whether the embedding lookup reads the tied LM head's rows (the loaded embedding
    /// matrix was dropped).
    pub fn embeds_from_lm_head(&self) -> bool {
        matches!(self.embed, Embedding::Head)
    }

    /// Input embeddings of `tokens`, `[tokens, hidden]` row-major.
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        let head = match &self.embed {
            Embedding::Weight(w) => {
                let ids = Tensor::from_slice(tokens, tokens.len(), &self.device)?;
                let rows = w.rows(&ids)?.to_dtype(DType::F32)?;
                return Ok(rows.flatten_all()?.to_vec1::<f32>()?);
            }
            Embedding::Head => self.lm_head.own_kernel().expect("checked at load"),
        };
        let hidden = self.config.hidden_size;
        let mut out = vec![0f32; tokens.len() * hidden];
        for (&id, row) in tokens.iter().zip(out.chunks_exact_mut(hidden)) {
            if id as usize >= head.out_features() {
                return Err(ModelError::TokenOutOfRange {
                    id,
                    vocab: head.out_features(),
                });
            }
            head.dequantize_row(id as usize, row);
        }
        Ok(out)
    }

    /// Runs every sequence's new tokens (writing their K/V) and returns the last-position
    /// logits of the sequences that ask for them.
    pub fn forward(
        &self,
        batch: &[SeqInput],
        kv: &mut KvCache,
        want_hidden: bool,
    ) -> Result<ForwardOutput> {
        let head = batch.iter().any(|s| s.logits);
        let Some((x, last_rows)) = self.trunk(batch, kv, head)? else {
            return self.empty_output(want_hidden);
        };
        if !head {
            return self.empty_output(want_hidden);
        }
        let h = self.config.hidden_size;
        let last: Vec<f32> = batch
            .iter()
            .zip(&last_rows)
            .filter(|(s, _)| s.logits)
            .flat_map(|(_, &r)| &x[r * h..(r + 1) * h])
            .copied()
            .collect();
        self.head(last, want_hidden)
    }

    /// Like [`Model::forward`], but logits and hidden states at every new position of every
    /// sequence, in order (`[tokens, vocab]`, `[tokens, hidden]`): what training a router
    /// over a text reads.
    pub fn forward_all_positions(
        &self,
        batch: &[SeqInput],
        kv: &mut KvCache,
    ) -> Result<ForwardOutput> {
        let Some((x, _)) = self.trunk(batch, kv, true)? else {
            return self.empty_output(true);
        };
        self.head(x, true)
    }

    /// The final norm and the LM head over residual rows `x` (`[rows, hidden]`).
    fn head(&self, mut x: Vec<f32>, want_hidden: bool) -> Result<ForwardOutput> {
        let c = &self.config;
        let rows = x.len() / c.hidden_size;
        timed(Part::AddNorm, || self.norm.forward_in_place(&mut x));
        let logits = timed(Part::LmHead, || self.lm_head.forward_rows(&x, rows))?;
        Ok(ForwardOutput {
            logits: Tensor::from_vec(logits, (rows, c.vocab_size), &self.device)?,
            hidden: want_hidden
                .then(|| Tensor::from_vec(x, (rows, c.hidden_size), &self.device))
                .transpose()?,
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
    /// final norm (`[tokens, hidden]`, row-major), and each sequence's last row in it (`None`
    /// when the batch is empty). Everything between the matmuls works on plain rows in place.
    /// `head`: the LM head runs next (its weights are prefetched during the last layer).
    fn trunk(
        &self,
        batch: &[SeqInput],
        kv: &mut KvCache,
        head: bool,
    ) -> Result<Option<(Vec<f32>, Vec<usize>)>> {
        let c = &self.config;
        self.validate_batch(batch, kv)?;
        if batch.is_empty() {
            return Ok(None);
        }
        let (ids, positions, last_rows) = flatten(batch);
        let attn_seqs: Vec<AttentionSeq> = batch
            .iter()
            .map(|s| AttentionSeq {
                blocks: s.blocks,
                start_pos: s.start_pos,
                num_tokens: s.tokens.len(),
            })
            .collect();
        let angles = RotaryAngles::new(&positions, &self.inv_freq, c.rope_style);
        let t = ids.len();
        let mut x = self.embed(&ids)?;
        let mut h = vec![0f32; x.len()];
        let ffn = c.intermediate_size;
        let mut gated = vec![0f32; t * ffn];
        // The previous layer's FFN output, added to the trunk in the pass of the next norm (or
        // after the last layer, below).
        let mut ffn_out: Option<Vec<f32>> = None;
        // Before each matmul, the one after it is named, so the pool's idle threads stream
        // its weights in while this thread works alone between the two.
        for (i, layer) in self.layers.iter().enumerate() {
            timed(Part::AddNorm, || {
                layer
                    .attn_norm
                    .add_forward(&mut x, ffn_out.take().as_deref(), &mut h)
            });
            layer.attn.o.prefetch_ahead();
            let a = self.attention(&layer.attn, &h, i, &angles, &attn_seqs, kv)?;
            layer.mlp.gate_up.prefetch_ahead();
            let a = timed(Part::AttnOut, || layer.attn.o.forward_rows(&a, t))?;
            timed(Part::AddNorm, || {
                layer.ffn_norm.add_forward(&mut x, Some(&a), &mut h)
            });
            layer.mlp.down.prefetch_ahead();
            timed(Part::GateUp, || {
                layer.mlp.gate_up.forward_into(&h, t, &mut gated)
            })?;
            match self.layers.get(i + 1) {
                Some(next) => next.attn.qkv.prefetch_ahead(),
                None if head => self.lm_head.prefetch_ahead(),
                None => {}
            }
            ffn_out = Some(timed(Part::Down, || {
                layer.mlp.down.forward_rows(&gated, t)
            })?);
        }
        if let Some(y) = ffn_out {
            timed(Part::AddNorm, || add_in_place(&mut x, &y));
        }
        Ok(Some((x, last_rows)))
    }

    /// Self-attention of normalised rows `x` (`[tokens, hidden]`): the attention output,
    /// `[tokens, q_dim]`, before the output projection.
    fn attention(
        &self,
        attn: &Attention,
        x: &[f32],
        layer: usize,
        angles: &RotaryAngles,
        seqs: &[AttentionSeq],
        kv: &mut KvCache,
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        let t = x.len() / c.hidden_size;
        // The new rows' cache lines come in while the projection runs.
        kv.prefetch_slots(layer, seqs);
        let qkv = timed(Part::Qkv, || attn.qkv.forward_rows(x, t))?;
        let part = |i: usize, norm: &Option<RmsNorm>| {
            let mut y = Vec::with_capacity(t * qkv.row(i, 0).len());
            for r in 0..t {
                y.extend_from_slice(qkv.row(i, r));
            }
            if let Some(norm) = norm {
                norm.forward_in_place(&mut y);
            }
            y
        };
        let q = timed(Part::RotaryKvWrite, || {
            let mut q = part(0, &attn.q_norm);
            let mut k = part(1, &attn.k_norm);
            let v = part(2, &None);
            angles.apply(&mut q, c.num_heads);
            angles.apply(&mut k, c.num_kv_heads);
            kv.write(layer, seqs, &k, &v);
            q
        });
        let mut out = vec![0f32; q.len()];
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        timed(Part::Attention, || {
            kv.attention(layer, &q, c.num_heads, seqs, scale, &mut out)
        });
        Ok(out)
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

/// The batch's new tokens in order, their positions, and each sequence's last row among them.
fn flatten(batch: &[SeqInput]) -> (Vec<u32>, Vec<u32>, Vec<usize>) {
    let mut ids = Vec::new();
    let mut positions = Vec::new();
    let mut last_rows = Vec::with_capacity(batch.len());
    for seq in batch {
        ids.extend_from_slice(seq.tokens);
        positions.extend((seq.start_pos..seq.start_pos + seq.tokens.len()).map(|p| p as u32));
        last_rows.push(ids.len() - 1);
    }
    (ids, positions, last_rows)
}
