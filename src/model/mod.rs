//! Model runtime: loading checkpoints (GGUF kept quantized, Hugging Face safetensors), the
//! Llama-family decoder with a batched forward over a paged KV cache, tokenizer, chat template
//! and sampler. Knows nothing of actors, scheduling policy or HTTP.

pub mod backend;
pub mod batch;
pub mod chat_template;
pub mod config;
pub mod decoder;
pub mod error;
pub mod gguf;
pub mod kv_cache;

pub mod profile;
pub mod random;
pub mod requantize;
pub mod runner;
pub mod safetensors;
pub mod sampler;
pub mod timing;
#[cfg(any(test, feature = "fixtures"))]
pub mod tiny;
pub mod tokenizer;
mod weights;

use std::path::{Path, PathBuf};

use candle_core::Device;
use serde::Deserialize;

pub use batch::SeqInput;
pub use chat_template::{ChatMessage, ChatTemplate};
pub use config::{Architecture, ModelConfig, RopeStyle};
pub use decoder::{ForwardOutput, Model};
pub use error::{ModelError, Result};
pub use kv_cache::{KvCache, KvDtype};
pub use requantize::Quantize;
pub use sampler::{Distribution, Sampler, SamplingParams};
pub use tokenizer::{IncrementalDecoder, SpecialTokens};
pub use weights::{gated_kernel, packed_kernel, MatmulBackend, OwnKernel, Weight, WeightSource};

/// Where a model computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComputeTarget {
    /// The CPU, with these quantized-matmul kernels.
    Cpu(MatmulBackend),
    /// GPU `N` (a build with the `cuda` feature).
    Cuda(usize),
}

/// Which weights a loaded model computes with.
enum Weights<'a, S> {
    /// The checkpoint's own, of this config, read from `S`.
    Own(ModelConfig, S),
    /// Random ones of this shape (see [`random::parse`]).
    Random(&'a str),
}

/// What requests are read and written with: a checkpoint's tokenizer, special ids and chat
/// template, without its weights.
#[derive(Clone)]
pub struct Vocabulary {
    pub tokenizer: tokenizers::Tokenizer,
    pub special: SpecialTokens,
    pub chat_template: Option<ChatTemplate>,
}

/// Everything one checkpoint provides: weights, tokenizer, special ids and chat template.
pub struct LoadedModel {
    pub model: Model,
    pub tokenizer: tokenizers::Tokenizer,
    pub special: SpecialTokens,
    pub chat_template: Option<ChatTemplate>,
    pub path: PathBuf,
}

impl LoadedModel {
    /// Loads a GGUF file, or a Hugging Face directory with `config.json` and safetensors.
    pub fn load(path: &Path, device: &Device) -> Result<Self> {
        Self::load_with(path, device, MatmulBackend::default())
    }

    /// Loads with an explicit choice of quantized-matmul kernels.
    pub fn load_with(path: &Path, device: &Device, backend: MatmulBackend) -> Result<Self> {
        Self::load_from(path, device, ComputeTarget::Cpu(backend), None, None)
    }

    /// Loads onto `target`: the file is read into host memory, then its weights are made
    /// ready for the target's kernels (repacked for the CPU's, uploaded as stored to a GPU).
    pub fn load_on(path: &Path, target: ComputeTarget) -> Result<Self> {
        Self::load_from(path, &Device::Cpu, target, None, None)
    }

    /// Loads onto `target` as [`Self::load_on`] does, with the layer matrices quantized to
    /// `quantize` where that stores them in fewer bits ([`requantize`]).
    pub fn load_quantized(
        path: &Path,
        target: ComputeTarget,
        quantize: Option<Quantize>,
    ) -> Result<Self> {
        Self::load_from(path, &Device::Cpu, target, None, quantize)
    }

    /// A random-weight model of shape `random` (`NAME[:FORMAT]`, see [`random::parse`]) on
    /// `target`, with the tokenizer, special tokens and chat template of `path` (a GGUF file,
    /// whose tensors are not read, or a Hugging Face directory): for speed runs at a published
    /// model's size without its weights.
    pub fn load_random(path: &Path, random: &str, target: ComputeTarget) -> Result<Self> {
        Self::load_from(path, &Device::Cpu, target, Some(random), None)
    }

    /// Drafts from the first `n` token ids only ([`Model::set_draft_vocab`]), reading that
    /// part of the LM head again from the file the model was loaded from.
    pub fn set_draft_vocab(&mut self, n: usize) -> Result<()> {
        let device = Device::Cpu;
        if self.path.is_dir() {
            let mut src = safetensors::SafetensorsDir::open(&self.path, &device)?;
            self.model.set_draft_vocab(n, &mut src)
        } else {
            let mut src = gguf::GgufFile::open(&self.path, &device)?;
            self.model.set_draft_vocab(n, &mut src)
        }
    }

