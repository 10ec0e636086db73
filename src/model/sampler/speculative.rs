//! What speculative sampling needs of a sampler: its next-token distribution whole, a draw
//! from one, and the acceptance test of a drafted token against a verifier's distribution.

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::{argmax_penalised, by_logit, weight, Sampler, Scaled};

impl Sampler {
    /// The distribution [`Sampler::sample`] draws from, whole: the tokens it may pick with
    /// their probabilities (penalties, temperature, top-k, min-p and top-p applied, the kept
    /// tokens' softmax renormalised); greedy gives the argmax with probability 1. For
    /// speculative decoding, which needs the probability of a drafted token under both
    /// models. Under top-k or top-p it sorts only as many of the largest candidates as the
    /// rules need.
    pub fn distribution(&self, logits: &[f32], prompt: &[u32], output: &[u32]) -> Distribution {
        let p = &self.params;
        let penalised = self.penalised(logits, prompt, output);
        if p.temperature == 0.0 {
            return Distribution {
                entries: vec![(argmax_penalised(logits, &penalised), 1.0)],
            };
        }
        let row = Scaled {
            logits,
            penalised: &penalised,
            temperature: p.temperature,
        };
        let mut cand = row.candidates();
        if cand.is_empty() {
            return Distribution {
                entries: vec![(0, 1.0)],
            };
        }
        let max = row.max();
        if p.top_k > 0 || p.top_p < 1.0 {
            if p.top_k > 0 && p.top_k < cand.len() {
                cand.select_nth_unstable_by(p.top_k - 1, by_logit);
                cand.truncate(p.top_k);
            }
            let total: f32 = cand.iter().map(|&(_, v)| weight(v, max)).sum();
            let keep = self.keep_largest(&mut cand, total).unwrap_or(cand.len());
            cand.truncate(keep);
            cand.sort_unstable_by_key(|&(t, _)| t);
        } else if p.min_p > 0.0 {
            cand.retain(|&(_, v)| weight(v, max) >= p.min_p);
        }
        let mut entries: Vec<(u32, f32)> = cand.iter().map(|&(t, v)| (t, weight(v, max))).collect();
        let mass: f64 = entries.iter().map(|&(_, w)| w as f64).sum();
        for (_, w) in &mut entries {
            *w = (*w as f64 / mass) as f32;
        }
        Distribution { entries }
    }

    /// Draws a token from `dist`.
    pub fn draw(&mut self, dist: &Distribution) -> u32 {
        draw_from(
            &mut self.rng,
            dist.entries.iter().map(|&(t, p)| (t, p as f64)),
        )
        .unwrap_or(0)
    }

    /// Speculative sampling's test of a `token` drafted from `q`, against the verifying
    /// model's `p`: accepted (`None`) with probability min(1, p(token) / q(token)); otherwise
    /// the token put in its place (`Some`), drawn from the normalised max(0, p - q) (from `p`
    /// without `token` when rounding leaves that empty). The tokens this yields follow `p`
    /// exactly, whatever `q` is.
    pub fn verify(&mut self, p: &Distribution, q: &Distribution, token: u32) -> Option<u32> {
        let (pt, qt) = (p.prob(token), q.prob(token));
        let u = self.rng.random::<f64>();
        if u * (qt as f64) < pt as f64 {
            return None;
        }
        let residual = p
            .entries
            .iter()
            .map(|&(t, pt)| (t, (pt - q.prob(t)).max(0.0) as f64));
        // Rounding can leave the residual empty when p and q all but agree: then p without
        // the rejected token (which would otherwise come back as its own replacement).
        let others = p
            .entries
            .iter()
            .map(|&(t, pt)| (t, if t == token { 0.0 } else { pt as f64 }));
        Some(
            draw_from(&mut self.rng, residual)
                .or_else(|| draw_from(&mut self.rng, others))
                .unwrap_or(token),
        )
    }
}

/// A next-token distribution: the tokens that may be drawn, with their probabilities, by
/// increasing token id.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Distribution {
    entries: Vec<(u32, f32)>,
}

impl Distribution {
    /// The probability of `token` (0 when it cannot be drawn).
    pub fn prob(&self, token: u32) -> f32 {
        self.entries
            .binary_search_by_key(&token, |&(t, _)| t)
            .map_or(0.0, |i| self.entries[i].1)
    }

    /// The tokens that may be drawn and their probabilities, by increasing token id.
    pub fn entries(&self) -> &[(u32, f32)] {
        &self.entries
    }
}

/// Draws one of `weights` (token, unnormalised weight) by its weight; `None` when they sum
/// to 0.
fn draw_from(
    rng: &mut ChaCha8Rng,
    weights: impl Iterator<Item = (u32, f64)> + Clone,
) -> Option<u32> {
    let mass: f64 = weights.clone().map(|(_, w)| w).sum();
    if mass <= 0.0 || !mass.is_finite() {
        return None;
    }
    let mut r = rng.random::<f64>() * mass;
    let mut last = None;
    for (t, w) in weights.filter(|&(_, w)| w > 0.0) {
        if r < w {
            return Some(t);
        }
        r -= w;
        last = Some(t);
    }
    last
}
