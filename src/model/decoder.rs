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

use candle_core::{Device, Tensor};

use super::backend::cpu::Cpu;
#[cfg(feature = "cuda")]
use super::backend::cuda::Cuda;
use super::backend::{Backend, Pass, QkvSpec};
use super::batch::{logit_rows, SeqInput};
use super::config::ModelConfig;
use super::error::{ModelError, Result};
use super::kv_cache::KvCache;
use super::timing::{timed, Part, PROJECTIONS};
use super::weights::{MatmulBackend, WeightSource};
use crate::kernels::rope::inverse_frequencies;
use load::{CountingSource, Loader};

mod head;
mod load;

pub struct ForwardOutput {
    /// `[rows, vocab]`, `f32`: logits at the last new position of each sequence with
    /// [`SeqInput::logits`], in batch order (row `i` is the `i`-th such sequence, not the
    /// `i`-th of the batch).
    pub logits: Tensor,
    /// `[rows, hidden]`: the final normalised hidden state there, when asked for.
    pub hidden: Option<Tensor>,
}

/// The model on its device: the decoder over the backend it was loaded for.
pub struct Model {
    inner: Inner,
}

// One per loaded model, made once and never moved on a hot path: sizes may differ.
#[allow(clippy::large_enum_variant)]
enum Inner {
    Cpu(Decoder<Cpu>),
    #[cfg(feature = "cuda")]
    Cuda(Decoder<Cuda>),
}

/// `$body` with `$d` bound to the model's decoder, whatever its backend.
macro_rules! with_decoder {
    ($model:expr, $d:ident => $body:expr) => {
        match &$model.inner {
            Inner::Cpu($d) => $body,
            #[cfg(feature = "cuda")]
            Inner::Cuda($d) => $body,
        }
    };
}

impl Model {
    pub fn load(config: ModelConfig, src: &mut dyn WeightSource, device: &Device) -> Result<Self> {
        let backend = src.backend();
        Self::load_with(config, src, device, backend)
    }

    /// Loads on the CPU with an explicit choice of quantized-matmul kernels. Weights on
    /// `device` are read into host memory first.
    pub fn load_with(
        config: ModelConfig,
        src: &mut dyn WeightSource,
        _device: &Device,
        backend: MatmulBackend,
    ) -> Result<Self> {
        Self::load_on(config, src, super::ComputeTarget::Cpu(backend))
    }

    /// Loads onto `target`: repacked for the CPU's kernels, or uploaded as stored to a GPU.
    pub fn load_on(
        config: ModelConfig,
        src: &mut dyn WeightSource,
        target: super::ComputeTarget,
    ) -> Result<Self> {
        let inner = match target {
            super::ComputeTarget::Cpu(matmul) => {
                Inner::Cpu(Decoder::load(Cpu { matmul }, config, src)?)
            }
            #[cfg(feature = "cuda")]
            super::ComputeTarget::Cuda(n) => {
                Inner::Cuda(Decoder::load(Cuda::open(n)?, config, src)?)
            }
            #[cfg(not(feature = "cuda"))]
            super::ComputeTarget::Cuda(n) => {
                return Err(ModelError::Device(format!(
                    "cuda:{n}: this binary was built without the `cuda` feature \
                     (cargo build --release --features cuda)"
                )))
            }
        };
        Ok(Self { inner })
    }

    pub fn config(&self) -> &ModelConfig {
        with_decoder!(self, d => &d.config)
    }

    /// The device and kernels the model runs on.
    pub fn describe_device(&self) -> String {
        with_decoder!(self, d => d.backend.describe())
    }

    /// For a model on a GPU, the rate its memory copies device to device (bytes read and
    /// written per second, measured now): the bandwidth its roofline is read against. `None`
    /// on the CPU.
    pub fn device_copy_rate(&self) -> Result<Option<f64>> {
        match &self.inner {
            Inner::Cpu(_) => Ok(None),
            #[cfg(feature = "cuda")]
            Inner::Cuda(d) => d.backend.copy_rate().map(Some),
        }
    }

