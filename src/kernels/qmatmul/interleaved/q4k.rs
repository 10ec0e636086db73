//! Q4_K, eight rows interleaved: a sub-block's eight `maddubs` products add up in 16-bit lanes
//! (at most 16 · 15 · 127 = 30 480, exact) before one `madd` applies the scales: 1⅛
//! multiplies per 32 multiply-adds against the row-major kernel's 2.
//!
//! Memory: 1184 bytes per eight rows' super-block against ggml's 8 × 144 (+2.8 %), with the
//! scales and mins unpacked to bytes.

use half::f16;

use super::{Interleaved, ROWS};
use crate::kernels::qmatmul::{ActBlockK, BlockQ4K};

/// Super-block `b` of eight Q4_K weight rows.
#[repr(C, align(32))]
#[derive(Clone, Copy)]
pub struct BlockQ4Kx8 {
    /// `qs[((p · 8 + g) · 8 + i) · 4 + k]` is byte `32p + 4g + k` of row `i`'s `qs`: the low
    /// nibble is value `4g + k` of sub-block `2p`, the high nibble of sub-block `2p + 1`.
    qs: [u8; 1024],
    /// `scales[8j + i]`: sub-block `j`'s scale for row `i`.
    scales: [u8; 64],
    /// `mins[16p + 2i + h]`: sub-block `2p + h`'s min for row `i`.
    mins: [u8; 64],
    d: [f16; ROWS],
    dmin: [f16; ROWS],
}

impl Interleaved for BlockQ4Kx8 {
    type Source = BlockQ4K;
    const TILE_ROWS: usize = 4;

    fn pack(rows: [&BlockQ4K; ROWS]) -> Self {
        let mut out = Self {
            qs: [0; 1024],
            scales: [0; 64],
            mins: [0; 64],
            d: [f16::ZERO; ROWS],
            dmin: [f16::ZERO; ROWS],
        };
        for (i, block) in rows.iter().enumerate() {
            let sm = block.scales_and_mins();
            for j in 0..8 {
                out.scales[8 * j + i] = sm[j];
                out.mins[16 * (j / 2) + 2 * i + j % 2] = sm[8 + j];
            }
            out.d[i] = block.d;
            out.dmin[i] = block.dmin;
            // Bytes `32p + 4g..+4` (chunk `c = 8p + g`) as one piece.
            for (c, bytes) in block.qs.chunks_exact(4).enumerate() {
                let at = (c * ROWS + i) * 4;
                out.qs[at..at + 4].copy_from_slice(bytes);
            }
        }
        out
    }

    fn dequantize(&self, i: usize, out: &mut [f32]) {
        let (d, dmin) = (self.d[i].to_f32(), self.dmin[i].to_f32());
        for j in 0..8 {
            let (p, shift) = (j / 2, 4 * (j % 2));
            let scale = d * self.scales[8 * j + i] as f32;
            let min = dmin * self.mins[16 * p + 2 * i + j % 2] as f32;
            for g in 0..8 {
                for k in 0..4 {
                    let q = (self.qs[((p * 8 + g) * ROWS + i) * 4 + k] >> shift) & 0x0F;
                    out[32 * j + 4 * g + k] = scale * q as f32 - min;
                }
            }
        }
    }

