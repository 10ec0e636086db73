//! Attention's scores and weighted sums for many query rows at once over `f32` or `f16` cache
//! rows, with AVX2, FMA and F16C ([`scores`], [`weighted_sums`]).
//!
//! Both hold a tile of up to [`MAX_TILE`] rows' results in registers, [`WIDE`] vectors a row
//! (16 positions for scores, 16 output columns for weighted sums), so each K or V vector
//! loaded feeds up to six multiply-adds and each query value or weight broadcast two. A
//! score is one chain of fused multiply-adds over the head's columns in order, and an output
//! column one chain over the positions in order, whatever the tile: a row gets the same bits
//! alone or among others.

use std::arch::x86_64::*;
use std::array::from_fn;
use std::cell::RefCell;

use crate::kernels::KvElem;

/// Most query rows a register tile holds.
const MAX_TILE: usize = 6;
/// Vectors of eight a register tile holds for each row: twelve accumulators in all, with the
/// vectors loaded and a broadcast fifteen of the sixteen registers.
const WIDE: usize = 2;

thread_local! {
    /// V rows converted to `f32`; grown, never shrunk.
    static ROWS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Eight cache elements from `p`, as `f32`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8<T: KvElem>(p: *const T) -> __m256 {
    if T::HALF {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    } else {
        _mm256_loadu_ps(p as *const f32)
    }
}

/// `(first row, rows)` of each register tile over `n` rows: as few tiles as [`MAX_TILE`]
/// allows, their sizes within one of each other (seven rows go as four and three, each with
/// enough independent chains to keep both FMA pipes busy, not as six and one).
fn row_tiles(n: usize) -> impl Iterator<Item = (usize, usize)> {
    let tiles = n.div_ceil(MAX_TILE).max(1);
    let (base, extra) = (n / tiles, n % tiles);
    (0..tiles).scan(0, move |first, t| {
        let rows = base + usize::from(t < extra);
        let tile = (*first, rows);
        *first += rows;
        Some(tile)
    })
}

/// Calls `$f::<R, V>` with the `[_; R]` array of `$row` (an expression of `$i`, the row), the
/// first of its `V` vectors and then the other arguments, for each register tile of `$n` rows
/// and each run of `$w` vectors ([`WIDE`] a call, fewer for the last).
macro_rules! for_tiles {
    ($n:expr, $w:expr, |$i:ident| $row:expr, $f:ident $(<$g:ty>)? ($($arg:expr),*)) => {
        for (first, rows) in row_tiles($n) {
            let mut tile = |t: usize| {
                let $i = first + t;
                $row
            };
            for at in (0..$w).step_by(WIDE) {
                match (rows, ($w - at).min(WIDE)) {
                    (1, 1) => $f::<1, 1 $(, $g)?>(from_fn(&mut tile), 8 * at, $($arg),*),
                    (1, _) => $f::<1, 2 $(, $g)?>(from_fn(&mut tile), 8 * at, $($arg),*),
                    (2, 1) => $f::<2, 1 $(, $g)?>(from_fn(&mut tile), 8 * at, $($arg),*),
                    (2, _) => $f::<2, 2 $(, $g)?>(from_fn(&mut tile), 8 * at, $($arg),*),
                    (3, 1) => $f::<3, 1 $(, $g)?>(from_fn(&mut tile), 8 * at, $($arg),*),
                    (3, _) => $f::<3, 2 $(, $g)?>(from_fn(&mut tile), 8 * at, $($arg),*),
                    (4, 1) => $f::<4, 1 $(, $g)?>(from_fn(&mut tile), 8 * at, $($arg),*),
                    (4, _) => $f::<4, 2 $(, $g)?>(from_fn(&mut tile), 8 * at, $($arg),*),
                    (5, 1) => $f::<5, 1 $(, $g)?>(from_fn(&mut tile), 8 * at, $($arg),*),
                    (5, _) => $f::<5, 2 $(, $g)?>(from_fn(&mut tile), 8 * at, $($arg),*),
                    (_, 1) => $f::<6, 1 $(, $g)?>(from_fn(&mut tile), 8 * at, $($arg),*),
                    (_, _) => $f::<6, 2 $(, $g)?>(from_fn(&mut tile), 8 * at, $($arg),*),
                }
            }
        }
    };
}

/// `out[r · stride + i] = scale · (q[r] · k_i)` for every query row `q[r]` (`hd` values, a
/// multiple of 8) and each of the first `n` positions `i` of `k`'s blocks in turn (each `hd`
/// columns of `bs` positions, `bs` a multiple of 8): a vector loads eight positions of one
/// column.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn scores<T: KvElem>(
    q: &[&[f32]],
    k: &[&[T]],
    n: usize,
    scale: f32,
    out: &mut [f32],
    stride: usize,
) {
    let (Some(hd), Some(first)) = (q.first().map(|r| r.len()), k.first()) else {
        return;
    };
    let bs = first.len() / hd;
    assert!(hd.is_multiple_of(8) && bs.is_multiple_of(8) && q.iter().all(|r| r.len() == hd));
    assert!(k.iter().all(|b| b.len() == bs * hd) && n <= k.len() * bs);
    assert!(n <= stride && out.len() >= (q.len() - 1) * stride + n);
    let out = out.as_mut_ptr();
    let scale = _mm256_set1_ps(scale);
    for (b, block) in k.iter().enumerate().take(n.div_ceil(bs)) {
        let block = Columns {
            k: block.as_ptr(),
            n: (n - b * bs).min(bs),
            bs,
            hd,
        };
        for_tiles!(
            q.len(),
            block.n.div_ceil(8),
            |r| (q[r].as_ptr(), out.add(r * stride + b * bs)),
            score_tile<T>(&block, scale)
        );
    }
}

