//! A model hosted by a subserver (`tokenrouter subserver`, another process on loopback): routed
//! output through it equals the full-recompute oracle in every scheduling mode; peers without
//! the secret, plain HTTP clients and malformed frames are refused without disturbing it; and
//! when it is killed, every request it carried fails within a second, the front reports the
//! model missing, frees every block, and takes the restarted subserver back.

#[path = "../common/mod.rs"]
mod common;
mod faults;
mod network;

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

/// The subserver address a front config names.
fn server_addr(front: &Path) -> String {
    Config::load(front).unwrap().models[1]
        .remote
        .clone()
        .unwrap()
}
