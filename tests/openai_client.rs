//! The official `openai` Python client (PyPI package `openai`) against the real server:
//! chat and completions, streaming and not, usage, finish reasons and a 400 error.
//! Needs `python3 -m pip install openai` (the CI script installs it).

mod common;

use std::process::Command;

use common::server::TestServer;

#[test]
fn the_official_openai_client_works_unchanged() {
    let probe = Command::new("python3")
        .args(["-c", "import openai"])
        .output();
    assert!(
        probe.is_ok_and(|o| o.status.success()),
        "the `openai` Python package is missing: run `python3 -m pip install openai`"
    );
    let server = TestServer::start("", &[]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/openai_client.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(format!("http://127.0.0.1:{}/v1", server.port))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
