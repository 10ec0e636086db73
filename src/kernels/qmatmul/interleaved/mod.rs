//! Quantized matrices with eight weight rows interleaved ([`Interleaved`] blocks, repacked exactly
//! at load), so the eight 32-bit lanes of a SIMD register are eight output columns:
//!
//! * one 32-byte load holds four values of each of the eight rows, multiplied with four
//!   activations broadcast to every lane (`maddubs`);
//! * several such products add up in 16-bit lanes, exactly, before one `madd` applies the eight
//!   rows' sub-block scales: fewer multiplies per multiply-add than the row-major kernels, which
//!   pay a `madd` for every `maddubs`; with AVX-512 VNNI or AVX-VNNI one `vpdpbusd` per step
//!   adds four products straight into 32-bit lanes, and a 32-bit multiply applies the scales
//!   (the `dp16` family in `qmatmul::avx2` holds both forms; the counts below are AVX2's);
//! * each super-block ends with one float multiply-add per activation row for all eight rows,
//!   and there is no horizontal sum anywhere.
//!
//! A batch of `m` rows is taken in tiles of up to [`Interleaved::TILE_ROWS`] activation rows,
//! each passing over an L2-sized slice of weight groups (see `for_each_slice_tile`). With
//! AVX-512 VNNI a tile of one row takes the 512-bit kernels of `avx512_row` (and of `q4k` /
//! `q6k`), Q4_K tiles of four rows and Q6_K tiles of eight take the assembly passes of `evex`,
//! and with AMX products of [`Interleaved::AMX_MIN_ROWS`] rows or more take the tiles of
//! `amx_tiles`. With AVX2 alone, Q6_K tiles of eight rows take the assembly pass of `vex`, and
//! Q5_0 products of 8 rows or more the tall tiles of `tall`, which read the slice's values
//! unpacked once. Every path gives a row's product the same bits.
//!
//! Files: one per block format (`block32` for Q4_0, Q4_1, Q5_0 and Q8_0 with the contract their
//! kernels read in `block32_trait`; `q4k`, `q6k` with their own 512-bit and AMX kernels beside
//! their layouts), one per instruction set's kernels for the 32-value formats (`avx512_row`,
//! `amx_tiles`, whose helpers the K-quants share), `evex` and `vex` for the tiles' passes in
//! assembly (AVX-512's encoding and AVX2's), `gated` for the fused SiLU·gate, `tall` for the
//! AVX2 tiles of tall products that unpack a slice of weights once for all its row tiles, and
//! `macros` for the macros they are written with.

use std::ops::Range;

use super::{for_each_slice_tile, ActFormat, Isa, QuantKernel, WeightBlock};
use crate::kernels::large_buf::LargeBuf;
use crate::kernels::parallel::{for_each_range, prefetch_ahead, DisjointOut};

#[macro_use]
mod macros;

#[cfg(target_arch = "x86_64")]
mod amx_tiles;
#[cfg(target_arch = "x86_64")]
mod avx512_row;
mod block32;
mod block32_trait;
#[cfg(target_arch = "x86_64")]
mod evex;
mod gated;
mod q4k;
mod q6k;
#[cfg(target_arch = "x86_64")]
mod tall;
#[cfg(target_arch = "x86_64")]
mod vex;
pub use block32::{BlockQ4_0x8, BlockQ4_1x8, BlockQ5_0x8, BlockQ8_0x8};
pub use gated::GatedPacked;
pub use q4k::BlockQ4Kx8;
pub use q6k::BlockQ6Kx8;

/// Weight rows interleaved in one block.
pub const ROWS: usize = 8;
/// The most activation rows any format's tile takes.
const MAX_TILE_ROWS: usize = 8;
/// Activation rows, and weight rows, of an AMX tile.
const AMX_TILE: usize = 16;

