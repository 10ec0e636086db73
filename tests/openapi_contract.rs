//! The server's OpenAPI document (`GET /openapi.json`) against the real server, checked by
//! schemathesis (PyPI package `schemathesis`): requests generated from the document, valid
//! and invalid, are never answered with a 5xx, invalid ones are refused with a 4xx, and every
//! response has a documented status, content type and body.
//! Needs `python3 -m pip install schemathesis` (the CI script installs it).

mod common;

use std::process::Command;

use common::server::TestServer;

/// Generated requests per operation and phase; seeded, so every run sends the same ones.
const EXAMPLES: &str = "100";

#[test]
fn schemathesis_finds_no_server_error_and_no_schema_violation() {
    let probe = Command::new("st").arg("--version").output();
    assert!(
        probe.is_ok_and(|o| o.status.success()),
        "schemathesis is missing: run `python3 -m pip install schemathesis`"
    );
    // Short generations keep the run bounded; the limits still accept every request the
    // document allows (longer ones end at the context with `length`).
    let server = TestServer::start("[server]\nmax_requests = 64\n", &[]);
    let url = format!("http://127.0.0.1:{}/openapi.json", server.port);
    let report = tempfile::tempdir().unwrap();
    let out = Command::new("st")
        .args(["run", &url, "--seed", "7", "--max-examples", EXAMPLES])
        .args(["--workers", "2", "--request-timeout", "60", "--no-shrink"])
        .args(["--phases", "examples,coverage,fuzzing"])
        // The KV-cache event stream never ends, so no request-response check can read it;
        // tests/kv_events.rs checks it.
        .args(["--exclude-path", "/cache/events"])
        .args([
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,\
             response_schema_conformance,negative_data_rejection",
        ])
        .args(["--report", "junit", "--report-junit-path"])
        .arg(report.path().join("junit.xml"))
        .env("NO_COLOR", "1")
        // schemathesis keeps a cache in its working directory: the scratch one, not the repo.
        .current_dir(report.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Every operation was exercised (a document schemathesis could not read tests nothing).
    let junit = std::fs::read_to_string(report.path().join("junit.xml")).unwrap();
    for operation in [
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "POST /generate",
        "POST /cache/match",
        "GET /v1/models",
        "GET /get_server_info",
    ] {
        assert!(
            junit.contains(operation),
            "{operation} was not tested:\n{junit}"
        );
    }
    assert!(!stdout.contains(" 0 generated"), "{stdout}");
    let summary = stdout.lines().filter(|l| l.contains("generated"));
    eprintln!("{}", summary.collect::<Vec<_>>().join("\n"));
}
