//! The HTTP server as a client sees it, over plain HTTP: OpenAI and SGLang response shapes,
//! SSE framing, every kind of bad input (and fuzzed bodies) answered with a 4xx naming the
//! problem, disconnects, slow readers and overload, the API key, and a soak of mixed requests
//! after which no KV block or active request is left.

mod common;

use std::io::Read;
use std::time::{Duration, Instant};

use common::server::{request, send, TestServer};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

fn chat(content: &str, extra: Value) -> String {
    let mut body = json!({"model": "tokenrouter", "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body.to_string()
}

/// Waits until `/metrics` shows no active request and no used KV block.
fn assert_drained(server: &TestServer) {
    let started = Instant::now();
    loop {
        let active = server.metric("tokenrouter_active_requests");
        let used = server.metric("tokenrouter_model_state{model=\"slm\",state=\"kv_blocks_used\"}")
            + server.metric("tokenrouter_model_state{model=\"llm\",state=\"kv_blocks_used\"}");
        // Finished requests leave their full blocks cached; cached ones count as free.
        if active == 0.0 && used == 0.0 {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "still active {active}, blocks used {used}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn chat_and_completions_answer_in_openai_shape() {
    let server = TestServer::start("", &[]);
    let r = server.post(
        "/v1/chat/completions",
        &chat("hello there", json!({"n": 2, "seed": 3})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 16);
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 2);
    let routed = &v["routing"]["tokens_per_model"];
    assert_eq!(
        routed["slm"].as_u64().unwrap() + routed["llm"].as_u64().unwrap(),
        16
    );
    assert!(v["routing"]["llm_token_share"].is_number());

    let r = server.post(
        "/v1/completions",
        &json!({"prompt": "the cat", "max_tokens": 5, "temperature": 0}).to_string(),
    );
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert!(v["choices"][0]["text"].is_string());
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": [1, 2, 3], "max_tokens": 3, "stop": ["x", "y"]}).to_string(),
    );
    assert_eq!(r.status, 200, "{}", r.body);

    let models = server.get("/v1/models").json();
    assert_eq!(models["data"][0]["id"], "tokenrouter");
    let info = server.get("/get_server_info").json();
    assert_eq!(
        info["models"][0]["kv_blocks"],
        info["models"][1]["kv_blocks"]
    );
    assert_eq!(server.get("/health_generate").status, 200);
}

#[test]
fn streams_are_sse_chunks_ending_with_done() {
    let server = TestServer::start("", &[]);
    let body = chat(
        "stream please",
        json!({"stream": true, "stream_options": {"include_usage": true}, "max_tokens": 6}),
    );
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let events = r.events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    let finish: Vec<_> = chunks
        .iter()
        .filter(|c| !c["choices"][0]["finish_reason"].is_null())
        .collect();
    assert_eq!(finish.len(), 1);
    assert_eq!(finish[0]["choices"][0]["finish_reason"], "length");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"].as_array().unwrap().len(), 0);
    assert_eq!(usage["usage"]["completion_tokens"], 6);

    let r = server.post("/generate", &json!({"text": "a b c", "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "stream": true}).to_string());
    let events = r.events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["meta_info"]["finish_reason"]["type"], "length");
    assert_eq!(last["output_ids"].as_array().unwrap().len(), 4);
    let whole = server.post("/generate", &json!({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).to_string()).json();
    assert_eq!(whole["meta_info"]["completion_tokens"], 4);
    assert!(whole["meta_info"]["routing"]["handoffs"].is_number());
}

#[test]
fn bad_input_gets_a_4xx_naming_the_problem_and_the_server_keeps_serving() {
    let server = TestServer::start("[server]\nmax_body_mb = 1\n", &[]);
    let long_prompt = "word ".repeat(5000);
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        ("/v1/chat/completions", b"{not json".to_vec(), 400, "body"),
        (
            "/v1/chat/completions",
            chat("x", json!({"temperature": "hot"})).into_bytes(),
            400,
            "temperature",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": []}).to_string().into_bytes(),
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": "hi"}).to_string().into_bytes(),
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"model": "gpt-9"})).into_bytes(),
            404,
            "model",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"temperature": -1})).into_bytes(),
            400,
            "temperature",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"top_p": 7})).into_bytes(),
            400,
            "top_p",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"max_tokens": 10_000_000})).into_bytes(),
            400,
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"max_tokens": -3})).into_bytes(),
            400,
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"n": 0})).into_bytes(),
            400,
            "n",
        ),
        (
            "/v1/chat/completions",
            chat(&long_prompt, json!({})).into_bytes(),
            400,
            "prompt",
        ),
        (
            "/v1/chat/completions",
            chat(&long_prompt, json!({"stream": true})).into_bytes(),
            400,
            "prompt",
        ),
        (
            "/v1/chat/completions",
            b"{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}".to_vec(),
            400,
            "body",
        ),
        ("/v1/chat/completions", vec![b' '; 2 << 20], 413, "limit"),
        (
            "/v1/completions",
            json!({"prompt": ""}).to_string().into_bytes(),
            400,
            "prompt",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 99_999_999]}).to_string().into_bytes(),
            400,
            "input_ids",
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "logprobs": 3})
                .to_string()
                .into_bytes(),
            400,
            "logprobs",
        ),
        (
            "/generate",
            json!({"sampling_params": {}}).to_string().into_bytes(),
            400,
            "text",
        ),
        (
            "/generate",
            json!({"text": "a", "sampling_params": {"top_k": -5}})
                .to_string()
                .into_bytes(),
            400,
            "top_k",
        ),
        ("/nope", b"{}".to_vec(), 404, "route"),
    ];
    for (path, body, status, names) in cases {
        let r = request(server.port, "POST", path, Some(&body), &[]).expect("the server answers");
        assert_eq!(
            r.status,
            status,
            "{path} {}: {}",
            String::from_utf8_lossy(&body[..body.len().min(80)]),
            r.body
        );
        let error = &r.json()["error"];
        let text = format!("{} {}", error["message"], error["param"]);
        assert!(
            text.contains(names),
            "{path}: the error should name {names}: {text}"
        );
    }
    // Fuzzed bodies: random bytes and truncated or mangled requests.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let valid = chat("fuzz", json!({}));
    for i in 0..60 {
        let body: Vec<u8> = match i % 3 {
            0 => (0..rng.random_range(0..200))
                .map(|_| rng.random())
                .collect(),
            1 => valid.as_bytes()[..rng.random_range(0..valid.len())].to_vec(),
            _ => {
                let mut b = valid.clone().into_bytes();
                let at = rng.random_range(0..b.len());
                b[at] = rng.random();
                b
            }
        };
        let r = request(
            server.port,
            "POST",
            "/v1/chat/completions",
            Some(&body),
            &[],
        )
        .expect("the server answers");
        assert!(
            r.status == 200 || (400..500).contains(&r.status),
            "fuzz {i}: {} {}",
            r.status,
            r.body
        );
        if r.status != 200 {
            assert!(r.json()["error"]["message"].is_string());
        }
    }
    let r = server.post("/v1/chat/completions", &chat("still there?", json!({})));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_drained(&server);
}

