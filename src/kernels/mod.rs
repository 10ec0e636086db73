//! Hot loops on plain slices: paged attention, rotary embedding, quantized matmul and the
//! per-batch routing features (softmax entropy).
//!
//! Kernels know nothing of models, requests or tensors: they take slices, shapes and block
//! tables, and write into caller-owned outputs. Each one has a scalar reference in its tests.

pub mod attention;
pub mod parallel;
pub mod qmatmul;
pub mod rope;
pub mod routing_features;

pub use attention::{paged_attention, AttentionSeq, PagedKv};
pub use rope::{RopeStyle, RotaryAngles};

/// Dot product with eight independent accumulators, so the loop vectorises.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let (a8, a_rest) = a.split_at(a.len() / 8 * 8);
    let (b8, b_rest) = b.split_at(a8.len());
    for (ca, cb) in a8.chunks_exact(8).zip(b8.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += ca[i] * cb[i];
        }
    }
    let mut sum = (acc[0] + acc[4]) + (acc[1] + acc[5]) + (acc[2] + acc[6]) + (acc[3] + acc[7]);
    for (x, y) in a_rest.iter().zip(b_rest) {
        sum += x * y;
    }
    sum
}

/// `acc += w * x`, element-wise.
#[inline]
pub(crate) fn axpy(acc: &mut [f32], w: f32, x: &[f32]) {
    for (a, v) in acc.iter_mut().zip(x) {
        *a += w * v;
    }
}

/// [`dot`] and [`axpy`] with AVX2 and FMA (four independent accumulators, fused
/// multiply-adds), and [`exp_in_place`]'s vector path.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        debug_assert_eq!(a.len(), b.len());
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (j, acc) in acc.iter_mut().enumerate() {
                let at = i + 8 * j;
                *acc = _mm256_fmadd_ps(
                    _mm256_loadu_ps(pa.add(at)),
                    _mm256_loadu_ps(pb.add(at)),
                    *acc,
                );
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i)),
                _mm256_loadu_ps(pb.add(i)),
                acc[0],
            );
            i += 8;
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let r = _mm_add_ps(_mm256_extractf128_ps::<1>(v), _mm256_castps256_ps128(v));
        let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
        let mut sum = _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
        while i < n {
            sum += a[i] * b[i];
            i += 1;
        }
        sum
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn axpy(acc: &mut [f32], w: f32, x: &[f32]) {
        let n = acc.len().min(x.len());
        let (pa, px) = (acc.as_mut_ptr(), x.as_ptr());
        let wv = _mm256_set1_ps(w);
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(
                pa.add(i),
                _mm256_fmadd_ps(wv, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(pa.add(i))),
            );
            i += 8;
        }
        while i < n {
            acc[i] += w * x[i];
            i += 1;
        }
    }
    /// [`exp_in_place`] with AVX2 and FMA.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp(xs: &mut [f32]) {
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
            _mm256_storeu_ps(c.as_mut_ptr(), _mm256_mul_ps(y, _mm256_castsi256_ps(bits)));
        }
        super::exp_portable(chunks.into_remainder());
    }
}

/// `xs[i] = exp(xs[i])`, eight at a time with AVX2 where the CPU has it (Cephes' polynomial
/// on the reduced argument, within 2 ulp of `f32::exp` for inputs in `-87.3..88.7`; smaller
/// inputs give about 1e-38 instead of 0 or a subnormal, larger ones are clamped).
pub fn exp_in_place(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if qmatmul::Isa::best() != qmatmul::Isa::Scalar {
        // SAFETY: every SIMD `Isa` includes AVX2 and FMA.
        unsafe { avx2::exp(xs) };
        return;
    }
    exp_portable(xs);
}

/// The portable [`exp_in_place`].
pub(crate) fn exp_portable(xs: &mut [f32]) {
    xs.iter_mut().for_each(|x| *x = x.exp());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simd_dot_and_axpy_match_the_portable_loops() {
        #[cfg(target_arch = "x86_64")]
        if qmatmul::Isa::best() != qmatmul::Isa::Scalar {
            for n in [0, 1, 7, 8, 13, 32, 64, 77] {
                let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
                let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
                let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
                // SAFETY: checked above that the CPU has AVX2 and FMA.
                let got = unsafe { avx2::dot(&a, &b) };
                assert!(
                    (got as f64 - want).abs() < 1e-5,
                    "dot n={n}: {got} vs {want}"
                );
                let (mut fast, mut slow) = (b.clone(), b.clone());
                unsafe { avx2::axpy(&mut fast, 0.75, &a) };
                axpy(&mut slow, 0.75, &a);
                for (f, s) in fast.iter().zip(&slow) {
                    assert!((f - s).abs() < 1e-6, "axpy n={n}");
                }
            }
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
    }
}
