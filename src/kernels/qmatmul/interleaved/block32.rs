//! The 32-value formats (Q4_0, Q4_1, Q5_0, Q8_0), eight rows interleaved: a register holds
//! four values of each of the eight rows, so one `maddubs` with four activations broadcast to
//! every lane serves eight rows, products add up in 16-bit lanes (eight per `madd` for the
//! 4-bit formats, at most 8 · 2 · 15 · 127 = 30 480; four for Q5_0, 4 · 2 · 31 · 127 = 31 496;
//! one for Q8_0, whose signed values take the sign trick) and each block ends with one float
//! multiply-add per activation row for all eight rows. The row-major kernels unpack a block
//! per row, pay a `madd` per `maddubs` and end every dot product with a horizontal sum.
//!
//! The 4-bit formats' values are unsigned here (Q4_0's -8 and Q5_0's -16 come back through
//! the activation block's exact integer sum). Memory: exactly ggml's, eight blocks' bytes
//! rearranged (144, 160, 176 and 272 bytes per eight rows' block).

use half::f16;

#[cfg(target_arch = "x86_64")]
use super::block32_trait::add_block;
use super::block32_trait::SimpleX8;
use super::{Interleaved, ROWS};
#[cfg(target_arch = "x86_64")]
use crate::kernels::qmatmul::ByteDot;
use crate::kernels::qmatmul::{
    ActBlock, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ8_0, SimpleBlock, WeightBlock, QK,
};

/// Index of byte `4g + k` of row `i` in an interleaved array: 32-byte group `g`, lane `i`.
fn at(g: usize, i: usize, k: usize) -> usize {
    (g * ROWS + i) * 4 + k
}

/// Eight rows' 16 bytes of nibbles interleaved: group `g < 4` holds bytes `4g..4g + 4` of
/// every row, whose low nibbles are values `4g + k` and high nibbles values `16 + 4g + k`.
fn interleave_nibbles(rows: [&[u8; 16]; ROWS]) -> [u8; 128] {
    let mut out = [0u8; 128];
    for (i, qs) in rows.iter().enumerate() {
        for (j, &byte) in qs.iter().enumerate() {
            out[at(j / 4, i, j % 4)] = byte;
        }
    }
    out
}

/// Row `i`'s 16 bytes of nibbles back.
fn row_nibbles(qs: &[u8; 128], i: usize) -> [u8; 16] {
    std::array::from_fn(|j| qs[at(j / 4, i, j % 4)])
}

impl<S: SimpleX8> Interleaved for S {
    type Source = S::Source;
    const TILE_ROWS: usize = 4;
    /// Five to eleven blocks: at 3 KB SmolLM2's Q4_1 matmuls streamed on two threads at 64–94 %
    /// of a plain read, at 1.5 KB at 76–96 % (its decode 1.5–3 % faster, the 0.5B's unchanged).
    const PREFETCH_AHEAD: usize = 1536;

    fn pack(rows: [&S::Source; ROWS]) -> Self {
        S::interleave(rows)
    }

    fn dot(&self, a: &ActBlock) -> [f32; ROWS] {
        std::array::from_fn(|i| self.row(i).dot(a))
    }

