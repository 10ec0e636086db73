//! Training router heads for an SLM/LLM pair on CPU.
//!
//! The data is one row per position: the features the heads read at serving time (the SLM's
//! final hidden state, the embedding of its greedy token and its largest logits) and a label
//! saying whether the LLM should produce that token. [`generated`] builds it from the SLM's own
//! completions of prompts, labelled by what the LLM would write there ([`cache`] keeps it on
//! disk); [`collect`] from existing text both models read, labelled wherever their greedy
//! tokens differ. [`train`] fits a head with candle's autograd (AdamW, class-balanced
//! logistic loss) and early stopping, picks thresholds on held-out calibration texts (for a
//! target recall and for target shares of LLM tokens) and reports what they do on held-out
//! test texts.

pub mod cache;
pub mod generated;
mod thresholds;

use std::collections::BTreeMap;

use candle_core::{Device, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarMap};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use super::head::{HeadConfig, HeadKind, RouterHead};
use crate::kernels::routing_features::top_logits_rows;
use crate::model::runner::score_text;
use crate::model::Model;
pub use thresholds::Measured;
use thresholds::{Scored, Thresholds};

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("model: {0}")]
    Model(#[from] crate::model::ModelError),
    #[error("training: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("{0}")]
    Data(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Features and labels of every position of the texts, row-major.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
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
    pub fn new(hidden_size: usize, top_k: usize) -> Self {
        Self {
            hidden_size,
            top_k,
            ..Default::default()
        }
    }

    pub fn rows(&self) -> usize {
        self.labels.len()
    }

    /// Share of positions where the models disagree.
    pub fn positive_share(&self) -> f64 {
        self.labels.iter().map(|&l| l as f64).sum::<f64>() / self.rows().max(1) as f64
    }

    /// The entropy of the softmax over row `r`'s largest logits (nats): close to the whole
    /// distribution's where the top logits hold most of the mass.
    fn top_entropy(&self, r: usize) -> f32 {
        let k = self.top_k;
        crate::kernels::routing_features::row_entropy(&self.top_logits[r * k..(r + 1) * k])
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

/// Runs both models over each text and labels every position where their greedy tokens
/// differ (teacher-forced on text neither model wrote; [`generated`] builds the data from the
/// SLM's own completions instead).
pub fn collect(
    slm: &Model,
    llm: &Model,
    texts: &[Vec<u32>],
    top_k: usize,
    mut progress: impl FnMut(usize),
) -> Result<Dataset, TrainError> {
    let vocab = slm.config().vocab_size.min(llm.config().vocab_size);
    let mut d = Dataset::new(slm.config().hidden_size, top_k);
    for (i, text) in texts.iter().enumerate() {
        let small = score_text(slm, text)?;
        let large = score_text(llm, text)?;
        let slm_logits = small.logits.flatten_all()?.to_vec1::<f32>()?;
        let llm_logits = large.logits.flatten_all()?.to_vec1::<f32>()?;
        let (sv, lv) = (slm.config().vocab_size, llm.config().vocab_size);
        let mut greedy = Vec::with_capacity(text.len());
        let mut labels = Vec::with_capacity(text.len());
        for t in 0..text.len() {
            let s = crate::model::sampler::argmax(&slm_logits[t * sv..t * sv + vocab]);
            let l = crate::model::sampler::argmax(&llm_logits[t * lv..t * lv + vocab]);
            labels.push(f32::from(u8::from(s != l)));
            greedy.push(s);
        }
        let hidden = small
            .hidden
            .ok_or_else(|| TrainError::Data("no hidden states".into()))?
            .flatten_all()?
            .to_vec1::<f32>()?;
        push_rows(&mut d, slm, &slm_logits, &hidden, &greedy, &labels, i)?;
        progress(i + 1);
    }
    Ok(d)
}

/// Appends one row per entry of `greedy`: the SLM's logits and final hidden states at those
/// positions (row-major), its greedy token there and the row's label, from text `text`.
fn push_rows(
    d: &mut Dataset,
    slm: &Model,
    logits: &[f32],
    hidden: &[f32],
    greedy: &[u32],
    labels: &[f32],
    text: usize,
) -> Result<(), TrainError> {
    let rows: Vec<usize> = (0..greedy.len()).collect();
    let mut top = vec![0.0; rows.len() * d.top_k];
    top_logits_rows(logits, slm.config().vocab_size, &rows, d.top_k, &mut top);
    d.top_logits.extend(top);
    d.hidden.extend_from_slice(hidden);
    d.embedding.extend(slm.embed(greedy)?);
    d.labels.extend_from_slice(labels);
    d.text.extend(std::iter::repeat_n(text, greedy.len()));
    Ok(())
}

#[derive(Debug, Clone)]
pub struct TrainSettings {
    /// Most passes over the training positions. Training stops earlier once the calibration
    /// loss has not improved for `patience` passes, and keeps the weights of the best pass: a
    /// head fitted past that point only grows more certain of the training positions (its
    /// scores pile up at 0 and 1, and no threshold between them ranks well).
    pub epochs: usize,
    pub patience: usize,
    pub batch_size: usize,
    pub learning_rate: f64,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f64,
    /// Share of texts held out: half of them (calibration) stop training and pick the
    /// thresholds, the other half (test) measure what those thresholds do.
    pub holdout: f64,
    /// Share of the training texts trained on, the held-out ones unchanged: below 1, a point
    /// of a learning curve (does the head gain from more data?).
    pub train_share: f64,
    /// Recall of the positions that need the LLM the threshold must reach.
    pub target_recall: f64,
    pub seed: u64,
}

impl Default for TrainSettings {
    fn default() -> Self {
        Self {
            epochs: 30,
            patience: 4,
            batch_size: 256,
            learning_rate: 1e-3,
            weight_decay: 1e-2,
            holdout: 0.3,
            train_share: 1.0,
            target_recall: 0.95,
            seed: 0,
        }
    }
}

/// Shares of tokens a head's thresholds are picked to send to the LLM.
pub const TARGET_SHARES: [f64; 4] = [0.05, 0.10, 0.15, 0.20];

/// What training measured on the held-out positions.
#[derive(Debug, Clone, Serialize)]
pub struct TrainReport {
    pub train_positions: usize,
    pub calibration_positions: usize,
    pub test_positions: usize,
    /// Share of test positions labelled for the LLM.
    pub positive_share: f64,
    /// Area under the test positions' ROC curve: the chance that a position labelled for the
    /// LLM outranks one that is not (0.5: no better than chance), whatever the threshold.
    pub auc: f64,
    /// The same for the SLM's next-token entropy over its largest logits (R-Stitch's
    /// signal), the baseline a head's features must beat.
    pub entropy_auc: f64,
    /// The threshold for the target recall.
    pub threshold: f32,
    pub precision: f64,
    pub recall: f64,
    /// Share of test tokens the threshold sends to the LLM.
    pub routed_share: f64,
    /// The threshold for each of [`TARGET_SHARES`] (keyed `"0.05"` and so on), and what it
    /// does on the test positions.
    pub shares: BTreeMap<String, Measured>,
    /// The same thresholds alone, as configurations read them.
    pub share_thresholds: BTreeMap<String, f32>,
    pub epochs_run: usize,
    pub best_epoch: usize,
    /// Calibration loss after the best epoch.
    pub final_loss: f32,
    /// Share of test scores within 0.01 of 0 or 1.
    pub saturated: f64,
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

/// The rows of the first `share` of the texts `rows` hold (at least one text), in the
/// order the texts first appear.
fn first_texts(data: &Dataset, rows: Vec<usize>, share: f64) -> Vec<usize> {
    if share >= 1.0 {
        return rows;
    }
    let mut texts: Vec<usize> = rows.iter().map(|&r| data.text[r]).collect();
    texts.dedup();
    let mut seen = std::collections::HashSet::new();
    texts.retain(|t| seen.insert(*t));
    let keep = ((texts.len() as f64 * share).round() as usize).max(1);
    let kept: std::collections::HashSet<usize> = texts.into_iter().take(keep).collect();
    rows.into_iter()
        .filter(|&r| kept.contains(&data.text[r]))
        .collect()
}

/// Rows split by text into training, calibration and test rows (the held-out texts halved;
/// with a single held-out text, calibration and test are the same rows).
fn split(data: &Dataset, holdout: f64, seed: u64) -> [Vec<usize>; 3] {
    let texts = data.text.iter().max().map_or(0, |m| m + 1);
    let mut order: Vec<usize> = (0..texts).collect();
    order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
    let held = ((texts as f64 * holdout).round() as usize).clamp(1, texts.saturating_sub(1).max(1));
    let calibration = held.div_ceil(2);
    // Each text's part, by its place in the seeded order.
    let mut part_of = vec![0; texts];
    for (i, &t) in order.iter().enumerate() {
        part_of[t] = match i {
            i if i < calibration => 1,
            i if i < held => 2,
            _ => 0,
        };
    }
    let mut parts = [Vec::new(), Vec::new(), Vec::new()];
    for r in 0..data.rows() {
        parts[part_of[data.text[r]]].push(r);
    }
    if parts[2].is_empty() {
        parts[2] = parts[1].clone();
    }
    parts
}

/// Rows scored per pass outside training, so that memory stays bounded.
const SCORE_ROWS: usize = 4096;

/// The head's logits over `rows` in one pass, and their labels.
fn batch_logits(
    head: &RouterHead,
    data: &Dataset,
    rows: &[usize],
) -> candle_core::Result<(Tensor, Tensor)> {
    let [h, e, t, y] = data.gather(rows)?;
    let t = t.narrow(1, 0, head.config.top_width().max(1).min(data.top_k))?;
    Ok((head.logits(&h, Some(&e), Some(&t))?, y))
}

/// The head's logits over `rows`, in order.
fn head_logits(head: &RouterHead, data: &Dataset, rows: &[usize]) -> Result<Tensor, TrainError> {
    let parts = rows
        .chunks(SCORE_ROWS)
        .map(|chunk| Ok(batch_logits(head, data, chunk)?.0))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&parts, 0)?)
}

/// Sets the head's standardisation to the mean and standard deviation of the state it reads
/// (the hidden state and any confidence features) over `rows`.
fn standardize(
    head: &RouterHead,
    vars: &VarMap,
    data: &Dataset,
    rows: &[usize],
) -> Result<(), TrainError> {
    let (mut sum, mut squares) = (None::<Tensor>, None::<Tensor>);
    for chunk in rows.chunks(SCORE_ROWS) {
        let [h, _, t, _] = data.gather(chunk)?;
        let x = head
            .state(&h, Some(&t))?
            .to_dtype(candle_core::DType::F64)?;
        let add = |acc: Option<Tensor>, part: Tensor| match acc {
            Some(a) => a + part,
            None => Ok(part),
        };
        sum = Some(add(sum, x.sum(0)?)?);
        squares = Some(add(squares, x.sqr()?.sum(0)?)?);
    }
    let (Some(sum), Some(squares)) = (sum, squares) else {
        return Err(TrainError::Data(
            "no training positions to standardise on".into(),
        ));
    };
    let n = rows.len() as f64;
    let mean = (sum / n)?;
    let variance = ((squares / n)? - mean.sqr()?)?.relu()?;
    // The 1e-6 keeps a feature that is constant over the training positions finite.
    let scale = (variance + 1e-6)?.sqrt()?.recip()?;
    let all = vars.data().lock().expect("the variables' lock");
    for (name, value) in [
        (super::head::STANDARDIZE_MEAN, mean),
        (super::head::STANDARDIZE_SCALE, scale),
    ] {
        all[name].set(&value.to_dtype(candle_core::DType::F32)?)?;
    }
    Ok(())
}

/// The head's weights by name, copied (what training returns to after the best epoch).
fn snapshot(vars: &VarMap) -> candle_core::Result<Vec<(String, Tensor)>> {
    let data = vars.data().lock().expect("the variables' lock");
    data.iter()
        .map(|(name, var)| Ok((name.clone(), var.as_tensor().copy()?)))
        .collect()
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
    config.check().map_err(TrainError::Data)?;
    if config.confidence_top_k > data.top_k {
        return Err(TrainError::Data(format!(
            "the confidence features read {} logits a position but the data keeps {} (collect with a larger --top-k)",
            config.confidence_top_k, data.top_k
        )));
    }
    let [train_rows, calibration_rows, test_rows] = split(data, settings.holdout, settings.seed);
    let train_rows = first_texts(data, train_rows, settings.train_share);
    if train_rows.is_empty() {
        return Err(TrainError::Data(
            "one text cannot be both trained on and held out: give at least two".into(),
        ));
    }
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
        weight_decay: settings.weight_decay,
        ..Default::default()
    };
    if config.standardized {
        standardize(&head, &vars, data, &train_rows)?;
    }
    // The standardisation is measured, not learned.
    let learned = {
        let all = vars.data().lock().expect("the variables' lock");
        all.iter()
            .filter(|(name, _)| !super::head::is_standardization(name))
            .map(|(_, var)| var.clone())
            .collect()
    };
    let mut opt = AdamW::new(learned, params)?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(settings.seed ^ 0x5eed);
    let mut order = train_rows.clone();
    let calibration_targets = {
        let [.., y] = data.gather(&calibration_rows)?;
        targets(config.kind, &y)?
    };
    let calibration_loss = |head: &RouterHead| -> Result<f32, TrainError> {
        let z = head_logits(head, data, &calibration_rows)?;
        Ok(loss(&z, &calibration_targets, positive_weight)?.to_scalar::<f32>()?)
    };
    let mut best = (calibration_loss(&head)?, 0, snapshot(&vars)?);
    let mut epochs_run = 0;
    for epoch in 1..=settings.epochs {
        order.shuffle(&mut rng);
        for batch in order.chunks(settings.batch_size.max(1)) {
            let (z, y) = batch_logits(&head, data, batch)?;
            opt.backward_step(&loss(&z, &targets(config.kind, &y)?, positive_weight)?)?;
        }
        epochs_run = epoch;
        let l = calibration_loss(&head)?;
        if l < best.0 {
            best = (l, epoch, snapshot(&vars)?);
        } else if epoch - best.1 >= settings.patience.max(1) {
            break;
        }
    }
    let (final_loss, best_epoch, weights) = best;
    {
        let data = vars.data().lock().expect("the variables' lock");
        for (name, tensor) in &weights {
            data[name].set(tensor)?;
        }
    }
    let scores = |rows: &[usize]| -> Result<Vec<f32>, TrainError> {
        Ok(candle_nn::ops::sigmoid(&head_logits(&head, data, rows)?)?.to_vec1()?)
    };
    let labels =
        |rows: &[usize]| -> Vec<bool> { rows.iter().map(|&r| data.labels[r] > 0.5).collect() };
    let thresholds = Thresholds::pick(
        config.kind,
        &scores(&calibration_rows)?,
        &labels(&calibration_rows),
        settings.target_recall,
    );
    let test = Scored {
        kind: config.kind,
        scores: scores(&test_rows)?,
        labels: labels(&test_rows),
    };
    let recall_point = test.measure(thresholds.recall);
    let shares: BTreeMap<String, Measured> = thresholds
        .shares
        .iter()
        .map(|(share, &t)| (share.clone(), test.measure(t)))
        .collect();
    let report = TrainReport {
        train_positions: train_rows.len(),
        calibration_positions: calibration_rows.len(),
        test_positions: test_rows.len(),
        positive_share: test.labels.iter().filter(|l| **l).count() as f64
            / test.labels.len().max(1) as f64,
        auc: test.auc(),
        entropy_auc: thresholds::auc(
            &test_rows
                .iter()
                .map(|&r| data.top_entropy(r))
                .collect::<Vec<_>>(),
            &test.labels,
        ),
        threshold: thresholds.recall,
        precision: recall_point.precision,
        recall: recall_point.recall,
        routed_share: recall_point.routed,
        share_thresholds: thresholds.shares,
        shares,
        epochs_run,
        best_epoch,
        final_loss,
        saturated: test
            .scores
            .iter()
            .filter(|&&s| !(0.01..=0.99).contains(&s))
            .count() as f64
            / test.scores.len().max(1) as f64,
    };
    let mut head = head;
    head.config.threshold = report.threshold;
    head.config.report = serde_json::to_value(&report).ok();
    Ok((head, vars, report))
}

#[cfg(test)]
mod tests;
