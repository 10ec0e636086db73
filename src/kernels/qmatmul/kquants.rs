//! The 256-value K-quant formats Q4_K and Q6_K, multiplied with activations quantized in
//! blocks of 256 with one scale and per-16 sums ([`ActBlockK`], ggml's `q8_K`), so a whole
//! super-block accumulates in integers and pays one float multiply.

use half::f16;

#[cfg(target_arch = "x86_64")]
use super::ByteDot;
use super::{ActFormat, WeightBlock};

/// Values per super-block.
pub const QK_K: usize = 256;

/// The K-quants' register tiles (see [`WeightBlock::TILES`]).
const K_TILES: &[(usize, usize)] = &[(1, 8), (2, 4), (2, 3), (2, 2), (2, 1)];

/// 256 activations: `x ≈ d · qs`, `bsums[k] = Σ qs[16k..16k + 16]` and
/// `bsums32[j] = Σ qs[32j..32j + 32]` (the padding to 32-byte alignment has room for them).
#[repr(C, align(32))]
#[derive(Clone, Copy)]
pub struct ActBlockK {
    pub(super) qs: [i8; QK_K],
    pub(super) bsums: [i16; 16],
    pub(super) bsums32: [i16; 8],
    pub(super) d: f32,
}

impl ActFormat for ActBlockK {
    const LEN: usize = QK_K;
    const ZERO: Self = Self {
        qs: [0; QK_K],
        bsums: [0; 16],
        bsums32: [0; 8],
        d: 0.0,
    };

    /// `d = amax / 127`, `q = round(x / d)`.
    fn quantize(x: &[f32], out: &mut Self) {
        let d = super::quantize_i8(x, &mut out.qs);
        for (s, qs) in out.bsums.iter_mut().zip(out.qs.chunks_exact(16)) {
            *s = qs.iter().map(|&q| q as i16).sum();
        }
        for (s, pair) in out.bsums32.iter_mut().zip(out.bsums.chunks_exact(2)) {
            *s = pair[0] + pair[1];
        }
        out.d = d;
    }

    fn value(&self, i: usize) -> f32 {
        self.d * self.qs[i] as f32
    }
}

/// 256 values: `d · sc_j · q - dmin · m_j` per 32-value sub-block `j`, with 4-bit `q` and
/// 6-bit `sc_j`, `m_j` packed into 12 bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ4K {
    pub(super) d: f16,
    pub(super) dmin: f16,
    scales: [u8; 12],
    pub(super) qs: [u8; 128],
}

/// 256 values: `d · sc_k · (q - 32)` with 6-bit `q` (low 4 bits in `ql`, high 2 in `qh`) and
/// a signed 8-bit scale `sc_k` per 16 values.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ6K {
    pub(super) ql: [u8; 128],
    pub(super) qh: [u8; 64],
    pub(super) scales: [i8; 16],
    pub(super) d: f16,
}

impl BlockQ4K {
    /// The 6-bit scales (bytes 0..8) and mins (bytes 8..16) of the 8 sub-blocks, unpacked
    /// from their 12-byte packing (ggml's `get_scale_min_k4`, done four bytes at a time).
    #[inline(always)]
    pub(super) fn scales_and_mins(&self) -> [u8; 16] {
        const LOW6: u32 = 0x3f3f_3f3f;
        const LOW4: u32 = 0x0f0f_0f0f;
        const LOW2: u32 = 0x0303_0303;
        let word = |i: usize| u32::from_le_bytes(self.scales[4 * i..4 * i + 4].try_into().unwrap());
        let (a, b, c) = (word(0), word(1), word(2));
        let words = [
            a & LOW6,
            (c & LOW4) | (((a >> 6) & LOW2) << 4),
            b & LOW6,
            ((c >> 4) & LOW4) | (((b >> 6) & LOW2) << 4),
        ];
        let mut bytes = [0u8; 16];
        for (chunk, w) in bytes.chunks_exact_mut(4).zip(words) {
            chunk.copy_from_slice(&w.to_le_bytes());
        }
        bytes
    }

    /// The 4-bit values of sub-block `j`: low nibbles of `qs[32(j/2)..]` for even `j`, high
    /// for odd.
    fn values(&self, j: usize) -> impl Iterator<Item = i32> + '_ {
        let shift = 4 * (j % 2);
        self.qs[32 * (j / 2)..][..32]
            .iter()
            .map(move |q| ((q >> shift) & 0x0F) as i32)
    }
}

impl WeightBlock for BlockQ4K {
    const NAME: &'static str = "Q4_K";
    type Act = ActBlockK;
    const TILES: &'static [(usize, usize)] = K_TILES;

