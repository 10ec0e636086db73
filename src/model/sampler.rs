//! Next-token sampling: penalties, temperature, top-k, top-p, min-p, and a per-request seed.
//!
//! Order (as in vLLM): repetition penalty (over prompt and output), presence and frequency
//! penalties (over the output), then greedy if `temperature == 0`, else temperature → top-k →
//! softmax → min-p → top-p → draw. For a given seed the sequence of draws is deterministic.

use std::collections::HashMap;

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
    pub fn sample(&mut self, logits: &[f32], prompt: &[u32], output: &[u32]) -> u32 {
        let p = &self.params;
        let mut logits = logits.to_vec();
        self.apply_penalties(&mut logits, prompt, output);
        if p.temperature == 0.0 {
            return argmax(&logits);
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

    fn apply_penalties(&self, logits: &mut [f32], prompt: &[u32], output: &[u32]) {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let mut seen = vec![false; logits.len()];
            for &t in prompt.iter().chain(output) {
                if let Some(s) = seen.get_mut(t as usize) {
                    *s = true;
                }
            }
            for (l, _) in logits.iter_mut().zip(&seen).filter(|(_, s)| **s) {
                *l = if *l > 0.0 {
                    *l / p.repetition_penalty
                } else {
                    *l * p.repetition_penalty
                };
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            let mut counts: HashMap<u32, u32> = HashMap::new();
            for &t in output {
                *counts.entry(t).or_default() += 1;
            }
            for (t, n) in counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= p.presence_penalty + p.frequency_penalty * n as f32;
                }
            }
        }
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
    const LANES: usize = 16;
    let max = max_value(logits);
    let before = logits
        .chunks_exact(LANES)
        .take_while(|chunk| !chunk.iter().fold(false, |hit, &l| hit | (l == max)))
        .count()
        * LANES;
    logits[before..]
        .iter()
        .position(|&l| l == max)
        .map_or(0, |i| before + i) as u32
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
