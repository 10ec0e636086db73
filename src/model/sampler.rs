//! Next-token sampling: penalties, temperature, top-k, top-p, min-p, and a per-request seed.
//!
//! Order (as in vLLM): repetition penalty (over prompt and output), presence and frequency
//! penalties (over the output), then greedy if `temperature == 0`, else temperature → top-k →
//! softmax → min-p → top-p → draw. For a given seed the sequence of draws is deterministic.
//!
//! The logits row is read where it lies, never copied: the penalties produce only the entries
//! they change, greedy is an argmax over the row with those in place, and without top-k the
//! vocabulary is never sorted whole (with top-p 1 the draw scans the softmax in token order;
//! with top-p < 1 only the tokens that can be in the nucleus are gathered and sorted).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::error::{ModelError, Result};
use crate::kernels::{exp_in_place, max_value};
pub use speculative::Distribution;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no limit.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    /// 1 means off; > 1 discourages tokens already in the prompt or output.
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Rejects values outside the ranges OpenAI-compatible servers accept, naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, reason: &str| {
            Err(ModelError::InvalidSampling {
                field,
                reason: reason.to_string(),
            })
        };
        if !self.temperature.is_finite() || !(0.0..=100.0).contains(&self.temperature) {
            return bad("temperature", "must be between 0 and 100");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", "must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", "must be in [0, 1]");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty <= 10.0) {
            return bad("repetition_penalty", "must be in (0, 10]");
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return bad("presence_penalty", "must be in [-2, 2]");
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return bad("frequency_penalty", "must be in [-2, 2]");
        }
        Ok(())
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let rng = match params.seed {
            Some(seed) => ChaCha8Rng::seed_from_u64(seed),
            None => ChaCha8Rng::from_rng(&mut rand::rng()),
        };
        Ok(Self { params, rng })
    }

    /// A sampler drawing from stream `stream` of its seed's generator: the models serving one
    /// request each draw from their own stream, so that their draws are independent (as
    /// speculative sampling's verification requires of the drafter's) while the seed still
    /// fixes them all.
    pub fn on_stream(params: SamplingParams, stream: u64) -> Result<Self> {
        let mut sampler = Self::new(params)?;
        sampler.rng.set_stream(stream);
        Ok(sampler)
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from `logits`, given the prompt and the output so far.
    ///
    /// The row is only read: the penalties yield the few entries they change
    /// (`Sampler::penalised`), greedy picks the largest value with those in place
    /// (`argmax_penalised`), and temperature sampling reads the row in blocks
    /// (`Scaled`), sorting only the candidates top-k or top-p keep.
    pub fn sample(&mut self, logits: &[f32], prompt: &[u32], output: &[u32]) -> u32 {
        let p = &self.params;
        let penalised = self.penalised(logits, prompt, output);
        if p.temperature == 0.0 {
            return argmax_penalised(logits, &penalised);
        }
        let row = Scaled {
            logits,
            penalised: &penalised,
            temperature: p.temperature,
        };
        if p.top_k > 0 {
            self.sample_top_k(&row)
        } else if p.top_p < 1.0 {
            self.sample_nucleus(&row)
        } else {
            self.sample_scan(&row)
        }
    }

    /// Top-k: the `top_k` largest logits, sorted, then min-p, top-p and the draw among them.
    fn sample_top_k(&mut self, row: &Scaled) -> u32 {
        let mut cand = row.candidates();
        if cand.is_empty() {
            return 0;
        }
        if self.params.top_k < cand.len() {
            cand.select_nth_unstable_by(self.params.top_k - 1, by_logit);
            cand.truncate(self.params.top_k);
        }
        cand.sort_unstable_by(by_logit);
        let max = cand[0].1;
        let total: f32 = cand.iter().map(|&(_, v)| weight(v, max)).sum();
        let keep = self.keep(&cand, total).unwrap_or(cand.len());
        self.draw_sorted(&cand[..keep], total)
    }

    /// Top-p < 1 without top-k. A first pass over the row sums the weights `exp(v - max)` by
    /// their binary exponent; from those sums, the largest power of two `t` such that the
    /// weights at or above it hold top-p of the total (and a little more, against rounding)
    /// bounds the nucleus, which is a prefix of the sorted order. Min-p bounds it too: the
    /// larger bound wins. A second pass gathers the tokens weighing at least that; of these,
    /// only the largest are sorted, 64 first and four times more each round, until min-p or
    /// top-p stops. Should top-p still not stop (rounding at its bound), every token with a
    /// weight is gathered instead.
    fn sample_nucleus(&mut self, row: &Scaled) -> u32 {
        let p = &self.params;
        let max = row.max();
        let mut block = Block::default();
        // Mass by the weights' f32 exponent bits (weights are in [0, 1]).
        let mut by_exponent = [0f64; 256];
        for start in (0..row.len()).step_by(BLOCK) {
            let n = row.block(start, max, &mut block);
            for &w in &block.weights[..n] {
                by_exponent[(w.to_bits() >> 23) as usize & 255] += w as f64;
            }
        }
        let total: f64 = by_exponent.iter().sum();
        if total == 0.0 {
            // Every value is NaN: no candidate.
            return 0;
        }
        let goal = (p.top_p as f64 + 1e-3).min(1.0) * total;
        let mut mass = 0.0;
        let exponent = (0..256u32)
            .rev()
            .find(|&e| {
                mass += by_exponent[e as usize];
                mass >= goal
            })
            .unwrap_or(0);
        let by_top_p = f32::from_bits(exponent << 23);
        // A little below min-p's own bound, so that the block weights' rounding
        // (`exp_in_place`, 2 ulp) never drops a token `keep` takes.
        let by_min_p = p.min_p * (1.0 - 1e-5);
        let total = total as f32;
        let mut floor = by_top_p.max(by_min_p).max(f32::MIN_POSITIVE);
        loop {
            let mut cand = Vec::new();
            for start in (0..row.len()).step_by(BLOCK) {
                let n = row.block(start, max, &mut block);
                let weights = block.weights[..n].iter().zip(&block.values);
                for (j, (_, &v)) in weights.enumerate().filter(|(_, (&w, _))| w >= floor) {
                    cand.push(((start + j) as u32, v));
                }
            }
            if let Some(keep) = self.keep_largest(&mut cand, total) {
                return self.draw_sorted(&cand[..keep], total);
            }
            // Min-p's bound, or no bound left: every gathered token is kept.
            if floor <= by_min_p || floor == f32::MIN_POSITIVE {
                return self.draw_sorted(&cand, total);
            }
            floor = by_min_p.max(f32::MIN_POSITIVE);
        }
    }

    /// Top-p = 1 without top-k: the draw scans the softmax in token order, no sorting. One
    /// pass sums the kept weights per block of [`BLOCK`] tokens (min-p keeps the tokens whose
    /// weight `exp(v - max)`, i.e. probability over the largest, is at least `min_p`); the draw
    /// finds its block by those sums and only that block's weights are computed again.
    ///
    /// Each token is drawn with its probability, as in sorted order, but a given random
    /// number maps to another token than in sorted order.
    fn sample_scan(&mut self, row: &Scaled) -> u32 {
        let max = row.max();
        let min_p = self.params.min_p;
        let mut block = Block::default();
        let kept_weights = |start: usize, block: &mut Block| {
            let n = row.block(start, max, block);
            for w in &mut block.weights[..n] {
                if *w < min_p {
                    *w = 0.0;
                }
            }
            n
        };
        let masses: Vec<f64> = (0..row.len())
            .step_by(BLOCK)
            .map(|start| {
                let n = kept_weights(start, &mut block);
                sum_lanes(&block.weights[..n]) as f64
            })
            .collect();
        let mass: f64 = masses.iter().sum();
        if mass == 0.0 {
            // Every value is NaN: no candidate.
            return 0;
        }
        // A 53-bit draw: with 24 bits, a token's share of the draws could be off by 2^-24,
        // more than the probability of most of a large vocabulary.
        let mut r = self.rng.random::<f64>() * mass;
        let mut chosen = None;
        for (b, &m) in masses.iter().enumerate() {
            if r < m {
                chosen = Some(b);
                break;
            }
            r -= m;
        }
        // Rounding can leave `r` just past the last block's end: its last kept token then.
        let b = chosen.unwrap_or_else(|| {
            r = f64::INFINITY;
            masses.iter().rposition(|&m| m > 0.0).expect("mass > 0")
        });
        let n = kept_weights(b * BLOCK, &mut block);
        let mut last = 0;
        for (j, &w) in block.weights[..n]
            .iter()
            .enumerate()
            .filter(|(_, &w)| w > 0.0)
        {
            if r < w as f64 {
                return (b * BLOCK + j) as u32;
            }
            r -= w as f64;
            last = j;
        }
        (b * BLOCK + last) as u32
    }

    /// Sorts the largest of `cand` (by decreasing logit), 64 first and four times more each
    /// round, until min-p or top-p stops within them ([`Sampler::keep`]), which it returns;
    /// `None` when neither stops (every candidate is sorted then). A nucleus is mostly far
    /// smaller than the vocabulary, so most of `cand` is never sorted.
    fn keep_largest(&self, cand: &mut [(u32, f32)], total: f32) -> Option<usize> {
        let mut sorted = 0;
        while sorted < cand.len() {
            let end = (4 * sorted).max(64).min(cand.len());
            if end < cand.len() {
                cand[sorted..].select_nth_unstable_by(end - sorted - 1, by_logit);
            }
            cand[sorted..end].sort_unstable_by(by_logit);
            sorted = end;
            if let Some(keep) = self.keep(&cand[..sorted], total) {
                return Some(keep);
            }
        }
        None
    }

    /// How many of the leading `sorted` candidates (by decreasing logit, normalised by
    /// `total`) min-p and then top-p keep; `None` when neither rule stops within them (all
    /// of them, if they are every candidate). Min-p keeps the prefix whose probabilities
    /// reach `min_p` times the first's (at least one token); top-p the shortest prefix of that
    /// whose cumulative probability reaches `top_p`.
    fn keep(&self, sorted: &[(u32, f32)], total: f32) -> Option<usize> {
        let p = &self.params;
        let max = sorted[0].1;
        let floor = p.min_p * (weight(max, max) / total);
        let mut cum = 0.0f32;
        for (i, &(_, v)) in sorted.iter().enumerate() {
            let x = weight(v, max) / total;
            if p.min_p > 0.0 && x < floor {
                return Some(i.max(1));
            }
            cum += x;
            if p.top_p < 1.0 && cum >= p.top_p {
                return Some(i + 1);
            }
        }
        None
    }

    /// Draws one of `kept` (sorted by decreasing logit) by its probability, `total` being the
    /// softmax's normaliser.
    fn draw_sorted(&mut self, kept: &[(u32, f32)], total: f32) -> u32 {
        let max = kept[0].1;
        let probs: Vec<f32> = kept.iter().map(|&(_, v)| weight(v, max) / total).collect();
        let mass: f32 = probs.iter().sum();
        let mut r = self.rng.random::<f32>() * mass;
        for (i, &x) in probs.iter().enumerate() {
            if r < x {
                return kept[i].0;
            }
            r -= x;
        }
        kept[kept.len() - 1].0
    }

    /// The entries of `logits` the penalties change, with their penalised values, by
    /// increasing token id: the repetition penalty over every token of the prompt and the
    /// output, then the presence and frequency penalties over the output's tokens (ids
    /// outside the vocabulary are ignored). Empty when every penalty is off.
    ///
    /// Which tokens occur is marked in a bitset (one bit per vocabulary entry, 19 KB for 152k)
    /// rather than by sorting the prompt, so the cost grows with the prompt only linearly.
    fn penalised(&self, logits: &[f32], prompt: &[u32], output: &[u32]) -> Vec<(u32, f32)> {
        let p = &self.params;
        let repetition = p.repetition_penalty != 1.0;
        let additive = p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        if !repetition && !additive {
            return Vec::new();
        }
        let mut seen = vec![0u64; logits.len().div_ceil(64)];
        let mut mark = |tokens: &[u32]| {
            for &t in tokens.iter().filter(|&&t| (t as usize) < logits.len()) {
                seen[t as usize / 64] |= 1 << (t % 64);
            }
        };
        if repetition {
            mark(prompt);
        }
        mark(output);
        // The output in order, so each token's count is the length of its run.
        let mut counted = if additive {
            output.to_vec()
        } else {
            Vec::new()
        };
        counted.sort_unstable();
        let mut runs = counted.as_slice();
        let mut out = Vec::new();
        for (w, &bits) in seen.iter().enumerate() {
            let mut bits = bits;
            while bits != 0 {
                let t = (w * 64) as u32 + bits.trailing_zeros();
                bits &= bits - 1;
                let mut l = logits[t as usize];
                if repetition {
                    l = if l > 0.0 {
                        l / p.repetition_penalty
                    } else {
                        l * p.repetition_penalty
                    };
                }
                // Every output token in the vocabulary is marked, so the run of `t` (if any)
                // starts the rest of the sorted output.
                let n = runs.iter().take_while(|&&o| o == t).count();
                runs = &runs[n..];
                if n > 0 {
                    l -= p.presence_penalty + p.frequency_penalty * n as f32;
                }
                out.push((t, l));
            }
        }
        out
    }
}

