//! Where decoder weights come from. Loaders (GGUF, safetensors) implement [`WeightSource`] with
//! tensor names in GGUF convention (`blk.0.attn_q.weight`); the decoder asks for each weight with
//! the shape it expects, so a checkpoint with a wrong shape fails at load, naming the tensor.
//! Each matrix then gets the kernel that multiplies it ([`Matmul`]): ours, repacked where a
//! format has an interleaved layout, or candle's. The layers built on them are in `layers`.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Module, Tensor};

use super::error::{ModelError, Result};
pub use crate::kernels::qmatmul::registry::OwnKernel;
use crate::kernels::qmatmul::registry::{self, Format};

pub trait WeightSource {
    /// A `[rows, cols]` (out, in) matrix, kept quantized when the checkpoint is.
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Weight>;
    /// A 1-D `f32` vector (norm weights, biases).
    fn vector(&mut self, name: &str, len: usize) -> Result<Tensor>;
    fn contains(&self, name: &str) -> bool;
    /// Which kernels quantized matrices use.
    fn backend(&self) -> MatmulBackend {
        MatmulBackend::Native
    }
}

/// Kernels for quantized matrices on the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum MatmulBackend {
    /// Ours (`kernels::qmatmul`) for Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K, candle's for the rest.
    #[default]
    Native,
    /// candle's for every type: the in-run baseline of `bench-model`.
    Candle,
}

impl MatmulBackend {
    /// The quantized kernels that run: `candle`, or our instruction set's name.
    pub fn kernels(self) -> &'static str {
        match self {
            Self::Candle => "candle",
            Self::Native => crate::kernels::qmatmul::Isa::best().name(),
        }
    }
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

    /// The matmul for this weight under `backend`.
    pub fn matmul(&self, backend: MatmulBackend) -> Result<Matmul> {
        Ok(match self {
            Self::Quantized(q) => match own_kernel(q, backend)? {
                Some(own) => own,
                None => Matmul::Candle(QMatMul::from_arc(q.clone())?),
            },
            Self::Dense(t) => Matmul::Candle(QMatMul::Tensor(t.clone())),
        })
    }

    /// Whether [`Weight::stack`] can put the two matrices' rows together: the same storage
    /// format (one quantized type on the CPU, or one dense dtype) and the same row width.
    pub fn stacks_with(&self, other: &Weight) -> bool {
        match (self, other) {
            (Self::Quantized(a), Self::Quantized(b)) => {
                a.device().is_cpu()
                    && b.device().is_cpu()
                    && a.dtype() == b.dtype()
                    && matches!((a.shape().dims2(), b.shape().dims2()), (Ok(x), Ok(y)) if x.1 == y.1)
            }
            (Self::Dense(a), Self::Dense(b)) => {
                a.dtype() == b.dtype()
                    && matches!((a.dims2(), b.dims2()), (Ok(x), Ok(y)) if x.1 == y.1)
            }
            _ => false,
        }
    }

    /// The matrix's first `rows` rows.
    pub fn first_rows(&self, rows: usize) -> Result<Weight> {
        Ok(match self {
            Self::Quantized(q) => {
                let (total, cols) = q.shape().dims2()?;
                let data = q.data()?;
                let per_row = data.len() / total.max(1);
                let bytes = data[..rows.min(total) * per_row].to_vec();
                let storage =
                    QStorage::from_data(std::borrow::Cow::Owned(bytes), &q.device(), q.dtype())?;
                Self::Quantized(Arc::new(QTensor::new(storage, (rows.min(total), cols))?))
            }
            Self::Dense(t) => Self::Dense(t.narrow(0, 0, rows.min(t.dims()[0]))?.contiguous()?),
        })
    }

    /// The matrices' rows one after another, as one matrix, where each [stacks
    /// with](Self::stacks_with) the first; `None` otherwise (or for no matrices).
    pub fn stack(parts: &[Weight]) -> Result<Option<Weight>> {
        let Some(first) = parts.first() else {
            return Ok(None);
        };
        if !parts.iter().all(|w| w.stacks_with(first)) {
            return Ok(None);
        }
        Ok(Some(match first {
            Self::Quantized(q) => {
                let mut bytes = Vec::new();
                let mut rows = 0;
                for w in parts {
                    if let Self::Quantized(part) = w {
                        bytes.extend_from_slice(&part.data()?);
                        rows += part.shape().dims2()?.0;
                    }
                }
                let cols = q.shape().dims2()?.1;
                let storage =
                    QStorage::from_data(std::borrow::Cow::Owned(bytes), &q.device(), q.dtype())?;
                Self::Quantized(Arc::new(QTensor::new(storage, (rows, cols))?))
            }
            Self::Dense(_) => {
                let dense: Vec<&Tensor> = parts
                    .iter()
                    .filter_map(|w| match w {
                        Self::Dense(t) => Some(t),
                        Self::Quantized(_) => None,
                    })
                    .collect();
                Self::Dense(Tensor::cat(&dense, 0)?)
            }
        }))
    }

    /// Rows `ids` of the matrix (embedding lookup), as `[ids, cols]` `f32`.
    pub fn rows(&self, ids: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Self::Quantized(q) => q.embedding(ids)?,
            Self::Dense(t) => t.embedding(ids)?,
        })
    }
}

