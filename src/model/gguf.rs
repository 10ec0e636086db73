//! GGUF checkpoints: metadata → [`ModelConfig`], tensors → [`WeightSource`] (kept quantized).
//!
//! The file is checked before any tensor is read: header, architecture, and that every tensor's
//! data lies inside the file, so a truncated download fails at once, naming the tensor.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor};

use super::config::{Architecture, ModelConfig, RopeStyle};
use super::error::{ModelError, Result};
use super::weights::{check_shape, Weight, WeightSource};

pub struct GgufFile {
    path: PathBuf,
    reader: BufReader<File>,
    content: Content,
    device: Device,
}

impl GgufFile {
    pub fn open(path: &Path, device: &Device) -> Result<Self> {
        let io = |source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let file_len = file.metadata().map_err(io)?.len();
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader).map_err(|e| ModelError::Format {
            path: path.to_path_buf(),
            reason: header_error(&e.to_string()),
        })?;
        let this = Self {
            path: path.to_path_buf(),
            reader,
            content,
            device: device.clone(),
        };
        this.check_tensor_extents(file_len)?;
        Ok(this)
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    fn check_tensor_extents(&self, file_len: u64) -> Result<()> {
        for (name, info) in &self.content.tensor_infos {
            let dtype = info.ggml_dtype;
            // The dimensions come from the file: their product may not fit a machine word.
            let Some(elems) = info
                .shape
                .dims()
                .iter()
                .try_fold(1usize, |n, &d| n.checked_mul(d))
            else {
                return Err(self.format_error(format!(
                    "tensor '{name}' has dimensions {:?}, more elements than can be addressed",
                    info.shape.dims()
                )));
            };
            // A tensor of no elements is never a model's, and its empty data would reach the
            // reader as a misaligned slice of the element type.
            if elems == 0 {
                return Err(self.format_error(format!(
                    "tensor '{name}' has dimensions {:?}: no elements",
                    info.shape.dims()
                )));
            }
            if elems % dtype.block_size() != 0 {
                return Err(self.format_error(format!(
                    "tensor '{name}' has {elems} elements, not a multiple of its {dtype:?} block size"
                )));
            }
            // Each step may overflow on a crafted file; an overflow is past any file's end.
            let end = ((elems / dtype.block_size()) as u64)
                .checked_mul(dtype.type_size() as u64)
                .and_then(|bytes| {
                    self.content
                        .tensor_data_offset
                        .checked_add(info.offset)?
                        .checked_add(bytes)
                })
                .unwrap_or(u64::MAX);
            if end > file_len {
                return Err(self.format_error(format!(
                    "file is truncated: tensor '{name}' ends at byte {end} but the file has {file_len} bytes"
                )));
            }
        }
        Ok(())
    }

    fn format_error(&self, reason: String) -> ModelError {
        ModelError::Format {
            path: self.path.clone(),
            reason,
        }
    }

    /// The decoder configuration from `{arch}.*` metadata.
    pub fn config(&self) -> Result<ModelConfig> {
        let md = self.metadata();
        let arch_name = get_str(md, "general.architecture")?;
        let architecture = Architecture::from_name(arch_name)?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let hidden = get_usize(md, &key("embedding_length"))?;
        let num_heads = get_usize(md, &key("attention.head_count"))?;
        let head_dim = match md.get(&key("attention.key_length")) {
            Some(v) => value_usize(v, &key("attention.key_length"))?,
            None => hidden / num_heads.max(1),
        };
        let vocab_size = match md.get(&key("vocab_size")) {
            Some(v) => value_usize(v, &key("vocab_size"))?,
            None => match md.get("tokenizer.ggml.tokens") {
                Some(Value::Array(tokens)) => tokens.len(),
                _ => return Err(ModelError::MissingMetadata(key("vocab_size"))),
            },
        };
        let rope_style = match architecture {
            Architecture::Llama => RopeStyle::Interleaved,
            Architecture::Qwen2 | Architecture::Qwen3 => RopeStyle::Neox,
        };
        Ok(ModelConfig {
            architecture,
            vocab_size,
            hidden_size: hidden,
            intermediate_size: get_usize(md, &key("feed_forward_length"))?,
            num_layers: get_usize(md, &key("block_count"))?,
            num_heads,
            num_kv_heads: match md.get(&key("attention.head_count_kv")) {
                Some(v) => value_usize(v, &key("attention.head_count_kv"))?,
                None => num_heads,
            },
            head_dim,
            context_length: get_usize(md, &key("context_length"))?,
            rms_norm_eps: get_f32(md, &key("attention.layer_norm_rms_epsilon"))? as f64,
            rope_theta: match md.get(&key("rope.freq_base")) {
                Some(v) => value_f32(v, &key("rope.freq_base"))?,
                None => 10_000.0,
            },
            rope_style,
            qkv_bias: architecture == Architecture::Qwen2,
            qk_norm: architecture == Architecture::Qwen3,
            tied_embeddings: !self.contains("output.weight"),
        })
    }

