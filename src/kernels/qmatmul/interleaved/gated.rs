//! SiLU·gate fused into the gate/up matmul: [`GatedPacked`].

use std::cell::RefCell;

#[cfg(target_arch = "x86_64")]
use super::uses_pairs;
use super::{block_len, prefetch_ahead_for, Act, Interleaved, PackedMatrix, MAX_TILE_ROWS, ROWS};
use crate::kernels::parallel::DisjointOut;
use crate::kernels::qmatmul::{Isa, QuantKernel};

/// The gate and up projections of a SwiGLU feed-forward layer as one matrix whose product is
/// the layer's activation, `silu(x · gateᵀ) · (x · upᵀ)` (`rows` values per row of `x`). Their
/// groups of eight rows alternate (gate rows `8j..8j + 8`, then up rows `8j..8j + 8`), so the
/// thread that multiplies a pair applies SiLU·gate to it while its sums are at hand: no pass
/// over the two `rows`-wide products is left to one thread after the parallel call, and no
/// one reads another core's half of them. The values are those of the two products then
/// [`silu_mul`](crate::kernels::silu_mul), bit for bit.
pub struct GatedPacked<P: Interleaved> {
    /// `2 · rows` rows, the pairs' groups in order.
    pairs: PackedMatrix<P>,
}

impl<P: Interleaved> GatedPacked<P> {
    /// Repacks ggml's bytes of the gate and up matrices (`rows × cols` each); `None` if a byte
    /// count does not match the shape, or `rows` or `cols` is not a positive multiple of 8 or
    /// of the block.
    pub fn from_bytes(rows: usize, cols: usize, gate: &[u8], up: &[u8]) -> Option<Self> {
        let len = block_len::<P>();
        let group = ROWS * cols / len * std::mem::size_of::<P::Source>();
        let whole = rows > 0 && rows.is_multiple_of(ROWS) && cols > 0 && cols.is_multiple_of(len);
        let bytes = rows / ROWS * group;
        if !whole || gate.len() != bytes || up.len() != bytes {
            return None;
        }
        let mut pairs = Vec::with_capacity(2 * bytes);
        for (g, u) in gate.chunks_exact(group).zip(up.chunks_exact(group)) {
            pairs.extend_from_slice(g);
            pairs.extend_from_slice(u);
        }
        PackedMatrix::from_bytes(2 * rows, cols, &pairs).map(|pairs| Self { pairs })
    }
}

// SAFETY: `matmul_quantized` writes every output value: the row tiles cover `0..m` and the
// pairs every eight columns (`rows` is a multiple of 8).
unsafe impl<P: Interleaved> QuantKernel for GatedPacked<P> {
    type Act = Act<P>;

    fn rows(&self) -> usize {
        self.pairs.rows / 2
    }

    fn cols(&self) -> usize {
        self.pairs.cols
    }

    fn storage_bytes(&self) -> usize {
        self.pairs.storage_bytes()
    }

    fn prefetch_ahead(&self) {
        self.pairs.prefetch_ahead()
    }

    unsafe fn matmul_quantized(&self, acts: &[Act<P>], m: usize, out: DisjointOut, isa: Isa) {
        thread_local! {
            /// A slice's gate and up products and activations for a tile's rows (grown,
            /// never shrunk).
            static STAGE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
        }
        let n = self.rows();
        #[cfg(target_arch = "x86_64")]
        if uses_pairs::<P>(isa, m) {
            // A pair's sums are its gate rows' then its up rows'.
            return self.pairs.pairs(acts, m, isa, |pair, r, sums| {
                let mut v = [0f32; ROWS];
                for (row, s) in r.zip(sums) {
                    crate::kernels::silu_mul(&s[..ROWS], &s[ROWS..], &mut v);
                    // SAFETY: columns 8·pair..8·pair + 8 belong to this task's pairs only, and
                    // lie inside `out` (as below).
                    unsafe { out.write(row * n + pair * ROWS, &v) };
                }
            });
        }
        let (rows, ahead) = (
            P::TILE_ROWS.min(MAX_TILE_ROWS),
            prefetch_ahead_for::<P>(isa),
        );
        self.pairs
            .for_each_tile(2, m, rows, ahead, isa, |pairs, r| {
                let width = pairs.len() * ROWS;
                let part = r.len() * width;
                STAGE.with(|cell| {
                    let mut stage = cell.borrow_mut();
                    if stage.len() < 3 * part {
                        stage.resize(3 * part, 0.0);
                    }
                    // Row `i` of the tile at `i · width` in each: its values for the slice's pairs.
                    let (gate, rest) = stage[..3 * part].split_at_mut(part);
                    let (up, values) = rest.split_at_mut(part);
                    let mut sums = [[0f32; ROWS]; MAX_TILE_ROWS];
                    let sums = &mut sums[..r.len()];
                    for (k, pair) in pairs.clone().enumerate() {
                        for (group, dst) in [(2 * pair, &mut *gate), (2 * pair + 1, &mut *up)] {
                            self.pairs.group_tile(group, acts, r.clone(), sums, isa);
                            for (i, s) in sums.iter().enumerate() {
                                dst[i * width + k * ROWS..][..ROWS].copy_from_slice(s);
                            }
                        }
                    }
                    for (i, row) in r.clone().enumerate() {
                        let at = i * width..(i + 1) * width;
                        let v = &mut values[at.clone()];
                        crate::kernels::silu_mul(&gate[at.clone()], &up[at], v);
                        // SAFETY: columns 8·pairs.start..8·pairs.end belong to this task's pairs
                        // only, and lie inside `out` (m × rows values, as `matmul_quantized`'s
                        // caller promised).
                        unsafe { out.write(row * n + pairs.start * ROWS, v) };
                    }
                })
            });
    }
}
