//! Paged causal attention for a mixed batch (prefill chunks, extends and single-token decodes in
//! one call), reading K/V in place from the block pool.
//!
//! Cache layout per layer: V `[block][kv_head][slot][head_dim]`, K
//! `[block][kv_head][head_dim][slot]`. One KV head's part of a block is contiguous in both; a
//! vector loads eight columns of a V row, or one K column at eight positions (for eight scores
//! at once). Token `i` of a sequence whose new tokens start at position `p` attends to cache
//! positions `0..=p + i`. A work item scores its whole span first and subtracts each row's
//! maximum before the exponential, so the softmax is numerically stable for any context
//! length. Its query rows are the heads of one GQA group for a tile of consecutive tokens of
//! one sequence: every K and V vector read serves all of them, so a long prompt reads its K/V
//! once per tile rather than once per token. A row's result does not depend on the tile it was
//! computed in (each score and each output column is one chain of multiply-adds in a fixed
//! order), so a prompt's rows equal, bit for bit, those of its tokens decoded one at a time.
//! Work is split over (tile, KV head) pairs, and when there are too few of them to keep every
//! thread busy (a decode step of a model with two or three KV heads) also over chunks of each
//! pair's context, whose softmax states (maximum, sum, unnormalised output) are merged
//! afterwards.

use std::cell::RefCell;

use super::parallel::{current_threads, for_each_range, DisjointOut};
use super::{axpy, exp_portable, max_value, prefetch_lines, KvElem};

#[cfg(target_arch = "x86_64")]
mod avx2;

/// Largest supported block size.
pub const MAX_BLOCK_SIZE: usize = 256;
/// Fewest cache positions a context chunk covers when contexts are split.
const MIN_CHUNK_POSITIONS: usize = 64;
/// Query rows a tile aims for: enough that a K or V vector loaded feeds many multiply-adds,
/// few enough that the tile's scores over a long context stay in L2.
const TILE_ROWS: usize = 24;

/// One layer's paged K and V storage, in `f32` or `f16` ([`KvElem`]), laid out as the module
/// says.
pub struct PagedKv<'a, T: KvElem = f32> {
    pub k: &'a [T],
    pub v: &'a [T],
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl<T: KvElem> PagedKv<'_, T> {
    /// Offset of `(block, kv_head)`'s part of K (and of V).
    #[inline]
    pub fn block_offset(&self, block: u32, kv_head: usize) -> usize {
        ((block as usize * self.num_kv_heads + kv_head) * self.block_size) * self.head_dim
    }
}

/// One sequence of the batch: its block table and where its new tokens start.
#[derive(Clone, Copy, Debug)]
pub struct AttentionSeq<'a> {
    pub blocks: &'a [u32],
    pub start_pos: usize,
    pub num_tokens: usize,
}

