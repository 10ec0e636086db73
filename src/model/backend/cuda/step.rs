//! One forward pass's inputs on the device: token ids, positions, block tables, attention
//! tiles and the rows to return, packed into one buffer of 32-bit words that is uploaded at
//! once (or staged in a recorded pass's own buffer, see `graphs`).

use cudarc::driver::CudaSlice;

use crate::model::backend::Pass;
use crate::model::batch::{logit_rows, SeqInput};

/// One forward pass's inputs on the device: the address of each array its kernels read.
pub struct Step<'a> {
    /// The buffer the addresses point into, where the step owns it (a recorded pass's
    /// stays with the recording).
    pub(super) _words: Option<CudaSlice<u32>>,
    /// Token ids (`u32`), one per new token.
    pub(super) ids: u64,
    /// Each new token's position (`u32`, read as `int` by the attention kernels).
    pub(super) positions: u64,
    pub(super) token_block: u64,
    pub(super) token_slot: u64,
    /// Each new token's sequence (`int`).
    pub(super) token_seq: u64,
    pub(super) block_tables: u64,
    pub(super) table_start: u64,
    /// The rotary inverse frequencies (`f32`).
    pub(super) inv_freq: u64,
    /// The rows of the new tokens whose logits come back (`u32`), and their count.
    pub(super) rows: (u64, usize),
    /// The first token of each tile of `paged_attention_tiles_f16`, and their count, where
    /// the step attends with it (head sizes 64 and 128).
    pub(super) attention_tiles: Option<(u64, usize)>,
    /// The longest context a token of the step attends to; `None` in a recorded pass,
    /// replayed over other contexts.
    pub(super) longest: Option<usize>,
    pub(super) neox: bool,
    pub(super) tokens: usize,
    pub(super) _batch: std::marker::PhantomData<&'a ()>,
}

/// Where each array of a step starts in its words.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Layout {
    ids: usize,
    positions: usize,
    token_block: usize,
    token_slot: usize,
    token_seq: usize,
    table_start: usize,
    rows: (usize, usize),
    tiles: Option<(usize, usize)>,
    inv_freq: usize,
    block_tables: usize,
    tokens: usize,
    longest: usize,
}

/// Appends `words` to `w`; where they start.
fn push(w: &mut Vec<u32>, words: impl IntoIterator<Item = u32>) -> usize {
    let at = w.len();
    w.extend(words);
    at
}

/// The words of `pass`'s inputs and where each array starts. The block tables come last, so
/// two decode steps of one batch size differ in nothing but the tables' length.
pub(super) fn pack(pass: &Pass) -> (Vec<u32>, Layout) {
    let (batch, c) = (pass.batch, pass.config);
    let mut w = Vec::new();
    let ids = push(&mut w, batch.iter().flat_map(|s| s.tokens.iter().copied()));
    let tokens = w.len();
    let positions = push(
        &mut w,
        batch
            .iter()
            .flat_map(|s| (s.start_pos..s.start_pos + s.tokens.len()).map(|p| p as u32)),
    );
    let token_block = push(&mut w, slots(batch, pass.block_size, |b, _| b));
    let token_slot = push(&mut w, slots(batch, pass.block_size, |_, s| s));
    let token_seq = push(
        &mut w,
        (0..batch.len() as u32)
            .flat_map(|i| std::iter::repeat_n(i, batch[i as usize].tokens.len())),
    );
    let table_start = push(
        &mut w,
        batch.iter().scan(0u32, |at, s| {
            let first = *at;
            *at += s.blocks.len() as u32;
            Some(first)
        }),
    );
    let rows = logit_rows(batch);
    let at_rows = push(&mut w, rows.iter().map(|&r| r as u32));
    let lens: Vec<usize> = batch.iter().map(|s| s.tokens.len()).collect();
    let group = c.num_heads / c.num_kv_heads.max(1);
    let tiles = attention_tiles(c.head_dim, group, &lens)
        .map(|firsts| (firsts.len(), push(&mut w, firsts)))
        .map(|(n, at)| (at, n));
    let inv_freq = push(&mut w, pass.inv_freq.iter().map(|f| f.to_bits()));
    let block_tables = push(&mut w, batch.iter().flat_map(|s| s.blocks.iter().copied()));
    let layout = Layout {
        ids,
        positions,
        token_block,
        token_slot,
        token_seq,
        table_start,
        rows: (at_rows, rows.len()),
        tiles,
        inv_freq,
        block_tables,
        tokens,
        longest: batch
            .iter()
            .map(|s| s.start_pos + s.tokens.len())
            .max()
            .unwrap_or(0),
    };
    (w, layout)
}

impl Layout {
    /// The layout without what a replay may change (the contexts' length).
    pub(super) fn replay_shape(&self) -> Layout {
        Layout {
            longest: 0,
            ..self.clone()
        }
    }
}

