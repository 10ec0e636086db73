//! Rotary position embedding applied in place, with a position per token (a batch mixes
//! sequences at different positions). Angles are computed once per forward pass and reused by
//! every layer; the arithmetic matches the usual `pos * base^(-2i/d)` table in `f32`.

/// How rotary embedding pairs the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs `(2i, 2i + 1)`: GGUF Llama checkpoints, whose Q/K rows llama.cpp permuted.
    Interleaved,
    /// Pairs `(i, i + d/2)` ("rotate half"): Qwen, and Llama in Hugging Face layout.
    Neox,
}

/// Inverse frequencies `1 / theta^(2i/d)` for `i < d/2`.
pub fn inverse_frequencies(head_dim: usize, theta: f32) -> Vec<f32> {
    (0..head_dim)
        .step_by(2)
        .map(|i| 1f32 / theta.powf(i as f32 / head_dim as f32))
        .collect()
}

/// cos/sin of every (token, frequency) pair of one forward pass.
pub struct RotaryAngles {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
    style: RopeStyle,
}

impl RotaryAngles {
    pub fn new(positions: &[u32], inv_freq: &[f32], style: RopeStyle) -> Self {
        let half = inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        Self {
            half,
            cos,
            sin,
            style,
        }
    }

    pub fn num_tokens(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// Rotates `x`, laid out `[tokens, heads, head_dim]` with `head_dim == 2 * half`.
    pub fn apply(&self, x: &mut [f32], num_heads: usize) {
        let head_dim = 2 * self.half;
        assert_eq!(x.len(), self.num_tokens() * num_heads * head_dim);
        for (t, row) in x.chunks_exact_mut(num_heads * head_dim).enumerate() {
            let cos = &self.cos[t * self.half..(t + 1) * self.half];
            let sin = &self.sin[t * self.half..(t + 1) * self.half];
            for head in row.chunks_exact_mut(head_dim) {
                match self.style {
                    RopeStyle::Neox => {
                        let (a, b) = head.split_at_mut(self.half);
                        for i in 0..self.half {
                            let (x0, x1) = (a[i], b[i]);
                            a[i] = x0 * cos[i] - x1 * sin[i];
                            b[i] = x0 * sin[i] + x1 * cos[i];
                        }
                    }
                    RopeStyle::Interleaved => {
                        for (i, pair) in head.chunks_exact_mut(2).enumerate() {
                            let (x0, x1) = (pair[0], pair[1]);
                            pair[0] = x0 * cos[i] - x1 * sin[i];
                            pair[1] = x0 * sin[i] + x1 * cos[i];
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    fn check_against_candle(style: RopeStyle) {
        let (tokens, heads, hd) = (5usize, 3usize, 8usize);
        let positions: Vec<u32> = (0..tokens as u32).map(|t| t + 7).collect();
        let inv = inverse_frequencies(hd, 10000.0);
        let x: Vec<f32> = (0..tokens * heads * hd)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        let mut ours = x.clone();
        RotaryAngles::new(&positions, &inv, style).apply(&mut ours, heads);

        // candle's rope on [1, heads, tokens, hd] with contiguous positions 7..12.
        let dev = Device::Cpu;
        let xt = Tensor::from_vec(x, (1, tokens, heads, hd), &dev)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap();
        let angles: Vec<f32> = positions
            .iter()
            .flat_map(|&p| inv.iter().map(move |f| p as f32 * f))
            .collect();
        let ang = Tensor::from_vec(angles, (tokens, hd / 2), &dev).unwrap();
        let (cos, sin) = (ang.cos().unwrap(), ang.sin().unwrap());
        let reference = match style {
            RopeStyle::Neox => candle_nn::rotary_emb::rope(&xt, &cos, &sin),
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(&xt, &cos, &sin),
        }
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
        for (a, b) in ours.iter().zip(&reference) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
    }

    #[test]
    fn neox_rotation_matches_candle_rope() {
        check_against_candle(RopeStyle::Neox);
    }

    #[test]
    fn interleaved_rotation_matches_candle_rope_i() {
        check_against_candle(RopeStyle::Interleaved);
    }

    #[test]
    fn position_zero_is_identity() {
        let inv = inverse_frequencies(4, 10000.0);
        let mut x = vec![1.0, 2.0, 3.0, 4.0];
        RotaryAngles::new(&[0], &inv, RopeStyle::Neox).apply(&mut x, 1);
        assert_eq!(x, vec![1.0, 2.0, 3.0, 4.0]);
    }
}
