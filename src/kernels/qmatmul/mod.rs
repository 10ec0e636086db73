//! Quantized matrix multiplication `y = x Wᵀ` for the ggml block formats Q4_0, Q4_1, Q5_0,
//! Q8_0, Q4_K and Q6_K, with activations quantized to 8 bits once per row and integer dot
//! products.
//!
//! * Matrices with whole groups of eight rows (every quantized matrix of the shipped models)
//!   are repacked exactly at load into [`PackedMatrix`] (module `interleaved`), eight rows interleaved,
//!   whose kernels pay fewer multiplies per multiply-add and no horizontal sums; the ggml copy
//!   is then dropped unless the tensor is also the embedding. [`QuantMatrix`] keeps the rest
//!   in their ggml block layout and reads them in place where the loader keeps them.
//! * Activations are quantized per weight block: in blocks of 32 with their own scale for the
//!   32-value formats (ggml's `q8_1`, [`ActBlock`]), in blocks of 256 with one scale and
//!   per-16 sums for the K-quants (ggml's `q8_K`, [`ActBlockK`]), so a K-quant super-block
//!   accumulates in integers and pays one float multiply.
//! * Batched: each task (see `kernels::parallel`) owns a range of output columns and computes
//!   register tiles of up to [`MAX_TILE`] dot products ([`WeightBlock::TILES`]); it takes its
//!   columns a slice at a time, passing every row tile over one slice while it sits in L2, so
//!   a batch reads every weight byte from memory once.
//! * Runtime dispatch ([`Isa`]): AVX2+FMA+F16C, with AVX-512 VNNI's or AVX-VNNI's integer dot
//!   products (`vpdpbusd` on 256-bit registers; see [`ByteDot`]: every interleaved format and
//!   the row-major 32-value ones, the row-major K-quants keep their AVX2 arithmetic) where
//!   present, else a portable scalar path with the same block arithmetic.
//!   `tests/emulated_isa.rs` runs the VNNI paths on emulated CPUs.
//! * [`registry`] is the one place a matrix gets its kernel (the layout and block type for its
//!   format and shape); the model layer names formats, never block types.
//! * No allocation per call beyond a thread-local scratch buffer that grows to the largest
//!   batch seen (and the output vector, for [`QuantKernel::matmul_vec`]).

use std::cell::RefCell;
use std::marker::PhantomData;
use std::ops::Range;

use super::parallel::{for_each_range_tail, DisjointOut};

mod acts;
pub mod amx;
mod blocks;
#[cfg(target_arch = "x86_64")]
pub use avx2::{Avx2Dot, Avx512VnniDot, AvxVnniDot, ByteDot};
mod interleaved;
mod isa;
mod kquants;
pub mod peak;
pub mod registry;
use acts::quantize_rows;
pub use acts::{quantize_i8, quantize_i8_scalar, quantize_row, ActBlock, ActFormat};
pub use blocks::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ8_0, SimpleBlock};
pub use interleaved::{
    BlockQ4Kx8, BlockQ4_0x8, BlockQ4_1x8, BlockQ5_0x8, BlockQ6Kx8, BlockQ8_0x8, GatedPacked,
    Interleaved, PackedMatrix, PackedQ4K, PackedQ4_0, PackedQ4_1, PackedQ5_0, PackedQ6K,
    PackedQ8_0,
};
pub use isa::{Isa, IsaError};
pub use kquants::{ActBlockK, BlockQ4K, BlockQ6K, QK_K};

/// Values per block of the 32-value formats.
pub const QK: usize = 32;
/// Weight rows a work item covers.
pub const COL_GROUP: usize = 4;
/// The most dot products one register tile computes (weight rows × activation rows).
pub const MAX_TILE: usize = 8;
/// Most bytes of weights in the last chunks of a matmul's work (a sixteenth of a thread's
/// share where that is less; one work item where an item is larger): about two microseconds
/// of one thread's streaming at batch 1, so the caller seldom waits long for the last worker.
/// A fixed fraction of the work made the LM head's last chunks about a megabyte each.
const TAIL_CHUNK_BYTES: usize = 16 * 1024;
/// Bytes of weights a task passes every row tile over before it moves on: well inside L2.
const WEIGHT_SLICE_BYTES: usize = 96 * 1024;

