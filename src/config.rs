//! `config.toml`: the configured models, the routing algorithm, the scheduler and the memory
//! budget. Unknown keys are rejected; defaults live here; [`Config::load`] validates and names
//! the key and the fix on error.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::kernels::attention::MAX_BLOCK_SIZE;
use crate::model::KvDtype;

mod device;
mod routing;
pub use device::DeviceSpec;
pub use routing::{DraftTokens, QueryRule, RoutingConfig, MAX_DRAFT_TOKENS};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config {path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub models: Vec<ModelEntry>,
    #[serde(default)]
    pub kv_cache: KvCacheSettings,
    #[serde(default)]
    pub memory: MemorySettings,
    #[serde(default)]
    pub routing: RoutingConfig,
    #[serde(default)]
    pub scheduler: SchedulerSettings,
    #[serde(default)]
    pub server: ServerSettings,
    #[serde(default)]
    pub compute: ComputeSettings,
}

/// How models placed on `device = "cpu"` share the cores.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ComputeSettings {
    /// `shared`: they form one device over every core, with one compute pool, and take turns
    /// step by step. `by-size`: each becomes a device of its own, on a disjoint set of cores
    /// sized in proportion to its weight bytes, and they run side by side.
    pub split: CoreSplit,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CoreSplit {
    #[default]
    Shared,
    BySize,
}

/// `tokenrouter serve`: where to listen and how much to take on.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerSettings {
    pub host: String,
    pub port: u16,
    /// Requests admitted at once (running or waiting); more get 503 with `Retry-After`.
    pub max_requests: usize,
    /// Seconds (fractions allowed) a request may run; 0 means no limit.
    pub request_timeout_s: f64,
    /// When set, every route but `/health` needs `Authorization: Bearer <api_key>`.
    pub api_key: Option<String>,
    pub max_body_mb: usize,
    /// HTTP worker threads (they only parse and format; models run on their own threads).
    pub workers: usize,
    /// Seconds an idle keep-alive connection stays open.
    pub keep_alive_s: f64,
}

impl Default for ServerSettings {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 30000,
            max_requests: 256,
            request_timeout_s: 0.0,
            api_key: None,
            max_body_mb: 8,
            workers: 2,
            keep_alive_s: 5.0,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelEntry {
    pub name: String,
    /// GGUF file or Hugging Face directory; relative paths are resolved against the config file.
    /// With `remote`, only the subserver reads it (and the entry may leave it out).
    #[serde(default)]
    pub path: PathBuf,
    /// What two-model routing algorithms call this model. With exactly two models and no
    /// roles, the first is the SLM and the second the LLM.
    #[serde(default)]
    pub role: Option<Role>,
    /// Delayed batching: launch a step once this many requests are ready here (or the oldest
    /// has waited `scheduler.max_wait_ms`).
    #[serde(default = "default_batch_threshold")]
    pub batch_threshold: usize,
    /// Compute threads of this model's device (models sharing a device must agree). Unset:
    /// one per core of the device.
    #[serde(default)]
    pub threads: Option<usize>,
    /// Where the model computes: `cpu` (default), `cpu:A-B` (these cores, threads pinned) or
    /// `cuda:N`. Models naming the same CPU device take turns on it; models on one GPU run side
    /// by side, each on its own stream.
    #[serde(default)]
    pub device: DeviceSpec,
    /// On a GPU, run every decode step launch by launch instead of replaying the CUDA graph
    /// recorded for its batch size (vLLM's `enforce_eager`): slower, for comparison and
    /// for debugging.
    #[serde(default)]
    pub enforce_eager: bool,
    /// Random weights of a known shape (`NAME[:FORMAT]`, as `bench-model --random`) instead
    /// of `path`'s, which then only gives the tokenizer: for speed runs at a published model's
    /// size without its file.
    #[serde(default)]
    pub random: Option<String>,
    /// Quantize the layer matrices to this format at load (`q4_0`, `q4_1`, `q5_0`, `q8_0`,
    /// `q4_k`, `q6_k`) where it stores them in fewer bits than the checkpoint: fewer bytes a
    /// decode step, some accuracy lost. For a speculative-decoding drafter it costs only
    /// acceptance.
    #[serde(default)]
    pub quantize: Option<crate::model::Quantize>,
    /// `HOST:PORT` of a subserver hosting this model (`tokenrouter subserver`): the front server
    /// connects there instead of loading the model.
    #[serde(default)]
    pub remote: Option<String>,
    /// The shared secret both ends of a `remote` link prove they hold (a file of at least 16
    /// bytes; relative paths are resolved against the config file).
    #[serde(default)]
    pub secret_file: Option<PathBuf>,
    /// TLS for the `remote` link: the CA (PEM) that signed the subserver's certificate.
    #[serde(default)]
    pub tls_ca: Option<PathBuf>,
    /// The certificate (PEM) this front presents to a subserver that asks for one
    /// (`--tls-client-ca`), with `tls_key`; it stands in for `secret_file`.
    #[serde(default)]
    pub tls_cert: Option<PathBuf>,
    #[serde(default)]
    pub tls_key: Option<PathBuf>,
    /// The name the subserver's certificate must bear (default: the host part of `remote`).
    #[serde(default)]
    pub tls_server_name: Option<String>,
}

fn default_batch_threshold() -> usize {
    1
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Slm,
    Llm,
}

/// One memory budget for the KV caches of all models.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MemorySettings {
    /// MiB (fractions allowed) for the KV caches of all models on CPUs together.
    pub kv_budget_mb: f64,
    /// The fraction of a GPU's memory the models placed on it may take in all: their KV
    /// caches get what is free of it once they are loaded, less the rest (vLLM's
    /// `gpu_memory_utilization`).
    pub gpu_memory_utilization: f64,
}

