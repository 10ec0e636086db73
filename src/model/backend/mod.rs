//! The seam between the decoder and a device. The decoder (`decoder.rs`) is written once over
//! [`Backend`]: it reads the checkpoint's tensors, hands each to the backend to make ready for
//! its device, and composes a forward pass from the backend's ops. A backend owns where the
//! data lives (host memory and the compute pool, or device memory and a stream) and how each
//! op runs; it never decides what the model computes.
//!
//! * [`cpu::Cpu`]: our SIMD kernels (`kernels::qmatmul`, attention, norms) over the compute
//!   pool, or candle's where ours do not take a format.
//! * `cuda::Cuda` (feature `cuda`): NVRTC-compiled kernels on one stream of one GPU.
//!
//! Every op takes the step's context ([`Backend::Step`]: positions, rotary angles, block
//! tables, uploaded once per forward) where it needs one. Ops that only pay on one device
//! (prefetching the next matmul's weights into the caches) have empty defaults.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use candle_core::Tensor;

use super::batch::SeqInput;
use super::config::ModelConfig;
use super::error::{ModelError, Result};
use super::kv_cache::KvCache;
use super::timing::{timed, Part};
use super::weights::Weight;

/// What one forward pass runs over.
pub struct Pass<'s, 'a> {
    pub config: &'s ModelConfig,
    pub batch: &'a [SeqInput<'a>],
    /// The KV cache's.
    pub block_size: usize,
    /// The rotary inverse frequencies (the layout is `config.rope_style`).
    pub inv_freq: &'s [f32],
    /// What, besides the batch's shape, decides the pass's launches (which rows it returns):
    /// a backend that records passes replays one only for an equal key over a batch of the
    /// same shape. `None`: the pass is not to be recorded.
    pub replay_key: Option<u64>,
}

/// A layer's q/k/v projection and what follows it before attention.
pub struct QkvSpec<'l, B: Backend> {
    /// q, k and v: three projections.
    pub qkv: &'l B::Linear,
    /// Per-head norms of q and of k, where the model has them.
    pub q_norm: Option<&'l B::Norm>,
    pub k_norm: Option<&'l B::Norm>,
    pub heads: usize,
    pub kv_heads: usize,
    pub layer: usize,
}

