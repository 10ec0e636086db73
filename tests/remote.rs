//! A model hosted by a subserver (`tokenrouter subserver`, another process on loopback): routed
//! output through it equals the full-recompute oracle in every scheduling mode; peers without
//! the secret, plain HTTP clients and malformed frames are refused without disturbing it; and
//! when it is killed, every request it carried fails within a second, the front reports the
//! model missing, frees every block, and takes the restarted subserver back.

mod common;

use std::io::{BufRead, BufReader, Read, Write as _};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use common::oracle::{routed_greedy, OracleToken};
use common::runtime::{
    collect, every_prompt, greedy, prompts, rules, tiny_pair, with_runtime, Pair,
};
use tokenrouter::actors::remote::codec::Codec;
use tokenrouter::actors::remote::handshake::{dial, Hello, LinkAuth, Secret};
use tokenrouter::actors::remote::protocol::{Frame, WireMeta};
use tokenrouter::actors::remote::vocabulary::vocab_digest;
use tokenrouter::actors::{RequestEvent, Runtime};
use tokenrouter::config::Config;
use tokenrouter::model::SamplingParams;
use tokenrouter::routing::ModelFacts;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::codec::Encoder;

const SECRET: &str = "a shared secret of the test pair\n";

/// The pair's config: the LLM hosted at `remote` when given.
fn write_config(dir: &Path, name: &str, remote: Option<&str>, rest: &str) -> PathBuf {
    write_config_for(dir, name, [None, remote], rest)
}

/// The pair's config, each model hosted at its `remote` when given.
fn write_config_for(dir: &Path, name: &str, remote: [Option<&str>; 2], rest: &str) -> PathBuf {
    let [slm, llm] = remote.map(|r| {
        r.map_or(String::new(), |addr| {
            format!("remote = \"{addr}\"\nsecret_file = \"secret\"\n")
        })
    });
    let text = format!(
        "[[models]]\nname = \"slm\"\npath = \"slm.gguf\"\nbatch_threshold = 3\n{slm}\
         [[models]]\nname = \"llm\"\npath = \"llm.gguf\"\nbatch_threshold = 2\n{llm}\
         [kv_cache]\nblock_size = 4\n{rest}"
    );
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    std::fs::write(dir.join("secret"), SECRET).unwrap();
    path
}

/// A subserver process hosting the LLM; killed when dropped.
struct Subserver {
    child: Child,
    addr: String,
    log: PathBuf,
}

impl Subserver {
    fn start(config: &Path, listen: &str) -> Self {
        Self::hosting("llm", config, listen)
    }

    fn hosting(model: &str, config: &Path, listen: &str) -> Self {
        let binary = &mut Command::new(env!("CARGO_BIN_EXE_tokenrouter"));
        Self::start_in(binary, model, config, listen, &secret_args(config))
    }

