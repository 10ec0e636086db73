//! Every input a fuzz target ever failed on (`fuzz/regressions/TARGET/`), replayed through what
//! the target runs (`tokenrouter::fuzzing`), and the seeds the targets start from: none may
//! panic, and a model file that does not load is an error naming the file.

use std::path::{Path, PathBuf};

use candle_core::Device;
use tokenrouter::fuzzing;
use tokenrouter::model::LoadedModel;

fn inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut files = Vec::new();
    for kind in ["regressions", "seeds"] {
        let Ok(dir) = std::fs::read_dir(root.join(kind).join(target)) else {
            continue;
        };
        for entry in dir {
            let path = entry.unwrap().path();
            files.push((path.clone(), std::fs::read(&path).unwrap()));
        }
    }
    files.sort();
    assert!(!files.is_empty(), "no inputs for the {target} target");
    files
}

#[test]
fn request_parsers() {
    for (_, body) in inputs("requests") {
        fuzzing::requests(&body);
    }
}

#[test]
fn kv_event_streams() {
    for (_, data) in inputs("kv_events") {
        fuzzing::kv_events(&data);
    }
}

#[test]
fn chat_templates() {
    for (_, data) in inputs("chat_template") {
        fuzzing::chat_template(&data);
    }
}

#[test]
fn the_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let model = fuzzing::tiny_model(&dir.path().join("tiny.gguf"));
    for (_, data) in inputs("tokenizer") {
        fuzzing::tokenizer(&model, &data);
    }
}

#[test]
fn model_files() {
    let dir = tempfile::tempdir().unwrap();
    let files = fuzzing::ModelFiles::new(dir.path());
    for (path, data) in inputs("model_file") {
        files.load(&data);
        if path.parent().unwrap().ends_with("regressions/model_file") && data.first() != Some(&b'{')
        {
            let err = LoadedModel::load(&path, &Device::Cpu)
                .err()
                .expect("a broken file");
            let text = err.to_string();
            assert!(
                text.contains(path.file_name().unwrap().to_str().unwrap()),
                "{text}"
            );
        }
    }
    // The seeds are real models: both load.
    for (path, _) in inputs("model_file")
        .iter()
        .filter(|(p, _)| p.ends_with("tiny-qwen2.gguf"))
    {
        LoadedModel::load(path, &Device::Cpu).unwrap();
    }
}
