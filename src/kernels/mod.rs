//! Hot loops on plain slices: paged attention, rotary embedding, quantized matmul, the
//! decoder's row-wise norm and activation, and the per-batch routing features (softmax
//! entropy); and the memory they stream (`large_buf`: buffers on huge pages).
//!
//! Kernels know nothing of models, requests or tensors: they take slices, shapes and block
//! tables, and write into caller-owned outputs. Each one has a scalar reference in its tests.

pub mod attention;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod large_buf;
pub mod parallel;
pub mod qmatmul;
pub mod rope;
pub mod routing_features;
mod rows;

pub use attention::{paged_attention, AttentionSeq, PagedKv};
pub use rope::{RopeStyle, RotaryAngles};
pub use rows::{add_in_place, add_rms_norm_rows, rms_norm_in_place, silu_mul, silu_mul_rows};

/// An element of the paged K/V cache: `f32`, or `f16` (half the bytes to store and read,
/// 11 significant bits).
pub trait KvElem: Copy + Default + Send + Sync + 'static {
    /// IEEE half precision (the vector kernels load it through F16C's conversion).
    const HALF: bool;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    /// `dst[i] = from_f32(src[i])` for slices of one length.
    fn from_f32_slice(dst: &mut [Self], src: &[f32]) {
        assert_eq!(dst.len(), src.len());
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = Self::from_f32(x);
        }
    }
}

impl KvElem for f32 {
    const HALF: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl KvElem for half::f16 {
    const HALF: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
    /// Eight at a time with F16C where the CPU has it (`half` converts one value per
    /// out-of-line call otherwise).
    fn from_f32_slice(dst: &mut [Self], src: &[f32]) {
        half::slice::HalfFloatSliceExt::convert_from_f32_slice(dst, src)
    }
}

/// Requests every cache line that `bytes` bytes from `start` touch (the first and last lines
/// included when `start` is not line-aligned). Prefetches never fault and change nothing.
#[inline(always)]
pub(crate) fn prefetch_lines<T>(start: *const T, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        let first = start as usize & !63;
        let end = start as usize + bytes;
        for line in (first..end).step_by(64) {
            // SAFETY: a prefetch has no effect on memory and cannot fault.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line as *const i8) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (start, bytes);
}

/// Dot product with eight independent accumulators, so the loop vectorises.
#[inline]
pub(crate) fn dot<T: KvElem>(a: &[f32], b: &[T]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let (a8, a_rest) = a.split_at(a.len() / 8 * 8);
    let (b8, b_rest) = b.split_at(a8.len());
    for (ca, cb) in a8.chunks_exact(8).zip(b8.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += ca[i] * cb[i].to_f32();
        }
    }
    let mut sum = (acc[0] + acc[4]) + (acc[1] + acc[5]) + (acc[2] + acc[6]) + (acc[3] + acc[7]);
    for (x, y) in a_rest.iter().zip(b_rest) {
        sum += x * y.to_f32();
    }
    sum
}

/// The largest value of `xs`, NaN ignored (−∞ for none): sixteen running maxima, so the loop
/// vectorises (a fold through `f32::max` waits on every comparison in turn).
pub fn max_value(xs: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (m, &x) in lanes.iter_mut().zip(chunk) {
            *m = if x > *m { x } else { *m };
        }
    }
    lanes
        .iter()
        .chain(rest)
        .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m })
}

/// `acc += w * x`, element-wise.
#[inline]
pub(crate) fn axpy<T: KvElem>(acc: &mut [f32], w: f32, x: &[T]) {
    for (a, v) in acc.iter_mut().zip(x) {
        *a += w * v.to_f32();
    }
}

/// [`exp_in_place`]'s vector path.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    /// [`exp_in_place`] with AVX2 and FMA.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp(xs: &mut [f32]) -> f32 {
        let mut total = _mm256_setzero_ps();
        let mut chunks = xs.chunks_exact_mut(8);
        for c in &mut chunks {
            let x = _mm256_loadu_ps(c.as_ptr());
            let x = _mm256_min_ps(
                _mm256_max_ps(x, _mm256_set1_ps(-87.336_55)),
                _mm256_set1_ps(88.722_83),
            );
            // x = n ln 2 + r, |r| <= ln 2 / 2, with ln 2 split in two for an exact product.
            let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            );
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
            let mut p = _mm256_set1_ps(1.987_569_1e-4);
            for c in [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
                p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
            }
            let y = _mm256_add_ps(
                _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r),
                _mm256_set1_ps(1.0),
            );
            // 2^n through the exponent bits (n is -126..=128 after the clamp; 128 only for inputs
            // that overflow anyway).
            let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvtps_epi32(n),
                _mm256_set1_epi32(127),
            ));
            let e = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
            total = _mm256_add_ps(total, e);
            _mm256_storeu_ps(c.as_mut_ptr(), e);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), total);
        lanes.iter().sum::<f32>() + super::exp_portable(chunks.into_remainder())
    }
}

