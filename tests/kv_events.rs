//! KV-cache events from real servers into a real gateway's exact index: after a seeded mixed
//! workload with evictions and a server restart, every server's own prefix cache and the
//! gateway's copy of it agree, and exact routing sends a request to the server holding its
//! prefix.

mod common;

use std::io::Read;
use std::time::{Duration, Instant};

use common::server::{free_port, send, TestServer};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use tokenrouter::gateway::kv_index::digest;

/// A server over the tiny pair with a KV cache small enough that the workload evicts.
fn small_cache_server(port: u16) -> TestServer {
    let dir = common::server::tiny_pair_config("");
    let config = dir.path().join("config.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace("kv_budget_mb = 2", "kv_budget_mb = 0.25"),
    )
    .unwrap();
    let config = config.to_str().unwrap().to_string();
    TestServer::launch_on(port, &["serve", "--config", &config], &[], dir, &[200])
}

/// The first event of a server's `/cache/events`: its snapshot.
fn snapshot(port: u16) -> Value {
    let mut stream = send(port, "GET", "/cache/events", None, &[]).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        let n = stream.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended before its snapshot");
        raw.extend_from_slice(&buf[..n]);
        let Some(head) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let body = &raw[head + 4..];
        // One chunk: its size line, then the event, which ends with a blank line.
        let Some(size_end) = body.windows(2).position(|w| w == b"\r\n") else {
            continue;
        };
        let event = &body[size_end + 2..];
        if let Some(end) = event.windows(2).position(|w| w == b"\n\n") {
            let text = String::from_utf8_lossy(&event[..end]).to_string();
            let data = text.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
            return serde_json::from_str(data).unwrap();
        }
    }
}

/// (instance, seq, blocks, digest) of a server's snapshot.
fn server_state(port: u16) -> (String, u64, usize, u64) {
    let s = snapshot(port);
    assert_eq!(s["type"], "snapshot");
    assert_eq!(s["block_size"], 8);
    let hashes: Vec<u64> = (s["hashes"].as_array().unwrap().iter())
        .map(|h| h.as_u64().unwrap())
        .collect();
    (
        s["instance"].as_str().unwrap().to_string(),
        s["seq"].as_u64().unwrap(),
        hashes.len(),
        digest(&hashes),
    )
}

/// The gateway's copy of worker `i`'s state, as `/workers` shows it.
fn gateway_state(gw: &TestServer, i: usize) -> Option<(String, u64, usize, u64)> {
    let workers = gw.get("/workers").json();
    let k = &workers["workers"][i]["kv_index"];
    (k["synced"] == true).then(|| {
        (
            k["instance"].as_str().unwrap().to_string(),
            k["seq"].as_u64().unwrap(),
            k["blocks"].as_u64().unwrap() as usize,
            k["digest"].as_u64().unwrap(),
        )
    })
}

