//! Training router heads for an SLM/LLM pair on CPU.
//!
//! [`collect`] runs both models over texts (teacher-forced, every position at once) and
//! labels each position where the SLM's greedy next token differs from the LLM's: those are
//! the tokens the LLM should produce. Features are what the heads read at serving time: the
//! SLM's final hidden state, the embedding of its greedy token and its largest logits.
//! [`train`] fits a head with candle's autograd (AdamW, class-balanced logistic loss), holds
//! out a share of texts, and picks the threshold that reaches a target recall of the
//! positions that need the LLM on the held-out part; it reports precision, recall and the
//! share of tokens routed there, and the thresholds that route given shares of tokens.

use std::collections::BTreeMap;

use candle_core::{Device, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarMap};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Serialize;

use super::head::{HeadConfig, HeadKind, RouterHead};
use crate::kernels::routing_features::top_logits_rows;
use crate::model::runner::score_text;
use crate::model::Model;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("model: {0}")]
    Model(#[from] crate::model::ModelError),
    #[error("training: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("{0}")]
    Data(String),
}

/// Features and labels of every position of the texts, row-major.
#[derive(Debug, Clone, Default)]
pub struct Dataset {
    pub hidden_size: usize,
    pub top_k: usize,
    pub hidden: Vec<f32>,
    pub embedding: Vec<f32>,
    pub top_logits: Vec<f32>,
    /// 1 where the SLM's greedy token differs from the LLM's.
    pub labels: Vec<f32>,
    /// Which text each row came from (held-out splits go by text).
    pub text: Vec<usize>,
}

impl Dataset {
    pub fn rows(&self) -> usize {
        self.labels.len()
    }

    /// Share of positions where the models disagree.
    pub fn positive_share(&self) -> f64 {
        self.labels.iter().map(|&l| l as f64).sum::<f64>() / self.rows().max(1) as f64
    }

    fn gather(&self, rows: &[usize]) -> candle_core::Result<[Tensor; 4]> {
        let pick = |data: &[f32], width: usize| {
            let v: Vec<f32> = rows
                .iter()
                .flat_map(|&r| &data[r * width..(r + 1) * width])
                .copied()
                .collect();
            Tensor::from_vec(v, (rows.len(), width), &Device::Cpu)
        };
        Ok([
            pick(&self.hidden, self.hidden_size)?,
            pick(&self.embedding, self.hidden_size)?,
            pick(&self.top_logits, self.top_k)?,
            pick(&self.labels, 1)?.squeeze(1)?,
        ])
    }
}

/// Runs both models over each text and labels every position.
pub fn collect(
    slm: &Model,
    llm: &Model,
    texts: &[Vec<u32>],
    top_k: usize,
    mut progress: impl FnMut(usize),
) -> Result<Dataset, TrainError> {
    let hidden_size = slm.config().hidden_size;
    let vocab = slm.config().vocab_size.min(llm.config().vocab_size);
    let mut d = Dataset {
        hidden_size,
        top_k,
        ..Default::default()
    };
    for (i, text) in texts.iter().enumerate() {
        let small = score_text(slm, text)?;
        let large = score_text(llm, text)?;
        let slm_logits = small.logits.flatten_all()?.to_vec1::<f32>()?;
        let llm_logits = large.logits.flatten_all()?.to_vec1::<f32>()?;
        let (sv, lv) = (slm.config().vocab_size, llm.config().vocab_size);
        let rows: Vec<usize> = (0..text.len()).collect();
        let mut greedy = Vec::with_capacity(text.len());
        for t in 0..text.len() {
            let s = crate::model::sampler::argmax(&slm_logits[t * sv..t * sv + vocab]);
            let l = crate::model::sampler::argmax(&llm_logits[t * lv..t * lv + vocab]);
            d.labels.push(f32::from(u8::from(s != l)));
            d.text.push(i);
            greedy.push(s);
        }
        let mut top = vec![0.0; rows.len() * top_k];
        top_logits_rows(&slm_logits, sv, &rows, top_k, &mut top);
        d.top_logits.extend(top);
        let hidden = small
            .hidden
            .ok_or_else(|| TrainError::Data("no hidden states".into()));
        d.hidden.extend(hidden?.flatten_all()?.to_vec1::<f32>()?);
        d.embedding.extend(slm.embed(&greedy)?);
        progress(i + 1);
    }
    Ok(d)
}

#[derive(Debug, Clone)]
pub struct TrainSettings {
    pub epochs: usize,
    pub batch_size: usize,
    pub learning_rate: f64,
    /// Share of texts held out to pick the threshold and report.
    pub holdout: f64,
    /// Recall of the positions that need the LLM the threshold must reach.
    pub target_recall: f64,
    pub seed: u64,
}

impl Default for TrainSettings {
    fn default() -> Self {
        Self {
            epochs: 30,
            batch_size: 256,
            learning_rate: 1e-3,
            holdout: 0.2,
            target_recall: 0.95,
            seed: 0,
        }
    }
}

