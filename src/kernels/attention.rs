//! Paged causal attention for a mixed batch (prefill chunks, extends and single-token decodes in
//! one call), reading K/V in place from the block pool.
//!
//! Cache layout per layer: `[block][kv_head][slot][head_dim]`, so one KV head's rows of one block
//! are contiguous. Token `i` of a sequence whose new tokens start at position `p` attends to
//! cache positions `0..=p + i`. The softmax is computed online, one block at a time (running
//! maximum and sum), so it is numerically stable for any context length, and the query heads
//! of one GQA group share every K/V row read. Work is split over (token, KV head) pairs.

use super::parallel::{for_each_range, DisjointOut};
use super::{axpy, dot};

/// Largest supported block size: scores of one block live on the stack.
pub const MAX_BLOCK_SIZE: usize = 256;

/// One layer's paged K and V storage.
pub struct PagedKv<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl PagedKv<'_> {
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
pub fn paged_attention(
    q: &[f32],
    num_heads: usize,
    kv: &PagedKv,
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

    // One work item per (token, KV head): the `group` query heads that share that KV head,
    // which are contiguous in `q` and `out`.
    let width = group * hd;
    let out = DisjointOut::new(out);
    for_each_range(token_ctx.len() * kv.num_kv_heads, |items| {
        for item in items {
            let token = item / kv.num_kv_heads;
            let kv_head = item % kv.num_kv_heads;
            let (s, ctx) = token_ctx[token];
            // SAFETY: item `item` owns exactly these `width` output elements.
            let out_g = unsafe { out.slice(item * width, width) };
            let q_g = &q[item * width..(item + 1) * width];
            attend_group(q_g, out_g, kv, seqs[s].blocks, kv_head, ctx, scale);
        }
    });
}

