//! Q6_K, eight rows interleaved: the 6-bit values (0..63, the -32 applied once per super-block
//! through the activations' 16-value sums) multiply four activations at a time; two such
//! products add up in 16-bit lanes (at most 2 · 2 · 63 · 127 = 32 004, exact) before one `madd`
//! applies the eight rows' 16-value scales: 1½ multiplies per 32 multiply-adds against the
//! row-major kernel's 2.
//!
//! The repack also rearranges the bits: ggml keeps four low bits and two high bits of a value in
//! different arrays (five operations to join them per 32 values); here the same four positions of
//! four sub-blocks share three bytes, three values whole in the low six bits (one `and`) and the
//! fourth spread over the three top bit pairs, so 128 values cost 11 operations instead of ~22.
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
    /// `q[(((8n + g) · 3 + j) · 8 + i) · 4 + k]` holds, for row `i` and position `p = 4g + k` of
    /// the sub-blocks `4n..4n + 4`: in its low six bits the value of sub-block `4n + j`, in its
    /// top two bits bits `2j, 2j + 1` of the value of sub-block `4n + 3`.
    q: [u8; 1536],
    /// `scales[8s + i]`: the scale of values `16s..16s + 16` of row `i`.
    scales: [i8; 128],
    d: [f16; ROWS],
}

/// Index in [`BlockQ6Kx8::q`] of byte `j` of row `i`'s position `p` in sub-blocks `4n..4n + 4`.
fn q_index(n: usize, p: usize, j: usize, i: usize) -> usize {
    (((8 * n + p / 4) * 3 + j) * ROWS + i) * 4 + p % 4
}

impl BlockQ6Kx8 {
    /// The 6-bit value `l` of sub-block `sub` of row `i` (0..63, before the -32).
    fn value(&self, i: usize, sub: usize, l: usize) -> i32 {
        let (n, k) = (sub / 4, sub % 4);
        let byte = |j| self.q[q_index(n, l, j, i)];
        match k {
            3 => (0..3).map(|j| ((byte(j) >> 6) as i32) << (2 * j)).sum(),
            _ => (byte(k) & 0x3F) as i32,
        }
    }
}

impl Interleaved for BlockQ6Kx8 {
    type Source = BlockQ6K;
    const TILE_ROWS: usize = 8;
    const L2_TILE_ROWS: usize = 3;

    fn pack(rows: [&BlockQ6K; ROWS]) -> Self {
        let mut out = Self {
            q: [0; 1536],
            scales: [0; 128],
            d: [f16::ZERO; ROWS],
        };
        for (i, block) in rows.iter().enumerate() {
            // ggml: value `p` of sub-block `4n + k` has its low four bits in nibble `k / 2` of
            // `ql[64n + 32(k % 2) + p]` and its high two in bits `2k..` of `qh[32n + p]`. Each
            // output byte is written once (the pack is a large share of a model's load).
            for n in 0..2 {
                for p in 0..32 {
                    let value = |k: usize| {
                        let lo = block.ql[64 * n + 32 * (k % 2) + p] >> (4 * (k / 2)) & 0x0F;
                        lo | (block.qh[32 * n + p] >> (2 * k) & 3) << 4
                    };
                    let fourth = value(3);
                    for j in 0..3 {
                        out.q[q_index(n, p, j, i)] = value(j) | (fourth >> (2 * j) & 3) << 6;
                    }
                }
            }
            for (s, &scale) in block.scales.iter().enumerate() {
                out.scales[8 * s + i] = scale;
            }
            out.d[i] = block.d;
        }
        out
    }