/// `q` and `out` are `[tokens, num_heads, head_dim]`, tokens in sequence order. The K/V of the
/// new tokens must already be written to the cache.
pub fn paged_attention<T: KvElem>(
    q: &[f32],
    num_heads: usize,
    kv: &PagedKv<T>,
    seqs: &[AttentionSeq],
    scale: f32,
    out: &mut [f32],
) {
    let hd = kv.head_dim;
    let group = num_heads / kv.num_kv_heads;
    assert!(
        kv.block_size <= MAX_BLOCK_SIZE,
        "block size above {MAX_BLOCK_SIZE}"
    );
    assert_eq!(num_heads % kv.num_kv_heads, 0);
    assert_eq!(q.len(), out.len());
    // (sequence, context length) of every token.
    let token_ctx: Vec<(usize, usize)> = seqs
        .iter()
        .enumerate()
        .flat_map(|(s, seq)| (0..seq.num_tokens).map(move |i| (s, seq.start_pos + i + 1)))
        .collect();
    assert_eq!(q.len(), token_ctx.len() * num_heads * hd);

    // A (token, KV head) pair's query heads, contiguous in `q` and `out`.
    let pairs = token_ctx.len() * kv.num_kv_heads;
    let width = group * hd;
    let q_of = |pair: usize| &q[pair * width..(pair + 1) * width];
    let out = DisjointOut::new(out);
    let Some(chunk) = chunk_blocks(&token_ctx, pairs, kv.block_size) else {
        // One work item per (tile, KV head).
        let tiles = tiles(seqs, tile_tokens(group, pairs));
        for_each_range(tiles.len() * kv.num_kv_heads, |items| {
            for item in items {
                let (first, n) = tiles[item / kv.num_kv_heads];
                let kv_head = item % kv.num_kv_heads;
                let item_pairs = (first..first + n).map(|t| t * kv.num_kv_heads + kv_head);
                let q_t: Vec<&[f32]> = item_pairs.clone().map(q_of).collect();
                // SAFETY: item `item` owns exactly its pairs' `width` output elements.
                let mut out_t: Vec<&mut [f32]> = item_pairs
                    .map(|pair| unsafe { out.slice(pair * width, width) })
                    .collect();
                out_t.iter_mut().for_each(|o| o.fill(0.0));
                let (s, ctx) = token_ctx[first];
                let mut state = SoftmaxState::new(n * group);
                let span = Span {
                    blocks: seqs[s].blocks,
                    first_pos: 0,
                    kv_head,
                    ctx,
                    scale,
                };
                attend_blocks(&q_t, &mut out_t, kv, span, &mut state);
                state.normalise(&mut out_t, hd);
            }
        });
        return;
    };
    // Work items are (pair, first block of its chunk), a pair's chunks consecutive; each
    // leaves its unnormalised output and softmax state in `partial`.
    let items: Vec<(usize, usize)> = (0..pairs)
        .flat_map(|pair| {
            let ctx = token_ctx[pair / kv.num_kv_heads].1;
            (0..ctx.div_ceil(kv.block_size))
                .step_by(chunk)
                .map(move |first| (pair, first))
        })
        .collect();
    let stride = width + 2 * group;
    let mut partial = vec![0f32; items.len() * stride];
    let parts = DisjointOut::new(&mut partial);
    for_each_range(items.len(), |range| {
        for i in range {
            let (pair, first) = items[i];
            let (s, ctx) = token_ctx[pair / kv.num_kv_heads];
            let blocks = seqs[s].blocks;
            let blocks = &blocks[first..blocks.len().min(first + chunk)];
            // SAFETY: item `i` owns exactly these `stride` elements of `partial`.
            let part = unsafe { parts.slice(i * stride, stride) };
            let (acc, max_sum) = part.split_at_mut(width);
            let mut state = SoftmaxState::new(group);
            let span = Span {
                blocks,
                first_pos: first * kv.block_size,
                kv_head: pair % kv.num_kv_heads,
                ctx,
                scale,
            };
            attend_blocks(&[q_of(pair)], &mut [acc], kv, span, &mut state);
            max_sum[..group].copy_from_slice(&state.max);
            max_sum[group..].copy_from_slice(&state.sum);
        }
    });
    // Merge each pair's chunks: rescale every chunk to the largest maximum.
    let mut start = 0;
    while start < items.len() {
        let pair = items[start].0;
        let end = start + items[start..].iter().take_while(|it| it.0 == pair).count();
        // SAFETY: the parallel call is over; pair `pair` owns these `width` elements.
        let out_g = unsafe { out.slice(pair * width, width) };
        for h in 0..group {
            let chunk_state = |i: usize| {
                let base = i * stride + width;
                (partial[base + h], partial[base + group + h])
            };
            let max = (start..end).fold(f32::NEG_INFINITY, |m, i| m.max(chunk_state(i).0));
            let dst = &mut out_g[h * hd..(h + 1) * hd];
            dst.fill(0.0);
            let mut sum = 0.0;
            for i in start..end {
                let (m, s) = chunk_state(i);
                let w = (m - max).exp();
                sum += s * w;
                axpy(
                    dst,
                    w,
                    &partial[i * stride + h * hd..i * stride + (h + 1) * hd],
                );
            }
            dst.iter_mut().for_each(|a| *a /= sum);
        }
        start = end;
    }
}

