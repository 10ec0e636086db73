//! Opening the links to the subservers that host a config's remote models, before the
//! runtime starts: the routing algorithm needs every model's facts, and the front's limits
//! (vocabulary, context) need the remote ones'.

use super::start::Locals;
use super::*;
use crate::actors::remote::handshake::{dial, Hello, RemoteFacts, Secret};
use crate::actors::remote::protocol::Bounds;
use crate::actors::remote::remote_model::RemoteSpec;
use crate::routing::ModelFacts;

/// A link opened and started, for a [`RemoteModel`] to take over.
pub(super) struct Opened {
    pub spec: RemoteSpec,
    pub stream: std::net::TcpStream,
}

/// What a routing algorithm knows of a loaded model.
pub(super) fn facts_of(model: &LoadedModel) -> ModelFacts {
    ModelFacts {
        hidden_size: model.model.config().hidden_size,
        weight_bytes: model.model.streamed_weight_bytes(),
    }
}

/// Opens a link to each remote model's subserver and gives each every model's facts, which
/// are returned (in config order) with the links.
pub(super) fn open_remotes(
    config: &Config,
    locals: &Locals,
) -> Result<(Vec<Opened>, Vec<ModelFacts>), RuntimeError> {
    let n = config.models.len();
    let mut facts: Vec<Option<ModelFacts>> = vec![None; n];
    for (i, model) in locals {
        facts[*i] = Some(facts_of(model));
    }
    let remote: Vec<ModelIndex> = (0..n).filter(|&i| facts[i].is_none()).collect();
    if remote.is_empty() {
        return Ok((Vec::new(), facts.into_iter().flatten().collect()));
    }
    let Some((_, lead)) = locals.first() else {
        return Err(RuntimeError::Config(
            "every model is remote: the front server computes at least the model requests start on"
                .into(),
        ));
    };
    let mut wanted = Vec::new();
    for &i in &remote {
        let entry = &config.models[i];
        let path = entry
            .secret_file
            .as_ref()
            .expect("validated: remote has a secret");
        let secret = Secret::read(path).map_err(RuntimeError::Config)?;
        let hello = Hello::new(config, i, &lead.tokenizer);
        let addr = entry.remote.clone().expect("remote");
        wanted.push((i, addr, Arc::new(secret), hello));
    }
    let link_error = |i: ModelIndex, error: String| {
        RuntimeError::Config(format!(
            "model '{}' (subserver at {}): {error}",
            config.models[i].name,
            config.models[i].remote.as_deref().unwrap_or("?")
        ))
    };
    // The handshake is async; the runtime's start is not, and may run inside an actix
    // system's executor, so the links open on a thread of their own and change hands as
    // plain sockets.
    let dialing = wanted
        .iter()
        .map(|(i, addr, secret, hello)| (*i, addr.clone(), secret.clone(), hello.clone()))
        .collect::<Vec<_>>();
    let known = facts.clone();
    let opened = std::thread::spawn(move || open_links(dialing, known))
        .join()
        .map_err(|_| RuntimeError::Config("opening the links to the subservers panicked".into()))?
        .map_err(|(i, e)| link_error(i, e))?;
    let all: Vec<ModelFacts> = (0..n)
        .map(|i| {
            facts[i].unwrap_or_else(|| {
                let k = remote.iter().position(|&r| r == i).expect("remote");
                opened[k].0.facts
            })
        })
        .collect();
    let vocab_size = locals
        .iter()
        .map(|(_, m)| m.model.config().vocab_size)
        .chain(opened.iter().map(|(f, _)| f.vocab_size))
        .min()
        .unwrap_or(0);
    let max_len = locals
        .iter()
        .map(|(_, m)| m.model.config().context_length)
        .chain(opened.iter().map(|(f, _)| f.max_len))
        .max()
        .unwrap_or(0);
    let links = wanted
        .into_iter()
        .zip(opened)
        .map(
            |((index, addr, secret, hello), (expected, stream))| Opened {
                spec: RemoteSpec {
                    index,
                    name: config.models[index].name.clone(),
                    addr,
                    secret,
                    hello,
                    facts: all.clone(),
                    expected,
                    bounds: Bounds {
                        num_models: n,
                        vocab_size,
                        max_len,
                    },
                },
                stream,
            },
        )
        .collect();
    Ok((links, all))
}

type Dialing = Vec<(ModelIndex, String, Arc<Secret>, Hello)>;

/// Greets every subserver, then starts every link with all the facts; returns each link's
/// remote facts and socket, or the index of the model that failed and why.
fn open_links(
    dialing: Dialing,
    mut facts: Vec<Option<ModelFacts>>,
) -> Result<Vec<(RemoteFacts, std::net::TcpStream)>, (ModelIndex, String)> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| (dialing[0].0, format!("cannot start an I/O runtime: {e}")))?;
    runtime.block_on(async {
        let mut greeted = Vec::new();
        for (i, addr, secret, hello) in &dialing {
            let g = dial(addr, secret, hello)
                .await
                .map_err(|e| (*i, e.to_string()))?;
            facts[*i] = Some(g.facts.facts);
            greeted.push((*i, g));
        }
        let all: Vec<ModelFacts> = facts.into_iter().map(Option::unwrap_or_default).collect();
        let mut out = Vec::new();
        for (i, g) in greeted {
            let remote = g.facts;
            let parts = g
                .start(all.clone())
                .await
                .map_err(|e| (i, e.to_string()))?
                .into_parts();
            if !parts.read_buf.is_empty() {
                return Err((
                    i,
                    "the subserver sent frames before its session began".into(),
                ));
            }
            let stream = parts.io.into_std().map_err(|e| (i, e.to_string()))?;
            out.push((remote, stream));
        }
        Ok(out)
    })
}