/// A weight block format: what the matmul needs from it.
pub trait WeightBlock: Copy + Send + Sync + 'static {
    /// ggml's name, for errors.
    const NAME: &'static str;
    /// The activation blocks it multiplies, one per weight block.
    type Act: ActFormat;
    /// The register tiles the SIMD kernels take, as (weight rows, activation rows), tallest
    /// first: a row tile is the first whose height fits the rows left, and its columns
    /// shrink to 1 at the end of a task's range. The 32-value formats unpack a block in a
    /// few instructions and take wide tiles; the K-quants take tall ones, so the unpacking
    /// of a super-block's scales is shared by more activation rows.
    const TILES: &'static [(usize, usize)] = &[(2, 4), (2, 3), (4, 2), (4, 1)];
    /// This block · one activation block: the portable path.
    fn dot(&self, a: &Self::Act) -> f32;
    /// Adds `blocks[c]` · `acts[r]` to `acc[c][r]` (eight partial sums) or `offsets[c][r]`
    /// for a tile of `C` weight rows × `T` activation rows, multiplying bytes as `D` does.
    /// Always inlined into the SIMD kernels, so the intrinsics compile with their target
    /// features.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C, and `D`'s instructions.
    #[cfg(target_arch = "x86_64")]
    unsafe fn accumulate_avx2<const C: usize, const T: usize, D: ByteDot>(
        blocks: &[&Self; C],
        acts: &[&Self::Act; T],
        acc: &mut [[std::arch::x86_64::__m256; T]; C],
        offsets: &mut [[f32; T]; C],
    );
}

/// A `[rows, cols]` weight matrix in one block format, read in place from bytes it owns or
/// shares (a loaded checkpoint's tensor, say).
pub struct QuantMatrix<B: WeightBlock> {
    rows: usize,
    cols: usize,
    data: Box<dyn AsRef<[u8]> + Send + Sync>,
    _format: PhantomData<B>,
}

/// Blocks copied into memory aligned for `B`.
struct OwnedBlocks<B>(Vec<B>);

impl<B: WeightBlock> AsRef<[u8]> for OwnedBlocks<B> {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `B` is a `repr(C)` block of plain integer and f16 fields without padding;
        // its bytes are initialised.
        unsafe {
            std::slice::from_raw_parts(
                self.0.as_ptr() as *const u8,
                std::mem::size_of_val(self.0.as_slice()),
            )
        }
    }
}

impl<B: WeightBlock> QuantMatrix<B> {
    /// Values per weight block.
    const BLOCK: usize = B::Act::LEN;

    fn shape_fits(rows: usize, cols: usize, bytes: usize) -> bool {
        cols.is_multiple_of(Self::BLOCK)
            && bytes == rows * cols / Self::BLOCK * std::mem::size_of::<B>()
    }

    /// Copies ggml's raw bytes; `None` if the byte count does not match the shape.
    pub fn from_bytes(rows: usize, cols: usize, bytes: &[u8]) -> Option<Self> {
        if !Self::shape_fits(rows, cols, bytes.len()) {
            return None;
        }
        let blocks: Vec<B> = bytes
            .chunks_exact(std::mem::size_of::<B>())
            // SAFETY: `B` is a `repr(C)` block of plain integer and f16 fields, any bit
            // pattern is valid, and `read_unaligned` needs no alignment.
            .map(|c| unsafe { std::ptr::read_unaligned(c.as_ptr() as *const B) })
            .collect();
        Some(Self {
            rows,
            cols,
            data: Box::new(OwnedBlocks(blocks)),
            _format: PhantomData,
        })
    }