/// Blocks per context chunk when (token, KV head) pairs alone are too few to give every thread
/// several work items and some context is long enough to split; `None` otherwise.
fn chunk_blocks(token_ctx: &[(usize, usize)], pairs: usize, block_size: usize) -> Option<usize> {
    let wanted = 4 * current_threads();
    let longest = token_ctx.iter().map(|t| t.1).max().unwrap_or(0);
    if pairs == 0 || pairs >= wanted || longest < 2 * MIN_CHUNK_POSITIONS {
        return None;
    }
    let splits = wanted.div_ceil(pairs);
    let min_blocks = MIN_CHUNK_POSITIONS.div_ceil(block_size);
    let blocks = longest
        .div_ceil(block_size)
        .div_ceil(splits)
        .max(min_blocks);
    (blocks * block_size < longest).then_some(blocks)
}

/// Tokens per tile: enough for about [`TILE_ROWS`] query rows, fewer where the tiles would not
/// give every thread several work items.
fn tile_tokens(group: usize, pairs: usize) -> usize {
    let spread = pairs / (4 * current_threads());
    TILE_ROWS.div_ceil(group).min(spread).max(1)
}

/// (first token, tokens) of each tile: every sequence's new tokens cut into runs of `tokens`
/// (its last run shorter).
fn tiles(seqs: &[AttentionSeq], tokens: usize) -> Vec<(usize, usize)> {
    let mut first = 0;
    let mut tiles = Vec::new();
    for seq in seqs {
        for start in (0..seq.num_tokens).step_by(tokens) {
            tiles.push((first + start, tokens.min(seq.num_tokens - start)));
        }
        first += seq.num_tokens;
    }
    tiles
}

/// The running maximum and sum of the online softmax of each query row of a work item.
struct SoftmaxState {
    max: Vec<f32>,
    sum: Vec<f32>,
}

impl SoftmaxState {
    fn new(rows: usize) -> Self {
        Self {
            max: vec![f32::NEG_INFINITY; rows],
            sum: vec![0f32; rows],
        }
    }

    /// Divides each row's accumulated output (`out`'s slices cut into rows of `hd`, in order)
    /// by its sum.
    fn normalise(&self, out: &mut [&mut [f32]], hd: usize) {
        let rows = out.iter_mut().flat_map(|o| o.chunks_exact_mut(hd));
        for (row, sum) in rows.zip(&self.sum) {
            let inv = 1.0 / sum;
            row.iter_mut().for_each(|a| *a *= inv);
        }
    }
}

/// The cache positions one work item attends to: `blocks` (the first holding position
/// `first_pos`) of KV head `kv_head`, up to position `ctx` for the item's first token (and
/// `ctx + t` for its token `t`); scores scaled by `scale`.
#[derive(Clone, Copy)]
struct Span<'a> {
    blocks: &'a [u32],
    first_pos: usize,
    kv_head: usize,
    ctx: usize,
    scale: f32,
}

/// Attention of a work item's query rows over `span`: `q[t]` and `out[t]` hold token `t`'s
/// rows (one GQA group, `head_dim` values a head). Adds the unnormalised weighted values to
/// `out` and updates `state` (a row each). With AVX2, FMA and F16C where the CPU has them and
/// the head and block sizes are multiples of 8; portable otherwise.
fn attend_blocks<T: KvElem>(
    q: &[&[f32]],
    out: &mut [&mut [f32]],
    kv: &PagedKv<T>,
    span: Span,
    state: &mut SoftmaxState,
) {
    #[cfg(target_arch = "x86_64")]
    if kv.head_dim.is_multiple_of(8)
        && kv.block_size.is_multiple_of(8)
        && super::qmatmul::Isa::best() != super::qmatmul::Isa::Scalar
    {
        // SAFETY: every SIMD `Isa` includes AVX2, FMA and F16C.
        return unsafe { attend_blocks_avx2(q, out, kv, span, state) };
    }
    attend_blocks_portable(q, out, kv, span, state)
}

