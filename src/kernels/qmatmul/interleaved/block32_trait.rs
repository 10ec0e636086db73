//! What the kernels of the 32-value interleaved formats (Q4_0, Q4_1, Q5_0, Q8_0; `block32.rs`)
//! ask of a format ([`SimpleX8`]), and the float step every one of them ends a block with
//! ([`add_block`]). A leaf: the 256-bit tiles, the 512-bit one-row kernel (`avx512_row.rs`) and the
//! AMX tiles (`amx_tiles.rs`) read it, and the formats implement it.

use half::f16;

use super::ROWS;
#[cfg(target_arch = "x86_64")]
use crate::kernels::qmatmul::ByteDot;
use crate::kernels::qmatmul::{ActBlock, SimpleBlock, WeightBlock};

/// A 32-value format interleaved: its packing and the integer part of its dot products.
pub trait SimpleX8: Copy + Send + Sync + 'static {
    type Source: SimpleBlock + WeightBlock<Act = ActBlock>;
    fn interleave(rows: [&Self::Source; ROWS]) -> Self;
    /// Row `i`'s block back, as ggml stores it.
    fn row(&self, i: usize) -> Self::Source;
    /// The eight rows' scales.
    fn d(&self) -> &[f16; ROWS];
    /// The eight rows' offsets, for the formats that have one (multiplied with the activation
    /// block's `s`, as ggml does).
    fn m(&self) -> Option<&[f16; ROWS]> {
        None
    }
    /// Whether the stored values are signed bytes (Q8_0); else unsigned, `OFFSET` above the
    /// values they stand for.
    const SIGNED: bool = false;
    /// What the unsigned stored values add to the true ones (Q4_0 8, Q5_0 16): a dot product
    /// of stored values loses `OFFSET` times the activation block's `sum`.
    const OFFSET: i32 = 0;
    /// Whether the 512-bit one-row kernel also requests each line into the second-level cache
    /// from `avx512_row::L2_AHEAD` bytes ahead. Not for Q8_0: with it, the 0.5B's Q8_0 LM head
    /// streamed at 32.1–33.1 GB/s at batch 1, without it at 35.3–36.7 (three alternated runs;
    /// the model 84–85 against 86–89 % of the roofline).
    const ROW_L2: bool = true;
    /// As [`Interleaved::AMX_MIN_ROWS`](super::Interleaved::AMX_MIN_ROWS).
    const AMX_MIN_ROWS: usize = 8;
    /// `Σ value · qs` for each activation row and weight row (a 32-bit lane per weight row),
    /// the values with their signed offsets applied, multiplying bytes as `D` does.
    ///
    /// # Safety
    /// The CPU must support AVX2 and `D`'s instructions.
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_i32<const T: usize, D: ByteDot>(
        &self,
        acts: &[&ActBlock; T],
    ) -> [std::arch::x86_64::__m256i; T];
    /// Whether products of many rows take the tall tiles (`interleaved::tall`), which read
    /// the values unpacked once per slice ([`values_avx2`](Self::values_avx2)). Not the 4-bit
    /// formats: their nibbles cost two instructions per 64 values, and their tall tiles
    /// multiplied 3–6 % slower with 16 rows and 1–4 % faster with 64 and 512 (Q4_0 and Q4_1,
    /// 1536 × 576 and 576 × 576, one thread, alternated in one process; SmolLM2's decode
    /// batches of 16 slower). Nor the signed Q8_0, whose values need no unpacking.
    const TALL: bool = false;
    /// The products AVX2's 16-bit sums of the tall tiles add before widening: eight for the
    /// 4-bit formats (at most 8 · 2 · 15 · 127 = 30 480), four for Q5_0 (31 496).
    const SUMS16: usize = 8;
    /// The block's values for the tall tiles, as `dot_i32` multiplies them: register `g`
    /// holds values `4g..4g + 4` of the eight rows, unsigned, `OFFSET` above the true values.
    ///
    /// # Safety
    /// The CPU must support AVX2; `TALL` is true.
    #[cfg(target_arch = "x86_64")]
    unsafe fn values_avx2(&self) -> [std::arch::x86_64::__m256i; 8] {
        unreachable!("the format has no tall tiles")
    }
    /// The AMX weight tile of one block of two groups, `pair[0]`'s eight rows then
    /// `pair[1]`'s: row `g` holds values `4g..4g + 4` of each of the 16 weight rows, as
    /// stored (see `SIGNED` and `OFFSET`).
    ///
    /// # Safety
    /// The CPU must support AVX-512 (F, BW).
    #[cfg(target_arch = "x86_64")]
    unsafe fn amx_rows(pair: [&Self; 2]) -> [std::arch::x86_64::__m512i; 8];
    /// The block's values for the 512-bit one-row kernel (`interleaved::avx512_row`), unsigned: register `s`
    /// holds values `8s..8s + 4` of the eight rows in lanes 0–7 and `8s + 4..8s + 8` in
    /// lanes 8–15, `OFFSET` above the true values (128 for the signed Q8_0).
    ///
    /// # Safety
    /// The CPU must support AVX-512 (F, BW, VL).
    #[cfg(target_arch = "x86_64")]
    unsafe fn zmm_values(&self) -> [std::arch::x86_64::__m512i; 4];
}

/// One block's float step for `T` activation rows, the same in every 256-bit tile and the
/// 512-bit one-row kernel (the AMX tiles repeat it in 16 lanes): `acc[r] +=
/// d · a.d · dots[r]` (plus `m · a.s` for the formats with an offset) in the eight lanes.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn add_block<S: SimpleX8, const T: usize>(
    block: &S,
    rows: &[&ActBlock; T],
    dots: [std::arch::x86_64::__m256i; T],
    acc: &mut [std::arch::x86_64::__m256; T],
) {
    use std::arch::x86_64::*;
    let d = _mm256_cvtph_ps(_mm_loadu_si128(block.d().as_ptr() as *const __m128i));
    for r in 0..T {
        let scale = _mm256_mul_ps(d, _mm256_set1_ps(rows[r].d));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), scale, acc[r]);
    }
    if let Some(m) = block.m() {
        let m = _mm256_cvtph_ps(_mm_loadu_si128(m.as_ptr() as *const __m128i));
        for r in 0..T {
            acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(rows[r].s), acc[r]);
        }
    }
}
