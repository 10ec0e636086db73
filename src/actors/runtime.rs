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
use crate::model::{LoadedModel, ModelError};
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

/// A running runtime: the model actors and what request actors need.
pub struct Runtime {
    shared: Arc<RuntimeShared>,
    kv: Vec<Option<KvShare>>,
    arbiters: Vec<Arbiter>,
}

mod kv_budget;
mod placement;
mod remotes;
mod start;
mod subserver;
mod threads;
pub use kv_budget::gpu_kv_budget;
use remotes::{open_remotes, Remotes};
pub use start::{load_model, load_models};
pub use subserver::{run_subserver, SubserverArgs};
pub use threads::thread_budget;
