//! Starting the runtime and talking to it.

use super::placement::{plan_devices, DevicePlan, ModelPlacement};
use super::*;
use crate::actors::executor::{Attach, DeviceExecutor};
use crate::actors::model_actor::DeviceSeat;
use crate::config::{DeviceSpec, Role, RoutingConfig, ThresholdSource};
use crate::kernels::parallel::{
    available_cores, install, pin_current_thread, process_cores, with_pool, ComputePool,
};
use crate::model::profile::{step_latencies, warm_up};
use crate::model::{ComputeTarget, MatmulBackend};
use crate::routing::ModelFacts;
use crate::scheduler::{Admission, DeviceQueue};
use crate::tuning::online::{LatencyProfile, OnlineThresholds, MAX_TUNED_CONCURRENCY};

/// Loads every configured model onto its device (`backend`: the CPU kernels of models on
/// the CPU), naming the model in any error.
pub fn load_models(
    config: &Config,
    backend: MatmulBackend,
) -> Result<Vec<Arc<LoadedModel>>, RuntimeError> {
    // Speculative decoding may give the SLM a draft vocabulary.
    let drafter = match config.routing {
        RoutingConfig::Speculative {
            draft_vocab: Some(n),
            ..
        } => config.role_index(Role::Slm).map(|slm| (slm, n)),
        _ => None,
    };
    config
        .models
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let target = match m.device {
                DeviceSpec::Cuda(n) => ComputeTarget::Cuda(n),
                DeviceSpec::Cpu | DeviceSpec::CpuCores(_) => ComputeTarget::Cpu(backend),
            };
            let draft_vocab = drafter.filter(|&(slm, _)| slm == i).map(|(_, n)| n);
            match &m.random {
                Some(_) if draft_vocab.is_some() => Err(crate::model::ModelError::Device(
                    "routing.draft_vocab reads the SLM's LM head from its file: not for random weights"
                        .into(),
                )),
                Some(shape) => LoadedModel::load_random(&m.path, shape, target),
                None => LoadedModel::load_on(&m.path, target).and_then(|mut lm| {
                    if let Some(n) = draft_vocab {
                        lm.set_draft_vocab(n)?;
                    }
                    Ok(lm)
                }),
            }
            .map(Arc::new)
            .map_err(|source| RuntimeError::Model {
                name: m.name.clone(),
                path: m.path.clone(),
                error: Box::new(source),
            })
        })
        .collect()
}

impl Runtime {
    /// Drives requests in this process: starts the runtime (as [`Runtime::start`]) in an
    /// actix system of its own on this thread, runs `body` with it, stops it, and returns
    /// what `body` returned. What `generate`, the benchmarks, the examples and the tests use.
    pub fn run<T>(
        config: &Config,
        models: Vec<Arc<LoadedModel>>,
        body: impl AsyncFnOnce(&Runtime) -> T,
    ) -> Result<T, RuntimeError> {
        Self::drive(|| Self::start(config, models), body)
    }

    /// [`Runtime::run`] with an algorithm of the caller's own (as
    /// [`Runtime::start_with_router`]).
    pub fn run_with_router<T>(
        config: &Config,
        models: Vec<Arc<LoadedModel>>,
        router: Arc<dyn RoutingAlgorithm>,
        body: impl AsyncFnOnce(&Runtime) -> T,
    ) -> Result<T, RuntimeError> {
        Self::drive(|| Self::start_with_router(config, models, router), body)
    }

    fn drive<T>(
        start: impl FnOnce() -> Result<Runtime, RuntimeError>,
        body: impl AsyncFnOnce(&Runtime) -> T,
    ) -> Result<T, RuntimeError> {
        actix::System::new().block_on(async move {
            let runtime = start()?;
            let out = body(&runtime).await;
            runtime.stop();
            Ok(out)
        })
    }