/// What training measured on the held-out positions.
#[derive(Debug, Clone, Serialize)]
pub struct TrainReport {
    pub train_positions: usize,
    pub heldout_positions: usize,
    /// Share of held-out positions where the SLM and the LLM disagree.
    pub disagreement: f64,
    pub threshold: f32,
    pub precision: f64,
    pub recall: f64,
    /// Share of held-out tokens the threshold sends to the LLM.
    pub routed_share: f64,
    /// Thresholds that send about these shares of tokens to the LLM.
    pub share_thresholds: BTreeMap<String, f32>,
    pub final_loss: f32,
}

/// The training target: 1 where the score should be high.
fn targets(kind: HeadKind, labels: &Tensor) -> candle_core::Result<Tensor> {
    match kind {
        // CITER scores confidence in the SLM's token: high where the models agree.
        HeadKind::Citer => labels.affine(-1.0, 1.0),
        HeadKind::R2r | HeadKind::CoLlm => Ok(labels.clone()),
    }
}

/// Class-balanced logistic loss: mean of −(w·y·log σ(z) + (1−y)·log σ(−z)).
fn loss(z: &Tensor, y: &Tensor, positive_weight: f64) -> candle_core::Result<Tensor> {
    // log σ(z) = min(z, 0) − log(1 + e^(−|z|)), stable for any z.
    let log_sigmoid = |z: &Tensor| -> candle_core::Result<Tensor> {
        let tail = (z.abs()?.neg()?.exp()? + 1.0)?.log()?;
        z.minimum(0f32)? - tail
    };
    let pos = (y * log_sigmoid(z)?)?.affine(positive_weight, 0.0)?;
    let neg = (y.affine(-1.0, 1.0)? * log_sigmoid(&z.neg()?)?)?;
    (pos + neg)?.mean_all()?.neg()
}

/// Splits rows by text into (train, held-out).
fn split(data: &Dataset, holdout: f64, seed: u64) -> (Vec<usize>, Vec<usize>) {
    let texts = data.text.iter().max().map_or(0, |m| m + 1);
    let mut order: Vec<usize> = (0..texts).collect();
    order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
    let held = ((texts as f64 * holdout).round() as usize).clamp(1, texts.saturating_sub(1).max(1));
    let held_texts: std::collections::HashSet<usize> = order[..held].iter().copied().collect();
    (0..data.rows()).partition(|r| !held_texts.contains(&data.text[*r]))
}

/// Trains a head of `config`'s shape on `data`; returns it, its variables and the report
/// (the threshold in the returned config is the one reaching the target recall).
pub fn train(
    mut config: HeadConfig,
    data: &Dataset,
    settings: &TrainSettings,
) -> Result<(RouterHead, VarMap, TrainReport), TrainError> {
    if data.rows() < 2 || data.hidden_size != config.hidden_size {
        return Err(TrainError::Data(format!(
            "{} positions of hidden size {} cannot train a head for hidden size {}",
            data.rows(),
            data.hidden_size,
            config.hidden_size
        )));
    }
    if config.kind == HeadKind::R2r {
        config.top_k = config.top_k.min(data.top_k);
    }
    let (train_rows, held_rows) = split(data, settings.holdout, settings.seed);
    let (head, vars) = RouterHead::init(config.clone(), settings.seed)?;
    let positives = train_rows
        .iter()
        .filter(|&&r| data.labels[r] > 0.5)
        .count()
        .max(1);
    let positive_weight = match config.kind {
        HeadKind::Citer => positives as f64 / (train_rows.len() - positives).max(1) as f64,
        _ => (train_rows.len() - positives).max(1) as f64 / positives as f64,
    };
    let params = ParamsAdamW {
        lr: settings.learning_rate,
        weight_decay: 1e-4,
        ..Default::default()
    };
    let mut opt = AdamW::new(vars.all_vars(), params)?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(settings.seed ^ 0x5eed);
    let mut order = train_rows.clone();
    let mut final_loss = f32::NAN;
    for _ in 0..settings.epochs {
        order.shuffle(&mut rng);
        for batch in order.chunks(settings.batch_size.max(1)) {
            let [h, e, t, y] = data.gather(batch)?;
            let t = t.narrow(1, 0, head.config.top_k.max(1).min(data.top_k))?;
            let z = head.logits(&h, Some(&e), Some(&t))?;
            let l = loss(&z, &targets(config.kind, &y)?, positive_weight)?;
            opt.backward_step(&l)?;
            final_loss = l.to_scalar::<f32>()?;
        }
    }
    let report = evaluate(
        &head,
        data,
        &held_rows,
        train_rows.len(),
        settings,
        final_loss,
    )?;
    let mut head = head;
    head.config.threshold = report.threshold;
    head.config.report = serde_json::to_value(&report).ok();
    Ok((head, vars, report))
}

/// The threshold at which about `share` of `scores` defer (scores ordered so that deferring
/// ones come first).
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

