//! A real `tokenrouter serve` process over two tiny random models, and a minimal HTTP/1.1
//! client (std sockets, `Connection: close`, chunked decoding) to talk to it.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::quantized::GgmlDType;
use tokenrouter::model::tiny::{write_gguf, TinySpec};
use tokenrouter::model::Architecture;

pub struct TestServer {
    pub port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

/// The tiny SLM and LLM: one tokenizer, different sizes and weights.
pub fn tiny_pair_specs() -> [(&'static str, TinySpec); 2] {
    let slm = TinySpec {
        seed: 11,
        ..TinySpec::new(Architecture::Qwen2)
    };
    let llm = TinySpec {
        seed: 12,
        hidden_size: 128,
        intermediate_size: 256,
        num_layers: 3,
        ..TinySpec::new(Architecture::Qwen2)
    };
    [("slm", slm), ("llm", llm)]
}

/// Writes the tiny SLM/LLM pair and a config with `extra` appended; returns the directory.
pub fn tiny_pair_config(extra: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, spec) in tiny_pair_specs() {
        write_gguf(
            &spec,
            &dir.path().join(format!("{name}.gguf")),
            &[GgmlDType::Q8_0],
        )
        .unwrap();
    }
    let config = format!(
        "[[models]]\nname = \"slm\"\npath = \"slm.gguf\"\n[[models]]\nname = \"llm\"\npath = \"llm.gguf\"\n\
         [routing]\nalgorithm = \"r-stitch\"\nhigh = 5.2\nlow = 5.0\n[memory]\nkv_budget_mb = 2\n\
         [kv_cache]\nblock_size = 8\n{extra}"
    );
    std::fs::write(dir.path().join("config.toml"), config).unwrap();
    dir
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A free port whose `following` successors are free too (for `serve --dp-size`, whose
/// servers take the ports after the gateway's).
pub fn free_port_run(following: u16) -> u16 {
    loop {
        let port = free_port();
        let free = (1..=following).all(|i| {
            port.checked_add(i)
                .is_some_and(|p| TcpListener::bind(("127.0.0.1", p)).is_ok())
        });
        if free {
            return port;
        }
    }
}

impl TestServer {
    /// Starts the binary on a free port and waits until `/health` answers.
    pub fn start(extra_config: &str, args: &[&str]) -> Self {
        Self::start_with_env(extra_config, args, &[])
    }

    pub fn start_with_env(extra_config: &str, args: &[&str], env: &[(&str, &str)]) -> Self {
        let dir = tiny_pair_config(extra_config);
        let config = dir.path().join("config.toml");
        let mut all = vec!["serve", "--config", config.to_str().unwrap()];
        all.extend_from_slice(args);
        Self::launch(&all, env, dir, &[200])
    }

    /// `tokenrouter gateway` over `workers`; ready once `/health` answers at all (a gateway
    /// with no healthy worker says 503).
    pub fn gateway(workers: &[&str], args: &[&str]) -> Self {
        let mut all = vec!["gateway", "--worker-urls"];
        all.extend_from_slice(workers);
        all.extend_from_slice(args);
        Self::launch(&all, &[], tempfile::tempdir().unwrap(), &[200, 503])
    }

    /// Runs the binary with `args` plus `--port` and waits for `/health` to give one of `ready`.
    pub fn launch(
        args: &[&str],
        env: &[(&str, &str)],
        dir: tempfile::TempDir,
        ready: &[u16],
    ) -> Self {
        Self::launch_on(free_port(), args, env, dir, ready)
    }

    /// [`TestServer::launch`] on a given port.
    pub fn launch_on(
        port: u16,
        args: &[&str],
        env: &[(&str, &str)],
        dir: tempfile::TempDir,
        ready: &[u16],
    ) -> Self {
        let child = Command::new(env!("CARGO_BIN_EXE_tokenrouter"))
            .envs(env.iter().copied())
            .args(args)
            .args(["--port", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut server = Self {
            port,
            child,
            _dir: dir,
        };
        let started = Instant::now();
        loop {
            let status = request(port, "GET", "/health", None, &[]).map(|r| r.status);
            if status.is_some_and(|s| ready.contains(&s)) {
                return server;
            }
            if let Some(exit) = server.child.try_wait().unwrap() {
                panic!("tokenrouter {args:?} exited early: {exit}");
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "tokenrouter {args:?} did not come up"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn post(&self, path: &str, body: &str) -> Response {
        request(self.port, "POST", path, Some(body.as_bytes()), &[]).expect("the server answers")
    }

    pub fn get(&self, path: &str) -> Response {
        request(self.port, "GET", path, None, &[]).expect("the server answers")
    }

    /// Sends SIGTERM and waits (up to a minute) for the process to exit.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "no exit after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// CPU time (user + system) the server process has used so far, in seconds.
    pub fn cpu_seconds(&self) -> f64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap();
        // Fields after the command name (which may hold spaces) start at state; utime and
        // stime are fields 14 and 15, in clock ticks.
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
        // SAFETY: sysconf reads a constant.
        ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
    }

    /// Resident memory of the server process, in bytes.
    pub fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kb = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap();
        kb * 1024
    }

    /// A value from `/metrics` (the first sample whose line starts with `prefix`).
    pub fn metric(&self, prefix: &str) -> f64 {
        let text = self.get("/metrics").body;
        text.lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The `data:` payloads of an SSE body.
    pub fn events(&self) -> Vec<String> {
        self.body
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }
}

/// Opens a connection and sends one request (raw bytes for the body).
pub fn send(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    headers: &[(&str, &str)],
) -> Option<TcpStream> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .ok()?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).ok()?;
    if let Some(b) = body {
        stream.write_all(b).ok()?;
    }
    Some(stream)
}

pub fn request(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    headers: &[(&str, &str)],
) -> Option<Response> {
    let mut stream = send(port, method, path, body, headers)?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).ok()?;
    parse_response(&raw)
}

fn parse_response(raw: &[u8]) -> Option<Response> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut lines = head.lines();
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    if chunked {
        body = dechunk(&body);
    }
    Some(Response {
        status,
        headers,
        body: String::from_utf8_lossy(&body).to_string(),
    })
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(line_end) = data.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(String::from_utf8_lossy(&data[..line_end]).trim(), 16)
            .unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = line_end + 2;
        out.extend_from_slice(&data[start..(start + size).min(data.len())]);
        data = &data[(start + size + 2).min(data.len())..];
    }
    out
}
