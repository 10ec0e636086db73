//! Tall products (a prefill's, an extend's, a decode batch of 8 or more rows) on AVX2: each
//! thread unpacks the slice of weight groups its row tiles pass over to plain bytes once, as the
//! first tile reaches each group, and every later tile of the slice multiplies those bytes
//! without unpacking them again. The 256-bit tiles unpack a block for each tile of four rows,
//! which for Q5_0 is about a quarter of a tile's instructions (the formats that take them:
//! `SimpleX8::TALL`). The integer sums are exact either way and the float step is the tile's, so
//! a row's product has the same bits on this path as on the others.

use std::cell::RefCell;
use std::ops::Range;

use super::{Interleaved, PackedMatrix};
use crate::kernels::qmatmul::Isa;

/// The fewest activation rows a product takes the tall tiles for: two tiles of four rows.
const TALL_MIN_ROWS: usize = 8;

/// Whether a product of `m` activation rows with `isa` takes the tall tiles: the formats that
/// have them ([`Interleaved::TALL_BYTES`]), with AVX2 alone (the instruction set they were
/// measured on; the VNNI forms multiply four products an instruction, so their balance of
/// unpacking against multiplying differs and is not yet measured).
pub(super) fn uses_tall<P: Interleaved>(isa: Isa, m: usize) -> bool {
    P::TALL_BYTES > 0 && isa == Isa::Avx2 && m >= TALL_MIN_ROWS
}

/// 32 bytes, aligned for a 256-bit load.
#[repr(C, align(32))]
#[derive(Clone, Copy)]
struct Line([u8; 32]);

/// A thread's unpacked groups: the window of the slice its tiles are passing over.
struct Window {
    /// The address of the matrix's blocks (0: none yet).
    owner: usize,
    groups: Range<usize>,
    /// Bytes of one group's values unpacked.
    group_bytes: usize,
    /// Whether each group of the window is unpacked yet.
    filled: Vec<bool>,
    lines: Vec<Line>,
}

thread_local! {
    /// Grown, never shrunk, so steady-state products allocate nothing.
    static WINDOW: RefCell<Window> = const {
        RefCell::new(Window {
            owner: 0,
            groups: 0..0,
            group_bytes: 0,
            filled: Vec::new(),
            lines: Vec::new(),
        })
    };
}

impl Window {
    fn begin(&mut self, owner: usize, groups: Range<usize>, group_bytes: usize) {
        self.owner = owner;
        self.group_bytes = group_bytes;
        self.filled.clear();
        self.filled.resize(groups.len(), false);
        let lines = groups.len() * group_bytes / std::mem::size_of::<Line>();
        if self.lines.len() < lines {
            self.lines.resize(lines, Line([0; 32]));
        }
        self.groups = groups;
    }
}

/// The bytes of group `group`'s `kb` blocks: [`Interleaved::TALL_BYTES`] each.
fn group_bytes<P: Interleaved>(kb: usize) -> usize {
    kb * P::TALL_BYTES
}

/// Starts the calling thread's window on groups `groups` of `matrix`: the slice its next tiles
/// pass over, unpacked as they first reach each group.
pub(super) fn begin_slice<P: Interleaved>(matrix: &PackedMatrix<P>, groups: Range<usize>) {
    let kb = matrix.kb();
    WINDOW.with(|cell| {
        let owner = matrix.blocks.as_ptr() as usize;
        cell.borrow_mut().begin(owner, groups, group_bytes::<P>(kb))
    })
}

/// `f(values)` with group `group`'s values unpacked (`kb` blocks of
/// [`Interleaved::TALL_BYTES`]), from the calling thread's window, unpacking them first if
/// the window does not hold them yet (a group outside the window opens a window of its own).
///
/// # Safety
/// [`uses_tall`] holds for the product's instruction set, which is available (the unpacking
/// runs AVX2).
pub(super) unsafe fn with_group<P: Interleaved, R>(
    matrix: &PackedMatrix<P>,
    group: usize,
    f: impl FnOnce(&[u8]) -> R,
) -> R {
    let kb = matrix.kb();
    let bytes = group_bytes::<P>(kb);
    WINDOW.with(|cell| {
        let mut window = cell.borrow_mut();
        let owner = matrix.blocks.as_ptr() as usize;
        if window.owner != owner || window.group_bytes != bytes || !window.groups.contains(&group) {
            window.begin(owner, group..group + 1, bytes);
        }
        let i = group - window.groups.start;
        let lines = &mut window.lines[i * bytes / 32..(i + 1) * bytes / 32];
        // SAFETY: `Line` is plain bytes, so the lines are `bytes` initialized bytes.
        let values =
            unsafe { std::slice::from_raw_parts_mut(lines.as_mut_ptr() as *mut u8, bytes) };
        if !window.filled[i] {
            let w = &matrix.blocks[group * kb..(group + 1) * kb];
            // SAFETY: AVX2 is available (as the caller promised); `values` holds `kb` blocks'
            // bytes, 32-byte aligned.
            unsafe { P::unpack_tall(w, values) };
            window.filled[i] = true;
        }
        f(values)
    })
}

