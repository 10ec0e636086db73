//! Tokenizers: built from GGUF metadata (so one GGUF file is a complete model) or read from a
//! `tokenizer.json`; plus [`IncrementalDecoder`], which turns a growing token sequence into text
//! without ever emitting half a UTF-8 character.
//!
//! From GGUF: `tokenizer.ggml.model = "gpt2"` (byte-level BPE) with `tokens`, `merges`,
//! `token_type` (3 = control → special added token, 4 = user-defined → added token) and the
//! pre-tokenizer named by `tokenizer.ggml.pre`; `add_bos_token` adds a BOS post-processor.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use super::error::{ModelError, Result};
use super::gguf::{get, get_str, value_usize};

/// Split pattern used by Qwen2 (and, with `{1,3}` digits, Llama 3).
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Special ids a generator needs besides the tokenizer itself.
#[derive(Debug, Clone, Default)]
pub struct SpecialTokens {
    pub bos: Option<u32>,
    /// Ids that end generation (the EOS id, plus end-of-turn ids found in the vocabulary).
    pub eos: Vec<u32>,
    pub bos_text: Option<String>,
    pub eos_text: Option<String>,
}

fn tok_err(e: impl ToString) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

fn string_array<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<Vec<&'a str>> {
    let Value::Array(items) = get(md, key)? else {
        return Err(tok_err(format!("'{key}' is not an array")));
    };
    items
        .iter()
        .map(|v| {
            v.to_string()
                .map(|s| s.as_str())
                .map_err(|_| tok_err(format!("'{key}' holds a non-string")))
        })
        .collect()
}

fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper> {
    let split = |pattern: &str| -> Result<PreTokenizerWrapper> {
        let split = Split::new(
            SplitPattern::Regex(pattern.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(tok_err)?;
        Ok(Sequence::new(vec![
            split.into(),
            ByteLevel::new(false, false, false).into(),
        ])
        .into())
    };
    match pre {
        "qwen2" | "deepseek-r1-qwen" => split(QWEN2_PATTERN),
        "llama3" | "llama-bpe" | "smaug-bpe" => split(LLAMA3_PATTERN),
        "smollm" | "starcoder" | "refact" | "codeshell" => Ok(Sequence::new(vec![
            Digits::new(true).into(),
            ByteLevel::new(false, true, true).into(),
        ])
        .into()),
        _ => {
            tracing::warn!(pre, "unknown GGUF pre-tokenizer; using the GPT-2 split");
            Ok(ByteLevel::new(false, true, true).into())
        }
    }
}

/// Builds the tokenizer that the GGUF metadata describes.
pub fn from_gguf_metadata(md: &HashMap<String, Value>) -> Result<(Tokenizer, SpecialTokens)> {
    let model = get_str(md, "tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(tok_err(format!(
            "tokenizer model '{model}' is not supported (supported: gpt2 byte-level BPE)"
        )));
    }
    let tokens = string_array(md, "tokenizer.ggml.tokens")?;
    let mut tokenizer = Tokenizer::new(byte_level_bpe(md, &tokens)?);
    let pre = md
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.to_string().ok())
        .map(|s| s.as_str())
        .unwrap_or("default");
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer(pre)?));
    if pre == "qwen2" {
        tokenizer.with_normalizer(Some(NFC));
    }
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    add_marked_tokens(&mut tokenizer, md, &tokens);

    let id = |key: &str| -> Result<Option<u32>> {
        md.get(key)
            .map(|v| value_usize(v, key).map(|x| x as u32))
            .transpose()
    };
    let bos = id("tokenizer.ggml.bos_token_id")?;
    let eos = id("tokenizer.ggml.eos_token_id")?;
    let text = |id: Option<u32>| {
        id.and_then(|i| tokens.get(i as usize))
            .map(|s| s.to_string())
    };
    let add_bos = md
        .get("tokenizer.ggml.add_bos_token")
        .and_then(|v| v.to_bool().ok())
        .unwrap_or(false);
    if let (true, Some(bos_id), Some(bos_text)) = (add_bos, bos, text(bos)) {
        tokenizer.with_post_processor(Some(bos_processor(&bos_text, bos_id)?));
    }
    let specials = SpecialTokens {
        bos,
        eos: end_ids(&tokenizer, eos),
        bos_text: text(bos),
        eos_text: text(eos),
    };
    Ok((tokenizer, specials))
}