    /// Starts one model actor per entry of `models` (in `config.models` order), routing with
    /// the algorithm `config.routing` names.
    pub fn start(config: &Config, models: Vec<Arc<LoadedModel>>) -> Result<Self, RuntimeError> {
        let facts: Vec<ModelFacts> = models
            .iter()
            .map(|m| ModelFacts {
                hidden_size: m.model.config().hidden_size,
                weight_bytes: m.model.streamed_weight_bytes(),
            })
            .collect();
        let router = crate::routing::build(config, &facts)?;
        Self::start_with_router(config, models, router)
    }

    /// Like [`Runtime::start`], with an algorithm of the caller's own (`config.routing` is not
    /// read): how a new algorithm runs before it has a name in the config.
    pub fn start_with_router(
        config: &Config,
        models: Vec<Arc<LoadedModel>>,
        router: Arc<dyn RoutingAlgorithm>,
    ) -> Result<Self, RuntimeError> {
        let home = router.first_model(&[]);
        if models.len() > 1 {
            check_same_tokenizer(config, &models)?;
        }
        let bytes: Vec<usize> = models
            .iter()
            .map(|m| KvCache::bytes_per_token(m.model.config(), config.kv_cache.dtype))
            .collect();
        let block_size = config.kv_cache.block_size;
        let kv = split_kv_budget(
            &bytes,
            block_size,
            (config.memory.kv_budget_mb * (1 << 20) as f64) as usize,
        );
        if kv[0].blocks == 0 {
            return Err(RuntimeError::Config(format!(
                "memory.kv_budget_mb = {} cannot hold one block of {block_size} tokens for every model; raise it",
                config.memory.kv_budget_mb
            )));
        }
        for (m, share) in config.models.iter().zip(&kv) {
            tracing::info!(model = %m.name, blocks = share.blocks, tokens = share.tokens,
                mib = share.bytes >> 20, "KV cache share");
        }
        let s = &config.scheduler;
        let devices = start_devices(config, &models)?;
        let pools: Vec<Arc<ComputePool>> = (0..models.len())
            .map(|i| devices.of_model(i).pool.clone())
            .collect();
        // The first forward pass of a model pays for lazy set-up (weight repacking, page
        // faults, thread-pool start); pay it here rather than in the first request's latency.
        for ((entry, model), pool) in config.models.iter().zip(&models).zip(&pools) {
            with_pool(pool, || warm_up(&model.model)).map_err(|source| RuntimeError::Model {
                name: entry.name.clone(),
                path: entry.path.clone(),
                error: Box::new(source),
            })?;
        }
        let profile = online_profile(config, &models, &pools)?;
        let mut workers = Vec::new();
        let health: Vec<_> = models
            .iter()
            .map(|_| Arc::new(AtomicBool::new(true)))
            .collect();
        let prefixes: Vec<Arc<PublishedPrefixes>> = models.iter().map(|_| Arc::default()).collect();
        for (index, (entry, model)) in config.models.iter().zip(&models).enumerate() {
            let stepping = match s.mode {
                SchedulingMode::Sync => Stepping::Sync,
                SchedulingMode::Eager => Stepping::Async(LaunchPolicy::Eager),
                SchedulingMode::Delayed => {
                    Stepping::Async(LaunchPolicy::Delayed(DelayedBatching {
                        threshold: entry.batch_threshold,
                        max_wait: Duration::from_millis(s.max_wait_ms),
                    }))
                }
            };
            let setup = WorkerSetup {
                index,
                name: entry.name.clone(),
                num_models: models.len(),
                model: model.clone(),
                router: router.clone(),
                limits: SchedulerLimits {
                    block_size,
                    num_blocks: kv[index].blocks,
                    max_batch_tokens: s.max_batch_tokens,
                    max_batch_requests: s.max_batch_requests,
                },
                kv_dtype: config.kv_cache.dtype,
                stepping,
                healthy: health[index].clone(),
                prefixes: prefixes[index].clone(),
                online: profile
                    .clone()
                    .map(|p| OnlineThresholds::new(p, config.role_index(Role::Slm) == Some(index))),
            };
            let worker = ModelWorker::new(setup).map_err(|source| RuntimeError::Model {
                name: entry.name.clone(),
                path: entry.path.clone(),
                error: Box::new(source),
            })?;
            workers.push(worker);
        }
        let max_context = workers.iter().map(ModelWorker::max_len).min().unwrap_or(0);
        let mut arbiters = Vec::new();
        let mut addrs = Vec::new();
        for (index, worker) in workers.into_iter().enumerate() {
            let device = devices.of_model(index);
            let pool = device.pool.clone();
            let pinned = device.plan.pinned.clone();
            let seat = devices.seat(index);
            let arbiter = Arbiter::new();
            addrs.push(ModelActor::start_in_arbiter(&arbiter.handle(), move |_| {
                // This runs on the actor's thread: its forward passes use its device's pool.
                if !pinned.is_empty() {
                    if let Err(e) = pin_current_thread(&pinned) {
                        tracing::warn!("cannot pin a model thread to its cores: {e}");
                    }
                }
                install(pool);
                ModelActor::new(worker, seat)
            }));
            arbiters.push(arbiter);
        }
        for addr in &addrs {
            addr.do_send(Wire(addrs.iter().map(|a| a.clone().recipient()).collect()));
        }
        for device in &devices.devices {
            let grants = device
                .plan
                .models
                .iter()
                .map(|&i| addrs[i].clone().recipient())
                .collect();
            device.executor.do_send(Attach(grants));
        }
        arbiters.extend(devices.arbiters);
        let lead = models[home].clone();
        let shared = RuntimeShared {
            model_names: config.models.iter().map(|m| m.name.clone()).collect(),
            models: addrs,
            eos: lead.special.eos.clone(),
            lead: lead.clone(),
            vocab_size: models
                .iter()
                .map(|m| m.model.config().vocab_size)
                .min()
                .unwrap_or(0),
            router,
            max_context,
            health,
            prefixes,
            block_size,
            next_id: AtomicU64::new(1),
        };
        Ok(Self {
            shared: Arc::new(shared),
            kv,
            arbiters,
        })
    }