/// Block `b` of eight weight rows of one format.
pub trait Interleaved: Copy + Send + Sync + 'static {
    /// The ggml block it is packed from.
    type Source: WeightBlock;
    /// The most activation rows one tile multiplies (its sums stay in registers).
    const TILE_ROWS: usize;
    /// Bytes ahead of the block being multiplied that the kernels request (`prefetch_line`):
    /// by default 3 KB, two and a half interleaved Q4_K super-blocks (1184 bytes each) or nearly
    /// two Q6_K ones (1696).
    const PREFETCH_AHEAD: usize = 3072;
    /// Interleaves block `b` of eight rows.
    fn pack(rows: [&Self::Source; ROWS]) -> Self;
    /// The eight rows' dot products with one activation block: the portable path.
    fn dot(&self, a: &Act<Self>) -> [f32; ROWS];
    /// Row `i`'s values, dequantized as ggml does (for an embedding lookup from a tied LM
    /// head); `out` holds one block's values.
    fn dequantize(&self, i: usize, out: &mut [f32]);
    /// `sums[r][i]` = activation row `r` (`kb` blocks each in `acts`) · weight row `i` of the
    /// group `w` (`kb` blocks), for `sums.len()` rows, 1 to `TILE_ROWS`.
    ///
    /// With the instruction set `isa`, a SIMD one.
    ///
    /// # Safety
    /// The CPU must support `isa`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn tile_simd(
        isa: Isa,
        w: &[Self],
        acts: &[Act<Self>],
        kb: usize,
        sums: &mut [[f32; ROWS]],
    );
    /// Whether the format has a one-row path on 512-bit registers
    /// ([`row_zmm`](Self::row_zmm)).
    const ROW_ZMM: bool = false;
    /// `sums[i]` = the activation row `acts` (`kb` blocks) · weight row `i` of the group `w`
    /// (`kb` blocks), on AVX-512 VNNI's 512-bit registers (see `interleaved::avx512_row`): the same bits as
    /// [`tile_simd`](Self::tile_simd)'s one-row tile.
    ///
    /// # Safety
    /// [`Isa::Avx512Vnni`] must be available and `ROW_ZMM` true; `w` and `acts` hold `kb`
    /// blocks (unchecked).
    #[cfg(target_arch = "x86_64")]
    unsafe fn row_zmm(w: &[Self], acts: &[Act<Self>], kb: usize, sums: &mut [f32; ROWS]) {
        let _ = (w, acts, kb, sums);
        unreachable!("the format has no 512-bit row path")
    }
    /// Whether the format has 512-bit pair tiles for AVX-512 VNNI
    /// ([`zmm_pair`](Self::zmm_pair)).
    const ZMM_PAIR: bool = false;
    /// The fewest activation rows a product takes the 512-bit pair tiles for (with
    /// [`Isa::Avx512Vnni`]); fewer take the 256-bit tiles. None yet, for every format: on
    /// one Zen 4 VM the same code prefilled one sequence 22–36 % faster than the 256-bit
    /// tiles in one sitting and half as fast in the next, and was slower in serving in both
    /// (docs/perf-notes/prefill-zen4.md). Until what they depend on is known, they are
    /// reached only directly (the kernel tests).
    const ZMM_PAIR_MIN_ROWS: usize = usize::MAX;
    /// As [`amx_pair`](Self::amx_pair), on AVX-512 VNNI's 512-bit registers: the same bits.
    ///
    /// # Safety
    /// [`Isa::Avx512Vnni`] must be available and `ZMM_PAIR` true; `rows` is 1 to 16 and the
    /// slices hold what `amx_pair` takes.
    #[cfg(target_arch = "x86_64")]
    unsafe fn zmm_pair(
        w: [&[Self]; 2],
        acts: &[Act<Self>],
        kb: usize,
        rows: usize,
        stream: bool,
        sums: &mut [[f32; AMX_TILE]; AMX_TILE],
    ) {
        let _ = (w, acts, kb, rows, stream, sums);
        unreachable!("the format has no 512-bit pair path")
    }
    /// Whether the format has an AMX path ([`amx_pair`](Self::amx_pair)).
    const AMX: bool = false;
    /// The fewest activation rows a product takes AMX tiles for (with [`Isa::Amx`]); fewer
    /// take the AVX-512 VNNI tiles. 8 by default (Q4_1, Q4_0, Q6_K; every format from 4 made
    /// batches of 4 6–16 % slower in the three models, before decode batches' AMX tiles
    /// requested their weights into L2); Q5_0 and Q8_0 from 4, Q4_K from 5 (each measured where
    /// it is set).
    const AMX_MIN_ROWS: usize = 8;
    /// The most activation rows a 256-bit tile may hold and still request its weights into
    /// L2 as well where [`ByteDot::L2_REQUESTS`](crate::kernels::qmatmul::ByteDot) (see
    /// `tile_prefetch_line`): any number by default (the 32-value formats); 3 for the
    /// K-quants, whose four-row tiles decoded the 1.5B's batches of 4 2–4 % slower with them
    /// (three alternated rounds).
    const L2_TILE_ROWS: usize = usize::MAX;
    /// Bytes deep its AMX products are: the values one set of scales covers.
    const AMX_DEPTH: usize = 32;
    /// `sums[r][c]` for `r < rows` (1 to 16) = activation row `r` (`kb` blocks each in
    /// `acts`) · weight row `c` of the pair of groups `w` (`w[0]`'s eight rows, then
    /// `w[1]`'s, `kb` blocks each), through AMX tiles; `stream`: the product's rows fit one
    /// tile, so its weights come from memory once (see `amx_tiles::prefetch_pair`).
    ///
    /// # Safety
    /// [`Isa::Amx`] must be available and `AMX` true; it runs inside
    /// [`with_tiles`](crate::kernels::qmatmul::amx::with_tiles) for `rows` rows and
    /// `AMX_DEPTH`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn amx_pair(
        w: [&[Self]; 2],
        acts: &[Act<Self>],
        kb: usize,
        rows: usize,
        stream: bool,
        sums: &mut [[f32; AMX_TILE]; AMX_TILE],
    ) {
        let _ = (w, acts, kb, rows, stream, sums);
        unreachable!("the format has no AMX path")
    }
    /// Bytes of one block's values unpacked for the tall tiles (`interleaved::tall`); 0 where
    /// the format has none.
    const TALL_BYTES: usize = 0;
    /// Unpacks the blocks `w` into `out` ([`TALL_BYTES`](Self::TALL_BYTES) each, in order).
    ///
    /// # Safety
    /// The CPU must support AVX2; `TALL_BYTES` is not 0, `out` holds `w.len()` blocks' bytes
    /// and is 32-byte aligned.
    #[cfg(target_arch = "x86_64")]
    unsafe fn unpack_tall(w: &[Self], out: &mut [u8]) {
        let _ = (w, out);
        unreachable!("the format has no tall tiles")
    }
    /// As [`tile_simd`](Self::tile_simd), the group's values unpacked in `values` (by
    /// [`unpack_tall`](Self::unpack_tall)): the same bits.
    ///
    /// # Safety
    /// `isa` is [`Isa::Avx2`] and available; `values` holds `w`'s blocks unpacked, `acts`
    /// `sums.len() · kb` blocks.
    #[cfg(target_arch = "x86_64")]
    unsafe fn tall_tile(
        isa: Isa,
        values: &[u8],
        w: &[Self],
        acts: &[Act<Self>],
        kb: usize,
        sums: &mut [[f32; ROWS]],
    ) {
        let _ = (isa, values, w, acts, kb, sums);
        unreachable!("the format has no tall tiles")
    }
}