    /// Reads ggml's raw bytes where `owner` keeps them, without a copy; `None` if the byte
    /// count does not match the shape or the bytes are not aligned for `B`.
    pub fn in_place(
        rows: usize,
        cols: usize,
        owner: impl AsRef<[u8]> + Send + Sync + 'static,
    ) -> Option<Self> {
        let bytes = owner.as_ref();
        let aligned = (bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<B>());
        if !aligned || !Self::shape_fits(rows, cols, bytes.len()) {
            return None;
        }
        Some(Self {
            rows,
            cols,
            data: Box::new(owner),
            _format: PhantomData,
        })
    }

    fn blocks(&self) -> &[B] {
        let bytes = (*self.data).as_ref();
        // SAFETY: checked at construction: the length is a whole number of blocks and the
        // pointer is aligned for `B`; any bit pattern is a valid `B`; the owner keeps the
        // bytes, unchanged, as long as `self`.
        unsafe {
            std::slice::from_raw_parts(
                bytes.as_ptr() as *const B,
                bytes.len() / std::mem::size_of::<B>(),
            )
        }
    }
}

// SAFETY: `matmul_quantized` writes every output value: the row tiles cover `0..m`, and each
// task's columns end with one-column tiles up to its last.
unsafe impl<B: WeightBlock> QuantKernel for QuantMatrix<B> {
    type Act = B::Act;

    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn storage_bytes(&self) -> usize {
        (*self.data).as_ref().len()
    }

    fn prefetch_ahead(&self) {
        super::parallel::prefetch_ahead((*self.data).as_ref())
    }

    unsafe fn matmul_quantized(&self, acts: &[B::Act], m: usize, out: DisjointOut, isa: Isa) {
        let kb = self.cols / Self::BLOCK;
        let n = self.rows;
        let blocks = self.blocks();
        // Work items are groups of COL_GROUP output columns.
        let group_bytes = COL_GROUP * kb * std::mem::size_of::<B>();
        let tile_rows = |left| tile_shape::<B>(left).1;
        for_each_slice_tile(
            n.div_ceil(COL_GROUP),
            group_bytes,
            m,
            tile_rows,
            |items, r| {
                let (group, rows) = tile_shape::<B>(r.len());
                let row_acts = &acts[r.start * kb..r.end * kb];
                let slice_end = (items.end * COL_GROUP).min(n);
                let mut col = items.start * COL_GROUP;
                while col < slice_end {
                    let cols = if col + group <= slice_end { group } else { 1 };
                    let w = &blocks[col * kb..(col + cols) * kb];
                    let mut sums = [0f32; MAX_TILE];
                    dot_tile(w, cols, row_acts, kb, &mut sums[..cols * rows], isa);
                    for row in 0..rows {
                        let mut values = [0f32; MAX_TILE];
                        for (c, v) in values[..cols].iter_mut().enumerate() {
                            *v = sums[c * rows + row];
                        }
                        // SAFETY: columns col..col + cols of row r.start + row belong to this
                        // task's items only, and lie inside `out` (m × n values, as
                        // `matmul_quantized`'s caller promised).
                        unsafe { out.write((r.start + row) * n + col, &values[..cols]) };
                    }
                    col += cols;
                }
            },
        );
    }
}

