//! Matrices on the device, as stored, and their products with activations: a matrix-vector
//! kernel per format for decode batches, a tensor-core GEMM (cuBLASLt, `f16` in, `f32` out and
//! accumulation) over a dequantized copy for prefills.

use candle_core::quantized::GgmlDType;
use candle_core::DType;
use std::ffi::c_void;

use cudarc::cublaslt::{result as lt, sys as lt_sys, MatmulShared};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::f16;

use super::{device_err, elementwise, int_count, launch, Cuda, DeviceRows};
use crate::model::error::{ModelError, Result};
use crate::model::weights::Weight;

/// Most rows the matrix-vector kernels take in one call (`MAX_MATVEC_BATCH` of `quant.cu`);
/// larger batches go through the GEMM.
pub const MAX_MATVEC_BATCH: usize = 8;

/// Most rows multiplied by the kernels that read the stored weights (matrix-vector, tensor
/// cores); more go through the GEMM.
pub(super) const DIRECT_ROWS: usize = 64;

/// Output rows and columns per tile of `matmul_tc_*` (`TC_BM`, `TC_BK` of `quant.cu`).
const TC_ROWS: usize = 32;
const TC_COLS: usize = 256;

/// How a matrix is stored, named as its kernels' suffix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q8_0,
    Q4K,
    Q6K,
}

impl Format {
    pub fn of_ggml(dtype: GgmlDType) -> Option<Self> {
        Some(match dtype {
            GgmlDType::F32 => Self::F32,
            GgmlDType::F16 => Self::F16,
            GgmlDType::BF16 => Self::Bf16,
            GgmlDType::Q4_0 => Self::Q4_0,
            GgmlDType::Q4_1 => Self::Q4_1,
            GgmlDType::Q5_0 => Self::Q5_0,
            GgmlDType::Q8_0 => Self::Q8_0,
            GgmlDType::Q4K => Self::Q4K,
            GgmlDType::Q6K => Self::Q6K,
            _ => return None,
        })
    }

    /// The suffix of this format's kernels.
    pub fn suffix(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
            Self::Q4_0 => "q4_0",
            Self::Q4_1 => "q4_1",
            Self::Q5_0 => "q5_0",
            Self::Q8_0 => "q8_0",
            Self::Q4K => "q4_k",
            Self::Q6K => "q6_k",
        }
    }
}

/// The stored bytes, typed where the GEMM reads them in place.
enum Storage {
    Bytes(CudaSlice<u8>),
    F16(CudaSlice<f16>),
    F32(CudaSlice<f32>),
}

/// A `[rows, cols]` matrix in device memory, in its checkpoint's format.
pub struct DeviceMatrix {
    storage: Storage,
    pub format: Format,
    pub rows: usize,
    pub cols: usize,
}

impl Cuda {
    /// `w` uploaded as it is stored.
    pub(super) fn matrix(&self, w: &Weight) -> Result<DeviceMatrix> {
        let unsupported = |what: String| {
            ModelError::Device(format!(
                "the CUDA backend has no kernels for {what} matrices"
            ))
        };
        let (storage, format, (rows, cols)) = match w {
            Weight::Quantized(q) => {
                let format = Format::of_ggml(q.dtype())
                    .ok_or_else(|| unsupported(format!("{:?}", q.dtype())))?;
                let bytes = q.data()?;
                let storage = match format {
                    Format::F16 => {
                        let h: &[f16] = bytemuck_cast(&bytes);
                        Storage::F16(self.upload(h)?)
                    }
                    _ => Storage::Bytes(self.upload(&bytes)?),
                };
                (storage, format, q.shape().dims2()?)
            }
            Weight::Dense(t) => {
                let dims = t.dims2()?;
                match t.dtype() {
                    DType::F16 => (
                        Storage::F16(self.upload(&t.flatten_all()?.to_vec1::<f16>()?)?),
                        Format::F16,
                        dims,
                    ),
                    DType::BF16 => {
                        let v = t.flatten_all()?.to_vec1::<half::bf16>()?;
                        let bits: Vec<u8> =
                            v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect();
                        (Storage::Bytes(self.upload(&bits)?), Format::Bf16, dims)
                    }
                    _ => (
                        Storage::F32(
                            self.upload(&t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)?,
                        ),
                        Format::F32,
                        dims,
                    ),
                }
            }
        };
        Ok(DeviceMatrix {
            storage,
            format,
            rows,
            cols,
        })
    }
}

