//! Opening a link. Before any model message, each side proves it holds the shared secret
//! without sending it (challenge–response: HMAC-SHA256 over both sides' fresh nonces, under a
//! different label for each direction); a subserver that authenticates fronts by their TLS
//! certificate instead ([`super::tls`]) may go without a secret, and says so in its challenge.
//! Then the front says which model it expects and the subserver answers with that model's
//! facts, or refuses naming what differs. Last, the front gives every model's facts, from
//! which the subserver builds the routing algorithm.

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_util::codec::Framed;

use super::codec::{Codec, ProtocolError};
use super::protocol::Frame;
use super::tls::{ClientTls, Io};
use super::vocabulary::WireVocabulary;
use crate::config::Config;
use crate::routing::{ModelFacts, ModelIndex};

/// Both sides must speak the same version; any change to a frame's layout changes it.
pub const PROTOCOL_VERSION: u32 = 3;
const MAGIC: [u8; 8] = *b"tkrouter";
/// How long a peer has to complete the handshake (a silent peer holds nothing longer).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a front waits for a subserver to start its session (its KV cache, and a first
/// forward pass that pays for lazy set-up).
pub const SESSION_START_TIMEOUT: Duration = Duration::from_secs(300);
const MIN_SECRET_BYTES: usize = 16;

/// The shared secret both sides read from a file.
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// The file's bytes, trailing whitespace left out.
    pub fn read(path: &Path) -> Result<Self, String> {
        let bytes =
            std::fs::read(path).map_err(|e| format!("secret file {}: {e}", path.display()))?;
        Self::new(bytes).map_err(|e| format!("secret file {}: {e}", path.display()))
    }

    pub fn new(mut bytes: Vec<u8>) -> Result<Self, String> {
        while bytes.last().is_some_and(u8::is_ascii_whitespace) {
            bytes.pop();
        }
        if bytes.len() < MIN_SECRET_BYTES {
            return Err(format!(
                "holds {} bytes; a secret needs at least {MIN_SECRET_BYTES} (for example `head -c 32 /dev/urandom | base64`)",
                bytes.len()
            ));
        }
        Ok(Self(bytes))
    }

    fn hmac(&self, label: &[u8], first: &[u8; 32], second: &[u8; 32]) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(label);
        mac.update(first);
        mac.update(second);
        mac
    }

    fn mac(&self, label: &[u8], first: &[u8; 32], second: &[u8; 32]) -> [u8; 32] {
        self.hmac(label, first, second)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Compares in constant time.
    fn verify(&self, label: &[u8], first: &[u8; 32], second: &[u8; 32], mac: &[u8; 32]) -> bool {
        self.hmac(label, first, second).verify_slice(mac).is_ok()
    }
}

const CLIENT: &[u8] = b"tokenrouter front";
const SERVER: &[u8] = b"tokenrouter subserver";

/// What the front expects of the subserver's model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    /// Every model's name, in config order.
    pub models: Vec<String>,
    /// The model the subserver must host.
    pub model: ModelIndex,
    /// Digest of the front's vocabulary ([`vocab_digest`]), when it computes a model itself.
    pub vocab: Option<[u8; 32]>,
    /// Whether the front asks for the model's vocabulary (requests start on that model, and
    /// the front reads and writes them with it).
    pub wants_vocabulary: bool,
    /// The routing algorithm and scheduling mode, which both sides must run alike.
    pub settings: String,
}

impl Hello {
    /// What a front with `config` (and the vocabulary digest `vocab`, if it has a model of
    /// its own) expects of the subserver hosting `model`.
    pub fn new(config: &Config, model: ModelIndex, vocab: Option<[u8; 32]>, wants: bool) -> Self {
        Self {
            models: config.models.iter().map(|m| m.name.clone()).collect(),
            model,
            vocab,
            wants_vocabulary: wants,
            settings: settings(config),
        }
    }
}

