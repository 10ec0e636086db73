//! The tokenizer path on any text and any token ids.
#![no_main]

use std::sync::OnceLock;

use tokenrouter::model::LoadedModel;

fn model() -> &'static LoadedModel {
    static MODEL: OnceLock<LoadedModel> = OnceLock::new();
    MODEL.get_or_init(|| {
        let name = format!("tokenrouter-fuzz-tok-{}.gguf", std::process::id());
        tokenrouter::fuzzing::tiny_model(&std::env::temp_dir().join(name))
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| tokenrouter::fuzzing::tokenizer(model(), data));