    /// Started by `command` (the binary, or a wrapper such as `ip netns exec`), with `auth`,
    /// the options that say how fronts are authenticated.
    fn start_in(
        command: &mut Command,
        model: &str,
        config: &Path,
        listen: &str,
        auth: &[PathBuf],
    ) -> Self {
        let dir = config.parent().unwrap();
        let log = dir.join(format!(
            "subserver-{model}-{}.log",
            listen.replace([':', '.'], "-")
        ));
        let mut child = command
            .args(["subserver", "--model", model, "--listen", listen])
            .arg("--config")
            .arg(config)
            .args(auth)
            .env("TOKENROUTER_COMPUTE_THREADS", "1")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let prefix = format!("subserver '{model}' listening on ");
        let Some(addr) = line.trim().strip_prefix(&prefix) else {
            let _ = child.wait();
            panic!(
                "{line:?}; its log: {}",
                std::fs::read_to_string(&log).unwrap()
            );
        };
        let addr = addr.to_string();
        Self { child, addr, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap()
    }
}

/// The subserver's options for the test pair's shared secret (next to `config`).
fn secret_args(config: &Path) -> Vec<PathBuf> {
    vec![
        "--secret-file".into(),
        config.parent().unwrap().join("secret"),
    ]
}

impl Drop for Subserver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn front(pair: &Pair, name: &str, addr: &str, rest: &str) -> Config {
    Config::load(&write_config(pair.dir.path(), name, Some(addr), rest)).unwrap()
}

/// Runs `body` with a front runtime computing the SLM, its LLM at the subserver.
fn with_front<T>(config: &Config, pair: &Pair, body: impl AsyncFnOnce(&Runtime) -> T) -> T {
    let slm = Pair {
        dir: tempfile::tempdir().unwrap(),
        models: vec![pair.models[0].clone()],
    };
    with_runtime(config, &slm, body)
}

#[test]
fn routed_output_through_a_remote_llm_equals_the_full_recompute_oracle_in_every_mode() {
    let pair = tiny_pair();
    let models = [&pair.models[0].model, &pair.models[1].model];
    let max_tokens = 20;
    for (rule, routing) in rules(&pair) {
        let expected: Vec<_> = prompts()
            .iter()
            .map(|p| routed_greedy(models, rule, p, max_tokens, &[]))
            .collect();
        let routed = expected
            .iter()
            .flat_map(|t| &t.tokens)
            .filter(|t| t.model == 1)
            .count();
        assert!(routed > 0, "{rule:?}: the oracle never used the LLM");
        for mode in ["delayed", "eager", "sync"] {
            let rest = format!("{routing}[scheduler]\nmode = \"{mode}\"\n");
            let dir = pair.dir.path();
            let sub = Subserver::start(
                &write_config(dir, &format!("sub-{mode}.toml"), None, &rest),
                "127.0.0.1:0",
            );
            let config = front(&pair, &format!("front-{mode}.toml"), &sub.addr, &rest);
            let (outcomes, stats) = with_front(&config, &pair, async |rt| {
                every_prompt(rt, max_tokens).await
            });
            for (i, (got, want)) in outcomes.iter().zip(&expected).enumerate() {
                assert_eq!(got.tokens, want.tokens, "{rule:?}, mode {mode}, prompt {i}");
                assert!(
                    matches!(got.terminals.as_slice(), [RequestEvent::Finished(s)] if s.completion_tokens == max_tokens),
                    "{:?}",
                    got.terminals
                );
            }
            // The subserver's counters came over the link: it computed the LLM's tokens.
            assert_eq!(stats[1].name, "llm");
            let link = stats[1]
                .link
                .as_ref()
                .expect("a remote model reports its link");
            assert!(
                link.up && link.frames_in > 0 && link.bytes_out > 0,
                "{link:?}"
            );
            assert!(stats[1].tokens_committed > 0, "{stats:?}");
            assert!(stats[1].total_blocks > 0, "{stats:?}");
        }
    }
}

#[test]
fn a_front_without_models_routes_between_two_subservers_as_one_process_does() {
    let pair = tiny_pair();
    let models = [&pair.models[0].model, &pair.models[1].model];
    let max_tokens = 16;
    let [(rule, routing), _] = rules(&pair);
    let expected: Vec<_> = prompts()
        .iter()
        .map(|p| routed_greedy(models, rule, p, max_tokens, &[]))
        .collect();
    for mode in ["delayed", "eager", "sync"] {
        let rest = format!("{routing}[scheduler]\nmode = \"{mode}\"\n");
        let dir = pair.dir.path();
        let local = write_config(dir, &format!("both-{mode}.toml"), None, &rest);
        let slm = Subserver::hosting("slm", &local, "127.0.0.1:0");
        let llm = Subserver::hosting("llm", &local, "127.0.0.1:0");
        let path = write_config_for(
            dir,
            &format!("thin-{mode}.toml"),
            [Some(&slm.addr), Some(&llm.addr)],
            &rest,
        );
        let config = Config::load(&path).unwrap();
        let no_models = Pair {
            dir: tempfile::tempdir().unwrap(),
            models: Vec::new(),
        };
        let (outcomes, stats) = with_runtime(&config, &no_models, async |rt| {
            // The front reads and writes requests with the SLM's vocabulary, sent over.
            let lead = &rt.shared().lead;
            assert_eq!(
                lead.tokenizer.get_vocab(true),
                pair.models[0].tokenizer.get_vocab(true)
            );
            assert_eq!(lead.special.eos, pair.models[0].special.eos);
            every_prompt(rt, max_tokens).await
        });
        for (i, (got, want)) in outcomes.iter().zip(&expected).enumerate() {
            assert_eq!(
                got.tokens, want.tokens,
                "mode {mode}, prompt {i}: {:?}",
                got.terminals
            );
        }
        assert!(
            stats
                .iter()
                .all(|s| s.link.is_some() && s.tokens_committed > 0),
            "{stats:?}"
        );
    }
}

/// Reads until the peer closes (or `limit` passes): whether it closed.
fn closes_within(mut stream: TcpStream, limit: Duration) -> bool {
    stream.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 4096];
    let start = Instant::now();
    while start.elapsed() < limit {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) if start.elapsed() < limit => return true,
            Ok(_) => continue,
            _ => break,
        }
    }
    false
}

