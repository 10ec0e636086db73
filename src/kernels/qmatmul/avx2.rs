//! The SIMD paths of the quantized matmul: ggml blocks unpacked in registers, `C` weight rows ×
//! `T` activation rows of independent accumulators per call, compiled once per [`ByteDot`]
//! (AVX2, AVX-VNNI, AVX-512 VNNI); and the byte dot-product helpers the interleaved kernels
//! share.

use std::arch::x86_64::*;

use super::WeightBlock;

/// Low nibbles in bytes 0..16, high nibbles in bytes 16..32.
#[inline(always)]
pub(super) unsafe fn nibbles(qs: &[u8; 16]) -> __m256i {
    let lo = _mm_loadu_si128(qs.as_ptr() as *const __m128i);
    let both = _mm256_insertf128_si256::<1>(_mm256_castsi128_si256(lo), _mm_srli_epi16(lo, 4));
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

/// Byte `i` is 0xFF where bit `i` of `x` is set, else 0.
#[inline(always)]
pub(super) unsafe fn bytes_from_bits(x: u32) -> __m256i {
    let shuffle = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x as i32), shuffle);
    let bits = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
    _mm256_cmpeq_epi8(bits, _mm256_set1_epi64x(-1))
}

#[inline(always)]
unsafe fn hsum(x: __m256) -> f32 {
    let r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    let r = _mm_add_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

/// Eight partial sums of `w · a` as floats; `w` signed (or unsigned when `unsigned`).
#[inline(always)]
pub(super) unsafe fn dot_i8<D: ByteDot>(w: __m256i, a: __m256i, unsigned: bool) -> __m256 {
    let (w, a) = if unsigned {
        (w, a)
    } else {
        (_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w))
    };
    _mm256_cvtepi32_ps(dp32::<D>(_mm256_setzero_si256(), w, a))
}

/// How a kernel multiplies unsigned weight bytes `q` with signed activation bytes `x`, four
/// products to a 32-bit lane: AVX2's `maddubs` into 16-bit pairs, or one `vpdpbusd` straight
/// into 32-bit lanes in either VNNI encoding. Kernels are generic over it (every method is
/// inlined into a kernel compiled with the matching target features) and add AVX2's pairs up
/// in 16 bits where the products cannot overflow them (`dp16`, widened once by `widen` or
/// `scaled`), or widen every step (`dp32`).
pub trait ByteDot: 'static {
    /// Whether `dpbusd` is one instruction, so kernels keep 32-bit sums.
    const VNNI: bool;
    /// Whether the interleaved tiles request their weights at the 512-bit one-row kernels'
    /// distances, into L2 as well as L1 (the AVX-512 machines': see `interleaved::tile_prefetch_line`).
    const L2_REQUESTS: bool = false;
    /// Whether the kernels are compiled for AVX-512 VNNI, so the tiles may take the passes of
    /// `interleaved::evex` (EVEX-encoded: broadcasts from memory, 32 registers).
    const EVEX: bool = false;
    /// `acc + q · x` in 32-bit lanes.
    ///
    /// # Safety
    /// Only inside a kernel compiled with the type's target features.
    unsafe fn dpbusd(acc: __m256i, q: __m256i, x: __m256i) -> __m256i;
}

/// AVX2: `maddubs` (pairs saturate at ±32 767, which no format's products reach) and `madd`.
pub struct Avx2Dot;
/// AVX-VNNI's VEX-encoded `vpdpbusd` (Alder Lake and later client cores, Zen 5).
pub struct AvxVnniDot;
/// AVX-512 VNNI's EVEX-encoded `vpdpbusd` on 256-bit registers (with AVX-512 VL).
pub struct Avx512VnniDot;

impl ByteDot for Avx2Dot {
    const VNNI: bool = false;
    #[inline(always)]
    unsafe fn dpbusd(acc: __m256i, q: __m256i, x: __m256i) -> __m256i {
        let pairs = _mm256_maddubs_epi16(q, x);
        _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    }
}

impl ByteDot for AvxVnniDot {
    const VNNI: bool = true;
    #[inline(always)]
    unsafe fn dpbusd(acc: __m256i, q: __m256i, x: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(acc, q, x)
    }
}

impl ByteDot for Avx512VnniDot {
    const VNNI: bool = true;
    const L2_REQUESTS: bool = true;
    const EVEX: bool = true;
    #[inline(always)]
    unsafe fn dpbusd(acc: __m256i, q: __m256i, x: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, q, x)
    }
}

/// `acc + q · x` in 32-bit lanes.
#[inline(always)]
pub(super) unsafe fn dp32<D: ByteDot>(acc: __m256i, q: __m256i, x: __m256i) -> __m256i {
    D::dpbusd(acc, q, x)
}

/// `acc + q · x` in the VNNI forms' 32-bit lanes or AVX2's 16-bit pairs (the caller bounds
/// the 16-bit sums).
#[inline(always)]
pub(super) unsafe fn dp16<D: ByteDot>(acc: __m256i, q: __m256i, x: __m256i) -> __m256i {
    if D::VNNI {
        D::dpbusd(acc, q, x)
    } else {
        _mm256_add_epi16(acc, _mm256_maddubs_epi16(q, x))
    }
}

