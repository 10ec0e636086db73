//! Where decoder weights come from. Loaders (GGUF, safetensors) implement [`WeightSource`] with
//! tensor names in GGUF convention (`blk.0.attn_q.weight`); the decoder asks for each weight with
//! the shape it expects, so a checkpoint with a wrong shape fails at load, naming the tensor.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Module, Tensor};

use super::error::{ModelError, Result};
use super::profile::{timed, Part};
use crate::kernels::qmatmul::{
    BlockQ4K, BlockQ4Kx8, BlockQ4_0, BlockQ4_0x8, BlockQ4_1, BlockQ4_1x8, BlockQ5_0, BlockQ5_0x8,
    BlockQ6K, BlockQ6Kx8, BlockQ8_0, BlockQ8_0x8, GatedPacked, PackedMatrix, QuantKernel,
    QuantMatrix, WeightBlock,
};
use crate::kernels::{add_rms_norm_rows, rms_norm_in_place, silu_mul_rows};

pub trait WeightSource {
    /// A `[rows, cols]` (out, in) matrix, kept quantized when the checkpoint is.
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Weight>;
    /// A 1-D `f32` vector (norm weights, biases).
    fn vector(&mut self, name: &str, len: usize) -> Result<Tensor>;
    fn contains(&self, name: &str) -> bool;
    /// Which kernels quantized matrices use.
    fn backend(&self) -> MatmulBackend {
        MatmulBackend::from_env()
    }
}

/// Kernels for quantized matrices on the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulBackend {
    /// Ours (`kernels::qmatmul`) for Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K, candle's for the rest.
    Native,
    /// candle's for every type: the in-run baseline of `bench-model`.
    Candle,
}

impl MatmulBackend {
    /// `Candle` when `TOKENROUTER_QMATMUL=candle`, or when candle's `CANDLE_DEQUANTIZE_ALL`
    /// asks for f32 matmuls everywhere (so a dequantized comparison dequantizes both sides).
    pub fn from_env() -> Self {
        let set = |key: &str| std::env::var(key).is_ok_and(|v| !v.is_empty() && v != "0");
        let forced = std::env::var("TOKENROUTER_QMATMUL").is_ok_and(|v| v == "candle");
        if forced || set("CANDLE_DEQUANTIZE_ALL") {
            Self::Candle
        } else {
            Self::Native
        }
    }

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

/// Our quantized kernel, whatever its block format.
pub trait OwnKernel: Send + Sync {
    fn out_features(&self) -> usize;
    fn in_features(&self) -> usize;
    fn matmul(&self, x: &[f32], out: &mut [f32]);
    /// The product in a new vector (`out_features` values per row of `x`).
    fn matmul_vec(&self, x: &[f32]) -> Vec<f32>;
    /// Row `row` dequantized into `out` (`in_features` values), where the layout supports it.
    fn dequantize_row(&self, row: usize, out: &mut [f32]) -> bool;
    /// Has idle compute threads request the weights ahead of the next product.
    fn prefetch_ahead(&self);
}

impl<K: QuantKernel> OwnKernel for K {
    fn out_features(&self) -> usize {
        self.rows()
    }
    fn in_features(&self) -> usize {
        self.cols()
    }
    fn matmul(&self, x: &[f32], out: &mut [f32]) {
        QuantKernel::matmul(self, x, out)
    }
    fn matmul_vec(&self, x: &[f32]) -> Vec<f32> {
        QuantKernel::matmul_vec(self, x)
    }
    fn dequantize_row(&self, row: usize, out: &mut [f32]) -> bool {
        QuantKernel::dequantize_row(self, row, out)
    }
    fn prefetch_ahead(&self) {
        QuantKernel::prefetch_ahead(self)
    }
}

/// `$kernel::<P>::from_bytes($args)` for the interleaved format `P` of ggml type `$dtype`,
/// boxed; `None` for a type without one, or where `from_bytes` refuses the shape.
macro_rules! interleaved {
    ($dtype:expr, $kernel:ident, ($($arg:expr),*)) => {{
        fn boxed<K: QuantKernel + 'static>(k: K) -> Box<dyn OwnKernel> {
            Box::new(k)
        }
        match $dtype {
            GgmlDType::Q4_0 => $kernel::<BlockQ4_0x8>::from_bytes($($arg),*).map(boxed),
            GgmlDType::Q4_1 => $kernel::<BlockQ4_1x8>::from_bytes($($arg),*).map(boxed),
            GgmlDType::Q5_0 => $kernel::<BlockQ5_0x8>::from_bytes($($arg),*).map(boxed),
            GgmlDType::Q8_0 => $kernel::<BlockQ8_0x8>::from_bytes($($arg),*).map(boxed),
            GgmlDType::Q4K => $kernel::<BlockQ4Kx8>::from_bytes($($arg),*).map(boxed),
            GgmlDType::Q6K => $kernel::<BlockQ6Kx8>::from_bytes($($arg),*).map(boxed),
            _ => None,
        }
    }};
}

