//! The 32-value ggml formats Q4_0, Q4_1, Q5_0 and Q8_0: one f16 scale (and Q4_1's f16 offset)
//! per block, multiplied with activations quantized in blocks of 32 ([`ActBlock`]).

use half::f16;

#[cfg(target_arch = "x86_64")]
use super::ByteDot;
use super::{ActBlock, WeightBlock, QK};

/// A 32-value format: its scale, offset and integer values; [`WeightBlock`] follows from these.
pub trait SimpleBlock: Copy + Send + Sync + 'static {
    const NAME: &'static str;
    /// Values are `0..=15` plus an offset `m` (Q4_1) rather than signed. The offset multiplies
    /// the activation block's sum rounded to f16, as ggml's `q8_1` does.
    const UNSIGNED: bool = false;
    /// The raw f16 bits of the scale `d`.
    fn d_bits(&self) -> u16;
    /// The raw f16 bits of the offset `m`.
    fn m_bits(&self) -> u16 {
        0
    }
    /// The 32 integer values: signed, or unsigned for `UNSIGNED` formats.
    fn values(&self) -> [i8; QK];
    /// The same 32 values in one register. Always inlined into the AVX2 kernels, so the
    /// intrinsics compile with their target features.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[cfg(target_arch = "x86_64")]
    unsafe fn unpack_avx2(&self) -> std::arch::x86_64::__m256i;
}

impl<B: SimpleBlock> WeightBlock for B {
    const NAME: &'static str = B::NAME;
    type Act = ActBlock;

    fn dot(&self, a: &ActBlock) -> f32 {
        let d = f16::from_bits(self.d_bits()).to_f32();
        let m = f16::from_bits(self.m_bits()).to_f32();
        let sumi: i32 = self
            .values()
            .iter()
            .zip(&a.qs)
            .map(|(&x, &y)| x as i32 * y as i32)
            .sum();
        d * a.d * sumi as f32 + if B::UNSIGNED { m * a.s } else { 0.0 }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn accumulate_avx2<const C: usize, const T: usize, D: ByteDot>(
        blocks: &[&Self; C],
        acts: &[&ActBlock; T],
        acc: &mut [[std::arch::x86_64::__m256; T]; C],
        offsets: &mut [[f32; T]; C],
    ) {
        use super::avx2::{dot_i8, f16_to_f32};
        use std::arch::x86_64::*;
        for c in 0..C {
            let wv = blocks[c].unpack_avx2();
            let d = f16_to_f32(blocks[c].d_bits());
            for r in 0..T {
                let av = _mm256_load_si256(acts[r].qs.as_ptr() as *const __m256i);
                let p = dot_i8::<D>(wv, av, B::UNSIGNED);
                acc[c][r] = _mm256_fmadd_ps(_mm256_set1_ps(d * acts[r].d), p, acc[c][r]);
            }
            if B::UNSIGNED {
                let m = f16_to_f32(blocks[c].m_bits());
                for r in 0..T {
                    offsets[c][r] += m * acts[r].s;
                }
            }
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ4_0 {
    pub(super) d: f16,
    pub(super) qs: [u8; 16],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ4_1 {
    pub(super) d: f16,
    pub(super) m: f16,
    pub(super) qs: [u8; 16],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ5_0 {
    pub(super) d: f16,
    pub(super) qh: [u8; 4],
    pub(super) qs: [u8; 16],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ8_0 {
    pub(super) d: f16,
    pub(super) qs: [i8; 32],
}

fn nibbles(qs: &[u8; 16]) -> [u8; QK] {
    let mut v = [0u8; QK];
    for j in 0..16 {
        v[j] = qs[j] & 0x0F;
        v[j + 16] = qs[j] >> 4;
    }
    v
}

impl SimpleBlock for BlockQ4_0 {
    const NAME: &'static str = "Q4_0";
    #[inline(always)]
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    fn values(&self) -> [i8; QK] {
        nibbles(&self.qs).map(|q| q as i8 - 8)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unpack_avx2(&self) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        _mm256_sub_epi8(super::avx2::nibbles(&self.qs), _mm256_set1_epi8(8))
    }
}

impl SimpleBlock for BlockQ4_1 {
    const NAME: &'static str = "Q4_1";
    const UNSIGNED: bool = true;
    #[inline(always)]
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    #[inline(always)]
    fn m_bits(&self) -> u16 {
        self.m.to_bits()
    }
    fn values(&self) -> [i8; QK] {
        nibbles(&self.qs).map(|q| q as i8)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unpack_avx2(&self) -> std::arch::x86_64::__m256i {
        super::avx2::nibbles(&self.qs)
    }
}

impl SimpleBlock for BlockQ5_0 {
    const NAME: &'static str = "Q5_0";
    #[inline(always)]
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    fn values(&self) -> [i8; QK] {
        let qh = u32::from_le_bytes(self.qh);
        let mut v = nibbles(&self.qs).map(|q| q as i8);
        for (j, x) in v.iter_mut().enumerate() {
            *x = (*x | ((((qh >> j) & 1) as i8) << 4)) - 16;
        }
        v
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unpack_avx2(&self) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // A clear fifth bit means value - 16: set the high nibble to 0xF (two's complement).
        let high = super::avx2::bytes_from_bits(u32::from_le_bytes(self.qh));
        let high = _mm256_andnot_si256(high, _mm256_set1_epi8(0xF0u8 as i8));
        _mm256_or_si256(super::avx2::nibbles(&self.qs), high)
    }
}

impl SimpleBlock for BlockQ8_0 {
    const NAME: &'static str = "Q8_0";
    #[inline(always)]
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    fn values(&self) -> [i8; QK] {
        self.qs
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unpack_avx2(&self) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        _mm256_loadu_si256(self.qs.as_ptr() as *const __m256i)
    }
}
