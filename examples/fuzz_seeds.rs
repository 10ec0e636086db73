//! Writes the fuzz targets' seed inputs (`fuzz/seeds/TARGET/`): the tiny random models the
//! tests use, as a GGUF file and as a Hugging Face directory packed the way the `model_file`
//! target reads one, chat templates with messages, and request bodies from the API tests.
//!
//!     cargo run --example fuzz_seeds -- fuzz/seeds

use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use candle_core::DType;
use tokenrouter::model::tiny::{write_gguf, write_hf_dir, TinySpec};
use tokenrouter::model::Architecture;

fn write(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join(name), bytes).unwrap();
}

fn main() {
    let out = PathBuf::from(std::env::args().nth(1).unwrap_or("fuzz/seeds".into()));
    let scratch = tempfile::tempdir().unwrap();
    // Small enough that the fuzzer mutates it quickly, real enough to load.
    let spec = TinySpec {
        hidden_size: 32,
        intermediate_size: 64,
        num_layers: 1,
        num_heads: 2,
        num_kv_heads: 1,
        context_length: 64,
        ..TinySpec::new(Architecture::Qwen2)
    };
    let gguf = scratch.path().join("tiny.gguf");
    write_gguf(&spec, &gguf, &[GgmlDType::Q8_0, GgmlDType::F32]).unwrap();
    let models = out.join("model_file");
    write(&models, "tiny-qwen2.gguf", &std::fs::read(&gguf).unwrap());
    let hf = scratch.path().join("hf");
    write_hf_dir(&spec, &hf, DType::F16).unwrap();
    let mut packed = std::fs::read(hf.join("config.json")).unwrap();
    packed.push(0);
    packed.extend(std::fs::read(hf.join("model.safetensors")).unwrap());
    write(&models, "tiny-qwen2-hf", &packed);

    let templates = out.join("chat_template");
    let chatml = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let llama = "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}<<SYS>>{{ m.content | trim }}<</SYS>>{% elif loop.index0 % 2 == 1 %}[INST] {{ m.content }} [/INST]{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}";
    for (name, source) in [("chatml", chatml), ("llama", llama)] {
        write(
            &templates,
            name,
            format!("{source}\0be brief\0hello\0hi\0more").as_bytes(),
        );
    }

    let requests = out.join("requests");
    let bodies = [
        r#"{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "n": 2, "stop": ["\n"], "seed": 3, "stream": true, "stream_options": {"include_usage": true}}"#,
        r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_completion_tokens": 4, "logit_bias": {"5": -100}, "presence_penalty": 0.5}"#,
        r#"{"prompt": "def f(", "max_tokens": 16, "logprobs": 0, "echo": false, "stop": "x", "frequency_penalty": 1.0}"#,
        r#"{"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": true}"#,
        r#"{"text": "hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0, "top_k": 5, "stop": ["."]}, "stream": true}"#,
        r#"{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}"#,
    ];
    for (i, body) in bodies.iter().enumerate() {
        write(&requests, &format!("body-{i}.json"), body.as_bytes());
    }
    let tokens = out.join("tokenizer");
    write(
        &tokens,
        "text",
        "Hello, world! <|im_end|> é ü 日本 \u{1F600}\n\tdef f(x): return x".as_bytes(),
    );
    // A worker's event stream: a snapshot, stores and a removal, a keep-alive, then a gap;
    // cut into chunks of 40 bytes, each after its length.
    let check = tokenrouter::scheduler::hash_check();
    let stream = format!(
        "event: snapshot\ndata: {{\"type\":\"snapshot\",\"instance\":\"a\",\"model\":\"m\",\
         \"block_size\":16,\"capacity\":64,\"hash_check\":{check},\"seq\":2,\"hashes\":[1,2]}}\n\n\
         event: stored\ndata: {{\"type\":\"stored\",\"seq\":3,\"hashes\":[3]}}\n\n\
         : keepalive\n\n\
         event: removed\ndata: {{\"type\":\"removed\",\"seq\":4,\"hashes\":[1]}}\n\n\
         event: stored\ndata: {{\"type\":\"stored\",\"seq\":9,\"hashes\":[4]}}\n\n"
    );
    let mut framed = Vec::new();
    for chunk in stream.as_bytes().chunks(40) {
        framed.push(chunk.len() as u8);
        framed.extend_from_slice(chunk);
    }
    write(&out.join("kv_events"), "stream", &framed);
    println!("seeds written to {}", out.display());
}
