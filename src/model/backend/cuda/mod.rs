//! The CUDA backend: weights kept as stored (GGML blocks, f16, bf16, f32) in device memory,
//! activations `f32` on the device, the paged KV cache in `f16` on the device, and every op a
//! kernel of `kernels::cuda` launched on the model's own stream. One row multiplies with a
//! matrix-vector kernel, decode batches with a tensor-core kernel over the stored weights,
//! prefills with cuBLASLt's GEMM over an `f16` copy (see `linear`); `device` opens the GPU.
//! Only the rows sampling reads come back to the host.
//!
//! Libraries are loaded when a device is opened, not at link time: a build with this feature
//! starts on machines without a GPU, and [`Cuda::open`] says in one line what is missing.

mod attention;
mod device;
mod graphs;
mod linear;
mod step;

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use candle_core::Tensor;
use cudarc::cublaslt::CudaBlasLT;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};

use super::Backend;
use crate::model::backend::{Pass, QkvSpec};
use crate::model::config::RopeStyle;
use crate::model::error::{ModelError, Result};
use crate::model::kv_cache::{DeviceKv, KvCache, KvStore};
use crate::model::weights::Weight;
pub use linear::{DeviceMatrix, Format, MAX_MATVEC_BATCH};
pub use step::Step;

/// One GPU, the stream a model computes on, and the kernels compiled for it.
pub struct Cuda {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    functions: HashMap<String, CudaFunction>,
    blas: CudaBlasLT,
    /// cuBLASLt's scratch (32 MiB, what it asks for on Hopper).
    workspace: CudaSlice<u8>,
    /// Events around each launch while the breakdown is on: (kernel, start, end).
    launches: Mutex<Vec<(String, CudaEvent, CudaEvent)>>,
    /// cuBLASLt's chosen algorithm per GEMM shape (operands, n, t, k).
    algos: Mutex<HashMap<linear::GemmShape, cudarc::cublaslt::sys::cublasLtMatmulAlgo_t>>,
    arch: u32,
    /// Streaming multiprocessors: how many CTAs fill the device.
    multiprocessors: usize,
    /// Decode steps recorded as CUDA graphs, by batch size.
    recordings: Mutex<graphs::Recordings>,
    /// Every pass runs launch by launch (no recordings).
    eager: AtomicBool,
    /// Decode steps run from a recording so far.
    replays: std::sync::atomic::AtomicU64,
}

/// `f32` activations on the device: `rows` rows of `width`.
pub struct DeviceRows {
    buf: CudaSlice<f32>,
    rows: usize,
    width: usize,
}

/// Projections of one input: each matmul, its bias, and the widths of the projections it
/// holds (consecutive projections of one format are stacked into one matrix at load).
pub struct DeviceLinear {
    groups: Vec<(DeviceMatrix, Option<CudaSlice<f32>>, Vec<usize>)>,
}

/// Gate and up, stacked when they share a format, and the width of each.
pub struct DeviceGateUp {
    linear: DeviceLinear,
    width: usize,
}

pub struct DeviceNorm {
    weight: CudaSlice<f32>,
    len: usize,
    eps: f32,
}

/// A driver or launch failure, as a model error.
fn device_err(e: impl std::fmt::Debug) -> ModelError {
    ModelError::Device(format!("{e:?}"))
}

/// Threads of an element-wise launch, and its grid over `n` elements.
fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 65535) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One CTA per row. `rows` must be > 0: callers return before launching over no rows (a CTA
/// over a row that is not there would read past the buffer).
fn per_row(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launches kernel `$name` of `$cuda` with grid and block `$cfg` and the arguments in order.
macro_rules! launch {
    ($cuda:expr, $name:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        let cuda: &Cuda = $cuda;
        let name: &str = $name;
        cuda.timed(name, || {
            let mut b = cuda.stream.launch_builder(cuda.f(name));
            $( b.arg($arg); )+
            // SAFETY: every kernel's arguments are pushed in the order and types its source
            // declares (see `kernels::cuda`), over buffers sized for the launch.
            unsafe { b.launch($cfg) }.map(|_| ()).map_err(device_err)
        })
    }};
}
pub(crate) use launch;

/// A null device pointer, for a kernel's optional argument.
const NULL: u64 = 0;

/// Largest `head_dim` `paged_attention_f16` takes (`PA_MAX_HEAD_DIM`; a CTA over a larger one
/// writes nothing).
const MAX_HEAD_DIM: usize = 256;

/// `n` as a kernel's `int` element count.
fn int_count(n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| {
        ModelError::Device(format!(
            "{n} elements: more than a kernel's int count takes (2^31 - 1)"
        ))
    })
}