/// Our kernel on a copy of `bytes` (a `[rows, cols]` matrix of `dtype`) repacked for it: every
/// format our kernels take, with whole groups of eight rows, interleaved (an exact repack; see
/// `kernels::qmatmul::x8`). `None` for other types and shapes.
pub fn packed_kernel(
    dtype: GgmlDType,
    rows: usize,
    cols: usize,
    bytes: &[u8],
) -> Option<Box<dyn OwnKernel>> {
    interleaved!(dtype, PackedMatrix, (rows, cols, bytes))
}

/// The gate and up matrices of a feed-forward layer (`[rows, cols]` each, of `dtype`) as one
/// kernel whose product is `silu(x · gateᵀ) · (x · upᵀ)` (see `GatedPacked`): every format
/// our interleaved kernels take, `rows` a multiple of 8. `None` for other types and shapes.
pub fn gated_kernel(
    dtype: GgmlDType,
    rows: usize,
    cols: usize,
    gate: &[u8],
    up: &[u8],
) -> Option<Box<dyn OwnKernel>> {
    interleaved!(dtype, GatedPacked, (rows, cols, gate, up))
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
    // A repacked copy where there is one (the ggml bytes are dropped with `q` unless the
    // tensor is also the embedding), else the ggml bytes read in place.
    if let Some(packed) = packed_kernel(q.dtype(), rows, cols, TensorBytes(q.clone()).as_ref()) {
        return Ok(Some(Matmul::Own(packed)));
    }
    fn boxed<B: WeightBlock>(
        q: &Arc<QTensor>,
        rows: usize,
        cols: usize,
    ) -> Option<Box<dyn OwnKernel>> {
        QuantMatrix::<B>::in_place(rows, cols, TensorBytes(q.clone()))
            .map(|m| Box::new(m) as Box<dyn OwnKernel>)
    }
    Ok(match q.dtype() {
        GgmlDType::Q4_0 => boxed::<BlockQ4_0>(q, rows, cols),
        GgmlDType::Q4_1 => boxed::<BlockQ4_1>(q, rows, cols),
        GgmlDType::Q5_0 => boxed::<BlockQ5_0>(q, rows, cols),
        GgmlDType::Q8_0 => boxed::<BlockQ8_0>(q, rows, cols),
        GgmlDType::Q4K => boxed::<BlockQ4K>(q, rows, cols),
        GgmlDType::Q6K => boxed::<BlockQ6K>(q, rows, cols),
        _ => None,
    }
    .map(Matmul::Own))
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
        super::profile::timed(super::profile::Part::Matmul, || self.multiply(x, rows))
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

/// `y = x Wᵀ (+ b)`.
pub struct Linear {
    weight: Matmul,
    bias: Option<Vec<f32>>,
}

impl Linear {
    pub fn load(
        src: &mut dyn WeightSource,
        name: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Self> {
        let backend = src.backend();
        let weight = src
            .matrix(&format!("{name}.weight"), out, inp)?
            .matmul(backend)?;
        let bias = if bias {
            Some(src.vector(&format!("{name}.bias"), out)?)
        } else {
            None
        };
        Self::new(weight, bias)
    }

    pub fn new(weight: Matmul, bias: Option<Tensor>) -> Result<Self> {
        let bias = bias
            .map(|b| b.to_dtype(DType::F32)?.to_vec1())
            .transpose()?;
        Ok(Self { weight, bias })
    }

    /// Our kernel, when the weight has one.
    pub fn own_kernel(&self) -> Option<&dyn OwnKernel> {
        self.weight.own_kernel()
    }

    /// Says that this is the next matmul to run: the compute pool's idle threads request
    /// its weights into the caches meanwhile (our kernels; candle's go without).
    pub fn prefetch_ahead(&self) {
        if let Some(kernel) = self.own_kernel() {
            kernel.prefetch_ahead();
        }
    }

    /// `x Wᵀ (+ b)` for the `rows` rows of `x` (row-major), as a row-major vector.
    pub fn forward_rows(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        let mut y = self.weight.forward_rows(x, rows)?;
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(b.len()) {
                row.iter_mut().zip(b).for_each(|(y, b)| *y += b);
            }
        }
        Ok(y)
    }
}

/// Projections of one input (q/k/v, gate/up) in as few matmuls as their formats allow:
/// consecutive projections whose weights share a format have their rows stacked at load and
/// run as one matmul (one pass over the input, quantized once, one parallel call), the output
/// split after. A checkpoint that quantizes `v` more finely than `q` and `k` (Qwen2.5's Q4_K
/// files keep `v` in Q6_K) runs `q` and `k` together and `v` alone.
pub struct FusedLinear {
    /// Each matmul and the widths of the projections it holds, in order.
    groups: Vec<(Linear, Vec<usize>)>,
}

impl FusedLinear {
    /// `names[i]` with `rows[i]` output rows each, all over `inp` inputs.
    pub fn load(
        src: &mut dyn WeightSource,
        parts: &[(&str, usize)],
        inp: usize,
        bias: bool,
    ) -> Result<Self> {
        let backend = src.backend();
        let mut weights = Vec::with_capacity(parts.len());
        let mut biases = Vec::with_capacity(parts.len());
        for &(name, rows) in parts {
            weights.push(src.matrix(&format!("{name}.weight"), rows, inp)?);
            if bias {
                biases.push(src.vector(&format!("{name}.bias"), rows)?);
            }
        }
        let widths: Vec<usize> = parts.iter().map(|p| p.1).collect();
        Self::from_weights(&weights, &biases, &widths, backend)
    }

    /// The projections of `weights` (`widths[i]` rows each), with `biases` (one per weight,
    /// or none at all).
    fn from_weights(
        weights: &[Weight],
        biases: &[Tensor],
        widths: &[usize],
        backend: MatmulBackend,
    ) -> Result<Self> {
        let bias = !biases.is_empty();
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
            let bias = match bias {
                true => Some(Tensor::cat(&biases[start..end], 0)?),
                false => None,
            };
            let widths = widths[start..end].to_vec();
            groups.push((Linear::new(weight.matmul(backend)?, bias)?, widths));
            start = end;
        }
        Ok(Self { groups })
    }

    /// [`Linear::prefetch_ahead`] of the first matmul.
    pub fn prefetch_ahead(&self) {
        if let Some((linear, _)) = self.groups.first() {
            linear.prefetch_ahead();
        }
    }

    /// Every projection of the `rows` rows of `x` (row-major, `in` each).
    pub fn forward_rows(&self, x: &[f32], rows: usize) -> Result<Projections> {
        let mut matrices = Vec::with_capacity(self.groups.len());
        let mut parts = Vec::new();
        for (m, (linear, widths)) in self.groups.iter().enumerate() {
            let mut offset = 0;
            for &width in widths {
                parts.push((m, offset, width));
                offset += width;
            }
            matrices.push((linear.forward_rows(x, rows)?, offset));
        }
        Ok(Projections { matrices, parts })
    }
}

