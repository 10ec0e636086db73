//! The `tokenrouter` binary: generation and benchmarking on a tiny model, and a one-line error
//! with a non-zero exit (never a panic) for every kind of bad model file or input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use tokenrouter::model::tiny::{write_gguf, TinySpec};
use tokenrouter::model::Architecture;

fn command() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tokenrouter"));
    command.env("RUST_LOG", "error");
    command
}

fn tokenrouter(args: &[&str]) -> Output {
    command().args(args).output().unwrap()
}

/// `tokenrouter generate --model MODEL --prompt PROMPT EXTRA...`.
fn generate(model: impl AsRef<std::ffi::OsStr>, prompt: &str, extra: &[&str]) -> Output {
    command()
        .arg("generate")
        .arg("--model")
        .arg(model)
        .args(["--prompt", prompt])
        .args(extra)
        .output()
        .unwrap()
}

fn tiny(dir: &Path) -> PathBuf {
    let path = dir.join("tiny.gguf");
    write_gguf(
        &TinySpec::new(Architecture::Qwen2),
        &path,
        &[GgmlDType::Q8_0, GgmlDType::Q4_0],
    )
    .unwrap();
    path
}

/// Asserts a clean failure: non-zero exit, one `error:` line mentioning `needle`, no panic.
fn assert_fails_with(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "expected failure, got success; stderr: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "panicked: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line, got: {stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    assert!(
        lines[0].to_lowercase().contains(&needle.to_lowercase()),
        "error should mention {needle:?}: {stderr}"
    );
}

#[test]
fn generate_streams_text_and_reports_throughput() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let out = generate(&model, "the cat", &["--max-tokens", "8", "--chat"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("prefill:") && stderr.contains("decode:"),
        "{stderr}"
    );
    assert!(!out.stdout.is_empty());
}

#[test]
fn seeded_sampling_is_reproducible_from_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let run = |seed: &str| {
        let out = generate(
            &model,
            "and the",
            &["--max-tokens", "16", "--temperature", "1.0", "--seed", seed],
        );
        assert!(out.status.success());
        out.stdout
    };
    assert_eq!(run("7"), run("7"));
}

/// `bench-model` with `--breakdown` on a tiny model, 8-token prompts and 4 decode steps, at
/// `batch`, and `extra` flags: its stdout (the run must succeed).
fn bench_model_stdout(batch: &str, extra: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let mut args = vec![
        "bench-model",
        "--model",
        model.to_str().unwrap(),
        "--batch",
        batch,
        "--prompt-len",
        "8",
        "--decode-steps",
        "4",
        "--breakdown",
    ];
    args.extend_from_slice(extra);
    let out = tokenrouter(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn bench_model_refuses_a_prefill_to_compare_without_extends() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let model = model.to_str().unwrap();
    let out = tokenrouter(&["bench-model", "--model", model, "--against-prefill", "64"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("give --extend too"), "{stderr}");
}

#[test]
fn bench_model_prints_a_table_with_its_header_and_breakdown() {
    let stdout = bench_model_stdout("2", &[]);
    let has = |text: &str| stdout.lines().any(|l| l.contains(text));
    assert!(has("MB of weights streamed per decode step"), "{stdout}");
    // The read buffer alone fills a huge-page region where there are regions.
    if cfg!(all(target_os = "linux", target_arch = "x86_64")) {
        assert!(has("2 MB pages back"), "{stdout}");
    }
    // batch, prefill, decode, read GB/s, roofline, % of roofline: numbers all.
    let row: Vec<&str> = stdout
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|w| w.len() == 6 && w[0] == "2")
        .unwrap_or_else(|| panic!("no batch-2 row in {stdout}"));
    for value in &row {
        let number = value.trim_end_matches('%').parse::<f64>();
        assert!(number.is_ok_and(|n| n >= 0.0), "{value} in {row:?}");
    }
    for part in [
        "matmuls",
        "attention",
        "adds and norms",
        "rotary and K/V write",
        "SiLU",
    ] {
        assert!(has(part), "{part} in {stdout}");
    }
    // The prefill's line and the decode step's, each followed by its projections' line.
    for pass in ["prefill:", "decode step:"] {
        assert!(has(pass), "{pass} in {stdout}");
    }
    let projections: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains("the layers' matmuls:"))
        .collect();
    assert_eq!(projections.len(), 2, "{stdout}");
    for line in projections {
        for name in ["q/k/v", "o", "gate/up", "down"] {
            assert!(line.contains(&format!(" {name} ")), "{name} in {line}");
        }
    }
    // The prefill's multiply-adds are read against the inner product's peak where the
    // kernels have a SIMD path.
    if cfg!(target_arch = "x86_64") && std::arch::is_x86_feature_detected!("avx2") {
        assert!(has("peak of the kernels' inner product"), "{stdout}");
        assert!(has("% of peak)"), "{stdout}");
    }
}