/// Why a front with `config` (and the pair's SLM) could not start.
fn refused_front(config: &Config, pair: &Pair) -> String {
    actix_rt::System::new()
        .block_on(async { Runtime::start(config, vec![pair.models[0].clone()]).err() })
        .expect("the front was taken")
        .to_string()
}

/// Whether a plain HTTP request to `addr` is met by the connection closing.
fn an_http_client_is_closed(addr: &str) -> bool {
    let mut http = TcpStream::connect(addr).unwrap();
    http.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    closes_within(http, Duration::from_secs(8))
}

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

/// The subserver address a front config names.
fn server_addr(front: &Path) -> String {
    Config::load(front).unwrap().models[1]
        .remote
        .clone()
        .unwrap()
}

/// Runs `ip` with `args`, which must succeed.
fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("iproute2's `ip`");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two network namespaces joined by a veth pair, deleted when dropped.
struct Hosts {
    names: [String; 2],
    addrs: [String; 2],
}

impl Hosts {
    fn new() -> Self {
        let tag = std::process::id() % 50_000;
        let names = [format!("tr{tag}a"), format!("tr{tag}b")];
        let subnet = format!("10.{}.{}", 200 + tag % 50, tag % 250);
        let addrs = [format!("{subnet}.1"), format!("{subnet}.2")];
        for n in &names {
            ip(&["netns", "add", n]);
        }
        let hosts = Self { names, addrs };
        let [a, b] = &hosts.names;
        let (va, vb) = (format!("{a}v"), format!("{b}v"));
        ip(&[
            "link", "add", &va, "netns", a, "type", "veth", "peer", "name", &vb, "netns", b,
        ]);
        for (ns, dev, addr) in [(a, &va, &hosts.addrs[0]), (b, &vb, &hosts.addrs[1])] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        hosts
    }