/// A long streaming chat request (`n` choices) whose response has started.
fn open_long_stream(server: &TestServer, n: usize) -> std::net::TcpStream {
    let body = chat(
        "go on",
        json!({"stream": true, "n": n, "max_tokens": 220, "ignore_eos": true}),
    );
    let mut stream = send(
        server.port,
        "POST",
        "/v1/chat/completions",
        Some(body.as_bytes()),
        &[],
    )
    .unwrap();
    let mut first = [0u8; 512];
    let n = stream.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).contains("200 OK"));
    stream
}

#[test]
fn a_client_disconnect_cancels_the_request_and_frees_its_blocks() {
    let server = TestServer::start("", &[]);
    for _ in 0..4 {
        drop(open_long_stream(&server, 1));
    }
    assert_drained(&server);
    assert!(server.metric("tokenrouter_requests_total{outcome=\"cancelled\"}") >= 1.0);
}

#[test]
fn a_client_reading_its_stream_a_byte_a_second_holds_up_no_one() {
    let server = TestServer::start("", &[]);
    // Four long choices: far more than the socket buffers between the two ends hold.
    let mut slow = open_long_stream(&server, 4);
    // A small receive buffer, so that the server's writes to this client back up at once.
    let size: libc::c_int = 1024;
    let set = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&slow),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&size as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(set, 0);
    // Until the stream's tokens are all made and its writes wait on this client.
    let made = Instant::now();
    while server.metric("tokenrouter_requests_total{outcome=\"finished\"}") < 1.0 {
        assert!(
            made.elapsed() < Duration::from_secs(30),
            "the stream never finished"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let port = server.port;
    let others: Vec<_> = (0..8)
        .map(|i| {
            std::thread::spawn(move || {
                let body = chat(&format!("meanwhile {i}"), json!({"max_tokens": 24}));
                request(
                    port,
                    "POST",
                    "/v1/chat/completions",
                    Some(body.as_bytes()),
                    &[],
                )
                .map(|r| r.status)
            })
        })
        .collect();
    // One byte a second until every other request is answered.
    let mut read = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !others.iter().all(|t| t.is_finished()) {
        assert!(Instant::now() < deadline, "the others were held up");
        let mut byte = [0u8];
        slow.read_exact(&mut byte).unwrap();
        read += 1;
        std::thread::sleep(Duration::from_secs(1));
    }
    for t in others {
        assert_eq!(t.join().unwrap().unwrap(), 200);
    }
    assert!(read < 60, "{read} bytes read");
    // The slow stream is whole once read.
    let mut rest = Vec::new();
    slow.read_to_end(&mut rest).unwrap();
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.contains("data: [DONE]"), "{rest}");
    assert_eq!(
        rest.matches("\"finish_reason\":\"length\"").count(),
        4,
        "{rest}"
    );
    assert_drained(&server);
}