/// [`argmax`] of `logits` with the `penalised` entries (by increasing token id) in place of
/// the row's own: their largest value ([`max_penalised`]), then the first place holding it,
/// each untouched stretch scanned in place.
fn argmax_penalised(logits: &[f32], penalised: &[(u32, f32)]) -> u32 {
    if penalised.is_empty() {
        return argmax(logits);
    }
    let max = max_penalised(logits, penalised);
    for ((start, xs), entry) in stretches(logits, penalised) {
        if let Some(i) = first_equal(xs, max) {
            return (start + i) as u32;
        }
        if let Some(&(t, _)) = entry.filter(|&&(_, l)| l == max) {
            return t;
        }
    }
    0
}

/// The largest value of `logits` with the `penalised` entries in place; NaN never wins
/// (-inf when every value is NaN).
fn max_penalised(logits: &[f32], penalised: &[(u32, f32)]) -> f32 {
    let larger = |m: f32, x: f32| if x > m { x } else { m };
    stretches(logits, penalised).fold(f32::NEG_INFINITY, |m, ((_, xs), entry)| {
        let m = larger(m, max_value(xs));
        entry.map_or(m, |&(_, l)| larger(m, l))
    })
}

/// A stretch of a row (its first index and values) and the penalised entry that ends it.
type Stretch<'a> = ((usize, &'a [f32]), Option<&'a (u32, f32)>);