/// The activation blocks an interleaved format multiplies.
pub type Act<P> = <<P as Interleaved>::Source as WeightBlock>::Act;

/// Values per block of an interleaved format.
const fn block_len<P: Interleaved>() -> usize {
    <Act<P> as ActFormat>::LEN
}

/// A `[rows, cols]` matrix, rows interleaved eight at a time; `rows` a multiple of 8.
pub struct PackedMatrix<P: Interleaved> {
    rows: usize,
    cols: usize,
    /// Group `c` (rows `8c..8c + 8`), super-block `b` at `c · kb + b`.
    blocks: LargeBuf<P>,
}

pub type PackedQ4K = PackedMatrix<BlockQ4Kx8>;
pub type PackedQ6K = PackedMatrix<BlockQ6Kx8>;
pub type PackedQ4_0 = PackedMatrix<BlockQ4_0x8>;
pub type PackedQ4_1 = PackedMatrix<BlockQ4_1x8>;
pub type PackedQ5_0 = PackedMatrix<BlockQ5_0x8>;
pub type PackedQ8_0 = PackedMatrix<BlockQ8_0x8>;

impl<P: Interleaved> PackedMatrix<P> {
    /// Blocks per row.
    fn kb(&self) -> usize {
        self.cols / block_len::<P>()
    }

