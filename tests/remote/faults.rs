//! Refused peers, killed subservers and failed models: the front stays up and says what
//! is missing, and takes a restarted subserver back.

use super::*;

#[test]
fn peers_without_the_secret_http_clients_and_garbage_are_refused_undisturbing() {
    let pair = tiny_pair();
    let models = [&pair.models[0].model, &pair.models[1].model];
    let [(rule, routing), _] = rules(&pair);
    let dir = pair.dir.path();
    let sub = Subserver::start(
        &write_config(dir, "sub.toml", None, &routing),
        "127.0.0.1:0",
    );
    // A front with another secret.
    std::fs::write(dir.join("wrong"), "another secret of sixteen bytes").unwrap();
    let text = std::fs::read_to_string(write_config(dir, "front.toml", Some(&sub.addr), &routing))
        .unwrap()
        .replace("secret_file = \"secret\"", "secret_file = \"wrong\"");
    std::fs::write(dir.join("wrong.toml"), text).unwrap();
    let wrong = Config::load(&dir.join("wrong.toml")).unwrap();
    let err = refused_front(&wrong, &pair);
    assert!(err.contains("shared secret"), "{err}");
    // A plain HTTP client, and random bytes.
    assert!(
        an_http_client_is_closed(&sub.addr),
        "the HTTP client was kept"
    );
    let mut junk = TcpStream::connect(&sub.addr).unwrap();
    let bytes: Vec<u8> = (0..512u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    junk.write_all(&bytes).unwrap();
    assert!(
        closes_within(junk, Duration::from_secs(8)),
        "the junk was kept"
    );
    // Peers that prove the secret and then send malformed frames lose their link; each
    // malformed frame is one session's last.
    let config = front(&pair, "front.toml", &sub.addr, &routing);
    let auth = LinkAuth {
        secret: Some(Secret::new(SECRET.into()).unwrap()),
        tls: None,
    };
    let vocab = vocab_digest(&pair.models[0].tokenizer);
    let hello = Hello::new(&config, 1, Some(vocab), false);
    let facts = vec![ModelFacts::default(); 2];
    let valid = |frame: Frame| {
        let mut buf = BytesMut::new();
        Codec::<Frame>::default().encode(frame, &mut buf).unwrap();
        buf.to_vec()
    };
    let meta = WireMeta {
        id: 1,
        prompt_len: 2,
        params: SamplingParams::greedy(),
        max_tokens: 4,
        stop_ids: Vec::new(),
        home: 0,
    };
    let mut fuzzed = vec![
        // A token outside the vocabulary.
        valid(Frame::Submit {
            meta: meta.clone(),
            prompt: vec![1, 1 << 30],
        }),
        // Frames only a subserver sends.
        valid(Frame::Stats(1, Default::default())),
        valid(Frame::Event {
            id: 1,
            event: tokenrouter::actors::messages::TokenEvent::Finished {
                reason: tokenrouter::model::runner::FinishReason::Length,
            },
        }),
        // A claimed length past the limit.
        vec![0x7f, 0xff, 0xff, 0xff, 1, 2, 3],
    ];
    // Seeded noise inside a well-formed length prefix, its first byte past the last variant.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for len in [1usize, 7, 64, 300] {
        let mut frame = (len as u32).to_be_bytes().to_vec();
        frame.push(0xf0);
        for _ in 1..len {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            frame.push(state as u8);
        }
        fuzzed.push(frame);
    }
    let io = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for (k, bytes) in fuzzed.iter().enumerate() {
        let closed = io.block_on(async {
            let link = dial(&sub.addr, &auth, &hello).await.unwrap();
            let mut stream = link.start(facts.clone()).await.unwrap().into_inner();
            stream.write_all(bytes).await.unwrap();
            let mut buf = vec![0u8; 1 << 16];
            let wait = async {
                loop {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(_) => {}
                    }
                }
            };
            tokio::time::timeout(Duration::from_secs(8), wait)
                .await
                .is_ok()
        });
        assert!(
            closed,
            "fuzzed frame {k} did not close its link: {}",
            sub.log()
        );
    }
    // The front with the right secret is served as if nothing had happened.
    let prompt = &prompts()[2];
    let want = routed_greedy(models, rule, prompt, 16, &[]).tokens;
    let got = with_front(&config, &pair, async |rt| {
        let mut req = greedy(prompt, 16);
        req.ignore_eos = true;
        collect(rt.submit(req), None).await
    });
    assert_eq!(got.tokens, want);
    let log = sub.log();
    assert!(log.matches("refused a peer").count() >= 3, "{log}");
    assert!(log.contains("shared secret"), "{log}");
    assert!(
        log.matches("link to the front server closed").count() >= fuzzed.len(),
        "{log}"
    );
}