    /// For a model on a GPU, its device's free and total memory in bytes, what the model's
    /// stream keeps of freed memory handed back first (so it counts as free); `None` on the
    /// CPU.
    pub fn device_memory(&self) -> Result<Option<(usize, usize)>> {
        match &self.inner {
            Inner::Cpu(_) => Ok(None),
            #[cfg(feature = "cuda")]
            Inner::Cuda(d) => d.backend.memory().map(Some),
        }
    }

    /// Whether a GPU model replays decode steps from CUDA graphs it records (on unless
    /// turned off, as vLLM's `--enforce-eager` does); a CPU model has none.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub fn set_cuda_graphs(&self, on: bool) {
        match &self.inner {
            Inner::Cpu(_) => {}
            #[cfg(feature = "cuda")]
            Inner::Cuda(d) => d.backend.set_recording(on),
        }
    }

    /// How many decode steps a GPU model has run from its CUDA graphs (always 0 on the CPU).
    pub fn cuda_graph_replays(&self) -> u64 {
        match &self.inner {
            Inner::Cpu(_) => 0,
            #[cfg(feature = "cuda")]
            Inner::Cuda(d) => d.backend.replays(),
        }
    }

    /// Whether the model runs on a GPU.
    pub fn on_gpu(&self) -> bool {
        !matches!(self.inner, Inner::Cpu(_))
    }

    /// On a GPU, the device time of each kernel launched since the last call while the
    /// breakdown was on ([`timing::set_breakdown`](super::timing::set_breakdown)), longest
    /// first; empty on the CPU.
    pub fn take_kernel_times(&self) -> Result<Vec<super::timing::KernelTime>> {
        match &self.inner {
            Inner::Cpu(_) => Ok(Vec::new()),
            #[cfg(feature = "cuda")]
            Inner::Cuda(d) => d.backend.take_kernel_times(),
        }
    }

    /// A KV cache of `num_blocks` blocks of `block_size` positions on the model's device.
    pub fn kv_cache(
        &self,
        block_size: usize,
        num_blocks: usize,
        dtype: super::KvDtype,
    ) -> Result<KvCache> {
        match &self.inner {
            Inner::Cpu(d) => KvCache::new(&d.config, block_size, num_blocks, dtype),
            #[cfg(feature = "cuda")]
            Inner::Cuda(d) => d.backend.kv_cache(&d.config, block_size, num_blocks, dtype),
        }
    }

    /// A KV cache on the model's device large enough for `tokens` positions.
    pub fn kv_cache_for(
        &self,
        block_size: usize,
        tokens: usize,
        dtype: super::KvDtype,
    ) -> Result<KvCache> {
        self.kv_cache(block_size, tokens.div_ceil(block_size.max(1)), dtype)
    }

    /// Bytes of weights one decode step reads (every layer and the LM head; the embedding
    /// lookup reads one row and is not counted).
    pub fn streamed_weight_bytes(&self) -> usize {
        with_decoder!(self, d => d.streamed_bytes)
    }

    /// The LM head's part of [`streamed_weight_bytes`](Self::streamed_weight_bytes).
    pub fn lm_head_bytes(&self) -> usize {
        with_decoder!(self, d => d.lm_head_bytes)
    }

    /// Each of the layers' projections' part of
    /// [`streamed_weight_bytes`](Self::streamed_weight_bytes), over every layer, in the order
    /// of [`PROJECTIONS`].
    pub fn projection_bytes(&self) -> [usize; PROJECTIONS.len()] {
        with_decoder!(self, d => d.projection_bytes)
    }

    /// Whether the embedding lookup reads the tied LM head's rows (the loaded embedding
    /// matrix was dropped).
    pub fn embeds_from_lm_head(&self) -> bool {
        with_decoder!(self, d => d.backend.embeds_from_head(&d.embed))
    }

    /// Input embeddings of `tokens`, `[tokens, hidden]` row-major, in host memory.
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        with_decoder!(self, d => {
            d.check_tokens(tokens)?;
            let rows = d.backend.embed(&d.embed, &d.lm_head, tokens, None)?;
            d.backend.to_host(rows)
        })
    }

    /// Runs every sequence's new tokens (writing their K/V) and returns the last-position
    /// logits of the sequences that ask for them.
    pub fn forward(
        &self,
        batch: &[SeqInput],
        kv: &mut KvCache,
        want_hidden: bool,
    ) -> Result<ForwardOutput> {
        with_decoder!(self, d => d.forward(batch, kv, want_hidden))
    }

    /// Like [`Model::forward`], but logits and hidden states at every new position of every
    /// sequence, in order (`[tokens, vocab]`, `[tokens, hidden]`): what training a router
    /// over a text reads.
    pub fn forward_all_positions(
        &self,
        batch: &[SeqInput],
        kv: &mut KvCache,
    ) -> Result<ForwardOutput> {
        with_decoder!(self, d => d.forward_all_positions(batch, kv))
    }
}

