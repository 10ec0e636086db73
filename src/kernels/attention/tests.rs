//! Paged attention against dense attention in f64 over the same stored values, for mixed
//! batches, awkward shapes, split contexts, both cache types and both instruction-set paths.

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

fn run_case(block_size: usize, heads: usize, kv_heads: usize, hd: usize, seqs: &[(usize, usize)]) {
    run_case_in::<f32>(block_size, heads, kv_heads, hd, seqs);
    run_case_in::<half::f16>(block_size, heads, kv_heads, hd, seqs);
}

/// Attention over a cache of `T` against dense f64 attention over the same stored values.
fn run_case_in<T: KvElem>(
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
    let mut k = vec![T::default(); total_blocks * row];
    let mut v = vec![T::default(); total_blocks * row];
    // Hand out blocks in a scrambled order so tables are not contiguous.
    let mut free: Vec<u32> = (0..total_blocks as u32).rev().collect();
    free.swap(0, 2);
    let mut tables = Vec::new();
    let mut dense_k = Vec::new();
    let mut dense_v = Vec::new();
    for (&(start, n), &nb) in seqs.iter().zip(&num_blocks_per_seq) {
        let table: Vec<u32> = (0..nb).map(|_| free.pop().unwrap()).collect();
        let len = start + n;
        // Values the cache's type holds exactly, so the reference sees what is stored.
        let mut stored = || T::from_f32(rng.random_range(-2.0f32..2.0)).to_f32();
        let dk: Vec<f32> = (0..len * kv_heads * hd).map(|_| stored()).collect();
        let dv: Vec<f32> = (0..len * kv_heads * hd).map(|_| stored()).collect();
        for p in 0..len {
            for h in 0..kv_heads {
                // K's columns and V's rows of the (block, KV head) part.
                let part = (table[p / block_size] as usize * kv_heads + h) * block_size * hd;
                let slot = p % block_size;
                let src = (p * kv_heads + h) * hd;
                for d in 0..hd {
                    k[part + d * block_size + slot] = T::from_f32(dk[src + d]);
                    v[part + slot * hd + d] = T::from_f32(dv[src + d]);
                }
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
fn long_decode_contexts_split_over_threads_match_dense_attention() {
    // Few (token, KV head) pairs and long contexts: each context is cut into chunks whose
    // softmax states are merged; a short sequence in the same batch stays whole.
    run_case(16, 8, 2, 32, &[(300, 1)]);
    run_case(5, 6, 3, 13, &[(257, 1), (3, 2)]);
    run_case(16, 4, 1, 16, &[(1000, 1), (130, 1)]);
}

#[test]
fn contexts_split_only_when_pairs_are_few_and_long() {
    let threads = current_threads();
    // Short contexts: never split.
    assert_eq!(chunk_blocks(&[(0, 100)], 1, 16), None);
    // Enough pairs for every thread: never split.
    assert_eq!(chunk_blocks(&[(0, 5000)], 4 * threads, 16), None);
    // One long decode: whole blocks, at least MIN_CHUNK_POSITIONS each, fewer than the
    // context.
    let blocks = chunk_blocks(&[(0, 5000)], 1, 16).expect("a long context splits");
    assert!(blocks * 16 >= MIN_CHUNK_POSITIONS && blocks * 16 < 5000);
}

#[test]
fn model_head_sizes_match_dense_attention() {
    // Head sizes of real models (64, 128) and ones that leave 8-column tails (24, 72),
    // with partial blocks and partial groups of eight rows.
    for hd in [64, 128, 24, 72] {
        run_case(16, 9, 3, hd, &[(0, 13), (21, 1), (100, 1)]);
    }
    run_case(16, 14, 2, 64, &[(300, 1)]);
}

/// A work item's body, as [`attend_blocks`] and its entry points are.
type Body = fn(&[&[f32]], &mut [&mut [f32]], &PagedKv, Span, &mut SoftmaxState);

/// Random K and V for four blocks of one KV head (`bs` positions of `hd` each), and
/// `group` query heads, in that order from `rng`.
fn one_kv_head(
    rng: &mut impl Rng,
    bs: usize,
    group: usize,
    hd: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut random =
        |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0..2.0)).collect() };
    let k = random(4 * bs * hd);
    let v = random(4 * bs * hd);
    (k, v, random(group * hd))
}

/// The cache view of [`one_kv_head`]'s K and V.
fn one_kv_head_view<'a>(k: &'a [f32], v: &'a [f32], bs: usize, hd: usize) -> PagedKv<'a> {
    PagedKv {
        k,
        v,
        block_size: bs,
        num_kv_heads: 1,
        head_dim: hd,
    }
}

/// `body` over `spans` in turn for one token's `group` query heads, carrying one softmax
/// state; the normalised output.
fn attend_spans(body: Body, q: &[f32], kv: &PagedKv, spans: &[Span], group: usize) -> Vec<f32> {
    let mut out = vec![0f32; q.len()];
    let mut state = SoftmaxState::new(group);
    for &span in spans {
        body(&[q], &mut [&mut out], kv, span, &mut state);
    }
    state.normalise(&mut [&mut out], kv.head_dim);
    out
}

#[test]
fn portable_and_simd_work_items_agree() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    for hd in [64, 128] {
        let (bs, group) = (16, 3);
        let (k, v, q) = one_kv_head(&mut rng, bs, group, hd);
        let kv = one_kv_head_view(&k, &v, bs, hd);
        let span = Span {
            blocks: &[2, 0, 3],
            first_pos: 0,
            kv_head: 0,
            ctx: 41,
            scale: 0.3,
        };
        let portable = attend_spans(attend_blocks_portable, &q, &kv, &[span], group);
        let best = attend_spans(attend_blocks, &q, &kv, &[span], group);
        for (a, b) in portable.iter().zip(&best) {
            assert!((a - b).abs() < 1e-5, "hd={hd}: {a} vs {b}");
        }
    }
}

