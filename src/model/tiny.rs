//! Tiny random-weight checkpoints for tests: a GGUF file (matrices in any mix of quant types)
//! or a Hugging Face directory (safetensors in f32/f16/bf16), each with a small working
//! byte-level BPE tokenizer and a ChatML template. Deterministic for a given seed, written in
//! milliseconds, so tests that need no real weights stay fast.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::config::Architecture;
use super::error::{ModelError, Result};
use super::safetensors::hf_name;

pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

const MERGES: &[(&str, &str)] = &[
    ("Ġ", "t"),
    ("h", "e"),
    ("i", "n"),
    ("Ġ", "a"),
    ("e", "r"),
    ("o", "n"),
    ("Ġt", "he"),
    ("r", "e"),
    ("Ġ", "s"),
    ("a", "n"),
    ("Ġ", "w"),
    ("o", "u"),
    ("Ġ", "c"),
    ("i", "s"),
    ("e", "n"),
    ("Ġ", "o"),
    ("Ġ", "b"),
    ("e", "d"),
    ("n", "d"),
    ("Ġa", "nd"),
    // 280 tokens in all: a multiple of 8, so a tied LM head takes the interleaved kernels
    // as real vocabularies do.
    ("Ġ", "h"),
];
const SPECIAL: &[&str] = &["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

#[derive(Debug, Clone)]
pub struct TinySpec {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub context_length: usize,
    pub tied_embeddings: bool,
    pub seed: u64,
}

impl TinySpec {
    pub fn new(architecture: Architecture) -> Self {
        Self {
            architecture,
            hidden_size: 64,
            intermediate_size: 128,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            context_length: 256,
            tied_embeddings: architecture == Architecture::Llama,
            seed: 0,
        }
    }

    /// Hidden and feed-forward widths that K-quants (256-wide blocks) accept.
    pub fn k_quant_sized(mut self) -> Self {
        self.hidden_size = 256;
        self.intermediate_size = 512;
        self
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    pub fn vocab_size(&self) -> usize {
        256 + MERGES.len() + SPECIAL.len()
    }
}

/// GPT-2's reversible byte → printable character map.
pub fn byte_to_char() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut extra = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + extra);
            extra += 1;
        }
    }
    let mut map = vec!['\0'; 256];
    for (b, c) in printable.into_iter().zip(chars) {
        map[b as usize] = char::from_u32(c).expect("valid char");
    }
    map
}

/// The tokenizer as GGUF metadata: byte tokens, a few merges, ChatML specials.
fn tokenizer_metadata() -> Vec<(String, Value)> {
    let mut tokens: Vec<String> = byte_to_char().into_iter().map(String::from).collect();
    tokens.extend(MERGES.iter().map(|(a, b)| format!("{a}{b}")));
    let mut types = vec![1i32; tokens.len()];
    tokens.extend(SPECIAL.iter().map(|s| s.to_string()));
    types.extend(SPECIAL.iter().map(|_| 3));
    let eos = (tokens.len() - 1) as u32;
    let strings = |v: Vec<String>| Value::Array(v.into_iter().map(Value::String).collect());
    vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("qwen2".into())),
        ("tokenizer.ggml.tokens".into(), strings(tokens)),
        (
            "tokenizer.ggml.merges".into(),
            strings(MERGES.iter().map(|(a, b)| format!("{a} {b}")).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(types.into_iter().map(Value::I32).collect()),
        ),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(eos)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(eos - 2)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
        (
            "tokenizer.chat_template".into(),
            Value::String(CHATML_TEMPLATE.into()),
        ),
    ]
}

