//! Activation quantization with AVX2 and F16C: the same bytes as the portable loops of
//! [`super`], eight values at a time.

use std::arch::x86_64::*;

use super::{ActBlock, QK};

/// [`super::quantize_i8`] eight values at a time; `xs.len()` a multiple of 8, `qs` as long.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_i8(xs: &[f32], qs: &mut [i8]) -> f32 {
    quantize_i8_sum(xs, qs).0
}

/// [`super::quantize_i8`] and `Σ qs`, inlined into its callers.
///
/// # Safety
/// The CPU must support AVX2; `xs.len()` is a multiple of 8 and `qs` as long.
#[inline(always)]
unsafe fn quantize_i8_sum(xs: &[f32], qs: &mut [i8]) -> (f32, i32) {
    debug_assert!(xs.len().is_multiple_of(8) && qs.len() == xs.len());
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let mut max = _mm256_setzero_ps();
    for c in xs.chunks_exact(8) {
        max = _mm256_max_ps(max, _mm256_and_ps(_mm256_loadu_ps(c.as_ptr()), abs_mask));
    }
    let m = _mm_max_ps(_mm256_castps256_ps128(max), _mm256_extractf128_ps(max, 1));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    let d = amax / 127.0;
    let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
    let half = _mm256_set1_ps(0.5);
    let one = _mm256_set1_ps(1.0);
    let sign_mask = _mm256_set1_ps(-0.0);
    let mut sum = _mm256_setzero_si256();
    for (c, q) in xs.chunks_exact(8).zip(qs.chunks_exact_mut(8)) {
        let v = _mm256_mul_ps(_mm256_loadu_ps(c.as_ptr()), id);
        // Round half away from zero, exactly: truncate, then step away from zero when the
        // (exact) remainder is at least one half.
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
        let away = _mm256_cmp_ps::<_CMP_GE_OQ>(_mm256_and_ps(_mm256_sub_ps(v, t), abs_mask), half);
        let step = _mm256_or_ps(_mm256_and_ps(v, sign_mask), one);
        let r = _mm256_cvttps_epi32(_mm256_add_ps(t, _mm256_and_ps(away, step)));
        // |r| <= 127 for any scale whose inverse is finite (|v| <= 127 up to rounding), so
        // the packs below do not saturate; below an amax of ~4e-37 the inverse overflows, as
        // in `quantize_i8`, and the scale rounds to zero in f16 anyway.
        sum = _mm256_add_epi32(sum, r);
        let w = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storel_epi64(q.as_mut_ptr() as *mut __m128i, _mm_packs_epi16(w, w));
    }
    let s = _mm_add_epi32(
        _mm256_castsi256_si128(sum),
        _mm256_extracti128_si256(sum, 1),
    );
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    (d, _mm_cvtsi128_si32(s))
}

/// `x` rounded to f16 and back, as F16C rounds (to nearest, ties to even: the `half` crate's
/// rounding).
///
/// # Safety
/// The CPU must support F16C.
#[inline(always)]
unsafe fn round_f16(x: f32) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(
        _mm_set_ss(x),
    )))
}

/// [`ActBlock::quantize`] over a row of blocks, in one SIMD function (the
/// block-at-a-time path pays a call, a scalar sum and four out-of-line f16 conversions per
/// 32 values); the same bytes.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn quantize_row_q8_1(x: &[f32], out: &mut [ActBlock]) {
    for (xs, block) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let (d, sum) = quantize_i8_sum(xs, &mut block.qs);
        let d = round_f16(d);
        block.d = d;
        // f16 · f16 is exact in f32; the product is rounded to f16 as `half`'s `Mul` does.
        block.s = round_f16(round_f16(sum as f32) * d);
        block.sum = sum;
    }
}