/// The outputs of a [`FusedLinear`]: each part's row, wherever the matmul left it.
pub struct Projections {
    /// Row-major matrices and their row widths.
    matrices: Vec<(Vec<f32>, usize)>,
    /// Per part: its matrix, its first column there and its width.
    parts: Vec<(usize, usize, usize)>,
}

impl Projections {
    /// Row `row` of part `part`.
    pub fn row(&self, part: usize, row: usize) -> &[f32] {
        let (m, offset, width) = self.parts[part];
        let (data, stride) = &self.matrices[m];
        &data[row * stride + offset..row * stride + offset + width]
    }
}

/// The gate and up projections of a SwiGLU feed-forward layer, and the SiLU·gate that joins
/// them: one kernel that applies it as it multiplies, where our interleaved kernels take the
/// two matrices' format ([`gated_kernel`]), else the two projections (a [`FusedLinear`]) and
/// [`silu_mul_rows`] after. Either gives the same values, bit for bit.
pub enum GateUp {
    Fused(Box<dyn OwnKernel>),
    Separate(FusedLinear),
}

impl GateUp {
    /// `gate` and `up` (`rows` output rows each, over `inp` inputs), without biases.
    pub fn load(
        src: &mut dyn WeightSource,
        gate: &str,
        up: &str,
        rows: usize,
        inp: usize,
    ) -> Result<Self> {
        let backend = src.backend();
        let weights = [
            src.matrix(&format!("{gate}.weight"), rows, inp)?,
            src.matrix(&format!("{up}.weight"), rows, inp)?,
        ];
        if let [Weight::Quantized(g), Weight::Quantized(u)] = &weights {
            if backend == MatmulBackend::Native && weights[0].stacks_with(&weights[1]) {
                if let Some(kernel) = gated_kernel(g.dtype(), rows, inp, &g.data()?, &u.data()?) {
                    return Ok(Self::Fused(kernel));
                }
            }
        }
        Ok(Self::Separate(FusedLinear::from_weights(
            &weights,
            &[],
            &[rows, rows],
            backend,
        )?))
    }

