//! Opening a link. Before any model message, each side proves it holds the shared secret
//! without sending it (challenge–response: HMAC-SHA256 over both sides' fresh nonces, under a
//! different label for each direction), then the front says which model it expects and the
//! subserver answers with that model's facts, or refuses naming what differs. Last, the front
//! gives every model's facts, from which the subserver builds the routing algorithm.

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_util::codec::Framed;

use super::protocol::{Codec, Frame, ProtocolError};
use crate::config::Config;
use crate::routing::{ModelFacts, ModelIndex};

/// Both sides must speak the same version; any change to a frame's layout changes it.
pub const PROTOCOL_VERSION: u32 = 1;
const MAGIC: [u8; 8] = *b"tkrouter";
/// How long a peer has to complete the handshake (a silent peer holds nothing longer).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
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
    /// Digest of the front's vocabulary ([`vocab_digest`]).
    pub vocab: [u8; 32],
    /// The routing algorithm and scheduling mode, which both sides must run alike.
    pub settings: String,
}

impl Hello {
    /// What a front with `config` (and `tokenizer`) expects of the subserver hosting `model`.
    pub fn new(config: &Config, model: ModelIndex, tokenizer: &tokenizers::Tokenizer) -> Self {
        Self {
            models: config.models.iter().map(|m| m.name.clone()).collect(),
            model,
            vocab: vocab_digest(tokenizer),
            settings: settings(config),
        }
    }
}

/// The settings both ends of a link must share, as one line: the scheduling mode and the
/// routing algorithm (a router head by its file name, as its folder may differ by host).
pub fn settings(config: &Config) -> String {
    let mut routing = config.routing.clone();
    if let Some(path) = routing.router_path() {
        *path = path.file_name().map(PathBuf::from).unwrap_or_default();
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
    },
    Response {
        version: u32,
        nonce: [u8; 32],
        mac: [u8; 32],
    },
    Accepted {
        mac: [u8; 32],
    },
    Hello(Hello),
    Welcome(RemoteFacts),
    Start {
        facts: Vec<ModelFacts>,
    },
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
    pub link: Framed<S, Codec<Frame>>,
}