/// Waits until the gateway's copy of each server's index equals the server's own.
fn assert_agree(gw: &TestServer, servers: &[&TestServer]) {
    let started = Instant::now();
    loop {
        let pairs: Vec<_> = (servers.iter().enumerate())
            .map(|(i, s)| (server_state(s.port), gateway_state(gw, i)))
            .collect();
        if pairs.iter().all(|(s, g)| g.as_ref() == Some(s)) {
            for (s, _) in &pairs {
                assert!(s.2 > 0, "a server holds prefixes: {s:?}");
            }
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the gateway's index never matched the servers': {pairs:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn chat(system: &str, user: &str, max_tokens: usize) -> String {
    json!({
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true,
    })
    .to_string()
}

/// Seeded requests over a few long system prompts, some through the gateway and some sent to
/// a server directly (behind the gateway's back), enough to evict from the small caches.
fn mixed_workload(rng: &mut ChaCha8Rng, gw: &TestServer, servers: &[&TestServer], n: usize) {
    for _ in 0..n {
        let group = rng.random_range(0..6);
        let system = format!("group {group}: ").repeat(4 + group * 3);
        let user = format!("question {}", rng.random_range(0..1000));
        let body = chat(&system, &user, rng.random_range(1..6));
        let target = match rng.random_range(0..4) {
            0 => servers[rng.random_range(0..servers.len())],
            _ => gw,
        };
        let r = target.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
    }
}

#[test]
fn the_gateway_index_follows_the_servers_caches_through_evictions_and_a_restart() {
    let port2 = free_port();
    let s1 = small_cache_server(free_port());
    let mut s2 = small_cache_server(port2);
    let gw = TestServer::gateway(
        &[&s1.url(), &s2.url()],
        &["--policy", "cache_aware", "--exact-prefix-match"],
    );
    let mut rng = ChaCha8Rng::seed_from_u64(41);
    mixed_workload(&mut rng, &gw, &[&s1, &s2], 40);
    assert_agree(&gw, &[&s1, &s2]);
    // Every store and every removal is one change: changes beyond the blocks held are
    // removals, in pairs with their stores.
    let evicted = |port: u16| {
        let (_, seq, blocks, _) = server_state(port);
        (seq as usize - blocks) / 2
    };
    assert!(evicted(s1.port) > 0, "the workload evicts");
    let before = server_state(port2).0;

    // Server 2 restarts on the same port: a new instance with an empty cache.
    assert!(s2.terminate().success());
    drop(s2);
    let s2 = small_cache_server(port2);
    assert_ne!(server_state(port2).0, before, "a new instance");
    mixed_workload(&mut rng, &gw, &[&s1, &s2], 30);
    assert_agree(&gw, &[&s1, &s2]);
    assert_eq!(gateway_state(&gw, 1).unwrap().0, server_state(port2).0);
    assert!(evicted(s1.port) > 0 && evicted(port2) > 0, "both evicted");
}

/// A prefix cached on one server behind the gateway's back: exact routing sends the next
/// requests of that prefix there, and the servers' own hit counters show the reuse.
#[test]
fn exact_routing_sends_a_prefix_to_the_server_holding_it() {
    let (s1, s2) = (TestServer::start("", &[]), TestServer::start("", &[]));
    let system = "You answer questions about the billing system. ".repeat(6);
    assert_eq!(
        s2.post("/v1/chat/completions", &chat(&system, "warm", 2))
            .status,
        200
    );
    let gw = TestServer::gateway(&[&s1.url(), &s2.url()], &["--exact-prefix-match"]);
    let started = Instant::now();
    while gateway_state(&gw, 1).is_none_or(|s| s.2 == 0) {
        assert!(started.elapsed() < Duration::from_secs(20), "never synced");
        std::thread::sleep(Duration::from_millis(50));
    }
    let hits =
        |s: &TestServer| s.metric("tokenrouter_model_counters{counter=\"prefix_hit_tokens\"");
    let before = (hits(&s1), hits(&s2));
    for user in ["one", "two", "three"] {
        let r = gw.post("/v1/chat/completions", &chat(&system, user, 2));
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert_eq!(hits(&s1), before.0, "nothing went to the cold server");
    assert!(hits(&s2) > before.1, "the warm server reused the prefix");
    let rate = gw.metric("tokenrouter_gateway_cache_hit_rate");
    assert!(rate > 0.3, "token hit rate {rate}");
}

/// `serve --dp-size 2 --exact-prefix-match --api-key K`: the gateway shows the servers' key
/// to their event streams (which check it like the API) and follows both.
#[test]
fn serve_dp_follows_its_keyed_servers_events() {
    let dir = common::server::tiny_pair_config("");
    let config = dir.path().join("config.toml");
    let args = [
        "serve",
        "--config",
        config.to_str().unwrap(),
        "--dp-size",
        "2",
        "--exact-prefix-match",
        "--api-key",
        "dp-key",
    ];
    let port = common::server::free_port_run(2);
    let _gw = TestServer::launch_on(port, &args, &[], dir, &[200]);
    let auth = [("Authorization", "Bearer dp-key")];
    let get = |p: u16, path: &str, headers: &[(&str, &str)]| {
        common::server::request(p, "GET", path, None, headers).unwrap()
    };
    // The servers' streams refuse a missing key.
    assert_eq!(get(port + 1, "/cache/vocabulary", &[]).status, 401);
    let started = Instant::now();
    loop {
        let workers = get(port, "/workers", &auth).json();
        let synced = (workers["workers"].as_array().unwrap().iter())
            .filter(|w| w["kv_index"]["synced"] == true)
            .count();
        if synced == 2 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the gateway never followed both servers: {workers}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let body = chat("You are terse. ".repeat(8).as_str(), "hi", 2);
    let r = common::server::request(
        port,
        "POST",
        "/v1/chat/completions",
        Some(body.as_bytes()),
        &auth,
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
}