fn byte_level_bpe(md: &HashMap<String, Value>, tokens: &[&str]) -> Result<BPE> {
    let merges: Vec<(String, String)> = string_array(md, "tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| tok_err(format!("merge '{m}' has no space")))
        })
        .collect::<Result<_>>()?;
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(false)
        .build()
        .map_err(tok_err)
}

/// Control tokens become special added tokens, user-defined ones plain added tokens, so both
/// are matched whole in the input text.
fn add_marked_tokens(tokenizer: &mut Tokenizer, md: &HashMap<String, Value>, tokens: &[&str]) {
    let Some(Value::Array(types)) = md.get("tokenizer.ggml.token_type") else {
        return;
    };
    let mut special = Vec::new();
    let mut added = Vec::new();
    for (tok, ty) in tokens.iter().zip(types) {
        match ty.to_i32().map(i64::from) {
            Ok(TOKEN_TYPE_CONTROL) => special.push(AddedToken::from(tok.to_string(), true)),
            Ok(TOKEN_TYPE_USER_DEFINED) => {
                added.push(AddedToken::from(tok.to_string(), false).normalized(false))
            }
            _ => {}
        }
    }
    tokenizer.add_special_tokens(&special);
    tokenizer.add_tokens(&added);
}

fn bos_processor(bos_text: &str, bos_id: u32) -> Result<TemplateProcessing> {
    TemplateProcessing::builder()
        .try_single(format!("{bos_text} $A"))
        .map_err(tok_err)?
        .try_pair(format!("{bos_text} $A {bos_text} $B"))
        .map_err(tok_err)?
        .special_tokens(vec![(bos_text.to_string(), bos_id)])
        .build()
        .map_err(tok_err)
}

/// The EOS id plus the end-of-turn markers chat models emit.
pub fn end_ids(tokenizer: &Tokenizer, eos: Option<u32>) -> Vec<u32> {
    let mut ids: Vec<u32> = eos.into_iter().collect();
    for marker in ["<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>"] {
        if let Some(id) = tokenizer.token_to_id(marker) {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    ids
}

/// Streams text out of a growing token sequence. Emits text only once the bytes decoded so far
/// form complete characters, and decodes a short window so the cost per token stays constant.
#[derive(Debug, Default, Clone)]
pub struct IncrementalDecoder {
    tokens: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// The text of the already-emitted window tail and of the whole window.
    fn window(&self, tokenizer: &Tokenizer) -> Result<(String, String)> {
        let prefix = tokenizer
            .decode(&self.tokens[self.prefix_offset..self.read_offset], true)
            .map_err(tok_err)?;
        let full = tokenizer
            .decode(&self.tokens[self.prefix_offset..], true)
            .map_err(tok_err)?;
        Ok((prefix, full))
    }

    /// Adds one token and returns the text it completes (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, token: u32) -> Result<String> {
        self.tokens.push(token);
        let (prefix, full) = self.window(tokenizer)?;
        if full.len() > prefix.len()
            && !full.ends_with('\u{FFFD}')
            && full.is_char_boundary(prefix.len())
        {
            let new = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.tokens.len();
            Ok(new)
        } else {
            Ok(String::new())
        }
    }

    /// Text held back at the end (an incomplete character), decoded lossily.
    pub fn flush(&mut self, tokenizer: &Tokenizer) -> Result<String> {
        let (prefix, full) = self.window(tokenizer)?;
        self.prefix_offset = self.tokens.len();
        self.read_offset = self.tokens.len();
        Ok(full.get(prefix.len()..).unwrap_or_default().to_string())
    }
}