/// A weight matrix ready to multiply.
pub enum Matmul {
    Candle(QMatMul),
    Own(Box<dyn OwnKernel>),
}

/// The format of a ggml type our kernels multiply, if they do.
fn format_of(dtype: GgmlDType) -> Option<Format> {
    Some(match dtype {
        GgmlDType::Q4_0 => Format::Q4_0,
        GgmlDType::Q4_1 => Format::Q4_1,
        GgmlDType::Q5_0 => Format::Q5_0,
        GgmlDType::Q8_0 => Format::Q8_0,
        GgmlDType::Q4K => Format::Q4K,
        GgmlDType::Q6K => Format::Q6K,
        _ => return None,
    })
}

/// Our kernel on a copy of `bytes` (a `[rows, cols]` matrix of `dtype`) repacked for it
/// ([`registry::packed`]). `None` for other types and shapes.
pub fn packed_kernel(
    dtype: GgmlDType,
    rows: usize,
    cols: usize,
    bytes: &[u8],
) -> Option<Box<dyn OwnKernel>> {
    registry::packed(format_of(dtype)?, rows, cols, bytes)
}

/// The gate and up matrices of a feed-forward layer as one kernel ([`registry::gated`]).
/// `None` for other types and shapes.
pub fn gated_kernel(
    dtype: GgmlDType,
    rows: usize,
    cols: usize,
    gate: &[u8],
    up: &[u8],
) -> Option<Box<dyn OwnKernel>> {
    registry::gated(format_of(dtype)?, rows, cols, gate, up)
}

/// A CPU tensor's quantized bytes, shared with candle rather than copied.
struct TensorBytes(Arc<QTensor>);

impl AsRef<[u8]> for TensorBytes {
    fn as_ref(&self) -> &[u8] {
        match self.0.data() {
            Ok(std::borrow::Cow::Borrowed(bytes)) => bytes,
            // Only host storage is borrowed; anything else has no bytes to read in place,
            // and `QuantMatrix::in_place` then refuses the tensor.
            _ => &[],
        }
    }
}

fn own_kernel(q: &Arc<QTensor>, backend: MatmulBackend) -> Result<Option<Matmul>> {
    if backend == MatmulBackend::Candle || !q.device().is_cpu() {
        return Ok(None);
    }
    let Ok((rows, cols)) = q.shape().dims2() else {
        return Ok(None);
    };
    let Some(format) = format_of(q.dtype()) else {
        return Ok(None);
    };
    // A repacked copy drops the ggml bytes with `q` (unless the tensor is also the embedding).
    Ok(registry::kernel(format, rows, cols, TensorBytes(q.clone())).map(Matmul::Own))
}

impl Matmul {
    /// Our kernel, when it is one (not candle's).
    pub fn own_kernel(&self) -> Option<&dyn OwnKernel> {
        match self {
            Self::Own(kernel) => Some(kernel.as_ref()),
            Self::Candle(_) => None,
        }
    }

    /// `x Wᵀ` for the `rows` rows of `x` (row-major), as a row-major `[rows, out]` vector:
    /// our kernels multiply the slice in place; candle's get it as a tensor on the weight's
    /// device.
    pub fn forward_rows(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        super::timing::timed(super::timing::Part::Matmul, || self.multiply(x, rows))
    }

    fn multiply(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        match self {
            Self::Own(kernel) => {
                assert_eq!(x.len(), rows * kernel.in_features(), "input rows");
                Ok(kernel.matmul_vec(x))
            }
            Self::Candle(m) => {
                let device = match m {
                    QMatMul::QTensor(q) => q.device(),
                    QMatMul::Tensor(t) | QMatMul::TensorF16(t) => t.device().clone(),
                };
                let cols = x.len() / rows.max(1);
                let x = Tensor::from_slice(x, (rows, cols), &device)?;
                Ok(m.forward(&x)?
                    .flatten_all()?
                    .to_dtype(DType::F32)?
                    .to_vec1()?)
            }
        }
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
