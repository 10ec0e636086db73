//! Activations quantized to 8 bits, once per row of a matmul's input, in the block layout
//! each weight format multiplies: [`ActBlock`] for the 32-value formats (ggml's `q8_1`);
//! the K-quants' [`ActBlockK`](super::ActBlockK) lives with them.

use half::f16;

use super::{Isa, QK};
use crate::kernels::parallel::{for_each_range, DisjointOut};

#[cfg(target_arch = "x86_64")]
mod avx2;

/// Activations of one matmul from which their quantization is spread over the pool (a
/// parallel call costs about a microsecond, a 576-value row's quantization about half one).
const PARALLEL_QUANTIZE_VALUES: usize = 2048;

/// A block of activations quantized to 8 bits, in the layout one weight format multiplies.
pub trait ActFormat: Copy + Send + Sync + 'static {
    /// Values per block.
    const LEN: usize;
    const ZERO: Self;
    /// Quantizes `LEN` values into `out`.
    fn quantize(x: &[f32], out: &mut Self);
    /// Quantizes a row of `out.len()` blocks, as [`quantize`](Self::quantize) does block by
    /// block (a format with a faster whole-row path gives the same bytes).
    fn quantize_row(x: &[f32], out: &mut [Self]) {
        quantize_blocks(x, out)
    }
    /// Value `i` as quantized (`d · q`).
    fn value(&self, i: usize) -> f32;
}

/// One quantized block of 32 activations: `x ≈ d · qs`, `s = d · Σ qs` rounded to f16 (for
/// Q4_1's offset), and `sum = Σ qs` exactly (for the interleaved kernels' offsets).
#[repr(C, align(32))]
#[derive(Clone, Copy)]
pub struct ActBlock {
    pub(super) qs: [i8; QK],
    pub(super) d: f32,
    pub(super) s: f32,
    pub(super) sum: i32,
}

impl ActFormat for ActBlock {
    const LEN: usize = QK;
    const ZERO: Self = Self {
        qs: [0; QK],
        d: 0.0,
        s: 0.0,
        sum: 0,
    };

    /// As ggml's `quantize_row_q8_1`: `d = amax / 127` rounded to f16, `q = round(x / d)`.
    fn quantize(xs: &[f32], block: &mut Self) {
        let d = quantize_i8(xs, &mut block.qs);
        let sum: i32 = block.qs.iter().map(|&q| q as i32).sum();
        let d16 = f16::from_f32(d);
        block.d = d16.to_f32();
        block.s = (f16::from_f32(sum as f32) * d16).to_f32();
        block.sum = sum;
    }

    fn quantize_row(x: &[f32], out: &mut [Self]) {
        #[cfg(target_arch = "x86_64")]
        if Isa::best() != Isa::Scalar {
            // SAFETY: every SIMD `Isa` includes AVX2 and F16C.
            return unsafe { avx2::quantize_row_q8_1(x, out) };
        }
        quantize_blocks(x, out)
    }

    fn value(&self, i: usize) -> f32 {
        self.d * self.qs[i] as f32
    }
}

/// `d = amax / 127` and `qs[i] = round(xs[i] / d)` (halves away from zero; 0 where `d` is 0),
/// with AVX2 where the CPU has it: the same bytes as the scalar loop for finite inputs.
pub fn quantize_i8(xs: &[f32], qs: &mut [i8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if Isa::best() != Isa::Scalar && xs.len().is_multiple_of(8) && qs.len() == xs.len() {
        // SAFETY: every SIMD `Isa` includes AVX2; the lengths are checked.
        return unsafe { avx2::quantize_i8(xs, qs) };
    }
    quantize_i8_scalar(xs, qs)
}

/// The portable [`quantize_i8`].
pub fn quantize_i8_scalar(xs: &[f32], qs: &mut [i8]) -> f32 {
    let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for (q, &v) in qs.iter_mut().zip(xs) {
        *q = (v * id).round() as i8;
    }
    d
}

/// Quantizes one row of activations (a whole number of blocks).
pub fn quantize_row<A: ActFormat>(x: &[f32], out: &mut [A]) {
    debug_assert_eq!(x.len(), out.len() * A::LEN);
    A::quantize_row(x, out)
}

/// Quantizes a row block by block ([`ActFormat::quantize`]).
fn quantize_blocks<A: ActFormat>(x: &[f32], out: &mut [A]) {
    for (xs, block) in x.chunks_exact(A::LEN).zip(out.iter_mut()) {
        A::quantize(xs, block);
    }
}

/// Quantizes the `m` rows of `x` into `acts` (as many blocks per row as `x` has values per
/// `A::LEN`), spread over the pool when there are enough values to pay for a parallel call.
pub(super) fn quantize_rows<A: ActFormat>(x: &[f32], m: usize, acts: &mut [A]) {
    assert!(m > 0 && acts.len() * A::LEN == x.len() && acts.len().is_multiple_of(m));
    let (kb, cols) = (acts.len() / m, x.len() / m);
    if m < 2 || x.len() < PARALLEL_QUANTIZE_VALUES {
        for (row, a) in x.chunks_exact(cols).zip(acts.chunks_exact_mut(kb)) {
            quantize_row(row, a);
        }
        return;
    }
    let out = DisjointOut::new(acts);
    for_each_range(m, |rows| {
        for row in rows {
            // SAFETY: row `row`'s `kb` blocks are this task's alone and lie inside `acts`
            // (`m · kb` blocks, asserted above).
            let a = unsafe { out.slice(row * kb, kb) };
            quantize_row(&x[row * cols..(row + 1) * cols], a);
        }
    });
}