#[test]
fn a_killed_subserver_fails_its_requests_at_once_and_is_taken_back_when_restarted() {
    let pair = tiny_pair();
    let models = [&pair.models[0].model, &pair.models[1].model];
    let [(rule, routing), _] = rules(&pair);
    let prompt = prompts()[3].clone();
    let want = routed_greedy(models, rule, &prompt, 12, &[]).tokens;
    // In lock-step the front's model waits for the subserver's rounds: while it is gone, and
    // once a new session (which starts at round 0) is back.
    for mode in ["eager", "sync"] {
        kill_and_restart(&pair, &routing, mode, &want);
    }
}

fn kill_and_restart(pair: &Pair, routing: &str, mode: &str, want: &[OracleToken]) {
    let dir = pair.dir.path().to_path_buf();
    let rest = format!("{routing}[scheduler]\nmode = \"{mode}\"\n");
    let sub_config = write_config(&dir, &format!("sub-{mode}.toml"), None, &rest);
    let mut sub = Some(Subserver::start(&sub_config, "127.0.0.1:0"));
    let addr = sub.as_ref().unwrap().addr.clone();
    let config = front(pair, &format!("front-{mode}.toml"), &addr, &rest);
    let prompt = prompts()[3].clone();
    with_front(&config, pair, async |rt| {
        // 16 long streams, each far from done when the subserver dies.
        let started = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = prompts()
            .iter()
            .cycle()
            .take(16)
            .map(|p| {
                let mut req = greedy(p, 230 - p.len());
                req.ignore_eos = true;
                let mut handle = rt.submit(req);
                let started = started.clone();
                actix::spawn(async move {
                    let mut tokens = 0;
                    loop {
                        match handle.events.recv().await {
                            Some(RequestEvent::Text { tokens: t, .. }) => {
                                if tokens < 2 && tokens + t.len() >= 2 {
                                    started.fetch_add(1, Ordering::SeqCst);
                                }
                                tokens += t.len();
                            }
                            Some(e) if e.is_terminal() => return (e, tokens, Instant::now()),
                            Some(_) => {}
                            None => panic!("no terminal event"),
                        }
                    }
                })
            })
            .collect();
        while started.load(Ordering::SeqCst) < 16 {
            actix_rt::time::sleep(Duration::from_millis(2)).await;
        }
        let killed = Instant::now();
        drop(sub.take());
        for task in tasks {
            let (end, tokens, at) = task.await.unwrap();
            match end {
                RequestEvent::Failed(e) => {
                    assert!(e.message.contains("model 'llm' is unavailable"), "{e:?}");
                }
                other => panic!("mode {mode}, after {tokens} tokens: {other:?}"),
            }
            assert!(
                at.duration_since(killed) < Duration::from_secs(1),
                "failed {:?} after the kill",
                at.duration_since(killed)
            );
        }
        assert_eq!(rt.shared().unhealthy_model(), Some("llm"));
        // New requests are refused at once, as unavailable.
        let refused = collect(rt.submit(greedy(&prompt, 4)), None).await;
        assert!(
            matches!(refused.terminals.as_slice(), [RequestEvent::Failed(e)] if e.message.contains("unavailable")),
            "{:?}",
            refused.terminals
        );
        let slm = &rt.stats().await[0];
        assert_eq!(slm.free_blocks, slm.total_blocks, "{slm:?}");
        // The subserver comes back on its address and is used again.
        let back = Subserver::start(&sub_config, &addr);
        let deadline = Instant::now() + Duration::from_secs(15);
        while rt.shared().unhealthy_model().is_some() {
            assert!(Instant::now() < deadline, "not reconnected: {}", back.log());
            actix_rt::time::sleep(Duration::from_millis(20)).await;
        }
        let mut req = greedy(&prompt, 12);
        req.ignore_eos = true;
        let again = actix_rt::time::timeout(Duration::from_secs(30), collect(rt.submit(req), None))
            .await
            .unwrap_or_else(|_| panic!("mode {mode}: the request never ended after the restart"));
        assert_eq!(again.tokens, *want, "mode {mode}");
        // Every request has ended: none is counted as active any more.
        let slm = &rt.stats().await[0];
        assert_eq!(slm.active_estimate, 0, "mode {mode}: {slm:?}");
        // Kept alive until the runtime's final count, which reads the subserver's blocks too.
        back
    });
}

