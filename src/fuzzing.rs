//! What each fuzz target (`fuzz/`, cargo-fuzz) does with one input, shared with the test that
//! replays every input a target ever failed on (`tests/fuzz_regressions.rs`). Each function
//! must return, whatever the input: an error is a pass, a panic is the finding.

use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device};

use crate::model::tiny::{write_gguf, write_hf_dir, TinySpec};
use crate::model::{Architecture, ChatMessage, ChatTemplate, IncrementalDecoder, LoadedModel};
use crate::server::schema::{parse, ChatRequest, CompletionRequest, GenerateBody};

/// The three request parsers (OpenAI chat and completions, SGLang generate) and the
/// conversion of what they accept into runtime requests.
pub fn requests(body: &[u8]) {
    if let Ok(chat) = ChatRequest::parse(body) {
        let _ = chat.to_request();
    }
    if let Ok(completion) = CompletionRequest::parse(body) {
        let _ = completion.to_request();
    }
    if let Ok(generate) = parse::<GenerateBody>(body) {
        let _ = generate.to_request();
    }
}

/// The chat template renderer: a template from a model file (the input before its first NUL
/// byte) rendering the messages a client sent (one per further NUL-separated part, roles
/// taking turns).
pub fn chat_template(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.split('\0');
    let source = parts.next().unwrap_or_default();
    let roles = ["system", "user", "assistant", "user"];
    let messages: Vec<ChatMessage> = parts
        .zip(roles.iter().cycle())
        .map(|(content, role)| ChatMessage::new(role, content))
        .collect();
    if let Ok(template) = ChatTemplate::new(source, Some("<s>"), Some("</s>")) {
        let _ = template.render(&messages, true);
    }
}

/// Where the model loader is fed: a folder holding a tiny model's tokenizer files, into which
/// each input is written as a model file.
pub struct ModelFiles {
    dir: PathBuf,
}

impl ModelFiles {
    pub fn new(dir: &Path) -> Self {
        let spec = TinySpec::new(Architecture::Qwen2);
        write_hf_dir(&spec, &dir.join("hf"), DType::F32).expect("a tiny model is written");
        Self {
            dir: dir.to_path_buf(),
        }
    }

    /// Loads `data` as a GGUF file or, when it starts with `{`, as a Hugging Face directory
    /// (`config.json` before the first NUL byte, `model.safetensors` after it); a model that
    /// loads encodes and decodes.
    pub fn load(&self, data: &[u8]) {
        let path = match data.iter().position(|&b| b == 0) {
            Some(nul) if data.first() == Some(&b'{') => {
                let hf = self.dir.join("hf");
                std::fs::write(hf.join("config.json"), &data[..nul]).expect("scratch is writable");
                std::fs::write(hf.join("model.safetensors"), &data[nul + 1..])
                    .expect("scratch is writable");
                hf
            }
            _ => {
                let file = self.dir.join("model.gguf");
                std::fs::write(&file, data).expect("scratch is writable");
                file
            }
        };
        if let Ok(model) = LoadedModel::load(&path, &Device::Cpu) {
            if let Ok(ids) = model.encode("fuzz <|im_end|> é") {
                let _ = model.decode(&ids);
            }
        }
    }
}

/// The tiny model whose tokenizer [`tokenizer`] runs on, written to and loaded from `path`.
pub fn tiny_model(path: &Path) -> LoadedModel {
    let spec = TinySpec::new(Architecture::Qwen2);
    write_gguf(&spec, path, &[GgmlDType::F32]).expect("a tiny model is written");
    LoadedModel::load(path, &Device::Cpu).expect("the tiny model loads")
}

/// The tokenizer path: the input encoded as text, and read as token ids (two bytes each,
/// in the vocabulary or not) decoded whole and incrementally, as streams are.
pub fn tokenizer(model: &LoadedModel, data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Ok(ids) = model.encode(&text) {
        let _ = model.decode(&ids);
    }
    let ids: Vec<u32> = data
        .chunks(2)
        .map(|c| u32::from(c[0]) | (u32::from(*c.get(1).unwrap_or(&0)) << 8))
        .collect();
    let _ = model.decode(&ids);
    let mut decoder = IncrementalDecoder::new();
    for &id in &ids {
        let _ = decoder.push(&model.tokenizer, id);
    }
    let _ = decoder.flush(&model.tokenizer);
}
