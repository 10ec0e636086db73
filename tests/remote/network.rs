//! Subservers on another network host (a namespace) and links secured by mutual TLS.

use super::*;

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