    /// Says that this is the next matmul to run ([`Linear::prefetch_ahead`]).
    pub fn prefetch_ahead(&self) {
        match self {
            Self::Fused(kernel) => kernel.prefetch_ahead(),
            Self::Separate(linear) => linear.prefetch_ahead(),
        }
    }

    /// `silu(x · gateᵀ) · (x · upᵀ)` for the `rows` rows of `x` (row-major) into `out`
    /// (`rows` rows of the projections' width).
    pub fn forward_into(&self, x: &[f32], rows: usize, out: &mut [f32]) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        match self {
            Self::Fused(kernel) => timed(Part::Matmul, || kernel.matmul(x, out)),
            Self::Separate(linear) => {
                let gate_up = linear.forward_rows(x, rows)?;
                let width = out.len() / rows;
                timed(Part::Activation, || {
                    silu_mul_rows(out, width, |r| (gate_up.row(0, r), gate_up.row(1, r)))
                })
            }
        }
        Ok(())
    }
}

/// Root-mean-square layer norm over the last dimension.
pub struct RmsNorm {
    weight: Vec<f32>,
    eps: f32,
}

impl RmsNorm {
    pub fn load(src: &mut dyn WeightSource, name: &str, len: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            weight: src.vector(name, len)?.to_dtype(DType::F32)?.to_vec1()?,
            eps: eps as f32,
        })
    }

    /// Normalises each row of `x` (rows of the weight's length) in place.
    pub fn forward_in_place(&self, x: &mut [f32]) {
        rms_norm_in_place(x, &self.weight, self.eps)
    }

    /// `x += add` (when given), then `out` = the norm of `x`, row by row over the compute
    /// pool (see [`add_rms_norm_rows`]).
    pub fn add_forward(&self, x: &mut [f32], add: Option<&[f32]>, out: &mut [f32]) {
        add_rms_norm_rows(x, add, &self.weight, self.eps, out)
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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use candle_core::Device;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Matrices and vectors held in memory, by name.
    struct Memory(HashMap<String, Weight>, HashMap<String, Tensor>);

    impl WeightSource for Memory {
        fn matrix(&mut self, name: &str, _rows: usize, _cols: usize) -> Result<Weight> {
            Ok(self.0[name].clone())
        }
        fn vector(&mut self, name: &str, _len: usize) -> Result<Tensor> {
            Ok(self.1[name].clone())
        }
        fn contains(&self, name: &str) -> bool {
            self.0.contains_key(name) || self.1.contains_key(name)
        }
        fn backend(&self) -> MatmulBackend {
            MatmulBackend::Native
        }
    }

    /// q/k/v in every grouping of formats (the 32-value ones and the K-quants, with and
    /// without biases): consecutive projections of one format run as one matmul, and every
    /// projection's output is, bit for bit, what its own matmul gives.
    #[test]
    fn projections_of_one_format_share_a_matmul() {
        use GgmlDType::{Q4K, Q4_0, Q4_1, Q6K, Q8_0};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let rows = [16, 8, 8];
        let dev = Device::Cpu;
        for (types, cols, bias, matmuls) in [
            ([Q4_0, Q4_0, Q8_0], 64, true, 2),
            ([Q8_0, Q4_0, Q4_0], 64, false, 2),
            ([Q4_1, Q4_1, Q4_1], 64, true, 1),
            ([Q8_0, Q4_0, Q8_0], 64, false, 3),
            ([Q4K, Q4K, Q6K], 256, true, 2),
        ] {
            let mut random =
                |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
            let x = random(3 * cols);
            let mut src = Memory(HashMap::new(), HashMap::new());
            let names = ["q", "k", "v"];
            for ((name, &r), dtype) in names.iter().zip(&rows).zip(types) {
                let t = Tensor::from_vec(random(r * cols), (r, cols), &dev).unwrap();
                let q = QTensor::quantize(&t, dtype).unwrap();
                src.0
                    .insert(format!("{name}.weight"), Weight::Quantized(Arc::new(q)));
                let b = Tensor::from_vec(random(r), r, &dev).unwrap();
                src.1.insert(format!("{name}.bias"), b);
            }
            let parts: Vec<(&str, usize)> = names.iter().copied().zip(rows).collect();
            let fused = FusedLinear::load(&mut src, &parts, cols, bias).unwrap();
            assert_eq!(fused.groups.len(), matmuls, "{types:?}");
            let out = fused.forward_rows(&x, 3).unwrap();
            for (i, (name, width)) in parts.iter().enumerate() {
                let alone = Linear::load(&mut src, name, *width, cols, bias).unwrap();
                let y = alone.forward_rows(&x, 3).unwrap();
                for r in 0..3 {
                    assert_eq!(
                        out.row(i, r),
                        &y[r * width..(r + 1) * width],
                        "{types:?} {name}"
                    );
                }
            }
        }
    }

    /// Gate and up of one interleaved format run as the fused kernel; mixed formats or rows
    /// not a multiple of 8 as the two projections and SiLU·gate after. Either gives, bit for
    /// bit, the stacked product and then SiLU·gate row by row.
    #[test]
    fn gate_up_fuses_where_the_formats_allow() {
        use GgmlDType::{Q4K, Q6K, Q8_0};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let dev = Device::Cpu;
        for (types, rows, cols, fused) in [
            ([Q8_0, Q8_0], 24, 64, true),
            ([Q4K, Q4K], 16, 256, true),
            ([Q4K, Q6K], 16, 256, false),
            ([Q8_0, Q8_0], 12, 64, false),
        ] {
            let mut random =
                |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
            let x = random(3 * cols);
            let mut src = Memory(HashMap::new(), HashMap::new());
            for (name, dtype) in ["gate", "up"].into_iter().zip(types) {
                let t = Tensor::from_vec(random(rows * cols), (rows, cols), &dev).unwrap();
                let q = QTensor::quantize(&t, dtype).unwrap();
                src.0
                    .insert(format!("{name}.weight"), Weight::Quantized(Arc::new(q)));
            }
            let gate_up = GateUp::load(&mut src, "gate", "up", rows, cols).unwrap();
            let case = format!("{types:?} {rows}x{cols}");
            assert_eq!(matches!(gate_up, GateUp::Fused(_)), fused, "{case}");
            let mut got = vec![f32::NAN; 3 * rows];
            gate_up.forward_into(&x, 3, &mut got).unwrap();
            let parts = [("gate", rows), ("up", rows)];
            let stacked = FusedLinear::load(&mut src, &parts, cols, false).unwrap();
            let products = stacked.forward_rows(&x, 3).unwrap();
            let mut want = vec![0f32; 3 * rows];
            for (r, want) in want.chunks_exact_mut(rows).enumerate() {
                crate::kernels::silu_mul(products.row(0, r), products.row(1, r), want);
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{case}");
        }
    }
}