    fn dot(&self, a: &ActBlockK) -> f32 {
        let sm = self.scales_and_mins();
        let (mut sumi, mut summ) = (0i32, 0i32);
        for j in 0..8 {
            let dot: i32 = self
                .values(j)
                .zip(&a.qs[32 * j..32 * j + 32])
                .map(|(w, &x)| w * x as i32)
                .sum();
            sumi += sm[j] as i32 * dot;
            summ += sm[8 + j] as i32 * (a.bsums[2 * j] as i32 + a.bsums[2 * j + 1] as i32);
        }
        a.d * (self.d.to_f32() * sumi as f32 - self.dmin.to_f32() * summ as f32)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn accumulate_avx2<const C: usize, const T: usize, D: ByteDot>(
        blocks: &[&Self; C],
        acts: &[&ActBlockK; T],
        acc: &mut [[std::arch::x86_64::__m256; T]; C],
        _offsets: &mut [[f32; T]; C],
    ) {
        use super::avx2::f16_to_f32;
        use std::arch::x86_64::*;
        // Each min in the two 16-bit lanes that meet the two per-16 sums of its sub-block.
        let mut mins = [_mm256_setzero_si256(); C];
        let mut d = [0f32; C];
        let mut dmin = [0f32; C];
        for c in 0..C {
            let sm = blocks[c].scales_and_mins();
            let sm = _mm_loadu_si128(sm.as_ptr() as *const __m128i);
            let pairs = _mm_set_epi64x(0x0f0f_0e0e_0d0d_0c0c, 0x0b0b_0a0a_0909_0808);
            mins[c] = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(sm, pairs));
            d[c] = f16_to_f32(blocks[c].d.to_bits());
            dmin[c] = f16_to_f32(blocks[c].dmin.to_bits());
        }
        let sumi = q4k_sums_256(blocks, acts);
        for r in 0..T {
            let a = acts[r];
            let bsums = _mm256_load_si256(a.bsums.as_ptr() as *const __m256i);
            for c in 0..C {
                let summ = _mm256_madd_epi16(mins[c], bsums);
                let v = _mm256_fmadd_ps(
                    _mm256_set1_ps(d[c] * a.d),
                    _mm256_cvtepi32_ps(sumi[c][r]),
                    acc[c][r],
                );
                acc[c][r] =
                    _mm256_fmadd_ps(_mm256_set1_ps(-dmin[c] * a.d), _mm256_cvtepi32_ps(summ), v);
            }
        }
    }
}

/// Per weight row × activation row, eight partial sums of `Σ_j sc_j · (q · x)_j` over a
/// Q4_K super-block, with AVX2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q4k_sums_256<const C: usize, const T: usize>(
    blocks: &[&BlockQ4K; C],
    acts: &[&ActBlockK; T],
) -> [[std::arch::x86_64::__m256i; T]; C] {
    use std::arch::x86_64::*;
    // Per weight row: each sub-block's scale in every 16-bit lane.
    let mut scale = [[_mm256_setzero_si256(); 8]; C];
    for c in 0..C {
        let sm = blocks[c].scales_and_mins();
        let sm = _mm_loadu_si128(sm.as_ptr() as *const __m128i);
        let scales = _mm256_cvtepu8_epi16(sm);
        let scales = _mm256_permute2x128_si256::<0>(scales, scales);
        for (j, s) in scale[c].iter_mut().enumerate() {
            let lane = 2 * j as i16;
            *s = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(lane | ((lane + 1) << 8)));
        }
    }
    let m4 = _mm256_set1_epi8(0x0F);
    let mut sumi = [[_mm256_setzero_si256(); T]; C];
    for (j, x_at) in (0..QK_K).step_by(32).enumerate() {
        // Sub-block j: the low (even j) or high (odd j) nibbles of 32 bytes.
        let mut q = [_mm256_setzero_si256(); C];
        for c in 0..C {
            let bits =
                _mm256_loadu_si256(blocks[c].qs.as_ptr().add(32 * (j / 2)) as *const __m256i);
            let bits = if j % 2 == 0 {
                bits
            } else {
                _mm256_srli_epi16(bits, 4)
            };
            q[c] = _mm256_and_si256(bits, m4);
        }
        for r in 0..T {
            let x = _mm256_load_si256(acts[r].qs.as_ptr().add(x_at) as *const __m256i);
            for c in 0..C {
                let p = _mm256_madd_epi16(scale[c][j], _mm256_maddubs_epi16(q[c], x));
                sumi[c][r] = _mm256_add_epi32(sumi[c][r], p);
            }
        }
    }
    sumi
}

