//! `tokenrouter bench` against real server processes over the tiny pair: every workload runs,
//! results come out as a table, JSON and SVG plots, and `--compare-modes` starts a server per
//! scheduling mode.

mod common;

use std::net::TcpListener;
use std::process::Command;

use common::server::{tiny_pair_config, TestServer};

fn bench(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tokenrouter"))
        .arg("bench")
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

#[test]
fn every_workload_is_measured_and_reported() {
    let server = TestServer::start("", &[]);
    let url = format!("http://127.0.0.1:{}", server.port);
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("results.json");
    let table = bench(&[
        "--url",
        &url,
        "--workload",
        "agentic",
        "--concurrency",
        "1,2",
        "--num-requests",
        "3",
        "--max-tokens",
        "6",
        "--output",
        json.to_str().unwrap(),
        "--plot-dir",
        dir.path().to_str().unwrap(),
    ]);
    assert!(table.contains("| server | 2 |"), "{table}");
    let results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let levels = results.as_array().unwrap();
    assert_eq!(levels.len(), 2);
    for level in levels {
        // Three sessions of three turns each, six tokens per turn.
        assert_eq!(level["requests"], 9);
        assert_eq!(level["failed"], 0);
        assert!(level["output_tok_s"].as_f64().unwrap() > 0.0);
        assert!(level["e2e_s"]["p99"].as_f64().unwrap() >= level["e2e_s"]["p50"].as_f64().unwrap());
    }
    for plot in ["throughput.svg", "latency.svg"] {
        let svg = std::fs::read_to_string(dir.path().join(plot)).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains("<polyline"),
            "{plot}"
        );
    }
    for workload in ["short", "long", "shared-prefix"] {
        let args = [
            "--url",
            &url,
            "--workload",
            workload,
            "--concurrency",
            "2",
            "--num-requests",
            "2",
        ];
        let table = bench(&[&args[..], &["--max-tokens", "4", "--prefix-words", "20"]].concat());
        assert!(table.contains("| server | 2 | 2 |"), "{workload}: {table}");
    }
}

#[test]
fn compare_modes_starts_a_server_per_mode_and_reports_ratios() {
    let dir = tiny_pair_config("");
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let config = dir.path().join("config.toml");
    let table = bench(&[
        "--compare-modes",
        "--modes",
        "sync,eager",
        "--config",
        config.to_str().unwrap(),
        "--port",
        &port,
        "--concurrency",
        "2",
        "--num-requests",
        "2",
        "--max-tokens",
        "4",
    ]);
    assert!(
        table.contains("| sync | 2 | 2 | ") && table.contains("| eager | 2 | 2 | "),
        "{table}"
    );
    assert!(table.contains("1.00×"), "{table}");
}