    pub fn shared(&self) -> &Arc<RuntimeShared> {
        &self.shared
    }

    pub fn kv_shares(&self) -> &[KvShare] {
        &self.kv
    }

    /// Starts a request actor for `request` on the current arbiter.
    pub fn submit(&self, request: GenerateRequest) -> RequestHandle {
        self.shared.submit(request)
    }

    /// Every model's counters, in model order.
    pub async fn stats(&self) -> Vec<WorkerStats> {
        let mut out = Vec::new();
        for addr in &self.shared.models {
            out.push(addr.send(GetStats).await.unwrap_or_default());
        }
        out
    }

    /// Stops the model actors' threads.
    pub fn stop(self) {
        for arbiter in self.arbiters {
            arbiter.stop();
            let _ = arbiter.join();
        }
    }
}

/// The started devices: each one's plan, compute pool and executor.
struct Devices {
    devices: Vec<StartedDevice>,
    /// Device of each model, by index.
    device_of: Vec<usize>,
    arbiters: Vec<Arbiter>,
}

struct StartedDevice {
    plan: DevicePlan,
    pool: Arc<ComputePool>,
    executor: Addr<DeviceExecutor>,
}

impl Devices {
    fn of_model(&self, index: usize) -> &StartedDevice {
        &self.devices[self.device_of[index]]
    }

    /// Model `index`'s seat at its device's executor.
    fn seat(&self, index: usize) -> DeviceSeat {
        let device = self.of_model(index);
        let slot_of = |m: usize| device.plan.models.iter().position(|&x| x == m);
        DeviceSeat {
            executor: device.executor.clone(),
            slot: slot_of(index).expect("placed on its device"),
            peer_slots: (0..self.device_of.len()).map(slot_of).collect(),
        }
    }
}