/// `bytes` as `f16` values (GGUF stores them little-endian and 2-byte aligned).
fn bytemuck_cast(bytes: &[u8]) -> &[f16] {
    assert_eq!(bytes.len() % 2, 0, "f16 data holds whole values");
    // SAFETY: f16 is a plain 2-byte value valid for every bit pattern; the length is checked
    // above and `align_to` gives no middle part unless it is aligned.
    let (head, mid, tail) = unsafe { bytes.align_to::<f16>() };
    assert!(
        head.is_empty() && tail.is_empty(),
        "f16 data is 2-byte aligned"
    );
    mid
}

impl DeviceMatrix {
    fn ptr(&self, cuda: &Cuda) -> u64 {
        use cudarc::driver::DevicePtr;
        match &self.storage {
            Storage::Bytes(b) => b.device_ptr(&cuda.stream).0,
            Storage::F16(b) => b.device_ptr(&cuda.stream).0,
            Storage::F32(b) => b.device_ptr(&cuda.stream).0,
        }
    }

    /// Work items of `dequant_rows_*` / `dequant_f16_*` over `rows` rows: one per 16 values,
    /// or one per value for a dense format whose rows are not whole 16-value units.
    fn dequant_work(&self, rows: usize) -> usize {
        let dense = matches!(self.format, Format::F32 | Format::F16 | Format::Bf16);
        match dense && !self.cols.is_multiple_of(16) {
            true => rows * self.cols,
            false => rows * self.cols / 16,
        }
    }

    /// Rows `ids` (`n` ids at device address `ids`) as `f32` into `out` (`[n, cols]`).
    pub(super) fn rows_into(
        &self,
        cuda: &Cuda,
        ids: u64,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let w = self.ptr(cuda);
        let (n_i, cols) = (n as i32, self.cols as i32);
        let name = format!("dequant_rows_{}", self.format.suffix());
        launch!(
            cuda,
            &name,
            elementwise(self.dequant_work(n)),
            &w,
            &ids,
            &n_i,
            &cols,
            out
        )
    }

