//! The CPU backend's layers over loaded weights: linear projections (alone, or several of one
//! input run as few matmuls), the feed-forward gate/up with its SiLU·gate, and RMS norm.

use candle_core::{DType, Tensor};

use crate::kernels::{add_rms_norm_rows, rms_norm_in_place, silu_mul_rows};
use crate::model::error::Result;
use crate::model::timing::{timed, Part};
use crate::model::weights::{gated_kernel, Matmul, MatmulBackend, OwnKernel, Weight};

/// `y = x Wᵀ (+ b)`.
pub struct Linear {
    weight: Matmul,
    bias: Option<Vec<f32>>,
}

impl Linear {
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
    /// The projections of `weights` (`widths[i]` rows each), with `biases` (one per weight,
    /// or none at all).
    pub fn from_weights(
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

    /// Our kernel of the first matmul, when it is one of ours.
    pub fn own_kernel(&self) -> Option<&dyn OwnKernel> {
        self.groups
            .first()
            .and_then(|(linear, _)| linear.own_kernel())
    }

    /// Every projection of the `rows` rows of `x`, each in a vector of its own: a single
    /// projection is the matmul's output as it is, several are copied out of theirs.
    pub fn forward_parts(&self, x: &[f32], rows: usize) -> Result<Vec<Vec<f32>>> {
        if let [(linear, widths)] = self.groups.as_slice() {
            if widths.len() == 1 {
                return Ok(vec![linear.forward_rows(x, rows)?]);
            }
        }
        let out = self.forward_rows(x, rows)?;
        Ok((0..out.parts.len())
            .map(|i| {
                let mut y = Vec::with_capacity(rows * out.row(i, 0).len());
                for r in 0..rows {
                    y.extend_from_slice(out.row(i, r));
                }
                y
            })
            .collect())
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
    /// Gate and up (`rows` output rows each, over `inp` inputs) as `backend` multiplies them.
    pub fn from_weights(
        weights: [Weight; 2],
        rows: usize,
        inp: usize,
        backend: MatmulBackend,
    ) -> Result<Self> {
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
    pub fn new(weight: &Tensor, eps: f64) -> Result<Self> {
        Ok(Self {
            weight: weight.to_dtype(DType::F32)?.to_vec1()?,
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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Arc;

    use candle_core::quantized::{GgmlDType, QTensor};

    use candle_core::Device;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Matrices and vectors held in memory, by name.
    struct Memory(HashMap<String, Weight>, HashMap<String, Tensor>);

    impl Memory {
        /// Projections `parts` (name and rows), with their biases when `bias`.
        fn fused(&self, parts: &[(&str, usize)], bias: bool) -> FusedLinear {
            let weights: Vec<Weight> = parts
                .iter()
                .map(|(name, _)| self.0[&format!("{name}.weight")].clone())
                .collect();
            let biases: Vec<Tensor> = match bias {
                true => parts
                    .iter()
                    .map(|(name, _)| self.1[&format!("{name}.bias")].clone())
                    .collect(),
                false => Vec::new(),
            };
            let widths: Vec<usize> = parts.iter().map(|p| p.1).collect();
            FusedLinear::from_weights(&weights, &biases, &widths, MatmulBackend::Native).unwrap()
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
            let fused = src.fused(&parts, bias);
            assert_eq!(fused.groups.len(), matmuls, "{types:?}");
            let out = fused.forward_rows(&x, 3).unwrap();
            for (i, (name, width)) in parts.iter().enumerate() {
                let alone = src.fused(&[(name, *width)], bias);
                let y = alone.forward_parts(&x, 3).unwrap().swap_remove(0);
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
            let weights = ["gate", "up"].map(|name| src.0[&format!("{name}.weight")].clone());
            let gate_up = GateUp::from_weights(weights, rows, cols, MatmulBackend::Native).unwrap();
            let case = format!("{types:?} {rows}x{cols}");
            assert_eq!(matches!(gate_up, GateUp::Fused(_)), fused, "{case}");
            let mut got = vec![f32::NAN; 3 * rows];
            gate_up.forward_into(&x, 3, &mut got).unwrap();
            let parts = [("gate", rows), ("up", rows)];
            let stacked = src.fused(&parts, false);
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