/// A subserver's answer to a hello it takes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Welcome {
    pub facts: RemoteFacts,
    /// Digest of its model's vocabulary.
    pub vocab: [u8; 32],
    /// The vocabulary itself, when the front asked for it.
    pub vocabulary: Option<WireVocabulary>,
}

/// The settings both ends of a link must share, as one line: the scheduling mode and the
/// routing algorithm (a router head by its file name and a digest of its bytes, as its folder
/// may differ by host but its weights may not).
pub fn settings(config: &Config) -> String {
    let mut routing = config.routing.clone();
    if let Some(path) = routing.router_path() {
        let digest = std::fs::read(&*path).map_or_else(
            |e| format!("unreadable: {e}"),
            |bytes| {
                let d: [u8; 32] = Sha256::digest(bytes).into();
                d[..8].iter().map(|b| format!("{b:02x}")).collect()
            },
        );
        let name = path.file_name().map(PathBuf::from).unwrap_or_default();
        *path = PathBuf::from(format!("{} (sha256 {digest}…)", name.display()));
    }
    format!(
        "mode {:?}, max_wait_ms {}, routing {routing:?}",
        config.scheduler.mode, config.scheduler.max_wait_ms
    )
}

/// What the front learns of a subserver's model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteFacts {
    pub facts: ModelFacts,
    pub vocab_size: usize,
    /// The longest sequence a request may reach there.
    pub max_len: usize,
}

#[derive(Debug, Serialize, Deserialize)]
enum Handshake {
    Challenge {
        magic: [u8; 8],
        version: u32,
        nonce: [u8; 32],
        /// Whether the front must prove the shared secret.
        proof: bool,
    },
    Response {
        version: u32,
        nonce: [u8; 32],
        /// The proof, from a front that has a secret.
        mac: Option<[u8; 32]>,
    },
    Accepted {
        /// The subserver's proof, when it has a secret.
        mac: Option<[u8; 32]>,
    },
    Hello(Hello),
    Welcome(Welcome),
    Start {
        facts: Vec<ModelFacts>,
    },
    /// The subserver's session is up: frames follow.
    Ready,
    Refused(String),
}

#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("{0}")]
    Protocol(#[from] ProtocolError),
    #[error("the peer closed the connection during the handshake")]
    Closed,
    #[error("no handshake within {} s", HANDSHAKE_TIMEOUT.as_secs())]
    Timeout,
    #[error("the peer does not speak this protocol (it sent {0})")]
    Unexpected(String),
    #[error("the peer speaks protocol version {0}; this side speaks {PROTOCOL_VERSION}")]
    Version(u32),
    #[error("the peer did not prove the shared secret")]
    WrongSecret,
    #[error("the subserver asks for the shared secret, and this side has none (set the model's secret_file)")]
    NoSecret,
    #[error("TLS: {0}")]
    Tls(std::io::Error),
    #[error("refused: {0}")]
    Refused(String),
}

type Link<S> = Framed<S, Codec<Handshake>>;

async fn next<S: AsyncRead + AsyncWrite + Unpin>(
    link: &mut Link<S>,
) -> Result<Handshake, HandshakeError> {
    match link.next().await {
        Some(Ok(Handshake::Refused(why))) => Err(HandshakeError::Refused(why)),
        Some(Ok(msg)) => Ok(msg),
        Some(Err(e)) => Err(e.into()),
        None => Err(HandshakeError::Closed),
    }
}

fn unexpected(msg: Handshake) -> HandshakeError {
    let text = format!("{msg:?}");
    HandshakeError::Unexpected(text.chars().take(80).collect())
}

fn nonce() -> [u8; 32] {
    let mut n = [0; 32];
    rand::Rng::fill(&mut rand::rng(), &mut n);
    n
}

async fn refuse<S: AsyncRead + AsyncWrite + Unpin>(
    link: &mut Link<S>,
    error: HandshakeError,
) -> HandshakeError {
    // The refusal is a courtesy: the link closes whether or not it arrives.
    let _ = link.send(Handshake::Refused(error.to_string())).await;
    error
}

