//! Router heads re-implemented with plain f64 loops over the tensors of their safetensors
//! file, as an independent reference for the routing tests.

use std::collections::HashMap;
use std::path::Path;

use super::oracle::TokenFeatures;

/// A head's tensors by name: (shape, values).
pub struct HeadWeights(HashMap<String, (Vec<usize>, Vec<f64>)>);

impl HeadWeights {
    pub fn read(path: &Path) -> Self {
        let tensors = candle_core::safetensors::load(path, &candle_core::Device::Cpu).unwrap();
        let map = tensors
            .into_iter()
            .map(|(name, t)| {
                let shape = t.dims().to_vec();
                let values = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                (name, (shape, values.into_iter().map(f64::from).collect()))
            })
            .collect();
        Self(map)
    }

    fn get(&self, name: &str) -> &(Vec<usize>, Vec<f64>) {
        self.0
            .get(name)
            .unwrap_or_else(|| panic!("no tensor {name}"))
    }

    /// y = W x + b for the linear layer `name` (W is [out, in]).
    fn linear(&self, name: &str, x: &[f64]) -> Vec<f64> {
        let (shape, w) = self.get(&format!("{name}.weight"));
        let (_, b) = self.get(&format!("{name}.bias"));
        let (out, inp) = (shape[0], shape[1]);
        assert_eq!(x.len(), inp, "{name}");
        (0..out)
            .map(|o| b[o] + (0..inp).map(|i| w[o * inp + i] * x[i]).sum::<f64>())
            .collect()
    }

    fn layer_norm(&self, name: &str, x: &[f64]) -> Vec<f64> {
        let (_, g) = self.get(&format!("{name}.weight"));
        let (_, b) = self.get(&format!("{name}.bias"));
        let n = x.len() as f64;
        let mean = x.iter().sum::<f64>() / n;
        let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        let inv = 1.0 / (var + 1e-5).sqrt();
        x.iter()
            .enumerate()
            .map(|(i, v)| (v - mean) * inv * g[i] + b[i])
            .collect()
    }
}

fn sigmoid(x: f64) -> f32 {
    (1.0 / (1.0 + (-x).exp())) as f32
}

fn relu(v: Vec<f64>) -> Vec<f64> {
    v.into_iter().map(|x| x.max(0.0)).collect()
}

/// erf by its Maclaurin series (|x| small) or the continued-fraction tail; ~1e-12 here.
pub fn erf(x: f64) -> f64 {
    if x.abs() < 3.0 {
        let (mut term, mut sum, x2) = (x, x, x * x);
        for n in 1..200 {
            term *= -x2 / n as f64;
            let add = term / (2 * n + 1) as f64;
            sum += add;
            if add.abs() < 1e-17 {
                break;
            }
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        let t = x.abs();
        let mut f = 0.0;
        for k in (1..60).rev() {
            f = (k as f64 / 2.0) / (t + f);
        }
        let tail = (-t * t).exp() / std::f64::consts::PI.sqrt() / (t + f);
        (1.0 - tail) * x.signum()
    }
}

fn gelu(v: Vec<f64>) -> Vec<f64> {
    v.into_iter()
        .map(|x| 0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2)))
        .collect()
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// What a head reads beside R2R's embedding and logits: the hidden state, then (when
/// `confidence_k` > 0) the entropy of the softmax over the `confidence_k` largest logits and
/// the margin between the two largest; standardised by the file's `standardize.mean` and
/// `standardize.scale` where it has them.
pub fn state(w: &HeadWeights, f: &TokenFeatures, confidence_k: usize) -> Vec<f64> {
    let mut x = f64s(&f.hidden);
    if confidence_k > 0 {
        let top = f64s(&f.sorted_logits[..confidence_k]);
        let z: f64 = top.iter().map(|&l| (l - top[0]).exp()).sum();
        let entropy = -top
            .iter()
            .map(|&l| {
                let p = (l - top[0]).exp() / z;
                p * p.ln()
            })
            .sum::<f64>();
        x.extend([entropy, top[0] - top[1]]);
    }
    if let (Some((_, mean)), Some((_, scale))) =
        (w.0.get("standardize.mean"), w.0.get("standardize.scale"))
    {
        for (i, v) in x.iter_mut().enumerate() {
            *v = (*v - mean[i]) * scale[i];
        }
    }
    x
}

/// Co-LLM's gate: sigmoid(probe · state).
pub fn co_llm(w: &HeadWeights, f: &TokenFeatures, confidence_k: usize) -> f32 {
    sigmoid(w.linear("probe", &state(w, f, confidence_k))[0])
}

/// CITER's confidence: state → 2h (ReLU) → h (ReLU) → 1, sigmoid.
pub fn citer(w: &HeadWeights, f: &TokenFeatures, confidence_k: usize) -> f32 {
    let x = relu(w.linear("fc1", &state(w, f, confidence_k)));
    let x = relu(w.linear("fc2", &x));
    sigmoid(w.linear("out", &x)[0])
}

/// R2R's score over state ‖ embedding ‖ projected top-k logits, `blocks` residual blocks.
pub fn r2r(
    w: &HeadWeights,
    f: &TokenFeatures,
    top_k: usize,
    blocks: usize,
    confidence_k: usize,
) -> f32 {
    let projected = w.linear("logits_proj", &f64s(&f.sorted_logits[..top_k]));
    let mut input = state(w, f, confidence_k);
    input.extend(f64s(&f.embedding));
    input.extend(projected);
    let mut x = w.linear("input", &input);
    for b in 0..blocks {
        let h = w.layer_norm(&format!("blocks.{b}.norm"), &x);
        let h = gelu(w.linear(&format!("blocks.{b}.fc1"), &h));
        let h = w.linear(&format!("blocks.{b}.fc2"), &h);
        x = x.iter().zip(h).map(|(a, b)| a + b).collect();
    }
    let x = w.layer_norm("norm", &x);
    sigmoid(w.linear("output", &x)[0])
}