    /// Repacks ggml's bytes; `None` if the byte count does not match the shape or the rows are
    /// not a multiple of 8.
    pub fn from_bytes(rows: usize, cols: usize, bytes: &[u8]) -> Option<Self> {
        let size = std::mem::size_of::<P::Source>();
        if !rows.is_multiple_of(ROWS)
            || !cols.is_multiple_of(block_len::<P>())
            || bytes.len() != rows * cols / block_len::<P>() * size
        {
            return None;
        }
        let kb = cols / block_len::<P>();
        let block = |row: usize, b: usize| {
            let at = (row * kb + b) * size;
            // SAFETY: `at + size` is inside `bytes` (length checked above); the source block
            // is a `repr(C)` block of plain integer and f16 fields, any bit pattern is valid,
            // and `read_unaligned` needs no alignment.
            unsafe { std::ptr::read_unaligned(bytes[at..at + size].as_ptr() as *const P::Source) }
        };
        // Groups repack independently, on the calling thread's pool (a load is otherwise
        // one thread's work).
        let n = rows / ROWS * kb;
        let mut blocks = LargeBuf::<std::mem::MaybeUninit<P>>::uninit(n);
        let out = DisjointOut::new(&mut blocks[..]);
        for_each_range(rows / ROWS, |groups| {
            for group in groups {
                // SAFETY: group `group`'s `kb` blocks lie inside the `n` allocated ones and are
                // this task's alone.
                let dst = unsafe { out.slice(group * kb, kb) };
                for (b, d) in dst.iter_mut().enumerate() {
                    let src: [P::Source; ROWS] =
                        std::array::from_fn(|i| block(group * ROWS + i, b));
                    d.write(P::pack(std::array::from_fn(|i| &src[i])));
                }
            }
        });
        // SAFETY: the groups cover all `n` blocks, each written above.
        let blocks = unsafe { blocks.assume_init() };
        Some(Self { rows, cols, blocks })
    }
}

// SAFETY: `matmul_quantized` writes every output value: the row tiles cover `0..m` and the
// groups every eight columns (`rows` is a multiple of 8).
unsafe impl<P: Interleaved> QuantKernel for PackedMatrix<P> {
    type Act = Act<P>;

    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn storage_bytes(&self) -> usize {
        std::mem::size_of_val(&self.blocks[..])
    }

    fn prefetch_ahead(&self) {
        prefetch_ahead(&self.blocks)
    }

    fn dequantize_row(&self, row: usize, out: &mut [f32]) -> bool {
        assert!(row < self.rows, "row {row} of {}", self.rows);
        assert_eq!(out.len(), self.cols, "a row holds {} values", self.cols);
        let kb = self.kb();
        let group = &self.blocks[row / ROWS * kb..(row / ROWS + 1) * kb];
        for (block, values) in group.iter().zip(out.chunks_exact_mut(block_len::<P>())) {
            block.dequantize(row % ROWS, values);
        }
        true
    }

    unsafe fn matmul_quantized(&self, acts: &[Act<P>], m: usize, out: DisjointOut, isa: Isa) {
        let n = self.rows;
        #[cfg(target_arch = "x86_64")]
        if uses_pairs::<P>(isa, m) {
            let groups = self.rows / ROWS;
            return self.pairs(acts, m, isa, |pair, r, sums| {
                let cols = (groups - 2 * pair).min(2) * ROWS;
                for (row, s) in r.zip(sums) {
                    // SAFETY: columns 16·pair..16·pair + cols belong to this task's pairs
                    // only, and lie inside `out` (as below).
                    unsafe { out.write(row * n + 2 * pair * ROWS, &s[..cols]) };
                }
            });
        }
        let (rows, ahead) = (
            P::TILE_ROWS.min(MAX_TILE_ROWS),
            prefetch_ahead_for::<P>(isa),
        );
        self.for_each_tile(1, m, rows, ahead, isa, |groups, r| {
            let mut sums = [[0f32; ROWS]; MAX_TILE_ROWS];
            let sums = &mut sums[..r.len()];
            for group in groups {
                self.group_tile(group, acts, r.clone(), sums, isa);
                for (row, s) in r.clone().zip(sums.iter()) {
                    // SAFETY: columns 8·group..8·group + 8 belong to this task's groups only,
                    // and lie inside `out` (m × n values, as `matmul_quantized`'s caller
                    // promised).
                    unsafe { out.write(row * n + group * ROWS, s) };
                }
            }
        });
    }
}

