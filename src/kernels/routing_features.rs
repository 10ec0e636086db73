//! Routing features computed once per batch over the logits: the entropy of each row's
//! softmax, in nats. Rows are spread over the shared thread pool; each row is read twice (max,
//! then the exponential sums) and nothing is allocated.

use super::parallel::{for_each_range, DisjointOut};

/// `out[k]` = entropy of the softmax of row `rows[k]` of `logits` (`[_, vocab]`).
pub fn entropy_rows(logits: &[f32], vocab: usize, rows: &[usize], out: &mut [f32]) {
    assert!(vocab > 0 && rows.len() == out.len(), "one output per row");
    assert!(
        rows.iter().all(|&r| (r + 1) * vocab <= logits.len()),
        "rows lie inside the [_, vocab] logits"
    );
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

/// H = ln Z − Σ p·(x − m), with Z = Σ exp(x − m) and m the row maximum.
fn row_entropy(row: &[f32]) -> f32 {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !m.is_finite() {
        return 0.0;
    }
    let (mut z, mut zx) = (0f64, 0f64);
    for &x in row {
        let d = x - m;
        let e = d.exp();
        z += e as f64;
        zx += (e * d) as f64;
    }
    (z.ln() - zx / z) as f32
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