/// A device's ops and its forms of the model's data.
pub trait Backend: Send + Sync + Sized + 'static {
    /// `[rows, width]` `f32` activations, row-major, where the device computes.
    type Rows: Send;
    /// One or more projections of one input (`y = x Wᵀ + b` each), ready to multiply.
    type Linear: Send + Sync;
    /// A SwiGLU feed-forward's gate and up projections and the SiLU·gate joining them.
    type GateUp: Send + Sync;
    /// An RMS norm's weight and epsilon.
    type Norm: Send + Sync;
    /// What the embedding lookup reads.
    type Embedding: Send + Sync;
    /// Every layer's K and V storage (inside a [`KvCache`]).
    type Kv: Send;
    /// Per forward pass: the batch's positions, rotary angles and block tables, in the form
    /// the device's kernels read them.
    type Step<'a>;

    /// A short name of the device and its kernels, for logs and reports.
    fn describe(&self) -> String;

    /// Projections `weights[i]` (`widths[i]` rows each, over the same input) with their biases
    /// (one per weight, or none at all), run as few matmuls as the formats allow.
    fn linear(
        &self,
        weights: &[Weight],
        biases: &[Tensor],
        widths: &[usize],
    ) -> Result<Self::Linear>;
    /// Gate and up, `rows` rows each over `cols` inputs.
    fn gate_up(&self, gate: Weight, up: Weight, rows: usize, cols: usize) -> Result<Self::GateUp>;
    fn norm(&self, weight: &Tensor, eps: f64) -> Result<Self::Norm>;
    /// The lookup over `table`; `tied_head` is the LM head when it multiplies by the same
    /// matrix, so a backend may read rows from its copy and drop `table`.
    fn embedding(&self, table: Weight, tied_head: Option<&Self::Linear>)
        -> Result<Self::Embedding>;
    /// Whether `embedding` reads the tied LM head's rows.
    fn embeds_from_head(&self, embedding: &Self::Embedding) -> bool;
    /// The K/V storage of `cache`, which must have been made for this backend's device.
    fn kv<'c>(&self, cache: &'c mut KvCache) -> Result<&'c mut Self::Kv>;

    /// Uploads what every layer of one forward pass reads.
    fn begin_step<'a>(&self, pass: &Pass<'_, 'a>) -> Result<Self::Step<'a>>;

    /// Runs one forward pass: `launch` runs it over the step of `pass` and returns the rows
    /// to bring back, which come back to host memory in order. A device that records passes
    /// (the CUDA backend records decode steps as CUDA graphs) may replay a recording of an
    /// earlier pass instead of calling `launch`, where `pass.replay_key` allows it.
    fn run_pass<'a, F>(
        &self,
        pass: &Pass<'_, 'a>,
        kv: &mut Self::Kv,
        mut launch: F,
    ) -> Result<Vec<Vec<f32>>>
    where
        F: FnMut(&Self::Step<'a>, &mut Self::Kv) -> Result<Vec<Self::Rows>>,
    {
        let step = self.begin_step(pass)?;
        launch(&step, kv)?
            .into_iter()
            .map(|r| self.to_host(r))
            .collect()
    }

    /// Input embeddings of `ids`, `[ids, hidden]`; `step`: the pass whose new tokens they
    /// are, if any (a device may read them from its upload).
    fn embed(
        &self,
        e: &Self::Embedding,
        head: &Self::Linear,
        ids: &[u32],
        step: Option<&Self::Step<'_>>,
    ) -> Result<Self::Rows>;
    /// Rows of zeros.
    fn zeros(&self, rows: usize, width: usize) -> Result<Self::Rows>;
    /// `x += add` (when given), then `out` = the norm of each row of `x`.
    fn add_norm(
        &self,
        n: &Self::Norm,
        x: &mut Self::Rows,
        add: Option<&Self::Rows>,
        out: &mut Self::Rows,
    ) -> Result<()>;
    /// Normalises `x` in place, in rows of the norm's length (a per-head norm normalises each
    /// head of each token).
    fn norm_in_place(&self, n: &Self::Norm, x: &mut Self::Rows) -> Result<()>;
    /// `x += y`.
    fn add(&self, x: &mut Self::Rows, y: &Self::Rows) -> Result<()>;
    /// Every projection of the `rows` rows of `x`, in order, each `[rows, width]`.
    fn project(&self, l: &Self::Linear, x: &Self::Rows, rows: usize) -> Result<Vec<Self::Rows>>;
    /// The one projection of a single-projection `l`.
    fn project_one(&self, l: &Self::Linear, x: &Self::Rows, rows: usize) -> Result<Self::Rows> {
        Ok(self.project(l, x, rows)?.swap_remove(0))
    }
    /// `silu(x · gateᵀ) · (x · upᵀ)` of the `rows` rows of `x` into `out`.
    fn gate_up_forward(
        &self,
        g: &Self::GateUp,
        x: &Self::Rows,
        rows: usize,
        out: &mut Self::Rows,
    ) -> Result<()>;
    /// Rotary embedding of `x` (`[tokens, heads, head_dim]`) at the step's positions.
    fn rotary(&self, step: &Self::Step<'_>, x: &mut Self::Rows, heads: usize) -> Result<()>;
    /// Writes the new tokens' K and V rows (`[tokens, kv_heads, head_dim]`) into layer
    /// `layer`'s cache at their positions.
    fn kv_write(
        &self,
        kv: &mut Self::Kv,
        layer: usize,
        step: &Self::Step<'_>,
        k: &Self::Rows,
        v: &Self::Rows,
    ) -> Result<()>;
    /// Causal paged attention of `q` (`[tokens, heads, head_dim]`) over layer `layer`'s
    /// cache, which already holds the new tokens' K/V.
    fn attention(
        &self,
        kv: &Self::Kv,
        layer: usize,
        step: &Self::Step<'_>,
        q: &Self::Rows,
        heads: usize,
        scale: f32,
    ) -> Result<Self::Rows>;
    /// Attention's input of the `rows` rows of `x`: q, k and v through `spec.qkv`, q and k
    /// normalised per head (where the model has those norms) and rotated at the step's
    /// positions, k and v written into layer `spec.layer`'s cache. Returns q, `[rows, heads,
    /// head_dim]`. The ops one by one unless a device does it in fewer launches.
    fn attention_inputs(
        &self,
        spec: &QkvSpec<'_, Self>,
        x: &Self::Rows,
        rows: usize,
        step: &Self::Step<'_>,
        kv: &mut Self::Kv,
    ) -> Result<Self::Rows> {
        attention_inputs_op_by_op(self, spec, x, rows, step, kv)
    }

    /// Rows `rows` of `x` (`width` wide), in that order: the step's logit rows
    /// ([`logit_rows`](super::batch::logit_rows) of its batch).
    fn select_rows(
        &self,
        x: &Self::Rows,
        step: &Self::Step<'_>,
        rows: &[usize],
        width: usize,
    ) -> Result<Self::Rows>;
    /// The values of `x` in host memory, row-major.
    fn to_host(&self, x: Self::Rows) -> Result<Vec<f32>>;

    /// Says that `l` is the next matmul to run.
    fn prefetch(&self, _l: &Self::Linear) {}
    /// Says that `g` is the next matmul to run.
    fn prefetch_gate_up(&self, _g: &Self::GateUp) {}
    /// Says that layer `layer`'s K/V rows for the step are written next.
    fn prefetch_kv(&self, _kv: &Self::Kv, _layer: usize, _step: &Self::Step<'_>) {}
}

/// [`Backend::attention_inputs`] one op at a time: the projections, the norms, the rotaries,
/// the K/V write.
pub fn attention_inputs_op_by_op<B: Backend>(
    b: &B,
    spec: &QkvSpec<'_, B>,
    x: &B::Rows,
    rows: usize,
    step: &B::Step<'_>,
    kv: &mut B::Kv,
) -> Result<B::Rows> {
    let qkv = timed(Part::Qkv, || b.project(spec.qkv, x, rows))?;
    let [mut q, mut k, v]: [B::Rows; 3] = qkv
        .try_into()
        .map_err(|_| ModelError::InvalidBatch("q/k/v must be three projections".into()))?;
    timed(Part::RotaryKvWrite, || {
        if let Some(norm) = spec.q_norm {
            b.norm_in_place(norm, &mut q)?;
        }
        if let Some(norm) = spec.k_norm {
            b.norm_in_place(norm, &mut k)?;
        }
        b.rotary(step, &mut q, spec.heads)?;
        b.rotary(step, &mut k, spec.kv_heads)?;
        b.kv_write(kv, spec.layer, step, &k, &v)
    })?;
    Ok(q)
}
