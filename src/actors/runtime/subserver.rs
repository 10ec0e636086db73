//! A subserver: one model of a config, hosted for a front server in another process. It loads
//! the model once, listens, and serves one front at a time: a front that passes the handshake
//! gets a session (the model actor, its KV cache and its device, started as the runtime starts
//! a local model), which ends with the link. A front that comes back (or another one) gets a
//! new session, so a restarted front never finds state left by the old one.

use std::cell::Cell;
use std::io::Write;
use std::net::SocketAddr;

use actix::{AsyncContext, Context};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::remotes::facts_of;
use super::start::{load_model, start_local};
use super::*;
use crate::actors::remote::front_link::{Claim, FrontLink, Session};
use crate::actors::remote::handshake::{
    accept, settings, Accepted, Hello, RemoteFacts, Secret, Welcome, HANDSHAKE_TIMEOUT,
};
use crate::actors::remote::protocol::Bounds;
use crate::actors::remote::tls::{Identity, Io, ServerTls};
use crate::actors::remote::vocabulary::{vocab_digest, WireVocabulary};
use crate::model::MatmulBackend;

/// Handshakes under way at once, at most.
const MAX_PENDING: usize = 64;
/// The pause after a failed accept.
const ACCEPT_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// How a subserver is started.
pub struct SubserverArgs {
    /// The model it hosts, by name.
    pub model: String,
    /// `HOST:PORT` to listen on (port 0: any free port; the one chosen is printed).
    pub listen: String,
    /// The secret fronts must prove.
    pub secret_file: Option<PathBuf>,
    /// TLS: this subserver's certificate and key (PEM).
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// TLS: fronts must present a certificate this CA signed.
    pub tls_client_ca: Option<PathBuf>,
}

impl SubserverArgs {
    /// How fronts are authenticated, and the link encrypted; the error says what to fix.
    fn auth(&self) -> Result<(Option<Secret>, Option<ServerTls>), String> {
        let tls = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(ServerTls::new(
                Identity { cert, key },
                self.tls_client_ca.as_deref(),
            )?),
            (None, None) if self.tls_client_ca.is_some() => {
                return Err("--tls-client-ca needs --tls-cert and --tls-key".into())
            }
            (None, None) => None,
            _ => return Err("--tls-cert and --tls-key go together".into()),
        };
        if self.secret_file.is_none() && self.tls_client_ca.is_none() {
            return Err("no way to authenticate a front: give --secret-file, or --tls-client-ca (with --tls-cert and --tls-key), or both".into());
        }
        let secret = self.secret_file.as_deref().map(Secret::read).transpose()?;
        Ok((secret, tls))
    }
}

/// What every connection is checked against and served with.
struct Host {
    config: Config,
    index: ModelIndex,
    model: Arc<LoadedModel>,
    /// Each is required of a front when present.
    secret: Option<Secret>,
    tls: Option<ServerTls>,
    welcome: RemoteFacts,
    vocab: [u8; 32],
    vocabulary: WireVocabulary,
    settings: String,
    bounds: Bounds,
    busy: Arc<AtomicBool>,
}