    fn dequantize(&self, i: usize, out: &mut [f32]) {
        let block = self.row(i);
        let d = f16::from_bits(block.d_bits()).to_f32();
        let m = f16::from_bits(block.m_bits()).to_f32();
        for (o, v) in out.iter_mut().zip(block.values()) {
            *o = if S::Source::UNSIGNED {
                v as f32 * d + m
            } else {
                v as f32 * d
            };
        }
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn tile_simd(
        isa: crate::kernels::qmatmul::Isa,
        w: &[Self],
        acts: &[ActBlock],
        kb: usize,
        sums: &mut [[f32; ROWS]],
    ) {
        use avx2::tile;
        dispatch_rows!(tile<S>, (isa, w, acts, kb), sums, [4, 3, 2, 1])
    }

    const ROW_ZMM: bool = true;

    #[cfg(target_arch = "x86_64")]
    unsafe fn row_zmm(w: &[Self], acts: &[ActBlock], kb: usize, sums: &mut [f32; ROWS]) {
        super::avx512_row::simple_row(w, acts, kb, sums)
    }

    const TALL_BYTES: usize = if S::TALL { 8 * 32 } else { 0 };

    #[cfg(target_arch = "x86_64")]
    unsafe fn unpack_tall(w: &[Self], out: &mut [u8]) {
        super::tall::simple::unpack(w, out)
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn tall_tile(
        isa: crate::kernels::qmatmul::Isa,
        values: &[u8],
        w: &[Self],
        acts: &[ActBlock],
        kb: usize,
        sums: &mut [[f32; ROWS]],
    ) {
        use super::tall::simple::tile;
        dispatch_rows!(tile<S>, (isa, values, w, acts, kb), sums, [4, 3, 2, 1])
    }

    pair_tiles!(ZMM_PAIR, zmm_pair, super::amx_tiles::zmm_pair_tile);

    const AMX_MIN_ROWS: usize = S::AMX_MIN_ROWS;
    pair_tiles!(AMX, amx_pair, super::amx_tiles::pair_tile);
}

/// Eight Q4_0 blocks: values `0..15`, less 8.
#[repr(C, align(16))]
#[derive(Clone, Copy)]
pub struct BlockQ4_0x8 {
    qs: [u8; 128],
    d: [f16; ROWS],
}

/// Eight Q4_1 blocks: values `0..15`, plus an offset.
#[repr(C, align(16))]
#[derive(Clone, Copy)]
pub struct BlockQ4_1x8 {
    qs: [u8; 128],
    d: [f16; ROWS],
    m: [f16; ROWS],
}

/// Eight Q5_0 blocks: values `0..31`, less 16.
#[repr(C, align(16))]
#[derive(Clone, Copy)]
pub struct BlockQ5_0x8 {
    /// The low four bits, as [`interleave_nibbles`].
    qs: [u8; 128],
    /// `qh[4i + k]`, bit `g`: the fifth bit of value `4g + k` of row `i` (the bit every value
    /// vector needs sits in the byte of its lane).
    qh: [u8; 32],
    d: [f16; ROWS],
}

/// Eight Q8_0 blocks: signed values.
#[repr(C, align(16))]
#[derive(Clone, Copy)]
pub struct BlockQ8_0x8 {
    /// `qs[at(g, i, k)]`: value `4g + k` of row `i`.
    qs: [i8; 256],
    d: [f16; ROWS],
}

impl SimpleX8 for BlockQ4_0x8 {
    type Source = BlockQ4_0;

    fn interleave(rows: [&BlockQ4_0; ROWS]) -> Self {
        Self {
            qs: interleave_nibbles(rows.map(|r| &r.qs)),
            d: rows.map(|r| r.d),
        }
    }

    fn row(&self, i: usize) -> BlockQ4_0 {
        BlockQ4_0 {
            d: self.d[i],
            qs: row_nibbles(&self.qs, i),
        }
    }

    fn d(&self) -> &[f16; ROWS] {
        &self.d
    }

    const OFFSET: i32 = 8;

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot_i32<const T: usize, D: ByteDot>(
        &self,
        acts: &[&ActBlock; T],
    ) -> [std::arch::x86_64::__m256i; T] {
        use std::arch::x86_64::*;
        let sums = avx2::nibble_dots::<T, D>(&self.qs, acts);
        std::array::from_fn(|r| {
            _mm256_sub_epi32(sums[r], _mm256_set1_epi32(Self::OFFSET * acts[r].sum))
        })
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn amx_rows(pair: [&Self; 2]) -> [std::arch::x86_64::__m512i; 8] {
        super::amx_tiles::nibble_rows(pair.map(|b| &b.qs))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn zmm_values(&self) -> [std::arch::x86_64::__m512i; 4] {
        super::avx512_row::nibble_values(&self.qs)
    }
}

impl SimpleX8 for BlockQ4_1x8 {
    type Source = BlockQ4_1;

    fn interleave(rows: [&BlockQ4_1; ROWS]) -> Self {
        Self {
            qs: interleave_nibbles(rows.map(|r| &r.qs)),
            d: rows.map(|r| r.d),
            m: rows.map(|r| r.m),
        }
    }

    fn row(&self, i: usize) -> BlockQ4_1 {
        BlockQ4_1 {
            d: self.d[i],
            m: self.m[i],
            qs: row_nibbles(&self.qs, i),
        }
    }

    fn d(&self) -> &[f16; ROWS] {
        &self.d
    }

    fn m(&self) -> Option<&[f16; ROWS]> {
        Some(&self.m)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot_i32<const T: usize, D: ByteDot>(
        &self,
        acts: &[&ActBlock; T],
    ) -> [std::arch::x86_64::__m256i; T] {
        avx2::nibble_dots::<T, D>(&self.qs, acts)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn amx_rows(pair: [&Self; 2]) -> [std::arch::x86_64::__m512i; 8] {
        super::amx_tiles::nibble_rows(pair.map(|b| &b.qs))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn zmm_values(&self) -> [std::arch::x86_64::__m512i; 4] {
        super::avx512_row::nibble_values(&self.qs)
    }
}

impl SimpleX8 for BlockQ5_0x8 {
    type Source = BlockQ5_0;

    fn interleave(rows: [&BlockQ5_0; ROWS]) -> Self {
        let mut qh = [0u8; 32];
        for (i, r) in rows.iter().enumerate() {
            let bits = u32::from_le_bytes(r.qh);
            for j in 0..QK {
                qh[4 * i + j % 4] |= (((bits >> j) & 1) as u8) << (j / 4);
            }
        }
        Self {
            qs: interleave_nibbles(rows.map(|r| &r.qs)),
            qh,
            d: rows.map(|r| r.d),
        }
    }

    fn row(&self, i: usize) -> BlockQ5_0 {
        let bits = (0..QK).fold(0u32, |acc, j| {
            acc | ((((self.qh[4 * i + j % 4] >> (j / 4)) & 1) as u32) << j)
        });
        BlockQ5_0 {
            d: self.d[i],
            qh: bits.to_le_bytes(),
            qs: row_nibbles(&self.qs, i),
        }
    }

    fn d(&self) -> &[f16; ROWS] {
        &self.d
    }

    const OFFSET: i32 = 16;
    /// From 4 rows. From 6 (against 8), the 0.5B (mostly Q5_0) decoded batches of 6 at 274–278
    /// tok/s and of 7 at 302–311, at 259–261 and 278–285 from 8 (three alternated rounds). Once
    /// decode batches' AMX tiles requested their weights into L2 (`amx::prefetch_pair`), from 4
    /// (against 6) batches of 5 ran at 277–298 % of the batch-1 roofline against 242–267, of 4
    /// at 243–249 against 230–243 (four alternated rounds, Q4_K from 4 or 5). Q4_1 from 6 was no
    /// faster for SmolLM2.
    const AMX_MIN_ROWS: usize = 4;

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn amx_rows(pair: [&Self; 2]) -> [std::arch::x86_64::__m512i; 8] {
        use std::arch::x86_64::*;
        let mut rows = super::amx_tiles::nibble_rows(pair.map(|b| &b.qs));
        // Bit `g` of each lane's `qh` byte is the fifth bit of row `g`'s byte in that lane.
        let qh = super::amx_tiles::join(pair[0].qh.as_ptr(), pair[1].qh.as_ptr());
        let sixteen = _mm512_set1_epi8(16);
        for (g, row) in rows.iter_mut().enumerate() {
            let set = _mm512_test_epi8_mask(qh, _mm512_set1_epi8((1u8 << g) as i8));
            *row = _mm512_mask_add_epi8(*row, set, *row, sixteen);
        }
        rows
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn zmm_values(&self) -> [std::arch::x86_64::__m512i; 4] {
        use std::arch::x86_64::*;
        let mut values = super::avx512_row::nibble_values(&self.qs);
        // Bit `g` of each lane's `qh` byte is the fifth bit of the value of group `g` in that
        // lane: a 32-bit rotation left by `4 - g` (mod 32) moves it to bit 4 of the same byte
        // in every byte of the lane at once.
        let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(self.qh.as_ptr() as *const __m256i));
        let bit4 = _mm512_set1_epi8(0x10);
        for (s, v) in values.iter_mut().enumerate() {
            let g = 2 * s as i32;
            let fifth =
                _mm512_rolv_epi32(qh, super::avx512_row::per_half((4 - g) & 31, (3 - g) & 31));
            // v | (fifth & bit4)
            *v = _mm512_ternarylogic_epi32::<0xF8>(*v, fifth, bit4);
        }
        values
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot_i32<const T: usize, D: ByteDot>(
        &self,
        acts: &[&ActBlock; T],
    ) -> [std::arch::x86_64::__m256i; T] {
        use avx2::{dp16, widen};
        use std::arch::x86_64::*;
        let qh = _mm256_loadu_si256(self.qh.as_ptr() as *const __m256i);
        // Values 0..15 of each block in one sum, 16..31 in the other: four products each.
        let mut lo = [_mm256_setzero_si256(); T];
        let mut hi = [_mm256_setzero_si256(); T];
        for g in 0..4 {
            let (q_lo, q_hi) = self.values_of(qh, g);
            for r in 0..T {
                let x = acts[r].qs.as_ptr() as *const u8;
                lo[r] = dp16::<D>(lo[r], q_lo, avx2::bcast(x, g));
                hi[r] = dp16::<D>(hi[r], q_hi, avx2::bcast(x, g + 4));
            }
        }
        std::array::from_fn(|r| {
            let sum = _mm256_add_epi32(widen::<D>(lo[r]), widen::<D>(hi[r]));
            _mm256_sub_epi32(sum, _mm256_set1_epi32(Self::OFFSET * acts[r].sum))
        })
    }

    /// Q5_0's fifth bits cost nine instructions per 64 values to unpack, about a quarter of
    /// a 256-bit tile's: its tall tiles multiplied 1.5–1.6 times as fast with 16, 64 and 512
    /// rows (4864 × 896 and 896 × 896, one thread, alternated in one process), and the 0.5B
    /// (gate, up, q/k/v and o in Q5_0) prefilled 512 tokens 1.39–1.41 times as fast (two
    /// alternated rounds).
    const TALL: bool = true;
    const SUMS16: usize = 4;

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn values_avx2(&self) -> [std::arch::x86_64::__m256i; 8] {
        use std::arch::x86_64::*;
        let qh = _mm256_loadu_si256(self.qh.as_ptr() as *const __m256i);
        let mut values = [_mm256_setzero_si256(); 8];
        for g in 0..4 {
            (values[g], values[g + 4]) = self.values_of(qh, g);
        }
        values
    }
}

impl BlockQ5_0x8 {
    /// Values `4g..4g + 4` and `16 + 4g..16 + 4g + 4` of the eight rows (`g < 4`), five bits
    /// each, the fifth from `qh` (the block's `qh` loaded).
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn values_of(
        &self,
        qh: std::arch::x86_64::__m256i,
        g: usize,
    ) -> (std::arch::x86_64::__m256i, std::arch::x86_64::__m256i) {
        use std::arch::x86_64::*;
        let m4 = _mm256_set1_epi8(0x0F);
        let bit4 = _mm256_set1_epi8(0x10);
        // Bit `g` of every byte to bit 4 (16-bit shifts: the masked bit stays in its byte).
        let fifth = |g: usize| {
            let moved = match g {
                0 => _mm256_slli_epi16::<4>(qh),
                1 => _mm256_slli_epi16::<3>(qh),
                2 => _mm256_slli_epi16::<2>(qh),
                3 => _mm256_slli_epi16::<1>(qh),
                4 => qh,
                5 => _mm256_srli_epi16::<1>(qh),
                6 => _mm256_srli_epi16::<2>(qh),
                _ => _mm256_srli_epi16::<3>(qh),
            };
            _mm256_and_si256(moved, bit4)
        };
        let raw = _mm256_loadu_si256(self.qs.as_ptr().add(32 * g) as *const __m256i);
        let lo = _mm256_or_si256(_mm256_and_si256(raw, m4), fifth(g));
        let hi = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4),
            fifth(g + 4),
        );
        (lo, hi)
    }
}

impl SimpleX8 for BlockQ8_0x8 {
    type Source = BlockQ8_0;

    fn interleave(rows: [&BlockQ8_0; ROWS]) -> Self {
        let mut qs = [0i8; 256];
        for (i, r) in rows.iter().enumerate() {
            for (j, &q) in r.qs.iter().enumerate() {
                qs[at(j / 4, i, j % 4)] = q;
            }
        }
        Self {
            qs,
            d: rows.map(|r| r.d),
        }
    }

    fn row(&self, i: usize) -> BlockQ8_0 {
        BlockQ8_0 {
            d: self.d[i],
            qs: std::array::from_fn(|j| self.qs[at(j / 4, i, j % 4)]),
        }
    }

    fn d(&self) -> &[f16; ROWS] {
        &self.d
    }

    const SIGNED: bool = true;
    const ROW_L2: bool = false;
    /// Q8_0 copies its bytes into the tiles without unpacking, so its tiles pay from 4 rows
    /// (1.9 times the VNNI tiles' speed for one 896 × 896 matrix in cache): the 0.5B, whose LM
    /// head is Q8_0, decoded batches of 6 at 237–238 tok/s with the tiles from 8 rows and at
    /// 256–260 from 2 or 4, batches of 4 at 212–214 from 8 and 216–218 from 2 (alternated
    /// rounds); from 2 rows, batches of 2 were 1.5 % slower.
    const AMX_MIN_ROWS: usize = 4;

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn amx_rows(pair: [&Self; 2]) -> [std::arch::x86_64::__m512i; 8] {
        let at = |b: &Self, g: usize| b.qs.as_ptr().add(32 * g) as *const u8;
        std::array::from_fn(|g| super::amx_tiles::join(at(pair[0], g), at(pair[1], g)))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn zmm_values(&self) -> [std::arch::x86_64::__m512i; 4] {
        use std::arch::x86_64::*;
        std::array::from_fn(|s| {
            // Two 32-byte halves: the 272-byte blocks put most 64-byte loads across two
            // lines (one row through 4864 × 896 and 151936 × 896 matrices streamed at 84 and
            // 88 % of a plain read that way, 85 and 88–90 % in halves).
            let at = self.qs.as_ptr().add(64 * s) as *const u8;
            let q = super::amx_tiles::join(at, at.add(32));
            _mm512_xor_si512(q, _mm512_set1_epi8(i8::MIN))
        })
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot_i32<const T: usize, D: ByteDot>(
        &self,
        acts: &[&ActBlock; T],
    ) -> [std::arch::x86_64::__m256i; T] {
        use avx2::dp32;
        use std::arch::x86_64::*;
        // As Q4_K's: two sums with VNNI, one with AVX2.
        let mut sums = [[_mm256_setzero_si256(); T]; 2];
        for g in 0..8 {
            let q = _mm256_loadu_si256(self.qs.as_ptr().add(32 * g) as *const __m256i);
            // |q| · (x with q's sign): unsigned × signed, as `maddubs` and `vpdpbusd` take
            // them (an AVX2 pair at most 2 · 128 · 127, so each step widens).
            let abs = _mm256_sign_epi8(q, q);
            for r in 0..T {
                let x = avx2::bcast(acts[r].qs.as_ptr() as *const u8, g);
                let k = if D::VNNI { g % 2 } else { 0 };
                sums[k][r] = dp32::<D>(sums[k][r], abs, _mm256_sign_epi8(x, q));
            }
        }
        std::array::from_fn(|r| _mm256_add_epi32(sums[0][r], sums[1][r]))
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::super::{broadcast4, tile_prefetch_line};
    use super::{ActBlock, ByteDot, SimpleX8, ROWS};
    pub(super) use crate::kernels::qmatmul::avx2::{add16, dp16, dp32, widen};

    /// Activations `4g..4g + 4` of a block broadcast to every lane.
    #[inline(always)]
    pub(super) unsafe fn bcast(x: *const u8, g: usize) -> __m256i {
        broadcast4(x.add(4 * g))
    }

    /// `Σ q · x` for the unsigned nibbles of the 4-bit formats: all eight products of a block
    /// in 16-bit lanes, one `madd` per activation row.
    #[inline(always)]
    pub(super) unsafe fn nibble_dots<const T: usize, D: ByteDot>(
        qs: &[u8; 128],
        acts: &[&ActBlock; T],
    ) -> [__m256i; T] {
        let m4 = _mm256_set1_epi8(0x0F);
        // As Q4_K's: two sums with VNNI, one with AVX2.
        let mut part = [[_mm256_setzero_si256(); T]; 2];
        let k = if D::VNNI { 1 } else { 0 };
        for g in 0..4 {
            let raw = _mm256_loadu_si256(qs.as_ptr().add(32 * g) as *const __m256i);
            let lo = _mm256_and_si256(raw, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4);
            for r in 0..T {
                let x = acts[r].qs.as_ptr() as *const u8;
                part[0][r] = dp16::<D>(part[0][r], lo, bcast(x, g));
                part[k][r] = dp16::<D>(part[k][r], hi, bcast(x, g + 4));
            }
        }
        std::array::from_fn(|r| widen::<D>(add16::<D>(part[0][r], part[1][r])))
    }

    simd_tiles!(tile_body, [S: SimpleX8], S, ActBlock);

    /// The tile: each block's integer dot products, then one float multiply-add (two for
    /// the formats with an offset) per activation row for all eight rows.
    #[inline(always)]
    unsafe fn tile_body<S: SimpleX8, const T: usize, D: ByteDot>(
        w: &[S],
        acts: &[ActBlock],
        kb: usize,
        sums: &mut [[f32; ROWS]],
    ) {
        debug_assert!(w.len() == kb && acts.len() == T * kb && sums.len() == T);
        let lines = std::mem::size_of::<S>().div_ceil(64);
        let mut acc = [_mm256_setzero_ps(); T];
        for b in 0..kb {
            let block = w.get_unchecked(b);
            for line in 0..lines {
                tile_prefetch_line::<S, D>(block, line, T);
            }
            let rows: [&ActBlock; T] = std::array::from_fn(|r| acts.get_unchecked(r * kb + b));
            super::add_block(block, &rows, block.dot_i32::<T, D>(&rows), &mut acc);
        }
        for (s, a) in sums.iter_mut().zip(acc) {
            _mm256_storeu_ps(s.as_mut_ptr(), a);
        }
    }
}