/// Each stretch of `logits` between the `penalised` entries (by increasing token id), with
/// its first index and the entry that ends it (none after the last).
fn stretches<'a>(
    logits: &'a [f32],
    penalised: &'a [(u32, f32)],
) -> impl Iterator<Item = Stretch<'a>> {
    let mut start = 0;
    penalised.iter().map(Some).chain([None]).map(move |entry| {
        let end = entry.map_or(logits.len(), |&(t, _)| t as usize);
        let stretch = (start, &logits[start..end]);
        start = end + 1;
        (stretch, entry)
    })
}

/// Candidates sorted by decreasing logit, the lower token id first among equal ones.
fn by_logit(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// A token's unnormalised probability, `exp(v - max)`; 1 for the largest logit itself, so
/// that infinite logits share the mass evenly rather than turn it into NaN.
fn weight(v: f32, max: f32) -> f32 {
    if v == max {
        1.0
    } else {
        (v - max).exp()
    }
}

/// The sum of `xs` over eight lanes, so the additions vectorise.
fn sum_lanes(xs: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder().iter().sum::<f32>();
    for chunk in chunks {
        for (s, &x) in lanes.iter_mut().zip(chunk) {
            *s += x;
        }
    }
    lanes.iter().sum::<f32>() + rest
}

/// Tokens whose weights [`Scaled::block`] computes at a time.
const BLOCK: usize = 64;

/// One block of a row: the scaled logits and their weights.
struct Block {
    values: [f32; BLOCK],
    weights: [f32; BLOCK],
}

impl Default for Block {
    fn default() -> Self {
        Self {
            values: [0.0; BLOCK],
            weights: [0.0; BLOCK],
        }
    }
}

/// A logits row with the penalised entries in place and divided by the temperature, read
/// where it lies: the values `v = l / temperature` the sampler draws from.
struct Scaled<'a> {
    logits: &'a [f32],
    /// By increasing token id (see [`Sampler::penalised`]).
    penalised: &'a [(u32, f32)],
    temperature: f32,
}

