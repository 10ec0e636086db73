//! Paged causal attention for a mixed batch (prefill chunks, extends and single-token decodes in
//! one call), reading K/V in place from the block pool.
//!
//! Cache layout per layer: `[block][kv_head][slot][head_dim]`, so one KV head's rows of one block
//! are contiguous. Token `i` of a sequence whose new tokens start at position `p` attends to
//! cache positions `0..=p + i`. A work item scores its whole span first and subtracts each
//! head's maximum before the exponential, so the softmax is numerically stable for any context
//! length, and the query heads of one GQA group share every K/V row read. Work is split over
//! (token, KV head) pairs, and
//! when there are too few of them to keep every thread busy (a decode step of a model with two
//! or three KV heads) also over chunks of each pair's context, whose softmax states (maximum,
//! sum, unnormalised output) are merged afterwards.

use std::cell::RefCell;

use super::parallel::{current_threads, for_each_range, DisjointOut};
use super::{axpy, dot, exp_portable, prefetch_lines, KvElem};

#[cfg(target_arch = "x86_64")]
mod avx2;

/// Largest supported block size: scores of one block live on the stack.
pub const MAX_BLOCK_SIZE: usize = 256;
/// Fewest cache positions a context chunk covers when contexts are split.
const MIN_CHUNK_POSITIONS: usize = 64;