/// A block of K: `hd` columns of `bs` positions, the first `n` of them wanted.
struct Columns<T> {
    k: *const T,
    n: usize,
    bs: usize,
    hd: usize,
}

/// The scores of positions `j..j + 8 · P` for a register tile's rows (each a query row and
/// where its scores go).
#[inline(always)]
unsafe fn score_tile<const R: usize, const P: usize, T: KvElem>(
    rows: [(*const f32, *mut f32); R],
    j: usize,
    block: &Columns<T>,
    scale: __m256,
) {
    let mut acc = [[_mm256_setzero_ps(); P]; R];
    let q = rows.map(|(q, _)| q);
    rank_one_updates(&mut acc, q, block.k.add(j), block.bs, block.hd);
    for (acc, &(_, out)) in acc.iter().zip(&rows) {
        for (p, acc) in acc.iter().enumerate() {
            let at = j + 8 * p;
            store_first(out.add(at), _mm256_mul_ps(*acc, scale), block.n - at);
        }
    }
}

/// `acc[r][j] += a[r][s] · b_s[j]` for each step `s < steps`, in order: `b_s` is the `V`
/// vectors of eight at `b + s · b_step` (loaded once a step for every row), `a[r][s]` is
/// broadcast. The register tile both scores and weighted sums are made of.
#[inline(always)]
unsafe fn rank_one_updates<const R: usize, const V: usize, T: KvElem>(
    acc: &mut [[__m256; V]; R],
    a: [*const f32; R],
    b: *const T,
    b_step: usize,
    steps: usize,
) {
    for s in 0..steps {
        let row = b.add(s * b_step);
        let b: [__m256; V] = from_fn(|j| load8(row.add(8 * j)));
        for (acc, a) in acc.iter_mut().zip(&a) {
            let x = _mm256_broadcast_ss(&*a.add(s));
            for (acc, &b) in acc.iter_mut().zip(&b) {
                *acc = _mm256_fmadd_ps(x, b, *acc);
            }
        }
    }
}

/// Stores the first `count` lanes of `x` (all eight for `count >= 8`) at `p`.
#[inline(always)]
unsafe fn store_first(p: *mut f32, x: __m256, count: usize) {
    if count >= 8 {
        _mm256_storeu_ps(p, x);
    } else {
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(count as i32), lanes);
        _mm256_maskstore_ps(p, mask, x);
    }
}

/// `acc[r] += Σ w[r · stride + i] · v_i` for every output row `acc[r]` (`hd` values, a
/// multiple of 8) over the rows `v_i` of `v`'s blocks in turn, copied first (as `f32`) into
/// one run of rows.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn weighted_sums<T: KvElem>(
    acc: &mut [&mut [f32]],
    w: &[f32],
    stride: usize,
    v: &[&[T]],
) {
    let Some(hd) = acc.first().map(|r| r.len()) else {
        return;
    };
    let n = v.iter().map(|b| b.len() / hd).sum::<usize>();
    assert!(hd.is_multiple_of(8) && acc.iter().all(|r| r.len() == hd));
    assert!(n <= stride && w.len() >= (acc.len() - 1) * stride + n);
    ROWS.with(|cell| {
        let mut buf = cell.borrow_mut();
        if buf.len() < n * hd {
            buf.resize(n * hd, 0.0);
        }
        let mut dst = buf.as_mut_ptr();
        for block in v {
            for i in (0..block.len() / hd * hd).step_by(8) {
                _mm256_storeu_ps(dst, load8(block.as_ptr().add(i)));
                dst = dst.add(8);
            }
        }
        let block = Rows {
            v: buf.as_ptr(),
            n,
            hd,
        };
        for_tiles!(
            acc.len(),
            hd / 8,
            |r| (acc[r].as_mut_ptr(), w.as_ptr().add(r * stride)),
            value_tile(&block)
        );
    })
}

/// V rows in `f32`: `n` of `hd`.
struct Rows {
    v: *const f32,
    n: usize,
    hd: usize,
}