/// The architecture, written once over a backend.
struct Decoder<B: Backend> {
    backend: B,
    config: ModelConfig,
    embed: B::Embedding,
    layers: Vec<DecoderLayer<B>>,
    norm: B::Norm,
    lm_head: B::Linear,
    /// An LM head over the first `n` token ids only, for a model that only drafts
    /// ([`Model::set_draft_vocab`]): [`Model::forward`] gives the other ids -inf.
    draft_head: Option<(B::Linear, usize)>,
    inv_freq: Vec<f32>,
    streamed_bytes: usize,
    /// The LM head's share of `streamed_bytes`.
    lm_head_bytes: usize,
    /// The layers' projections' shares of `streamed_bytes`, over every layer.
    projection_bytes: [usize; PROJECTIONS.len()],
}

struct Attention<B: Backend> {
    /// q, k and v.
    qkv: B::Linear,
    o: B::Linear,
    q_norm: Option<B::Norm>,
    k_norm: Option<B::Norm>,
}

struct Mlp<B: Backend> {
    /// gate and up, and the SiLU·gate between them and `down`.
    gate_up: B::GateUp,
    down: B::Linear,
}

struct DecoderLayer<B: Backend> {
    attn_norm: B::Norm,
    attn: Attention<B>,
    ffn_norm: B::Norm,
    mlp: Mlp<B>,
}

/// What every layer of one forward pass works with: the backend, the KV cache, the step's
/// uploaded positions and tables, and the sizes of the batch.
struct StepCtx<'s, 'a, B: Backend> {
    backend: &'s B,
    config: &'s ModelConfig,
    kv: &'s mut B::Kv,
    step: &'s B::Step<'a>,
    /// New tokens in the batch.
    tokens: usize,
}

impl<B: Backend> Decoder<B> {
    fn load(backend: B, config: ModelConfig, src: &mut dyn WeightSource) -> Result<Self> {
        config.validate()?;
        let embed = src.matrix("token_embd.weight", config.vocab_size, config.hidden_size)?;
        let mut counting = CountingSource {
            inner: src,
            bytes: 0,
            projections: [0; PROJECTIONS.len()],
        };
        let mut loader = Loader {
            backend: &backend,
            src: &mut counting,
            config: &config,
        };
        let layers = (0..config.num_layers)
            .map(|i| loader.layer(i))
            .collect::<Result<Vec<_>>>()?;
        let norm = loader.norm("output_norm.weight", config.hidden_size)?;
        let tied = config.tied_embeddings || !counting.contains("output.weight");
        let before_head = counting.bytes;
        let lm_head = if tied {
            counting.bytes += embed.storage_bytes();
            backend.linear(std::slice::from_ref(&embed), &[], &[config.vocab_size])?
        } else {
            let mut loader = Loader {
                backend: &backend,
                src: &mut counting,
                config: &config,
            };
            loader.linear(&[("output", config.vocab_size)], config.hidden_size, false)?
        };
        let streamed_bytes = counting.bytes;
        let lm_head_bytes = streamed_bytes - before_head;
        let projection_bytes = counting.projections;
        let embed = backend.embedding(embed, tied.then_some(&lm_head))?;
        let inv_freq = inverse_frequencies(config.head_dim, config.rope_theta);
        Ok(Self {
            backend,
            config,
            embed,
            layers,
            norm,
            lm_head,
            draft_head: None,
            inv_freq,
            streamed_bytes,
            lm_head_bytes,
            projection_bytes,
        })
    }