/// `xs[i] = exp(xs[i])`, eight at a time with AVX2 where the CPU has it (Cephes' polynomial
/// on the reduced argument, within 2 ulp of `f32::exp` for inputs in `-87.3..88.7`; smaller
/// inputs give about 1e-38 instead of 0 or a subnormal, larger ones are clamped). Returns the
/// sum of the results.
pub fn exp_in_place(xs: &mut [f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if qmatmul::Isa::best() != qmatmul::Isa::Scalar {
        // SAFETY: every SIMD `Isa` includes AVX2 and FMA.
        return unsafe { avx2::exp(xs) };
    }
    exp_portable(xs)
}

/// The portable [`exp_in_place`].
pub(crate) fn exp_portable(xs: &mut [f32]) -> f32 {
    xs.iter_mut()
        .map(|x| {
            *x = x.exp();
            *x
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The largest value against a plain fold, NaN ignored, at lengths around the lane count.
    #[test]
    fn max_value_is_the_largest_non_nan() {
        for len in [0usize, 1, 15, 16, 17, 100] {
            let mut xs: Vec<f32> = (0..len).map(|i| ((i * 37 % 23) as f32) - 11.0).collect();
            if len > 3 {
                xs[len / 2] = f32::NAN;
            }
            let want = xs
                .iter()
                .filter(|x| !x.is_nan())
                .fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            assert_eq!(max_value(&xs), want, "len {len}");
        }
        assert_eq!(max_value(&[f32::NAN; 20]), f32::NEG_INFINITY);
        assert_eq!(
            max_value(&[f32::NEG_INFINITY, f32::INFINITY]),
            f32::INFINITY
        );
    }

    /// The slice conversion the K/V cache writes with gives each value's own conversion,
    /// ties, subnormals, overflow and an odd-length tail included.
    #[test]
    fn f16_slice_conversion_matches_one_at_a_time() {
        let mut src: Vec<f32> = (0..67).map(|i| ((i as f32) * 0.731).sin() * 3.0).collect();
        src.extend([1.0 + f32::EPSILON, 2049.0, 6.0e-8, -1.0e-6, 70_000.0, -0.0]);
        let mut fast = vec![half::f16::ZERO; src.len()];
        <half::f16 as KvElem>::from_f32_slice(&mut fast, &src);
        for (got, &x) in fast.iter().zip(&src) {
            assert_eq!(got.to_bits(), half::f16::from_f32(x).to_bits(), "{x}");
        }
    }

    #[test]
    fn vector_exp_matches_the_library_exp() {
        let xs: Vec<f32> = (0..20_000)
            .map(|i| -90.0 + i as f32 * 0.0089)
            .chain([0.0, -0.0, 1.0, 88.0])
            .collect();
        let mut got = xs.clone();
        exp_in_place(&mut got);
        for (x, g) in xs.iter().zip(&got) {
            let want = (*x as f64).exp();
            if *x < -87.3 {
                assert!(*g >= 0.0 && *g < 1.3e-38, "exp({x}) = {g}");
                continue;
            }
            let rel = ((*g as f64 - want) / want).abs();
            assert!(
                rel < 3e-7,
                "exp({x}) = {g}, want {want} (relative error {rel})"
            );
        }
        // The returned sum, over a length with a tail past the vectors.
        let mut xs: Vec<f32> = (0..1003).map(|i| -20.0 + i as f32 * 0.02).collect();
        let want: f64 = xs.iter().map(|&x| (x as f64).exp()).sum();
        let sum = exp_in_place(&mut xs);
        assert!(
            ((sum as f64 - want) / want).abs() < 1e-5,
            "sum {sum}, want {want}"
        );
    }
}