impl Default for MemorySettings {
    fn default() -> Self {
        Self {
            kv_budget_mb: 1024.0,
            gpu_memory_utilization: 0.9,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SchedulingMode {
    /// Asynchronous actors with delayed batching (`batch_threshold` per model).
    Delayed,
    /// Asynchronous actors that launch as soon as anything is ready.
    Eager,
    /// Lock-step: every model's step waits for all models' previous step.
    Sync,
}

/// Where delayed-batching thresholds come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ThresholdSource {
    /// `batch_threshold` of each model.
    Fixed,
    /// The throughput model, re-solved online as concurrency and routing drift (two models
    /// with SLM and LLM roles; step latencies are profiled at start-up).
    Auto,
}

impl std::str::FromStr for SchedulingMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "delayed" => Ok(Self::Delayed),
            "eager" => Ok(Self::Eager),
            "sync" => Ok(Self::Sync),
            other => Err(format!(
                "'{other}' is not a scheduling mode (delayed, eager, sync)"
            )),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SchedulerSettings {
    pub mode: SchedulingMode,
    pub thresholds: ThresholdSource,
    /// Delayed batching never holds a ready request longer than this.
    pub max_wait_ms: u64,
    /// Tokens one forward pass computes at most (prefill chunks fill what decodes leave).
    pub max_batch_tokens: usize,
    /// Requests one forward pass holds at most.
    pub max_batch_requests: usize,
}

impl Default for SchedulerSettings {
    fn default() -> Self {
        Self {
            mode: SchedulingMode::Delayed,
            thresholds: ThresholdSource::Fixed,
            max_wait_ms: 20,
            max_batch_tokens: 256,
            max_batch_requests: 64,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvCacheSettings {
    pub block_size: usize,
    /// What K and V are stored as: `f16` (half the memory, half the bytes attention reads)
    /// or `f32`.
    pub dtype: KvDtype,
}

impl Default for KvCacheSettings {
    fn default() -> Self {
        Self {
            block_size: 16,
            dtype: KvDtype::default(),
        }
    }
}

impl Config {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let invalid = |reason: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            reason,
        };
        let mut config: Config =
            toml::from_str(&text).map_err(|e| invalid(e.message().to_string()))?;
        config.validate().map_err(invalid)?;
        let base = path.parent().unwrap_or(Path::new("."));
        for m in &mut config.models {
            if m.path.is_relative() && !m.path.as_os_str().is_empty() {
                m.path = base.join(&m.path);
            }
            let files = [
                &mut m.secret_file,
                &mut m.tls_ca,
                &mut m.tls_cert,
                &mut m.tls_key,
            ];
            for file in files.into_iter().flatten().filter(|p| p.is_relative()) {
                *file = base.join(&*file);
            }
        }
        if let Some(router) = config.routing.router_path().filter(|p| p.is_relative()) {
            *router = base.join(&*router);
        }
        Ok(config)
    }

    /// One model served alone (`routing.algorithm = "single"`, fixed thresholds), every
    /// other setting at its default: what `generate --model` runs.
    pub fn alone(name: &str, path: PathBuf) -> Self {
        Self {
            models: vec![ModelEntry {
                name: name.into(),
                path,
                role: None,
                batch_threshold: default_batch_threshold(),
                threads: None,
                device: DeviceSpec::default(),
                enforce_eager: false,
                random: None,
                quantize: None,
                remote: None,
                secret_file: None,
                tls_ca: None,
                tls_cert: None,
                tls_key: None,
                tls_server_name: None,
            }],
            kv_cache: KvCacheSettings::default(),
            memory: MemorySettings::default(),
            routing: RoutingConfig::Single { model: None },
            scheduler: SchedulerSettings {
                thresholds: ThresholdSource::Fixed,
                ..SchedulerSettings::default()
            },
            server: ServerSettings::default(),
            compute: ComputeSettings::default(),
        }
    }

    /// Checks the settings together; the error says what to fix.
    pub fn validate(&self) -> Result<(), String> {
        if self.models.is_empty() {
            return Err(
                "[[models]] is empty: add at least one model with a name and a path".into(),
            );
        }
        for (i, m) in self.models.iter().enumerate() {
            if m.name.is_empty() {
                return Err(format!("models[{i}].name is empty"));
            }
            if self.models[..i].iter().any(|o| o.name == m.name) {
                return Err(format!(
                    "models[{i}].name '{}' is used twice; names must be unique",
                    m.name
                ));
            }
        }
        for (i, m) in self.models.iter().enumerate() {
            if m.batch_threshold == 0 {
                return Err(format!("models[{i}].batch_threshold must be at least 1"));
            }
            if let Some(shape) = &m.random {
                crate::model::random::parse(shape)
                    .map_err(|e| format!("models[{i}].random = \"{shape}\": {e}"))?;
                if m.quantize.is_some() {
                    return Err(format!(
                        "models[{i}]: `quantize` applies to a checkpoint's weights, not `random` \
                         ones; give the format in random = \"NAME:FORMAT\""
                    ));
                }
            }
            if m.path.as_os_str().is_empty() && m.remote.is_none() {
                return Err(format!(
                    "models[{i}] ('{}') has no path: give the model's file (or `remote`, a subserver hosting it)",
                    m.name
                ));
            }
            if let Some(remote) = &m.remote {
                let port = remote.rsplit_once(':').map(|(_, p)| p.parse::<u16>());
                if !matches!(port, Some(Ok(p)) if p > 0) {
                    return Err(format!(
                        "models[{i}].remote = \"{remote}\": expected HOST:PORT, as the subserver's --listen"
                    ));
                }
                if m.tls_cert.is_some() != m.tls_key.is_some() {
                    return Err(format!(
                        "models[{i}]: tls_cert and tls_key go together (the certificate and its private key)"
                    ));
                }
                if m.tls_cert.is_some() && m.tls_ca.is_none() {
                    return Err(format!(
                        "models[{i}]: tls_cert needs tls_ca, the CA that signed the subserver's certificate"
                    ));
                }
                if m.secret_file.is_none() && m.tls_cert.is_none() {
                    return Err(format!(
                        "models[{i}].remote needs secret_file (or tls_ca, tls_cert and tls_key): a subserver accepts only peers that prove its shared secret or present a certificate it trusts"
                    ));
                }
            } else if m.secret_file.is_some()
                || m.tls_ca.is_some()
                || m.tls_cert.is_some()
                || m.tls_server_name.is_some()
            {
                return Err(format!(
                    "models[{i}] ('{}'): secret_file and the tls_ settings are for a `remote` model",
                    m.name
                ));
            }
            if m.threads == Some(0) {
                return Err(format!(
                    "models[{i}].threads must be at least 1 (or left out: one per core of the device)"
                ));
            }
        }
        self.validate_devices()?;
        self.validate_routing()?;
        let paired = self.models.len() == 2
            && self.role_index(Role::Slm).is_some()
            && self.role_index(Role::Llm).is_some();
        if self.scheduler.thresholds == ThresholdSource::Auto && !paired {
            return Err(
                "scheduler.thresholds = \"auto\" needs exactly two models, an SLM and an LLM"
                    .into(),
            );
        }
        let s = &self.scheduler;
        if s.max_batch_tokens == 0 || s.max_batch_requests == 0 {
            return Err(
                "scheduler.max_batch_tokens and scheduler.max_batch_requests must be at least 1"
                    .into(),
            );
        }
        let sv = &self.server;
        if sv.request_timeout_s.is_nan() || sv.request_timeout_s < 0.0 {
            return Err("server.request_timeout_s must be >= 0 (0: no limit)".into());
        }
        if !(sv.keep_alive_s > 0.0 && sv.keep_alive_s <= 86_400.0) {
            return Err(
                "server.keep_alive_s must be a number of seconds above 0, at most a day".into(),
            );
        }
        if sv.max_requests == 0 || sv.workers == 0 || sv.max_body_mb == 0 {
            return Err(
                "server.max_requests, server.workers and server.max_body_mb must be at least 1"
                    .into(),
            );
        }
        if self.memory.kv_budget_mb.is_nan() || self.memory.kv_budget_mb <= 0.0 {
            return Err("memory.kv_budget_mb must be a positive number of MiB".into());
        }
        let u = self.memory.gpu_memory_utilization;
        if !(u > 0.0 && u <= 1.0) {
            return Err(format!(
                "memory.gpu_memory_utilization = {u}: give a fraction above 0, at most 1"
            ));
        }
        let bs = self.kv_cache.block_size;
        if bs == 0 || bs > MAX_BLOCK_SIZE {
            return Err(format!(
                "kv_cache.block_size = {bs}: must be between 1 and {MAX_BLOCK_SIZE}"
            ));
        }
        Ok(())
    }

    /// Devices never overlap unless they are the same device, models on one device agree on
    /// its threads, and no device needs a backend this build lacks.
    fn validate_devices(&self) -> Result<(), String> {
        for (i, m) in self.models.iter().enumerate() {
            if let (DeviceSpec::Cuda(_), false) = (&m.device, cfg!(feature = "cuda")) {
                return Err(format!(
                    "models[{i}].device = \"{}\": this build has no CUDA backend; build with `--features cuda`, or use \"cpu\" or a core set such as \"cpu:0-7\"",
                    m.device
                ));
            }
            if !m.device.is_cpu() && self.kv_cache.dtype != KvDtype::F16 {
                return Err(format!(
                    "models[{i}].device = \"{}\" keeps its KV cache in f16: set kv_cache.dtype = \"f16\"",
                    m.device
                ));
            }
            for (j, o) in self.models[..i].iter().enumerate() {
                if o.device != m.device && o.device.overlaps(&m.device) {
                    return Err(format!(
                        "models[{j}].device = \"{}\" and models[{i}].device = \"{}\" share cores; give them the same device (they take turns) or disjoint core sets (they run side by side)",
                        o.device, m.device
                    ));
                }
                if o.device == m.device
                    && o.threads.is_some()
                    && m.threads.is_some()
                    && o.threads != m.threads
                {
                    return Err(format!(
                        "models[{j}] and models[{i}] share device \"{}\" but ask for different threads; models on one device share its compute pool",
                        m.device
                    ));
                }
            }
        }
        Ok(())
    }

    /// Keeps only model `name`, served alone (`routing.algorithm = "single"`, fixed
    /// thresholds).
    pub fn serve_alone(&mut self, name: &str) -> Result<(), String> {
        let Some(entry) = self.model(name).cloned() else {
            let names: Vec<&str> = self.models.iter().map(|m| m.name.as_str()).collect();
            return Err(format!(
                "--single {name}: the config has no model of that name (models: {})",
                names.join(", ")
            ));
        };
        self.models = vec![entry];
        self.routing = RoutingConfig::Single { model: None };
        self.scheduler.thresholds = ThresholdSource::Fixed;
        Ok(())
    }

    pub fn model(&self, name: &str) -> Option<&ModelEntry> {
        self.models.iter().find(|m| m.name == name)
    }

    /// Index of the model playing `role`: the one marked so, or by position when exactly two
    /// models carry no roles.
    /// For commands that compute every model themselves: an error naming the first remote one.
    pub fn require_local(&self, command: &str) -> Result<(), String> {
        match self.models.iter().find(|m| m.remote.is_some()) {
            Some(m) => Err(format!(
                "{command} computes every model in this process; model '{}' is remote (drop its `remote` line, keeping its path)",
                m.name
            )),
            None => Ok(()),
        }
    }

    pub fn role_index(&self, role: Role) -> Option<usize> {
        if let Some(i) = self.models.iter().position(|m| m.role == Some(role)) {
            return Some(i);
        }
        let unmarked = self.models.len() == 2 && self.models.iter().all(|m| m.role.is_none());
        unmarked.then_some(match role {
            Role::Slm => 0,
            Role::Llm => 1,
        })
    }
}

#[cfg(test)]
mod tests;
