//! Routing features computed once per batch over the logits: the entropy of each row's
//! softmax, in nats, and each row's largest logits in descending order. Rows are spread over
//! the shared thread pool; entropy reads a row twice (max, then the exponential sums), top-k
//! once through a small sorted buffer; neither allocates per row.

use super::parallel::{for_each_range, DisjointOut};
use super::{dot, exp_in_place, max_value};

/// `out[k]` = entropy of the softmax of row `rows[k]` of `logits` (`[_, vocab]`).
pub fn entropy_rows(logits: &[f32], vocab: usize, rows: &[usize], out: &mut [f32]) {
    check_rows(logits, vocab, rows, out.len(), 1);
    let dst = DisjointOut::new(out);
    for_each_range(rows.len(), |ks| {
        for k in ks {
            let r = rows[k];
            let h = row_entropy(&logits[r * vocab..(r + 1) * vocab]);
            // SAFETY: each output index is handed to exactly one task.
            unsafe { dst.slice(k, 1)[0] = h };
        }
    });
}

/// `out[k]` = the largest probability of the softmax of row `rows[k]`: 1 / Σ exp(x − max).
pub fn max_prob_rows(logits: &[f32], vocab: usize, rows: &[usize], out: &mut [f32]) {
    check_rows(logits, vocab, rows, out.len(), 1);
    let dst = DisjointOut::new(out);
    for_each_range(rows.len(), |ks| {
        for k in ks {
            let row = &logits[rows[k] * vocab..(rows[k] + 1) * vocab];
            let m = max_value(row);
            let p = if m.is_finite() {
                (1.0 / softmax_sums(row, m, false).0) as f32
            } else {
                0.0
            };
            // SAFETY: each output index is handed to exactly one task.
            unsafe { dst.slice(k, 1)[0] = p };
        }
    });
}

/// `out[k*top..(k+1)*top]` = the `top` largest logits of row `rows[k]`, largest first (rows
/// narrower than `top` are padded with their minimum).
pub fn top_logits_rows(logits: &[f32], vocab: usize, rows: &[usize], top: usize, out: &mut [f32]) {
    check_rows(logits, vocab, rows, out.len(), top);
    let dst = DisjointOut::new(out);
    for_each_range(rows.len(), |ks| {
        for k in ks {
            let r = rows[k];
            // SAFETY: each output range is handed to exactly one task.
            let best = unsafe { dst.slice(k * top, top) };
            row_top(&logits[r * vocab..(r + 1) * vocab], best);
        }
    });
}

/// The contract of both kernels: `per_row` outputs for each row, and rows inside the logits.
fn check_rows(logits: &[f32], vocab: usize, rows: &[usize], outputs: usize, per_row: usize) {
    assert!(vocab > 0 && per_row > 0, "a vocabulary and outputs per row");
    assert_eq!(rows.len() * per_row, outputs, "{per_row} outputs per row");
    assert!(
        rows.iter().all(|&r| (r + 1) * vocab <= logits.len()),
        "rows lie inside the [_, vocab] logits"
    );
}

/// Keeps `best` sorted descending while scanning; a value enters only when it beats the
/// current smallest kept one, so a row costs ~one comparison per element.
fn row_top(row: &[f32], best: &mut [f32]) {
    let top = best.len();
    let mut kept = 0;
    for &x in row {
        if kept == top && x <= best[top - 1] {
            continue;
        }
        let mut i = kept.min(top - 1);
        if kept < top {
            kept += 1;
        }
        while i > 0 && best[i - 1] < x {
            best[i] = best[i - 1];
            i -= 1;
        }
        best[i] = x;
    }
    let floor = if kept > 0 { best[kept - 1] } else { 0.0 };
    best[kept..].fill(floor);
}

/// H = ln Z − Σ p·(x − m), with Z = Σ exp(x − m) and m the row maximum.
pub fn row_entropy(row: &[f32]) -> f32 {
    let m = max_value(row);
    if !m.is_finite() {
        return 0.0;
    }
    let (z, zx) = softmax_sums(row, m, true);
    (z.ln() - zx / z) as f32
}