    fn dot(&self, a: &ActBlockK) -> [f32; ROWS] {
        let mut out = [0f32; ROWS];
        for (i, o) in out.iter_mut().enumerate() {
            let (mut sumi, mut summ) = (0i32, 0i32);
            for j in 0..8 {
                let (p, shift) = (j / 2, 4 * (j % 2));
                let mut dot = 0i32;
                for g in 0..8 {
                    for k in 0..4 {
                        let q = (self.qs[((p * 8 + g) * ROWS + i) * 4 + k] >> shift) & 0x0F;
                        dot += q as i32 * a.qs[32 * j + 4 * g + k] as i32;
                    }
                }
                sumi += self.scales[8 * j + i] as i32 * dot;
                summ += self.mins[16 * p + 2 * i + j % 2] as i32 * a.bsums32[j] as i32;
            }
            *o = a.d * (self.d[i].to_f32() * sumi as f32 - self.dmin[i].to_f32() * summ as f32);
        }
        out
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn tile_simd(
        isa: crate::kernels::qmatmul::Isa,
        w: &[Self],
        acts: &[ActBlockK],
        kb: usize,
        sums: &mut [[f32; ROWS]],
    ) {
        use avx2::tile;
        dispatch_rows!(tile, (isa, w, acts, kb), sums, [4, 3, 2, 1])
    }

    const ROW_ZMM: bool = true;
    /// From 5 rows. From 6 (against 8), the 1.5B decoded batches of 6 at 102–106 tok/s and of
    /// 7 at 114–116, at 96–100 and 103–107 from 8 (three alternated rounds); its Q6_K from 6
    /// too was slower (100 and 109–110). Once decode batches' AMX tiles requested their
    /// weights into L2 (`amx::prefetch_pair`), from 5 its batches of 5 decoded at 100–104 tok/s
    /// against 87–90 from 6 (four alternated rounds); from 4, batches of 4 were 1–3 % slower.
    const AMX_MIN_ROWS: usize = 5;
    const L2_TILE_ROWS: usize = 3;

    #[cfg(target_arch = "x86_64")]
    unsafe fn row_zmm(w: &[Self], acts: &[ActBlockK], kb: usize, sums: &mut [f32; ROWS]) {
        zmm::row(w, acts, kb, sums)
    }

    pair_tiles!(ZMM_PAIR, zmm_pair, zmm_pair::tile);

    pair_tiles!(AMX, amx_pair, amx::pair_tile);
}

/// Q4_K through AMX tiles (see `interleaved::amx_tiles`): a super-block's eight sub-blocks are a stretch,
/// unpacked, multiplied and scaled in three passes; each sub-block's sums take its integer
/// scales in 32-bit lanes and each super-block ends with the AVX2 tile's float step, so the
/// product is the VNNI kernels' bit for bit.
#[cfg(target_arch = "x86_64")]
mod amx {
    use std::arch::x86_64::*;

    use super::super::amx_tiles::{add_scaled, bytes8, scratch, store_rows, Scratch};
    use super::pair::{unpack, Step};
    use super::{ActBlockK, BlockQ4Kx8};
    use crate::kernels::qmatmul::amx::{self as tiles, TILE_COLS, TILE_ROWS};

    /// As `interleaved::amx_tiles::pair_tile`, for Q4_K.
    ///
    /// # Safety
    /// As `interleaved::amx_tiles::pair_tile`'s.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn pair_tile(
        w: [&[BlockQ4Kx8]; 2],
        acts: &[ActBlockK],
        kb: usize,
        rows: usize,
        stream: bool,
        sums: &mut [[f32; TILE_COLS]; TILE_ROWS],
    ) {
        let Scratch { b, c } = scratch();
        let mut acc = [_mm512_setzero_ps(); TILE_ROWS];
        let stride = kb * std::mem::size_of::<ActBlockK>();
        for k in 0..kb {
            let pair = [w[0].get_unchecked(k), w[1].get_unchecked(k)];
            unpack(pair, b, stream);
            let a = acts.get_unchecked(k).qs.as_ptr();
            for (j, (b, c)) in b.iter().zip(c.iter_mut()).enumerate() {
                tiles::product(j, a.add(32 * j), stride, b.as_ptr(), false, c);
            }
            let mut sumi = [_mm512_setzero_si512(); TILE_ROWS];
            for (j, c) in c[..8].iter().enumerate() {
                let [s0, s1] = pair.map(|block| block.scales.as_ptr().add(8 * j));
                add_scaled(&mut sumi, c, _mm512_cvtepu8_epi32(bytes8(s0, s1)), rows);
            }
            let step = Step::new(pair);
            for_rows!(rows, |r| {
                step.apply(acts.get_unchecked(r * kb + k), sumi[r], &mut acc[r]);
            });
        }
        store_rows(&acc, rows, sums);
    }
}

/// What Q4_K's AMX and 512-bit pair tiles share: a super-block of the pair unpacked to bytes,
/// and its float step.
#[cfg(target_arch = "x86_64")]
mod pair {
    use std::arch::x86_64::*;

