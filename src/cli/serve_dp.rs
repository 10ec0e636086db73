//! `tokenrouter serve --dp-size N`: N server processes on consecutive ports after the
//! gateway's, each started from this binary with the same config, then the gateway in front
//! once every one answers `/health`. A server that exits while the gateway runs is started
//! again on its port. The servers are stopped (SIGTERM) when the gateway exits, and die with
//! it if it is killed.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Server processes, watched: one that exits while the gateway runs (killed, crashed) is
/// started again on its port, and the gateway takes it back once its health checks pass.
/// Stopped (SIGTERM) on drop.
pub struct Servers {
    children: Arc<Mutex<Vec<Child>>>,
    stopping: Arc<AtomicBool>,
    watcher: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Servers {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        if let Some(watcher) = self.watcher.take() {
            let _ = watcher.join();
        }
        let mut children = self.children.lock().unwrap_or_else(|e| e.into_inner());
        for child in children.iter_mut() {
            // SIGTERM lets a server finish its in-flight requests.
            let pid = child.id() as libc::pid_t;
            // SAFETY: kill(2) on a pid we spawned and have not reaped.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        for child in children.iter_mut() {
            let _ = child.wait();
        }
    }
}

/// How to start the server on one port.
#[derive(Clone)]
struct Launch {
    exe: std::path::PathBuf,
    server_args: Vec<String>,
    env: Vec<(String, String)>,
}

impl Launch {
    fn spawn(&self, port: u16) -> anyhow::Result<Child> {
        let mut command = Command::new(&self.exe);
        command
            .arg("serve")
            .args(&self.server_args)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env_remove("TOKENROUTER_DP_SIZE");
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl is async-signal-safe; it only asks for SIGTERM when we die.
            unsafe {
                command.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                    Ok(())
                });
            }
        }
        command
            .spawn()
            .map_err(|e| anyhow::anyhow!("starting server on port {port}: {e}"))
    }
}

/// Restarts servers that exit until `stopping`, checking every `every`. A server starts again
/// a second after it exits; one that keeps dying waits twice as long each time (up to a
/// minute), and a minute up resets that.
fn watch(
    children: Arc<Mutex<Vec<Child>>>,
    ports: Vec<u16>,
    launch: Launch,
    stopping: Arc<AtomicBool>,
    every: Duration,
) {
    const FIRST: Duration = Duration::from_secs(1);
    const LONGEST: Duration = Duration::from_secs(60);
    let n = ports.len();
    let mut started = vec![Instant::now(); n];
    let mut backoff = vec![FIRST; n];
    let mut next_start: Vec<Option<Instant>> = vec![None; n];
    while !stopping.load(Ordering::SeqCst) {
        std::thread::sleep(every);
        let mut children = children.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        for (i, &port) in ports.iter().enumerate() {
            if stopping.load(Ordering::SeqCst) {
                return;
            }
            match next_start[i] {
                None => {
                    if let Ok(Some(status)) = children[i].try_wait() {
                        if started[i].elapsed() > LONGEST {
                            backoff[i] = FIRST;
                        }
                        eprintln!(
                            "server on port {port} exited ({status}); starting it again in {:?}",
                            backoff[i]
                        );
                        next_start[i] = Some(now + backoff[i]);
                        backoff[i] = (backoff[i] * 2).min(LONGEST);
                    }
                }
                Some(at) if now >= at => match launch.spawn(port) {
                    Ok(child) => {
                        children[i] = child;
                        started[i] = now;
                        next_start[i] = None;
                    }
                    Err(e) => {
                        eprintln!("{e}; trying again in {:?}", backoff[i]);
                        next_start[i] = Some(now + backoff[i]);
                        backoff[i] = (backoff[i] * 2).min(LONGEST);
                    }
                },
                Some(_) => {}
            }
        }
    }
}

/// `GET /health` over a bare connection; true on a 200.
fn healthy(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let request = format!("GET /health HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).is_ok() && head.ends_with(b"200")
}

/// Starts `n` servers with `server_args` plus their port; returns their URLs and the guard.
pub fn start(
    n: usize,
    first_port: u16,
    server_args: &[String],
    env: &[(&str, String)],
    ready_within: Duration,
) -> anyhow::Result<(Vec<String>, Servers)> {
    let launch = Launch {
        exe: std::env::current_exe()?,
        server_args: server_args.to_vec(),
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect(),
    };
    let ports: Vec<u16> = (0..n as u16).map(|i| first_port + i).collect();
    // A taken port would only show as a server exiting early; name it before starting any.
    for (i, &port) in ports.iter().enumerate() {
        if let Err(e) = TcpListener::bind(("127.0.0.1", port)) {
            anyhow::bail!(
                "port {port} for server {} of {n} (the ports after --port) is not free ({e}); choose another --port",
                i + 1
            );
        }
    }
    let mut servers = Servers {
        children: Arc::default(),
        stopping: Arc::default(),
        watcher: None,
    };
    for &port in &ports {
        let child = launch.spawn(port)?;
        servers.children.lock().unwrap().push(child);
    }
    let deadline = Instant::now() + ready_within;
    for (i, &port) in ports.iter().enumerate() {
        while !healthy(port) {
            if let Some(status) = servers.children.lock().unwrap()[i].try_wait()? {
                anyhow::bail!("the server on port {port} exited ({status}) before it was healthy");
            }
            if Instant::now() > deadline {
                anyhow::bail!("the server on port {port} was not healthy within {ready_within:?}");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        eprintln!("server {} of {n} healthy on port {port}", i + 1);
    }
    let urls = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    let (children, stopping) = (servers.children.clone(), servers.stopping.clone());
    servers.watcher = Some(std::thread::spawn(move || {
        watch(
            children,
            ports,
            launch,
            stopping,
            Duration::from_millis(200),
        )
    }));
    Ok((urls, servers))
}