/// Attending to a span's blocks in two calls that carry one softmax state gives what one
/// call over all of them gives (the second call rescales the first's output and sum).
#[test]
fn a_state_carried_across_spans_matches_one_span() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    let (bs, group, hd) = (16, 3, 64);
    let (k, v, q) = one_kv_head(&mut rng, bs, group, hd);
    let kv = one_kv_head_view(&k, &v, bs, hd);
    let blocks = [3, 1, 0, 2];
    let span = |from: usize, to: usize| Span {
        blocks: &blocks[from..to],
        first_pos: from * bs,
        kv_head: 0,
        ctx: 57,
        scale: 0.4,
    };
    for body in [attend_blocks_portable::<f32> as Body, attend_blocks::<f32>] {
        let whole = attend_spans(body, &q, &kv, &[span(0, 4)], group);
        let halves = attend_spans(body, &q, &kv, &[span(0, 2), span(2, 4)], group);
        for (a, b) in whole.iter().zip(&halves) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }
}

#[test]
fn long_prefills_match_dense_attention() {
    // Prompts over many blocks beside short extends and a decode, in the real models' group
    // shapes (7 and 6 query heads a KV head, odd and even) and an awkward one.
    run_case(16, 14, 2, 64, &[(0, 40), (5, 9), (70, 1)]);
    run_case(16, 12, 2, 128, &[(0, 37), (3, 6)]);
    run_case(5, 9, 3, 24, &[(0, 23), (12, 11)]);
}

/// A prompt's rows, computed in tiles of several tokens, are bit for bit those of its tokens
/// attended one at a time (as decode steps are), for both cache types.
#[test]
fn a_prompts_rows_equal_its_tokens_attended_alone() {
    fn check<T: KvElem>(heads: usize, kv_heads: usize, hd: usize, len: usize) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let bs = 16;
        let blocks: Vec<u32> = (0..len.div_ceil(bs) as u32).rev().collect();
        let size = blocks.len() * kv_heads * bs * hd;
        let mut random =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0..2.0)).collect() };
        let k: Vec<T> = random(size).into_iter().map(T::from_f32).collect();
        let v: Vec<T> = random(size).into_iter().map(T::from_f32).collect();
        let q = random(len * heads * hd);
        let kv = PagedKv {
            k: &k,
            v: &v,
            block_size: bs,
            num_kv_heads: kv_heads,
            head_dim: hd,
        };
        let seq = |start_pos: usize, num_tokens: usize| AttentionSeq {
            blocks: &blocks,
            start_pos,
            num_tokens,
        };
        let mut whole = vec![f32::NAN; q.len()];
        paged_attention(&q, heads, &kv, &[seq(0, len)], 0.125, &mut whole);
        let width = heads * hd;
        for (t, want) in whole.chunks_exact(width).enumerate() {
            let mut alone = vec![f32::NAN; width];
            paged_attention(
                &q[t * width..][..width],
                heads,
                &kv,
                &[seq(t, 1)],
                0.125,
                &mut alone,
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&alone),
                bits(want),
                "token {t} of {len}, {heads}/{kv_heads} heads, hd {hd}"
            );
        }
    }
    // Contexts short enough that a token alone is not split over threads.
    assert!(chunk_blocks(&[(0, 100)], 1, 16).is_none());
    for (heads, kv_heads, hd) in [(14, 2, 64), (12, 2, 128), (9, 3, 64), (4, 4, 24)] {
        check::<f32>(heads, kv_heads, hd, 100);
        check::<half::f16>(heads, kv_heads, hd, 61);
    }
}

#[test]
fn tiles_cut_each_sequence_into_runs() {
    let blocks = [0u32];
    let seq = |num_tokens: usize| AttentionSeq {
        blocks: &blocks,
        start_pos: 0,
        num_tokens,
    };
    assert_eq!(
        tiles(&[seq(10), seq(1), seq(4)], 4),
        [(0, 4), (4, 4), (8, 2), (10, 1), (11, 4)]
    );
    assert_eq!(tiles(&[seq(3)], 1), [(0, 1), (1, 1), (2, 1)]);
    // Tiles aim for TILE_ROWS rows, but leave every thread several work items.
    assert_eq!(tile_tokens(7, 1_000_000), TILE_ROWS.div_ceil(7));
    assert_eq!(tile_tokens(1, 1), 1);
    assert!(tile_tokens(6, 8 * current_threads()) <= 2);
}

#[test]
fn multi_head_attention_without_grouping_matches() {
    run_case(8, 4, 4, 16, &[(0, 9), (8, 8)]);
}

#[test]
fn empty_batch_writes_nothing() {
    let kv: PagedKv<f32> = PagedKv {
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