    use super::super::amx_tiles::{halves, join, prefetch_pair};
    use super::{ActBlockK, BlockQ4Kx8};

    /// Unpacks the pair's super-block into `b`: `b[j][g]` is values `4g..4g + 4` of sub-block
    /// `j` of the 16 weight rows (the first group's eight, then the second's), as bytes.
    #[inline(always)]
    pub(super) unsafe fn unpack(pair: [&BlockQ4Kx8; 2], b: &mut [[[u8; 64]; 8]; 8], stream: bool) {
        let m4 = _mm512_set1_epi8(0x0F);
        let lines = std::mem::size_of::<BlockQ4Kx8>().div_ceil(64);
        // Chunk `8p + g` of each group's values: its low nibbles are values `4g..4g + 4` of
        // sub-block `2p`, its high ones of sub-block `2p + 1`.
        for p in 0..4 {
            prefetch_pair(pair, p * lines / 4..(p + 1) * lines / 4, stream);
            let (lo, hi) = b[2 * p..2 * p + 2].split_at_mut(1);
            for (g, (lo, hi)) in lo[0].iter_mut().zip(hi[0].iter_mut()).enumerate() {
                let at = (p * 8 + g) * 32;
                let raw = join(pair[0].qs.as_ptr().add(at), pair[1].qs.as_ptr().add(at));
                let low = _mm512_and_si512(raw, m4);
                let high = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), m4);
                _mm512_store_si512(lo.as_mut_ptr() as *mut __m512i, low);
                _mm512_store_si512(hi.as_mut_ptr() as *mut __m512i, high);
            }
        }
    }

    /// A pair's super-block float step: the 256-bit tile's `finish` in 16 lanes, so each
    /// path gives the same bits.
    pub(super) struct Step {
        d: __m512,
        dmin: __m512,
        /// `mins[16p + 2i + h]` of each group: lane `i` (8 more for the second group) holds
        /// sub-blocks `2p` and `2p + 1`'s mins as a pair of 16-bit values.
        mins: [__m512i; 4],
    }

    impl Step {
        #[inline(always)]
        pub(super) unsafe fn new(pair: [&BlockQ4Kx8; 2]) -> Self {
            let mins = std::array::from_fn(|p| {
                let half = |block: &BlockQ4Kx8| {
                    _mm_loadu_si128(block.mins.as_ptr().add(16 * p) as *const __m128i)
                };
                _mm512_cvtepu8_epi16(_mm256_set_m128i(half(pair[1]), half(pair[0])))
            });
            Self {
                d: halves([&pair[0].d, &pair[1].d]),
                dmin: halves([&pair[0].dmin, &pair[1].dmin]),
                mins,
            }
        }

        /// `acc += a.d · (d · sumi - dmin · Σ mins · bsums)` for the activation block `a`.
        #[inline(always)]
        pub(super) unsafe fn apply(&self, a: &ActBlockK, sumi: __m512i, acc: &mut __m512) {
            let mut summ = _mm512_setzero_si512();
            for (p, m) in self.mins.iter().enumerate() {
                // Sub-blocks `2p` and `2p + 1`'s activation sums, as a pair.
                let s = std::ptr::read_unaligned(a.bsums32.as_ptr().add(2 * p) as *const i32);
                summ = _mm512_add_epi32(summ, _mm512_madd_epi16(*m, _mm512_set1_epi32(s)));
            }
            let ad = _mm512_set1_ps(a.d);
            let v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_mul_ps(self.d, ad), *acc);
            *acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(summ), _mm512_mul_ps(self.dmin, ad), v);
        }
    }
}

/// Q4_K's pair tiles on 512-bit registers (AVX-512 VNNI without AMX): the pair's super-block
/// is unpacked to bytes once (as for AMX) and reused by every activation row of the tile, four
/// at a time; each `vpdpbusd` multiplies 16 weight rows by one row's four activation bytes,
/// broadcast from memory. Against the 256-bit tiles, a multiply-add costs half the
/// instructions: no unpacking in the inner loop and one broadcast per 64 products, not 32.
#[cfg(target_arch = "x86_64")]
mod zmm_pair {
    use std::arch::x86_64::*;