impl<P: Interleaved> PackedMatrix<P> {
    /// Spreads the groups over the pool in work items of `per_item` consecutive groups (the
    /// last may hold fewer) and calls `f(items, rows)` for every slice of items and tile of at
    /// most `max_rows` of the `m` activation rows (`for_each_slice_tile`), the slice's first
    /// `ahead` bytes of weights requested as it starts (the distance its tiles prefetch at);
    /// where the product takes the tall tiles with `isa`, each slice opens the thread's window
    /// of unpacked groups (`tall::begin_slice`).
    fn for_each_tile(
        &self,
        per_item: usize,
        m: usize,
        max_rows: usize,
        ahead: usize,
        isa: Isa,
        f: impl Fn(Range<usize>, Range<usize>) + Sync,
    ) {
        #[cfg(target_arch = "x86_64")]
        let tall = tall::uses_tall::<P>(isa, m);
        let _ = isa;
        let kb = self.kb();
        let item_blocks = per_item * kb;
        // As few tiles as `max_rows` allows, of heights differing by at most one: five rows
        // take tiles of 3 and 2 rather than 4 and a lone row.
        let tile_rows = |left: usize| left.div_ceil(left.div_ceil(max_rows).max(1));
        let item_bytes = item_blocks * std::mem::size_of::<P>();
        for_each_slice_tile(
            (self.rows / ROWS).div_ceil(per_item),
            item_bytes,
            m,
            tile_rows,
            |items, r| {
                // The tiles prefetch `ahead` bytes ahead of their work, so the head of a
                // thread's chunk would come in as demand misses: every slice starts with its
                // first `ahead` bytes requested at once (for a slice continuing the previous
                // one, lines already requested: 24 to 48 cheap instructions per slice).
                if r.start == 0 {
                    let end = (items.end * item_blocks).min(self.blocks.len());
                    let slice = &self.blocks[items.start * item_blocks..end];
                    let bytes = std::mem::size_of_val(slice).min(ahead);
                    crate::kernels::prefetch_lines(slice.as_ptr(), bytes);
                    #[cfg(target_arch = "x86_64")]
                    if tall {
                        let groups = self.rows / ROWS;
                        let first = (items.start * per_item).min(groups);
                        tall::begin_slice(self, first..(items.end * per_item).min(groups));
                    }
                }
                f(items, r)
            },
        );
    }

