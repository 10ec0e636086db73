//! Random-weight models of real shapes, made in memory: what measuring speed at a published
//! model's size needs, without its file. Every matrix is stored in one chosen format with
//! random quants and small, finite scales; norms are ones. The values mean nothing; the bytes
//! read and the work done per token are the real model's.

use std::borrow::Cow;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{Device, Tensor};
use rayon::prelude::*;

use super::config::{Architecture, ModelConfig, RopeStyle};
use super::error::{ModelError, Result};
use super::weights::{Weight, WeightSource};

/// The shapes `--random` knows, by name: published configs of Qwen2.5 and Qwen3 models.
pub const SHAPES: [&str; 5] = [
    "qwen2.5-0.5b",
    "qwen2.5-1.5b",
    "qwen3-0.6b",
    "qwen3-8b",
    "qwen3-32b",
];

/// The config of shape `name` (one of [`SHAPES`]).
pub fn shape(name: &str) -> Option<ModelConfig> {
    // (architecture, hidden, intermediate, layers, heads, kv heads, head dim, tied)
    let (arch, h, ffn, layers, heads, kv, hd, tied) = match name {
        "qwen2.5-0.5b" => (Architecture::Qwen2, 896, 4864, 24, 14, 2, 64, true),
        "qwen2.5-1.5b" => (Architecture::Qwen2, 1536, 8960, 28, 12, 2, 128, true),
        "qwen3-0.6b" => (Architecture::Qwen3, 1024, 3072, 28, 16, 8, 128, true),
        "qwen3-8b" => (Architecture::Qwen3, 4096, 12288, 36, 32, 8, 128, false),
        "qwen3-32b" => (Architecture::Qwen3, 5120, 25600, 64, 64, 8, 128, false),
        _ => return None,
    };
    Some(ModelConfig {
        architecture: arch,
        vocab_size: 151_936,
        hidden_size: h,
        intermediate_size: ffn,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv,
        head_dim: hd,
        context_length: 32_768,
        rms_norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        rope_style: RopeStyle::Neox,
        qkv_bias: arch == Architecture::Qwen2,
        qk_norm: arch == Architecture::Qwen3,
        tied_embeddings: tied,
    })
}

/// Parses `NAME` or `NAME:FORMAT` (`qwen3-8b:q4_k`; the format defaults to Q4_K).
pub fn parse(spec: &str) -> Result<(ModelConfig, GgmlDType)> {
    let (name, format) = spec.split_once(':').unwrap_or((spec, "q4_k"));
    let config = shape(name).ok_or_else(|| {
        ModelError::Device(format!(
            "random model '{name}' is not a known shape (known: {})",
            SHAPES.join(", ")
        ))
    })?;
    let dtype = match format.to_ascii_lowercase().as_str() {
        "f32" => GgmlDType::F32,
        "f16" => GgmlDType::F16,
        "bf16" => GgmlDType::BF16,
        "q4_0" => GgmlDType::Q4_0,
        "q4_1" => GgmlDType::Q4_1,
        "q5_0" => GgmlDType::Q5_0,
        "q8_0" => GgmlDType::Q8_0,
        "q4_k" => GgmlDType::Q4K,
        "q6_k" => GgmlDType::Q6K,
        other => {
            return Err(ModelError::Device(format!(
                "random model format '{other}' is not one of f32, f16, bf16, q4_0, q4_1, \
                 q5_0, q8_0, q4_k, q6_k"
            )))
        }
    };
    Ok((config, dtype))
}

/// Weights of one format, drawn from a seed, for a config's every tensor.
pub struct RandomSource {
    dtype: GgmlDType,
    seed: u64,
    tied: bool,
}

impl RandomSource {
    pub fn new(config: &ModelConfig, dtype: GgmlDType, seed: u64) -> Self {
        Self {
            dtype,
            seed,
            tied: config.tied_embeddings,
        }
    }
}

/// Byte offsets of a block's `f16` scales, which must be finite.
fn scale_offsets(dtype: GgmlDType) -> &'static [usize] {
    match dtype {
        GgmlDType::Q4_0 | GgmlDType::Q5_0 | GgmlDType::Q8_0 => &[0],
        GgmlDType::Q4_1 | GgmlDType::Q4K => &[0, 2],
        GgmlDType::Q6K => &[208],
        _ => &[],
    }
}

