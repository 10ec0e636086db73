//! Q6_K, eight rows interleaved: the 6-bit values (0..63, the -32 applied once per super-block
//! through the activations' 16-value sums) multiply four activations at a time; two such
//! products add up in 16-bit lanes (at most 2 · 2 · 63 · 127 = 32 004, exact) before one `madd`
//! applies the eight rows' 16-value scales: 1½ multiplies per 32 multiply-adds against the
//! row-major kernel's 2.
//!
//! Memory: 1696 bytes per eight rows' super-block against ggml's 8 × 210 (+1 %: padding to
//! 32-byte alignment).

use half::f16;

use super::{Interleaved, ROWS};
use crate::kernels::qmatmul::{ActBlockK, BlockQ6K};

/// Super-block `b` of eight Q6_K weight rows.
#[repr(C, align(32))]
#[derive(Clone, Copy)]
pub struct BlockQ6Kx8 {
    /// `ql[(((2n + h) · 8 + g) · 8 + i) · 4 + k]` is byte `64n + 32h + 4g + k` of row `i`'s
    /// `ql`: low bits of value `4g + k` of sub-block `4n + h` (low nibble) and `4n + h + 2`
    /// (high nibble).
    ql: [u8; 1024],
    /// `qh[((8n + g) · 8 + i) · 4 + k]` is byte `32n + 4g + k` of row `i`'s `qh`: bits `2k'..`
    /// hold the high two bits of value `4g + k` of sub-block `4n + k'`.
    qh: [u8; 512],
    /// `scales[8s + i]`: the scale of values `16s..16s + 16` of row `i`.
    scales: [i8; 128],
    d: [f16; ROWS],
}

impl BlockQ6Kx8 {
    /// The 6-bit value `l` of sub-block `sub` of row `i` (0..63, before the -32).
    fn value(&self, i: usize, sub: usize, l: usize) -> i32 {
        let (n, k, g) = (sub / 4, sub % 4, l / 4);
        let lo = self.ql[(((2 * n + k % 2) * 8 + g) * ROWS + i) * 4 + l % 4] >> (4 * (k / 2));
        let hi = self.qh[((8 * n + g) * ROWS + i) * 4 + l % 4] >> (2 * k);
        ((lo & 0x0F) | ((hi & 3) << 4)) as i32
    }
}

impl Interleaved for BlockQ6Kx8 {
    type Source = BlockQ6K;
    const TILE_ROWS: usize = 8;

    fn pack(rows: [&BlockQ6K; ROWS]) -> Self {
        let mut out = Self {
            ql: [0; 1024],
            qh: [0; 512],
            scales: [0; 128],
            d: [f16::ZERO; ROWS],
        };
        for (i, block) in rows.iter().enumerate() {
            for (at, &byte) in block.ql.iter().enumerate() {
                let (nh, g, k) = (at / 32, at % 32 / 4, at % 4);
                out.ql[((nh * 8 + g) * ROWS + i) * 4 + k] = byte;
            }
            for (at, &byte) in block.qh.iter().enumerate() {
                let (n, g, k) = (at / 32, at % 32 / 4, at % 4);
                out.qh[((8 * n + g) * ROWS + i) * 4 + k] = byte;
            }
            for (s, &scale) in block.scales.iter().enumerate() {
                out.scales[8 * s + i] = scale;
            }
            out.d[i] = block.d;
        }
        out
    }