    /// The binary, run in namespace `k`.
    fn command(&self, k: usize) -> Command {
        let mut c = Command::new("ip");
        c.args([
            "netns",
            "exec",
            &self.names[k],
            env!("CARGO_BIN_EXE_tokenrouter"),
        ]);
        c
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

/// `tokenrouter generate` with `config`, greedy, each token coloured by its model: stdout
/// and stderr.
fn generate(command: &mut Command, config: &Path) -> (String, String) {
    let out = command
        .args([
            "generate",
            "--prompt",
            "once upon a time",
            "--max-tokens",
            "24",
        ])
        .args(["--ignore-eos", "--show-routing", "--config"])
        .arg(config)
        .env("TOKENROUTER_COMPUTE_THREADS", "1")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    assert!(out.status.success(), "{stderr}");
    (stdout, stderr)
}

/// Needs root and iproute2 (CI runs as root; `scripts/test.sh` installs iproute2).
#[test]
fn routed_output_across_two_network_namespaces_equals_the_in_process_runtime() {
    let pair = tiny_pair();
    let [(_, routing), _] = rules(&pair);
    let dir = pair.dir.path();
    let hosts = Hosts::new();
    let local = write_config(dir, "local.toml", None, &routing);
    let sub = Subserver::start_in(
        &mut hosts.command(0),
        "llm",
        &local,
        &format!("{}:0", hosts.addrs[0]),
        &secret_args(&local),
    );
    assert!(sub.addr.starts_with(&hosts.addrs[0]), "{}", sub.addr);
    let front = write_config(dir, "front.toml", Some(&sub.addr), &routing);
    let (across, stderr) = generate(&mut hosts.command(1), &front);
    let (here, _) = generate(&mut Command::new(env!("CARGO_BIN_EXE_tokenrouter")), &local);
    assert_eq!(across, here);
    // The LLM (at the other host) made some of the tokens.
    let llm = stderr
        .split("llm ")
        .nth(1)
        .and_then(|s| s.split([',', ';']).next())
        .and_then(|n| n.trim().parse::<usize>().ok());
    assert!(llm.is_some_and(|n| n > 0), "{stderr}");
}

/// A CA and the certificates a test signs with it, as PEM files in `dir`.
struct Pki {
    ca: (rcgen::Certificate, rcgen::KeyPair),
}

impl Pki {
    fn new(dir: &Path, name: &str) -> Self {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, format!("{name} CA"));
        let cert = params.self_signed(&key).unwrap();
        std::fs::write(dir.join(format!("{name}-ca.pem")), cert.pem()).unwrap();
        Self { ca: (cert, key) }
    }

    /// Writes `NAME.pem` and `NAME.key`: a certificate for `names` (DNS names or IP
    /// addresses), for a server or a client.
    fn sign(&self, dir: &Path, name: &str, names: &[&str], server: bool) -> [PathBuf; 2] {
        let key = rcgen::KeyPair::generate().unwrap();
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = rcgen::CertificateParams::new(names).unwrap();
        params.extended_key_usages = vec![if server {
            rcgen::ExtendedKeyUsagePurpose::ServerAuth
        } else {
            rcgen::ExtendedKeyUsagePurpose::ClientAuth
        }];
        let cert = params.signed_by(&key, &self.ca.0, &self.ca.1).unwrap();
        let files = [
            dir.join(format!("{name}.pem")),
            dir.join(format!("{name}.key")),
        ];
        std::fs::write(&files[0], cert.pem()).unwrap();
        std::fs::write(&files[1], key.serialize_pem()).unwrap();
        files
    }
}

#[test]
fn mutual_tls_stands_in_for_the_secret_and_refuses_untrusted_fronts() {
    let pair = tiny_pair();
    let models = [&pair.models[0].model, &pair.models[1].model];
    let [(rule, routing), _] = rules(&pair);
    let dir = pair.dir.path();
    let (pki, rogue) = (Pki::new(dir, "link"), Pki::new(dir, "rogue"));
    let [cert, key] = pki.sign(dir, "subserver", &["127.0.0.1", "localhost"], true);
    let [front_cert, front_key] = pki.sign(dir, "front", &["front"], false);
    let [rogue_cert, rogue_key] = rogue.sign(dir, "intruder", &["front"], false);
    let rest = format!("{routing}[scheduler]\nmode = \"delayed\"\n");
    let local = write_config(dir, "tls-sub.toml", None, &rest);
    // Fronts are authenticated by their certificate alone: no secret on either side.
    let tls = [
        "--tls-cert".into(),
        cert,
        "--tls-key".into(),
        key,
        "--tls-client-ca".into(),
        dir.join("link-ca.pem"),
    ];
    let binary = &mut Command::new(env!("CARGO_BIN_EXE_tokenrouter"));
    let sub = Subserver::start_in(binary, "llm", &local, "127.0.0.1:0", &tls);
    let front_config = |name: &str, identity: &str| {
        let text = std::fs::read_to_string(&local).unwrap().replacen(
            "name = \"llm\"\n",
            &format!(
                "name = \"llm\"\nremote = \"{}\"\ntls_ca = \"link-ca.pem\"\n{identity}",
                sub.addr
            ),
            1,
        );
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        Config::load(&path).unwrap()
    };
    let refused = |config: &Config| refused_front(config, &pair);
    let identity = |cert: &Path, key: &Path| {
        format!(
            "tls_cert = \"{}\"\ntls_key = \"{}\"\n",
            cert.display(),
            key.display()
        )
    };
    // A certificate from another CA, and none at all (with a secret the subserver does not
    // ask for), are refused in the TLS handshake.
    let intruder = front_config("intruder.toml", &identity(&rogue_cert, &rogue_key));
    let err = refused(&intruder);
    assert!(err.contains("model 'llm'") && err.contains("TLS"), "{err}");
    let anonymous = front_config("anonymous.toml", "secret_file = \"secret\"\n");
    let err = refused(&anonymous);
    assert!(err.contains("model 'llm'"), "{err}");
    // A front that checks the subserver against another CA does not take it.
    let mut wrong_ca = front_config("wrong-ca.toml", &identity(&front_cert, &front_key));
    wrong_ca.models[1].tls_ca = Some(dir.join("rogue-ca.pem"));
    let err = refused(&wrong_ca);
    assert!(err.contains("TLS"), "{err}");
    // A plain TCP client (an HTTP request) is closed, unanswered.
    assert!(an_http_client_is_closed(&sub.addr), "kept open");
    // The trusted front routes exactly, over TLS.
    let trusted = front_config("trusted.toml", &identity(&front_cert, &front_key));
    let max_tokens = 16;
    let (outcomes, stats) = with_front(&trusted, &pair, async |rt| {
        every_prompt(rt, max_tokens).await
    });
    for (i, (got, p)) in outcomes.iter().zip(prompts()).enumerate() {
        let want = routed_greedy(models, rule, &p, max_tokens, &[]);
        assert_eq!(got.tokens, want.tokens, "prompt {i}");
    }
    assert!(stats[1].tokens_committed > 0, "{stats:?}");
    let log = sub.log();
    assert!(log.matches("refused a peer: TLS").count() >= 3, "{log}");
}