    fn forward(
        &self,
        batch: &[SeqInput],
        kv: &mut KvCache,
        want_hidden: bool,
    ) -> Result<ForwardOutput> {
        self.validate_batch(batch, kv)?;
        let rows = logit_rows(batch);
        if batch.is_empty() {
            return self.empty_output(want_hidden);
        }
        let (b, hidden) = (&self.backend, self.config.hidden_size);
        // The rows returned depend on the batch's shape and `want_hidden` only.
        let pass = self.pass(batch, kv, Some(want_hidden as u64));
        let out = b.run_pass(&pass, b.kv(kv)?, |step, kv| {
            let x = self.trunk(batch, step, kv, !rows.is_empty())?;
            if rows.is_empty() {
                return Ok(Vec::new());
            }
            let last = b.select_rows(&x, step, &rows, hidden)?;
            self.head(last, rows.len(), want_hidden, true)
        })?;
        match rows.is_empty() {
            true => self.empty_output(want_hidden),
            false => self.output(out, rows.len(), true),
        }
    }

    fn forward_all_positions(&self, batch: &[SeqInput], kv: &mut KvCache) -> Result<ForwardOutput> {
        self.validate_batch(batch, kv)?;
        if batch.is_empty() {
            return self.empty_output(true);
        }
        let tokens = batch.iter().map(|s| s.tokens.len()).sum();
        let b = &self.backend;
        let pass = self.pass(batch, kv, None);
        let out = b.run_pass(&pass, b.kv(kv)?, |step, kv| {
            let x = self.trunk(batch, step, kv, true)?;
            self.head(x, tokens, true, false)
        })?;
        self.output(out, tokens, false)
    }