fn evaluate(
    head: &RouterHead,
    data: &Dataset,
    held: &[usize],
    train_positions: usize,
    settings: &TrainSettings,
    final_loss: f32,
) -> Result<TrainReport, TrainError> {
    let kind = head.config.kind;
    let [h, e, t, _] = data.gather(held)?;
    let t = t.narrow(1, 0, head.config.top_k.max(1).min(data.top_k))?;
    let scores: Vec<f32> =
        candle_nn::ops::sigmoid(&head.logits(&h, Some(&e), Some(&t))?)?.to_vec1()?;
    let labels: Vec<bool> = held.iter().map(|&r| data.labels[r] > 0.5).collect();
    // Deferring scores first: descending for R2R / Co-LLM, ascending for CITER.
    let order = |mut v: Vec<f32>| {
        v.sort_by(|a, b| match kind {
            HeadKind::Citer => a.total_cmp(b),
            _ => b.total_cmp(a),
        });
        v
    };
    let positive_scores = order(
        labels
            .iter()
            .zip(&scores)
            .filter(|(l, _)| **l)
            .map(|(_, s)| *s)
            .collect(),
    );
    let need = (positive_scores.len() as f64 * settings.target_recall).ceil() as usize;
    let threshold = threshold_for_count(kind, &positive_scores, need);
    let deferred: Vec<bool> = scores.iter().map(|&s| kind.defers(s, threshold)).collect();
    let hits = deferred
        .iter()
        .zip(&labels)
        .filter(|(d, l)| **d && **l)
        .count();
    let routed = deferred.iter().filter(|d| **d).count();
    let all = order(scores.clone());
    let share_thresholds = [0.05, 0.10, 0.20]
        .iter()
        .map(|&share| {
            let count = (all.len() as f64 * share).round() as usize;
            (
                format!("{share:.2}"),
                threshold_for_count(kind, &all, count),
            )
        })
        .collect();
    Ok(TrainReport {
        train_positions,
        heldout_positions: held.len(),
        disagreement: labels.iter().filter(|l| **l).count() as f64 / labels.len().max(1) as f64,
        threshold,
        precision: hits as f64 / routed.max(1) as f64,
        recall: hits as f64 / positive_scores.len().max(1) as f64,
        routed_share: routed as f64 / scores.len().max(1) as f64,
        share_thresholds,
        final_loss,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Positions whose label is a known linear function of the hidden state.
    fn separable(rows: usize, hidden: usize) -> Dataset {
        let mut d = Dataset {
            hidden_size: hidden,
            top_k: 4,
            ..Default::default()
        };
        for r in 0..rows {
            let h: Vec<f32> = (0..hidden)
                .map(|i| ((r * 7 + i * 13) as f32 * 0.61).sin())
                .collect();
            d.labels.push(f32::from(u8::from(h[0] + 0.5 * h[1] > 0.6)));
            d.embedding.extend(h.iter().map(|x| x * 0.5));
            d.hidden.extend(h);
            d.top_logits.extend([3.0, 2.0, 1.0, 0.0]);
            d.text.push(r / 8);
        }
        d
    }

    #[test]
    fn a_probe_learns_a_separable_rule_and_meets_the_recall_target() {
        let data = separable(1200, 6);
        let config = HeadConfig::new(HeadKind::CoLlm, 6);
        let settings = TrainSettings {
            epochs: 60,
            batch_size: 64,
            learning_rate: 2e-2,
            ..Default::default()
        };
        let (head, _, report) = train(config, &data, &settings).unwrap();
        assert!(report.recall >= 0.95, "{report:?}");
        assert!(report.precision > 0.6, "{report:?}");
        assert!(
            (report.routed_share - report.disagreement).abs() < 0.2,
            "{report:?}"
        );
        assert_eq!(head.config.threshold, report.threshold);
        assert_eq!(report.share_thresholds.len(), 3);
    }

    #[test]
    fn citer_learns_confidence_and_defers_below_its_threshold() {
        let data = separable(1200, 6);
        let config = HeadConfig::new(HeadKind::Citer, 6);
        let settings = TrainSettings {
            epochs: 40,
            batch_size: 64,
            learning_rate: 1e-2,
            ..Default::default()
        };
        let (_, _, report) = train(config, &data, &settings).unwrap();
        assert!(
            report.recall >= 0.95 && report.precision > 0.5,
            "{report:?}"
        );
    }

    #[test]
    fn the_loss_is_the_logistic_loss() {
        let z = Tensor::new(&[0.0f32, 2.0, -3.0], &Device::Cpu).unwrap();
        let y = Tensor::new(&[1.0f32, 0.0, 1.0], &Device::Cpu).unwrap();
        let got = loss(&z, &y, 1.0).unwrap().to_scalar::<f32>().unwrap();
        let s = |x: f64| 1.0 / (1.0 + (-x).exp());
        let want = -((s(0.0)).ln() + (1.0 - s(2.0)).ln() + s(-3.0).ln()) / 3.0;
        assert!((got as f64 - want).abs() < 1e-5, "{got} vs {want}");
    }
}