/// [`attend_blocks`] without SIMD intrinsics.
fn attend_blocks_portable<T: KvElem>(
    q: &[&[f32]],
    out: &mut [&mut [f32]],
    kv: &PagedKv<T>,
    span: Span,
    state: &mut SoftmaxState,
) {
    let hd = kv.head_dim;
    let ops = BlockOps {
        scores: |q: &[&[f32]], k: &[&[T]], n: usize, scale: f32, out: &mut [f32], stride| {
            let bs = kv.block_size;
            for (b, block) in k.iter().enumerate().take(n.div_ceil(bs)) {
                let count = (n - b * bs).min(bs);
                for (r, q) in q.iter().enumerate() {
                    let s = &mut out[r * stride + b * bs..][..count];
                    s.fill(0.0);
                    for (&x, column) in q.iter().zip(block.chunks_exact(bs)) {
                        axpy(s, x, &column[..count]);
                    }
                    s.iter_mut().for_each(|s| *s *= scale);
                }
            }
        },
        values: |acc: &mut [&mut [f32]], w: &[f32], stride: usize, v: &[&[T]]| {
            for (r, acc) in acc.iter_mut().enumerate() {
                let rows = v.iter().flat_map(|b| b.chunks_exact(hd));
                for (&w, v) in w[r * stride..].iter().zip(rows) {
                    axpy(acc, w, v);
                }
            }
        },
        exp: exp_portable,
    };
    attend_blocks_with(ops, q, out, kv, span, state)
}

/// [`attend_blocks`] compiled for AVX2, FMA and F16C, for head and block sizes a multiple of
/// 8: register tiles of several rows' scores over eight positions of K's columns a vector, and
/// of their outputs across V's rows (see [`avx2`]).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `kv.head_dim` and `kv.block_size` must be
/// multiples of 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_blocks_avx2<T: KvElem>(
    q: &[&[f32]],
    out: &mut [&mut [f32]],
    kv: &PagedKv<T>,
    span: Span,
    state: &mut SoftmaxState,
) {
    // SAFETY (of the calls): this function only runs where AVX2, FMA and F16C are available,
    // with rows of a multiple of 8 elements.
    let ops = BlockOps {
        scores: |q: &[&[f32]], k: &[&[T]], n: usize, scale: f32, out: &mut [f32], stride| unsafe {
            avx2::scores(q, k, n, scale, out, stride)
        },
        values: |acc: &mut [&mut [f32]], w: &[f32], stride: usize, v: &[&[T]]| unsafe {
            avx2::weighted_sums(acc, w, stride, v)
        },
        exp: |xs: &mut [f32]| unsafe { super::avx2::exp(xs) },
    };
    attend_blocks_with(ops, q, out, kv, span, state)
}

/// The vector work of a work item's query rows over the rows of a few consecutive blocks of
/// a span (every block but the last full), passed into [`attend_blocks_with`] so each
/// instruction set's entry point inlines its own and dispatches once per work item.
struct BlockOps<S, V, E> {
    /// For every query row `q[r]` and each of the first `n` positions `i` of `k`'s blocks in
    /// turn (each a block's whole part of K), `out[r · stride + i] = scale · (q[r] · k_i)`.
    scores: S,
    /// For every output row `acc[r]`, `acc[r] += Σ w[r · stride + i] · v_i` over the rows
    /// `v_i` of `v`'s blocks in turn.
    values: V,
    /// `xs[i] = exp(xs[i])`; returns their sum.
    exp: E,
}

/// Blocks ahead of the one being read whose rows are requested: a sequence's blocks lie
/// anywhere in the pool, a few KB each, too short for the hardware prefetcher. (A decode
/// step's K/V is cold: the weights streamed through the caches since the last step.)
const PREFETCH_BLOCKS: usize = 2;
/// Cache positions a call of the block ops covers at least: every call reloads the weighted
/// sums' outputs into registers.
const CALL_POSITIONS: usize = 32;