#[test]
fn overload_gets_503_with_retry_after_and_the_api_key_guards_every_route_but_health() {
    let server = TestServer::start("", &["--max-requests", "1", "--api-key", "s3cret"]);
    let auth = [("Authorization", "Bearer s3cret")];
    assert_eq!(server.get("/health").status, 200);
    let r = server.post("/v1/chat/completions", &chat("x", json!({})));
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["type"], "authentication_error");
    // Twelve clients at once against a limit of one request: some must be turned away.
    let port = server.port;
    let clients: Vec<_> = (0..12)
        .map(|_| {
            std::thread::spawn(move || {
                let body = chat("long one", json!({"max_tokens": 200, "ignore_eos": true}));
                let auth = [("Authorization", "Bearer s3cret")];
                request(
                    port,
                    "POST",
                    "/v1/chat/completions",
                    Some(body.as_bytes()),
                    &auth,
                )
                .unwrap()
            })
        })
        .collect();
    let responses: Vec<_> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    let busy: Vec<_> = responses.iter().filter(|r| r.status == 503).collect();
    assert!(!busy.is_empty(), "no request was turned away");
    assert!(busy.iter().all(|r| r.header("retry-after") == Some("1")));
    assert!(responses.iter().all(|r| r.status == 200 || r.status == 503));
    let r = request(
        server.port,
        "POST",
        "/v1/chat/completions",
        Some(chat("x", json!({})).as_bytes()),
        &auth,
    )
    .unwrap();
    assert_eq!(r.status, 200, "the slots were given back: {}", r.body);
}