/// Places the models on devices and starts each device's compute pool and executor; the
/// placement is logged.
fn start_devices(config: &Config, models: &[Arc<LoadedModel>]) -> Result<Devices, RuntimeError> {
    let placements: Vec<ModelPlacement> = config
        .models
        .iter()
        .zip(models)
        .map(|(m, model)| ModelPlacement {
            device: m.device.clone(),
            threads: m.threads,
            weight_bytes: model.model.streamed_weight_bytes(),
        })
        .collect();
    let plans = plan_devices(
        &placements,
        &process_cores(),
        available_cores(),
        config.compute.split,
    )
    .map_err(RuntimeError::Config)?;
    let s = &config.scheduler;
    let mut device_of = vec![0; models.len()];
    let mut devices = Vec::new();
    let mut arbiters = Vec::new();
    for (d, plan) in plans.into_iter().enumerate() {
        let names: Vec<&str> = plan
            .models
            .iter()
            .map(|&i| config.models[i].name.as_str())
            .collect();
        let kernels = plan
            .models
            .first()
            .map(|&i| models[i].model.describe_device());
        tracing::info!(device = %plan.spec, threads = plan.threads, models = ?names, ?kernels,
            "device");
        let settings: Vec<(usize, Duration)> = plan
            .models
            .iter()
            .map(|&i| match s.mode {
                SchedulingMode::Delayed => (
                    config.models[i].batch_threshold,
                    Duration::from_millis(s.max_wait_ms),
                ),
                _ => (1, Duration::ZERO),
            })
            .collect();
        for &i in &plan.models {
            device_of[i] = d;
        }
        let pool = ComputePool::pinned(plan.threads, &format!("compute{d}"), &plan.pinned);
        let arbiter = Arbiter::new();
        let admission = if plan.spec.is_cpu() {
            Admission::OneStep
        } else {
            Admission::PerModel
        };
        let (name, queue) = (
            plan.spec.to_string(),
            DeviceQueue::new(admission, &settings),
        );
        let executor = DeviceExecutor::start_in_arbiter(&arbiter.handle(), move |_| {
            DeviceExecutor::new(name, queue)
        });
        arbiters.push(arbiter);
        devices.push(StartedDevice {
            plan,
            pool,
            executor,
        });
    }
    Ok(Devices {
        devices,
        device_of,
        arbiters,
    })
}

/// With `thresholds = "auto"`: the step latencies of the SLM and the LLM, measured now.
fn online_profile(
    config: &Config,
    models: &[Arc<LoadedModel>],
    pools: &[Arc<ComputePool>],
) -> Result<Option<Arc<LatencyProfile>>, RuntimeError> {
    if config.scheduler.thresholds != ThresholdSource::Auto {
        return Ok(None);
    }
    let (Some(slm), Some(llm)) = (config.role_index(Role::Slm), config.role_index(Role::Llm))
    else {
        return Err(RuntimeError::Config(
            "thresholds = \"auto\" needs an SLM and an LLM".into(),
        ));
    };
    let measure = |i: usize| {
        with_pool(&pools[i], || {
            step_latencies(
                &models[i].model,
                MAX_TUNED_CONCURRENCY,
                config.kv_cache.dtype,
            )
        })
        .map_err(|source| RuntimeError::Model {
            name: config.models[i].name.clone(),
            path: config.models[i].path.clone(),
            error: Box::new(source),
        })
    };
    let profile = LatencyProfile {
        slm: measure(slm)?,
        llm: measure(llm)?,
        // Models on one CPU device take turns on it; on one GPU each has a stream of its own.
        shared_compute: Arc::ptr_eq(&pools[slm], &pools[llm]) && config.models[slm].device.is_cpu(),
    };
    tracing::info!(?profile, "step latencies for online thresholds");
    Ok(Some(Arc::new(profile)))
}

/// Token routing passes token ids between models: their vocabularies must be identical.
fn check_same_tokenizer(config: &Config, models: &[Arc<LoadedModel>]) -> Result<(), RuntimeError> {
    let first = models[0].tokenizer.get_vocab(true);
    for (entry, model) in config.models.iter().zip(models).skip(1) {
        if model.tokenizer.get_vocab(true) != first {
            return Err(RuntimeError::Config(format!(
                "models '{}' and '{}' have different tokenizers, so tokens cannot be routed between them; pair models of one family (or use routing.algorithm = \"single\")",
                config.models[0].name, entry.name
            )));
        }
    }
    Ok(())
}