    fn dequantize(&self, i: usize, out: &mut [f32]) {
        let d = self.d[i].to_f32();
        for sub in 0..8 {
            for l in 0..32 {
                let scale = self.scales[8 * (2 * sub + l / 16) + i] as f32;
                out[32 * sub + l] = d * scale * (self.value(i, sub, l) - 32) as f32;
            }
        }
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
    unsafe fn tile_simd(
        isa: crate::kernels::qmatmul::Isa,
        w: &[Self],
        acts: &[ActBlockK],
        kb: usize,
        sums: &mut [[f32; ROWS]],
    ) {
        use avx2::tile;
        dispatch_rows!(tile, (isa, w, acts, kb), sums, [8, 7, 6, 5, 4, 3, 2, 1])
    }

    const ROW_ZMM: bool = true;

    #[cfg(target_arch = "x86_64")]
    unsafe fn row_zmm(w: &[Self], acts: &[ActBlockK], kb: usize, sums: &mut [f32; ROWS]) {
        zmm::row(w, acts, kb, sums)
    }

    /// A scale covers 16 values.
    const AMX_DEPTH: usize = 16;
    pair_tiles!(ZMM_PAIR, zmm_pair, zmm_pair::tile);

    pair_tiles!(AMX, amx_pair, amx::pair_tile);
}

/// Q6_K on 512-bit registers, one activation row (see `interleaved::avx512_row`): a register holds the same
/// byte of positions `4g..4g + 4` (lanes 0–7) and `4g + 4..4g + 8` (lanes 8–15) of a group of
/// four sub-blocks, so the three whole values and the fourth built from the three top bit pairs
/// come out for eight positions at once; the four sub-blocks' activations sit in two
/// registers for `vpermd`. Each 16-value scale applies to both halves, the halves are added
/// once a super-block, and the -32 and the float step are the 256-bit tile's.
#[cfg(target_arch = "x86_64")]
mod zmm {
    use std::arch::x86_64::*;

    use super::super::amx_tiles::{bytes8, join};
    use super::super::avx512_row::{fold, prefetch_row_line, word_pair};
    use super::{avx2, q_index, ActBlockK, BlockQ6Kx8, ROWS};