#[test]
fn bench_model_prints_json_lines() {
    let stdout = bench_model_stdout(
        "1,3",
        &["--json", "--extend", "4", "--against-prefill", "40"],
    );
    let rows: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2);
    for (row, batch) in rows.iter().zip([1, 3]) {
        assert_eq!(row["batch"], batch);
        assert_eq!(row["model"], "tiny.gguf");
        for key in [
            "prefill_tok_s",
            "decode_tok_s",
            "roofline_tok_s",
            "roofline_fraction",
            "read_gb_s",
            "extend_tok_s",
            "against_prefill_tok_s",
            "extend_over_prefill",
        ] {
            assert!(row[key].as_f64().unwrap() > 0.0, "{key} in {row}");
        }
        // The decode steps' time split into parts: shares of one whole, the LM head among
        // the matmuls.
        let part = |k: &str| row["breakdown"][k].as_f64().unwrap();
        let parts = [
            "matmul",
            "attention",
            "add_norm",
            "rotary_kv_write",
            "activation",
            "other",
        ];
        let whole: f64 = parts.iter().map(|&k| part(k)).sum();
        assert!((whole - 1.0).abs() < 1e-9, "{row}");
        for k in &parts[..5] {
            assert!(part(k) > 0.0, "{k} in {row}");
        }
        assert!(
            part("lm_head") > 0.0 && part("lm_head") < part("matmul"),
            "{row}"
        );
        // Every step reads the layers' weights and the LM head's, so the rate over all the
        // matmuls lies between the two parts' own.
        let (all, layers, head) = (
            part("matmul_gb_s"),
            part("layer_matmul_gb_s"),
            part("lm_head_gb_s"),
        );
        assert!(layers > 0.0 && head > 0.0, "{row}");
        let close = |a: f64, b: f64| a >= b * (1.0 - 1e-9);
        assert!(
            close(all, layers.min(head)) && close(layers.max(head), all),
            "{row}"
        );
        // The layers' projections, each timed around its matmuls: together at least the
        // layers' matmul time, each with weights streamed.
        let projections = &row["breakdown"]["projections"];
        let mut shares = 0.0;
        for key in ["qkv", "attn_out", "gate_up", "down"] {
            let (share, gb_s) = (
                projections[key]["share"].as_f64().unwrap(),
                projections[key]["gb_s"].as_f64().unwrap(),
            );
            assert!(share > 0.0 && gb_s > 0.0, "{key} in {row}");
            shares += share;
        }
        assert!(
            close(shares, part("matmul") - part("lm_head")),
            "{shares} in {row}"
        );
        // The prefill's time split the same way, its matmuls' rate in multiply-adds a second.
        let prefill = &row["prefill_breakdown"];
        let part = |k: &str| prefill[k].as_f64().unwrap();
        let whole: f64 = parts.iter().map(|&k| part(k)).sum();
        assert!((whole - 1.0).abs() < 1e-9, "{row}");
        assert!(
            part("matmul") > 0.0 && part("layer_macs_per_s") > 0.0,
            "{row}"
        );
        if cfg!(target_arch = "x86_64") && std::arch::is_x86_feature_detected!("avx2") {
            assert!(part("peak_macs_per_s") > 0.0, "{row}");
        }
        let mut shares = 0.0;
        for key in ["qkv", "attn_out", "gate_up", "down"] {
            let each = &prefill["projections"][key];
            let (share, rate) = (
                each["share"].as_f64().unwrap(),
                each["macs_per_s"].as_f64().unwrap(),
            );
            assert!(share > 0.0 && rate > 0.0, "{key} in {row}");
            shares += share;
        }
        assert!(
            close(shares, part("matmul") - part("lm_head")),
            "{shares} in {row}"
        );
    }
}