/// Attention of the `group` query heads sharing `kv_head`, over the first `ctx` cache positions.
fn attend_group(
    q: &[f32],
    out: &mut [f32],
    kv: &PagedKv,
    blocks: &[u32],
    kv_head: usize,
    ctx: usize,
    scale: f32,
) {
    let hd = kv.head_dim;
    let bs = kv.block_size;
    let group = q.len() / hd;
    let mut running_max = vec![f32::NEG_INFINITY; group];
    let mut running_sum = vec![0f32; group];
    out.fill(0.0);
    let mut scores = [0f32; MAX_BLOCK_SIZE];
    for (bi, &block) in blocks.iter().enumerate() {
        let start = bi * bs;
        if start >= ctx {
            break;
        }
        let n = bs.min(ctx - start);
        let base = kv.block_offset(block, kv_head);
        let k_rows = &kv.k[base..base + n * hd];
        let v_rows = &kv.v[base..base + n * hd];
        for h in 0..group {
            let qh = &q[h * hd..(h + 1) * hd];
            let acc = &mut out[h * hd..(h + 1) * hd];
            let mut block_max = f32::NEG_INFINITY;
            for (score, k) in scores[..n].iter_mut().zip(k_rows.chunks_exact(hd)) {
                *score = dot(qh, k) * scale;
                block_max = block_max.max(*score);
            }
            let new_max = running_max[h].max(block_max);
            let correction = (running_max[h] - new_max).exp();
            if correction != 1.0 {
                acc.iter_mut().for_each(|a| *a *= correction);
                running_sum[h] *= correction;
            }
            for (score, v) in scores[..n].iter().zip(v_rows.chunks_exact(hd)) {
                let w = (score - new_max).exp();
                running_sum[h] += w;
                axpy(acc, w, v);
            }
            running_max[h] = new_max;
        }
    }
    for h in 0..group {
        let inv = 1.0 / running_sum[h];
        out[h * hd..(h + 1) * hd].iter_mut().for_each(|a| *a *= inv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Plain attention over a dense `[positions, kv_heads, hd]` copy of the cache.
    fn reference(
        q: &[f32],
        (dense_k, dense_v): (&[Vec<f32>], &[Vec<f32>]),
        seqs: &[(usize, usize)],
        (heads, kv_heads, hd): (usize, usize, usize),
        scale: f32,
    ) -> Vec<f32> {
        let mut out = Vec::new();
        let mut t = 0;
        for (s, &(start, n)) in seqs.iter().enumerate() {
            for i in 0..n {
                let ctx = start + i + 1;
                for h in 0..heads {
                    let kvh = h / (heads / kv_heads);
                    let qh = &q[(t * heads + h) * hd..][..hd];
                    let scores: Vec<f64> = (0..ctx)
                        .map(|p| {
                            let k = &dense_k[s][(p * kv_heads + kvh) * hd..][..hd];
                            qh.iter()
                                .zip(k)
                                .map(|(a, b)| (*a as f64) * (*b as f64))
                                .sum::<f64>()
                                * scale as f64
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                    let z: f64 = w.iter().sum();
                    for d in 0..hd {
                        let val: f64 = (0..ctx)
                            .map(|p| w[p] * dense_v[s][(p * kv_heads + kvh) * hd + d] as f64)
                            .sum();
                        out.push((val / z) as f32);
                    }
                }
                t += 1;
            }
        }
        out
    }

    fn run_case(
        block_size: usize,
        heads: usize,
        kv_heads: usize,
        hd: usize,
        seqs: &[(usize, usize)],
    ) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let num_blocks_per_seq: Vec<usize> = seqs
            .iter()
            .map(|(s, n)| (s + n).div_ceil(block_size))
            .collect();
        let total_blocks: usize = num_blocks_per_seq.iter().sum::<usize>() + 3;
        let row = kv_heads * block_size * hd;
        let mut k = vec![0f32; total_blocks * row];
        let mut v = vec![0f32; total_blocks * row];
        // Hand out blocks in a scrambled order so tables are not contiguous.
        let mut free: Vec<u32> = (0..total_blocks as u32).rev().collect();
        free.swap(0, 2);
        let mut tables = Vec::new();
        let mut dense_k = Vec::new();
        let mut dense_v = Vec::new();
        for (&(start, n), &nb) in seqs.iter().zip(&num_blocks_per_seq) {
            let table: Vec<u32> = (0..nb).map(|_| free.pop().unwrap()).collect();
            let len = start + n;
            let dk: Vec<f32> = (0..len * kv_heads * hd)
                .map(|_| rng.random_range(-2.0..2.0))
                .collect();
            let dv: Vec<f32> = (0..len * kv_heads * hd)
                .map(|_| rng.random_range(-2.0..2.0))
                .collect();
            for p in 0..len {
                for h in 0..kv_heads {
                    let dst = ((table[p / block_size] as usize * kv_heads + h) * block_size
                        + p % block_size)
                        * hd;
                    let src = (p * kv_heads + h) * hd;
                    k[dst..dst + hd].copy_from_slice(&dk[src..src + hd]);
                    v[dst..dst + hd].copy_from_slice(&dv[src..src + hd]);
                }
            }
            tables.push(table);
            dense_k.push(dk);
            dense_v.push(dv);
        }
        let tokens: usize = seqs.iter().map(|s| s.1).sum();
        let q: Vec<f32> = (0..tokens * heads * hd)
            .map(|_| rng.random_range(-2.0..2.0))
            .collect();
        let scale = 1.0 / (hd as f32).sqrt();
        let attn_seqs: Vec<AttentionSeq> = seqs
            .iter()
            .zip(&tables)
            .map(|(&(start_pos, num_tokens), t)| AttentionSeq {
                blocks: t,
                start_pos,
                num_tokens,
            })
            .collect();
        let kv = PagedKv {
            k: &k,
            v: &v,
            block_size,
            num_kv_heads: kv_heads,
            head_dim: hd,
        };
        let mut out = vec![f32::NAN; q.len()];
        paged_attention(&q, heads, &kv, &attn_seqs, scale, &mut out);
        let want = reference(&q, (&dense_k, &dense_v), seqs, (heads, kv_heads, hd), scale);
        let max_err = out
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(max_err < 1e-5, "max abs error {max_err}");
    }

    #[test]
    fn mixed_prefill_extend_and_decode_match_dense_attention() {
        // (start position, new tokens): a prefill, an extend, two decodes.
        run_case(16, 8, 2, 32, &[(0, 21), (19, 3), (40, 1), (0, 1)]);
    }

    #[test]
    fn odd_head_dim_and_block_size_match_dense_attention() {
        run_case(5, 6, 3, 13, &[(0, 17), (33, 1)]);
    }

    #[test]
    fn multi_head_attention_without_grouping_matches() {
        run_case(8, 4, 4, 16, &[(0, 9), (8, 8)]);
    }

    #[test]
    fn empty_batch_writes_nothing() {
        let kv = PagedKv {
            k: &[],
            v: &[],
            block_size: 16,
            num_kv_heads: 1,
            head_dim: 4,
        };
        let mut out: Vec<f32> = vec![];
        paged_attention(&[], 2, &kv, &[], 0.5, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn extreme_scores_stay_finite() {
        // Large logits would overflow a naive exp; the online softmax must not.
        let hd = 4;
        let k = vec![100.0f32; 2 * hd];
        let v: Vec<f32> = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let kv = PagedKv {
            k: &k,
            v: &v,
            block_size: 2,
            num_kv_heads: 1,
            head_dim: hd,
        };
        let q = vec![100.0f32; hd];
        let mut out = vec![0f32; hd];
        let blocks = [0u32];
        let seqs = [AttentionSeq {
            blocks: &blocks,
            start_pos: 1,
            num_tokens: 1,
        }];
        paged_attention(&q, 1, &kv, &seqs, 1.0, &mut out);
        assert_eq!(out, vec![3.0, 4.0, 5.0, 6.0]);
    }
}