impl<'a> Step<'a> {
    /// The step whose words (laid out as `layout`) start at device address `base`; `owned`:
    /// the buffer, where the step keeps it. `recorded`: the pass is recorded, to be
    /// replayed over other contexts.
    pub(super) fn at(
        base: u64,
        layout: &Layout,
        owned: Option<CudaSlice<u32>>,
        neox: bool,
        recorded: bool,
    ) -> Self {
        let a = |at: usize| base + 4 * at as u64;
        Step {
            _words: owned,
            ids: a(layout.ids),
            positions: a(layout.positions),
            token_block: a(layout.token_block),
            token_slot: a(layout.token_slot),
            token_seq: a(layout.token_seq),
            block_tables: a(layout.block_tables),
            table_start: a(layout.table_start),
            inv_freq: a(layout.inv_freq),
            rows: (a(layout.rows.0), layout.rows.1),
            attention_tiles: layout.tiles.map(|(at, n)| (a(at), n)),
            longest: (!recorded).then_some(layout.longest),
            neox,
            tokens: layout.tokens,
            _batch: std::marker::PhantomData,
        }
    }
}
/// Query rows of a `paged_attention_tiles_f16` CTA (`PT_ROWS`).
pub(super) const TILE_ROWS: usize = 16;

/// The first token of each tile of `paged_attention_tiles_f16` over a batch whose sequences
/// have `lens` new tokens each, in order: every sequence's new tokens cut into runs of
/// `TILE_ROWS / min(group, TILE_ROWS)` (`group` query heads a KV head), so each K/V row the
/// kernel stages serves the heads of a group for several tokens of a prefill or an extend
/// (and, in a decode step, the group's heads of one token). `None` for a head size the
/// kernel does not take (`paged_attention_f16` attends instead).
pub(super) fn attention_tiles(head_dim: usize, group: usize, lens: &[usize]) -> Option<Vec<u32>> {
    if !matches!(head_dim, 64 | 128) || group == 0 {
        return None;
    }
    let per_tile = TILE_ROWS / group.min(TILE_ROWS);
    let mut first = 0;
    let mut firsts = Vec::new();
    for &n in lens {
        firsts.extend((0..n).step_by(per_tile).map(|t| (first + t) as u32));
        first += n;
    }
    Some(firsts)
}

/// Per new token of the batch, `f(block, slot)` of its position in blocks of `block_size`.
pub(super) fn slots(
    batch: &[SeqInput],
    block_size: usize,
    f: impl Fn(u32, u32) -> u32,
) -> Vec<u32> {
    let mut out = Vec::new();
    for s in batch {
        for p in s.start_pos..s.start_pos + s.tokens.len() {
            out.push(f(s.blocks[p / block_size], (p % block_size) as u32));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pass of the Qwen3-8B shape (128-dim heads, four a KV head), rotary of two
    /// frequencies, blocks of 4 positions.
    fn words_of(batch: &[SeqInput]) -> (Vec<u32>, Layout) {
        let config = crate::model::random::shape("qwen3-8b").unwrap();
        let inv_freq = [1.0f32, 0.5];
        pack(&Pass {
            config: &config,
            batch,
            block_size: 4,
            inv_freq: &inv_freq,
            replay_key: None,
        })
    }

    #[test]
    fn a_step_packs_every_array_in_one_buffer() {
        // A prefill chunk of 3 tokens at positions 3..6 (logits of its last), and a decode at
        // position 4.
        let batch = [
            SeqInput {
                tokens: &[10, 11, 12],
                start_pos: 3,
                blocks: &[7, 2],
                logits: 1,
            },
            SeqInput {
                tokens: &[20],
                start_pos: 4,
                blocks: &[5, 9],
                logits: 1,
            },
        ];
        let (w, at) = words_of(&batch);
        let get = |start: usize, n: usize| w[start..start + n].to_vec();
        assert_eq!(at.tokens, 4);
        assert_eq!(get(at.ids, 4), [10, 11, 12, 20]);
        assert_eq!(get(at.positions, 4), [3, 4, 5, 4]);
        assert_eq!(get(at.token_block, 4), [7, 2, 2, 9]);
        assert_eq!(get(at.token_slot, 4), [3, 0, 1, 0]);
        assert_eq!(get(at.token_seq, 4), [0, 0, 0, 1]);
        assert_eq!(get(at.table_start, 2), [0, 2]);
        assert_eq!(at.rows, (at.rows.0, 2));
        assert_eq!(get(at.rows.0, 2), [2, 3]);
        let (tiles, n) = at.tiles.unwrap();
        assert_eq!(get(tiles, n), [0, 3]);
        assert_eq!(get(at.inv_freq, 2), [1.0f32.to_bits(), 0.5f32.to_bits()]);
        assert_eq!(at.block_tables + 4, w.len());
        assert_eq!(get(at.block_tables, 4), [7, 2, 5, 9]);
        assert_eq!(at.longest, 6);
    }

    #[test]
    fn decode_steps_of_one_batch_size_share_a_layout() {
        let step = |pos: usize, blocks: &'static [u32]| {
            let batch = [SeqInput {
                tokens: &[1],
                start_pos: pos,
                blocks,
                logits: 1,
            }];
            words_of(&batch).1
        };
        // Further on, the same layout but for the context's length (the tables come last).
        let (early, late) = (step(2, &[4]), step(6, &[4, 8]));
        assert_ne!(early, late);
        assert_eq!(early.replay_shape(), late.replay_shape());
    }

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