/// `len` pseudo-random bytes of stream `seed` (splitmix64, in parallel chunks).
fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    bytes
        .par_chunks_mut(1 << 20)
        .enumerate()
        .for_each(|(chunk, out)| {
            let mut state = seed ^ (chunk as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            for word in out.chunks_mut(8) {
                state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^= z >> 31;
                word.copy_from_slice(&z.to_le_bytes()[..word.len()]);
            }
        });
    bytes
}

/// A stable per-tensor seed.
fn tensor_seed(seed: u64, name: &str) -> u64 {
    name.bytes().fold(seed ^ 0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Small values of a dense format, from random bytes: `f16`/`bf16` with their exponent
/// pinned to ±[2⁻⁷, 2⁻⁶), `f32` likewise.
fn dense(dtype: GgmlDType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let n = rows * cols;
    let mut bytes = random_bytes(n * dtype.type_size(), seed);
    match dtype {
        GgmlDType::F16 => bytes.chunks_exact_mut(2).for_each(|b| {
            let bits = (u16::from_le_bytes([b[0], b[1]]) & 0x83ff) | (0x08 << 10);
            b.copy_from_slice(&bits.to_le_bytes());
        }),
        GgmlDType::BF16 => bytes.chunks_exact_mut(2).for_each(|b| {
            let bits = (u16::from_le_bytes([b[0], b[1]]) & 0x807f) | (0x78 << 7);
            b.copy_from_slice(&bits.to_le_bytes());
        }),
        _ => bytes.chunks_exact_mut(4).for_each(|b| {
            let bits = (u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x807f_ffff) | (0x78 << 23);
            b.copy_from_slice(&bits.to_le_bytes());
        }),
    }
    bytes
}

impl WeightSource for RandomSource {
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Weight> {
        let seed = tensor_seed(self.seed, name);
        let dtype = self.dtype;
        let block = dtype.block_size();
        if !cols.is_multiple_of(block) {
            return Err(ModelError::Device(format!(
                "{name}: {cols} columns are not whole {dtype:?} blocks of {block}"
            )));
        }
        let bytes = match dtype {
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => dense(dtype, rows, cols, seed),
            _ => {
                let size = dtype.type_size();
                let mut bytes = random_bytes(rows * cols / block * size, seed);
                // Scales of about 2⁻⁹ keep every value small and finite.
                let scale = half::f16::from_f32(1.0 / 512.0).to_le_bytes();
                bytes.par_chunks_exact_mut(size).for_each(|b| {
                    for &at in scale_offsets(dtype) {
                        b[at..at + 2].copy_from_slice(&scale);
                    }
                });
                bytes
            }
        };
        let storage = QStorage::from_data(Cow::Owned(bytes), &Device::Cpu, dtype)?;
        Ok(Weight::Quantized(Arc::new(QTensor::new(
            storage,
            (rows, cols),
        )?)))
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<Tensor> {
        let value = if name.ends_with(".bias") { 0.0 } else { 1.0 };
        Ok(Tensor::full(value as f32, len, &Device::Cpu)?)
    }

    fn contains(&self, name: &str) -> bool {
        name != "output.weight" || !self.tied
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ComputeTarget, MatmulBackend, Model};

    #[test]
    fn every_shape_is_a_valid_config() {
        for name in SHAPES {
            shape(name).unwrap().validate().unwrap();
        }
        assert!(parse("qwen3-9b")
            .unwrap_err()
            .to_string()
            .contains("qwen3-8b"));
        assert!(parse("qwen3-8b:q3_k")
            .unwrap_err()
            .to_string()
            .contains("q4_k"));
    }

    /// A random model of each format runs and gives finite logits: its scales are finite.
    #[test]
    fn random_models_give_finite_logits() {
        let mut config = shape("qwen3-0.6b").unwrap();
        config.num_layers = 1;
        config.vocab_size = 512;
        for dtype in [
            GgmlDType::Q4K,
            GgmlDType::Q6K,
            GgmlDType::Q8_0,
            GgmlDType::F16,
        ] {
            let mut src = RandomSource::new(&config, dtype, 7);
            let target = ComputeTarget::Cpu(MatmulBackend::Native);
            let model = Model::load_on(config.clone(), &mut src, target).unwrap();
            let logits = crate::model::runner::score_text(&model, &[1, 2, 3])
                .unwrap()
                .logits;
            let values = logits.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(values.len(), 3 * 512);
            assert!(values.iter().all(|v| v.is_finite()), "{dtype:?}");
            assert!(values.iter().any(|&v| v != 0.0), "{dtype:?}");
        }
    }
}
