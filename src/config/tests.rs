use super::*;

fn load_str(text: &str) -> Result<Config, ConfigError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.toml");
    std::fs::write(&path, text).unwrap();
    Config::load(&path)
}

#[test]
fn relative_model_paths_resolve_against_the_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.toml");
    std::fs::write(&path, "[[models]]\nname = \"slm\"\npath = \"m/a.gguf\"\n").unwrap();
    let config = Config::load(&path).unwrap();
    assert_eq!(
        config.model("slm").unwrap().path,
        dir.path().join("m/a.gguf")
    );
    assert_eq!(config.kv_cache.block_size, 16);
    assert_eq!(config.kv_cache.dtype, KvDtype::F16);
}

#[test]
fn kv_cache_dtype_parses_and_bad_values_are_named() {
    let base = "[[models]]\nname = \"a\"\npath = \"x\"\n[kv_cache]\n";
    let config = load_str(&format!("{base}dtype = \"f32\"\n")).unwrap();
    assert_eq!(config.kv_cache.dtype, KvDtype::F32);
    let err = load_str(&format!("{base}dtype = \"f8\"\n")).unwrap_err();
    assert!(err.to_string().contains("f8"), "{err}");
}

#[test]
fn unknown_keys_are_rejected_by_name() {
    let err = load_str("[[models]]\nname = \"a\"\npath = \"x\"\nquant = \"q4\"\n").unwrap_err();
    assert!(err.to_string().contains("quant"), "{err}");
}

#[test]
fn duplicate_names_and_bad_block_sizes_are_rejected() {
    let err = load_str(
        "[[models]]\nname = \"a\"\npath = \"x\"\n[[models]]\nname = \"a\"\npath = \"y\"\n",
    )
    .unwrap_err();
    assert!(err.to_string().contains("used twice"), "{err}");
    let err = load_str("[[models]]\nname = \"a\"\npath = \"x\"\n[kv_cache]\nblock_size = 0\n")
        .unwrap_err();
    assert!(err.to_string().contains("kv_cache.block_size"), "{err}");
}

#[test]
fn routing_sections_parse_and_are_checked() {
    let two = "[[models]]\nname = \"a\"\npath = \"x\"\n[[models]]\nname = \"b\"\npath = \"y\"\n";
    let config = load_str(&format!(
        "{two}[routing]\nalgorithm = \"r-stitch\"\nhigh = 2.0\nlow = 0.5\n"
    ))
    .unwrap();
    assert_eq!(
        config.routing,
        RoutingConfig::RStitch {
            high: 2.0,
            low: 0.5
        }
    );
    assert_eq!(config.role_index(Role::Llm), Some(1));
    let err = load_str(&format!(
        "{two}[routing]\nalgorithm = \"entropy\"\nthreshold = 1.0\nhigh = 3.0\n"
    ))
    .unwrap_err();
    assert!(err.to_string().contains("high"), "{err}");
    let err = load_str(&format!("{two}[routing]\nalgorithm = \"magic\"\n")).unwrap_err();
    assert!(err.to_string().contains("magic"), "{err}");
    let one = "[[models]]\nname = \"a\"\npath = \"x\"\n";
    let err = load_str(&format!(
        "{one}[routing]\nalgorithm = \"entropy\"\nthreshold = 1.0\n"
    ))
    .unwrap_err();
    assert!(err.to_string().contains("role"), "{err}");
    let err = load_str(&format!("{two}[scheduler]\nmode = \"lockstep\"\n")).unwrap_err();
    assert!(err.to_string().contains("lockstep"), "{err}");
}

