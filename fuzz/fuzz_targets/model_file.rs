//! The model loader on a GGUF file or a Hugging Face directory of any bytes.
#![no_main]

use std::sync::OnceLock;

use tokenrouter::fuzzing::ModelFiles;

fn files() -> &'static ModelFiles {
    static FILES: OnceLock<ModelFiles> = OnceLock::new();
    FILES.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("tokenrouter-fuzz-{}", std::process::id()));
        ModelFiles::new(&dir)
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| files().load(data));