impl Cuda {
    fn add_bias(&self, y: &mut DeviceRows, bias: &CudaSlice<f32>) -> Result<()> {
        let (rows, cols) = (y.rows as i32, y.width as i32);
        launch!(
            self,
            "add_bias",
            elementwise(y.rows * y.width),
            &mut y.buf,
            bias,
            &rows,
            &cols
        )
    }

    fn copy_columns(&self, src: &DeviceRows, offset: usize, width: usize) -> Result<DeviceRows> {
        let mut dst = self.alloc(src.rows, width)?;
        let (rows, stride, off, w) = (
            src.rows as i32,
            src.width as i32,
            offset as i32,
            width as i32,
        );
        launch!(
            self,
            "copy_columns",
            elementwise(src.rows * width),
            &src.buf,
            &mut dst.buf,
            &rows,
            &stride,
            &off,
            &w
        )?;
        Ok(dst)
    }

    fn rms_norm_rows(&self, n: &DeviceNorm, x: &mut DeviceRows) -> Result<()> {
        let rows = x.rows * x.width / n.len;
        if rows == 0 {
            return Ok(());
        }
        let cols = n.len as i32;
        let threads = if n.len <= 256 { 64 } else { 256 };
        // In place: `out` is `x`.
        let ptr = {
            let (p, _sync) = cudarc::driver::DevicePtr::device_ptr(&x.buf, &self.stream);
            p
        };
        launch!(
            self,
            "rms_norm",
            per_row(rows, threads),
            &ptr,
            &n.weight,
            &ptr,
            &cols,
            &n.eps
        )
    }
}

impl Backend for Cuda {
    type Rows = DeviceRows;
    type Linear = DeviceLinear;
    type GateUp = DeviceGateUp;
    type Norm = DeviceNorm;
    type Embedding = DeviceMatrix;
    type Kv = DeviceKv;
    type Step<'a> = Step<'a>;

    fn describe(&self) -> String {
        let name = self.ctx.name().unwrap_or_else(|_| "GPU".into());
        format!("cuda:{} ({name}, sm_{})", self.ctx.ordinal(), self.arch)
    }

    fn linear(
        &self,
        weights: &[Weight],
        biases: &[Tensor],
        widths: &[usize],
    ) -> Result<DeviceLinear> {
        let mut groups = Vec::new();
        let mut start = 0;
        while start < weights.len() {
            let end = start
                + 1
                + weights[start + 1..]
                    .iter()
                    .take_while(|w| w.stacks_with(&weights[start]))
                    .count();
            let weight = match end - start {
                1 => weights[start].clone(),
                _ => Weight::stack(&weights[start..end])?
                    .expect("weights of one format and row width stack"),
            };
            let bias = match biases.is_empty() {
                true => None,
                false => Some(self.vector(&Tensor::cat(&biases[start..end], 0)?)?),
            };
            groups.push((self.matrix(&weight)?, bias, widths[start..end].to_vec()));
            start = end;
        }
        Ok(DeviceLinear { groups })
    }

    fn gate_up(&self, gate: Weight, up: Weight, rows: usize, _cols: usize) -> Result<DeviceGateUp> {
        Ok(DeviceGateUp {
            linear: self.linear(&[gate, up], &[], &[rows, rows])?,
            width: rows,
        })
    }

    fn norm(&self, weight: &Tensor, eps: f64) -> Result<DeviceNorm> {
        Ok(DeviceNorm {
            weight: self.vector(weight)?,
            len: weight.elem_count(),
            eps: eps as f32,
        })
    }

    fn embedding(&self, table: Weight, _tied_head: Option<&DeviceLinear>) -> Result<DeviceMatrix> {
        self.matrix(&table)
    }

    fn embeds_from_head(&self, _embedding: &DeviceMatrix) -> bool {
        false
    }