/// Loads the model and serves front servers until the process ends. Prints
/// `subserver 'NAME' listening on ADDR` once it accepts connections.
pub fn run_subserver(
    config: Config,
    args: SubserverArgs,
    backend: MatmulBackend,
) -> Result<(), RuntimeError> {
    let names: Vec<&str> = config.models.iter().map(|m| m.name.as_str()).collect();
    let index = names.iter().position(|&n| n == args.model).ok_or_else(|| {
        RuntimeError::Config(format!(
            "--model {}: the config has no such model (it has {})",
            args.model,
            names.join(", ")
        ))
    })?;
    if config.models[index].path.as_os_str().is_empty() {
        return Err(RuntimeError::Config(format!(
            "models[{index}] ('{}') has no path: the subserver loads the model from its file",
            args.model
        )));
    }
    let (secret, tls) = args.auth().map_err(RuntimeError::Config)?;
    let model = load_model(&config, index, backend)?;
    let share = super::kv_budget::kv_shares(&config, &[(index, model.as_ref())])?.remove(0);
    let context = model.model.config().context_length;
    let welcome = RemoteFacts {
        facts: facts_of(&model),
        vocab_size: model.model.config().vocab_size,
        max_len: context.min(share.tokens),
    };
    let vocabulary = WireVocabulary::of(&model.vocabulary())
        .map_err(|e| RuntimeError::Config(format!("model '{}': its tokenizer: {e}", args.model)))?;
    let host = Arc::new(Host {
        index,
        vocab: vocab_digest(&model.tokenizer),
        vocabulary,
        settings: settings(&config),
        bounds: Bounds {
            num_models: config.models.len(),
            vocab_size: welcome.vocab_size,
            // A handoff may carry drafts past the context; the worker drops those.
            max_len: context + crate::config::MAX_DRAFT_TOKENS,
        },
        welcome,
        model,
        secret,
        tls,
        config,
        busy: Arc::default(),
    });
    actix::System::new().block_on(async move {
        let listener = TcpListener::bind(&args.listen).await.map_err(|e| {
            RuntimeError::Config(format!(
                "--listen {}: cannot listen there: {e}",
                args.listen
            ))
        })?;
        let local = listener
            .local_addr()
            .map_err(|e| RuntimeError::Config(e.to_string()))?;
        println!("subserver '{}' listening on {local}", args.model);
        let _ = std::io::stdout().flush();
        tracing::info!(model = %args.model, %local, "subserver listening");
        let pending = Arc::new(Semaphore::new(MAX_PENDING));
        loop {
            match listener.accept().await {
                Ok((stream, peer)) => {
                    // A flood of peers that never finish their handshake costs this many
                    // sockets at most; the rest are closed at once.
                    let Ok(permit) = pending.clone().try_acquire_owned() else {
                        tracing::warn!(%peer, "refused a peer: {MAX_PENDING} handshakes are under way");
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    let host = host.clone();
                    actix::spawn(async move {
                        serve_front(stream, peer, host, permit).await;
                    });
                }
                Err(e) => {
                    // Out of descriptors, say: retrying at once would only spin.
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(ACCEPT_PAUSE).await;
                }
            }
        }
    })
}

impl Host {
    fn check(&self, hello: &Hello) -> Result<(Welcome, Claim), String> {
        let names: Vec<String> = self.config.models.iter().map(|m| m.name.clone()).collect();
        let name = &names[self.index];
        if hello.models != names {
            return Err(format!(
                "the front's models are {:?}, this subserver's config has {names:?}",
                hello.models
            ));
        }
        if hello.model != self.index {
            return Err(format!(
                "the front expects model '{}' here; this subserver hosts '{name}'",
                names.get(hello.model).map_or("?", String::as_str)
            ));
        }
        if hello.vocab.is_some_and(|v| v != self.vocab) {
            return Err(format!(
                "model '{name}' has a different tokenizer from the front's models, so tokens cannot be routed between them"
            ));
        }
        if hello.settings != self.settings {
            return Err(format!(
                "the settings differ: the front runs {}; this subserver {}",
                hello.settings, self.settings
            ));
        }
        let claim = Claim::take(&self.busy)
            .ok_or_else(|| "busy: this subserver serves another front server".to_string())?;
        let welcome = Welcome {
            facts: self.welcome,
            vocab: self.vocab,
            vocabulary: hello.wants_vocabulary.then(|| self.vocabulary.clone()),
        };
        Ok((welcome, claim))
    }

    /// Starts the model's session for a front with every model's `facts`; the link actor
    /// that will serve it is started on `ctx` once the front knows.
    fn start_session(
        &self,
        facts: &[crate::routing::ModelFacts],
        claim: Claim,
        ctx: &Context<FrontLink>,
    ) -> Result<Session, RuntimeError> {
        let router = crate::routing::build(&self.config, facts)?;
        let locals = vec![(self.index, self.model.clone())];
        let started = start_local(&self.config, &locals, router)?;
        let (_, model) = started.addrs[0].clone();
        let front = ctx.address().recipient();
        model.do_send(Wire(vec![front; self.config.models.len()]));
        Ok(Session {
            index: self.index,
            model,
            bounds: self.bounds,
            arbiters: started.arbiters,
            claim: Some(claim),
            healthy: started.health[0].clone(),
        })
    }
}

async fn serve_front(
    stream: TcpStream,
    peer: SocketAddr,
    host: Arc<Host>,
    pending: OwnedSemaphorePermit,
) {
    let stream: Io = match &host.tls {
        Some(tls) => match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.accept(stream)).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => return tracing::warn!(%peer, "refused a peer: TLS: {e}"),
            Err(_) => return tracing::warn!(%peer, "refused a peer: no TLS handshake in time"),
        },
        None => Box::new(stream),
    };
    let claim = Cell::new(None);
    let accepted = accept(stream, host.secret.as_ref(), |hello| {
        let (welcome, taken) = host.check(hello)?;
        claim.set(Some(taken));
        Ok(welcome)
    })
    .await;
    let accepted: Accepted<Io> = match accepted {
        Ok(accepted) => accepted,
        Err(e) => return tracing::warn!(%peer, "refused a peer: {e}"),
    };
    drop(pending);
    let claim = claim
        .take()
        .expect("a front is accepted once its hello is taken");
    let ctx = Context::<FrontLink>::new();
    let mut session = match host.start_session(&accepted.facts, claim, &ctx) {
        Ok(session) => session,
        Err(e) => {
            tracing::error!(%peer, "cannot start a session: {e}");
            accepted
                .link
                .refuse(format!("cannot start a session: {e}"))
                .await;
            return;
        }
    };
    match accepted.link.ready().await {
        Ok(link) => {
            ctx.run(FrontLink::new(session, link, peer.to_string()));
        }
        Err(e) => {
            tracing::warn!(%peer, "the front left while its session started: {e}");
            session.stop();
        }
    }
}
