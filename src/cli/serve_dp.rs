//! `tokenrouter serve --dp-size N`: N server processes on consecutive ports after the
//! gateway's, each started from this binary with the same config, then the gateway in front
//! once every one answers `/health`. The servers are stopped (SIGTERM) when the gateway exits,
//! and die with it if it is killed.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// Server processes, stopped on drop.
pub struct Servers(Vec<Child>);

impl Drop for Servers {
    fn drop(&mut self) {
        for child in &mut self.0 {
            // SIGTERM lets a server finish its in-flight requests.
            let pid = child.id() as libc::pid_t;
            // SAFETY: kill(2) on a pid we spawned and have not reaped.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        for child in &mut self.0 {
            let _ = child.wait();
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
    let exe = std::env::current_exe()?;
    let mut servers = Servers(Vec::new());
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
    for &port in &ports {
        let mut command = Command::new(&exe);
        command
            .arg("serve")
            .args(server_args)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .envs(env.iter().map(|(k, v)| (k, v)))
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
        let child = command
            .spawn()
            .map_err(|e| anyhow::anyhow!("starting server on port {port}: {e}"))?;
        servers.0.push(child);
    }
    let deadline = Instant::now() + ready_within;
    for (i, &port) in ports.iter().enumerate() {
        while !healthy(port) {
            if let Some(status) = servers.0[i].try_wait()? {
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
    Ok((urls, servers))
}
