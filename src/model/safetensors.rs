//! Hugging Face checkpoint directories: `config.json`, `*.safetensors` (f32/f16/bf16, converted
//! to f32 at load), `tokenizer.json`, and `tokenizer_config.json` for the chat template and
//! special tokens. Tensor names are mapped from the GGUF names the decoder asks for.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde::Deserialize;

use super::config::{Architecture, ModelConfig, RopeStyle};
use super::error::{ModelError, Result};
use super::weights::{check_shape, Weight, WeightSource};

/// The subset of `config.json` the decoder needs.
#[derive(Debug, Deserialize)]
struct HfConfig {
    model_type: String,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    max_position_embeddings: usize,
    rms_norm_eps: f64,
    #[serde(default = "default_rope_theta")]
    rope_theta: f32,
    #[serde(default)]
    tie_word_embeddings: bool,
    attention_bias: Option<bool>,
}

fn default_rope_theta() -> f32 {
    10_000.0
}

pub struct SafetensorsDir {
    dir: PathBuf,
    tensors: HashMap<String, Tensor>,
    device: Device,
}

fn io_err(path: &Path, source: std::io::Error) -> ModelError {
    ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Reads and parses a JSON file of the checkpoint directory.
pub fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| io_err(path, e))?;
    serde_json::from_str(&text).map_err(|e| ModelError::Format {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

impl SafetensorsDir {
    pub fn open(dir: &Path, device: &Device) -> Result<Self> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| io_err(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(ModelError::Format {
                path: dir.to_path_buf(),
                reason: "directory has no *.safetensors files".into(),
            });
        }
        let mut tensors = HashMap::new();
        for file in &files {
            let loaded =
                candle_core::safetensors::load(file, device).map_err(|e| ModelError::Format {
                    path: file.clone(),
                    reason: e.to_string(),
                })?;
            tensors.extend(loaded);
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            tensors,
            device: device.clone(),
        })
    }

    pub fn config(&self) -> Result<ModelConfig> {
        let hf: HfConfig = read_json(&self.dir.join("config.json"))?;
        let architecture = Architecture::from_name(&hf.model_type)?;
        Ok(ModelConfig {
            architecture,
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_layers: hf.num_hidden_layers,
            num_heads: hf.num_attention_heads,
            num_kv_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim: hf
                .head_dim
                .unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1)),
            context_length: hf.max_position_embeddings,
            rms_norm_eps: hf.rms_norm_eps,
            rope_theta: hf.rope_theta,
            // Hugging Face keeps Q/K unpermuted: every architecture rotates halves.
            rope_style: RopeStyle::Neox,
            qkv_bias: hf
                .attention_bias
                .unwrap_or(architecture == Architecture::Qwen2),
            qk_norm: architecture == Architecture::Qwen3,
            tied_embeddings: hf.tie_word_embeddings || !self.tensors.contains_key("lm_head.weight"),
        })
    }

    fn get(&self, gguf_name: &str) -> Result<Tensor> {
        let name = hf_name(gguf_name);
        let t = self
            .tensors
            .get(&name)
            .ok_or_else(|| ModelError::MissingTensor(name.clone()))?;
        match t.dtype() {
            DType::F32 | DType::F16 | DType::BF16 => {
                Ok(t.to_dtype(DType::F32)?.to_device(&self.device)?)
            }
            other => Err(ModelError::UnsupportedQuant {
                tensor: name,
                dtype: format!("{other:?}"),
            }),
        }
    }
}

impl WeightSource for SafetensorsDir {
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Weight> {
        let t = self.get(name)?;
        check_shape(&hf_name(name), t.dims(), &[rows, cols])?;
        Ok(Weight::Dense(t))
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<Tensor> {
        let t = self.get(name)?;
        check_shape(&hf_name(name), t.dims(), &[len])?;
        Ok(t)
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(&hf_name(name))
    }
}

/// Maps a GGUF tensor name to its Hugging Face name.
pub fn hf_name(gguf: &str) -> String {
    match gguf {
        "token_embd.weight" => return "model.embed_tokens.weight".into(),
        "output_norm.weight" => return "model.norm.weight".into(),
        "output.weight" => return "lm_head.weight".into(),
        _ => {}
    }
    let Some(rest) = gguf.strip_prefix("blk.") else {
        return gguf.to_string();
    };
    let (layer, rest) = rest.split_once('.').unwrap_or((rest, ""));
    let (module, param) = rest.rsplit_once('.').unwrap_or((rest, ""));
    let hf_module = match module {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        other => other,
    };
    format!("model.layers.{layer}.{hf_module}.{param}")
}

#[cfg(test)]
mod tests {
    use super::hf_name;

    #[test]
    fn gguf_names_map_to_hugging_face_names() {
        assert_eq!(
            hf_name("blk.3.attn_q.bias"),
            "model.layers.3.self_attn.q_proj.bias"
        );
        assert_eq!(
            hf_name("blk.0.ffn_down.weight"),
            "model.layers.0.mlp.down_proj.weight"
        );
        assert_eq!(
            hf_name("blk.11.attn_k_norm.weight"),
            "model.layers.11.self_attn.k_norm.weight"
        );
        assert_eq!(hf_name("token_embd.weight"), "model.embed_tokens.weight");
        assert_eq!(hf_name("output.weight"), "lm_head.weight");
    }
}