/// A quantized weight matrix our kernels multiply: `out[m × rows] = x[m × cols] · Wᵀ`.
///
/// # Safety
/// [`matmul_quantized`](Self::matmul_quantized) must write every one of its `m · rows` output
/// values: [`matmul_vec`](Self::matmul_vec) hands them out without initialising them first.
pub unsafe trait QuantKernel: Send + Sync {
    /// The activation blocks its kernels take.
    type Act: ActFormat;
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// Bytes of weights (what one pass over the matrix reads).
    fn storage_bytes(&self) -> usize;
    /// Has the pool's idle workers request the weights into the caches ahead of the next
    /// product ([`prefetch_ahead`](super::parallel::prefetch_ahead)).
    fn prefetch_ahead(&self);
    /// Writes row `row`'s `cols` values, dequantized as ggml does, to `out`, where the layout
    /// supports it (the interleaved one); `false` otherwise.
    fn dequantize_row(&self, row: usize, out: &mut [f32]) -> bool {
        let _ = (row, out);
        false
    }
    /// The product for `m` rows of activations already quantized (`cols / Act::LEN` blocks
    /// each).
    ///
    /// Writes every one of the `m · rows` values of `out`, which may be uninitialised.
    ///
    /// # Safety
    /// The CPU must support `isa`; `acts` holds `m · cols / Act::LEN` blocks and `out` points
    /// to `m · rows` values no one else accesses during the call (the kernels write through
    /// raw pointers).
    unsafe fn matmul_quantized(&self, acts: &[Self::Act], m: usize, out: DisjointOut, isa: Isa);

    /// With the best instruction set this CPU has.
    fn matmul(&self, x: &[f32], out: &mut [f32]) {
        // `best` only returns an instruction set the CPU has.
        self.matmul_with(Isa::best(), x, out)
    }

    /// With a chosen instruction set (one of [`Isa::available`]).
    fn matmul_with(&self, isa: Isa, x: &[f32], out: &mut [f32]) {
        assert!(isa.is_available(), "{isa:?} is not available on this CPU");
        let m = rows_of(self, x);
        assert_eq!(out.len(), m * self.rows(), "output has the wrong size");
        // SAFETY: `isa` is available; `out` holds the `m · rows` values, borrowed mutably.
        unsafe { run(self, isa, x, m, DisjointOut::new(out)) }
    }

    /// The product in a new vector, written once (not zeroed first: at batch 16 zeroing
    /// SmolLM2's logits alone cost as much as 3 % of a decode step). Builds with debug
    /// assertions fill it with NaN first, so a value left unwritten shows in the tests.
    fn matmul_vec(&self, x: &[f32]) -> Vec<f32> {
        let m = rows_of(self, x);
        let len = m * self.rows();
        let mut out = Vec::with_capacity(len);
        #[cfg(debug_assertions)]
        out.spare_capacity_mut()[..len].fill(std::mem::MaybeUninit::new(f32::NAN));
        // SAFETY: `best` is available; the spare capacity holds `len` values, and the kernels
        // write every one of them before the length is set.
        unsafe {
            run(
                self,
                Isa::best(),
                x,
                m,
                DisjointOut::uninit(&mut out.spare_capacity_mut()[..len]),
            );
            out.set_len(len);
        }
        out
    }
}

/// Rows of `x` for `kernel`, asserting that `x` is a whole number of them.
fn rows_of<K: QuantKernel + ?Sized>(kernel: &K, x: &[f32]) -> usize {
    let cols = kernel.cols();
    let m = x.len() / cols.max(1);
    assert_eq!(x.len(), m * cols, "input is not a whole number of rows");
    m
}

/// Quantizes `x` (`m` rows) into this thread's scratch buffer and multiplies into `out`.
///
/// # Safety
/// The CPU must support `isa`; `out` points to `m · rows` values no one else accesses.
unsafe fn run<K: QuantKernel + ?Sized>(
    kernel: &K,
    isa: Isa,
    x: &[f32],
    m: usize,
    out: DisjointOut,
) {
    let cols = kernel.cols();
    if m == 0 {
        return;
    }
    let kb = cols / K::Act::LEN;
    with_scratch::<K::Act>(m * kb, |acts| {
        quantize_rows(x, m, acts);
        // SAFETY: as the caller promised; `acts` holds the `m · kb` blocks.
        unsafe { kernel.matmul_quantized(acts, m, out, isa) }
    });
}