impl Scaled<'_> {
    fn len(&self) -> usize {
        self.logits.len()
    }

    /// The largest value; -inf when there is none (every value NaN).
    fn max(&self) -> f32 {
        max_penalised(self.logits, self.penalised) / self.temperature
    }

    /// Every value that is not NaN, with its token id, in token order.
    fn candidates(&self) -> Vec<(u32, f32)> {
        let t = self.temperature;
        let mut out = Vec::with_capacity(self.logits.len());
        for ((start, xs), entry) in stretches(self.logits, self.penalised) {
            let values = xs
                .iter()
                .enumerate()
                .map(|(i, &l)| ((start + i) as u32, l / t));
            out.extend(values.filter(|(_, v)| !v.is_nan()));
            out.extend(
                entry
                    .map(|&(id, l)| (id, l / t))
                    .filter(|(_, v)| !v.is_nan()),
            );
        }
        out
    }

    /// The values and weights of the tokens from `start` (a multiple of [`BLOCK`]) to the
    /// block's end or the row's; returns how many. A weight is `exp(v - max)` by the vector
    /// [`exp_in_place`] (within 2 ulp of `f32::exp`); NaN values and weights below the
    /// smallest normal `f32` (where `exp_in_place` stops following `exp` down to 0) weigh 0.
    fn block(&self, start: usize, max: f32, block: &mut Block) -> usize {
        let end = (start + BLOCK).min(self.logits.len());
        let n = end - start;
        let t = self.temperature;
        for (v, &l) in block.values.iter_mut().zip(&self.logits[start..end]) {
            *v = l / t;
        }
        let from = self
            .penalised
            .partition_point(|&(id, _)| (id as usize) < start);
        for &(id, l) in self.penalised[from..]
            .iter()
            .take_while(|&&(id, _)| (id as usize) < end)
        {
            block.values[id as usize - start] = l / t;
        }
        for (w, &v) in block.weights.iter_mut().zip(&block.values[..n]) {
            *w = if v == max {
                0.0
            } else if v.is_nan() {
                f32::NEG_INFINITY
            } else {
                v - max
            };
        }
        exp_in_place(&mut block.weights[..n]);
        for w in &mut block.weights[..n] {
            if *w <= f32::MIN_POSITIVE {
                *w = 0.0;
            }
        }
        n
    }
}

/// Index of the largest logit; the lowest index wins ties, NaN never wins (0 when every value
/// is NaN or the slice is empty).
///
/// Two passes, each over sixteen values at a time so the loops vectorise: the largest value
/// ([`max_value`]), then the first sixteen holding it. (One pass that carries the best index
/// compares every value with a load that waits on the previous comparison: several times
/// slower over a real vocabulary.)
pub fn argmax(logits: &[f32]) -> u32 {
    first_equal(logits, max_value(logits)).unwrap_or(0) as u32
}

/// The first index of `xs` holding `value`, sixteen values at a time (see [`argmax`]).
fn first_equal(xs: &[f32], value: f32) -> Option<usize> {
    const LANES: usize = 16;
    let before = xs
        .chunks_exact(LANES)
        .take_while(|chunk| !chunk.iter().fold(false, |hit, &l| hit | (l == value)))
        .count()
        * LANES;
    xs[before..]
        .iter()
        .position(|&l| l == value)
        .map(|i| before + i)
}

mod speculative;
#[cfg(test)]
mod tests;