    /// `x Wᵀ` for the `rows` rows of `x`: `[rows, self.rows]`.
    pub(super) fn multiply(&self, cuda: &Cuda, x: &DeviceRows, rows: usize) -> Result<DeviceRows> {
        let mut y = cuda.alloc(rows, self.rows)?;
        if rows == 0 {
            return Ok(y);
        }
        // One row: the matrix-vector kernel, which reads each weight once and x from cache.
        // More rows up to `DIRECT_ROWS`: the tensor-core kernel, which decodes each weight once
        // per 32 rows (the matrix-vector kernel would be bound by reading x). More rows: the
        // GEMM over an f16 copy, whose cost the rows share. Float weights go to the GEMM as
        // they are stored, with no copy to make. Dense rows that are not whole 16-value units
        // take the matrix-vector kernel's scalar path in chunks.
        let float = matches!(self.storage, Storage::F16(_) | Storage::F32(_));
        let units = self.cols.is_multiple_of(16);
        if rows > DIRECT_ROWS || float && rows > MAX_MATVEC_BATCH && !units {
            self.gemm(cuda, x, rows, &mut y)?;
            return Ok(y);
        }
        if rows > 1 && units {
            self.tensor_cores(cuda, x, rows, &mut y)?;
            return Ok(y);
        }
        let w = self.ptr(cuda);
        let (r, c) = (self.rows as i32, self.cols as i32);
        let cfg = LaunchConfig {
            grid_dim: (self.rows.div_ceil(4) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let name = format!("matvec_{}", self.format.suffix());
        for first in (0..rows).step_by(MAX_MATVEC_BATCH) {
            let batch = (rows - first).min(MAX_MATVEC_BATCH);
            // Chunk offsets are multiples of 8 rows of `f32`: 16-byte aligned, as the kernel
            // needs.
            let xs = x.buf.slice(first * self.cols..(first + batch) * self.cols);
            let mut ys = y
                .buf
                .slice_mut(first * self.rows..(first + batch) * self.rows);
            let b_i = batch as i32;
            launch!(cuda, &name, cfg, &w, &xs, &mut ys, &r, &c, &b_i)?;
        }
        Ok(y)
    }

    /// `matmul_tc_*`: `x` as `f16`, the weights decoded tile by tile, `f32` accumulation. A
    /// grid with too few tiles to fill the device splits the columns into slices, summed after.
    fn tensor_cores(
        &self,
        cuda: &Cuda,
        x: &DeviceRows,
        rows: usize,
        y: &mut DeviceRows,
    ) -> Result<()> {
        let xh = cuda.to_f16(&x.buf, rows * self.cols)?;
        let bn = match rows {
            0..=8 => 8,
            9..=16 => 16,
            _ => 32,
        };
        let tiles = (self.rows.div_ceil(TC_ROWS), rows.div_ceil(bn));
        let col_tiles = self.cols.div_ceil(TC_COLS);
        // Four CTAs per multiprocessor keep enough loads in flight; a slice takes at least
        // two column tiles.
        let wanted = (4 * cuda.multiprocessors)
            .div_ceil(tiles.0 * tiles.1)
            .clamp(1, col_tiles.div_ceil(2).max(1));
        let per_slice = col_tiles.div_ceil(wanted);
        let slices = col_tiles.div_ceil(per_slice);
        let cfg = LaunchConfig {
            grid_dim: (tiles.0 as u32, tiles.1 as u32, slices as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let w = self.ptr(cuda);
        let name = format!("matmul_tc_{}", self.format.suffix());
        let (r, c, b) = (self.rows as i32, self.cols as i32, rows as i32);
        let (bn, per) = (bn as i32, per_slice as i32);
        if slices == 1 {
            return launch!(cuda, &name, cfg, &w, &xh, &mut y.buf, &r, &c, &b, &bn, &per);
        }
        let n = rows * self.rows;
        let mut parts = cuda.uninit::<f32>(slices * n)?;
        launch!(cuda, &name, cfg, &w, &xh, &mut parts, &r, &c, &b, &bn, &per)?;
        let (s, n_i) = (slices as i32, int_count(n)?);
        launch!(
            cuda,
            "sum_slices",
            elementwise(n),
            &parts,
            &mut y.buf,
            &s,
            &n_i
        )
    }

    /// The tensor-core path: `f16` operands, `f32` accumulation.
    fn gemm(&self, cuda: &Cuda, x: &DeviceRows, rows: usize, y: &mut DeviceRows) -> Result<()> {
        let (n, k) = (self.rows, self.cols);
        if let Storage::F32(w) = &self.storage {
            return cuda.gemm(Operands::F32, w, &x.buf, &mut y.buf, n, rows, k);
        }
        let xh = cuda.to_f16(&x.buf, rows * k)?;
        let scratch;
        let w: &CudaSlice<f16> = match &self.storage {
            Storage::F16(w) => w,
            _ => {
                scratch = self.dequantize_f16(cuda)?;
                &scratch
            }
        };
        cuda.gemm(Operands::F16, w, &xh, &mut y.buf, n, rows, k)
    }

    /// The whole matrix as `f16`, row-major.
    fn dequantize_f16(&self, cuda: &Cuda) -> Result<CudaSlice<f16>> {
        let mut out = cuda.uninit::<f16>(self.rows * self.cols)?;
        let w = self.ptr(cuda);
        let (r, c) = (self.rows as i32, self.cols as i32);
        let name = format!("dequant_f16_{}", self.format.suffix());
        launch!(
            cuda,
            &name,
            elementwise(self.dequant_work(self.rows)),
            &w,
            &mut out,
            &r,
            &c
        )?;
        Ok(out)
    }
}

impl Cuda {
    /// `n` values of `x` as `f16`.
    fn to_f16(&self, x: &CudaSlice<f32>, n: usize) -> Result<CudaSlice<f16>> {
        let mut out = self.uninit::<f16>(n)?;
        let count = int_count(n)?;
        launch!(self, "f32_to_f16", elementwise(n), x, &mut out, &count)?;
        Ok(out)
    }
}

/// The type of a GEMM's operands; its output and accumulation are `f32` either way.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Operands {
    /// Tensor cores at their `f16` rate.
    F16,
    /// `f32` operands (TF32 tensor cores where cuBLASLt picks them).
    F32,
}

/// A GEMM's operands and sizes `(n, t, k)`, what cuBLASLt's choice of algorithm depends on.
pub(super) type GemmShape = (Operands, usize, usize, usize);

/// A cuBLASLt descriptor, destroyed when dropped.
struct Lt<T: Copy>(T, unsafe fn(T) -> std::result::Result<(), lt::CublasError>);

impl<T: Copy> Drop for Lt<T> {
    fn drop(&mut self) {
        // SAFETY: created by cuBLASLt below and destroyed once, here.
        if let Err(e) = unsafe { (self.1)(self.0) } {
            tracing::warn!("cuBLASLt descriptor: {e:?}");
        }
    }
}

impl Cuda {
    /// `y[t, n] = x[t, k] · w[n, k]ᵀ` (all row-major) with `f32` output and accumulation.
    /// cuBLASLt is column-major: `y` is its `[n, t]` matrix (ld `n`), `w` its `[k, n]` taken
    /// transposed (ld `k`), `x` its `[k, t]` (ld `k`).
    #[allow(clippy::too_many_arguments)]
    fn gemm<T>(
        &self,
        operands: Operands,
        w: &CudaSlice<T>,
        x: &CudaSlice<T>,
        y: &mut CudaSlice<f32>,
        n: usize,
        t: usize,
        k: usize,
    ) -> Result<()> {
        use lt_sys::cublasComputeType_t::{CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32};
        use lt_sys::cudaDataType_t::{CUDA_R_16F, CUDA_R_32F};
        let (input, compute) = match operands {
            Operands::F16 => (CUDA_R_16F, CUBLAS_COMPUTE_32F),
            Operands::F32 => (CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32),
        };
        let err = |e: lt::CublasError| device_err(e);
        let layout = |ty, rows: usize, cols: usize, ld: usize| {
            lt::create_matrix_layout(ty, rows as u64, cols as u64, ld as i64)
                .map(|l| Lt(l, lt::destroy_matrix_layout))
                .map_err(err)
        };
        let a = layout(input, k, n, k)?;
        let b = layout(input, k, t, k)?;
        let c = layout(CUDA_R_32F, n, t, n)?;
        let desc = lt::create_matmul_desc(compute, CUDA_R_32F)
            .map(|d| Lt(d, lt::destroy_matmul_desc))
            .map_err(err)?;
        let transpose: i32 = 1;
        // SAFETY: the attribute is a 4-byte operation code, as cuBLASLt reads it.
        unsafe {
            lt::set_matmul_desc_attribute(
                desc.0,
                lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&transpose) as *const i32 as *const c_void,
                std::mem::size_of::<i32>(),
            )
        }
        .map_err(err)?;
        let pref = lt::create_matmul_pref()
            .map(|p| Lt(p, lt::destroy_matmul_pref))
            .map_err(err)?;
        let workspace = self.workspace.len();
        // SAFETY: the attribute is the workspace size in bytes, a u64.
        unsafe {
            lt::set_matmul_pref_attribute(
                pref.0,
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&(workspace as u64)) as *const u64 as *const c_void,
                std::mem::size_of::<u64>(),
            )
        }
        .map_err(err)?;
        let handle = *self.blas.handle();
        // SAFETY: every descriptor above is live; the buffers hold the sizes the layouts
        // describe (`w` n·k, `x` t·k, `y` t·n values) and stay alive until the stream reaches
        // the product (their guards are held across the call).
        unsafe {
            // cuBLASLt's heuristic costs more than a small product: asked once per shape.
            let shape = (operands, n, t, k);
            let cached = self
                .algos
                .lock()
                .expect("no panic holds the lock")
                .get(&shape)
                .copied();
            let algo = match cached {
                Some(algo) => algo,
                None => {
                    let found =
                        lt::get_matmul_algo_heuristic(handle, desc.0, a.0, b.0, c.0, c.0, pref.0)
                            .map_err(err)?
                            .algo;
                    self.algos
                        .lock()
                        .expect("no panic holds the lock")
                        .insert(shape, found);
                    found
                }
            };
            let (alpha, beta) = (1f32, 0f32);
            let (w_ptr, _w) = w.device_ptr(&self.stream);
            let (x_ptr, _x) = x.device_ptr(&self.stream);
            let (y_ptr, _y) = y.device_ptr_mut(&self.stream);
            let (ws_ptr, _ws) = self.workspace.device_ptr(&self.stream);
            let name = match operands {
                Operands::F16 => "cublaslt_gemm_f16",
                Operands::F32 => "cublaslt_gemm_f32",
            };
            self.timed(name, || {
                lt::matmul(
                    handle,
                    desc.0,
                    (&alpha) as *const f32 as *const c_void,
                    (&beta) as *const f32 as *const c_void,
                    w_ptr as *const c_void,
                    a.0,
                    x_ptr as *const c_void,
                    b.0,
                    y_ptr as *const c_void,
                    c.0,
                    y_ptr as *mut c_void,
                    c.0,
                    &algo,
                    ws_ptr as *mut c_void,
                    workspace,
                    self.stream.cu_stream() as *mut _,
                )
                .map_err(err)
            })
        }
    }
}