/// Needs the `failpoints` feature (`cargo test` turns it on through the dev-dependency on this
/// package).
#[test]
fn a_failed_model_on_a_subserver_is_named_by_the_fronts_health() {
    let pair = tiny_pair();
    let models = [&pair.models[0].model, &pair.models[1].model];
    let [(rule, routing), _] = rules(&pair);
    let prompt = prompts()
        .into_iter()
        .find(|p| {
            let oracle = routed_greedy(models, rule, p, 12, &[]);
            oracle.tokens.iter().any(|t| t.model == 1)
        })
        .expect("a prompt the LLM serves");
    let dir = pair.dir.path();
    let rest = format!("{routing}[scheduler]\nmode = \"eager\"\n");
    let local = write_config(dir, "sub-failing.toml", None, &rest);
    // The subserver's forward passes over the prompt's first token panic.
    let mut command = Command::new(env!("CARGO_BIN_EXE_tokenrouter"));
    command.env("TOKENROUTER_FAILPOINT_TOKEN", prompt[0].to_string());
    let args = secret_args(&local);
    let sub = Subserver::start_in(&mut command, "llm", &local, "127.0.0.1:0", &args);
    let config = front(&pair, "front-failing.toml", &sub.addr, &rest);
    with_front(&config, &pair, async |rt| {
        assert_eq!(rt.shared().unhealthy_model(), None);
        let failed = collect(rt.submit(greedy(&prompt, 12)), None).await;
        assert!(
            matches!(failed.terminals.as_slice(), [RequestEvent::Failed(e)] if e.message.contains("panicked")),
            "{:?}",
            failed.terminals
        );
        let deadline = Instant::now() + Duration::from_secs(5);
        while rt.shared().unhealthy_model() != Some("llm") {
            assert!(Instant::now() < deadline, "/health never named the model");
            actix_rt::time::sleep(Duration::from_millis(20)).await;
        }
        // The link itself is up: the model's failure is not a lost subserver.
        let stats = rt.stats().await;
        assert!(stats[1].link.as_ref().is_some_and(|l| l.up), "{stats:?}");
        sub
    });
}

/// Reads what the stream sends until it ends; when it ended.
fn drain(mut stream: TcpStream) -> (String, Instant) {
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut text = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return (String::from_utf8_lossy(&text).into(), Instant::now()),
            Ok(n) => {
                text.extend_from_slice(&buf[..n]);
                // The stream's last event came; the connection may stay open.
                if text.ends_with(b"data: [DONE]\n\n") {
                    return (String::from_utf8_lossy(&text).into(), Instant::now());
                }
            }
        }
    }
}