/// A front that passed the handshake: its hello, every model's facts, and the link.
pub struct Accepted<S> {
    pub hello: Hello,
    pub facts: Vec<ModelFacts>,
    pub link: Starting<S>,
}

/// A link whose front waits for the subserver's session to start.
pub struct Starting<S>(Link<S>);

impl<S: AsyncRead + AsyncWrite + Unpin> Starting<S> {
    /// The session is up: tells the front; the link then carries frames.
    pub async fn ready(mut self) -> Result<Framed<S, Codec<Frame>>, HandshakeError> {
        self.0.send(Handshake::Ready).await?;
        Ok(self.0.map_codec(|_| Codec::default()))
    }

    /// The session could not start: tells the front why.
    pub async fn refuse(mut self, why: String) {
        refuse(&mut self.0, HandshakeError::Refused(why)).await;
    }
}

/// The subserver's side: `check` answers the front's hello with this model's welcome, or
/// says why they do not match.
/// Without `secret` the front's certificate must have been checked (mutual TLS).
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    io: S,
    secret: Option<&Secret>,
    check: impl FnOnce(&Hello) -> Result<Welcome, String>,
) -> Result<Accepted<S>, HandshakeError> {
    let handshake = async {
        // Every message a front sends here is small; a peer that has not proved the secret
        // makes this side buffer no more.
        let mut link: Link<S> = Framed::new(io, Codec::small());
        let ours = nonce();
        link.send(Handshake::Challenge {
            magic: MAGIC,
            version: PROTOCOL_VERSION,
            nonce: ours,
            proof: secret.is_some(),
        })
        .await?;
        let (theirs, mac) = match next(&mut link).await? {
            Handshake::Response {
                version: PROTOCOL_VERSION,
                nonce,
                mac,
            } => (nonce, mac),
            Handshake::Response { version, .. } => {
                return Err(refuse(&mut link, HandshakeError::Version(version)).await)
            }
            other => return Err(unexpected(other)),
        };
        if let Some(secret) = secret {
            if !mac.is_some_and(|mac| secret.verify(CLIENT, &ours, &theirs, &mac)) {
                return Err(refuse(&mut link, HandshakeError::WrongSecret).await);
            }
        }
        link.send(Handshake::Accepted {
            mac: secret.map(|s| s.mac(SERVER, &theirs, &ours)),
        })
        .await?;
        let hello = match next(&mut link).await? {
            Handshake::Hello(h) => h,
            other => return Err(unexpected(other)),
        };
        match check(&hello) {
            Ok(welcome) => link.send(Handshake::Welcome(welcome)).await?,
            Err(why) => return Err(refuse(&mut link, HandshakeError::Refused(why)).await),
        }
        let facts = match next(&mut link).await? {
            Handshake::Start { facts } if facts.len() == hello.models.len() => facts,
            other => return Err(unexpected(other)),
        };
        Ok(Accepted {
            hello,
            facts,
            link: Starting(link),
        })
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake)
        .await
        .map_err(|_| HandshakeError::Timeout)?
}

