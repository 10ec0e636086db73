//! Next-token sampling: penalties, temperature, top-k, top-p, min-p, and a per-request seed.
//!
//! Order (as in vLLM): repetition penalty (over prompt and output), presence and frequency
//! penalties (over the output), then greedy if `temperature == 0`, else temperature → top-k →
//! softmax → min-p → top-p → draw. For a given seed the sequence of draws is deterministic.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::error::{ModelError, Result};
use crate::kernels::max_value;

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

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from `logits`, given the prompt and the output so far.
    ///
    /// The row is only read: the penalties yield the few entries they change
    /// ([`Sampler::penalised`]), and greedy picks the largest value with those in place
    /// ([`argmax_penalised`]) without copying the row.
    pub fn sample(&mut self, logits: &[f32], prompt: &[u32], output: &[u32]) -> u32 {
        let p = &self.params;
        let penalised = self.penalised(logits, prompt, output);
        if p.temperature == 0.0 {
            return argmax_penalised(logits, &penalised);
        }
        let mut logits = logits.to_vec();
        for &(t, l) in &penalised {
            logits[t as usize] = l;
        }
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l / p.temperature))
            .filter(|(_, l)| !l.is_nan())
            .collect();
        if cand.is_empty() {
            return 0;
        }
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, by_logit);
            cand.truncate(p.top_k);
        }
        cand.sort_unstable_by(by_logit);
        let max = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|(_, l)| (l - max).exp()).collect();
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        let mut keep = probs.len();
        if p.min_p > 0.0 {
            let floor = p.min_p * probs[0];
            keep = probs.iter().take_while(|&&x| x >= floor).count().max(1);
        }
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            let mut n = 0;
            for &x in &probs[..keep] {
                cum += x;
                n += 1;
                if cum >= p.top_p {
                    break;
                }
            }
            keep = n.max(1);
        }
        let mass: f32 = probs[..keep].iter().sum();
        let mut r = self.rng.random::<f32>() * mass;
        for (i, &x) in probs[..keep].iter().enumerate() {
            if r < x {
                return cand[i].0;
            }
            r -= x;
        }
        cand[keep - 1].0
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
/// the row's own: the largest value over the untouched stretches between them and the
/// penalised values, then the first place holding it, each stretch scanned in place.
fn argmax_penalised(logits: &[f32], penalised: &[(u32, f32)]) -> u32 {
    if penalised.is_empty() {
        return argmax(logits);
    }
    // Each stretch of the row between penalised entries, with the entry that ends it (none
    // after the last).
    let stretches = || {
        let mut start = 0;
        penalised.iter().map(Some).chain([None]).map(move |entry| {
            let end = entry.map_or(logits.len(), |&(t, _)| t as usize);
            let stretch = (start, &logits[start..end]);
            start = end + 1;
            (stretch, entry)
        })
    };
    let larger = |m: f32, x: f32| if x > m { x } else { m };
    let max = stretches().fold(f32::NEG_INFINITY, |m, ((_, xs), entry)| {
        let m = larger(m, max_value(xs));
        entry.map_or(m, |&(_, l)| larger(m, l))
    });
    for ((start, xs), entry) in stretches() {
        if let Some(i) = first_equal(xs, max) {
            return (start + i) as u32;
        }
        if let Some(&(t, _)) = entry.filter(|&&(_, l)| l == max) {
            return t;
        }
    }
    0
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

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(params: SamplingParams) -> Sampler {
        Sampler::new(params).unwrap()
    }

    #[test]
    fn greedy_picks_the_largest_logit() {
        let mut s = sampler(SamplingParams::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, 2.9, -1.0], &[], &[]), 1);
    }

    /// Against the plain definition (the first index of the largest non-NaN value) on
    /// random logits with ties, infinities and NaN, at lengths around the lane count.
    #[test]
    fn argmax_is_the_first_largest_value() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for len in [0usize, 1, 2, 15, 16, 17, 33, 1000, 49_152] {
            for case in 0..4 {
                // Few distinct values, so the largest repeats.
                let mut logits: Vec<f32> = (0..len)
                    .map(|_| rng.random_range(0..8) as f32 - 4.0)
                    .collect();
                if len > 0 {
                    match case {
                        1 => logits[rng.random_range(0..len)] = f32::NAN,
                        2 => logits[rng.random_range(0..len)] = f32::INFINITY,
                        3 => logits.iter_mut().for_each(|l| *l = f32::NEG_INFINITY),
                        _ => {}
                    }
                }
                let expected = logits
                    .iter()
                    .enumerate()
                    .filter(|(_, l)| !l.is_nan())
                    .fold(None, |best: Option<(usize, f32)>, (i, &l)| match best {
                        Some((_, b)) if b >= l => best,
                        _ => Some((i, l)),
                    })
                    .map_or(0, |(i, _)| i);
                assert_eq!(argmax(&logits) as usize, expected, "len {len}, case {case}");
            }
        }
        assert_eq!(argmax(&[f32::NAN, 1.0, 3.0, 3.0]), 2);
        assert_eq!(argmax(&[f32::NAN; 40]), 0);
    }

    /// The penalties as plainly defined: applied to a copy of the whole row.
    fn penalise_copy(
        params: &SamplingParams,
        logits: &[f32],
        prompt: &[u32],
        output: &[u32],
    ) -> Vec<f32> {
        let mut logits = logits.to_vec();
        if params.repetition_penalty != 1.0 {
            let mut seen = vec![false; logits.len()];
            for &t in prompt.iter().chain(output) {
                if let Some(s) = seen.get_mut(t as usize) {
                    *s = true;
                }
            }
            for (l, _) in logits.iter_mut().zip(&seen).filter(|(_, s)| **s) {
                *l = if *l > 0.0 {
                    *l / params.repetition_penalty
                } else {
                    *l * params.repetition_penalty
                };
            }
        }
        let mut counts = std::collections::HashMap::<u32, u32>::new();
        for &t in output {
            *counts.entry(t).or_default() += 1;
        }
        for (t, n) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= params.presence_penalty + params.frequency_penalty * n as f32;
            }
        }
        logits
    }

    /// Greedy with penalties reads the row in place; it must pick what the argmax of a
    /// penalised copy picks, ties, NaN, infinities and out-of-vocabulary ids included.
    #[test]
    fn greedy_with_penalties_picks_the_argmax_of_the_penalised_row() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for case in 0..400 {
            let len = [1usize, 2, 17, 100, 1000][case % 5];
            // Few distinct values, so ties between penalised and untouched entries occur.
            let mut logits: Vec<f32> = (0..len)
                .map(|_| rng.random_range(0..6) as f32 - 2.0)
                .collect();
            match case % 7 {
                1 => logits[rng.random_range(0..len)] = f32::NAN,
                2 => logits[rng.random_range(0..len)] = f32::INFINITY,
                3 => logits.iter_mut().for_each(|l| *l = f32::NAN),
                _ => {}
            }
            let ids = |rng: &mut ChaCha8Rng, most: usize| -> Vec<u32> {
                let n = rng.random_range(0..most);
                (0..n)
                    .map(|_| rng.random_range(0..len as u32 + 2))
                    .collect()
            };
            let prompt = ids(&mut rng, 2 * len);
            let output = ids(&mut rng, len + 1);
            let params = SamplingParams {
                repetition_penalty: [1.0, 2.0, 0.5][case % 3],
                presence_penalty: [0.0, 0.5, -1.0][(case / 3) % 3],
                frequency_penalty: [0.0, 1.0, -0.5][(case / 9) % 3],
                ..SamplingParams::greedy()
            };
            let expected = argmax(&penalise_copy(&params, &logits, &prompt, &output));
            let got = sampler(params.clone()).sample(&logits, &prompt, &output);
            assert_eq!(got, expected, "case {case}: {params:?}");
        }
    }

    #[test]
    fn same_seed_gives_same_draws() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(42),
            ..SamplingParams::default()
        };
        let draw = |params: &SamplingParams| {
            let mut s = sampler(params.clone());
            (0..20)
                .map(|_| s.sample(&logits, &[], &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(&params), draw(&params));
        let other = SamplingParams {
            seed: Some(43),
            ..params.clone()
        };
        assert_ne!(draw(&params), draw(&other));
    }

    #[test]
    fn top_k_one_is_greedy() {
        let mut s = sampler(SamplingParams {
            top_k: 1,
            seed: Some(1),
            ..SamplingParams::default()
        });
        for _ in 0..10 {
            assert_eq!(s.sample(&[0.0, 1.0, 0.5], &[], &[]), 1);
        }
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // Token 0 has ~88% of the mass; top_p = 0.5 keeps only it.
        let mut s = sampler(SamplingParams {
            top_p: 0.5,
            seed: Some(3),
            ..SamplingParams::default()
        });
        for _ in 0..50 {
            assert_eq!(s.sample(&[3.0, 1.0, 0.0], &[], &[]), 0);
        }
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let mut s = sampler(SamplingParams {
            min_p: 0.5,
            seed: Some(5),
            ..SamplingParams::default()
        });
        // p(1)/p(0) = e^-0.1 stays; token 2 is far below half of the top probability.
        let mut seen = [0; 3];
        for _ in 0..200 {
            seen[s.sample(&[2.0, 1.9, -3.0], &[], &[]) as usize] += 1;
        }
        assert!(seen[0] > 0 && seen[1] > 0);
        assert_eq!(seen[2], 0);
    }

    #[test]
    fn sampling_follows_the_distribution() {
        let mut s = sampler(SamplingParams {
            seed: Some(9),
            ..SamplingParams::default()
        });
        let logits = [0.0f32, (3.0f32).ln()];
        let ones = (0..4000)
            .filter(|_| s.sample(&logits, &[], &[]) == 1)
            .count();
        // Expected 3000 (p = 0.75); 5 standard deviations is ±137.
        assert!((2863..=3137).contains(&ones), "{ones}");
    }

    #[test]
    fn repetition_penalty_demotes_seen_tokens() {
        let mut s = sampler(SamplingParams {
            temperature: 0.0,
            repetition_penalty: 2.0,
            ..SamplingParams::default()
        });
        // 2.0 / 2 = 1.0 < 1.5: the unseen token wins.
        assert_eq!(s.sample(&[2.0, 1.5], &[0], &[]), 1);
    }

    #[test]
    fn frequency_and_presence_penalties_count_output_tokens() {
        let mut s = sampler(SamplingParams {
            temperature: 0.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.5,
            ..SamplingParams::default()
        });
        // Token 0 appeared twice: 3.0 - 0.5 - 1.0 = 1.5 < 2.0.
        assert_eq!(s.sample(&[3.0, 2.0], &[], &[0, 0]), 1);
        // Prompt tokens are not penalised by these.
        assert_eq!(s.sample(&[3.0, 2.0], &[0, 0], &[]), 0);
    }

    #[test]
    fn invalid_values_name_the_field() {
        let err = Sampler::new(SamplingParams {
            top_p: 0.0,
            ..SamplingParams::default()
        })
        .err()
        .unwrap();
        assert!(err.to_string().contains("top_p"));
        let err = Sampler::new(SamplingParams {
            temperature: -1.0,
            ..SamplingParams::default()
        })
        .err()
        .unwrap();
        assert!(err.to_string().contains("temperature"));
    }
}
