//! TLS under a link (rustls, optional): the subserver presents a certificate, which the front
//! checks against its CA, and may require one of the front in turn (mutual TLS), refusing in
//! the TLS handshake, before any of this protocol's messages, a front that has none signed by
//! its client CA. A shared secret, when both sides have one, is then proved inside the
//! encrypted stream ([`super::handshake`]).

use std::io;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// What a link runs over: a TCP stream, or TLS over one.
pub trait LinkIo: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> LinkIo for T {}
pub type Io = Box<dyn LinkIo>;

/// *ring*'s suites: it builds with a C compiler alone. Its key exchange has no post-quantum
/// group (rustls deprecates it for that); aws-lc-rs, which has one, needs a longer native build.
#[allow(deprecated)]
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let read = |e: rustls::pki_types::pem::Error| format!("{}: {e}", path.display());
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(read)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(read)?;
    if certs.is_empty() {
        return Err(format!("{}: no PEM certificate in it", path.display()));
    }
    Ok(certs)
}

fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| format!("{}: {e}", path.display()))
}

fn roots(path: &Path) -> Result<Arc<RootCertStore>, String> {
    let mut roots = RootCertStore::empty();
    for cert in certificates(path)? {
        roots
            .add(cert)
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(Arc::new(roots))
}

/// A certificate and its private key, as PEM files.
#[derive(Debug, Clone, Copy)]
pub struct Identity<'a> {
    pub cert: &'a Path,
    pub key: &'a Path,
}

/// The subserver's side.
pub struct ServerTls {
    acceptor: TlsAcceptor,
}

impl ServerTls {
    /// Presents `identity`; with `client_ca`, takes only fronts whose certificate it signed.
    pub fn new(identity: Identity, client_ca: Option<&Path>) -> Result<Self, String> {
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?;
        let builder = match client_ca {
            Some(ca) => {
                let verifier = WebPkiClientVerifier::builder_with_provider(roots(ca)?, provider())
                    .build()
                    .map_err(|e| format!("{}: {e}", ca.display()))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let config = builder
            .with_single_cert(certificates(identity.cert)?, private_key(identity.key)?)
            .map_err(|e| format!("{}: {e}", identity.key.display()))?;
        Ok(Self {
            acceptor: TlsAcceptor::from(Arc::new(config)),
        })
    }

    pub async fn accept(&self, stream: TcpStream) -> io::Result<Io> {
        Ok(Box::new(self.acceptor.accept(stream).await?))
    }
}

/// The front's side of one link.
pub struct ClientTls {
    connector: TlsConnector,
    name: ServerName<'static>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ClientTls({:?})", self.name)
    }
}

impl ClientTls {
    /// Takes a subserver whose certificate `ca` signed for `server_name`; presents
    /// `identity`, when given, to subservers that ask for a certificate.
    pub fn new(ca: &Path, identity: Option<Identity>, server_name: &str) -> Result<Self, String> {
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots(ca)?);
        let config = match identity {
            Some(id) => builder
                .with_client_auth_cert(certificates(id.cert)?, private_key(id.key)?)
                .map_err(|e| format!("{}: {e}", id.key.display()))?,
            None => builder.with_no_client_auth(),
        };
        let name = ServerName::try_from(server_name.to_string())
            .map_err(|e| format!("server name \"{server_name}\": {e}"))?;
        Ok(Self {
            connector: TlsConnector::from(Arc::new(config)),
            name,
        })
    }

    pub async fn connect(&self, stream: TcpStream) -> io::Result<Io> {
        Ok(Box::new(
            self.connector.connect(self.name.clone(), stream).await?,
        ))
    }
}

/// The host part of `HOST:PORT` (an IPv6 address without its brackets): the name a
/// subserver's certificate is checked for unless the config gives another.
pub fn host_of(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(host, _)| host);
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_of_an_address() {
        assert_eq!(host_of("10.0.0.2:7100"), "10.0.0.2");
        assert_eq!(host_of("gpu-1.lan:7100"), "gpu-1.lan");
        assert_eq!(host_of("[::1]:7100"), "::1");
    }

    #[test]
    fn unreadable_or_empty_pem_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "no certificate here\n").unwrap();
        let err = ClientTls::new(&empty, None, "localhost").unwrap_err();
        assert!(err.contains("empty.pem: no PEM certificate"), "{err}");
        let missing = dir.path().join("missing.pem");
        let err = ClientTls::new(&missing, None, "localhost").unwrap_err();
        assert!(err.contains("missing.pem"), "{err}");
    }
}