    /// Calls `f(pair, rows, sums)` for every pair of groups (`2 · pair`, and `2 · pair + 1`
    /// unless the groups end first) and tile of the `m` activation rows, `sums[i][j]` =
    /// activation row `rows.start + i` · weight row `16 · pair + j`, through AMX tiles
    /// ([`Isa::Amx`]) or 512-bit pair tiles (`isa` AVX-512 VNNI).
    ///
    /// # Safety
    /// [`uses_pairs`] must hold for `isa`, and `isa` be available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn pairs(
        &self,
        acts: &[Act<P>],
        m: usize,
        isa: Isa,
        f: impl Fn(usize, Range<usize>, &[[f32; AMX_TILE]]) + Sync,
    ) {
        let kb = self.kb();
        let groups = self.rows / ROWS;
        let group = |g: usize| &self.blocks[g * kb..(g + 1) * kb];
        // A decode batch (one tile of rows) reads each weight once, from memory: its tiles
        // request their weights as the one-row kernels do (`amx_tiles::prefetch_pair`).
        let stream = m <= AMX_TILE;
        let ahead = if stream {
            avx512_row::AHEAD
        } else {
            P::PREFETCH_AHEAD
        };
        self.for_each_tile(2, m, AMX_TILE, ahead, isa, |pairs, r| {
            let mut sums = [[0f32; AMX_TILE]; AMX_TILE];
            // The kernels take the tile's rows unchecked.
            assert!((1..=AMX_TILE).contains(&r.len()) && r.end * kb <= acts.len());
            let a = &acts[r.start * kb..r.end * kb];
            let mut each = |amx: bool| {
                for pair in pairs.clone() {
                    // An odd last group is multiplied twice and written once.
                    let w = [group(2 * pair), group((2 * pair + 1).min(groups - 1))];
                    // SAFETY: AMX's inside `with_tiles` for the tile's rows, the 512-bit ones
                    // where AVX-512 VNNI is (as the caller promised); `w` holds `kb` blocks
                    // each, `a` the tile's rows.
                    unsafe {
                        if amx {
                            P::amx_pair(w, a, kb, r.len(), stream, &mut sums);
                        } else {
                            P::zmm_pair(w, a, kb, r.len(), stream, &mut sums);
                        }
                    }
                    f(pair, r.clone(), &sums[..r.len()]);
                }
            };
            if isa == Isa::Amx {
                // SAFETY: AMX is available (as the caller promised).
                unsafe {
                    crate::kernels::qmatmul::amx::with_tiles(r.len(), P::AMX_DEPTH, || each(true))
                }
            } else {
                each(false)
            }
        });
    }

    /// `sums[i][j]` = activation row `rows.start + i` (of `acts`) · weight row `8 · group + j`.
    fn group_tile(
        &self,
        group: usize,
        acts: &[Act<P>],
        rows: Range<usize>,
        sums: &mut [[f32; ROWS]],
        isa: Isa,
    ) {
        let kb = self.kb();
        let w = &self.blocks[group * kb..(group + 1) * kb];
        let a = &acts[rows.start * kb..rows.end * kb];
        #[cfg(target_arch = "x86_64")]
        if tall::uses_tall::<P>(isa, acts.len().checked_div(kb).unwrap_or(0)) {
            // SAFETY: the tall tiles take AVX2 alone (`uses_tall`), and `isa` is available;
            // `values` is the group's `kb` blocks unpacked, `a` the tile's rows.
            return unsafe {
                tall::with_group(self, group, |values| {
                    P::tall_tile(isa, values, w, a, kb, sums)
                })
            };
        }
        tile(w, a, kb, sums, isa);
    }
}

/// Whether a product of `m` activation rows takes pair tiles: AMX's, or with AVX-512 VNNI
/// (and no AMX) the 512-bit ones.
fn uses_pairs<P: Interleaved>(isa: Isa, m: usize) -> bool {
    match isa {
        Isa::Amx => P::AMX && m >= P::AMX_MIN_ROWS,
        Isa::Avx512Vnni => P::ZMM_PAIR && m >= P::ZMM_PAIR_MIN_ROWS,
        _ => false,
    }
}

/// Whether a tile of `rows` activation rows takes the 512-bit one-row kernel.
fn uses_row_zmm<P: Interleaved>(isa: Isa, rows: usize) -> bool {
    matches!(isa, Isa::Avx512Vnni | Isa::Amx) && P::ROW_ZMM && rows == 1
}

/// One group's tile with the instruction set `isa`.
fn tile<P: Interleaved>(w: &[P], acts: &[Act<P>], kb: usize, sums: &mut [[f32; ROWS]], isa: Isa) {
    // SAFETY: `isa` is one the CPU supports (`Isa::best`, or checked by `matmul_with`), and
    // `Isa::Amx` includes AVX-512 VNNI.
    #[cfg(target_arch = "x86_64")]
    match &mut *sums {
        _ if isa == Isa::Scalar => {}
        [row] if uses_row_zmm::<P>(isa, 1) => return unsafe { P::row_zmm(w, acts, kb, row) },
        _ => return unsafe { P::tile_simd(isa, w, acts, kb, sums) },
    }
    let _ = isa;
    tile_scalar(w, acts, kb, sums);
}

