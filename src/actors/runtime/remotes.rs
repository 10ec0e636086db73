//! Opening the links to the subservers that host a config's remote models, before the
//! runtime starts: the routing algorithm needs every model's facts, the front's limits
//! (vocabulary, context) need the remote ones', and a front whose requests start on a remote
//! model reads and writes them with that model's vocabulary.

use super::start::Locals;
use super::*;
use crate::actors::remote::handshake::{dial, Hello, LinkAuth, Secret, Welcome};
use crate::actors::remote::link_runtime;
use crate::actors::remote::protocol::Bounds;
use crate::actors::remote::remote_model::{Handover, RemoteSpec};
use crate::actors::remote::tls::{host_of, ClientTls, Identity};
use crate::actors::remote::vocabulary::vocab_digest;
use crate::model::Vocabulary;
use crate::routing::ModelFacts;

/// A link opened and started, for a [`RemoteModel`] to take over.
pub(super) struct Opened {
    pub spec: RemoteSpec,
    pub link: Handover,
}

/// What opening the links gave.
pub(super) struct Remotes {
    pub links: Vec<Opened>,
    /// Every model's facts, in config order.
    pub facts: Vec<ModelFacts>,
    /// Each remote model's vocabulary, by config index (`None` for local ones).
    pub vocabularies: Vec<Option<Vocabulary>>,
}

/// What a routing algorithm knows of a loaded model.
pub(super) fn facts_of(model: &LoadedModel) -> ModelFacts {
    ModelFacts {
        hidden_size: model.model.config().hidden_size,
        weight_bytes: model.model.streamed_weight_bytes(),
    }
}

/// Opens a link to each remote model's subserver and gives each every model's facts.
pub(super) fn open_remotes(config: &Config, locals: &Locals) -> Result<Remotes, RuntimeError> {
    let n = config.models.len();
    let mut facts: Vec<Option<ModelFacts>> = vec![None; n];
    for (i, model) in locals {
        facts[*i] = Some(facts_of(model));
    }
    let remote: Vec<ModelIndex> = (0..n).filter(|&i| facts[i].is_none()).collect();
    if remote.is_empty() {
        return Ok(Remotes {
            links: Vec::new(),
            facts: facts.into_iter().flatten().collect(),
            vocabularies: vec![None; n],
        });
    }
    // With a model of its own, the front has the subservers check their vocabulary against
    // it; without, it checks that they agree among themselves.
    let vocab = locals.first().map(|(_, m)| vocab_digest(&m.tokenizer));
    let mut dialing = Vec::new();
    for &i in &remote {
        let entry = &config.models[i];
        let auth = link_auth(entry)
            .map_err(|e| RuntimeError::Config(format!("models[{i}] ('{}'): {e}", entry.name)))?;
        // Requests may start on any of them (the routing algorithm decides, later).
        let hello = Hello::new(config, i, vocab, true);
        let addr = entry.remote.clone().expect("remote");
        dialing.push((i, addr, auth, hello));
    }
    let link_error = |i: ModelIndex, error: String| {
        RuntimeError::Config(format!(
            "model '{}' (subserver at {}): {error}",
            config.models[i].name,
            config.models[i].remote.as_deref().unwrap_or("?")
        ))
    };
    // The handshake is async; the runtime's start is not, and may run inside an actix
    // system's executor, so the links open on a thread of their own, driven by the link
    // runtime.
    let opened = std::thread::scope(|s| s.spawn(|| open_links(&dialing, facts.clone())).join())
        .map_err(|_| RuntimeError::Config("opening the links to the subservers panicked".into()))?
        .map_err(|(i, e)| link_error(i, e))?;
    let first = &opened[0].0;
    if let Some(k) = opened.iter().position(|(w, _)| w.vocab != first.vocab) {
        return Err(RuntimeError::Config(format!(
            "models '{}' and '{}' have different tokenizers, so tokens cannot be routed between them",
            config.models[remote[0]].name, config.models[remote[k]].name
        )));
    }
    let all: Vec<ModelFacts> = (0..n)
        .map(|i| {
            facts[i].unwrap_or_else(|| {
                let k = remote.iter().position(|&r| r == i).expect("remote");
                opened[k].0.facts.facts
            })
        })
        .collect();
    let vocab_size = locals
        .iter()
        .map(|(_, m)| m.model.config().vocab_size)
        .chain(opened.iter().map(|(w, _)| w.facts.vocab_size))
        .min()
        .unwrap_or(0);
    // A handoff may carry drafts past the context; the worker drops those.
    let max_len = locals
        .iter()
        .map(|(_, m)| m.model.config().context_length)
        .chain(opened.iter().map(|(w, _)| w.facts.max_len))
        .max()
        .unwrap_or(0)
        + crate::config::MAX_DRAFT_TOKENS;
    let mut vocabularies = vec![None; n];
    let mut links = Vec::new();
    for ((index, addr, auth, mut hello), (welcome, link)) in dialing.into_iter().zip(opened) {
        let vocabulary = welcome
            .vocabulary
            .ok_or_else(|| "no vocabulary in its welcome".to_string())
            .and_then(|v| v.into_vocabulary())
            .map_err(|e| link_error(index, e))?;
        vocabularies[index] = Some(vocabulary);
        // Reconnections check the vocabulary by its digest alone.
        hello.vocab = Some(welcome.vocab);
        hello.wants_vocabulary = false;
        links.push(Opened {
            spec: RemoteSpec {
                index,
                name: config.models[index].name.clone(),
                addr,
                auth,
                hello,
                facts: all.clone(),
                expected: welcome.facts,
                bounds: Bounds {
                    num_models: n,
                    vocab_size,
                    max_len,
                },
            },
            link,
        });
    }
    Ok(Remotes {
        links,
        facts: all,
        vocabularies,
    })
}

