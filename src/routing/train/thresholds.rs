//! Thresholds for a trained head: picked on the calibration positions' scores (for a target
//! recall and for target shares of LLM tokens), and measured on the test positions'.

use std::collections::BTreeMap;

use serde::Serialize;

use super::TARGET_SHARES;
use crate::routing::head::HeadKind;

/// A threshold picked on the calibration positions, and what it does on the test positions.
#[derive(Debug, Clone, Serialize)]
pub struct Measured {
    pub threshold: f32,
    /// Share of test tokens it sends to the LLM.
    pub routed: f64,
    pub precision: f64,
    pub recall: f64,
}

/// Scores of one kind of head with their labels.
pub(super) struct Scored {
    pub kind: HeadKind,
    pub scores: Vec<f32>,
    pub labels: Vec<bool>,
}

impl Scored {
    /// What `threshold` does to these positions.
    pub fn measure(&self, threshold: f32) -> Measured {
        let deferred: Vec<bool> = self
            .scores
            .iter()
            .map(|&s| self.kind.defers(s, threshold))
            .collect();
        let hits = deferred
            .iter()
            .zip(&self.labels)
            .filter(|(d, l)| **d && **l)
            .count();
        let routed = deferred.iter().filter(|d| **d).count();
        let positives = self.labels.iter().filter(|l| **l).count();
        Measured {
            threshold,
            routed: routed as f64 / self.scores.len().max(1) as f64,
            precision: hits as f64 / routed.max(1) as f64,
            recall: hits as f64 / positives.max(1) as f64,
        }
    }

    /// The area under the ROC curve of the scores as urgencies.
    pub fn auc(&self) -> f64 {
        let urgency: Vec<f32> = self.scores.iter().map(|&s| self.kind.urgency(s)).collect();
        auc(&urgency, &self.labels)
    }
}

/// Thresholds picked on calibration scores.
pub(super) struct Thresholds {
    pub recall: f32,
    pub shares: BTreeMap<String, f32>,
}

impl Thresholds {
    pub fn pick(kind: HeadKind, scores: &[f32], labels: &[bool], target_recall: f64) -> Self {
        // Deferring scores first: descending for R2R / Co-LLM, ascending for CITER.
        let order = |mut v: Vec<f32>| {
            v.sort_by(|a, b| match kind {
                HeadKind::Citer => a.total_cmp(b),
                _ => b.total_cmp(a),
            });
            v
        };
        let positive = order(
            labels
                .iter()
                .zip(scores)
                .filter(|(l, _)| **l)
                .map(|(_, s)| *s)
                .collect(),
        );
        let need = (positive.len() as f64 * target_recall).ceil() as usize;
        let all = order(scores.to_vec());
        Self {
            recall: threshold_for_count(kind, &positive, need),
            shares: TARGET_SHARES
                .iter()
                .map(|&share| {
                    let count = (all.len() as f64 * share).round() as usize;
                    (
                        format!("{share:.2}"),
                        threshold_for_count(kind, &all, count),
                    )
                })
                .collect(),
        }
    }
}

/// The threshold at which the first `count` of `ordered` defer (scores ordered so that
/// deferring ones come first).
fn threshold_for_count(kind: HeadKind, ordered: &[f32], count: usize) -> f32 {
    if ordered.is_empty() {
        return 0.5;
    }
    let s = ordered[count.clamp(1, ordered.len()) - 1];
    match kind {
        HeadKind::Citer => s + 1e-6,
        _ => s - 1e-6,
    }
}

/// The area under the ROC curve of `urgency` for `labels` (true: the position needs the LLM),
/// ties counted half: the Mann-Whitney statistic, the chance that a positive outranks a
/// negative; 0.5 where either class is missing.
pub(super) fn auc(urgency: &[f32], labels: &[bool]) -> f64 {
    let mut ranked: Vec<(f32, bool)> = urgency
        .iter()
        .copied()
        .zip(labels.iter().copied())
        .collect();
    ranked.sort_by(|a, b| a.0.total_cmp(&b.0));
    let positives = labels.iter().filter(|l| **l).count();
    let negatives = labels.len() - positives;
    if positives == 0 || negatives == 0 {
        return 0.5;
    }
    // Sum of the positives' ranks (1-based, ties given their mean rank).
    let mut rank_sum = 0.0;
    let mut i = 0;
    while i < ranked.len() {
        let j = i + ranked[i..]
            .iter()
            .take_while(|r| r.0 == ranked[i].0)
            .count();
        let mean_rank = (i + 1 + j) as f64 / 2.0;
        rank_sum += mean_rank * ranked[i..j].iter().filter(|r| r.1).count() as f64;
        i = j;
    }
    let p = positives as f64;
    (rank_sum - p * (p + 1.0) / 2.0) / (p * negatives as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auc_is_the_share_of_positive_negative_pairs_ranked_right() {
        let auc = |kind, scores: &[f32], labels: &[bool]| {
            Scored {
                kind,
                scores: scores.to_vec(),
                labels: labels.to_vec(),
            }
            .auc()
        };
        let split = [false, false, true, true];
        assert_eq!(auc(HeadKind::R2r, &[0.1, 0.2, 0.8, 0.9], &split), 1.0);
        assert_eq!(auc(HeadKind::CoLlm, &[0.9, 0.8, 0.2, 0.1], &split), 0.0);
        // CITER's score is confidence in the SLM: low where the LLM is needed.
        assert_eq!(auc(HeadKind::Citer, &[0.9, 0.8, 0.2, 0.1], &split), 1.0);
        // Positives at 0.5 and 0.2, negatives at 0.4 and 0.2: of the four pairs, two are
        // ranked right and one is a tie (half).
        let mixed = [true, true, false, false];
        assert_eq!(auc(HeadKind::R2r, &[0.5, 0.2, 0.4, 0.2], &mixed), 0.625);
        assert_eq!(auc(HeadKind::R2r, &[0.5, 0.2], &[true, true]), 0.5);
    }
}
