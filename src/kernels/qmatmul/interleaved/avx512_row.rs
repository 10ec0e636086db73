//! One activation row on AVX-512 VNNI's 512-bit registers. A batch-1 decode reads every weight
//! once and does little arithmetic per byte, yet with the 256-bit tiles a core streams its
//! share of a matrix below its own read bandwidth: the more instructions a byte costs, the
//! fewer bytes ahead the out-of-order window reaches and the fewer misses it keeps in flight
//! (one row through the Q4_K 8960 × 1536 matrices at 81–84 % of a plain read, the Q6_K ones,
//! fewer values a byte, at 87–88 %).
//!
//! Here one register holds two consecutive 32-byte groups of an interleaved block: four values
//! of each of the eight weight rows in lanes 0–7 and the next four in lanes 8–15. One `vpermd`
//! from a register of activations gives each half its own four activations, and one
//! `vpdpbusd` multiplies 64 bytes, where the 256-bit tiles take two loads, two broadcasts and
//! two `vpdpbusd`. The two halves' integer sums are added before the float step, which is the
//! 256-bit tile's, so a row's product is the same bits as theirs (and as any batch's).

use std::arch::x86_64::*;

use super::block32_trait::{add_block, SimpleX8};
use super::{prefetch_at, ROWS};
use crate::kernels::qmatmul::ActBlock;

/// Bytes ahead of the block being multiplied that the one-row kernels request their weights
/// into the first-level cache (the 256-bit tiles use
/// [`Interleaved::PREFETCH_AHEAD`](super::Interleaved::PREFETCH_AHEAD)): 3 KB for every
/// format. With the 32-value formats' 1.5 KB (the better distance for the 256-bit tiles on a
/// Zen 3), the Intel Xeon these kernels were measured on decoded the 0.5B at batch 1 at 79–82 %
/// of the roofline and SmolLM2 at 92–96 %; at 3 KB 83–86 % and 102–106 % (three alternated
/// runs each).
pub(super) const AHEAD: usize = 3072;

/// Bytes ahead that the one-row kernels also request each line into the second-level cache
/// (`prefetcht1`), so more lines are on their way from memory than the first-level cache's
/// miss buffers hold: one row through Q4_K matrices from memory went from 84–88 % of a plain
/// read to 91–94 % (8960 × 1536 and 1536 × 8960) and from 75–78 to 82–86 % (2048 and 1536 ×
/// 1536), Q5_0 4864 × 896 from 80–83 to 84–86 %. 9 KB and 15 KB did as well on the large
/// shapes, 19 KB worse on the small ones; the second request alone, without the first, 79–90 %;
/// and added to the 256-bit Q4_K tile it made that one slower (76–79 → 67–72 %).
pub(super) const L2_AHEAD: usize = AHEAD + 8192;

/// Requests line `line` of a block (counted as `prefetch_line` counts) into the first-level
/// cache from [`AHEAD`] bytes ahead and into the second-level cache from [`L2_AHEAD`].
#[inline(always)]
pub(super) unsafe fn prefetch_row_line<P>(block: &P, line: usize) {
    prefetch_at::<_MM_HINT_T0, P>(block, AHEAD, line);
    prefetch_at::<_MM_HINT_T1, P>(block, L2_AHEAD, line);
}

/// `low` in lanes 0–7, `high` in lanes 8–15.
#[inline(always)]
pub(super) unsafe fn per_half(low: i32, high: i32) -> __m512i {
    let low = _mm512_castsi256_si512(_mm256_set1_epi32(low));
    _mm512_inserti64x4::<1>(low, _mm256_set1_epi32(high))
}

/// The `vpermd` indices giving lanes 0–7 the 32-bit word `first` of a register and lanes
/// 8–15 the word `first + 1`: the activations of two consecutive groups of four values.
#[inline(always)]
pub(super) unsafe fn word_pair(first: i32) -> __m512i {
    per_half(first, first + 1)
}

/// Lanes `i` and `8 + i` added: the eight weight rows' sums.
#[inline(always)]
pub(super) unsafe fn fold(x: __m512i) -> __m256i {
    _mm256_add_epi32(_mm512_castsi512_si256(x), _mm512_extracti64x4_epi64::<1>(x))
}

/// The 32-value formats: per block, the values of [`SimpleX8::zmm_values`] multiply the
/// activations in four `vpdpbusd`, then the 256-bit tile's float step.
///
/// # Safety
/// The CPU must support AVX-512 (F, BW, VL) and AVX-512 VNNI; `w` and `acts` hold `kb` blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn simple_row<S: SimpleX8>(
    w: &[S],
    acts: &[ActBlock],
    kb: usize,
    sums: &mut [f32; ROWS],
) {
    debug_assert!(w.len() == kb && acts.len() == kb);
    let pairs: [__m512i; 4] = std::array::from_fn(|s| word_pair(2 * s as i32));
    // The values multiplied are unsigned, `offset` above the true ones.
    let offset = if S::SIGNED { 128 } else { S::OFFSET };
    let lines = std::mem::size_of::<S>().div_ceil(64);
    let mut acc = [_mm256_setzero_ps()];
    for b in 0..kb {
        let block = w.get_unchecked(b);
        for line in 0..lines {
            if S::ROW_L2 {
                prefetch_row_line(block, line);
            } else {
                prefetch_at::<_MM_HINT_T0, S>(block, AHEAD, line);
            }
        }
        let a = acts.get_unchecked(b);
        // Words 0..8 only: `vpermd` reads no others.
        let x = _mm512_castsi256_si512(_mm256_load_si256(a.qs.as_ptr() as *const __m256i));
        let values = block.zmm_values();
        // Two sums, so `vpdpbusd`'s latency overlaps.
        let mut part = [_mm512_setzero_si512(); 2];
        for (s, (v, pair)) in values.iter().zip(&pairs).enumerate() {
            let x = _mm512_permutexvar_epi32(*pair, x);
            part[s % 2] = _mm512_dpbusd_epi32(part[s % 2], *v, x);
        }
        let dot = fold(_mm512_add_epi32(part[0], part[1]));
        let dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(offset * a.sum));
        add_block(block, &[a], [dot], &mut acc);
    }
    _mm256_storeu_ps(sums.as_mut_ptr(), acc[0]);
}

/// The 4-bit formats' values as [`SimpleX8::zmm_values`] takes them: the low nibbles of
/// groups 0–3 (values `0..16`), then the high ones (`16..32`).
#[inline(always)]
pub(super) unsafe fn nibble_values(qs: &[u8; 128]) -> [__m512i; 4] {
    let m4 = _mm512_set1_epi8(0x0F);
    let raw = [0, 64].map(|at| _mm512_loadu_si512(qs.as_ptr().add(at) as *const _));
    let low = raw.map(|r| _mm512_and_si512(r, m4));
    let high = raw.map(|r| _mm512_and_si512(_mm512_srli_epi16::<4>(r), m4));
    [low[0], low[1], high[0], high[1]]
}
