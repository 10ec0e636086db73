use super::*;

fn config(kind: HeadKind, hidden: usize) -> HeadConfig {
    match kind {
        HeadKind::R2r => HeadConfig::new(kind, hidden).with_r2r_shape(8, 4, 12, 2),
        _ => HeadConfig::new(kind, hidden),
    }
}

fn inputs(rows: usize, hidden: usize, top: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let f = |n: usize, k: f32| (0..n).map(|i| (i as f32 * k).sin()).collect::<Vec<f32>>();
    (
        f(rows * hidden, 0.37),
        f(rows * hidden, 0.91),
        f(rows * top, 1.7),
    )
}

#[test]
fn every_kind_saves_and_loads_to_the_same_scores() {
    let dir = tempfile::tempdir().unwrap();
    let kinds = [HeadKind::R2r, HeadKind::Citer, HeadKind::CoLlm];
    for (kind, confidence) in kinds.into_iter().flat_map(|k| [(k, 0), (k, 6)]) {
        let config = match confidence {
            0 => config(kind, 6),
            k => config(kind, 6).with_confidence(k).standardized(),
        };
        let (head, vars) = RouterHead::init(config, 3).unwrap();
        let path = dir
            .path()
            .join(format!("{kind:?}-{confidence}.safetensors"));
        head.save(&vars, &path).unwrap();
        let loaded = RouterHead::load(&path, kind, 6).unwrap();
        // The runtime hands a head as many of the largest logits as it asks for.
        let width = if kind == HeadKind::R2r { 8 } else { confidence };
        assert_eq!(loaded.needs().top_logits, width, "{kind:?}");
        assert_eq!(loaded.config, head.config);
        let (h, e, t) = inputs(5, 6, width);
        let batch = HeadInputs {
            rows: 5,
            hidden: &h,
            token_embedding: &e,
            top_logits: &t,
        };
        let (a, b) = (head.scores(&batch).unwrap(), loaded.scores(&batch).unwrap());
        assert_eq!(a.len(), 5);
        assert_eq!(a, b, "{kind:?}");
        assert!(a.iter().all(|s| (0.0..=1.0).contains(s)));
        assert!(loaded.needs().hidden);
    }
}

#[test]
fn the_confidence_is_the_entropy_over_the_top_logits_and_the_top_margin() {
    let top = [[2.0f32, 1.0, 0.5, -1.0], [0.0, 0.0, 0.0, 0.0]];
    let t = Tensor::new(&top, &Device::Cpu).unwrap();
    let features = confidence(&t, 3).unwrap().to_vec2::<f32>().unwrap();
    for (row, got) in top.iter().zip(&features) {
        // Over the first three logits only, in f64.
        let z: f64 = row[..3].iter().map(|&x| (x as f64).exp()).sum();
        let entropy: f64 = row[..3]
            .iter()
            .map(|&x| {
                let p = (x as f64).exp() / z;
                -p * p.ln()
            })
            .sum();
        assert!(
            (got[0] as f64 - entropy).abs() < 1e-5,
            "{got:?} vs {entropy}"
        );
        assert_eq!(got[1], row[0] - row[1]);
    }
    assert!((features[1][0] as f64 - 3f64.ln()).abs() < 1e-6);
}

#[test]
fn init_is_seeded() {
    let (a, _) = RouterHead::init(config(HeadKind::Citer, 4), 9).unwrap();
    let (b, _) = RouterHead::init(config(HeadKind::Citer, 4), 9).unwrap();
    let (h, e, t) = inputs(3, 4, 0);
    let batch = HeadInputs {
        rows: 3,
        hidden: &h,
        token_embedding: &e,
        top_logits: &t,
    };
    assert_eq!(a.scores(&batch).unwrap(), b.scores(&batch).unwrap());
}

#[test]
fn malformed_router_files_get_errors_naming_file_and_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("router.safetensors");
    let (head, vars) = RouterHead::init(config(HeadKind::Citer, 6), 1).unwrap();
    head.save(&vars, &path).unwrap();
    let err = |r: Result<RouterHead, RoutingError>| r.err().expect("refused").to_string();

    let e = err(RouterHead::load(&path, HeadKind::Citer, 8));
    assert!(
        e.contains("router.json") && e.contains("hidden size is 8"),
        "{e}"
    );
    let e = err(RouterHead::load(&path, HeadKind::CoLlm, 6));
    assert!(e.contains("Citer head, not CoLlm"), "{e}");

    // Weights of another shape than the config says.
    let wrong = HeadConfig {
        hidden_size: 7,
        ..config(HeadKind::Citer, 7)
    };
    std::fs::write(
        RouterHead::config_path(&path),
        serde_json::to_string(&wrong).unwrap(),
    )
    .unwrap();
    let e = err(RouterHead::load(&path, HeadKind::Citer, 7));
    assert!(
        e.contains("router.safetensors") && e.contains("shape"),
        "{e}"
    );

    let json = r#"{"kind": "citer", "hidden_size": 6}"#;
    std::fs::write(RouterHead::config_path(&path), json).unwrap();
    let e = err(RouterHead::load(&path, HeadKind::Citer, 6));
    assert!(e.contains("missing field `threshold`"), "{e}");

    std::fs::write(
        RouterHead::config_path(&path),
        r#"{"kind": "r2r", "hidden_size": 6, "threshold": 0.5}"#,
    )
    .unwrap();
    let e = err(RouterHead::load(&path, HeadKind::R2r, 6));
    assert!(e.contains("needs top_k"), "{e}");

    std::fs::write(
        RouterHead::config_path(&path),
        r#"{"kind": "citer", "hidden_size": 6, "threshold": 0.5, "confidence_top_k": 1}"#,
    )
    .unwrap();
    let e = err(RouterHead::load(&path, HeadKind::Citer, 6));
    assert!(
        e.contains("confidence_top_k") && e.contains("two logits"),
        "{e}"
    );

    std::fs::remove_file(RouterHead::config_path(&path)).unwrap();
    let e = err(RouterHead::load(&path, HeadKind::Citer, 6));
    assert!(
        e.contains("router.json") && e.contains("cannot read"),
        "{e}"
    );
    let e = err(RouterHead::load(
        &dir.path().join("none.safetensors"),
        HeadKind::Citer,
        6,
    ));
    assert!(e.contains("none.json"), "{e}");
}
