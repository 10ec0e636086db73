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
use common::oracle::routed_greedy;
use common::runtime::{collect, greedy, prompts, rules, tiny_pair, with_runtime, Pair};
use tokenrouter::actors::remote::handshake::{dial, Hello, Secret};
use tokenrouter::actors::remote::protocol::{Codec, Frame, WireMeta};
use tokenrouter::actors::{RequestEvent, Runtime};
use tokenrouter::config::Config;
use tokenrouter::model::SamplingParams;
use tokenrouter::routing::ModelFacts;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::codec::Encoder;

const SECRET: &str = "a shared secret of the test pair\n";

/// The pair's config: the LLM hosted at `remote` when given.
fn write_config(dir: &Path, name: &str, remote: Option<&str>, rest: &str) -> PathBuf {
    let remote = remote.map_or(String::new(), |addr| {
        format!("remote = \"{addr}\"\nsecret_file = \"secret\"\n")
    });
    let text = format!(
        "[[models]]\nname = \"slm\"\npath = \"slm.gguf\"\nbatch_threshold = 3\n\
         [[models]]\nname = \"llm\"\npath = \"llm.gguf\"\nbatch_threshold = 2\n{remote}\
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
        let dir = config.parent().unwrap();
        let log = dir.join(format!("subserver-{}.log", listen.replace([':', '.'], "-")));
        let mut child = Command::new(env!("CARGO_BIN_EXE_tokenrouter"))
            .args(["subserver", "--model", "llm", "--listen", listen])
            .arg("--config")
            .arg(config)
            .arg("--secret-file")
            .arg(dir.join("secret"))
            .env("TOKENROUTER_COMPUTE_THREADS", "1")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let Some(addr) = line.trim().strip_prefix("subserver 'llm' listening on ") else {
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
                let handles: Vec<_> = prompts()
                    .iter()
                    .map(|p| {
                        let mut req = greedy(p, max_tokens);
                        req.ignore_eos = true;
                        rt.submit(req)
                    })
                    .collect();
                let mut out = Vec::new();
                for h in handles {
                    out.push(collect(h, None).await);
                }
                (out, rt.stats().await)
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
            assert!(stats[1].tokens_committed > 0, "{stats:?}");
            assert!(stats[1].total_blocks > 0, "{stats:?}");
        }
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
    let err = actix::System::new()
        .block_on(async { Runtime::start(&wrong, vec![pair.models[0].clone()]).err() })
        .expect("a front with the wrong secret was taken");
    assert!(err.to_string().contains("shared secret"), "{err}");
    // A plain HTTP client, and random bytes.
    let mut http = TcpStream::connect(&sub.addr).unwrap();
    http.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    assert!(
        closes_within(http, Duration::from_secs(8)),
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
    let secret = Secret::new(SECRET.into()).unwrap();
    let hello = Hello::new(&config, 1, &pair.models[0].tokenizer);
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
            let link = dial(&sub.addr, &secret, &hello).await.unwrap();
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
    let dir = pair.dir.path().to_path_buf();
    let rest = format!("{routing}[scheduler]\nmode = \"eager\"\n");
    let sub_config = write_config(&dir, "sub.toml", None, &rest);
    let mut sub = Some(Subserver::start(&sub_config, "127.0.0.1:0"));
    let addr = sub.as_ref().unwrap().addr.clone();
    let config = front(&pair, "front.toml", &addr, &rest);
    let prompt = prompts()[3].clone();
    let want = routed_greedy(models, rule, &prompt, 12, &[]).tokens;
    with_front(&config, &pair, async |rt| {
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
                other => panic!("after {tokens} tokens: {other:?}"),
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
        let again = collect(rt.submit(req), None).await;
        assert_eq!(again.tokens, want);
        // Kept alive until the runtime's final count, which reads the subserver's blocks too.
        back
    });
}