/// The 32-value formats' tall tiles (those with `SimpleX8::TALL`).
#[cfg(target_arch = "x86_64")]
pub(super) mod simple {
    use std::arch::x86_64::*;

    use super::super::block32_trait::{add_block, SimpleX8};
    use super::super::{broadcast4, prefetch_line, ROWS};
    use crate::kernels::qmatmul::avx2::{dp16, widen};
    use crate::kernels::qmatmul::{ActBlock, Avx2Dot, Isa};

    /// Unpacks the blocks `w` into `out`, 256 bytes each ([`SimpleX8::values_avx2`]).
    ///
    /// # Safety
    /// The CPU must support AVX2; `out` holds `w.len()` blocks' bytes, 32-byte aligned.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in super::super) unsafe fn unpack<S: SimpleX8>(w: &[S], out: &mut [u8]) {
        assert!(out.len() >= 256 * w.len() && out.as_ptr().align_offset(32) == 0);
        let lines = std::mem::size_of::<S>().div_ceil(64);
        for (b, block) in w.iter().enumerate() {
            // The one pass over the slice's weights streams them as the tiles would.
            for line in 0..lines {
                prefetch_line(block, line);
            }
            let at = out.as_mut_ptr().add(256 * b) as *mut __m256i;
            for (g, v) in block.values_avx2().into_iter().enumerate() {
                _mm256_store_si256(at.add(g), v);
            }
        }
    }

    /// The tall tile with `isa` (AVX2): as the 256-bit tile, each block's values read from
    /// `values` (as [`unpack`] wrote them) rather than unpacked; the same sums, so the same
    /// bits.
    ///
    /// # Safety
    /// `isa` is AVX2 and available; `values` holds `kb` unpacked blocks of `w`, 32-byte
    /// aligned, `acts` `T · kb` blocks.
    pub(in super::super) unsafe fn tile<S: SimpleX8, const T: usize>(
        isa: Isa,
        values: &[u8],
        w: &[S],
        acts: &[ActBlock],
        kb: usize,
        sums: &mut [[f32; ROWS]],
    ) {
        debug_assert_eq!(isa, Isa::Avx2);
        tile_avx2::<S, T>(values, w, acts, kb, sums)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_avx2<S: SimpleX8, const T: usize>(
        values: &[u8],
        w: &[S],
        acts: &[ActBlock],
        kb: usize,
        sums: &mut [[f32; ROWS]],
    ) {
        const { assert!(8 % S::SUMS16 == 0, "the 16-bit sums must divide a block") };
        assert!(values.len() >= 256 * kb && values.as_ptr().align_offset(32) == 0);
        debug_assert!(w.len() == kb && acts.len() == T * kb && sums.len() == T);
        let mut acc = [_mm256_setzero_ps(); T];
        for b in 0..kb {
            let block = w.get_unchecked(b);
            let v = values.as_ptr().add(256 * b) as *const __m256i;
            let rows: [&ActBlock; T] = std::array::from_fn(|r| acts.get_unchecked(r * kb + b));
            let mut dots = [_mm256_setzero_si256(); T];
            let mut part = [_mm256_setzero_si256(); T];
            for g in 0..8 {
                let q = _mm256_load_si256(v.add(g));
                for r in 0..T {
                    let x = broadcast4((rows[r].qs.as_ptr() as *const u8).add(4 * g));
                    part[r] = dp16::<Avx2Dot>(part[r], q, x);
                }
                if (g + 1) % S::SUMS16 == 0 {
                    for r in 0..T {
                        dots[r] = _mm256_add_epi32(dots[r], widen::<Avx2Dot>(part[r]));
                        part[r] = _mm256_setzero_si256();
                    }
                }
            }
            let dots = std::array::from_fn(|r| {
                _mm256_sub_epi32(dots[r], _mm256_set1_epi32(S::OFFSET * rows[r].sum))
            });
            add_block(block, &rows, dots, &mut acc);
        }
        for (s, a) in sums.iter_mut().zip(acc) {
            _mm256_storeu_ps(s.as_mut_ptr(), a);
        }
    }
}