    use super::super::amx_tiles::{bytes8, scratch, store_rows, Scratch};
    use super::pair::{unpack, Step};
    use super::{ActBlockK, BlockQ4Kx8};
    use crate::kernels::qmatmul::amx::{TILE_COLS, TILE_ROWS};

    /// As [`Interleaved::zmm_pair`](super::Interleaved::zmm_pair).
    ///
    /// # Safety
    /// The CPU must support AVX-512 (F, BW, VL) and AVX-512 VNNI; `acts` holds `rows · kb`
    /// blocks, each of `w` `kb`; `rows` is 1 to 16.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn tile(
        w: [&[BlockQ4Kx8]; 2],
        acts: &[ActBlockK],
        kb: usize,
        rows: usize,
        stream: bool,
        sums: &mut [[f32; TILE_COLS]; TILE_ROWS],
    ) {
        let Scratch { b, .. } = scratch();
        let mut acc = [_mm512_setzero_ps(); TILE_ROWS];
        for k in 0..kb {
            let pair = [w[0].get_unchecked(k), w[1].get_unchecked(k)];
            unpack(pair, b, stream);
            let step = Step::new(pair);
            let mut r = 0;
            while r < rows {
                r += match rows - r {
                    1 => rows_of::<1>(b, pair, acts, kb, k, r, &step, &mut acc),
                    2 => rows_of::<2>(b, pair, acts, kb, k, r, &step, &mut acc),
                    3 => rows_of::<3>(b, pair, acts, kb, k, r, &step, &mut acc),
                    _ => rows_of::<4>(b, pair, acts, kb, k, r, &step, &mut acc),
                };
            }
        }
        store_rows(&acc, rows, sums);
    }

    /// Super-block `k` for activation rows `r0..r0 + T`; returns `T`. Two sub-blocks at a
    /// time, so `2T` sums are independent chains and `vpdpbusd`'s latency overlaps.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn rows_of<const T: usize>(
        b: &[[[u8; 64]; 8]; 8],
        pair: [&BlockQ4Kx8; 2],
        acts: &[ActBlockK],
        kb: usize,
        k: usize,
        r0: usize,
        step: &Step,
        acc: &mut [__m512; TILE_ROWS],
    ) -> usize {
        let a: [&ActBlockK; T] = std::array::from_fn(|i| acts.get_unchecked((r0 + i) * kb + k));
        let mut sumi = [_mm512_setzero_si512(); T];
        for jj in 0..4 {
            let mut part = [[_mm512_setzero_si512(); T]; 2];
            let subs = [&b[2 * jj], &b[2 * jj + 1]];
            for g in 0..8 {
                for (h, (part, sub)) in part.iter_mut().zip(subs).enumerate() {
                    let j = 2 * jj + h;
                    let wv = _mm512_load_si512(sub[g].as_ptr() as *const __m512i);
                    for i in 0..T {
                        let x = std::ptr::read_unaligned(
                            a[i].qs.as_ptr().add(32 * j + 4 * g) as *const i32
                        );
                        part[i] = _mm512_dpbusd_epi32(part[i], wv, _mm512_set1_epi32(x));
                    }
                }
            }
            for (h, part) in part.iter().enumerate() {
                let j = 2 * jj + h;
                let [s0, s1] = pair.map(|block| block.scales.as_ptr().add(8 * j));
                let scales = _mm512_cvtepu8_epi32(bytes8(s0, s1));
                for i in 0..T {
                    sumi[i] = _mm512_add_epi32(sumi[i], _mm512_mullo_epi32(part[i], scales));
                }
            }
        }
        for i in 0..T {
            step.apply(a[i], sumi[i], &mut acc[r0 + i]);
        }
        T
    }
}