impl BlockQ6K {
    /// The 6-bit values (before the -32) of sub-block `4n + k` (`n` the 128-value half, `k`
    /// in 0..4): the low (k < 2) or high nibbles of `ql[64n + 32(k % 2)..][..32]` and bits
    /// `2k..2k + 2` of `qh[32n..][..32]`.
    fn values(&self, sub: usize) -> impl Iterator<Item = i32> + '_ {
        let (n, k) = (sub / 4, sub % 4);
        let ql = &self.ql[64 * n + 32 * (k % 2)..][..32];
        let qh = &self.qh[32 * n..][..32];
        let lo_shift = 4 * (k / 2);
        ql.iter()
            .zip(qh)
            .map(move |(l, h)| (((l >> lo_shift) & 0x0F) | (((h >> (2 * k)) & 3) << 4)) as i32)
    }
}

impl WeightBlock for BlockQ6K {
    const NAME: &'static str = "Q6_K";
    type Act = ActBlockK;
    const TILES: &'static [(usize, usize)] = K_TILES;

    fn dot(&self, a: &ActBlockK) -> f32 {
        let mut sumi = 0i32;
        for sub in 0..8 {
            for (i, (w, &x)) in self
                .values(sub)
                .zip(&a.qs[32 * sub..32 * sub + 32])
                .enumerate()
            {
                sumi += self.scales[2 * sub + i / 16] as i32 * (w - 32) * x as i32;
            }
        }
        a.d * self.d.to_f32() * sumi as f32
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn accumulate_avx2<const C: usize, const T: usize, D: ByteDot>(
        blocks: &[&Self; C],
        acts: &[&ActBlockK; T],
        acc: &mut [[std::arch::x86_64::__m256; T]; C],
        _offsets: &mut [[f32; T]; C],
    ) {
        use super::avx2::f16_to_f32;
        use std::arch::x86_64::*;
        let sumi = q6k_sums_256(blocks, acts);
        for c in 0..C {
            let w = blocks[c];
            // The -32 on every value: Σ sc_k · 32 · bsum_k.
            let scales16 =
                _mm256_cvtepi8_epi16(_mm_loadu_si128(w.scales.as_ptr() as *const __m128i));
            let d = f16_to_f32(w.d.to_bits());
            for r in 0..T {
                let a = acts[r];
                let bsums = _mm256_load_si256(a.bsums.as_ptr() as *const __m256i);
                let offset = _mm256_slli_epi32(_mm256_madd_epi16(scales16, bsums), 5);
                let total = _mm256_sub_epi32(sumi[c][r], offset);
                acc[c][r] = _mm256_fmadd_ps(
                    _mm256_set1_ps(d * a.d),
                    _mm256_cvtepi32_ps(total),
                    acc[c][r],
                );
            }
        }
    }
}

/// Per weight row × activation row, eight partial sums of `Σ_k sc_k · (q · x)_k` over a
/// Q6_K super-block (the -32 left out), with AVX2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q6k_sums_256<const C: usize, const T: usize>(
    blocks: &[&BlockQ6K; C],
    acts: &[&ActBlockK; T],
) -> [[std::arch::x86_64::__m256i; T]; C] {
    use std::arch::x86_64::*;
    let m4 = _mm256_set1_epi8(0x0F);
    let mut sumi = [[_mm256_setzero_si256(); T]; C];
    for sub in 0..8 {
        let (n, k) = (sub / 4, sub % 4);
        let mut q = [_mm256_setzero_si256(); C];
        let mut scale = [_mm256_setzero_si256(); C];
        // Scales 2·sub and 2·sub + 1, each over 8 16-bit lanes.
        let pick = _mm_set_epi64x(
            i64::from_ne_bytes([2 * sub as u8 + 1; 8]),
            i64::from_ne_bytes([2 * sub as u8; 8]),
        );
        for c in 0..C {
            let w = blocks[c];
            let ql = _mm256_loadu_si256(w.ql.as_ptr().add(64 * n + 32 * (k % 2)) as *const __m256i);
            let ql = if k < 2 { ql } else { _mm256_srli_epi16(ql, 4) };
            let qh = _mm256_loadu_si256(w.qh.as_ptr().add(32 * n) as *const __m256i);
            q[c] = _mm256_or_si256(_mm256_and_si256(ql, m4), q6k_high(qh, 2 * k as i32));
            let scales = _mm_loadu_si128(w.scales.as_ptr() as *const __m128i);
            scale[c] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, pick));
        }
        for r in 0..T {
            let x = _mm256_load_si256(acts[r].qs.as_ptr().add(32 * sub) as *const __m256i);
            for c in 0..C {
                let p = _mm256_madd_epi16(scale[c], _mm256_maddubs_epi16(q[c], x));
                sumi[c][r] = _mm256_add_epi32(sumi[c][r], p);
            }
        }
    }
    sumi
}

/// Bits `shift..shift + 2` of each byte of `qh`, moved to bits 4..6.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q6k_high(qh: std::arch::x86_64::__m256i, shift: i32) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let h = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift));
    // (qh & 3) << 4 stays inside each byte, so 16-bit shifts are exact.
    _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(3)), 4)
}
