//! Attention's many-row dot products and weighted sums over `f32` or `f16` cache rows with
//! AVX2, FMA and F16C ([`scores`], [`weighted_sum`] and their two-query forms).

use std::arch::x86_64::*;

use crate::kernels::KvElem;

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
pub(super) unsafe fn scores<T: KvElem>(q: &[f32], k: &[T], scale: f32, scores: &mut [f32]) -> f32 {
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
pub(super) unsafe fn scores_pair<T: KvElem>(
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
pub(super) unsafe fn weighted_sum<T: KvElem>(acc: &mut [f32], w: &[f32], v: &[T]) {
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
pub(super) unsafe fn weighted_sum_pair<T: KvElem>(
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector scores and weighted sums against f64 sums over the stored values, for
    /// `f32` and `f16` rows.
    fn check_simd_rows<T: KvElem>() {
        if crate::kernels::qmatmul::Isa::best() != crate::kernels::qmatmul::Isa::Scalar {
            for hd in [8, 16, 24, 64, 72, 128] {
                for n in [1, 5, 8, 13, 16] {
                    let q: Vec<f32> = (0..hd).map(|i| (i as f32 * 0.37).sin()).collect();
                    let rows: Vec<T> = (0..n * hd)
                        .map(|i| T::from_f32((i as f32 * 0.11).cos()))
                        .collect();
                    let row = |i: usize, d: usize| rows[i * hd + d].to_f32() as f64;
                    let mut got = vec![f32::NAN; n];
                    // SAFETY: checked above that the CPU has AVX2, FMA and F16C.
                    let max = unsafe { scores(&q, &rows, 0.5, &mut got) };
                    assert_eq!(max, got.iter().copied().fold(f32::NEG_INFINITY, f32::max));
                    for (i, g) in got.iter().enumerate() {
                        let want: f64 = (0..hd).map(|d| q[d] as f64 * row(i, d) * 0.5).sum();
                        assert!((*g as f64 - want).abs() < 1e-5, "hd={hd} n={n} row {i}");
                    }
                    let w: Vec<f32> = (0..n).map(|i| 0.25 + i as f32 * 0.1).collect();
                    let mut fast = q.clone();
                    unsafe { weighted_sum(&mut fast, &w, &rows) };
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
}