    fn dot(&self, a: &ActBlockK) -> [f32; ROWS] {
        let mut out = [0f32; ROWS];
        for (i, o) in out.iter_mut().enumerate() {
            let mut sumi = 0i32;
            for sub in 0..8 {
                for l in 0..32 {
                    let scale = self.scales[8 * (2 * sub + l / 16) + i] as i32;
                    let x = a.qs[32 * sub + l] as i32;
                    sumi += scale * (self.value(i, sub, l) - 32) * x;
                }
            }
            *o = a.d * self.d[i].to_f32() * sumi as f32;
        }
        out
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn tile_avx2(w: &[Self], acts: &[ActBlockK], kb: usize, sums: &mut [[f32; ROWS]]) {
        use avx2::tile;
        dispatch_rows!(tile, w, acts, kb, sums, [8, 7, 6, 5, 4, 3, 2, 1])
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::super::{broadcast4, prefetch_ahead};
    use super::{ActBlockK, BlockQ6Kx8, ROWS};

    /// The values of sub-block `4n + k` for group `g` (four values of each row) as bytes.
    #[inline(always)]
    unsafe fn values(block: &BlockQ6Kx8, n: usize, k: usize, g: usize) -> __m256i {
        let m4 = _mm256_set1_epi8(0x0F);
        let lo = _mm256_load_si256(
            block.ql.as_ptr().add(((2 * n + k % 2) * 8 + g) * 32) as *const __m256i
        );
        let lo = if k < 2 { lo } else { _mm256_srli_epi16(lo, 4) };
        let hi = _mm256_load_si256(block.qh.as_ptr().add((8 * n + g) * 32) as *const __m256i);
        // Bits 2k..2k + 2 to bits 4..6 (16-bit shifts: the masked bits stay in their byte).
        let hi = match k {
            0 => _mm256_slli_epi16(hi, 4),
            1 => _mm256_slli_epi16(hi, 2),
            2 => hi,
            _ => _mm256_srli_epi16(hi, 2),
        };
        _mm256_or_si256(
            _mm256_and_si256(lo, m4),
            _mm256_and_si256(hi, _mm256_set1_epi8(0x30)),
        )
    }

    /// `T` activation rows × one group of eight weight rows.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `acts` holds `T · kb` blocks, `w` `kb`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile<const T: usize>(
        w: &[BlockQ6Kx8],
        acts: &[ActBlockK],
        kb: usize,
        sums: &mut [[f32; ROWS]],
    ) {
        debug_assert!(w.len() == kb && acts.len() == T * kb && sums.len() == T);
        // Each scale to the two 16-bit lanes of its row.
        let pairs = _mm_set_epi8(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        let mut acc = [_mm256_setzero_ps(); T];
        for b in 0..kb {
            let block = w.get_unchecked(b);
            prefetch_ahead(block);
            let rows: [&ActBlockK; T] = std::array::from_fn(|r| acts.get_unchecked(r * kb + b));
            let mut sumi = [_mm256_setzero_si256(); T];
            for sub in 0..8 {
                let (n, k) = (sub / 4, sub % 4);
                for half in 0..2 {
                    let s = 2 * sub + half;
                    let scale = _mm_loadl_epi64(block.scales.as_ptr().add(8 * s) as *const __m128i);
                    let scale = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scale, pairs));
                    for pair in 0..2 {
                        let g = 4 * half + 2 * pair;
                        let q0 = values(block, n, k, g);
                        let q1 = values(block, n, k, g + 1);
                        for r in 0..T {
                            let x = rows[r].qs.as_ptr().add(32 * sub + 4 * g) as *const u8;
                            let part = _mm256_add_epi16(
                                _mm256_maddubs_epi16(q0, broadcast4(x)),
                                _mm256_maddubs_epi16(q1, broadcast4(x.add(4))),
                            );
                            sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(part, scale));
                        }
                    }
                }
            }
            // The -32 of every value: Σ_s scale_s · 32 · bsum_s, two scales per `madd`.
            let scale_pairs: [__m256i; 8] = std::array::from_fn(|p| {
                let s = _mm_loadu_si128(block.scales.as_ptr().add(16 * p) as *const __m128i);
                _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s, _mm_srli_si128::<8>(s)))
            });
            let d = _mm256_cvtph_ps(_mm_load_si128(block.d.as_ptr() as *const __m128i));
            for r in 0..T {
                let a = rows[r];
                let mut offset = _mm256_setzero_si256();
                for (p, sp) in scale_pairs.iter().enumerate() {
                    let bsums = broadcast4(a.bsums.as_ptr().add(2 * p) as *const u8);
                    offset = _mm256_add_epi32(offset, _mm256_madd_epi16(*sp, bsums));
                }
                let total = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(offset, 5));
                let dv = _mm256_mul_ps(d, _mm256_set1_ps(a.d));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), dv, acc[r]);
            }
        }
        for (s, a) in sums.iter_mut().zip(acc) {
            _mm256_storeu_ps(s.as_mut_ptr(), a);
        }
    }
}
