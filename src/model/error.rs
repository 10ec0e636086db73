//! The model layer's error type: every failure names the file, tensor, key or limit involved so
//! that the CLI and the server can print it as one line.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read model file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("model file {path} is not valid: {reason}")]
    Format { path: PathBuf, reason: String },
    #[error("unsupported architecture '{0}' (supported: llama, qwen2, qwen3)")]
    UnsupportedArchitecture(String),
    #[error("tensor '{tensor}' has unsupported type {dtype} (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K)")]
    UnsupportedQuant { tensor: String, dtype: String },
    #[error("model metadata is missing '{0}'")]
    MissingMetadata(String),
    #[error("model metadata '{key}' is invalid: {reason}")]
    InvalidMetadata { key: String, reason: String },
    #[error("model is missing tensor '{0}'")]
    MissingTensor(String),
    #[error("tensor '{tensor}' has shape {got:?}, expected {expected:?}")]
    Shape {
        tensor: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("sequence needs {needed} positions but the model's context length is {limit}")]
    ContextOverflow { needed: usize, limit: usize },
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("KV cache is full: {needed} more blocks needed, {free} free")]
    OutOfBlocks { needed: usize, free: usize },
    #[error("invalid forward batch: {0}")]
    InvalidBatch(String),
    #[error("{0}")]
    Device(String),
    #[error("invalid sampling parameter {field}: {reason}")]
    InvalidSampling { field: &'static str, reason: String },
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, ModelError>;

impl From<crate::scheduler::OutOfBlocks> for ModelError {
    fn from(e: crate::scheduler::OutOfBlocks) -> Self {
        Self::OutOfBlocks {
            needed: e.needed,
            free: e.available,
        }
    }
}