type Dialing = Vec<(ModelIndex, String, LinkAuth, Hello)>;

/// How the front proves itself to the subserver hosting `entry`, and checks it.
fn link_auth(entry: &crate::config::ModelEntry) -> Result<LinkAuth, String> {
    let secret = entry.secret_file.as_deref().map(Secret::read).transpose()?;
    let tls = match &entry.tls_ca {
        Some(ca) => {
            let identity = entry
                .tls_cert
                .as_deref()
                .zip(entry.tls_key.as_deref())
                .map(|(cert, key)| Identity { cert, key });
            let remote = entry.remote.as_deref().unwrap_or_default();
            let name = entry.tls_server_name.as_deref().unwrap_or(host_of(remote));
            Some(ClientTls::new(ca, identity, name)?)
        }
        None => None,
    };
    Ok(LinkAuth { secret, tls })
}

/// Greets every subserver, then starts every link with all the facts; returns each link's
/// welcome and socket, or the index of the model that failed and why.
fn open_links(
    dialing: &Dialing,
    mut facts: Vec<Option<ModelFacts>>,
) -> Result<Vec<(Welcome, Handover)>, (ModelIndex, String)> {
    link_runtime().block_on(async {
        let mut greeted = Vec::new();
        for (i, addr, auth, hello) in dialing {
            let g = dial(addr, auth, hello)
                .await
                .map_err(|e| (*i, e.to_string()))?;
            facts[*i] = Some(g.welcome.facts.facts);
            greeted.push((*i, g));
        }
        let all: Vec<ModelFacts> = facts.into_iter().map(Option::unwrap_or_default).collect();
        // Every subserver starts its session at once: each waits for its start only as long
        // as a handshake may take, however long another's session takes to start.
        let starting = greeted.into_iter().map(|(i, g)| {
            let all = all.clone();
            async move {
                let welcome = g.welcome.clone();
                // Frames the subserver sent once ready may be read already: they go along
                // in the link's buffer.
                let link = g.start(all).await.map_err(|e| (i, e.to_string()))?;
                Ok((welcome, link))
            }
        });
        futures_util::future::try_join_all(starting).await
    })
}