/// The subserver's side: `check` answers the front's hello with this model's facts, or says
/// why they do not match.
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    io: S,
    secret: &Secret,
    check: impl FnOnce(&Hello) -> Result<RemoteFacts, String>,
) -> Result<Accepted<S>, HandshakeError> {
    let handshake = async {
        let mut link: Link<S> = Framed::new(io, Codec::default());
        let ours = nonce();
        link.send(Handshake::Challenge {
            magic: MAGIC,
            version: PROTOCOL_VERSION,
            nonce: ours,
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
        if !secret.verify(CLIENT, &ours, &theirs, &mac) {
            return Err(refuse(&mut link, HandshakeError::WrongSecret).await);
        }
        link.send(Handshake::Accepted {
            mac: secret.mac(SERVER, &theirs, &ours),
        })
        .await?;
        let hello = match next(&mut link).await? {
            Handshake::Hello(h) => h,
            other => return Err(unexpected(other)),
        };
        match check(&hello) {
            Ok(facts) => link.send(Handshake::Welcome(facts)).await?,
            Err(why) => return Err(refuse(&mut link, HandshakeError::Refused(why)).await),
        }
        let facts = match next(&mut link).await? {
            Handshake::Start { facts } if facts.len() == hello.models.len() => facts,
            other => return Err(unexpected(other)),
        };
        Ok(Accepted {
            hello,
            facts,
            link: link.map_codec(|_| Codec::default()),
        })
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake)
        .await
        .map_err(|_| HandshakeError::Timeout)?
}

/// A subserver that welcomed the front, waiting for every model's facts.
pub struct Greeted<S> {
    link: Link<S>,
    pub facts: RemoteFacts,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Greeted<S> {
    /// Gives every model's facts; the link then carries frames.
    pub async fn start(
        mut self,
        facts: Vec<ModelFacts>,
    ) -> Result<Framed<S, Codec<Frame>>, HandshakeError> {
        self.link.send(Handshake::Start { facts }).await?;
        Ok(self.link.map_codec(|_| Codec::default()))
    }
}

/// The front's side, up to the subserver's welcome.
pub async fn greet<S: AsyncRead + AsyncWrite + Unpin>(
    io: S,
    secret: &Secret,
    hello: &Hello,
) -> Result<Greeted<S>, HandshakeError> {
    let handshake = async {
        let mut link: Link<S> = Framed::new(io, Codec::default());
        let theirs = match next(&mut link).await? {
            Handshake::Challenge {
                magic: MAGIC,
                version: PROTOCOL_VERSION,
                nonce,
            } => nonce,
            Handshake::Challenge {
                magic: MAGIC,
                version,
                ..
            } => return Err(HandshakeError::Version(version)),
            other => return Err(unexpected(other)),
        };
        let ours = nonce();
        link.send(Handshake::Response {
            version: PROTOCOL_VERSION,
            nonce: ours,
            mac: secret.mac(CLIENT, &theirs, &ours),
        })
        .await?;
        match next(&mut link).await? {
            Handshake::Accepted { mac } if secret.verify(SERVER, &ours, &theirs, &mac) => {}
            Handshake::Accepted { .. } => return Err(HandshakeError::WrongSecret),
            other => return Err(unexpected(other)),
        }
        link.send(Handshake::Hello(hello.clone())).await?;
        match next(&mut link).await? {
            Handshake::Welcome(facts) => Ok(Greeted { link, facts }),
            other => Err(unexpected(other)),
        }
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake)
        .await
        .map_err(|_| HandshakeError::Timeout)?
}

/// [`greet`] over a new TCP connection to `addr`.
pub async fn dial(
    addr: &str,
    secret: &Secret,
    hello: &Hello,
) -> Result<Greeted<TcpStream>, HandshakeError> {
    let stream = tokio::time::timeout(HANDSHAKE_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| HandshakeError::Timeout)?
        .map_err(ProtocolError::from)?;
    stream.set_nodelay(true).map_err(ProtocolError::from)?;
    greet(stream, secret, hello).await
}

/// A digest of a vocabulary (every token and its id): equal digests, equal vocabularies.
pub fn vocab_digest(tokenizer: &tokenizers::Tokenizer) -> [u8; 32] {
    let mut vocab: Vec<(u32, String)> = tokenizer
        .get_vocab(true)
        .into_iter()
        .map(|(t, id)| (id, t))
        .collect();
    vocab.sort_unstable();
    let mut hash = Sha256::new();
    for (id, token) in vocab {
        hash.update(id.to_le_bytes());
        hash.update((token.len() as u64).to_le_bytes());
        hash.update(token.as_bytes());
    }
    hash.finalize().into()
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
            vocab: [7; 32],
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

    /// Runs both sides over an in-memory pipe.
    async fn both(
        server_secret: &str,
        client_secret: &str,
        check: impl FnOnce(&Hello) -> Result<RemoteFacts, String>,
    ) -> (
        Result<Accepted<tokio::io::DuplexStream>, HandshakeError>,
        Result<RemoteFacts, HandshakeError>,
    ) {
        let (a, b) = tokio::io::duplex(1 << 16);
        let (server_secret, client_secret) = (secret(server_secret), secret(client_secret));
        let server = accept(a, &server_secret, check);
        let client = async {
            let greeted = greet(b, &client_secret, &hello()).await?;
            let facts = greeted.facts;
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
            Ok(facts())
        }));
        let accepted = server.unwrap();
        assert_eq!(accepted.hello, hello());
        assert_eq!(accepted.facts, vec![facts().facts; 2]);
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
    fn short_secrets_are_rejected() {
        let err = Secret::new(b"short\n".to_vec()).unwrap_err();
        assert!(err.contains("5 bytes"), "{err}");
    }
}
