//! Wiring from `config.toml`: loads the models, checks they can be routed together, splits one
//! KV memory budget between them, starts one model actor per model on its own arbiter thread,
//! and builds what request actors share. Must be used inside an actix system.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::Duration;

use actix::{Actor, Addr, Arbiter};

use super::model_actor::{GetStats, ModelActor, ModelAddr, Wire};
use super::remote::remote_model::RemoteModel;
use super::request::{GenerateRequest, RequestHandle, RuntimeShared};
use super::worker::{ModelWorker, Stepping, WorkerSetup, WorkerStats};
use crate::config::{Config, SchedulingMode};
use crate::model::{KvCache, LoadedModel, ModelError};
use crate::routing::ModelIndex;
use crate::routing::{RoutingAlgorithm, RoutingError};
use crate::scheduler::{DelayedBatching, LaunchPolicy, PublishedPrefixes, SchedulerLimits};

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The model's error is part of the message, not a source, so that an error chain printed
    /// in full (`{:#}`) says it once.
    #[error("model '{name}' ({path}): {error}")]
    Model {
        name: String,
        path: PathBuf,
        error: Box<ModelError>,
    },
    #[error(transparent)]
    Routing(#[from] RoutingError),
    #[error("{0}")]
    Config(String),
}

/// One model's share of the KV budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvShare {
    pub blocks: usize,
    pub tokens: usize,
    pub bytes: usize,
}

/// The largest common token capacity whose caches all fit in `budget_bytes`, as blocks.
pub fn split_kv_budget(
    bytes_per_token: &[usize],
    block_size: usize,
    budget_bytes: usize,
) -> Vec<KvShare> {
    let per_token: usize = bytes_per_token.iter().sum();
    let blocks = budget_bytes / (per_token * block_size).max(1);
    bytes_per_token
        .iter()
        .map(|b| KvShare {
            blocks,
            tokens: blocks * block_size,
            bytes: blocks * block_size * b,
        })
        .collect()
}

/// A running runtime: the model actors and what request actors need.
pub struct Runtime {
    shared: Arc<RuntimeShared>,
    kv: Vec<Option<KvShare>>,
    arbiters: Vec<Arbiter>,
}

mod placement;
mod remotes;
mod start;
mod subserver;
mod threads;
use remotes::{open_remotes, Remotes};
pub use start::{load_model, load_models};
pub use subserver::{run_subserver, SubserverArgs};
pub use threads::thread_budget;