/// Two [`dp16`] sums added (kernels keep two, so `vpdpbusd`'s latency overlaps; the caller
/// bounds AVX2's 16-bit total).
#[inline(always)]
pub(super) unsafe fn add16<D: ByteDot>(a: __m256i, b: __m256i) -> __m256i {
    if D::VNNI {
        _mm256_add_epi32(a, b)
    } else {
        _mm256_add_epi16(a, b)
    }
}

/// A [`dp16`] sum as 32-bit lanes.
#[inline(always)]
pub(super) unsafe fn widen<D: ByteDot>(part: __m256i) -> __m256i {
    if D::VNNI {
        part
    } else {
        _mm256_madd_epi16(part, _mm256_set1_epi16(1))
    }
}

/// Eight per-lane scale bytes at `p` (signed when `SIGNED`) in the form [`scaled`] takes.
#[inline(always)]
pub(super) unsafe fn scales<D: ByteDot, const SIGNED: bool>(p: *const u8) -> __m256i {
    let s = _mm_loadl_epi64(p as *const __m128i);
    match (D::VNNI, SIGNED) {
        (true, true) => _mm256_cvtepi8_epi32(s),
        (true, false) => _mm256_cvtepu8_epi32(s),
        (false, signed) => {
            // Each scale to the two 16-bit lanes of its 32-bit lane.
            let pairs = _mm_set_epi8(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
            let s = _mm_shuffle_epi8(s, pairs);
            if signed {
                _mm256_cvtepi8_epi16(s)
            } else {
                _mm256_cvtepu8_epi16(s)
            }
        }
    }
}

/// A [`dp16`] sum times [`scales`], as 32-bit lanes.
#[inline(always)]
pub(super) unsafe fn scaled<D: ByteDot>(part: __m256i, scales: __m256i) -> __m256i {
    if D::VNNI {
        _mm256_mullo_epi32(part, scales)
    } else {
        _mm256_madd_epi16(part, scales)
    }
}

#[inline(always)]
pub(super) unsafe fn f16_to_f32(bits: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// The tile kernels for one instruction set: `$tile` dispatches on the tile shape to
/// `$block`, which keeps its `C × T` accumulators in registers.
macro_rules! tile_kernels {
    ($tile:ident, $block:ident, $features:literal, $dot:ty) => {
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $tile<B: WeightBlock>(
            w: &[B],
            cols: usize,
            acts: &[B::Act],
            kb: usize,
            sums: &mut [f32],
        ) {
            match (cols, sums.len() / cols) {
                (4, 1) => $block::<B, 4, 1>(w, acts, kb, sums),
                (4, 2) => $block::<B, 4, 2>(w, acts, kb, sums),
                (2, 3) => $block::<B, 2, 3>(w, acts, kb, sums),
                (2, 4) => $block::<B, 2, 4>(w, acts, kb, sums),
                (2, 1) => $block::<B, 2, 1>(w, acts, kb, sums),
                (2, 2) => $block::<B, 2, 2>(w, acts, kb, sums),
                (1, 1) => $block::<B, 1, 1>(w, acts, kb, sums),
                (1, 2) => $block::<B, 1, 2>(w, acts, kb, sums),
                (1, 3) => $block::<B, 1, 3>(w, acts, kb, sums),
                (1, 4) => $block::<B, 1, 4>(w, acts, kb, sums),
                (1, 8) => $block::<B, 1, 8>(w, acts, kb, sums),
                _ => super::dot_tile_scalar(w, cols, acts, kb, sums),
            }
        }

        #[target_feature(enable = $features)]
        unsafe fn $block<B: WeightBlock, const C: usize, const T: usize>(
            w: &[B],
            acts: &[B::Act],
            kb: usize,
            sums: &mut [f32],
        ) {
            let mut acc = [[_mm256_setzero_ps(); T]; C];
            let mut offsets = [[0f32; T]; C];
            // The next tile's weight rows, one block per step: rows are a few hundred bytes,
            // too short for the hardware prefetcher to pick each one up in time. Prefetches
            // never fault, so running past the end of the matrix is harmless.
            let next = w.as_ptr().wrapping_add(C * kb) as *const i8;
            for b in 0..kb {
                for c in 0..C {
                    let block = next.wrapping_add((c * kb + b) * std::mem::size_of::<B>());
                    for line in (0..std::mem::size_of::<B>()).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T0>(block.wrapping_add(line));
                    }
                }
                let mut rows = [acts.get_unchecked(b); T];
                for (r, row) in rows.iter_mut().enumerate().skip(1) {
                    *row = acts.get_unchecked(r * kb + b);
                }
                let mut blocks = [w.get_unchecked(b); C];
                for (c, block) in blocks.iter_mut().enumerate().skip(1) {
                    *block = w.get_unchecked(c * kb + b);
                }
                B::accumulate_avx2::<C, T, $dot>(&blocks, &rows, &mut acc, &mut offsets);
            }
            for c in 0..C {
                for r in 0..T {
                    sums[c * T + r] = hsum(acc[c][r]) + offsets[c][r];
                }
            }
        }
    };
}

tile_kernels!(dot_tile, dot_block, "avx2,fma,f16c", Avx2Dot);
tile_kernels!(
    dot_tile_avxvnni,
    dot_block_avxvnni,
    "avx2,fma,f16c,avxvnni",
    AvxVnniDot
);
tile_kernels!(
    dot_tile_vnni,
    dot_block_vnni,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    Avx512VnniDot
);