#[test]
fn learned_ensemble_and_query_level_sections_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.toml");
    let two = "[[models]]\nname = \"a\"\npath = \"x\"\n[[models]]\nname = \"b\"\npath = \"y\"\n";
    let r2r = format!("{two}[routing]\nalgorithm = \"r2r\"\nrouter = \"r/h.safetensors\"\n");
    std::fs::write(&path, r2r).unwrap();
    let mut config = Config::load(&path).unwrap();
    assert_eq!(
        config.routing.router_path().cloned(),
        Some(dir.path().join("r/h.safetensors"))
    );
    let bad = [
        (
            "algorithm = \"co-llm\"\nrouter = \"h\"\nthreshold = 1.5",
            "[0, 1]",
        ),
        ("algorithm = \"r2r\"\nrouter = \"h\"\nshare = 1.0", "(0, 1)"),
        (
            "algorithm = \"citer\"\nrouter = \"h\"\nshare = 0.1\nthreshold = 0.5",
            "set one of them",
        ),
        (
            "algorithm = \"ensemble\"\nweights = [1.0]",
            "one positive weight per model",
        ),
        ("algorithm = \"ensemble\"\nweights = [1.0, 0.0]", "positive"),
        (
            "algorithm = \"query-level\"\nrule = \"fraction\"\nthreshold = 2.0",
            "share",
        ),
        (
            "algorithm = \"query-level\"\nrule = \"vibes\"\nthreshold = 2.0",
            "vibes",
        ),
        ("algorithm = \"citer\"", "router"),
        ("algorithm = \"bernoulli\"\np = 1.5", "routing.p = 1.5"),
        ("algorithm = \"bernoulli\"", "missing field `p`"),
        (
            "algorithm = \"speculative\"\ndraft_tokens = 0",
            "routing.draft_tokens = 0",
        ),
        (
            "algorithm = \"speculative\"\ndraft_tokens = 17",
            "draft 1 to 16 tokens",
        ),
        (
            "algorithm = \"speculative\"\ndraft_tokens = \"many\"",
            "a number of tokens or \"auto\"",
        ),
        (
            "algorithm = \"speculative\"\ndraft_vocab = 0",
            "routing.draft_vocab = 0",
        ),
    ];
    for (routing, needle) in bad {
        let err = load_str(&format!("{two}[routing]\n{routing}\n")).unwrap_err();
        assert!(err.to_string().contains(needle), "{routing}: {err}");
    }
    let ok = load_str(&format!(
        "{two}[routing]\nalgorithm = \"ensemble\"\nweights = [1.0, 2.0]\n"
    ));
    assert!(ok.is_ok());
    let bernoulli = load_str(&format!(
        "{two}[routing]\nalgorithm = \"bernoulli\"\np = 0.1\nseed = 7\n"
    ))
    .unwrap();
    assert_eq!(
        bernoulli.routing,
        RoutingConfig::Bernoulli { p: 0.1, seed: 7 }
    );
    for (value, want) in [
        ("", DraftTokens::Auto),
        ("draft_tokens = \"auto\"\n", DraftTokens::Auto),
        ("draft_tokens = 5\n", DraftTokens::Fixed(5)),
    ] {
        let config = load_str(&format!(
            "{two}[routing]\nalgorithm = \"speculative\"\n{value}"
        ))
        .unwrap();
        assert_eq!(
            config.routing,
            RoutingConfig::Speculative {
                draft_tokens: want,
                draft_vocab: None
            }
        );
    }
    let err = load_str(&format!(
        "{two}[routing]\nalgorithm = \"speculative\"\n[scheduler]\nmax_batch_tokens = 1\n"
    ))
    .unwrap_err();
    assert!(
        err.to_string().contains("max_batch_tokens to at least 2"),
        "{err}"
    );
}

#[test]
fn the_shipped_configs_are_valid() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = Config::load(&root.join("config.toml")).unwrap();
    assert!(config.model("slm").is_some() && config.model("llm").is_some());
    for entry in std::fs::read_dir(root.join("configs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let config = Config::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(!config.models.is_empty(), "{}", path.display());
        }
    }
}

#[test]
fn overlapping_devices_and_missing_backends_are_rejected() {
    let two = |a: &str, b: &str| {
        format!(
            "[[models]]\nname = \"a\"\npath = \"a.gguf\"\ndevice = \"{a}\"\n\
             [[models]]\nname = \"b\"\npath = \"b.gguf\"\ndevice = \"{b}\"\n"
        )
    };
    assert!(load_str(&two("cpu", "cpu")).is_ok());
    assert!(load_str(&two("cpu:0", "cpu:1")).is_ok());
    let err = load_str(&two("cpu", "cpu:1")).unwrap_err().to_string();
    assert!(err.contains("share cores"), "{err}");
    // The SLM on the CPU and the LLM on a GPU, in a build that has a GPU backend.
    let mixed = load_str(&two("cpu:0-1", "cuda:0"));
    assert_eq!(mixed.is_ok(), cfg!(feature = "cuda"));
    if let Err(e) = mixed {
        assert!(
            e.to_string().contains("this build has no CUDA backend"),
            "{e}"
        );
    }
    assert_eq!(
        load_str(&two("cuda:0", "cuda:1")).is_ok(),
        cfg!(feature = "cuda")
    );
    // A GPU keeps its KV cache in f16.
    let f32_kv = format!("{}[kv_cache]\ndtype = \"f32\"\n", two("cpu:0", "cuda:0"));
    let err = load_str(&f32_kv).unwrap_err().to_string();
    let needle = match cfg!(feature = "cuda") {
        true => "set kv_cache.dtype = \"f16\"",
        false => "this build has no CUDA backend",
    };
    assert!(err.contains(needle), "{err}");
    let err = load_str(&two("tpu", "cpu")).unwrap_err().to_string();
    assert!(err.contains("device \"tpu\""), "{err}");
}