/// The output columns `c..c + 8 · C` of a register tile's rows (each an output row and its
/// weights), in registers across all the rows of V.
#[inline(always)]
unsafe fn value_tile<const R: usize, const C: usize>(
    rows: [(*mut f32, *const f32); R],
    c: usize,
    block: &Rows,
) {
    let mut acc: [[__m256; C]; R] =
        from_fn(|r| from_fn(|j| _mm256_loadu_ps(rows[r].0.add(c + 8 * j))));
    let w = rows.map(|(_, w)| w);
    rank_one_updates(&mut acc, w, block.v.add(c), block.hd, block.n);
    for (acc, &(out, _)) in acc.iter().zip(&rows) {
        for (j, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.add(c + 8 * j), *acc);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_tiles_cover_the_rows_evenly() {
        for n in 1..40 {
            let tiles: Vec<(usize, usize)> = row_tiles(n).collect();
            assert_eq!(tiles.len(), n.div_ceil(MAX_TILE), "{n} rows");
            let mut next = 0;
            for &(first, rows) in &tiles {
                assert_eq!(first, next);
                assert!((1..=MAX_TILE).contains(&rows));
                next += rows;
            }
            assert_eq!(next, n);
            let sizes = tiles.iter().map(|t| t.1);
            assert!(
                sizes.clone().max().unwrap() - sizes.min().unwrap() <= 1,
                "{n} rows"
            );
        }
    }

    /// The vector scores and weighted sums of several rows at once against f64 sums over the
    /// stored values, for `f32` and `f16` rows; and each row's results, bit for bit, what it
    /// gets alone.
    fn check_simd_rows<T: KvElem>() {
        if crate::kernels::qmatmul::Isa::best() == crate::kernels::qmatmul::Isa::Scalar {
            return;
        }
        for hd in [8, 16, 24, 64, 72, 128] {
            for n in [1, 5, 8, 13, 16, 27, 45] {
                for rows in [1, 4, 7, 13] {
                    let stride = n + 3;
                    let q: Vec<Vec<f32>> = (0..rows)
                        .map(|r| (0..hd).map(|i| ((i + 7 * r) as f32 * 0.37).sin()).collect())
                        .collect();
                    let q: Vec<&[f32]> = q.iter().map(|r| &r[..]).collect();
                    // Position `i`'s row, V's layout: blocks of five rows, the last partial.
                    let cache: Vec<T> = (0..n * hd)
                        .map(|i| T::from_f32((i as f32 * 0.11).cos()))
                        .collect();
                    let blocks: Vec<&[T]> = cache.chunks(5 * hd).collect();
                    let at = |i: usize, d: usize| cache[i * hd + d].to_f32() as f64;
                    // The same rows in K's layout: blocks of 16 positions (columns of 16),
                    // the last partial, with other values after position `n`.
                    let bs = 16;
                    let columns: Vec<T> = (0..n.div_ceil(bs) * bs * hd)
                        .map(|e| {
                            let (b, d, slot) = (e / (bs * hd), e / bs % hd, e % bs);
                            let i = b * bs + slot;
                            if i < n {
                                cache[i * hd + d]
                            } else {
                                T::from_f32(1e4)
                            }
                        })
                        .collect();
                    let k_blocks: Vec<&[T]> = columns.chunks(bs * hd).collect();
                    let case = format!("hd={hd} n={n} rows={rows}");
                    let mut got = vec![f32::NAN; rows * stride];
                    // SAFETY: checked above that the CPU has AVX2, FMA and F16C.
                    unsafe { scores(&q, &k_blocks, n, 0.5, &mut got, stride) };
                    for (r, q) in q.iter().enumerate() {
                        for i in 0..n {
                            let want: f64 = (0..hd).map(|d| q[d] as f64 * at(i, d) * 0.5).sum();
                            let g = got[r * stride + i] as f64;
                            assert!((g - want).abs() < 1e-5, "{case} score {r}, {i}");
                        }
                        // Nothing written past a row's `n` scores.
                        let past = &got[r * stride + n..(r + 1) * stride];
                        assert!(past.iter().all(|x| x.is_nan()), "{case}");
                        let mut alone = vec![f32::NAN; n];
                        unsafe { scores(&[q], &k_blocks, n, 0.5, &mut alone, n) };
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&alone), bits(&got[r * stride..][..n]), "{case}");
                    }
                    let w: Vec<f32> = (0..rows * stride)
                        .map(|i| 0.25 + (i % 11) as f32 * 0.1)
                        .collect();
                    let mut outs: Vec<Vec<f32>> = q.iter().map(|r| r.to_vec()).collect();
                    let mut acc: Vec<&mut [f32]> = outs.iter_mut().map(|r| &mut r[..]).collect();
                    unsafe { weighted_sums(&mut acc, &w, stride, &blocks) };
                    for (r, out) in outs.iter().enumerate() {
                        for (d, o) in out.iter().enumerate() {
                            let sum: f64 =
                                (0..n).map(|i| w[r * stride + i] as f64 * at(i, d)).sum();
                            let want = q[r][d] as f64 + sum;
                            assert!((*o as f64 - want).abs() < 1e-5, "{case} out {r}, {d}");
                        }
                        let mut alone = q[r].to_vec();
                        unsafe {
                            weighted_sums(&mut [&mut alone[..]], &w[r * stride..], n, &blocks)
                        };
                        assert_eq!(alone, *out, "{case}");
                    }
                }
            }
        }
    }

    #[test]
    fn simd_scores_and_weighted_sums_match_f64_sums() {
        check_simd_rows::<f32>();
        check_simd_rows::<half::f16>();
    }
}