/// A subserver that welcomed the front, waiting for every model's facts.
pub struct Greeted<S> {
    link: Link<S>,
    pub welcome: Welcome,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Greeted<S> {
    /// Gives every model's facts and waits for the subserver's session to start; the link
    /// then carries frames.
    pub async fn start(
        mut self,
        facts: Vec<ModelFacts>,
    ) -> Result<Framed<S, Codec<Frame>>, HandshakeError> {
        self.link.send(Handshake::Start { facts }).await?;
        match tokio::time::timeout(SESSION_START_TIMEOUT, next(&mut self.link)).await {
            Ok(Ok(Handshake::Ready)) => Ok(self.link.map_codec(|_| Codec::default())),
            Ok(Ok(other)) => Err(unexpected(other)),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(HandshakeError::Timeout),
        }
    }
}

/// The front's side, up to the subserver's welcome. With `secret` the subserver must prove
/// it too.
pub async fn greet<S: AsyncRead + AsyncWrite + Unpin>(
    io: S,
    secret: Option<&Secret>,
    hello: &Hello,
) -> Result<Greeted<S>, HandshakeError> {
    let handshake = async {
        // Until the subserver proves the secret, this side buffers no more than it would.
        let mut link: Link<S> = Framed::new(io, Codec::small());
        let (theirs, proof) = match next(&mut link).await? {
            Handshake::Challenge {
                magic: MAGIC,
                version: PROTOCOL_VERSION,
                nonce,
                proof,
            } => (nonce, proof),
            Handshake::Challenge {
                magic: MAGIC,
                version,
                ..
            } => return Err(HandshakeError::Version(version)),
            other => return Err(unexpected(other)),
        };
        if proof && secret.is_none() {
            return Err(HandshakeError::NoSecret);
        }
        let ours = nonce();
        link.send(Handshake::Response {
            version: PROTOCOL_VERSION,
            nonce: ours,
            mac: secret.map(|s| s.mac(CLIENT, &theirs, &ours)),
        })
        .await?;
        match (next(&mut link).await?, secret) {
            (Handshake::Accepted { .. }, None) => {}
            (Handshake::Accepted { mac: Some(mac) }, Some(s))
                if s.verify(SERVER, &ours, &theirs, &mac) => {}
            (Handshake::Accepted { .. }, Some(_)) => return Err(HandshakeError::WrongSecret),
            (other, _) => return Err(unexpected(other)),
        }
        // The welcome may carry a vocabulary.
        let mut link = link.map_codec(|_| Codec::default());
        link.send(Handshake::Hello(hello.clone())).await?;
        match next(&mut link).await? {
            Handshake::Welcome(welcome) => Ok(Greeted { link, welcome }),
            other => Err(unexpected(other)),
        }
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake)
        .await
        .map_err(|_| HandshakeError::Timeout)?
}

/// How a front proves itself to one subserver, and checks it: a shared secret, TLS, or both.
#[derive(Debug, Default)]
pub struct LinkAuth {
    pub secret: Option<Secret>,
    pub tls: Option<ClientTls>,
}

/// [`greet`] over a new connection to `addr` (TLS when `auth` says so).
pub async fn dial(
    addr: &str,
    auth: &LinkAuth,
    hello: &Hello,
) -> Result<Greeted<Io>, HandshakeError> {
    let opening = async {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(ProtocolError::from)?;
        stream.set_nodelay(true).map_err(ProtocolError::from)?;
        match &auth.tls {
            Some(tls) => tls.connect(stream).await.map_err(HandshakeError::Tls),
            None => Ok(Box::new(stream) as Io),
        }
    };
    let io = tokio::time::timeout(HANDSHAKE_TIMEOUT, opening)
        .await
        .map_err(|_| HandshakeError::Timeout)??;
    // A subserver that refuses this side's certificate says so in an alert read here.
    greet(io, auth.secret.as_ref(), hello)
        .await
        .map_err(|e| match e {
            HandshakeError::Protocol(ProtocolError::Io(e))
                if e.get_ref().is_some_and(|inner| inner.is::<rustls::Error>()) =>
            {
                HandshakeError::Tls(e)
            }
            e => e,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> Secret {
        Secret::new(s.as_bytes().to_vec()).unwrap()
    }

    fn hello() -> Hello {
        Hello {
            models: vec!["slm".into(), "llm".into()],
            model: 1,
            vocab: Some([7; 32]),
            wants_vocabulary: false,
            settings: "delayed".into(),
        }
    }

    fn facts() -> RemoteFacts {
        RemoteFacts {
            facts: ModelFacts {
                hidden_size: 64,
                weight_bytes: 1000,
            },
            vocab_size: 256,
            max_len: 128,
        }
    }

    fn welcome() -> Welcome {
        Welcome {
            facts: facts(),
            vocab: [7; 32],
            vocabulary: None,
        }
    }

    /// Runs both sides over an in-memory pipe.
    async fn both(
        server_secret: &str,
        client_secret: &str,
        check: impl FnOnce(&Hello) -> Result<Welcome, String>,
    ) -> (
        Result<
            (
                Hello,
                Vec<ModelFacts>,
                Framed<tokio::io::DuplexStream, Codec<Frame>>,
            ),
            HandshakeError,
        >,
        Result<RemoteFacts, HandshakeError>,
    ) {
        let (a, b) = tokio::io::duplex(1 << 16);
        let (server_secret, client_secret) = (secret(server_secret), secret(client_secret));
        let server = async {
            let accepted = accept(a, Some(&server_secret), check).await?;
            let (hello, facts) = (accepted.hello, accepted.facts);
            let link = accepted.link.ready().await?;
            Ok::<_, HandshakeError>((hello, facts, link))
        };
        let client = async {
            let greeted = greet(b, Some(&client_secret), &hello()).await?;
            let facts = greeted.welcome.facts;
            greeted.start(vec![facts.facts; 2]).await?;
            Ok(facts)
        };
        tokio::join!(server, client)
    }

    fn run<T>(f: impl std::future::Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn a_shared_secret_opens_the_link() {
        let (server, client) = run(both("0123456789abcdef", "0123456789abcdef\n", |h| {
            assert_eq!(h, &hello());
            Ok(welcome())
        }));
        let (h, f, _) = server.unwrap();
        assert_eq!(h, hello());
        assert_eq!(f, vec![facts().facts; 2]);
        assert_eq!(client.unwrap(), facts());
    }

    #[test]
    fn a_wrong_secret_is_refused_before_any_hello() {
        let (server, client) = run(both("0123456789abcdef", "0123456789abcdeX", |_| {
            panic!("a hello was read from a peer without the secret")
        }));
        assert!(matches!(server, Err(HandshakeError::WrongSecret)));
        let err = client.unwrap_err().to_string();
        assert!(err.contains("shared secret"), "{err}");
    }

    #[test]
    fn a_mismatched_model_is_refused_with_the_reason() {
        let (server, client) = run(both("0123456789abcdef", "0123456789abcdef", |_| {
            Err("this subserver hosts 'other'".into())
        }));
        assert!(matches!(server, Err(HandshakeError::Refused(_))));
        let err = client.unwrap_err().to_string();
        assert!(err.contains("hosts 'other'"), "{err}");
    }

    #[test]
    fn router_heads_are_compared_by_their_bytes_not_their_folder() {
        let dir = tempfile::tempdir().unwrap();
        let config = |folder: &str, weights: &[u8]| {
            let head = dir.path().join(folder).join("head.json");
            std::fs::create_dir_all(head.parent().unwrap()).unwrap();
            std::fs::write(&head, weights).unwrap();
            let text = format!(
                "[[models]]\nname = \"slm\"\npath = \"s.gguf\"\n[[models]]\nname = \"llm\"\npath = \"l.gguf\"\n\
                 [routing]\nalgorithm = \"r2r\"\nrouter = \"{}\"\n",
                head.display()
            );
            let path = dir.path().join(format!("{folder}.toml"));
            std::fs::write(&path, text).unwrap();
            Config::load(&path).unwrap()
        };
        let here = settings(&config("a", b"weights"));
        assert_eq!(here, settings(&config("b", b"weights")));
        assert_ne!(here, settings(&config("c", b"other weights")));
        assert!(
            here.contains("head.json") && !here.contains("/a/"),
            "{here}"
        );
    }

    #[test]
    fn short_secrets_are_rejected() {
        let err = Secret::new(b"short\n".to_vec()).unwrap_err();
        assert!(err.contains("5 bytes"), "{err}");
    }
}
