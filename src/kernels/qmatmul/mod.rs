//! Quantized matrix multiplication `y = x Wᵀ` for the ggml block formats Q4_0, Q4_1, Q5_0 and
//! Q8_0, with activations quantized to 8 bits once per row and integer dot products.
//!
//! * Weights stay in their ggml block layout (copied once at load into typed, aligned blocks:
//!   no repacking, no extra memory beyond that copy).
//! * Batched: each task (see `kernels::parallel`) owns a range of output columns and computes
//!   register tiles of up to [`COL_TILE`] weight rows × [`ROW_TILE`] activation rows, so a
//!   batch of 16 reads every weight byte from memory once (the rows stay in L1 for the other
//!   row tiles).
//! * Runtime dispatch: AVX2+FMA+F16C when the CPU has them, else a portable scalar path with
//!   the same block arithmetic. Activation quantization follows ggml (`quantize_row_q8_0` /
//!   `_q8_1`, scales rounded to f16), so results agree with ggml-style implementations.
//! * No allocation per call beyond a thread-local scratch buffer that grows to the largest
//!   batch seen.

use std::cell::RefCell;

use half::f16;

use super::parallel::{for_each_range, DisjointOut};

/// Values per block, for every format here.
pub const QK: usize = 32;
/// Activation rows that share one unpacked weight block.
pub const ROW_TILE: usize = 4;
/// Weight rows processed together (independent accumulators hide FMA latency).
pub const COL_TILE: usize = 4;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ4_0 {
    d: f16,
    qs: [u8; 16],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ4_1 {
    d: f16,
    m: f16,
    qs: [u8; 16],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ5_0 {
    d: f16,
    qh: [u8; 4],
    qs: [u8; 16],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ8_0 {
    d: f16,
    qs: [i8; 32],
}

/// One quantized block of activations: `x ≈ d · qs`, and `s = d · Σ qs` (for Q4_1's offset).
#[repr(C, align(32))]
#[derive(Clone, Copy)]
pub struct ActBlock {
    qs: [i8; QK],
    d: f32,
    s: f32,
}

/// A weight block format: its scalar meaning and, on x86-64, its AVX2 unpacking.
pub trait WeightBlock: Copy + Send + Sync + 'static {
    /// ggml's name, for errors.
    const NAME: &'static str;
    /// Values are `0..=15` plus an offset `m` (Q4_1) rather than signed.
    const UNSIGNED: bool = false;
    fn d(&self) -> f32;
    /// The raw f16 bits of `d` (the SIMD path converts them itself).
    fn d_bits(&self) -> u16;
    fn m(&self) -> f32 {
        0.0
    }
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

fn nibbles(qs: &[u8; 16]) -> [u8; QK] {
    let mut v = [0u8; QK];
    for j in 0..16 {
        v[j] = qs[j] & 0x0F;
        v[j + 16] = qs[j] >> 4;
    }
    v
}

impl WeightBlock for BlockQ4_0 {
    const NAME: &'static str = "Q4_0";
    #[inline(always)]
    fn d(&self) -> f32 {
        self.d.to_f32()
    }
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
        _mm256_sub_epi8(avx2::nibbles(&self.qs), _mm256_set1_epi8(8))
    }
}

impl WeightBlock for BlockQ4_1 {
    const NAME: &'static str = "Q4_1";
    const UNSIGNED: bool = true;
    #[inline(always)]
    fn d(&self) -> f32 {
        self.d.to_f32()
    }
    #[inline(always)]
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    #[inline(always)]
    fn m(&self) -> f32 {
        self.m.to_f32()
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
        avx2::nibbles(&self.qs)
    }
}

impl WeightBlock for BlockQ5_0 {
    const NAME: &'static str = "Q5_0";
    #[inline(always)]
    fn d(&self) -> f32 {
        self.d.to_f32()
    }
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
        let high = avx2::bytes_from_bits(u32::from_le_bytes(self.qh));
        let high = _mm256_andnot_si256(high, _mm256_set1_epi8(0xF0u8 as i8));
        _mm256_or_si256(avx2::nibbles(&self.qs), high)
    }
}

impl WeightBlock for BlockQ8_0 {
    const NAME: &'static str = "Q8_0";
    #[inline(always)]
    fn d(&self) -> f32 {
        self.d.to_f32()
    }
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

/// Quantizes one row of `k` activations (`k` a multiple of [`QK`]) as ggml's
/// `quantize_row_q8_1` does: `d = amax / 127` rounded to f16, `q = round(x / d)`.
pub fn quantize_row(x: &[f32], out: &mut [ActBlock]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    for (xs, block) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in block.qs.iter_mut().zip(xs) {
            *q = (v * id).round() as i8;
            sum += *q as i32;
        }
        let d16 = f16::from_f32(d);
        block.d = d16.to_f32();
        block.s = (f16::from_f32(sum as f32) * d16).to_f32();
    }
}

/// A `[rows, cols]` weight matrix in one block format.
pub struct QuantMatrix<B: WeightBlock> {
    rows: usize,
    cols: usize,
    blocks: Vec<B>,
}

impl<B: WeightBlock> QuantMatrix<B> {
    /// Reads ggml's raw bytes; `None` if the byte count does not match the shape.
    pub fn from_bytes(rows: usize, cols: usize, bytes: &[u8]) -> Option<Self> {
        let size = std::mem::size_of::<B>();
        if !cols.is_multiple_of(QK) || bytes.len() != rows * cols / QK * size {
            return None;
        }
        let blocks = bytes
            .chunks_exact(size)
            // SAFETY: `B` is a `repr(C)` block of plain integer and f16 fields, any bit
            // pattern is valid, and `read_unaligned` needs no alignment.
            .map(|c| unsafe { std::ptr::read_unaligned(c.as_ptr() as *const B) })
            .collect();
        Some(Self { rows, cols, blocks })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn storage_bytes(&self) -> usize {
        self.blocks.len() * std::mem::size_of::<B>()
    }

    /// `out[m × rows] = x[m × cols] · Wᵀ`.
    pub fn matmul(&self, x: &[f32], out: &mut [f32]) {
        let m = x.len() / self.cols.max(1);
        assert_eq!(
            x.len(),
            m * self.cols,
            "input is not a whole number of rows"
        );
        assert_eq!(out.len(), m * self.rows, "output has the wrong size");
        if m == 0 {
            return;
        }
        let kb = self.cols / QK;
        thread_local! {
            static SCRATCH: RefCell<Vec<ActBlock>> = const { RefCell::new(Vec::new()) };
        }
        SCRATCH.with(|cell| {
            let mut acts = cell.borrow_mut();
            let zero = ActBlock {
                qs: [0; QK],
                d: 0.0,
                s: 0.0,
            };
            acts.resize(m * kb, zero);
            for (row, a) in x.chunks_exact(self.cols).zip(acts.chunks_exact_mut(kb)) {
                quantize_row(row, a);
            }
            self.matmul_quantized(&acts[..m * kb], m, out);
        });
    }

    fn matmul_quantized(&self, acts: &[ActBlock], m: usize, out: &mut [f32]) {
        let kb = self.cols / QK;
        let n = self.rows;
        let out = DisjointOut::new(out);
        let use_avx2 = has_avx2_fma();
        // Work items are groups of COL_TILE output columns.
        for_each_range(n.div_ceil(COL_TILE), |groups| {
            let cols_start = groups.start * COL_TILE;
            let cols_end = (groups.end * COL_TILE).min(n);
            for r0 in (0..m).step_by(ROW_TILE) {
                let rows = ROW_TILE.min(m - r0);
                let row_acts = &acts[r0 * kb..(r0 + rows) * kb];
                // Fewer columns at a time for taller row tiles: accumulators stay in registers.
                let group = if rows <= 2 { COL_TILE } else { COL_TILE / 2 };
                let mut col = cols_start;
                while col < cols_end {
                    let cols = if col + group <= cols_end { group } else { 1 };
                    let w = &self.blocks[col * kb..(col + cols) * kb];
                    let mut sums = [0f32; COL_TILE * ROW_TILE];
                    dot_tile(w, cols, row_acts, kb, &mut sums[..cols * rows], use_avx2);
                    for r in 0..rows {
                        // SAFETY: columns col..col + cols of row r0 + r belong to this task's
                        // column range only, and lie inside `out` (m × n) by the asserts in
                        // `matmul`.
                        let dst = unsafe { out.slice((r0 + r) * n + col, cols) };
                        for (c, d) in dst.iter_mut().enumerate() {
                            *d = sums[c * rows + r];
                        }
                    }
                    col += cols;
                }
            }
        });
    }
}

fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Dot products of `cols` consecutive weight rows (`w`, `kb` blocks each) with `rows`
/// activation rows; `sums[c * rows + r]` receives weight row `c` · activation row `r`.
fn dot_tile<B: WeightBlock>(
    w: &[B],
    cols: usize,
    acts: &[ActBlock],
    kb: usize,
    sums: &mut [f32],
    use_avx2: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if use_avx2 {
        // SAFETY: AVX2, FMA and F16C were detected at run time.
        unsafe { avx2::dot_tile(w, cols, acts, kb, sums) };
        return;
    }
    let _ = use_avx2;
    dot_tile_scalar(w, cols, acts, kb, sums);
}

/// The portable path, and the reference the SIMD path is tested against.
pub fn dot_tile_scalar<B: WeightBlock>(
    w: &[B],
    cols: usize,
    acts: &[ActBlock],
    kb: usize,
    sums: &mut [f32],
) {
    let rows = sums.len() / cols.max(1);
    for c in 0..cols {
        for r in 0..rows {
            let mut total = 0f32;
            for (wb, ab) in w[c * kb..(c + 1) * kb]
                .iter()
                .zip(&acts[r * kb..(r + 1) * kb])
            {
                let sumi: i32 = wb
                    .values()
                    .iter()
                    .zip(&ab.qs)
                    .map(|(&x, &y)| x as i32 * y as i32)
                    .sum();
                total += wb.d() * ab.d * sumi as f32 + wb.m() * ab.s;
            }
            sums[c * rows + r] = total;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random_blocks<B: WeightBlock>(n: usize, rng: &mut impl Rng) -> Vec<u8> {
        let size = std::mem::size_of::<B>();
        let mut bytes: Vec<u8> = (0..n * size).map(|_| rng.random()).collect();
        // Scales (and Q4_1's offset) as sane f16 values rather than random bit patterns.
        let fields = if B::UNSIGNED { 2 } else { 1 };
        for block in bytes.chunks_exact_mut(size) {
            for f in 0..fields {
                let v = f16::from_f32(rng.random_range(-0.05..0.05));
                block[2 * f..2 * f + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        bytes
    }

    /// Dequantize-then-multiply in f64 over the quantized activations: the plain reference.
    /// Q4_1's offset term uses the block's stored `s = d · Σ q` (f16-rounded, as in ggml).
    fn dense_reference<B: WeightBlock>(
        m: &QuantMatrix<B>,
        acts: &[ActBlock],
        rows: usize,
    ) -> Vec<f32> {
        let kb = m.cols / QK;
        let mut out = vec![0f32; rows * m.rows];
        for r in 0..rows {
            for c in 0..m.rows {
                let mut total = 0f64;
                for b in 0..kb {
                    let wb = &m.blocks[c * kb + b];
                    let ab = &acts[r * kb + b];
                    for (w, a) in wb.values().iter().zip(&ab.qs) {
                        total += (wb.d() as f64 * *w as f64) * (ab.d as f64 * *a as f64);
                    }
                    total += wb.m() as f64 * ab.s as f64;
                }
                out[r * m.rows + c] = total as f32;
            }
        }
        out
    }

    fn check<B: WeightBlock>(rows: usize, cols: usize, batch: usize) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64((rows * 31 + cols * 7 + batch) as u64);
        let bytes = random_blocks::<B>(rows * cols / QK, &mut rng);
        let m = QuantMatrix::<B>::from_bytes(rows, cols, &bytes).unwrap();
        let x: Vec<f32> = (0..batch * cols)
            .map(|_| rng.random_range(-3.0..3.0))
            .collect();
        let mut out = vec![f32::NAN; batch * rows];
        m.matmul(&x, &mut out);

        let kb = cols / QK;
        let zero = ActBlock {
            qs: [0; QK],
            d: 0.0,
            s: 0.0,
        };
        let mut acts = vec![zero; batch * kb];
        for (row, a) in x.chunks_exact(cols).zip(acts.chunks_exact_mut(kb)) {
            quantize_row(row, a);
        }
        let want = dense_reference(&m, &acts, batch);
        let mut scalar = vec![0f32; batch * rows];
        for c in 0..rows {
            let mut sums = vec![0f32; batch];
            dot_tile_scalar(&m.blocks[c * kb..(c + 1) * kb], 1, &acts, kb, &mut sums);
            for r in 0..batch {
                scalar[r * rows + c] = sums[r];
            }
        }
        for (i, ((got, s), w)) in out.iter().zip(&scalar).zip(&want).enumerate() {
            let tol = 1e-4 * (1.0 + w.abs());
            assert!(
                (got - w).abs() < tol,
                "{} {rows}x{cols} b{batch} [{i}]: {got} vs {w}",
                B::NAME
            );
            assert!((s - w).abs() < tol, "{} scalar [{i}]: {s} vs {w}", B::NAME);
        }
    }

    fn check_shapes<B: WeightBlock>() {
        for (rows, cols, batch) in [
            (1, 32, 1),
            (7, 64, 17),
            (33, 96, 4),
            (64, 256, 16),
            (5, 32, 0),
        ] {
            check::<B>(rows, cols, batch);
        }
    }

    #[test]
    fn q4_0_matches_the_dense_reference() {
        check_shapes::<BlockQ4_0>();
    }

    #[test]
    fn q4_1_matches_the_dense_reference() {
        check_shapes::<BlockQ4_1>();
    }

    #[test]
    fn q5_0_matches_the_dense_reference() {
        check_shapes::<BlockQ5_0>();
    }

    #[test]
    fn q8_0_matches_the_dense_reference() {
        check_shapes::<BlockQ8_0>();
    }

    #[test]
    fn wrong_byte_counts_are_rejected() {
        assert!(QuantMatrix::<BlockQ4_0>::from_bytes(2, 32, &[0; 35]).is_none());
        assert!(QuantMatrix::<BlockQ4_0>::from_bytes(2, 48, &[0; 54]).is_none());
    }

    #[test]
    fn activation_quantization_round_trips_within_half_a_step() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 5.0).collect();
        let zero = ActBlock {
            qs: [0; QK],
            d: 0.0,
            s: 0.0,
        };
        let mut a = vec![zero; 2];
        quantize_row(&x, &mut a);
        for (b, xs) in a.iter().zip(x.chunks_exact(QK)) {
            for (q, v) in b.qs.iter().zip(xs) {
                assert!((*q as f32 * b.d - v).abs() <= b.d * 0.51 + 1e-3);
            }
        }
    }
}