    fn load_from(
        path: &Path,
        device: &Device,
        target: ComputeTarget,
        random: Option<&str>,
        quantize: Option<Quantize>,
    ) -> Result<Self> {
        let meta = std::fs::metadata(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        if meta.is_dir() {
            Self::load_hf_dir(path, device, target, random, quantize)
        } else {
            Self::load_gguf(path, device, target, random, quantize)
        }
    }

    /// Random weights of shape `spec` on `target`, for a tokenizer of `vocab` tokens.
    fn random_weights(spec: &str, vocab: usize, target: ComputeTarget) -> Result<Model> {
        let (config, dtype) = random::parse(spec)?;
        if config.vocab_size < vocab {
            return Err(ModelError::Device(format!(
                "random model '{spec}' has {} embeddings but the tokenizer has {vocab} tokens",
                config.vocab_size
            )));
        }
        let mut weights = random::RandomSource::new(&config, dtype, 0);
        Model::load_on(config, &mut weights, target)
    }

    fn load_gguf(
        path: &Path,
        device: &Device,
        target: ComputeTarget,
        random: Option<&str>,
        quantize: Option<Quantize>,
    ) -> Result<Self> {
        let mut file = gguf::GgufFile::open(path, device)?;
        // With its own weights, the file's config is checked first: a wrong architecture is
        // the error to report.
        let weights = match random {
            Some(spec) => Weights::Random(spec),
            None => Weights::Own(file.config()?, ()),
        };
        let md = file.metadata();
        let json_path = path.with_file_name("tokenizer.json");
        let (tokenizer, special) = if json_path.is_file() {
            let (_, mut special) = tokenizer::from_gguf_metadata(md)?;
            let json = tokenizers::Tokenizer::from_file(&json_path)
                .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", json_path.display())))?;
            special.eos = tokenizer::end_ids(&json, special.eos.first().copied());
            (json, special)
        } else {
            tokenizer::from_gguf_metadata(md)?
        };
        let chat_template = match md.get("tokenizer.chat_template") {
            Some(v) => Some(ChatTemplate::new(
                v.to_string()
                    .map_err(|e| ModelError::Template(e.to_string()))?,
                special.bos_text.as_deref(),
                special.eos_text.as_deref(),
            )?),
            None => None,
        };
        let model = match weights {
            Weights::Own(config, ()) => {
                let mut src = requantize::Requantized {
                    inner: &mut file,
                    to: quantize,
                };
                Model::load_on(config, &mut src, target)?
            }
            Weights::Random(spec) => {
                Self::random_weights(spec, tokenizer.get_vocab_size(true), target)?
            }
        };
        Ok(Self {
            model,
            tokenizer,
            special,
            chat_template,
            path: path.to_path_buf(),
        })
    }

    fn load_hf_dir(
        dir: &Path,
        device: &Device,
        target: ComputeTarget,
        random: Option<&str>,
        quantize: Option<Quantize>,
    ) -> Result<Self> {
        // Random weights read only the tokenizer files.
        let weights = match random {
            Some(spec) => Weights::Random(spec),
            None => {
                let st = safetensors::SafetensorsDir::open(dir, device)?;
                Weights::Own(st.config()?, st)
            }
        };
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = tokenizers::Tokenizer::from_file(&tok_path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", tok_path.display())))?;
        let tc: TokenizerConfig = match dir.join("tokenizer_config.json") {
            p if p.is_file() => safetensors::read_json(&p)?,
            _ => TokenizerConfig::default(),
        };
        let bos_text = tc.bos_token.as_ref().map(|t| t.text().to_string());
        let eos_text = tc.eos_token.as_ref().map(|t| t.text().to_string());
        let id_of = |t: &Option<String>| t.as_deref().and_then(|s| tokenizer.token_to_id(s));
        let special = SpecialTokens {
            bos: id_of(&bos_text),
            eos: tokenizer::end_ids(&tokenizer, id_of(&eos_text)),
            bos_text: bos_text.clone(),
            eos_text: eos_text.clone(),
        };
        let chat_template = match tc.chat_template {
            Some(src) => Some(ChatTemplate::new(
                &src,
                bos_text.as_deref(),
                eos_text.as_deref(),
            )?),
            None => None,
        };
        let model = match weights {
            Weights::Own(config, mut st) => {
                let mut src = requantize::Requantized {
                    inner: &mut st,
                    to: quantize,
                };
                Model::load_on(config, &mut src, target)?
            }
            Weights::Random(spec) => {
                Self::random_weights(spec, tokenizer.get_vocab_size(true), target)?
            }
        };
        Ok(Self {
            model,
            tokenizer,
            special,
            chat_template,
            path: dir.to_path_buf(),
        })
    }

    /// Tokenizes `text` (special tokens written in the text are recognised).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn vocabulary(&self) -> Vocabulary {
        Vocabulary {
            tokenizer: self.tokenizer.clone(),
            special: self.special.clone(),
            chat_template: self.chat_template.clone(),
        }
    }

    /// Renders `messages` with the checkpoint's chat template and tokenizes the result.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or_else(|| ModelError::Template("the model has no chat template".into()))?;
        self.encode(&template.render(messages, true)?)
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))
    }
}

#[derive(Debug, Default, Deserialize)]
struct TokenizerConfig {
    chat_template: Option<String>,
    bos_token: Option<TokenText>,
    eos_token: Option<TokenText>,
}

/// `tokenizer_config.json` writes special tokens as a string or as `{"content": ...}`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum TokenText {
    Plain(String),
    Added { content: String },
}

impl TokenText {
    fn text(&self) -> &str {
        match self {
            Self::Plain(s) | Self::Added { content: s } => s,
        }
    }
}