    fn read(&mut self, name: &str) -> Result<Arc<candle_core::quantized::QTensor>> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        check_dtype(name, info.ggml_dtype)?;
        let t = info
            .read(
                &mut self.reader,
                self.content.tensor_data_offset,
                &self.device,
            )
            .map_err(|e| ModelError::Format {
                path: self.path.clone(),
                reason: format!("tensor '{name}': {e}"),
            })?;
        Ok(Arc::new(t))
    }
}

impl WeightSource for GgufFile {
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Weight> {
        let t = self.read(name)?;
        check_shape(name, t.shape().dims(), &[rows, cols])?;
        Ok(match t.dtype() {
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => {
                Weight::Dense(t.dequantize(&self.device)?)
            }
            _ => Weight::Quantized(t),
        })
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<Tensor> {
        let t = self.read(name)?;
        check_shape(name, t.shape().dims(), &[len])?;
        Ok(t.dequantize(&self.device)?)
    }

    fn contains(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }
}

fn check_dtype(name: &str, dtype: GgmlDType) -> Result<()> {
    match dtype {
        GgmlDType::Q8_1 | GgmlDType::Q8K => Err(ModelError::UnsupportedQuant {
            tensor: name.to_string(),
            dtype: format!("{dtype:?}"),
        }),
        _ => Ok(()),
    }
}

/// Rephrases the GGUF reader's header errors so the cause is clear.
fn header_error(msg: &str) -> String {
    if let Some(id) = msg.strip_prefix("unknown dtype for tensor ") {
        format!("a tensor uses ggml type id {id}, which is not supported (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K)")
    } else if msg.contains("magic") {
        format!("not a GGUF file ({msg})")
    } else if msg.contains("failed to fill whole buffer") {
        "file is truncated inside its header".to_string()
    } else {
        msg.to_string()
    }
}

pub(crate) fn get<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<&'a Value> {
    md.get(key)
        .ok_or_else(|| ModelError::MissingMetadata(key.to_string()))
}

pub(crate) fn get_str<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<&'a str> {
    get(md, key)?
        .to_string()
        .map(|s| s.as_str())
        .map_err(|e| invalid(key, e))
}

fn get_usize(md: &HashMap<String, Value>, key: &str) -> Result<usize> {
    value_usize(get(md, key)?, key)
}

fn get_f32(md: &HashMap<String, Value>, key: &str) -> Result<f32> {
    value_f32(get(md, key)?, key)
}

pub(crate) fn value_usize(v: &Value, key: &str) -> Result<usize> {
    let n = match v {
        Value::U8(x) => *x as i64,
        Value::I8(x) => *x as i64,
        Value::U16(x) => *x as i64,
        Value::I16(x) => *x as i64,
        Value::U32(x) => *x as i64,
        Value::I32(x) => *x as i64,
        Value::U64(x) => *x as i64,
        Value::I64(x) => *x,
        other => {
            return Err(invalid(
                key,
                format!("expected an integer, found {:?}", other.value_type()),
            ))
        }
    };
    usize::try_from(n).map_err(|_| invalid(key, format!("{n} is negative")))
}

fn value_f32(v: &Value, key: &str) -> Result<f32> {
    match v {
        Value::F32(x) => Ok(*x),
        Value::F64(x) => Ok(*x as f32),
        other => value_usize(other, key).map(|x| x as f32),
    }
}

fn invalid(key: &str, reason: impl ToString) -> ModelError {
    ModelError::InvalidMetadata {
        key: key.to_string(),
        reason: reason.to_string(),
    }
}