#[test]
fn the_instruction_set_override_is_checked_and_used() {
    use tokenrouter::kernels::qmatmul::Isa;
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let bench = |isa: Option<&str>| {
        let mut c = command();
        c.args(["bench-model", "--model", model.to_str().unwrap()]);
        c.args([
            "--batch",
            "2",
            "--prompt-len",
            "4",
            "--decode-steps",
            "2",
            "--json",
        ]);
        match isa {
            Some(isa) => c.env("TOKENROUTER_ISA", isa),
            None => c.env_remove("TOKENROUTER_ISA"),
        };
        c.output().unwrap()
    };
    let kernels = |out: Output| {
        let stdout = String::from_utf8(out.stdout).unwrap();
        let row: serde_json::Value = serde_json::from_str(stdout.lines().next().unwrap()).unwrap();
        row["kernels"].as_str().unwrap().to_owned()
    };
    assert_eq!(kernels(bench(Some("scalar"))), "scalar");
    let fastest = Isa::available().last().unwrap().name();
    assert_eq!(kernels(bench(None)), fastest);
    assert_fails_with(&bench(Some("avx3")), "'avx3' is not one of scalar");
    if let Some(missing) = Isa::ALL.into_iter().find(|isa| !isa.is_available()) {
        assert_fails_with(&bench(Some(missing.name())), "this CPU lacks it");
    }
}

#[test]
fn missing_model_file_is_a_clear_error() {
    let out = generate("/nonexistent/model.gguf", "hi", &[]);
    assert_fails_with(&out, "/nonexistent/model.gguf");
}

#[test]
fn truncated_model_file_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let bytes = std::fs::read(&model).unwrap();
    std::fs::write(&model, &bytes[..bytes.len() - 1000]).unwrap();
    let out = generate(&model, "hi", &[]);
    assert_fails_with(&out, "truncated");
    // Cut inside the header too.
    std::fs::write(&model, &bytes[..100]).unwrap();
    let out = generate(&model, "hi", &[]);
    assert_fails_with(&out, "tiny.gguf");
}

#[test]
fn corrupt_model_file_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("garbage.gguf");
    std::fs::write(
        &path,
        b"this is not a model at all, just some text that goes on",
    )
    .unwrap();
    let out = generate(&path, "hi", &[]);
    assert_fails_with(&out, "not a GGUF file");
}

fn write_custom_gguf(path: &Path, arch: &str, dtype: GgmlDType) {
    let t = Tensor::zeros((4, 32), candle_core::DType::F32, &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, dtype).unwrap();
    let arch_value = Value::String(arch.into());
    let mut file = std::fs::File::create(path).unwrap();
    gguf_file::write(
        &mut file,
        &[("general.architecture", &arch_value)],
        &[("zz_weight", &q)],
    )
    .unwrap();
}

#[test]
fn unsupported_architecture_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("falcon.gguf");
    write_custom_gguf(&path, "falcon", GgmlDType::Q8_0);
    let out = generate(&path, "hi", &[]);
    assert_fails_with(&out, "unsupported architecture 'falcon'");
}

#[test]
fn unsupported_quant_type_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("iq.gguf");
    write_custom_gguf(&path, "llama", GgmlDType::Q8_0);
    // Rewrite the tensor's type id (Q8_0 = 8) to IQ2_XXS (16), which is not supported.
    let mut bytes = std::fs::read(&path).unwrap();
    let name = b"zz_weight";
    let at = bytes.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    let type_at = at + 4 + 2 * 8; // n_dims (u32), two dims (u64)
    assert_eq!(
        u32::from_le_bytes(bytes[type_at..type_at + 4].try_into().unwrap()),
        8
    );
    bytes[type_at..type_at + 4].copy_from_slice(&16u32.to_le_bytes());
    std::fs::write(&path, bytes).unwrap();
    let out = generate(&path, "hi", &[]);
    assert_fails_with(&out, "ggml type id 16");
}

#[test]
fn prompt_longer_than_the_context_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let prompt = "zq ".repeat(400); // the tiny model's context is 256 positions
    let out = generate(&model, &prompt, &[]);
    assert_fails_with(&out, "do not fit the context of 256 tokens");
}

#[test]
fn invalid_sampling_flag_names_the_parameter() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let out = generate(&model, "hi", &["--top-p", "0"]);
    assert_fails_with(&out, "top_p");
}

#[test]
fn hugging_face_directory_problems_are_clear_errors() {
    use tokenrouter::model::tiny::write_hf_dir;
    let dir = tempfile::tempdir().unwrap();
    let hf = dir.path().join("hf");
    write_hf_dir(
        &TinySpec::new(Architecture::Llama),
        &hf,
        candle_core::DType::F16,
    )
    .unwrap();
    let run = || generate(&hf, "the", &["--max-tokens", "4"]);
    assert!(
        run().status.success(),
        "{}",
        String::from_utf8_lossy(&run().stderr)
    );

    std::fs::write(hf.join("config.json"), "{\"model_type\": \"llama\"").unwrap();
    assert_fails_with(&run(), "config.json");

    std::fs::remove_file(hf.join("model.safetensors")).unwrap();
    assert_fails_with(&run(), "no *.safetensors");
}