/// Q4_K on 512-bit registers, one activation row (see `interleaved::avx512_row`): a register holds two
/// consecutive 32-byte chunks of a block, whose low nibbles are eight values of sub-block `2p`
/// and high nibbles eight of `2p + 1`; the two sub-blocks' 64 activation bytes sit in one
/// register for `vpermd`. The scales apply to both halves at once, the halves are added once a
/// super-block, and the float step is the 256-bit tile's.
#[cfg(target_arch = "x86_64")]
mod zmm {
    use std::arch::x86_64::*;

    use super::super::amx_tiles::bytes8;
    use super::super::avx512_row::{fold, prefetch_row_line, word_pair};
    use super::{avx2, ActBlockK, BlockQ4Kx8, ROWS};

    /// As [`Interleaved::row_zmm`](super::Interleaved::row_zmm).
    ///
    /// # Safety
    /// The CPU must support AVX-512 (F, BW, VL) and AVX-512 VNNI; `w` and `acts` hold `kb`
    /// super-blocks.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn row(
        w: &[BlockQ4Kx8],
        acts: &[ActBlockK],
        kb: usize,
        sums: &mut [f32; ROWS],
    ) {
        debug_assert!(w.len() == kb && acts.len() == kb);
        let m4 = _mm512_set1_epi8(0x0F);
        // Chunks `2s` and `2s + 1` take activation words `2s`, `2s + 1` of sub-block `2p`
        // (low nibbles) and `8 + 2s`, `9 + 2s` of sub-block `2p + 1` (high).
        let low: [__m512i; 4] = std::array::from_fn(|s| word_pair(2 * s as i32));
        let high: [__m512i; 4] = std::array::from_fn(|s| word_pair(8 + 2 * s as i32));
        let mut acc = [_mm256_setzero_ps()];
        for b in 0..kb {
            let block = w.get_unchecked(b);
            let a = acts.get_unchecked(b);
            let mut sumi = _mm512_setzero_si512();
            for p in 0..4 {
                let x = _mm512_loadu_si512(a.qs.as_ptr().add(64 * p) as *const _);
                // Per sub-block two sums, so `vpdpbusd`'s latency overlaps.
                let mut part = [[_mm512_setzero_si512(); 2]; 2];
                for s in 0..4 {
                    // A block's 19 lines (as the 256-bit tile counts them): four of `qs` for
                    // each `p`, one a load, and one of the tail with the first of each but
                    // the last.
                    prefetch_row_line(block, 4 * p + s);
                    if s == 0 && p < 3 {
                        prefetch_row_line(block, 16 + p);
                    }
                    let at = block.qs.as_ptr().add((p * 8 + 2 * s) * 32);
                    let bits = _mm512_loadu_si512(at as *const _);
                    let lo = _mm512_and_si512(bits, m4);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(bits), m4);
                    let (xl, xh) = (
                        _mm512_permutexvar_epi32(low[s], x),
                        _mm512_permutexvar_epi32(high[s], x),
                    );
                    part[0][s % 2] = _mm512_dpbusd_epi32(part[0][s % 2], lo, xl);
                    part[1][s % 2] = _mm512_dpbusd_epi32(part[1][s % 2], hi, xh);
                }
                for (h, part) in part.iter().enumerate() {
                    // Sub-block `2p + h`'s eight scales, for both halves.
                    let at = block.scales.as_ptr().add(8 * (2 * p + h));
                    let scales = _mm512_cvtepu8_epi32(bytes8(at, at));
                    let dots = _mm512_add_epi32(part[0], part[1]);
                    sumi = _mm512_add_epi32(sumi, _mm512_mullo_epi32(dots, scales));
                }
            }
            avx2::finish(block, &[a], &[fold(sumi)], &mut acc);
        }
        _mm256_storeu_ps(sums.as_mut_ptr(), acc[0]);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::super::{broadcast4, evex, line_at, tile_prefetch_line};
    use super::{ActBlockK, BlockQ4Kx8, ROWS};
    use crate::kernels::qmatmul::avx2::{add16, dp16, scaled, scales};
    use crate::kernels::qmatmul::ByteDot;

    simd_tiles!(tile_body, [], BlockQ4Kx8, ActBlockK);

    /// The line of a block (counted as [`prefetch_line`](super::super::prefetch_line) counts) to
    /// request before load `step` of the `steps` that the passes over sub-blocks `2p` and `2p + 1`
    /// make, if any. A block is 18½ lines, requested as 19 (with 18 the stream falls 32 bytes
    /// behind every block): four lines of `qs` for each `p` and one of the tail for each but the
    /// last, spread evenly over the loads. Requesting each `p`'s lines together before its loads
    /// left the loads that followed without new requests: one row through 8960 × 1536 matrices
    /// streamed at 77–80 % of a plain read on one thread that way and 84–86 % spread (83–87 and
    /// 89–91 % on two), and the 1.5B decodes at batch 1 a median 3–4 % faster (the two alternated
    /// per decode step in one process; batches of 4 and 16 within 1 %).
    #[inline(always)]
    fn prefetch_slot(p: usize, step: usize, steps: usize) -> Option<usize> {
        let lines = if p < 3 { 5 } else { 4 };
        (0..lines)
            .find(|&i| (2 * i + 1) * steps / 10 == step)
            .map(|i| if i < 4 { 4 * p + i } else { 16 + p })
    }

    /// The tile: a sub-block's eight products per row and lane add up in [`dp16`]'s lanes
    /// (AVX2: at most 16 · 15 · 127 = 30 480 in 16 bits) before its scales apply.
    #[inline(always)]
    unsafe fn tile_body<const T: usize, D: ByteDot>(
        w: &[BlockQ4Kx8],
        acts: &[ActBlockK],
        kb: usize,
        sums: &mut [[f32; ROWS]],
    ) {
        debug_assert!(w.len() == kb && acts.len() == T * kb && sums.len() == T);
        let m4 = _mm256_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); T];
        for b in 0..kb {
            let block = w.get_unchecked(b);
            let rows: [&ActBlockK; T] = std::array::from_fn(|r| acts.get_unchecked(r * kb + b));
            let mut sumi = [_mm256_setzero_si256(); T];
            if D::EVEX && T == 4 {
                // The passes below in assembly (see `interleaved::evex`). `T` is 4 here; the
                // index only has to compile for every `T`.
                let a: [*const i8; 4] = std::array::from_fn(|r| rows[r % T].qs.as_ptr());
                let sumi4 = <&mut [__m256i; 4]>::try_from(&mut sumi[..]).expect("four rows");
                let ahead = <BlockQ4Kx8 as super::Interleaved>::PREFETCH_AHEAD;
                for p in 0..4 {
                    // The lines `prefetch_slot` gives the pass: `qs` lines 4p..4p + 4, then
                    // tail line 16 + p but for the last pass (which requests a line again).
                    let pf = line_at(block, ahead, 4 * p);
                    let last = line_at(block, ahead, if p < 3 { 16 + p } else { 4 * p });
                    evex::q4k_pass4(
                        block.qs.as_ptr().add(256 * p),
                        a.map(|x| x.add(64 * p)),
                        block.scales.as_ptr().add(16 * p),
                        m4,
                        pf,
                        last,
                        sumi4,
                    );
                }
                finish(block, &rows, &sumi, &mut acc);
                continue;
            }
            // Sub-blocks `2p` and `2p + 1` share their bytes (low and high nibbles).
            for p in 0..4 {
                // VNNI: both sub-blocks in one pass over the bytes, their sums independent
                // chains so `vpdpbusd`'s latency overlaps, and with one or two rows even and
                // odd groups in separate sums as well (more rows bring their own chains, and
                // more sums would not fit the 16 registers of AVX-VNNI). AVX2 (one-cycle adds):
                // one sub-block a pass, reloading the bytes for the second, so T sums are live
                // instead of 2T (at four rows a median 4 % more multiply-adds a second than
                // both in one pass, alternating the two in one process).
                let halves = if D::VNNI { 2 } else { 1 };
                for pass in 0..2 / halves {
                    let mut part = [[[_mm256_setzero_si256(); T]; 2]; 2];
                    for g in 0..8 {
                        if let Some(line) = prefetch_slot(p, pass * 8 + g, 16 / halves) {
                            tile_prefetch_line::<_, D>(block, line, T);
                        }
                        let bits = _mm256_load_si256(
                            block.qs.as_ptr().add((p * 8 + g) * 32) as *const __m256i
                        );
                        let k = if D::VNNI && T <= 2 { g % 2 } else { 0 };
                        for (hh, part) in part.iter_mut().enumerate().take(halves) {
                            let h = pass * halves + hh;
                            let q = if h == 0 {
                                _mm256_and_si256(bits, m4)
                            } else {
                                _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4)
                            };
                            let j = 2 * p + h;
                            for r in 0..T {
                                let x = broadcast4(
                                    rows[r].qs.as_ptr().add(32 * j + 4 * g) as *const u8
                                );
                                part[k][r] = dp16::<D>(part[k][r], q, x);
                            }
                        }
                    }
                    for (hh, part) in part.iter().enumerate().take(halves) {
                        let j = 2 * p + pass * halves + hh;
                        let scales = scales::<D, false>(block.scales.as_ptr().add(8 * j));
                        for r in 0..T {
                            let part = add16::<D>(part[0][r], part[1][r]);
                            sumi[r] = _mm256_add_epi32(sumi[r], scaled::<D>(part, scales));
                        }
                    }
                }
            }
            finish(block, &rows, &sumi, &mut acc);
        }
        for (s, a) in sums.iter_mut().zip(acc) {
            _mm256_storeu_ps(s.as_mut_ptr(), a);
        }
    }

    /// A super-block's float step for `T` activation rows, the same in every 256-bit tile and
    /// the 512-bit one-row kernel (the AMX tiles repeat it in 16 lanes): `acc[r] += a.d ·
    /// (d · sumi[r] - dmin · Σ mins · bsums)` in the eight lanes.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[inline(always)]
    pub(super) unsafe fn finish<const T: usize>(
        block: &BlockQ4Kx8,
        rows: &[&ActBlockK; T],
        sumi: &[__m256i; T],
        acc: &mut [__m256; T],
    ) {
        let d = _mm256_cvtph_ps(_mm_load_si128(block.d.as_ptr() as *const __m128i));
        let dmin = _mm256_cvtph_ps(_mm_load_si128(block.dmin.as_ptr() as *const __m128i));
        let mins: [__m256i; 4] = std::array::from_fn(|p| {
            _mm256_cvtepu8_epi16(_mm_load_si128(
                block.mins.as_ptr().add(16 * p) as *const __m128i
            ))
        });
        for r in 0..T {
            let a = rows[r];
            let mut summ = _mm256_setzero_si256();
            for (p, m) in mins.iter().enumerate() {
                let s = broadcast4(a.bsums32.as_ptr().add(2 * p) as *const u8);
                summ = _mm256_add_epi32(summ, _mm256_madd_epi16(*m, s));
            }
            let ad = _mm256_set1_ps(a.d);
            let v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_mul_ps(d, ad), acc[r]);
            acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(summ), _mm256_mul_ps(dmin, ad), v);
        }
    }

    #[cfg(test)]
    mod tests {
        /// Both passes' schedules (AVX2's 16 loads per `p`, VNNI's 8) request each of a
        /// block's 19 lines once, at most one a load, in order.
        #[test]
        fn prefetch_slots_request_each_line_once_in_order() {
            for steps in [16, 8] {
                let lines: Vec<usize> = (0..4)
                    .flat_map(|p| (0..steps).filter_map(move |s| super::prefetch_slot(p, s, steps)))
                    .collect();
                let mut sorted = lines.clone();
                sorted.sort();
                assert_eq!(
                    sorted,
                    (0..19).collect::<Vec<_>>(),
                    "{steps} steps: {lines:?}"
                );
                // Each `p`'s qs lines in order, its tail line last.
                for p in 0..4 {
                    let mine: Vec<usize> = (0..steps)
                        .filter_map(|s| super::prefetch_slot(p, s, steps))
                        .collect();
                    let mut want: Vec<usize> = (4 * p..4 * p + 4).collect();
                    if p < 3 {
                        want.push(16 + p);
                    }
                    assert_eq!(mine, want, "{steps} steps, p = {p}");
                }
            }
        }
    }
}
