//! The gateway binary in front of mock workers (slow, failing, unhealthy on demand) and of
//! real tiny-model servers: policies, failover, retries, disconnect propagation, runtime
//! worker changes, the bounded queue, and `serve --dp-size`.

mod common;

use std::io::Read;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::mock_worker::MockWorker;
use common::server::{request, send, TestServer};
use serde_json::json;

/// A chat body whose conversation starts with `system`.
fn chat(system: &str, user: &str, stream: bool) -> String {
    json!({
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 4,
        "stream": stream,
    })
    .to_string()
}

fn served_by(response: &common::server::Response) -> String {
    assert_eq!(response.status, 200, "{}", response.body);
    response.json()["worker"].as_str().unwrap().to_string()
}

fn wait_until(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < within, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

const GROUP_A: &str = "You are the billing assistant of a large utility company. Always answer politely, cite the tariff and never promise refunds.";
const GROUP_B: &str = "Tu es un assistant de cuisine. Réponds en français, en trois phrases au plus, et propose toujours une variante végétarienne.";

#[test]
fn cache_aware_keeps_each_prefix_group_on_one_worker() {
    let (a, b) = (MockWorker::start("a"), MockWorker::start("b"));
    let gw = TestServer::gateway(&[&a.url, &b.url], &["--policy", "cache_aware"]);
    let mut seen = std::collections::HashMap::<&str, Vec<String>>::new();
    for i in 0..6 {
        for (group, system) in [("A", GROUP_A), ("B", GROUP_B)] {
            let r = gw.post(
                "/v1/chat/completions",
                &chat(system, &format!("question {i}"), false),
            );
            seen.entry(group).or_default().push(served_by(&r));
        }
    }
    let a_workers: std::collections::HashSet<_> = seen["A"].iter().collect();
    let b_workers: std::collections::HashSet<_> = seen["B"].iter().collect();
    assert_eq!(a_workers.len(), 1, "group A stayed on one worker: {seen:?}");
    assert_eq!(b_workers.len(), 1, "group B stayed on one worker: {seen:?}");
    assert_ne!(
        a_workers, b_workers,
        "the two groups were spread over both workers"
    );
    assert!(gw.metric("tokenrouter_gateway_cache_hit_rate") > 0.5);
    let workers = gw.get("/workers").json();
    assert_eq!(workers["policy"], "cache_aware");
    assert!(workers["workers"][0]["tree_chars"].as_u64().unwrap() > 100);
}

#[test]
fn round_robin_alternates_and_the_body_is_passed_unchanged() {
    let (a, b) = (MockWorker::start("a"), MockWorker::start("b"));
    let gw = TestServer::gateway(&[&a.url, &b.url], &["--policy", "round_robin"]);
    let order: Vec<String> = (0..4)
        .map(|_| served_by(&gw.post("/v1/completions", r#"{"prompt": "hi", "max_tokens": 2}"#)))
        .collect();
    assert_eq!(order, ["a", "b", "a", "b"]);
    assert_eq!(
        a.state.bodies.lock().unwrap()[0],
        json!({"prompt": "hi", "max_tokens": 2})
    );
}

#[test]
fn shortest_queue_avoids_the_worker_with_a_request_in_flight() {
    let (a, b) = (MockWorker::start("a"), MockWorker::start("b"));
    for w in [&a, &b] {
        w.state.chunk_ms.store(300, Ordering::SeqCst);
    }
    let gw = TestServer::gateway(&[&a.url, &b.url], &["--policy", "shortest_queue"]);
    // A slow stream holds one worker...
    let mut slow = send(
        gw.port,
        "POST",
        "/generate",
        Some(br#"{"text": "x", "stream": true}"#),
        &[],
    )
    .unwrap();
    wait_until("the stream started", Duration::from_secs(10), || {
        a.requests() + b.requests() == 1
    });
    let busy = if a.requests() == 1 { "a" } else { "b" };
    // ...so the next requests go to the other.
    for _ in 0..3 {
        let r = gw.post("/generate", r#"{"text": "y"}"#);
        assert_ne!(served_by(&r), busy);
    }
    let mut rest = Vec::new();
    slow.read_to_end(&mut rest).unwrap();
    assert!(String::from_utf8_lossy(&rest).contains("[DONE]"));
}

#[test]
fn failed_requests_are_retried_on_another_worker() {
    let (a, b) = (MockWorker::start("a"), MockWorker::start("b"));
    a.state.fail_status.store(502, Ordering::SeqCst);
    let gw = TestServer::gateway(
        &[&a.url, &b.url],
        &["--policy", "round_robin", "--retry-backoff-ms", "1"],
    );
    for _ in 0..4 {
        let r = gw.post("/v1/chat/completions", &chat("s", "u", false));
        assert_eq!(served_by(&r), "b");
    }
    assert!(a.requests() >= 1);
    assert!(gw.metric("tokenrouter_gateway_retries_total") >= 1.0);
    // A worker that refuses connections is skipped the same way.
    let dead = format!("http://127.0.0.1:{}", common::server::free_port());
    let gw2 = TestServer::gateway(
        &[&dead, &b.url],
        &["--policy", "round_robin", "--retry-backoff-ms", "1"],
    );
    for _ in 0..3 {
        assert_eq!(served_by(&gw2.post("/generate", r#"{"text": "z"}"#)), "b");
    }
}

#[test]
fn a_failure_on_every_worker_reaches_the_client_after_the_retries() {
    let a = MockWorker::start("a");
    a.state.fail_status.store(504, Ordering::SeqCst);
    let gw = TestServer::gateway(
        &[&a.url],
        &["--max-retries", "2", "--retry-backoff-ms", "1"],
    );
    let r = gw.post("/generate", r#"{"text": "z"}"#);
    assert_eq!(r.status, 504);
    assert_eq!(a.requests(), 3, "one try and two retries");
    // Client errors are the worker's answer, passed through without retries.
    a.state.fail_status.store(400, Ordering::SeqCst);
    assert_eq!(gw.post("/generate", "{}").status, 400);
    assert_eq!(a.requests(), 4);
}

#[test]
fn an_unhealthy_worker_is_taken_out_and_put_back() {
    let (a, b) = (MockWorker::start("a"), MockWorker::start("b"));
    let gw = TestServer::gateway(
        &[&a.url, &b.url],
        &[
            "--policy",
            "round_robin",
            "--health-check-interval",
            "0.05",
            "--health-failure-threshold",
            "2",
            "--health-success-threshold",
            "2",
        ],
    );
    a.state.unhealthy.store(true, Ordering::SeqCst);
    let healthy = |gw: &TestServer, i: usize| {
        gw.get("/workers").json()["workers"][i]["healthy"]
            .as_bool()
            .unwrap()
    };
    wait_until("a is taken out", Duration::from_secs(10), || {
        !healthy(&gw, 0)
    });
    let before = a.requests();
    for _ in 0..4 {
        assert_eq!(served_by(&gw.post("/generate", r#"{"text": "q"}"#)), "b");
    }
    assert_eq!(a.requests(), before);
    a.state.unhealthy.store(false, Ordering::SeqCst);
    wait_until("a is back", Duration::from_secs(10), || healthy(&gw, 0));
    let served: Vec<String> = (0..4)
        .map(|_| served_by(&gw.post("/generate", r#"{"text": "q"}"#)))
        .collect();
    assert!(served.iter().any(|w| w == "a"), "{served:?}");
    // With every worker out the gateway itself is unhealthy and says so.
    a.state.unhealthy.store(true, Ordering::SeqCst);
    b.state.unhealthy.store(true, Ordering::SeqCst);
    wait_until("both are out", Duration::from_secs(10), || {
        gw.get("/health").status == 503
    });
    let r = gw.post("/generate", r#"{"text": "q"}"#);
    assert_eq!(r.status, 503);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("no healthy worker"));
}

#[test]
fn a_client_disconnect_reaches_the_worker_and_frees_the_load() {
    let a = MockWorker::start("a");
    a.state.chunks.store(50, Ordering::SeqCst);
    a.state.chunk_ms.store(100, Ordering::SeqCst);
    let gw = TestServer::gateway(&[&a.url], &[]);
    let mut stream = send(
        gw.port,
        "POST",
        "/v1/chat/completions",
        Some(chat("s", "u", true).as_bytes()),
        &[],
    )
    .unwrap();
    let mut first = [0u8; 64];
    stream.read_exact(&mut first).unwrap();
    let load = |gw: &TestServer| {
        gw.get("/workers").json()["workers"][0]["in_flight"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(load(&gw), 1);
    drop(stream);
    wait_until(
        "the worker saw the disconnect",
        Duration::from_secs(10),
        || a.state.disconnects.load(Ordering::SeqCst) == 1,
    );
    wait_until("the load is released", Duration::from_secs(10), || {
        load(&gw) == 0
    });
    assert_eq!(a.state.completed.load(Ordering::SeqCst), 0);
}

#[test]
fn workers_can_be_added_and_removed_at_runtime() {
    let (a, b) = (MockWorker::start("a"), MockWorker::start("b"));
    let gw = TestServer::gateway(&[&a.url], &["--policy", "round_robin"]);
    let added = gw.post("/workers", &json!({"url": b.url}).to_string());
    assert_eq!(added.status, 200, "{}", added.body);
    assert_eq!(added.json()["healthy"], true);
    let served: Vec<String> = (0..4)
        .map(|_| served_by(&gw.post("/generate", r#"{"text": "q"}"#)))
        .collect();
    assert!(served.contains(&"a".to_string()) && served.contains(&"b".to_string()));
    let remove_a = || {
        let path = format!("/workers?url={}", a.url);
        request(gw.port, "DELETE", &path, None, &[]).unwrap()
    };
    let removed = remove_a();
    assert_eq!(removed.status, 200, "{}", removed.body);
    for _ in 0..3 {
        assert_eq!(served_by(&gw.post("/generate", r#"{"text": "q"}"#)), "b");
    }
    let again = remove_a();
    assert_eq!(again.status, 404);
    let bad = gw.post("/workers", r#"{"url": "ftp://nowhere"}"#);
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json()["error"]["param"], "url");
    assert_eq!(
        gw.get("/workers").json()["workers"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
}

#[test]
fn saturated_workers_queue_then_turn_requests_away() {
    let a = MockWorker::start("a");
    a.state.chunks.store(10, Ordering::SeqCst);
    a.state.chunk_ms.store(100, Ordering::SeqCst);
    let gw = TestServer::gateway(
        &[&a.url],
        &[
            "--worker-max-load",
            "1",
            "--queue-size",
            "1",
            "--queue-timeout",
            "0.3",
        ],
    );
    let body = br#"{"text": "x", "stream": true}"#;
    let mut holding = send(gw.port, "POST", "/generate", Some(body), &[]).unwrap();
    wait_until("the first request runs", Duration::from_secs(10), || {
        a.requests() == 1
    });
    // The second waits in the queue; the third finds the queue full.
    let queued = std::thread::spawn({
        let port = gw.port;
        move || request(port, "POST", "/generate", Some(body), &[]).unwrap()
    });
    wait_until("one request queued", Duration::from_secs(10), || {
        gw.metric("tokenrouter_gateway_queued_requests") >= 1.0
    });
    let third = gw.post("/generate", r#"{"text": "y"}"#);
    assert_eq!(third.status, 429, "{}", third.body);
    assert!(third.header("Retry-After").is_some());
    let second = queued.join().unwrap();
    assert_eq!(
        second.status, 503,
        "the queue wait ran out: {}",
        second.body
    );
    let mut rest = Vec::new();
    holding.read_to_end(&mut rest).unwrap();
    assert!(String::from_utf8_lossy(&rest).contains("[DONE]"));
    assert_eq!(a.requests(), 1);
}

#[test]
fn bad_requests_get_an_openai_error_body() {
    let a = MockWorker::start("a");
    let gw = TestServer::gateway(&[&a.url], &[]);
    let r = gw.post("/v1/chat/completions", "{not json");
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    assert_eq!(gw.get("/nowhere").status, 404);
    assert_eq!(a.requests(), 0);
    assert_eq!(gw.get("/v1/models").json()["object"], "list");
}

#[test]
fn gateway_flags_are_checked() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenrouter"))
        .args(["gateway", "--worker-urls", "localhost:1", "--port", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--worker-urls") && err.contains("http://"),
        "{err}"
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenrouter"))
        .args([
            "gateway",
            "--worker-urls",
            "http://a:1",
            "--policy",
            "fastest",
        ])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown policy"));
}

/// Greedy chat through the gateway equals the same request sent to a server directly, streamed
/// or not, and a group's shared prefix is reused from the KV cache of the server it sticks to.
#[test]
fn real_servers_behind_the_gateway_answer_as_directly() {
    let (s1, s2) = (TestServer::start("", &[]), TestServer::start("", &[]));
    let gw = TestServer::gateway(&[&s1.url(), &s2.url()], &["--policy", "cache_aware"]);
    let body = |user: &str, stream: bool| {
        json!({
            "messages": [{"role": "system", "content": GROUP_A}, {"role": "user", "content": user}],
            "max_tokens": 8, "temperature": 0, "stream": stream, "ignore_eos": true,
        })
        .to_string()
    };
    let direct = s1.post("/v1/chat/completions", &body("first", false));
    let via = gw.post("/v1/chat/completions", &body("first", false));
    assert_eq!(via.status, 200, "{}", via.body);
    let content =
        |r: &common::server::Response| r.json()["choices"][0]["message"]["content"].clone();
    assert_eq!(content(&via), content(&direct));
    let streamed = gw.post("/v1/chat/completions", &body("second", true));
    assert_eq!(streamed.status, 200);
    assert_eq!(streamed.events().last().map(String::as_str), Some("[DONE]"));
    for user in ["third", "fourth", "fifth"] {
        assert_eq!(
            gw.post("/v1/chat/completions", &body(user, false)).status,
            200
        );
    }
    let hits =
        |s: &TestServer| s.metric("tokenrouter_model_counters{counter=\"prefix_hit_tokens\"");
    let (h1, h2) = (hits(&s1), hits(&s2));
    assert!(
        h1.max(h2) > 0.0,
        "the group reused its prefix on one server ({h1}, {h2})"
    );
}

#[test]
fn serve_with_dp_size_names_a_taken_server_port() {
    let dir = common::server::tiny_pair_config("");
    let config = dir.path().join("config.toml");
    let port = common::server::free_port_run(2);
    let _taken = std::net::TcpListener::bind(("127.0.0.1", port + 2)).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenrouter"))
        .args([
            "serve",
            "--config",
            config.to_str().unwrap(),
            "--dp-size",
            "2",
        ])
        .args(["--port", &port.to_string()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("port {} for server 2 of 2", port + 2)),
        "{stderr}"
    );
}

/// `serve --dp-size 2 --policy round_robin EXTRA...` over the tiny pair: the two servers take
/// the two ports after the gateway's.
fn serve_dp(extra: &[&str]) -> TestServer {
    let dir = common::server::tiny_pair_config("");
    let config = dir.path().join("config.toml");
    let mut args = vec![
        "serve",
        "--config",
        config.to_str().unwrap(),
        "--dp-size",
        "2",
        "--policy",
        "round_robin",
    ];
    args.extend_from_slice(extra);
    TestServer::launch_on(common::server::free_port_run(2), &args, &[], dir, &[200])
}

#[test]
fn serve_with_dp_size_starts_servers_behind_a_gateway_and_stops_them() {
    let mut gw = serve_dp(&["--api-key", "dp-key"]);
    // The key guards the gateway as well as its servers.
    assert_eq!(gw.get("/workers").status, 401);
    let auth = [("Authorization", "Bearer dp-key")];
    let get = |path: &str| request(gw.port, "GET", path, None, &auth).unwrap();
    let workers = get("/workers").json();
    let urls: Vec<String> = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["url"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(urls.len(), 2);
    let body = r#"{"text": "hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}"#;
    for _ in 0..2 {
        let r = request(gw.port, "POST", "/generate", Some(body.as_bytes()), &auth).unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let selected: Vec<u64> = get("/workers").json()["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["selected"].as_u64().unwrap())
        .collect();
    assert_eq!(selected, [1, 1]);
    // GETs the gateway forwards carry the client's key to the servers.
    let models = get("/v1/models");
    assert_eq!(models.status, 200, "{}", models.body);
    assert_eq!(get("/get_server_info").status, 200);
    assert!(gw.terminate().success());
    let port = |u: &str| u.rsplit(':').next().unwrap().parse::<u16>().unwrap();
    for url in &urls {
        wait_until("the server stopped", Duration::from_secs(30), || {
            request(port(url), "GET", "/health", None, &[]).is_none()
        });
    }
}

/// A server says exactly how much of a prompt its prefix cache holds (`POST /cache/match`).
#[test]
fn servers_report_how_much_of_a_prompt_they_hold() {
    let (s1, s2) = (TestServer::start("", &[]), TestServer::start("", &[]));
    let body = |user: &str| {
        json!({
            "messages": [{"role": "system", "content": GROUP_B}, {"role": "user", "content": user}],
            "max_tokens": 2, "temperature": 0,
        })
        .to_string()
    };
    assert_eq!(s2.post("/v1/chat/completions", &body("warm")).status, 200);
    let report = s2.post("/cache/match?api=chat", &body("next"));
    assert_eq!(report.status, 200, "{}", report.body);
    let (cached, prompt) = (
        report.json()["cached_tokens"].as_u64().unwrap(),
        report.json()["prompt_tokens"].as_u64().unwrap(),
    );
    assert!(cached > 0 && cached < prompt, "{}", report.body);
    assert_eq!(
        s1.post("/cache/match?api=chat", &body("next")).json()["cached_tokens"],
        0
    );
    assert_eq!(s1.post("/cache/match?api=nope", &body("next")).status, 400);
}

/// With keys set, the gateway checks `Authorization: Bearer` before anything is routed, on
/// every route but /health: the metrics and the worker list included. Every key of
/// `--api-key` and of the key file is accepted; a missing or wrong one is a 401 with an
/// OpenAI-style body.
#[test]
fn the_gateway_checks_its_api_keys_on_every_route_but_health() {
    let worker = TestServer::start("", &[]);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("keys");
    std::fs::write(&file, "# operators\nk3\n\n").unwrap();
    let gw = TestServer::gateway(
        &[&worker.url()],
        &[
            "--api-key",
            "k1,k2",
            "--api-key-file",
            file.to_str().unwrap(),
        ],
    );
    let call = |method: &str, path: &str, body: Option<&str>, key: Option<&str>| {
        let bearer = key.map(|k| format!("Bearer {k}"));
        let headers: Vec<(&str, &str)> = bearer
            .as_deref()
            .map(|b| vec![("Authorization", b)])
            .unwrap_or_default();
        request(gw.port, method, path, body.map(str::as_bytes), &headers).unwrap()
    };
    assert_eq!(call("GET", "/health", None, None).status, 200);
    let chat =
        r#"{"model": "slm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}"#;
    for (method, path, body) in [
        ("GET", "/metrics", None),
        ("GET", "/workers", None),
        ("POST", "/workers", Some(r#"{"url": "http://127.0.0.1:1"}"#)),
        (
            "DELETE",
            "/workers",
            Some(r#"{"url": "http://127.0.0.1:1"}"#),
        ),
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", Some(chat)),
    ] {
        for key in [None, Some("k4"), Some("k1x")] {
            let r = call(method, path, body, key);
            assert_eq!(r.status, 401, "{method} {path} with {key:?}: {}", r.body);
            assert_eq!(
                r.json()["error"]["type"],
                "authentication_error",
                "{}",
                r.body
            );
        }
    }
    for key in ["k1", "k2", "k3"] {
        assert_eq!(
            call("GET", "/metrics", None, Some(key)).status,
            200,
            "{key}"
        );
    }
    let r = call("POST", "/v1/chat/completions", Some(chat), Some("k2"));
    assert_eq!(r.status, 200, "{}", r.body);
    let workers = call("GET", "/workers", None, Some("k3")).json();
    assert_eq!(workers["workers"].as_array().unwrap().len(), 1);
    // An empty key would accept anyone: refused at start.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenrouter"))
        .args(["gateway", "--worker-urls", "http://a:1", "--api-key", "k1,"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("empty key"));
}

/// A worker that dies in the middle of a stream (half an event sent, then the connection
/// dropped): the client gets every whole event, then an error event naming the worker and
/// `[DONE]`, never the half event; the failure counts against the worker.
#[test]
fn a_worker_dying_mid_stream_ends_the_stream_with_an_error_event() {
    let a = MockWorker::start("a");
    a.state.chunks.store(10, Ordering::SeqCst);
    a.state.chunk_ms.store(10, Ordering::SeqCst);
    a.state.die_at.store(3, Ordering::SeqCst);
    let gw = TestServer::gateway(&[&a.url], &["--breaker-failures", "1"]);
    let r = gw.post("/v1/chat/completions", &chat("s", "u", true));
    assert_eq!(r.status, 200, "{}", r.body);
    let events: Vec<&str> = r.body.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 5, "{}", r.body);
    for (i, event) in events[..3].iter().enumerate() {
        let json: serde_json::Value =
            serde_json::from_str(event.strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(json["i"], i, "{event}");
    }
    let error: serde_json::Value =
        serde_json::from_str(events[3].strip_prefix("data: ").unwrap()).unwrap();
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(&a.url) && message.contains("mid-stream"),
        "{message}"
    );
    assert_eq!(events[4], "data: [DONE]");
    let workers = gw.get("/workers").json();
    assert_eq!(workers["workers"][0]["breaker_open"], true, "{workers}");
    assert_eq!(workers["workers"][0]["in_flight"], 0, "{workers}");
}

/// The process of the `serve --dp-size` server listening on `port`.
fn server_pid(port: u16) -> Option<u32> {
    let port = port.to_string();
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
            let serves_port = args
                .windows(2)
                .any(|w| w[0] == b"--port" && w[1] == port.as_bytes());
            (serves_port && args.contains(&&b"--host"[..])).then_some(pid)
        })
}

/// `kill -9` of one `serve --dp-size` server: requests keep being answered (those routed to it
/// are retried on the other), the gateway marks it down, the server is started again on its
/// port, and the gateway takes it back and routes to it again.
#[test]
fn serve_with_dp_size_restarts_a_killed_server_and_takes_it_back() {
    let mut gw = serve_dp(&[
        "--health-check-interval",
        "0.1",
        "--health-failure-threshold",
        "1",
        "--health-success-threshold",
        "1",
    ]);
    let worker = |gw: &TestServer, i: usize| gw.get("/workers").json()["workers"][i].clone();
    let url = worker(&gw, 0)["url"].as_str().unwrap().to_string();
    let port: u16 = url.rsplit(':').next().unwrap().parse().unwrap();
    let pid = server_pid(port).expect("the server's process");
    Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    let body = r#"{"text": "hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}"#;
    for _ in 0..4 {
        let r = gw.post("/generate", body);
        assert_eq!(r.status, 200, "{}", r.body);
    }
    wait_until("the killed server is out", Duration::from_secs(30), || {
        let w = worker(&gw, 0);
        w["healthy"] == false || w["breaker_open"] == true
    });
    wait_until(
        "the server is started again",
        Duration::from_secs(30),
        || server_pid(port).is_some_and(|p| p != pid),
    );
    wait_until(
        "the gateway takes it back",
        Duration::from_secs(120),
        || {
            let w = worker(&gw, 0);
            w["healthy"] == true && w["breaker_open"] == false
        },
    );
    let before = worker(&gw, 0)["selected"].as_u64().unwrap();
    for _ in 0..4 {
        let r = gw.post("/generate", body);
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert!(worker(&gw, 0)["selected"].as_u64().unwrap() > before);
    assert!(gw.terminate().success());
}