#[test]
fn a_configured_model_name_resolves_through_the_config_file() {
    let dir = tempfile::tempdir().unwrap();
    tiny(dir.path());
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        "[[models]]\nname = \"small\"\npath = \"tiny.gguf\"\n",
    )
    .unwrap();
    let cfg = config.to_str().unwrap();
    let out = tokenrouter(&[
        "generate",
        "--config",
        cfg,
        "--model",
        "small",
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = tokenrouter(&[
        "generate", "--config", cfg, "--model", "large", "--prompt", "hi",
    ]);
    assert_fails_with(&out, "names: small");
}

#[test]
fn unavailable_device_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let out = generate(&model, "hi", &["--device", "tpu"]);
    assert_fails_with(&out, "--device 'tpu'");
}

/// A GPU the binary cannot use is a one-line error saying what is missing: the feature in a
/// CPU-only build, the driver on a machine without one.
#[test]
fn an_unusable_gpu_is_a_clear_error() {
    let out = tokenrouter(&[
        "bench-model",
        "--random",
        "qwen2.5-0.5b",
        "--device",
        "cuda:0",
    ]);
    let needle = match cfg!(feature = "cuda") {
        false => "built without the `cuda` feature",
        true => "cuda:0: ",
    };
    assert_fails_with(&out, needle);
    let out = tokenrouter(&["bench-model", "--random", "qwen3-9b"]);
    assert_fails_with(&out, "qwen3-8b");
}

/// A random-weight model of a real shape is measured without a file.
#[test]
fn bench_model_measures_a_random_model_of_a_real_shape() {
    let out = tokenrouter(&[
        "bench-model",
        "--random",
        "qwen2.5-0.5b:q8_0",
        "--batch",
        "1",
        "--prompt-len",
        "4",
        "--decode-steps",
        "2",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8(out.stdout).unwrap();
    let row: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
    assert_eq!(row["model"], "random qwen2.5-0.5b:q8_0");
    assert!(row["decode_tok_s"].as_f64().unwrap() > 0.0, "{row}");
}

/// A config may serve random-weight models of real shapes, with a tokenizer from a file, and
/// route between them with the seeded benchmark router.
#[test]
fn a_config_serves_random_models_routed_by_a_seeded_share() {
    let dir = tempfile::tempdir().unwrap();
    tiny(dir.path());
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        "[[models]]\nname = \"small\"\npath = \"tiny.gguf\"\nrandom = \"qwen2.5-0.5b:q4_0\"\n\
         [[models]]\nname = \"large\"\npath = \"tiny.gguf\"\nrandom = \"qwen2.5-0.5b:q8_0\"\n\
         [routing]\nalgorithm = \"bernoulli\"\np = 0.5\nseed = 1\n",
    )
    .unwrap();
    let cfg = config.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec!["generate", "--config", cfg, "--prompt", "hi"];
        args.extend_from_slice(extra);
        tokenrouter(&args)
    };
    let out = run(&["--max-tokens", "12", "--ignore-eos"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let report = String::from_utf8_lossy(&out.stdout).to_string() + &stderr;
    let per_model = report
        .split("tokens per model: ")
        .nth(1)
        .and_then(|s| s.split(';').next())
        .unwrap_or_else(|| panic!("no per-model counts: {report}"));
    let counts: Vec<usize> = per_model
        .split(", ")
        .map(|part| part.split(' ').nth(1).unwrap().parse().unwrap())
        .collect();
    assert_eq!(counts.iter().sum::<usize>(), 12, "{per_model}");
    assert!(
        counts.iter().all(|&n| n > 0),
        "both models take part: {per_model}"
    );
    if !cfg!(feature = "cuda") {
        let out = run(&["--device", "cuda:0"]);
        assert_fails_with(&out, "this build has no CUDA backend");
    }
}

/// A model of the config that cannot load is one line naming the model, its file and the
/// cause, said once.
#[test]
fn a_configured_model_that_cannot_load_is_named_once() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        "[[models]]\nname = \"small\"\npath = \"missing.gguf\"\n",
    )
    .unwrap();
    let out = tokenrouter(&[
        "generate",
        "--config",
        config.to_str().unwrap(),
        "--prompt",
        "hi",
    ]);
    assert_fails_with(&out, "model 'small'");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.matches("missing.gguf:").count(), 1, "{stderr}");
    assert_eq!(stderr.matches("os error 2").count(), 1, "{stderr}");
}
