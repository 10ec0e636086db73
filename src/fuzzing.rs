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

/// A worker's KV-cache event stream as the gateway reads it: the input cut into chunks (each
/// chunk's length from one byte of it), split into events, applied to an exact index for one
/// of three workers (a byte of the event picks which), then a lookup.
pub fn kv_events(data: &[u8]) {
    use crate::gateway::kv_follow::{EventReader, ExactRouting};
    use crate::gateway::kv_index::KvIndex;
    use std::sync::Arc;
    let exact = ExactRouting::new(Arc::new(KvIndex::new()), None);
    let mut reader = EventReader::default();
    let mut rest = data;
    while let Some((&len, tail)) = rest.split_first() {
        let (chunk, next) = tail.split_at((len as usize).min(tail.len()));
        rest = next;
        let Ok(events) = reader.push(chunk) else {
            return;
        };
        for (k, event) in events.into_iter().enumerate() {
            if let Ok(event) = event {
                let _ = exact.apply(u32::from(chunk.get(k).copied().unwrap_or(0) % 3), event);
            }
        }
    }
    let mut views = Vec::new();
    exact.index.view(&[1, 2, 3], &[0, 1, 2], &mut views);
    let _ = exact.index.workers();
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