/// The portable path.
fn tile_scalar<P: Interleaved>(w: &[P], acts: &[Act<P>], kb: usize, sums: &mut [[f32; ROWS]]) {
    for (r, s) in sums.iter_mut().enumerate() {
        *s = [0.0; ROWS];
        for (block, a) in w.iter().zip(&acts[r * kb..(r + 1) * kb]) {
            for (total, v) in s.iter_mut().zip(block.dot(a)) {
                *total += v;
            }
        }
    }
}

/// Four bytes at `p` as one i32, broadcast to every lane.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn broadcast4(p: *const u8) -> std::arch::x86_64::__m256i {
    std::arch::x86_64::_mm256_set1_epi32(std::ptr::read_unaligned(p as *const i32))
}

/// Prefetches 64-byte line `line` counted from [`Interleaved::PREFETCH_AHEAD`] bytes past
/// `block` (a group's blocks are one contiguous stream, and a task's groups follow each other).
/// The kernels call it once per line of a block, spread over their work on it: a burst of a whole
/// block's lines at once fills the core's miss buffers and stalls the arithmetic behind it (a
/// 1536 × 8960 Q6_K matrix streamed from memory at one row: 11–12 GB/s that way, 15–18
/// spread, against 17–19 for a plain read). Prefetches never fault, so running past the end
/// is harmless.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_line<P: Interleaved>(block: &P, line: usize) {
    prefetch_at::<{ std::arch::x86_64::_MM_HINT_T0 }, P>(block, P::PREFETCH_AHEAD, line)
}

/// The request of a `D` tile of `rows` activation rows for line `line` of `block` (as
/// [`prefetch_line`] counts): where [`ByteDot::L2_REQUESTS`] and `rows` is at most the format's
/// [`Interleaved::L2_TILE_ROWS`], the 512-bit one-row kernels' ([`avx512_row::prefetch_row_line`]),
/// else [`prefetch_line`]. These tiles multiply two to seven rows (AMX takes more), and their
/// arithmetic takes half the time their weights take to stream or more, so their stream, like
/// one row's, wants more lines on their way than L1's requests keep. Batches of 2 decoded at
/// 156–160 % of the batch-1 roofline against 141–147 (the 0.5B), 183–184 against 138–142
/// (SmolLM2) and 136–144 against 129–135 (the 1.5B); batches of 3 to 5 1–10 % faster
/// (alternated rounds).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tile_prefetch_line<P: Interleaved, D: crate::kernels::qmatmul::ByteDot>(
    block: &P,
    line: usize,
    rows: usize,
) {
    if D::L2_REQUESTS && rows <= P::L2_TILE_ROWS {
        avx512_row::prefetch_row_line(block, line);
    } else {
        prefetch_line(block, line);
    }
}

/// As [`prefetch_line`], `ahead` bytes ahead instead of the format's distance, with the
/// `_mm_prefetch` hint `HINT`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_at<const HINT: i32, P>(block: &P, ahead: usize, line: usize) {
    std::arch::x86_64::_mm_prefetch::<HINT>(line_at(block, ahead, line));
}

/// The address of 64-byte line `line` counted from `ahead` bytes past `block`, as
/// [`prefetch_at`] requests it (the assembly passes of `evex` take such addresses).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn line_at<P>(block: &P, ahead: usize, line: usize) -> *const i8 {
    (block as *const P as *const i8).wrapping_add(ahead + 64 * line)
}

/// The bytes ahead that a product outside the AMX tiles requests its weights with `isa`: with
/// AVX-512 VNNI (`amx` included) the 512-bit one-row kernels' and the tiles' distance
/// ([`avx512_row::AHEAD`]; the K-quants' tiles of more rows than `L2_TILE_ROWS` keep their own, the
/// same 3 KB), else the format's.
fn prefetch_ahead_for<P: Interleaved>(isa: Isa) -> usize {
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx512Vnni | Isa::Amx) {
        return avx512_row::AHEAD;
    }
    let _ = isa;
    P::PREFETCH_AHEAD
}