    /// A forward pass over `batch` and `kv`'s blocks; `replay_key`: see [`Pass`].
    fn pass<'s, 'a>(
        &'s self,
        batch: &'a [SeqInput<'a>],
        kv: &KvCache,
        replay_key: Option<u64>,
    ) -> Pass<'s, 'a> {
        Pass {
            config: &self.config,
            batch,
            block_size: kv.block_size(),
            inv_freq: &self.inv_freq,
            replay_key,
        }
    }

    /// The decoder layers over every new token of the (non-empty) batch at `step`: the
    /// residual stream before the final norm (`[tokens, hidden]`). `head`: the LM head runs
    /// next (its weights are prefetched during the last layer).
    fn trunk(
        &self,
        batch: &[SeqInput],
        step: &B::Step<'_>,
        kv: &mut B::Kv,
        head: bool,
    ) -> Result<B::Rows> {
        let (b, c) = (&self.backend, &self.config);
        let ids: Vec<u32> = batch
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let t = ids.len();
        let mut ctx = StepCtx {
            backend: b,
            config: c,
            step,
            kv,
            tokens: t,
        };
        let mut x = b.embed(&self.embed, &self.lm_head, &ids, Some(step))?;
        let mut h = b.zeros(t, c.hidden_size)?;
        let mut gated = b.zeros(t, c.intermediate_size)?;
        // The previous layer's FFN output, added to the trunk in the pass of the next norm (or
        // after the last layer, below).
        let mut ffn_out: Option<B::Rows> = None;
        for (i, layer) in self.layers.iter().enumerate() {
            let next = match self.layers.get(i + 1) {
                Some(next) => Some(&next.attn.qkv),
                None if head => Some(self.draft_head.as_ref().map_or(&self.lm_head, |(h, _)| h)),
                None => None,
            };
            let pending = ffn_out.take();
            ffn_out = Some(layer.forward(i, &mut x, pending, &mut h, &mut gated, next, &mut ctx)?);
        }
        if let Some(y) = ffn_out {
            timed(Part::AddNorm, || b.add(&mut x, &y))?;
        }
        Ok(x)
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let vocab = self.config.vocab_size;
        match tokens.iter().find(|&&id| id as usize >= vocab) {
            Some(&id) => Err(ModelError::TokenOutOfRange { id, vocab }),
            None => Ok(()),
        }
    }

    fn validate_batch(&self, batch: &[SeqInput], kv: &KvCache) -> Result<()> {
        let c = &self.config;
        for (i, seq) in batch.iter().enumerate() {
            if seq.tokens.is_empty() {
                return Err(ModelError::InvalidBatch(format!(
                    "sequence {i} brings no tokens"
                )));
            }
            if seq.logits > seq.tokens.len() {
                return Err(ModelError::InvalidBatch(format!(
                    "sequence {i} asks for the logits of {} positions but brings {} tokens",
                    seq.logits,
                    seq.tokens.len()
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

impl<B: Backend> DecoderLayer<B> {
    /// One layer over the trunk `x`: `pending` (the previous layer's FFN output) is added in
    /// the pass of the first norm, and this layer's FFN output is returned for the next one.
    /// `h` and `gated` are scratch of the trunk's and the FFN's width. Before each matmul the
    /// one after it is named (`next`: the first matmul after this layer), so a CPU's idle
    /// threads stream its weights in while the caller works alone between the two.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        layer: usize,
        x: &mut B::Rows,
        pending: Option<B::Rows>,
        h: &mut B::Rows,
        gated: &mut B::Rows,
        next: Option<&B::Linear>,
        ctx: &mut StepCtx<'_, '_, B>,
    ) -> Result<B::Rows> {
        let (b, t) = (ctx.backend, ctx.tokens);
        timed(Part::AddNorm, || {
            b.add_norm(&self.attn_norm, x, pending.as_ref(), h)
        })?;
        b.prefetch(&self.attn.o);
        let a = self.attn.forward(layer, h, ctx)?;
        b.prefetch_gate_up(&self.mlp.gate_up);
        let a = timed(Part::AttnOut, || b.project_one(&self.attn.o, &a, t))?;
        timed(Part::AddNorm, || b.add_norm(&self.ffn_norm, x, Some(&a), h))?;
        b.prefetch(&self.mlp.down);
        timed(Part::GateUp, || {
            b.gate_up_forward(&self.mlp.gate_up, h, t, gated)
        })?;
        if let Some(next) = next {
            b.prefetch(next);
        }
        timed(Part::Down, || b.project_one(&self.mlp.down, gated, t))
    }
}

impl<B: Backend> Attention<B> {
    /// Self-attention of normalised rows `x` (`[tokens, hidden]`): the attention output,
    /// `[tokens, q_dim]`, before the output projection.
    fn forward(&self, layer: usize, x: &B::Rows, ctx: &mut StepCtx<'_, '_, B>) -> Result<B::Rows> {
        let (b, c) = (ctx.backend, ctx.config);
        // The new rows' cache lines come in while the projection runs.
        b.prefetch_kv(ctx.kv, layer, ctx.step);
        let spec = QkvSpec {
            qkv: &self.qkv,
            q_norm: self.q_norm.as_ref(),
            k_norm: self.k_norm.as_ref(),
            heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            layer,
        };
        let q = b.attention_inputs(&spec, x, ctx.tokens, ctx.step, ctx.kv)?;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        timed(Part::Attention, || {
            b.attention(ctx.kv, layer, ctx.step, &q, c.num_heads, scale)
        })
    }
}