    /// As [`Interleaved::row_zmm`](super::Interleaved::row_zmm).
    ///
    /// # Safety
    /// The CPU must support AVX-512 (F, BW, VL) and AVX-512 VNNI; `w` and `acts` hold `kb`
    /// super-blocks.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn row(
        w: &[BlockQ6Kx8],
        acts: &[ActBlockK],
        kb: usize,
        sums: &mut [f32; ROWS],
    ) {
        debug_assert!(w.len() == kb && acts.len() == kb);
        let low6 = _mm512_set1_epi8(0x3F);
        let top2 = _mm512_set1_epi8(0xC0u8 as i8);
        let (bits01, bits0123) = (_mm512_set1_epi8(0x03), _mm512_set1_epi8(0x0F));
        let mut acc = [_mm256_setzero_ps()];
        for b in 0..kb {
            let block = w.get_unchecked(b);
            let a = acts.get_unchecked(b);
            let mut sumi = _mm512_setzero_si512();
            for n in 0..2 {
                // Sub-blocks `4n`, `4n + 1` in one register, `4n + 2`, `4n + 3` in the other.
                let x: [__m512i; 2] = std::array::from_fn(|h| {
                    _mm512_loadu_si512(a.qs.as_ptr().add(128 * n + 64 * h) as *const _)
                });
                for half in 0..2 {
                    // Sub-block `4n + k`'s products for the scale of values `16 half..`.
                    let mut part = [_mm512_setzero_si512(); 4];
                    for pair in 0..2 {
                        let g = 4 * half + 2 * pair;
                        let bytes: [__m512i; 3] = std::array::from_fn(|j| {
                            let at = |g: usize| block.q.as_ptr().add(q_index(n, 4 * g, j, 0));
                            join(at(g), at(g + 1))
                        });
                        // The fourth sub-block's value: the top bit pairs of bytes 0, 1, 2 to
                        // bits 0–1, 2–3, 4–5 (16-bit shifts; each select keeps the bits its
                        // own byte brought, and byte 2's pair is masked before its shift).
                        let fourth = {
                            let b0 = _mm512_srli_epi16::<6>(bytes[0]);
                            let b1 = _mm512_srli_epi16::<4>(bytes[1]);
                            let b2 = _mm512_srli_epi16::<2>(_mm512_and_si512(bytes[2], top2));
                            // `m ? x : y`, bit by bit.
                            let low = _mm512_ternarylogic_epi32::<0xCA>(bits01, b0, b1);
                            _mm512_ternarylogic_epi32::<0xCA>(bits0123, low, b2)
                        };
                        let values = [
                            _mm512_and_si512(bytes[0], low6),
                            _mm512_and_si512(bytes[1], low6),
                            _mm512_and_si512(bytes[2], low6),
                            fourth,
                        ];
                        for (k, (part, v)) in part.iter_mut().zip(values).enumerate() {
                            // A block's lines spread over its 32 products, as in the 256-bit
                            // one-row tile.
                            let step = ((2 * n + half) * 2 + pair) * 4 + k;
                            if let Some(line) = avx2::ONE_ROW_LINES[step] {
                                prefetch_row_line(block, line as usize);
                            }
                            let words = word_pair((8 * (k % 2) + g) as i32);
                            let x = _mm512_permutexvar_epi32(words, x[k / 2]);
                            *part = _mm512_dpbusd_epi32(*part, v, x);
                        }
                    }
                    for (k, part) in part.iter().enumerate() {
                        // The eight rows' scales, for both halves.
                        let at = block.scales.as_ptr().add(8 * (2 * (4 * n + k) + half));
                        let at = at as *const u8;
                        let scales = _mm512_cvtepi8_epi32(bytes8(at, at));
                        let scaled = _mm512_mullo_epi32(*part, scales);
                        sumi = _mm512_add_epi32(sumi, scaled);
                    }
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

    use super::super::{broadcast4, evex, line_at, tile_prefetch_line, vex};
    use super::{q_index, ActBlockK, BlockQ6Kx8, ROWS};
    use crate::kernels::qmatmul::avx2::{dp16, scaled, scales};
    use crate::kernels::qmatmul::ByteDot;

    /// The values of sub-block `4n + k` for group `g` (four values of each row) as bytes.
    #[inline(always)]
    pub(super) unsafe fn values(block: &BlockQ6Kx8, n: usize, k: usize, g: usize) -> __m256i {
        let at = |j: usize| {
            _mm256_load_si256(block.q.as_ptr().add(q_index(n, 4 * g, j, 0)) as *const __m256i)
        };
        if k < 3 {
            return _mm256_and_si256(at(k), _mm256_set1_epi8(0x3F));
        }
        // Bit pair `j` from the top of byte `j` to bits `2j..2j + 2` (16-bit shifts: the masked
        // bits stay in their byte).
        let part = |j: usize, bits: i8| match j {
            0 => _mm256_and_si256(_mm256_srli_epi16(at(0), 6), _mm256_set1_epi8(bits)),
            1 => _mm256_and_si256(_mm256_srli_epi16(at(1), 4), _mm256_set1_epi8(bits)),
            _ => _mm256_and_si256(_mm256_srli_epi16(at(2), 2), _mm256_set1_epi8(bits)),
        };
        _mm256_or_si256(_mm256_or_si256(part(0, 0x03), part(1, 0x0C)), part(2, 0x30))
    }

    simd_tiles!(tile_body, [], BlockQ6Kx8, ActBlockK);

    /// The line of a block (counted as [`prefetch_line`](super::super::prefetch_line) counts) that
    /// a one-row tile requests at each of its 32 steps, if any: the 26½ lines of a block as 27
    /// requests spread evenly. Tiles of more rows request line `step` at every step, five lines of
    /// the next block twice. One row through 8960 × 1536 and 151936 × 1536 matrices streamed 5–10 %
    /// faster with these requests than with those (alternated in one process), and the 1.5B decodes
    /// at batch 1 a median 4.3–4.6 % faster (alternated per decode step); but with the same matrix
    /// kept in the last-level cache one row ran 14–17 % slower, and batches of 16 decoded 1.5 %
    /// slower, so more rows keep one request a step.
    pub(super) const ONE_ROW_LINES: [Option<u8>; 32] = {
        let mut lines = [None; 32];
        let mut step = 0;
        while step < 32 {
            if step * 27 % 32 < 27 {
                lines[step] = Some((step * 27 / 32) as u8);
            }
            step += 1;
        }
        lines
    };

    /// The tile: per row and lane, the products of a scale's two groups of four values add up
    /// in [`dp16`]'s lanes (AVX2: four in each 16-bit half, at most 4 · 63 · 127 = 32 004)
    /// before the scale applies.
    #[inline(always)]
    unsafe fn tile_body<const T: usize, D: ByteDot>(
        w: &[BlockQ6Kx8],
        acts: &[ActBlockK],
        kb: usize,
        sums: &mut [[f32; ROWS]],
    ) {
        debug_assert!(w.len() == kb && acts.len() == T * kb && sums.len() == T);
        let mut acc = [_mm256_setzero_ps(); T];
        for b in 0..kb {
            let block = w.get_unchecked(b);
            let rows: [&ActBlockK; T] = std::array::from_fn(|r| acts.get_unchecked(r * kb + b));
            let mut sumi = [_mm256_setzero_si256(); T];
            if (D::EVEX || !D::VNNI) && T == 8 {
                // The loop below in assembly (`interleaved::evex` with AVX-512, `vex` with AVX2
                // alone), with its requests: a sub-block's lines `4 sub..4 sub + 4`.
                let sumi8 = <&mut [__m256i; 8]>::try_from(&mut sumi[..]).expect("eight rows");
                let stride = kb * std::mem::size_of::<ActBlockK>();
                let ahead = <BlockQ6Kx8 as super::Interleaved>::PREFETCH_AHEAD;
                for sub in 0..8 {
                    let (n, k) = (sub / 4, sub % 4);
                    let q = block.q.as_ptr().add(q_index(n, 0, k % 3, 0));
                    let scales = block.scales.as_ptr().add(16 * sub);
                    let x = rows[0].qs.as_ptr().add(32 * sub);
                    let pf = line_at(block, ahead, 4 * sub);
                    if D::EVEX {
                        evex::q6k_sub8(k == 3, q, scales, x, stride, pf, sumi8);
                    } else {
                        vex::q6k_sub8(k == 3, q, scales, x, stride, pf, sumi8);
                    }
                }
                finish(block, &rows, &sumi, &mut acc);
                continue;
            }
            for sub in 0..8 {
                let (n, k) = (sub / 4, sub % 4);
                for half in 0..2 {
                    let s = 2 * sub + half;
                    let scale = scales::<D, true>(block.scales.as_ptr().add(8 * s) as *const u8);
                    for pair in 0..2 {
                        let step = (sub * 2 + half) * 2 + pair;
                        if T > 1 {
                            tile_prefetch_line::<_, D>(block, step, T);
                        } else if let Some(line) = ONE_ROW_LINES[step] {
                            tile_prefetch_line::<_, D>(block, line as usize, T);
                        }
                        let g = 4 * half + 2 * pair;
                        let q0 = values(block, n, k, g);
                        let q1 = values(block, n, k, g + 1);
                        for r in 0..T {
                            let x = rows[r].qs.as_ptr().add(32 * sub + 4 * g) as *const u8;
                            let part = dp16::<D>(_mm256_setzero_si256(), q0, broadcast4(x));
                            let part = dp16::<D>(part, q1, broadcast4(x.add(4)));
                            sumi[r] = _mm256_add_epi32(sumi[r], scaled::<D>(part, scale));
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

    /// A super-block's end for `T` activation rows, the same in every 256-bit tile and the
    /// 512-bit one-row kernel (the AMX tiles repeat it in 16 lanes): the -32 of every value
    /// (`Σ_s scale_s · 32 · bsum_s`, two scales per `madd`) taken from `sumi[r]`, then
    /// `acc[r] += d · a.d · total` in the eight lanes.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[inline(always)]
    pub(super) unsafe fn finish<const T: usize>(
        block: &BlockQ6Kx8,
        rows: &[&ActBlockK; T],
        sumi: &[__m256i; T],
        acc: &mut [__m256; T],
    ) {
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

    #[cfg(test)]
    mod tests {
        /// A one-row tile requests each of a block's 27 lines once, in order, spread so that
        /// no five steps in a row go without a request.
        #[test]
        fn one_row_lines_request_each_line_once_in_order() {
            let lines: Vec<usize> = super::ONE_ROW_LINES
                .iter()
                .flatten()
                .map(|&l| l as usize)
                .collect();
            assert_eq!(lines, (0..27).collect::<Vec<_>>());
            assert!(super::ONE_ROW_LINES
                .windows(5)
                .all(|w| w.iter().any(Option::is_some)));
        }
    }
}

/// Q6_K through AMX tiles (see `interleaved::amx_tiles`): as Q4_K's, with a product 16 values deep for each of
/// a super-block's 16 scales; the -32 of every value comes back once a super-block through the
/// activations' 16-value sums, as in the AVX2 tile, so the product is the VNNI kernels' bit
/// for bit.
#[cfg(target_arch = "x86_64")]
mod amx {
    use std::arch::x86_64::*;

    use super::super::amx_tiles::{add_scaled, bytes8, scratch, store_rows, Scratch};
    use super::pair::{unpack, Step};
    use super::{ActBlockK, BlockQ6Kx8};
    use crate::kernels::qmatmul::amx::{self as tiles, TILE_COLS, TILE_ROWS};

    /// As `interleaved::amx_tiles::pair_tile`, for Q6_K.
    ///
    /// # Safety
    /// As `interleaved::amx_tiles::pair_tile`'s, inside `with_tiles` 16 bytes deep.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn pair_tile(
        w: [&[BlockQ6Kx8]; 2],
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
            for (s, c) in c.iter_mut().enumerate() {
                let half = b[s / 2].as_ptr().add(4 * (s % 2));
                tiles::product(s, a.add(16 * s), stride, half, false, c);
            }
            let mut sumi = [_mm512_setzero_si512(); TILE_ROWS];
            for (s, c) in c.iter().enumerate() {
                let [s0, s1] = pair.map(|block| block.scales.as_ptr().add(8 * s) as *const u8);
                add_scaled(&mut sumi, c, _mm512_cvtepi8_epi32(bytes8(s0, s1)), rows);
            }
            let step = Step::new(pair);
            for_rows!(rows, |r| {
                step.apply(acts.get_unchecked(r * kb + k), sumi[r], &mut acc[r]);
            });
        }
        store_rows(&acc, rows, sums);
    }
}

/// What Q6_K's AMX and 512-bit pair tiles share: a super-block of the pair unpacked to bytes,
/// and its float step.
#[cfg(target_arch = "x86_64")]
mod pair {
    use std::arch::x86_64::*;

    use super::super::amx_tiles::{halves, prefetch_pair};
    use super::avx2::values;
    use super::{ActBlockK, BlockQ6Kx8};

    /// Unpacks the pair's super-block into `b`: row `g` of `b[t]` holds values `4g..4g + 4`
    /// of values `32t..32t + 32` of the 16 weight rows (the first group's eight, then the
    /// second's), as unsigned bytes (32 above the values); sub-block `s` (16 values) is rows
    /// `4 (s % 2)..` of `b[s / 2]`.
    #[inline(always)]
    pub(super) unsafe fn unpack(pair: [&BlockQ6Kx8; 2], b: &mut [[[u8; 64]; 8]; 8], stream: bool) {
        let lines = std::mem::size_of::<BlockQ6Kx8>().div_ceil(64);
        for (sub, tile) in b.iter_mut().enumerate() {
            prefetch_pair(pair, sub * lines / 8..(sub + 1) * lines / 8, stream);
            let (n, q) = (sub / 4, sub % 4);
            for (g, row) in tile.iter_mut().enumerate() {
                let low = _mm512_castsi256_si512(values(pair[0], n, q, g));
                let v = _mm512_inserti64x4::<1>(low, values(pair[1], n, q, g));
                _mm512_store_si512(row.as_mut_ptr() as *mut __m512i, v);
            }
        }
    }

    /// A pair's super-block float step, the same ops on every path.
    pub(super) struct Step {
        d: __m512,
        /// Lane `i` holds scales `2p` and `2p + 1` of its row as a pair of 16-bit values.
        scale_pairs: [__m512i; 8],
    }

    impl Step {
        #[inline(always)]
        pub(super) unsafe fn new(pair: [&BlockQ6Kx8; 2]) -> Self {
            let scale_pairs = std::array::from_fn(|p| {
                let pairs = |block: &BlockQ6Kx8| {
                    let s = _mm_loadu_si128(block.scales.as_ptr().add(16 * p) as *const __m128i);
                    _mm_unpacklo_epi8(s, _mm_srli_si128::<8>(s))
                };
                _mm512_cvtepi8_epi16(_mm256_set_m128i(pairs(pair[1]), pairs(pair[0])))
            });
            Self {
                d: halves([&pair[0].d, &pair[1].d]),
                scale_pairs,
            }
        }

        /// `acc += d · a.d · (sumi - 32 Σ_s scale_s · bsum_s)`: the -32 of every value, two
        /// scales per `madd`.
        #[inline(always)]
        pub(super) unsafe fn apply(&self, a: &ActBlockK, sumi: __m512i, acc: &mut __m512) {
            let mut offset = _mm512_setzero_si512();
            for (p, sp) in self.scale_pairs.iter().enumerate() {
                let s = std::ptr::read_unaligned(a.bsums.as_ptr().add(2 * p) as *const i32);
                offset = _mm512_add_epi32(offset, _mm512_madd_epi16(*sp, _mm512_set1_epi32(s)));
            }
            let total = _mm512_sub_epi32(sumi, _mm512_slli_epi32::<5>(offset));
            let dv = _mm512_mul_ps(self.d, _mm512_set1_ps(a.d));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), dv, *acc);
        }
    }
}

/// Q6_K's pair tiles on 512-bit registers (AVX-512 VNNI without AMX), as Q4_K's: the pair's
/// super-block unpacked once and reused by every activation row of the tile, four at a time.
#[cfg(target_arch = "x86_64")]
mod zmm_pair {
    use std::arch::x86_64::*;

    use super::super::amx_tiles::{bytes8, scratch, store_rows, Scratch};
    use super::pair::{unpack, Step};
    use super::{ActBlockK, BlockQ6Kx8};
    use crate::kernels::qmatmul::amx::{TILE_COLS, TILE_ROWS};

    /// As [`Interleaved::zmm_pair`](super::Interleaved::zmm_pair).
    ///
    /// # Safety
    /// The CPU must support AVX-512 (F, BW, VL) and AVX-512 VNNI; `acts` holds `rows · kb`
    /// blocks, each of `w` `kb`; `rows` is 1 to 16.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn tile(
        w: [&[BlockQ6Kx8]; 2],
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
    /// time, so `2T` sums are independent chains.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn rows_of<const T: usize>(
        b: &[[[u8; 64]; 8]; 8],
        pair: [&BlockQ6Kx8; 2],
        acts: &[ActBlockK],
        kb: usize,
        k: usize,
        r0: usize,
        step: &Step,
        acc: &mut [__m512; TILE_ROWS],
    ) -> usize {
        let a: [&ActBlockK; T] = std::array::from_fn(|i| acts.get_unchecked((r0 + i) * kb + k));
        let mut sumi = [_mm512_setzero_si512(); T];
        // Sub-blocks `2t` and `2t + 1` are `b[t]`'s rows 0–3 and 4–7.
        for (t, tile) in b.iter().enumerate() {
            let mut part = [[_mm512_setzero_si512(); T]; 2];
            for (g, values) in tile.iter().enumerate() {
                let wv = _mm512_load_si512(values.as_ptr() as *const __m512i);
                for i in 0..T {
                    let x = std::ptr::read_unaligned(
                        a[i].qs.as_ptr().add(32 * t + 4 * g) as *const i32
                    );
                    part[g / 4][i] = _mm512_dpbusd_epi32(part[g / 4][i], wv, _mm512_set1_epi32(x));
                }
            }
            for (h, part) in part.iter().enumerate() {
                let s = 2 * t + h;
                let [s0, s1] = pair.map(|block| block.scales.as_ptr().add(8 * s) as *const u8);
                let scales = _mm512_cvtepi8_epi32(bytes8(s0, s1));
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
