//! One forward pass's positions, block tables and attention tiles on the device.

use cudarc::driver::CudaSlice;

use crate::model::batch::SeqInput;

/// One forward pass's positions and block tables on the device.
pub struct Step<'a> {
    pub(super) positions: CudaSlice<u32>,
    pub(super) inv_freq: CudaSlice<f32>,
    pub(super) neox: bool,
    pub(super) token_block: CudaSlice<i32>,
    pub(super) token_slot: CudaSlice<i32>,
    pub(super) token_pos: CudaSlice<i32>,
    pub(super) token_seq: CudaSlice<i32>,
    pub(super) block_tables: CudaSlice<i32>,
    pub(super) table_start: CudaSlice<i32>,
    /// The first token of each tile of `paged_attention_tiles_f16`, and their count, where
    /// the step attends with it (head sizes 64 and 128).
    pub(super) attention_tiles: Option<(CudaSlice<i32>, usize)>,
    /// The longest context a token of the step attends to.
    pub(super) longest: usize,
    pub(super) tokens: usize,
    pub(super) _batch: std::marker::PhantomData<&'a ()>,
}

/// Query rows of a `paged_attention_tiles_f16` CTA (`PT_ROWS`).
pub(super) const TILE_ROWS: usize = 16;

/// The first token of each tile of `paged_attention_tiles_f16` over a batch whose sequences
/// have `lens` new tokens each, in order: every sequence's new tokens cut into runs of
/// `TILE_ROWS / min(group, TILE_ROWS)` (`group` query heads a KV head), so each K/V row the
/// kernel stages serves the heads of a group for several tokens of a prefill or an extend
/// (and, in a decode step, the group's heads of one token). `None` for a head size the
/// kernel does not take (`paged_attention_f16` attends instead).
pub(super) fn attention_tiles(head_dim: usize, group: usize, lens: &[usize]) -> Option<Vec<i32>> {
    if !matches!(head_dim, 64 | 128) || group == 0 {
        return None;
    }
    let per_tile = TILE_ROWS / group.min(TILE_ROWS);
    let mut first = 0;
    let mut firsts = Vec::new();
    for &n in lens {
        firsts.extend((0..n).step_by(per_tile).map(|t| (first + t) as i32));
        first += n;
    }
    Some(firsts)
}

/// Per new token of the batch, `f(block, slot)` of its position in blocks of `block_size`.
pub(super) fn slots(
    batch: &[SeqInput],
    block_size: usize,
    f: impl Fn(i32, i32) -> i32,
) -> Vec<i32> {
    let mut out = Vec::new();
    for s in batch {
        for p in s.start_pos..s.start_pos + s.tokens.len() {
            out.push(f(s.blocks[p / block_size] as i32, (p % block_size) as i32));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_tiles_cut_each_sequence_into_runs() {
        // Four query heads a KV head: four tokens a tile; the second sequence's run ends
        // early, the third (a decode) is a tile of its own.
        assert_eq!(
            attention_tiles(128, 4, &[10, 3, 1]),
            Some(vec![0, 4, 8, 10, 13])
        );
        // Seven heads: two tokens a tile (14 rows); twenty: one token, in two parts.
        assert_eq!(attention_tiles(64, 7, &[5]), Some(vec![0, 2, 4]));
        assert_eq!(attention_tiles(64, 20, &[2, 2]), Some(vec![0, 1, 2, 3]));
        // One head a KV head: sixteen tokens a tile; a decode step, a tile a sequence.
        assert_eq!(attention_tiles(64, 1, &[40]), Some(vec![0, 16, 32]));
        assert_eq!(attention_tiles(128, 4, &[1, 1, 1]), Some(vec![0, 1, 2]));
    }

    #[test]
    fn other_head_sizes_keep_the_per_token_kernel() {
        assert_eq!(attention_tiles(96, 4, &[10]), None);
        assert_eq!(attention_tiles(256, 2, &[10]), None);
    }
}