/// Needs the `failpoints` feature (`cargo test` turns it on through the dev-dependency on this
/// package).
#[test]
fn a_panic_in_a_forward_pass_fails_its_requests_with_500_and_marks_health() {
    let server = TestServer::start_with_env("", &[], &[("TOKENROUTER_FAILPOINT_TOKEN", "77")]);
    let r = server.post(
        "/generate",
        &json!({"input_ids": [1, 77, 2], "sampling_params": {"max_new_tokens": 4}}).to_string(),
    );
    assert_eq!(r.status, 500, "{}", r.body);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("panicked"),
        "{}",
        r.body
    );
    let health = server.get("/health");
    assert_eq!(health.status, 503);
    assert_eq!(health.json()["model"], "slm");
    // One new token: a sampled token never enters a forward pass, so this request cannot
    // meet the failpoint by sampling token 77 itself (with more tokens it did, now and then).
    let r = server.post(
        "/generate",
        &json!({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}).to_string(),
    );
    assert_eq!(r.status, 200, "other requests are still served: {}", r.body);
    assert_drained(&server);
}

#[test]
fn a_request_past_the_timeout_gets_504_and_is_cancelled() {
    let server = TestServer::start("", &["--request-timeout", "0.001"]);
    let body = chat("slow", json!({"max_tokens": 220, "ignore_eos": true}));
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 504, "{}", r.body);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("timeout"));
    assert_drained(&server);
}

#[test]
fn sigterm_stops_the_server_cleanly_even_with_a_stream_in_flight() {
    let mut server = TestServer::start("", &["--shutdown-timeout", "2"]);
    let _stream = open_long_stream(&server, 1);
    let status = server.terminate();
    assert!(status.success(), "exit status {status}");
    assert!(
        request(server.port, "GET", "/health", None, &[]).is_none(),
        "the port is closed"
    );
}

#[test]
fn a_soak_of_mixed_requests_with_cancellations_leaves_nothing_behind() {
    let server = TestServer::start("[server]\nmax_requests = 64\n", &[]);
    let port = server.port;
    for _ in 0..20 {
        server.post(
            "/v1/chat/completions",
            &chat("warm up", json!({"max_tokens": 16})),
        );
    }
    let rss_before = server.rss();
    let threads: Vec<_> = (0..6u64)
        .map(|t| {
            std::thread::spawn(move || {
                let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(t);
                let mut errors = Vec::new();
                for i in 0..40 {
                    let stream = rng.random_bool(0.5);
                    let body = match i % 3 {
                        0 => chat("soak", json!({"stream": stream, "max_tokens": rng.random_range(1..24), "temperature": 0.8, "seed": i})),
                        1 => json!({"prompt": "soak test", "stream": stream, "max_tokens": rng.random_range(1..24)}).to_string(),
                        _ => json!({"text": "soak", "stream": stream, "sampling_params": {"max_new_tokens": rng.random_range(1..24)}}).to_string(),
                    };
                    let path = ["/v1/chat/completions", "/v1/completions", "/generate"][i % 3];
                    if stream && rng.random_bool(0.3) {
                        let mut s = send(port, "POST", path, Some(body.as_bytes()), &[]).unwrap();
                        let mut buf = [0u8; 64];
                        let _ = s.read(&mut buf);
                        continue;
                    }
                    let r = request(port, "POST", path, Some(body.as_bytes()), &[]).unwrap();
                    if r.status != 200 || r.body.contains("\"error\"") {
                        errors.push(format!("{path}: {} {}", r.status, r.body));
                    }
                }
                errors
            })
        })
        .collect();
    let errors: Vec<String> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    assert!(errors.is_empty(), "{errors:?}");
    assert_drained(&server);
    assert!(server.metric("tokenrouter_requests_total{outcome=\"finished\"}") > 100.0);
    let growth = server.rss().saturating_sub(rss_before);
    assert!(
        growth < 64 << 20,
        "resident memory grew by {} MiB",
        growth >> 20
    );
}

