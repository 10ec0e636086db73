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

/// Attention's many-row dot products and weighted sums over `f32` or `f16` cache rows with
/// AVX2, FMA and F16C ([`avx2::scores`], [`avx2::weighted_sum`]), and [`exp_in_place`]'s
/// vector path.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use super::KvElem;

    /// Eight cache elements from `p`, as `f32`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8<T: KvElem>(p: *const T) -> __m256 {
        if T::HALF {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        } else {
            _mm256_loadu_ps(p as *const f32)
        }
    }

    /// `scores[i] = scale · (q · k[i])` for the `scores.len()` rows of `k` (`q.len()` each, a
    /// multiple of 8): eight rows at a time, each into its own accumulator, the eight reduced
    /// together. Returns the largest score.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn scores<T: KvElem>(
        q: &[f32],
        k: &[T],
        scale: f32,
        scores: &mut [f32],
    ) -> f32 {
        let hd = q.len();
        let mut max = _mm256_set1_ps(f32::NEG_INFINITY);
        let n = scores.len();
        assert!(hd.is_multiple_of(8) && k.len() >= n * hd);
        let pq = q.as_ptr();
        let scale = _mm256_set1_ps(scale);
        let mut r0 = 0;
        while r0 < n {
            let rows = (n - r0).min(8);
            // Past the last row, the slots repeat it; their scores are dropped.
            let mut row = [k.as_ptr(); 8];
            for (i, r) in row.iter_mut().enumerate() {
                *r = k.as_ptr().add((r0 + i.min(rows - 1)) * hd);
            }
            let mut acc = [_mm256_setzero_ps(); 8];
            let mut c = 0;
            while c < hd {
                let qv = _mm256_loadu_ps(pq.add(c));
                for (acc, row) in acc.iter_mut().zip(&row) {
                    *acc = _mm256_fmadd_ps(qv, load8(row.add(c)), *acc);
                }
                c += 8;
            }
            let sums = _mm256_mul_ps(sum_lanes8(&acc), scale);
            // The repeated slots hold copies of the last row's score.
            max = _mm256_max_ps(max, sums);
            if rows == 8 {
                _mm256_storeu_ps(scores.as_mut_ptr().add(r0), sums);
            } else {
                let mut all = [0f32; 8];
                _mm256_storeu_ps(all.as_mut_ptr(), sums);
                scores[r0..].copy_from_slice(&all[..rows]);
            }
            r0 += 8;
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), max);
        lanes.iter().copied().fold(f32::NEG_INFINITY, f32::max)
    }

    /// [`scores`] for two query heads at once (`q` holds both, `hd` each): every K row loaded
    /// serves both heads, four rows at a time. Head `h`'s scores go to `out[h * stride..]`
    /// (`k.len() / hd` of them); returns each head's largest.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `out` must hold `stride + k.len() / hd`
    /// elements.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn scores_pair<T: KvElem>(
        q: &[f32],
        k: &[T],
        scale: f32,
        out: &mut [f32],
        stride: usize,
    ) -> [f32; 2] {
        let hd = q.len() / 2;
        let n = k.len() / hd;
        assert!(hd.is_multiple_of(8) && out.len() >= stride + n && stride >= n);
        let (q0, q1) = (q.as_ptr(), q.as_ptr().add(hd));
        let scale = _mm256_set1_ps(scale);
        let mut max = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut r0 = 0;
        while r0 < n {
            let rows = (n - r0).min(4);
            // Past the last row, the slots repeat it; their scores are dropped.
            let row: [*const T; 4] =
                std::array::from_fn(|i| k.as_ptr().add((r0 + i.min(rows - 1)) * hd));
            // acc[i]: head 0 and row i; acc[4 + i]: head 1 and row i.
            let mut acc = [_mm256_setzero_ps(); 8];
            let mut c = 0;
            while c < hd {
                let a = _mm256_loadu_ps(q0.add(c));
                let b = _mm256_loadu_ps(q1.add(c));
                for (i, row) in row.iter().enumerate() {
                    let x = load8(row.add(c));
                    acc[i] = _mm256_fmadd_ps(a, x, acc[i]);
                    acc[4 + i] = _mm256_fmadd_ps(b, x, acc[4 + i]);
                }
                c += 8;
            }
            // Lanes 0..4: head 0's rows; lanes 4..8: head 1's.
            let sums = _mm256_mul_ps(sum_lanes8(&acc), scale);
            max = _mm256_max_ps(max, sums);
            if rows == 4 {
                _mm_storeu_ps(out[r0..r0 + 4].as_mut_ptr(), _mm256_castps256_ps128(sums));
                let high = _mm256_extractf128_ps::<1>(sums);
                _mm_storeu_ps(out[stride + r0..stride + r0 + 4].as_mut_ptr(), high);
            } else {
                let mut all = [0f32; 8];
                _mm256_storeu_ps(all.as_mut_ptr(), sums);
                for i in 0..rows {
                    out[r0 + i] = all[i];
                    out[stride + r0 + i] = all[4 + i];
                }
            }
            r0 += 4;
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), max);
        let top = |l: &[f32]| l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        [top(&lanes[..4]), top(&lanes[4..])]
    }

    /// The lane sums of eight vectors, as one vector: lane `i` holds the sum of `a[i]`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn sum_lanes8(a: &[__m256; 8]) -> __m256 {
        // Two rounds of pairwise sums leave in `u0` the sums of lanes 0..4 (low half) and 4..8
        // (high half) of a[0..4], in `u1` those of a[4..8]; adding the halves gives the totals.
        let t0 = _mm256_hadd_ps(a[0], a[1]);
        let t1 = _mm256_hadd_ps(a[2], a[3]);
        let t2 = _mm256_hadd_ps(a[4], a[5]);
        let t3 = _mm256_hadd_ps(a[6], a[7]);
        let u0 = _mm256_hadd_ps(t0, t1);
        let u1 = _mm256_hadd_ps(t2, t3);
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(u0, u1),
            _mm256_permute2f128_ps::<0x31>(u0, u1),
        )
    }

    /// `acc += Σ w[i] · v[i]` over the `w.len()` rows of `v` (`acc.len()` each, a multiple of
    /// 8), `acc` held in registers 64 (or 8) columns at a time across all the rows.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn weighted_sum<T: KvElem>(acc: &mut [f32], w: &[f32], v: &[T]) {
        let hd = acc.len();
        assert!(hd.is_multiple_of(8) && v.len() >= w.len() * hd);
        let mut c = 0;
        while c + 64 <= hd {
            weighted_sum_cols::<T, 8>(acc.as_mut_ptr().add(c), w, v.as_ptr().add(c), hd);
            c += 64;
        }
        while c < hd {
            weighted_sum_cols::<T, 1>(acc.as_mut_ptr().add(c), w, v.as_ptr().add(c), hd);
            c += 8;
        }
    }

    /// [`weighted_sum`] over `8 · N` columns from `acc` and from each row of `v` (rows
    /// `stride` apart).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weighted_sum_cols<T: KvElem, const N: usize>(
        acc: *mut f32,
        w: &[f32],
        v: *const T,
        stride: usize,
    ) {
        let mut a = [_mm256_setzero_ps(); N];
        for (j, a) in a.iter_mut().enumerate() {
            *a = _mm256_loadu_ps(acc.add(8 * j));
        }
        for (i, &wi) in w.iter().enumerate() {
            let wv = _mm256_set1_ps(wi);
            let row = v.add(i * stride);
            for (j, a) in a.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(wv, load8(row.add(8 * j)), *a);
            }
        }
        for (j, a) in a.iter().enumerate() {
            _mm256_storeu_ps(acc.add(8 * j), *a);
        }
    }

    /// [`weighted_sum`] for two heads at once: `acc` holds both heads' outputs (`hd` each),
    /// head `h`'s weights are `w[h * stride..]` (`v.len() / hd` of them); every V row loaded
    /// serves both heads, 32 (or 8) columns at a time.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn weighted_sum_pair<T: KvElem>(
        acc: &mut [f32],
        w: &[f32],
        stride: usize,
        v: &[T],
    ) {
        let hd = acc.len() / 2;
        let n = v.len() / hd;
        assert!(hd.is_multiple_of(8) && w.len() >= stride + n && stride >= n);
        let (w0, w1) = (&w[..n], &w[stride..stride + n]);
        let (a0, a1) = acc.split_at_mut(hd);
        let mut c = 0;
        while c + 32 <= hd {
            weighted_sum_pair_cols::<T, 4>(a0, a1, c, (w0, w1), v.as_ptr().add(c), hd);
            c += 32;
        }
        while c < hd {
            weighted_sum_pair_cols::<T, 1>(a0, a1, c, (w0, w1), v.as_ptr().add(c), hd);
            c += 8;
        }
    }

    /// [`weighted_sum_pair`] over `8 · N` columns from column `c` of both outputs and from
    /// each row of `v` (rows `stride` apart).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weighted_sum_pair_cols<T: KvElem, const N: usize>(
        a0: &mut [f32],
        a1: &mut [f32],
        c: usize,
        (w0, w1): (&[f32], &[f32]),
        v: *const T,
        stride: usize,
    ) {
        let (p0, p1) = (a0[c..c + 8 * N].as_mut_ptr(), a1[c..c + 8 * N].as_mut_ptr());
        let mut s0: [__m256; N] = std::array::from_fn(|j| _mm256_loadu_ps(p0.add(8 * j)));
        let mut s1: [__m256; N] = std::array::from_fn(|j| _mm256_loadu_ps(p1.add(8 * j)));
        for (i, (&x0, &x1)) in w0.iter().zip(w1).enumerate() {
            let (x0, x1) = (_mm256_set1_ps(x0), _mm256_set1_ps(x1));
            let row = v.add(i * stride);
            for j in 0..N {
                let x = load8(row.add(8 * j));
                s0[j] = _mm256_fmadd_ps(x0, x, s0[j]);
                s1[j] = _mm256_fmadd_ps(x1, x, s1[j]);
            }
        }
        for j in 0..N {
            _mm256_storeu_ps(p0.add(8 * j), s0[j]);
            _mm256_storeu_ps(p1.add(8 * j), s1[j]);
        }
    }

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

    /// The vector scores and weighted sums against f64 sums over the stored values, for
    /// `f32` and `f16` rows.
    fn check_simd_rows<T: KvElem>() {
        #[cfg(target_arch = "x86_64")]
        if qmatmul::Isa::best() != qmatmul::Isa::Scalar {
            for hd in [8, 16, 24, 64, 72, 128] {
                for n in [1, 5, 8, 13, 16] {
                    let q: Vec<f32> = (0..hd).map(|i| (i as f32 * 0.37).sin()).collect();
                    let rows: Vec<T> = (0..n * hd)
                        .map(|i| T::from_f32((i as f32 * 0.11).cos()))
                        .collect();
                    let row = |i: usize, d: usize| rows[i * hd + d].to_f32() as f64;
                    let mut got = vec![f32::NAN; n];
                    // SAFETY: checked above that the CPU has AVX2, FMA and F16C.
                    let max = unsafe { avx2::scores(&q, &rows, 0.5, &mut got) };
                    assert_eq!(max, got.iter().copied().fold(f32::NEG_INFINITY, f32::max));
                    for (i, g) in got.iter().enumerate() {
                        let want: f64 = (0..hd).map(|d| q[d] as f64 * row(i, d) * 0.5).sum();
                        assert!((*g as f64 - want).abs() < 1e-5, "hd={hd} n={n} row {i}");
                    }
                    let w: Vec<f32> = (0..n).map(|i| 0.25 + i as f32 * 0.1).collect();
                    let mut fast = q.clone();
                    unsafe { avx2::weighted_sum(&mut fast, &w, &rows) };
                    for (d, f) in fast.iter().enumerate() {
                        let want =
                            q[d] as f64 + (0..n).map(|i| w[i] as f64 * row(i, d)).sum::<f64>();
                        assert!((*f as f64 - want).abs() < 1e-5, "hd={hd} n={n} col {d}");
                    }
                }
            }
        }
    }

    #[test]
    fn simd_scores_and_weighted_sums_match_f64_sums() {
        check_simd_rows::<f32>();
        check_simd_rows::<half::f16>();
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