/// The body of [`attend_blocks`], in two passes over the span: every position's score for
/// every query row (a block's K read once for all of them), each row's softmax over all of
/// its scores at once, then the weighted sum of the V rows (a block's rows again serving every
/// row). Keeping the span's scores (4 bytes per position and row, in a per-thread buffer)
/// saves an online softmax's per-block work: a maximum, a scalar `exp` and a rescaling of the
/// output for every block and row. A row past its own context (an earlier token of the tile)
/// gets weight 0 for the positions after it, which leaves its sums as they were.
#[inline(always)]
fn attend_blocks_with<T: KvElem, S, V, E>(
    ops: BlockOps<S, V, E>,
    q: &[&[f32]],
    out: &mut [&mut [f32]],
    kv: &PagedKv<T>,
    span: Span,
    state: &mut SoftmaxState,
) where
    S: Fn(&[&[f32]], &[&[T]], usize, f32, &mut [f32], usize),
    V: Fn(&mut [&mut [f32]], &[f32], usize, &[&[T]]),
    E: Fn(&mut [f32]) -> f32,
{
    thread_local! {
        /// Scores of a span, grown, never shrunk (steady-state calls allocate nothing).
        static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    }
    let hd = kv.head_dim;
    let bs = kv.block_size;
    let Span {
        blocks,
        first_pos,
        kv_head,
        ctx,
        scale,
    } = span;
    let q_rows: Vec<&[f32]> = q.iter().flat_map(|t| t.chunks_exact(hd)).collect();
    let mut out_rows: Vec<&mut [f32]> = out
        .iter_mut()
        .flat_map(|t| t.chunks_exact_mut(hd))
        .collect();
    let rows = q_rows.len();
    if rows == 0 {
        return;
    }
    let group = rows / q.len();
    let last_ctx = ctx + q.len() - 1;
    let n_blocks = blocks
        .len()
        .min(last_ctx.saturating_sub(first_pos).div_ceil(bs));
    if n_blocks == 0 {
        return;
    }
    let positions = (last_ctx - first_pos).min(n_blocks * bs);
    // Where block `bi`'s part of K lies in the layer (and of V: its first rows).
    let block_part = |bi: usize| {
        let base = kv.block_offset(blocks[bi], kv_head);
        base..base + bs * hd
    };
    let block_rows = |bi: usize| {
        let part = block_part(bi);
        part.start..part.start + bs.min(positions - bi * bs) * hd
    };
    let prefetch = |cache: &[T], bi: usize| {
        if bi < n_blocks {
            let part = &cache[block_part(bi)];
            prefetch_lines(part.as_ptr(), std::mem::size_of_val(part));
        }
    };
    // Each block's part of K and its rows of V; a call of the block ops covers `per_call`
    // blocks.
    let k_blocks: Vec<&[T]> = (0..n_blocks).map(|bi| &kv.k[block_part(bi)]).collect();
    let v_blocks: Vec<&[T]> = (0..n_blocks).map(|bi| &kv.v[block_rows(bi)]).collect();
    let per_call = CALL_POSITIONS.div_ceil(bs);
    let calls = || {
        (0..n_blocks)
            .step_by(per_call)
            .map(move |first| first..n_blocks.min(first + per_call))
    };
    SCORES.with(|cell| {
        let mut buf = cell.borrow_mut();
        if buf.len() < rows * positions {
            buf.resize(rows * positions, 0.0);
        }
        // Row `r`'s scores at `scores[r * positions..]`.
        let scores = &mut buf[..rows * positions];
        (0..PREFETCH_BLOCKS).for_each(|bi| prefetch(kv.k, bi));
        for call in calls() {
            call.clone()
                .for_each(|bi| prefetch(kv.k, bi + PREFETCH_BLOCKS));
            let n = positions.min(call.end * bs) - call.start * bs;
            let out = &mut scores[call.start * bs..];
            (ops.scores)(&q_rows, &k_blocks[call], n, scale, out, positions);
        }
        // The first V rows come in while the softmax runs.
        (0..PREFETCH_BLOCKS).for_each(|bi| prefetch(kv.v, bi));
        for (r, s) in scores.chunks_exact_mut(positions).enumerate() {
            // The positions row `r` (token `r / group`) attends to.
            let len = (ctx + r / group).saturating_sub(first_pos).min(positions);
            let (s, past) = s.split_at_mut(len);
            past.fill(0.0);
            if len == 0 {
                continue;
            }
            let max = max_value(s).max(state.max[r]);
            // A state carried in from an earlier span is rescaled to the new maximum.
            let correction = (state.max[r] - max).exp();
            if correction != 1.0 {
                out_rows[r].iter_mut().for_each(|a| *a *= correction);
                state.sum[r] *= correction;
            }
            s.iter_mut().for_each(|s| *s -= max);
            state.sum[r] += (ops.exp)(s);
            state.max[r] = max;
        }
        for call in calls() {
            call.clone()
                .for_each(|bi| prefetch(kv.v, bi + PREFETCH_BLOCKS));
            let w = &scores[call.start * bs..];
            (ops.values)(&mut out_rows, w, positions, &v_blocks[call]);
        }
    });
}

#[cfg(test)]
mod tests;