#[test]
fn random_weights_name_a_known_shape() {
    let one = |random: &str| {
        format!("[[models]]\nname = \"a\"\npath = \"vocab.gguf\"\nrandom = \"{random}\"\n")
    };
    let config = load_str(&one("qwen3-32b:q4_k")).unwrap();
    assert_eq!(config.models[0].random.as_deref(), Some("qwen3-32b:q4_k"));
    let err = load_str(&one("qwen9-1t")).unwrap_err().to_string();
    assert!(
        err.contains("models[0].random = \"qwen9-1t\"") && err.contains("qwen3-0.6b"),
        "{err}"
    );
    let err = load_str(&one("qwen3-8b:q3_k")).unwrap_err().to_string();
    assert!(err.contains("q3_k"), "{err}");
    let err = load_str(&format!("{}quantize = \"q4_0\"\n", one("qwen3-8b")))
        .unwrap_err()
        .to_string();
    assert!(err.contains("NAME:FORMAT"), "{err}");
}

#[test]
fn quantize_names_a_format_our_kernels_multiply() {
    let one =
        |q: &str| format!("[[models]]\nname = \"a\"\npath = \"a.gguf\"\nquantize = \"{q}\"\n");
    let config = load_str(&one("q4_1")).unwrap();
    assert_eq!(
        config.models[0].quantize,
        Some(crate::model::Quantize::Q4_1)
    );
    let err = load_str(&one("q3_k")).unwrap_err().to_string();
    assert!(err.contains("q3_k") && err.contains("q4_k"), "{err}");
}

#[test]
fn remote_models_need_an_address_and_a_secret() {
    let slm = "[[models]]\nname = \"slm\"\npath = \"s.gguf\"\n[[models]]\nname = \"llm\"\n";
    let config = load_str(&format!(
        "{slm}remote = \"10.0.0.2:7100\"\nsecret_file = \"key\"\n"
    ))
    .unwrap();
    let llm = config.model("llm").unwrap();
    assert_eq!(llm.remote.as_deref(), Some("10.0.0.2:7100"));
    assert!(llm.path.as_os_str().is_empty());
    assert!(llm.secret_file.as_ref().unwrap().is_absolute());
    assert!(config.require_local("tune").unwrap_err().contains("'llm'"));
    let err = |extra: &str| load_str(&format!("{slm}{extra}")).unwrap_err().to_string();
    assert!(err("").contains("has no path"));
    assert!(err("remote = \"10.0.0.2:7100\"\n").contains("secret_file"));
    assert!(err("remote = \"10.0.0.2\"\nsecret_file = \"k\"\n").contains("HOST:PORT"));
    // A client certificate stands in for the secret; its parts come together.
    let tls = "remote = \"10.0.0.2:7100\"\ntls_ca = \"ca.pem\"\n";
    let config = load_str(&format!(
        "{slm}{tls}tls_cert = \"c.pem\"\ntls_key = \"k.pem\"\n"
    ))
    .unwrap();
    let llm = config.model("llm").unwrap();
    assert!(llm.secret_file.is_none());
    assert!(llm.tls_key.as_ref().unwrap().is_absolute());
    assert!(err(&format!("{tls}tls_cert = \"c.pem\"\n")).contains("go together"));
    assert!(err("remote = \"h:1\"\ntls_cert = \"c\"\ntls_key = \"k\"\n").contains("tls_ca"));
    assert!(err(tls).contains("secret_file (or tls_ca, tls_cert and tls_key)"));
    assert!(err("path = \"l.gguf\"\nsecret_file = \"k\"\n").contains("`remote` model"));
}

#[test]
fn keep_alive_is_a_positive_number_of_seconds() {
    let one = "[[models]]\nname = \"m\"\npath = \"m.gguf\"\n";
    let config = load_str(&format!("{one}[server]\nkeep_alive_s = 120\n")).unwrap();
    assert_eq!(config.server.keep_alive_s, 120.0);
    assert_eq!(load_str(one).unwrap().server.keep_alive_s, 5.0);
    for bad in ["0", "-1", "nan", "1e9"] {
        let err = load_str(&format!("{one}[server]\nkeep_alive_s = {bad}\n")).unwrap_err();
        assert!(err.to_string().contains("keep_alive_s"), "{bad}: {err}");
    }
}

#[test]
fn gpu_memory_utilization_is_a_fraction() {
    let one =
        |memory: &str| format!("[[models]]\nname = \"a\"\npath = \"x\"\n[memory]\n{memory}\n");
    let config = load_str(&one("gpu_memory_utilization = 0.5")).unwrap();
    assert_eq!(config.memory.gpu_memory_utilization, 0.5);
    assert_eq!(
        load_str(&one("")).unwrap().memory.gpu_memory_utilization,
        0.9
    );
    for bad in ["0", "1.5", "-0.2", "nan"] {
        let err = load_str(&one(&format!("gpu_memory_utilization = {bad}")))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("memory.gpu_memory_utilization"),
            "{bad}: {err}"
        );
    }
}