/// Random `f32` weights under GGUF names, in GGUF shape order `[out, in]`.
fn random_weights(spec: &TinySpec) -> Result<Vec<(String, Tensor)>> {
    let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
    let dev = Device::Cpu;
    let mut uniform = |shape: &[usize], scale: f32, center: f32| -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = (0..n)
            .map(|_| center + scale * rng.random_range(-1.0f32..1.0))
            .collect();
        Ok(Tensor::from_vec(data, shape, &dev)?)
    };
    let (h, f, hd) = (spec.hidden_size, spec.intermediate_size, spec.head_dim());
    let (q, kv) = (spec.num_heads * hd, spec.num_kv_heads * hd);
    let mut out = vec![(
        "token_embd.weight".to_string(),
        uniform(&[spec.vocab_size(), h], 1.0, 0.0)?,
    )];
    for i in 0..spec.num_layers {
        let p = format!("blk.{i}");
        let mut push = |name: &str, t: Tensor| out.push((format!("{p}.{name}"), t));
        push("attn_norm.weight", uniform(&[h], 0.1, 1.0)?);
        push(
            "attn_q.weight",
            uniform(&[q, h], 1.5 / (h as f32).sqrt(), 0.0)?,
        );
        push(
            "attn_k.weight",
            uniform(&[kv, h], 1.5 / (h as f32).sqrt(), 0.0)?,
        );
        push(
            "attn_v.weight",
            uniform(&[kv, h], 1.5 / (h as f32).sqrt(), 0.0)?,
        );
        if spec.architecture == Architecture::Qwen2 {
            push("attn_q.bias", uniform(&[q], 0.1, 0.0)?);
            push("attn_k.bias", uniform(&[kv], 0.1, 0.0)?);
            push("attn_v.bias", uniform(&[kv], 0.1, 0.0)?);
        }
        if spec.architecture == Architecture::Qwen3 {
            push("attn_q_norm.weight", uniform(&[hd], 0.1, 1.0)?);
            push("attn_k_norm.weight", uniform(&[hd], 0.1, 1.0)?);
        }
        push(
            "attn_output.weight",
            uniform(&[h, q], 1.0 / (q as f32).sqrt(), 0.0)?,
        );
        push("ffn_norm.weight", uniform(&[h], 0.1, 1.0)?);
        push(
            "ffn_gate.weight",
            uniform(&[f, h], 1.5 / (h as f32).sqrt(), 0.0)?,
        );
        push(
            "ffn_up.weight",
            uniform(&[f, h], 1.5 / (h as f32).sqrt(), 0.0)?,
        );
        push(
            "ffn_down.weight",
            uniform(&[h, f], 1.0 / (f as f32).sqrt(), 0.0)?,
        );
    }
    out.push(("output_norm.weight".into(), uniform(&[h], 0.1, 1.0)?));
    if !spec.tied_embeddings {
        out.push((
            "output.weight".into(),
            uniform(&[spec.vocab_size(), h], 2.0 / (h as f32).sqrt(), 0.0)?,
        ));
    }
    Ok(out)
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes a GGUF file; 2-D weights cycle through `matrix_types` (1-D ones stay F32).
pub fn write_gguf(spec: &TinySpec, path: &Path, matrix_types: &[GgmlDType]) -> Result<()> {
    let arch = spec.architecture.name();
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (
            format!("{arch}.block_count"),
            Value::U32(spec.num_layers as u32),
        ),
        (
            format!("{arch}.context_length"),
            Value::U32(spec.context_length as u32),
        ),
        (
            format!("{arch}.embedding_length"),
            Value::U32(spec.hidden_size as u32),
        ),
        (
            format!("{arch}.feed_forward_length"),
            Value::U32(spec.intermediate_size as u32),
        ),
        (
            format!("{arch}.attention.head_count"),
            Value::U32(spec.num_heads as u32),
        ),
        (
            format!("{arch}.attention.head_count_kv"),
            Value::U32(spec.num_kv_heads as u32),
        ),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-6),
        ),
        (format!("{arch}.rope.freq_base"), Value::F32(10_000.0)),
        (
            format!("{arch}.rope.dimension_count"),
            Value::U32(spec.head_dim() as u32),
        ),
        (
            format!("{arch}.attention.key_length"),
            Value::U32(spec.head_dim() as u32),
        ),
        (
            format!("{arch}.attention.value_length"),
            Value::U32(spec.head_dim() as u32),
        ),
        // Tells readers that compute in the checkpoint's dtype to use f32.
        ("general.dtype".into(), Value::U32(0)),
    ];
    md.extend(tokenizer_metadata());
    let mut tensors = Vec::new();
    let mut matrices = 0;
    for (name, t) in random_weights(spec)? {
        let dtype = if t.rank() == 2 && !matrix_types.is_empty() {
            matrices += 1;
            matrix_types[(matrices - 1) % matrix_types.len()]
        } else {
            GgmlDType::F32
        };
        tensors.push((name, QTensor::quantize(&t, dtype)?));
    }
    let mut file = std::fs::File::create(path).map_err(io(path))?;
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    candle_core::quantized::gguf_file::write(&mut file, &md_refs, &t_refs)?;
    Ok(())
}

/// Writes a Hugging Face directory (`config.json`, `model.safetensors` in `dtype`,
/// `tokenizer.json`, `tokenizer_config.json`) holding the same weights `write_gguf` would.
pub fn write_hf_dir(spec: &TinySpec, dir: &Path, dtype: DType) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tensors: HashMap<String, Tensor> = random_weights(spec)?
        .into_iter()
        .map(|(name, t)| Ok((hf_name(&name), t.to_dtype(dtype)?)))
        .collect::<Result<_>>()?;
    let st_path = dir.join("model.safetensors");
    candle_core::safetensors::save(&tensors, &st_path)?;
    let config = serde_json::json!({
        "model_type": spec.architecture.name(),
        "vocab_size": spec.vocab_size(),
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.context_length,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": spec.tied_embeddings,
    });
    let write = |name: &str, text: String| {
        let p = dir.join(name);
        std::fs::write(&p, text).map_err(io(&p))
    };
    write("config.json", config.to_string())?;
    let md: HashMap<String, Value> = tokenizer_metadata().into_iter().collect();
    let (tokenizer, _) = super::tokenizer::from_gguf_metadata(&md)?;
    write(
        "tokenizer.json",
        tokenizer
            .to_string(false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?,
    )?;
    let tc = serde_json::json!({
        "chat_template": CHATML_TEMPLATE,
        "eos_token": "<|im_end|>",
        "bos_token": null,
    });
    write("tokenizer_config.json", tc.to_string())
}