/// Z = Σ exp(x − m) over `row` and, when `with_x`, Σ exp(x − m)·(x − m): the exponentials
/// through [`exp_in_place`] a chunk of the row at a time in stack buffers, each chunk's sums
/// in `f32` and the chunks' in `f64` (several times faster than one `f64` exponential per
/// value; see the `row_ops` bench). The offsets x − m are floored at −88, below the lowest
/// argument the vector exp takes (−87.3), so a −∞ (masked) or NaN logit weighs ~1e-38, and
/// its offset times that weight stays finite.
fn softmax_sums(row: &[f32], m: f32, with_x: bool) -> (f64, f64) {
    const CHUNK: usize = 1024;
    let (mut offsets, mut exps) = ([0f32; CHUNK], [0f32; CHUNK]);
    let (mut z, mut zx) = (0f64, 0f64);
    for xs in row.chunks(CHUNK) {
        let (d, e) = (&mut offsets[..xs.len()], &mut exps[..xs.len()]);
        d.iter_mut()
            .zip(xs)
            .for_each(|(d, &x)| *d = (x - m).max(-88.0));
        e.copy_from_slice(d);
        z += exp_in_place(e) as f64;
        if with_x {
            zx += dot(e, d) as f64;
        }
    }
    (z, zx)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(row: &[f32]) -> f32 {
        let total: f64 = row.iter().map(|&x| (x as f64).exp()).sum();
        -row.iter()
            .map(|&x| {
                let p = (x as f64).exp() / total;
                if p > 0.0 {
                    p * p.ln()
                } else {
                    0.0
                }
            })
            .sum::<f64>() as f32
    }

    #[test]
    fn entropy_matches_the_definition() {
        let vocab = 97;
        let logits: Vec<f32> = (0..5 * vocab)
            .map(|i| ((i * 7919 % 113) as f32 / 10.0) - 5.0)
            .collect();
        let mut out = vec![0.0; 5];
        entropy_rows(&logits, vocab, &[0, 1, 2, 3, 4], &mut out);
        for (r, h) in out.iter().enumerate() {
            let want = reference(&logits[r * vocab..(r + 1) * vocab]);
            assert!((h - want).abs() < 1e-4, "row {r}: {h} vs {want}");
        }
    }

    /// A real vocabulary's width (the exponentials in chunks, partial last chunk), and masked
    /// (−∞) logits, which carry no probability.
    #[test]
    fn entropy_of_long_and_masked_rows() {
        let vocab = 151_936;
        let logits: Vec<f32> = (0..vocab)
            .map(|i| ((i * 7919 % 10_007) as f32 / 500.0) - 10.0)
            .collect();
        let mut out = [0.0; 1];
        entropy_rows(&logits, vocab, &[0], &mut out);
        let want = reference(&logits);
        assert!((out[0] - want).abs() < 1e-5 * want, "{} vs {want}", out[0]);
        max_prob_rows(&logits, vocab, &[0], &mut out);
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let top = 1.0 / logits.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>();
        assert!(
            (out[0] as f64 - top).abs() < 1e-5 * top,
            "{} vs {top}",
            out[0]
        );

        // Masked and NaN logits in the vector lanes and the tail (37 values: 32 + 5) carry no
        // probability.
        let mut masked = vec![f32::NEG_INFINITY; 37];
        masked[3] = 0.5;
        masked[34] = 0.5;
        masked[10] = f32::NAN;
        masked[35] = f32::NAN;
        entropy_rows(&masked, 37, &[0], &mut out);
        assert!((out[0] - 2f32.ln()).abs() < 1e-6, "{}", out[0]);
        max_prob_rows(&masked, 37, &[0], &mut out);
        assert!((out[0] - 0.5).abs() < 1e-6, "{}", out[0]);
    }

    #[test]
    fn top_logits_are_the_largest_in_order() {
        let vocab = 211;
        let logits: Vec<f32> = (0..3 * vocab)
            .map(|i| ((i * 7919 % 1009) as f32 / 7.0) - 50.0)
            .collect();
        let rows = [2, 0];
        let top = 10;
        let mut out = vec![0.0; rows.len() * top];
        top_logits_rows(&logits, vocab, &rows, top, &mut out);
        for (k, &r) in rows.iter().enumerate() {
            let mut want = logits[r * vocab..(r + 1) * vocab].to_vec();
            want.sort_by(|a, b| b.total_cmp(a));
            assert_eq!(&out[k * top..(k + 1) * top], &want[..top], "row {r}");
        }
        // A row narrower than `top` is padded with its minimum.
        let mut out = vec![0.0; 5];
        top_logits_rows(&[1.0, 3.0, 2.0], 3, &[0], 5, &mut out);
        assert_eq!(out, [3.0, 2.0, 1.0, 1.0, 1.0]);
    }

    #[test]
    fn max_prob_is_the_top_softmax_probability() {
        let logits = [0.0f32, 1.0, 2.0, 0.0, 0.0, 0.0];
        let mut out = [0.0; 2];
        max_prob_rows(&logits, 3, &[0, 1], &mut out);
        let z = 1.0 + 1f64.exp() + 2f64.exp();
        assert!((out[0] as f64 - 2f64.exp() / z).abs() < 1e-6);
        assert!((out[1] - 1.0 / 3.0).abs() < 1e-6);
    }

    #[test]
    fn uniform_rows_have_log_vocab_and_peaked_rows_near_zero() {
        let mut out = [0.0; 2];
        let mut logits = vec![0.0f32; 2 * 64];
        logits[64 + 3] = 100.0;
        entropy_rows(&logits, 64, &[0, 1], &mut out);
        assert!((out[0] - (64f32).ln()).abs() < 1e-5);
        assert!(out[1].abs() < 1e-5);
    }
}