/// Spreads `n_items` work items of `item_bytes` weight bytes each over the pool and calls
/// `f(items, rows)` for every row tile (heights from `tile_rows(rows left)`) of the `m`
/// activation rows. A task takes its items a slice at a time, small enough to stay in L2 while
/// every row tile passes over it (a row tile's activations stay in L1), so a batch reads every
/// weight byte from memory once.
fn for_each_slice_tile(
    n_items: usize,
    item_bytes: usize,
    m: usize,
    tile_rows: impl Fn(usize) -> usize + Sync,
    f: impl Fn(Range<usize>, Range<usize>) + Sync,
) {
    let slice = (WEIGHT_SLICE_BYTES / item_bytes.max(1)).max(1);
    let tail = (TAIL_CHUNK_BYTES / item_bytes.max(1)).max(1);
    for_each_range_tail(n_items, tail, |items| {
        let mut start = items.start;
        while start < items.end {
            let end = (start + slice).min(items.end);
            let mut r0 = 0;
            while r0 < m {
                let rows = tile_rows(m - r0).clamp(1, m - r0);
                f(start..end, r0..r0 + rows);
                r0 += rows;
            }
            start = end;
        }
    });
}

/// The first of `B`'s tiles whose height fits `rows_left`, as (weight rows, activation rows).
fn tile_shape<B: WeightBlock>(rows_left: usize) -> (usize, usize) {
    B::TILES
        .iter()
        .copied()
        .find(|&(_, rows)| rows <= rows_left)
        .unwrap_or((1, 1))
}

/// Runs `f` on a thread-local buffer of `len` activation blocks (grown, never shrunk, so
/// steady-state calls allocate nothing).
fn with_scratch<A: ActFormat>(len: usize, f: impl FnOnce(&mut [A])) {
    thread_local! {
        static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    }
    SCRATCH.with(|cell| {
        let mut bytes = cell.borrow_mut();
        let align = std::mem::align_of::<A>();
        let need = len * std::mem::size_of::<A>() + align;
        if bytes.len() < need {
            bytes.resize(need, 0);
        }
        let offset = bytes.as_ptr().align_offset(align);
        // SAFETY: the buffer holds `len` properly aligned `A`s from `offset` on; `A` is a
        // `repr(C)` block of integers and floats, valid for any bit pattern; the borrow of
        // the buffer outlives the slice.
        let acts = unsafe {
            std::slice::from_raw_parts_mut(bytes.as_mut_ptr().add(offset) as *mut A, len)
        };
        f(acts)
    })
}

/// Dot products of `cols` consecutive weight rows (`w`, `kb` blocks each) with `rows`
/// activation rows (`kb` blocks each); `sums[c * rows + r]` receives weight row `c` ·
/// activation row `r`.
fn dot_tile<B: WeightBlock>(
    w: &[B],
    cols: usize,
    acts: &[B::Act],
    kb: usize,
    sums: &mut [f32],
    isa: Isa,
) {
    // SAFETY: `isa` is one the CPU supports (`Isa::best`, or checked by `matmul_with`).
    #[cfg(target_arch = "x86_64")]
    match isa {
        Isa::Avx2 => return unsafe { avx2::dot_tile(w, cols, acts, kb, sums) },
        Isa::AvxVnni => return unsafe { avx2::dot_tile_avxvnni(w, cols, acts, kb, sums) },
        Isa::Avx512Vnni | Isa::Amx => {
            return unsafe { avx2::dot_tile_vnni(w, cols, acts, kb, sums) }
        }
        Isa::Scalar => {}
    }
    let _ = isa;
    dot_tile_scalar(w, cols, acts, kb, sums);
}

/// The portable path, and the reference the SIMD path is tested against.
pub fn dot_tile_scalar<B: WeightBlock>(
    w: &[B],
    cols: usize,
    acts: &[B::Act],
    kb: usize,
    sums: &mut [f32],
) {
    let rows = sums.len() / cols.max(1);
    for c in 0..cols {
        for r in 0..rows {
            sums[c * rows + r] = w[c * kb..(c + 1) * kb]
                .iter()
                .zip(&acts[r * kb..(r + 1) * kb])
                .map(|(wb, ab)| wb.dot(ab))
                .sum();
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(test)]
mod tests;