#[test]
fn an_idle_server_after_a_burst_uses_almost_no_cpu() {
    let server = TestServer::start("", &[]);
    let port = server.port;
    let burst: Vec<_> = (0..8)
        .map(|i| {
            std::thread::spawn(move || {
                let body = chat(&format!("burst {i}"), json!({"max_tokens": 24}));
                let path = "/v1/chat/completions";
                request(port, "POST", path, Some(body.as_bytes()), &[]).unwrap()
            })
        })
        .collect();
    for t in burst {
        assert_eq!(t.join().unwrap().status, 200);
    }
    assert_drained(&server);
    std::thread::sleep(Duration::from_millis(500));
    let before = server.cpu_seconds();
    std::thread::sleep(Duration::from_secs(10));
    let used = server.cpu_seconds() - before;
    assert!(
        used < 0.2,
        "the idle server used {used:.3} s of CPU in 10 s"
    );
}

/// Too many request headers, or one too long, is refused with 431 before any handler runs, on
/// the server and on a gateway in front of it, and both keep serving.
#[test]
fn a_header_flood_is_refused_and_the_server_keeps_serving() {
    let server = TestServer::start("", &[]);
    let gateway = TestServer::gateway(&[&server.url()], &[]);
    let names: Vec<String> = (0..500).map(|i| format!("X-Flood-{i}")).collect();
    let flood: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), "1")).collect();
    let long = "v".repeat(512 << 10);
    for port in [server.port, gateway.port] {
        let r = request(port, "GET", "/v1/models", None, &flood).expect("an answer");
        assert_eq!(r.status, 431, "500 headers");
        // Half a megabyte of one header: a 431, or the connection closed before it is all sent.
        let r = request(
            port,
            "GET",
            "/v1/models",
            None,
            &[("X-Long", long.as_str())],
        );
        assert!(
            r.as_ref().is_none_or(|r| r.status == 431),
            "{:?}",
            r.map(|r| r.status)
        );
        let r = request(port, "GET", "/v1/models", None, &[]).expect("an answer");
        assert_eq!(r.status, 200, "{}", r.body);
    }
}

/// A server decoding speculatively (its SLM drafting from a draft vocabulary) reports each
/// response's drafts and acceptance in its `routing` field and their totals in `/metrics`; a
/// streamed answer carries only committed tokens, the same text as the whole one, and every
/// block comes back.
#[test]
fn speculative_decoding_is_served_with_its_acceptance_reported() {
    let dir = common::server::tiny_pair_config("");
    let path = dir.path().join("config.toml");
    let text = std::fs::read_to_string(&path).unwrap().replace(
        "algorithm = \"r-stitch\"\nhigh = 5.2\nlow = 5.0",
        "algorithm = \"speculative\"\ndraft_tokens = 3\ndraft_vocab = 200",
    );
    std::fs::write(&path, text).unwrap();
    let config = path.to_str().unwrap().to_string();
    let server = TestServer::launch(&["serve", "--config", &config], &[], dir, &[200]);
    let r = server.post(
        "/v1/chat/completions",
        &chat("verify me", json!({"max_tokens": 12, "ignore_eos": true})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["usage"]["completion_tokens"], 12);
    let spec = &v["routing"]["speculative"];
    let drafted = spec["drafted_tokens"].as_u64().unwrap();
    let accepted = spec["accepted_tokens"].as_u64().unwrap();
    let verifications = spec["verifications"].as_u64().unwrap();
    assert!(
        drafted > 0 && accepted <= drafted && verifications > 0,
        "{spec}"
    );
    assert_eq!(
        v["routing"]["tokens_per_model"]["slm"].as_u64().unwrap(),
        accepted
    );
    assert_eq!(
        spec["acceptance_rate"].as_f64().unwrap(),
        accepted as f64 / drafted as f64
    );
    assert_eq!(
        server.metric("tokenrouter_spec_drafted_tokens_total"),
        drafted as f64
    );
    assert_eq!(
        server.metric("tokenrouter_spec_accepted_tokens_total"),
        accepted as f64
    );

    let body = chat(
        "verify me",
        json!({"max_tokens": 12, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}}),
    );
    let events = server.post("/v1/chat/completions", &body).events();
    let streamed: String = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(
        streamed,
        v["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert_drained(&server);
}