/// One layer's paged K and V storage, in `f32` or `f16` ([`KvElem`]).
pub struct PagedKv<'a, T: KvElem = f32> {
    pub k: &'a [T],
    pub v: &'a [T],
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl<T: KvElem> PagedKv<'_, T> {
    /// Offset of the first row of `(block, kv_head)`.
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

    let pairs = token_ctx.len() * kv.num_kv_heads;
    let width = group * hd;
    let out = DisjointOut::new(out);
    let Some(chunk) = chunk_blocks(&token_ctx, pairs, kv.block_size) else {
        // One work item per (token, KV head): the `group` query heads that share that KV
        // head, which are contiguous in `q` and `out`.
        for_each_range(pairs, |items| {
            for item in items {
                let (s, ctx) = token_ctx[item / kv.num_kv_heads];
                let kv_head = item % kv.num_kv_heads;
                // SAFETY: item `item` owns exactly these `width` output elements.
                let out_g = unsafe { out.slice(item * width, width) };
                let q_g = &q[item * width..(item + 1) * width];
                let mut state = SoftmaxState::new(group);
                out_g.fill(0.0);
                let span = Span {
                    blocks: seqs[s].blocks,
                    first_pos: 0,
                    kv_head,
                    ctx,
                    scale,
                };
                attend_blocks(q_g, out_g, kv, span, &mut state);
                state.normalise(out_g, hd);
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
            let q_g = &q[pair * width..(pair + 1) * width];
            let span = Span {
                blocks,
                first_pos: first * kv.block_size,
                kv_head: pair % kv.num_kv_heads,
                ctx,
                scale,
            };
            attend_blocks(q_g, acc, kv, span, &mut state);
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

/// The running maximum and sum of the online softmax of each query head of a group.
struct SoftmaxState {
    max: Vec<f32>,
    sum: Vec<f32>,
}

impl SoftmaxState {
    fn new(group: usize) -> Self {
        Self {
            max: vec![f32::NEG_INFINITY; group],
            sum: vec![0f32; group],
        }
    }

    /// Divides each head's accumulated output by its sum.
    fn normalise(&self, out: &mut [f32], hd: usize) {
        for (h, sum) in self.sum.iter().enumerate() {
            let inv = 1.0 / sum;
            out[h * hd..(h + 1) * hd].iter_mut().for_each(|a| *a *= inv);
        }
    }
}

/// The cache positions one work item attends to: `blocks` (the first holding position
/// `first_pos`) of KV head `kv_head`, up to position `ctx`; scores scaled by `scale`.
#[derive(Clone, Copy)]
struct Span<'a> {
    blocks: &'a [u32],
    first_pos: usize,
    kv_head: usize,
    ctx: usize,
    scale: f32,
}

/// Attention of the query heads of `q` (one GQA group) over `span`: adds the unnormalised
/// weighted values to `out` and updates `state`. With AVX2, FMA and F16C where the CPU has
/// them and the head size is a multiple of 8; portable otherwise.
fn attend_blocks<T: KvElem>(
    q: &[f32],
    out: &mut [f32],
    kv: &PagedKv<T>,
    span: Span,
    state: &mut SoftmaxState,
) {
    #[cfg(target_arch = "x86_64")]
    if kv.head_dim.is_multiple_of(8) && super::qmatmul::Isa::best() != super::qmatmul::Isa::Scalar {
        // SAFETY: every SIMD `Isa` includes AVX2, FMA and F16C.
        return unsafe { attend_blocks_avx2(q, out, kv, span, state) };
    }
    attend_blocks_portable(q, out, kv, span, state)
}

/// [`attend_blocks`] without SIMD intrinsics.
fn attend_blocks_portable<T: KvElem>(
    q: &[f32],
    out: &mut [f32],
    kv: &PagedKv<T>,
    span: Span,
    state: &mut SoftmaxState,
) {
    let hd = kv.head_dim;
    let ops = BlockOps {
        scores: |q: &[f32], k: &[T], scale: f32, out: &mut [f32], stride: usize| {
            let mut max = [f32::NEG_INFINITY; 2];
            for (h, q) in q.chunks_exact(hd).enumerate() {
                for (i, k) in k.chunks_exact(hd).enumerate() {
                    out[h * stride + i] = dot(q, k) * scale;
                    max[h] = max[h].max(out[h * stride + i]);
                }
            }
            max
        },
        values: |acc: &mut [f32], w: &[f32], stride: usize, v: &[T]| {
            for (h, acc) in acc.chunks_exact_mut(hd).enumerate() {
                for (&w, v) in w[h * stride..].iter().zip(v.chunks_exact(hd)) {
                    axpy(acc, w, v);
                }
            }
        },
        exp: exp_portable,
    };
    attend_blocks_with(ops, q, out, kv, span, state)
}

/// [`attend_blocks`] compiled for AVX2, FMA and F16C, for head sizes a multiple of 8. Query
/// heads go two at a time, so every K or V vector loaded (and converted from f16) serves both:
/// four rows' scores for the two heads come from eight accumulators reduced together, and the
/// two heads' outputs stay in registers 32 columns at a time across a block's rows. An odd
/// last head goes alone (eight rows' scores at once, 64 output columns in registers).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `kv.head_dim` must be a multiple of 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_blocks_avx2<T: KvElem>(
    q: &[f32],
    out: &mut [f32],
    kv: &PagedKv<T>,
    span: Span,
    state: &mut SoftmaxState,
) {
    // SAFETY (of the calls): this function only runs where AVX2, FMA and F16C are available,
    // with rows of a multiple of 8 elements.
    let hd = kv.head_dim;
    let ops = BlockOps {
        scores: |q: &[f32], k: &[T], scale: f32, out: &mut [f32], stride: usize| unsafe {
            if q.len() == hd {
                [avx2::scores(q, k, scale, &mut out[..k.len() / hd]), 0.0]
            } else {
                avx2::scores_pair(q, k, scale, out, stride)
            }
        },
        values: |acc: &mut [f32], w: &[f32], stride: usize, v: &[T]| unsafe {
            if acc.len() == hd {
                avx2::weighted_sum(acc, &w[..v.len() / hd], v)
            } else {
                avx2::weighted_sum_pair(acc, w, stride, v)
            }
        },
        exp: |xs: &mut [f32]| unsafe { super::avx2::exp(xs) },
    };
    attend_blocks_with(ops, q, out, kv, span, state)
}

/// The vector work of one or two query heads over one block's rows, passed into
/// [`attend_blocks_with`] so each instruction set's entry point inlines its own and dispatches
/// once per work item.
struct BlockOps<S, V, E> {
    /// For the one or two query heads in `q` (`hd` values each) and every row `i` of `k`,
    /// `out[h · stride + i] = scale · (q[h] · k[i])`; returns each head's largest (the second
    /// unused for one head).
    scores: S,
    /// For the one or two heads in `acc` (`hd` values each), `acc[h] += Σ w[h · stride + i] ·
    /// v[i]` over the rows `i` of `v`.
    values: V,
    /// `xs[i] = exp(xs[i])`; returns their sum.
    exp: E,
}

/// Blocks ahead of the one being read whose rows are requested: a sequence's blocks lie
/// anywhere in the pool, a few KB each, too short for the hardware prefetcher. (A decode
/// step's K/V is cold: the weights streamed through the caches since the last step.)
const PREFETCH_BLOCKS: usize = 2;

/// The body of [`attend_blocks`], in two passes over the span: every position's score for
/// every query head of the group, two heads at a time (a block's K rows stay in L1 across the
/// pairs), each head's softmax over all of its scores at once, then the weighted sum of the V
/// rows (a block's rows again serving every pair). Keeping the span's scores (4 bytes per
/// position and head, in a per-thread buffer) saves an online softmax's per-block work: a
/// maximum, a scalar `exp` and a rescaling of the output for every block and head.
#[inline(always)]
fn attend_blocks_with<T: KvElem, S, V, E>(
    ops: BlockOps<S, V, E>,
    q: &[f32],
    out: &mut [f32],
    kv: &PagedKv<T>,
    span: Span,
    state: &mut SoftmaxState,
) where
    S: Fn(&[f32], &[T], f32, &mut [f32], usize) -> [f32; 2],
    V: Fn(&mut [f32], &[f32], usize, &[T]),
    E: Fn(&mut [f32]) -> f32,
{
    thread_local! {
        /// Scores of a span, grown, never shrunk (steady-state calls allocate nothing).
        static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    }
    let hd = kv.head_dim;
    let bs = kv.block_size;
    let group = q.len() / hd;
    let Span {
        blocks,
        first_pos,
        kv_head,
        ctx,
        scale,
    } = span;
    let n_blocks = blocks.len().min(ctx.saturating_sub(first_pos).div_ceil(bs));
    if n_blocks == 0 {
        return;
    }
    let positions = (ctx - first_pos).min(n_blocks * bs);
    // Where block `bi`'s rows lie in the layer's K (and V).
    let rows = |bi: usize| {
        let base = kv.block_offset(blocks[bi], kv_head);
        base..base + bs.min(positions - bi * bs) * hd
    };
    let prefetch = |cache: &[T], bi: usize| {
        if bi < n_blocks {
            let rows = &cache[rows(bi)];
            prefetch_lines(rows.as_ptr(), std::mem::size_of_val(rows));
        }
    };
    // The group's heads, two at a time (an odd last one alone).
    let head_pairs = || (0..group).step_by(2).map(move |h| h..(h + 2).min(group));
    SCORES.with(|cell| {
        let mut buf = cell.borrow_mut();
        if buf.len() < (positions + 1) * group {
            buf.resize((positions + 1) * group, 0.0);
        }
        // Each head's largest score, then head `h`'s scores at `scores[h * positions..]`.
        let (maxima, scores) = buf[..(positions + 1) * group].split_at_mut(group);
        maxima.copy_from_slice(&state.max);
        (0..PREFETCH_BLOCKS).for_each(|bi| prefetch(kv.k, bi));
        for bi in 0..n_blocks {
            prefetch(kv.k, bi + PREFETCH_BLOCKS);
            let k_rows = &kv.k[rows(bi)];
            for heads in head_pairs() {
                let s = &mut scores[heads.start * positions + bi * bs..];
                let q = &q[heads.start * hd..heads.end * hd];
                let top = (ops.scores)(q, k_rows, scale, s, positions);
                for (max, top) in maxima[heads].iter_mut().zip(top) {
                    *max = max.max(top);
                }
            }
        }
        // The first V rows come in while the softmax runs.
        (0..PREFETCH_BLOCKS).for_each(|bi| prefetch(kv.v, bi));
        for (h, &max) in maxima.iter().enumerate() {
            // A state carried in from an earlier span is rescaled to the new maximum.
            let correction = (state.max[h] - max).exp();
            if correction != 1.0 {
                out[h * hd..(h + 1) * hd]
                    .iter_mut()
                    .for_each(|a| *a *= correction);
                state.sum[h] *= correction;
            }
            let s = &mut scores[h * positions..(h + 1) * positions];
            s.iter_mut().for_each(|s| *s -= max);
            state.sum[h] += (ops.exp)(s);
            state.max[h] = max;
        }
        for bi in 0..n_blocks {
            prefetch(kv.v, bi + PREFETCH_BLOCKS);
            let v_rows = &kv.v[rows(bi)];
            for heads in head_pairs() {
                let w = &scores[heads.start * positions + bi * bs..];
                let acc = &mut out[heads.start * hd..heads.end * hd];
                (ops.values)(acc, w, positions, v_rows);
            }
        }
    });
}

#[cfg(test)]
mod tests;
