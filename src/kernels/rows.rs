//! The decoder's row-wise steps between its matmuls: the residual add, RMS norm and SiLU·gate,
//! each row on its own, the rows of a batch spread over the compute pool.

use super::parallel::{self, DisjointOut};
use super::{dot, exp_in_place};

/// RMS norm of each row of `x` (rows of `weight.len()`) in place: `x / rms(x) · w`, the mean of
/// squares summed in `f32`.
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(weight.len()) {
        let rms = rms(row, eps);
        for (v, w) in row.iter_mut().zip(weight) {
            *v = *v / rms * w;
        }
    }
}

/// `x += add` (when given), then `out` = [`rms_norm_in_place`] of a copy of `x`, bit for bit;
/// row by row while the row is in cache, the rows spread over the compute pool.
pub fn add_rms_norm_rows(
    x: &mut [f32],
    add: Option<&[f32]>,
    weight: &[f32],
    eps: f32,
    out: &mut [f32],
) {
    let n = weight.len();
    assert!(x.len().is_multiple_of(n) && out.len() == x.len());
    assert!(add.is_none_or(|a| a.len() == x.len()));
    let (xs, outs) = (DisjointOut::new(x), DisjointOut::new(out));
    parallel::for_each_range(out.len() / n, |rows| {
        for r in rows {
            // SAFETY: `r < x.len() / n` and `out.len() == x.len()` (asserted), so row `r` of
            // each lies inside it; each `r` goes to one task.
            let (x, out) = unsafe { (xs.slice(r * n, n), outs.slice(r * n, n)) };
            if let Some(add) = add {
                add_in_place(x, &add[r * n..(r + 1) * n]);
            }
            let rms = rms(x, eps);
            for ((o, v), w) in out.iter_mut().zip(&*x).zip(weight) {
                *o = *v / rms * w;
            }
        }
    });
}

/// The root mean square of `row` with `eps` added to the mean, its squares summed in eight
/// lanes ([`dot`]: a sum in order waits on every add, about a microsecond for 576 values).
fn rms(row: &[f32], eps: f32) -> f32 {
    (dot(row, row) / row.len() as f32 + eps).sqrt()
}

/// `x += y`, element-wise.
pub fn add_in_place(x: &mut [f32], y: &[f32]) {
    assert_eq!(x.len(), y.len());
    x.iter_mut().zip(y).for_each(|(x, y)| *x += y);
}

/// `out = silu(gate) · up`, element-wise: `gate / (1 + e^-gate) · up`, the exponentials
/// through [`exp_in_place`].
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    out.iter_mut().zip(gate).for_each(|(o, g)| *o = -g);
    exp_in_place(out);
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = *g / (1.0 + *o) * u;
    }
}

/// [`silu_mul`] for each row of `out` (rows of `width`), `rows(r)` giving row `r`'s gate and
/// up values; the rows spread over the compute pool.
pub fn silu_mul_rows<'a>(
    out: &mut [f32],
    width: usize,
    rows: impl Fn(usize) -> (&'a [f32], &'a [f32]) + Sync,
) {
    assert!(out.len().is_multiple_of(width));
    let outs = DisjointOut::new(out);
    parallel::for_each_range(out.len() / width, |range| {
        for r in range {
            let (gate, up) = rows(r);
            assert!(
                gate.len() == width && up.len() == width,
                "rows of {width} values"
            );
            // SAFETY: `r < out.len() / width`, so row `r` lies inside `out`; each `r` goes to
            // one task.
            silu_mul(gate, up, unsafe { outs.slice(r * width, width) });
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values of every sign and size, from a seeded sequence.
    fn seeded_values(n: usize, seed: u32) -> Vec<f32> {
        let mut state = seed;
        (0..n)
            .map(|_| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (state >> 8) as f32 / (1u32 << 24) as f32 * 8.0 - 4.0
            })
            .collect()
    }

    /// The row-parallel forms give the sequential ones' values bit for bit, on three threads
    /// (so rows land on the workers) and for one row (done inline).
    #[test]
    fn row_parallel_norm_and_activation_match_the_sequential_ones() {
        let pool = parallel::ComputePool::new(3, "test");
        let width = 37;
        for rows in [1, 2, 17] {
            let x = seeded_values(rows * width, 1);
            let y = seeded_values(rows * width, 2);
            let weight = seeded_values(width, 3);
            for add in [None, Some(&y[..])] {
                let mut want_x = x.clone();
                if let Some(y) = add {
                    want_x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
                }
                let mut want = want_x.clone();
                rms_norm_in_place(&mut want, &weight, 1e-5);
                let (mut got_x, mut got) = (x.clone(), vec![f32::NAN; x.len()]);
                parallel::with_pool(&pool, || {
                    add_rms_norm_rows(&mut got_x, add, &weight, 1e-5, &mut got)
                });
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got_x),
                    bits(&want_x),
                    "{rows} rows, add {}",
                    add.is_some()
                );
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{rows} rows, add {}",
                    add.is_some()
                );
            }
            let mut want = vec![0f32; x.len()];
            for ((g, u), o) in x
                .chunks_exact(width)
                .zip(y.chunks_exact(width))
                .zip(want.chunks_exact_mut(width))
            {
                silu_mul(g, u, o);
            }
            let mut got = vec![f32::NAN; x.len()];
            parallel::with_pool(&pool, || {
                silu_mul_rows(&mut got, width, |r| {
                    (
                        &x[r * width..(r + 1) * width],
                        &y[r * width..(r + 1) * width],
                    )
                })
            });
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{rows} rows");
        }
    }

    #[test]
    fn rms_norm_matches_the_definition() {
        for width in [1, 7, 8, 37, 576] {
            let x = seeded_values(3 * width, 4);
            let weight = seeded_values(width, 5);
            let mut got = x.clone();
            rms_norm_in_place(&mut got, &weight, 1e-6);
            for (row, got) in x.chunks_exact(width).zip(got.chunks_exact(width)) {
                let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / width as f64;
                let rms = (ms + 1e-6).sqrt();
                for ((&v, &w), &o) in row.iter().zip(&weight).zip(got) {
                    let want = v as f64 / rms * w as f64;
                    assert!(
                        (o as f64 - want).abs() <= 1e-5 * want.abs().max(1.0),
                        "{width}"
                    );
                }
            }
        }
    }

    #[test]
    fn silu_mul_matches_the_definition() {
        let gate: Vec<f32> = (0..37).map(|i| -95.0 + i as f32 * 5.1).collect();
        let up: Vec<f32> = (0..37).map(|i| 0.5 - i as f32 * 0.03).collect();
        let mut out = vec![f32::NAN; gate.len()];
        silu_mul(&gate, &up, &mut out);
        for ((g, u), o) in gate.iter().zip(&up).zip(&out) {
            let (g, u) = (*g as f64, *u as f64);
            let want = g / (1.0 + (-g).exp()) * u;
            assert!(
                (*o as f64 - want).abs() <= 1e-6 * want.abs().max(1.0),
                "{g}: {o} vs {want}"
            );
        }
    }
}