#[test]
fn the_http_server_reports_a_killed_subserver_and_serves_again_once_it_is_back() {
    let dir = common::server::tiny_pair_config("");
    std::fs::write(dir.path().join("secret"), SECRET).unwrap();
    let sub_config = dir.path().join("config.toml");
    // Every token goes to the LLM, so every request depends on the subserver.
    let routed = std::fs::read_to_string(&sub_config).unwrap().replace(
        "algorithm = \"r-stitch\"\nhigh = 5.2\nlow = 5.0\n",
        "algorithm = \"entropy\"\nthreshold = 0.0\n",
    );
    assert!(routed.contains("entropy"));
    std::fs::write(&sub_config, routed).unwrap();
    let sub = Subserver::start(&sub_config, "127.0.0.1:0");
    let text = std::fs::read_to_string(&sub_config).unwrap().replace(
        "path = \"llm.gguf\"\n",
        &format!(
            "path = \"llm.gguf\"\nremote = \"{}\"\nsecret_file = \"secret\"\n",
            sub.addr
        ),
    );
    let front_config = dir.path().join("front.toml");
    std::fs::write(&front_config, text).unwrap();
    let mut sub = Some(sub);
    let server = common::server::TestServer::launch(
        &["serve", "--config", front_config.to_str().unwrap()],
        &[],
        tempfile::tempdir().unwrap(),
        &[200],
    );
    let body = |max: usize| {
        serde_json::json!({"model": "tokenrouter", "prompt": "once upon a time", "stream": true,
            "max_tokens": max, "ignore_eos": true, "temperature": 0})
        .to_string()
    };
    let streams: Vec<TcpStream> = (0..16)
        .map(|_| {
            let mut s = common::server::send(
                server.port,
                "POST",
                "/v1/completions",
                Some(body(200).as_bytes()),
                &[],
            )
            .unwrap();
            let mut first = [0u8; 1024];
            let n = s.read(&mut first).unwrap();
            assert!(String::from_utf8_lossy(&first[..n]).contains("200 OK"));
            s
        })
        .collect();
    let killed = Instant::now();
    drop(sub.take());
    let waits: Vec<_> = streams
        .into_iter()
        .map(|s| std::thread::spawn(move || drain(s)))
        .collect();
    for wait in waits {
        let (text, ended) = wait.join().unwrap();
        assert!(text.contains("model 'llm' is unavailable"), "{text}");
        let after = ended.duration_since(killed);
        assert!(
            after < Duration::from_secs(1),
            "the error came {after:?} after the kill"
        );
    }
    let health = server.get("/health");
    assert_eq!(
        (health.status, health.json()["model"].clone()),
        (503, "llm".into())
    );
    let refused = server.post("/v1/completions", &body(4).replace("true", "false"));
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert!(
        refused.body.contains("'llm' is unavailable"),
        "{}",
        refused.body
    );
    assert_eq!(
        server.metric("tokenrouter_model_state{model=\"slm\",state=\"kv_blocks_used\"}"),
        0.0
    );
    assert_eq!(
        server.metric("tokenrouter_link{counter=\"up\",model=\"llm\"}"),
        0.0
    );
    let _back = Subserver::start(&sub_config, &server_addr(&front_config));
    let started = Instant::now();
    while server.get("/health").status != 200 {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "not reconnected"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let again = server.post("/v1/completions", &body(8).replace("true", "false"));
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.json()["usage"]["completion_tokens"], 8);
    assert_eq!(
        server.metric("tokenrouter_link{counter=\"up\",model=\"llm\"}"),
        1.0
    );
    assert_eq!(
        server.metric("tokenrouter_link{counter=\"reconnects\",model=\"llm\"}"),
        1.0
    );
    assert!(server.metric("tokenrouter_link{counter=\"frames_in\",model=\"llm\"}") > 0.0);
    assert!(server.metric("tokenrouter_link_rtt_seconds{model=\"llm\"}") > 0.0);
}