    fn kv<'c>(&self, cache: &'c mut KvCache) -> Result<&'c mut DeviceKv> {
        match cache.store_mut() {
            KvStore::Cuda(kv) => Ok(kv),
            KvStore::Host(_) => Err(ModelError::InvalidBatch(
                "the KV cache is in host memory but the model is on a GPU".into(),
            )),
        }
    }

    fn begin_step<'a>(&self, pass: &Pass<'_, 'a>) -> Result<Step<'a>> {
        let (words, layout) = step::pack(pass);
        let buf = self.upload(&words)?;
        let neox = pass.config.rope_style == RopeStyle::Neox;
        Ok(Step::at(self.ptr(&buf), &layout, Some(buf), neox, false))
    }

    fn run_pass<'a, F>(
        &self,
        pass: &Pass<'_, 'a>,
        kv: &mut DeviceKv,
        launch: F,
    ) -> Result<Vec<Vec<f32>>>
    where
        F: FnMut(&Step<'a>, &mut DeviceKv) -> Result<Vec<DeviceRows>>,
    {
        self.run_recorded(pass, kv, launch)
    }

    fn embed(
        &self,
        e: &DeviceMatrix,
        _head: &DeviceLinear,
        ids: &[u32],
        step: Option<&Step<'_>>,
    ) -> Result<DeviceRows> {
        let mut out = self.alloc(ids.len(), e.cols)?;
        let (_owned, ids_at) = match step {
            // The step's upload holds the same ids.
            Some(step) => (None, step.ids),
            None => {
                let buf = self.upload(ids)?;
                let at = self.ptr(&buf);
                (Some(buf), at)
            }
        };
        e.rows_into(self, ids_at, ids.len(), &mut out.buf)?;
        Ok(out)
    }

    fn zeros(&self, rows: usize, width: usize) -> Result<DeviceRows> {
        let buf = self
            .stream
            .alloc_zeros::<f32>((rows * width).max(1))
            .map_err(device_err)?;
        Ok(DeviceRows { buf, rows, width })
    }

    fn add_norm(
        &self,
        n: &DeviceNorm,
        x: &mut DeviceRows,
        add: Option<&DeviceRows>,
        out: &mut DeviceRows,
    ) -> Result<()> {
        if x.rows == 0 {
            return Ok(());
        }
        let cols = n.len as i32;
        let add = add.map_or(NULL, |a| self.ptr(&a.buf));
        launch!(
            self,
            "add_rms_norm",
            per_row(x.rows, 256),
            &mut x.buf,
            &add,
            &n.weight,
            &mut out.buf,
            &cols,
            &n.eps
        )
    }

    fn norm_in_place(&self, n: &DeviceNorm, x: &mut DeviceRows) -> Result<()> {
        self.rms_norm_rows(n, x)
    }

    fn add(&self, x: &mut DeviceRows, y: &DeviceRows) -> Result<()> {
        let n = (x.rows * x.width) as i64;
        launch!(
            self,
            "add_in_place",
            elementwise(n as usize),
            &mut x.buf,
            &y.buf,
            &n
        )
    }

    fn project(&self, l: &DeviceLinear, x: &DeviceRows, rows: usize) -> Result<Vec<DeviceRows>> {
        let mut parts = Vec::new();
        for (m, bias, widths) in &l.groups {
            let mut y = m.multiply(self, x, rows)?;
            if let Some(bias) = bias {
                self.add_bias(&mut y, bias)?;
            }
            if widths.len() == 1 {
                parts.push(y);
                continue;
            }
            let mut offset = 0;
            for &w in widths {
                parts.push(self.copy_columns(&y, offset, w)?);
                offset += w;
            }
        }
        Ok(parts)
    }

    fn gate_up_forward(
        &self,
        g: &DeviceGateUp,
        x: &DeviceRows,
        rows: usize,
        out: &mut DeviceRows,
    ) -> Result<()> {
        let w = g.width;
        let (rows_i, w_i) = (rows as i32, w as i32);
        match g.linear.groups.as_slice() {
            // Stacked: one `[rows, 2w]` product, gate then up.
            [(m, _, _)] => {
                let y = m.multiply(self, x, rows)?;
                let (gp, _s1) = cudarc::driver::DevicePtr::device_ptr(&y.buf, &self.stream);
                let up = gp + (w * 4) as u64;
                let stride = (2 * w) as i32;
                launch!(
                    self,
                    "silu_mul",
                    elementwise(rows * w),
                    &gp,
                    &up,
                    &mut out.buf,
                    &rows_i,
                    &w_i,
                    &stride,
                    &stride
                )
            }
            [(gm, _, _), (um, _, _)] => {
                let gate = gm.multiply(self, x, rows)?;
                let up = um.multiply(self, x, rows)?;
                launch!(
                    self,
                    "silu_mul",
                    elementwise(rows * w),
                    &gate.buf,
                    &up.buf,
                    &mut out.buf,
                    &rows_i,
                    &w_i,
                    &w_i,
                    &w_i
                )
            }
            _ => Err(ModelError::InvalidBatch(
                "gate/up must be one or two matmuls".into(),
            )),
        }
    }

    fn rotary(&self, step: &Step<'_>, x: &mut DeviceRows, heads: usize) -> Result<()> {
        let head_dim = x.width / heads;
        let (tokens, heads_i, hd, neox) = (
            step.tokens as i32,
            heads as i32,
            head_dim as i32,
            step.neox as i32,
        );
        launch!(
            self,
            "rotary",
            elementwise(step.tokens * heads * head_dim / 2),
            &mut x.buf,
            &step.positions,
            &step.inv_freq,
            &tokens,
            &heads_i,
            &hd,
            &neox
        )
    }

    fn kv_write(
        &self,
        kv: &mut DeviceKv,
        layer: usize,
        step: &Step<'_>,
        k: &DeviceRows,
        v: &DeviceRows,
    ) -> Result<()> {
        let (tokens, kvh, hd, bs) = (
            step.tokens as i32,
            kv.num_kv_heads as i32,
            kv.head_dim as i32,
            kv.block_size as i32,
        );
        let n = step.tokens * kv.num_kv_heads * kv.head_dim;
        let (kc, vc) = (&mut kv.k[layer], &mut kv.v[layer]);
        launch!(
            self,
            "kv_write_f16",
            elementwise(n),
            kc,
            vc,
            &k.buf,
            &v.buf,
            &step.token_block,
            &step.token_slot,
            &tokens,
            &kvh,
            &hd,
            &bs
        )
    }

    fn attention(
        &self,
        kv: &DeviceKv,
        layer: usize,
        step: &Step<'_>,
        q: &DeviceRows,
        heads: usize,
        scale: f32,
    ) -> Result<DeviceRows> {
        let mut out = self.alloc(q.rows, q.width)?;
        if step.tokens == 0 {
            return Ok(out);
        }
        let (tokens, heads_i, kvh, hd, bs) = (
            step.tokens as i32,
            heads as i32,
            kv.num_kv_heads as i32,
            kv.head_dim as i32,
            kv.block_size as i32,
        );
        if let Some((tile_first, tiles)) = &step.attention_tiles {
            self.attend_in_tiles(
                kv,
                layer,
                step,
                (*tile_first, *tiles),
                q,
                heads,
                scale,
                &mut out,
            )?;
            return Ok(out);
        }
        // Decode (few CTAs, long contexts) splits each position range over more warps.
        let threads = if step.tokens * heads < 512 { 256 } else { 128 };
        let cfg = LaunchConfig {
            grid_dim: ((step.tokens * heads) as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            self,
            "paged_attention_f16",
            cfg,
            &q.buf,
            &kv.k[layer],
            &kv.v[layer],
            &mut out.buf,
            &step.block_tables,
            &step.table_start,
            &step.positions,
            &step.token_seq,
            &tokens,
            &heads_i,
            &kvh,
            &hd,
            &bs,
            &scale
        )?;
        Ok(out)
    }

    fn attention_inputs(
        &self,
        spec: &QkvSpec<'_, Self>,
        x: &DeviceRows,
        rows: usize,
        step: &Step<'_>,
        kv: &mut DeviceKv,
    ) -> Result<DeviceRows> {
        match self.qkv_in_one_launch(spec, x, rows, step, kv)? {
            Some(q) => Ok(q),
            None => super::attention_inputs_op_by_op(self, spec, x, rows, step, kv),
        }
    }

    fn select_rows(
        &self,
        x: &DeviceRows,
        step: &Step<'_>,
        rows: &[usize],
        width: usize,
    ) -> Result<DeviceRows> {
        // `gather_rows` reads rows of `width` values one after another; the step's upload
        // holds `rows`.
        debug_assert_eq!(width, x.width);
        debug_assert_eq!(rows.len(), step.rows.1);
        let mut out = self.alloc(rows.len(), width)?;
        let (ids, n, w) = (step.rows.0, rows.len() as i32, width as i32);
        launch!(
            self,
            "gather_rows",
            elementwise(rows.len() * width),
            &x.buf,
            &ids,
            &mut out.buf,
            &n,
            &w
        )?;
        Ok(out)
    }

    fn to_host(&self, x: DeviceRows) -> Result<Vec<f32>> {
        let mut v = self.stream.clone_dtoh(&x.buf).map_err(device_err)?;
        v.truncate(x.rows * x.width);
        Ok(v)
    }
}
