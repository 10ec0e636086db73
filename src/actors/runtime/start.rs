//! Starting the runtime and talking to it.

use super::kv_budget::kv_shares;
use super::placement::{plan_devices, DevicePlan, ModelPlacement};
use super::*;
use crate::actors::executor::{Attach, DeviceExecutor};
use crate::actors::model_actor::DeviceSeat;
use crate::config::{DeviceSpec, Role, RoutingConfig, ThresholdSource};
use crate::kernels::parallel::{
    available_cores, install, pin_current_thread, process_cores, with_pool, ComputePool,
};
use crate::model::profile::{row_costs, step_latencies, warm_up};
use crate::model::{ComputeTarget, MatmulBackend};
use crate::scheduler::{Admission, DeviceQueue};
use crate::tuning::online::{LatencyProfile, OnlineThresholds, MAX_TUNED_CONCURRENCY};

/// Loads every configured model onto its device (`backend`: the CPU kernels of models on
/// the CPU), naming the model in any error.
/// (Entries with `remote` are hosted by subservers and skipped.)
pub fn load_models(
    config: &Config,
    backend: MatmulBackend,
) -> Result<Vec<Arc<LoadedModel>>, RuntimeError> {
    (0..config.models.len())
        .filter(|&i| config.models[i].remote.is_none())
        .map(|i| load_model(config, i, backend))
        .collect()
}

/// Loads entry `index` of `config.models` (as [`load_models`] does each).
pub fn load_model(
    config: &Config,
    index: ModelIndex,
    backend: MatmulBackend,
) -> Result<Arc<LoadedModel>, RuntimeError> {
    // Speculative decoding may give the SLM a draft vocabulary.
    let drafter = match config.routing {
        RoutingConfig::Speculative {
            draft_vocab: Some(n),
            ..
        } => config.role_index(Role::Slm).map(|slm| (slm, n)),
        _ => None,
    };
    let m = &config.models[index];
    let target = match m.device {
        DeviceSpec::Cuda(n) => ComputeTarget::Cuda(n),
        DeviceSpec::Cpu | DeviceSpec::CpuCores(_) => ComputeTarget::Cpu(backend),
    };
    let draft_vocab = drafter.filter(|&(slm, _)| slm == index).map(|(_, n)| n);
    match &m.random {
        Some(_) if draft_vocab.is_some() => Err(crate::model::ModelError::Device(
            "routing.draft_vocab reads the SLM's LM head from its file: not for random weights"
                .into(),
        )),
        Some(shape) => LoadedModel::load_random(&m.path, shape, target),
        None => LoadedModel::load_quantized(&m.path, target, m.quantize).and_then(|mut lm| {
            if let Some(n) = draft_vocab {
                lm.set_draft_vocab(n)?;
            }
            Ok(lm)
        }),
    }
    .map(|lm| {
        lm.model.set_cuda_graphs(!m.enforce_eager);
        Arc::new(lm)
    })
    .map_err(|source| RuntimeError::Model {
        name: m.name.clone(),
        path: m.path.clone(),
        error: Box::new(source),
    })
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

    /// Starts one model actor per model this process computes (`models`: the weights of the
    /// entries of `config.models` without `remote`, in config order), connects to the
    /// subservers hosting the others, and routes with the algorithm `config.routing` names.
    pub fn start(config: &Config, models: Vec<Arc<LoadedModel>>) -> Result<Self, RuntimeError> {
        let locals = locals(config, models)?;
        let remotes = open_remotes(config, &locals)?;
        let router = crate::routing::build(config, &remotes.facts)?;
        Self::start_parts(config, locals, remotes, router)
    }

    /// Like [`Runtime::start`], with an algorithm of the caller's own (`config.routing` is not
    /// read): how a new algorithm runs before it has a name in the config.
    pub fn start_with_router(
        config: &Config,
        models: Vec<Arc<LoadedModel>>,
        router: Arc<dyn RoutingAlgorithm>,
    ) -> Result<Self, RuntimeError> {
        let locals = locals(config, models)?;
        let remotes = open_remotes(config, &locals)?;
        Self::start_parts(config, locals, remotes, router)
    }

    fn start_parts(
        config: &Config,
        locals: Locals,
        remotes: Remotes,
        router: Arc<dyn RoutingAlgorithm>,
    ) -> Result<Self, RuntimeError> {
        let n = config.models.len();
        let home = router.first_model(&[]);
        // Requests are read and written with the vocabulary of the model they start on.
        let lead = match locals.iter().find(|(i, _)| *i == home) {
            Some((_, m)) => m.vocabulary(),
            None => remotes.vocabularies[home]
                .clone()
                .expect("a model is local or remote"),
        };
        let started = start_local(config, &locals, router.clone())?;
        let mut addrs: Vec<Option<ModelAddr>> = vec![None; n];
        let flags = || -> Vec<Arc<AtomicBool>> {
            (0..n).map(|_| Arc::new(AtomicBool::new(true))).collect()
        };
        let (mut health, linked) = (flags(), flags());
        let mut prefixes: Vec<Arc<PublishedPrefixes>> = vec![Arc::default(); n];
        for (k, (i, addr)) in started.addrs.iter().enumerate() {
            addrs[*i] = Some(ModelAddr::of(addr));
            health[*i] = started.health[k].clone();
            prefixes[*i] = started.prefixes[k].clone();
        }
        let mut arbiters = started.arbiters;
        let mut max_context = started.max_len;
        let mut vocab_size = locals
            .iter()
            .map(|(_, m)| m.model.config().vocab_size)
            .min()
            .unwrap_or(usize::MAX);
        for opened in remotes.links {
            let index = opened.spec.index;
            max_context = max_context.min(opened.spec.expected.max_len);
            vocab_size = vocab_size.min(opened.spec.expected.vocab_size);
            let (up, healthy) = (linked[index].clone(), health[index].clone());
            let arbiter = Arbiter::new();
            let (spec, link) = (opened.spec, opened.link);
            let addr = RemoteModel::start_in_arbiter(&arbiter.handle(), move |_| {
                RemoteModel::new(spec, link, up, healthy)
            });
            addrs[index] = Some(ModelAddr::of(&addr));
            arbiters.push(arbiter);
        }
        let models: Vec<ModelAddr> = addrs
            .into_iter()
            .map(|a| a.expect("every model is local or remote"))
            .collect();
        let peers: Vec<_> = models.iter().map(|m| m.peer.clone()).collect();
        for m in &models {
            m.wire.do_send(Wire(peers.clone()));
        }
        let shared = RuntimeShared {
            model_names: config.models.iter().map(|m| m.name.clone()).collect(),
            models,
            eos: lead.special.eos.clone(),
            lead: Arc::new(lead),
            vocab_size,
            router,
            max_context,
            health,
            linked,
            prefixes,
            block_size: config.kv_cache.block_size,
            next_id: AtomicU64::new(1),
        };
        let mut kv = vec![None; n];
        for ((i, _), share) in locals.iter().zip(started.kv) {
            kv[*i] = Some(share);
        }
        Ok(Self {
            shared: Arc::new(shared),
            kv,
            arbiters,
        })
    }

    pub fn shared(&self) -> &Arc<RuntimeShared> {
        &self.shared
    }

    /// Each model's KV share, in config order (`None`: a subserver's, not this process's).
    pub fn kv_shares(&self) -> &[Option<KvShare>] {
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
            out.push(addr.stats.send(GetStats).await.unwrap_or_default());
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

/// The models this process computes: their config index and weights.
pub(super) type Locals = Vec<(ModelIndex, Arc<LoadedModel>)>;

/// Pairs `models` with the config's entries that are not remote.
fn locals(config: &Config, models: Vec<Arc<LoadedModel>>) -> Result<Locals, RuntimeError> {
    let indices: Vec<ModelIndex> = (0..config.models.len())
        .filter(|&i| config.models[i].remote.is_none())
        .collect();
    if indices.len() != models.len() {
        return Err(RuntimeError::Config(format!(
            "{} models loaded for the {} entries of [[models]] computed in this process",
            models.len(),
            indices.len()
        )));
    }
    Ok(indices.into_iter().zip(models).collect())
}

/// What [`start_local`] started.
pub(super) struct Started {
    /// Each local model's actor, by config index.
    pub addrs: Vec<(ModelIndex, Addr<ModelActor>)>,
    /// In the order of `addrs`.
    pub health: Vec<Arc<AtomicBool>>,
    pub prefixes: Vec<Arc<PublishedPrefixes>>,
    pub kv: Vec<KvShare>,
    /// The longest sequence every local model can hold (`usize::MAX` without one).
    pub max_len: usize,
    pub arbiters: Vec<Arbiter>,
}

/// Starts the model actors of `locals` on their devices, splitting the KV budget among them.
/// Their peers (`Wire`) are the caller's to give.
pub(super) fn start_local(
    config: &Config,
    locals: &Locals,
    router: Arc<dyn RoutingAlgorithm>,
) -> Result<Started, RuntimeError> {
    let models: Vec<Arc<LoadedModel>> = locals.iter().map(|(_, m)| m.clone()).collect();
    let entry = |k: usize| &config.models[locals[k].0];
    let model_error = |k: usize, source: ModelError| RuntimeError::Model {
        name: entry(k).name.clone(),
        path: entry(k).path.clone(),
        error: Box::new(source),
    };
    if models.len() > 1 {
        check_same_tokenizer(config, locals)?;
    }
    let block_size = config.kv_cache.block_size;
    let s = &config.scheduler;
    let devices = start_devices(config, locals)?;
    let pools: Vec<Arc<ComputePool>> = (0..models.len())
        .map(|k| devices.of_model(locals[k].0).pool.clone())
        .collect();
    // The first forward pass of a model pays for lazy set-up (weight repacking, page
    // faults, thread-pool start); pay it here rather than in the first request's latency.
    for (k, (model, pool)) in models.iter().zip(&pools).enumerate() {
        with_pool(pool, || warm_up(&model.model)).map_err(|e| model_error(k, e))?;
    }
    let profile = online_profile(config, locals, &pools)?;
    if let Some(rows) = router.priced_rows() {
        let mut costs = vec![None; config.models.len()];
        for (k, (model, pool)) in models.iter().zip(&pools).enumerate() {
            let measured = with_pool(pool, || {
                row_costs(&model.model, rows, config.kv_cache.dtype)
            })
            .map_err(|e| model_error(k, e))?;
            tracing::info!(model = %entry(k).name, rows, step_ms = measured.step_s * 1e3,
                row_ms = measured.row_s * 1e3, "step cost by rows");
            costs[locals[k].0] = Some(measured);
        }
        router.price(&costs);
    }
    // After the models have run: a GPU's KV caches take what its models leave free.
    let shared: Vec<(usize, &LoadedModel)> = locals.iter().map(|(i, m)| (*i, m.as_ref())).collect();
    let kv = kv_shares(config, &shared)?;
    for (k, share) in kv.iter().enumerate() {
        tracing::info!(model = %entry(k).name, blocks = share.blocks, tokens = share.tokens,
            mib = share.bytes >> 20, "KV cache share");
    }
    let health: Vec<_> = models
        .iter()
        .map(|_| Arc::new(AtomicBool::new(true)))
        .collect();
    let prefixes: Vec<Arc<PublishedPrefixes>> = models.iter().map(|_| Arc::default()).collect();
    let mut workers = Vec::new();
    for (k, (index, model)) in locals.iter().enumerate() {
        let entry = entry(k);
        let stepping = match s.mode {
            SchedulingMode::Sync => Stepping::Sync,
            SchedulingMode::Eager => Stepping::Async(LaunchPolicy::Eager),
            SchedulingMode::Delayed => Stepping::Async(LaunchPolicy::Delayed(DelayedBatching {
                threshold: entry.batch_threshold,
                max_wait: Duration::from_millis(s.max_wait_ms),
            })),
        };
        let setup = WorkerSetup {
            index: *index,
            name: entry.name.clone(),
            num_models: config.models.len(),
            model: model.clone(),
            router: router.clone(),
            limits: SchedulerLimits {
                block_size,
                num_blocks: kv[k].blocks,
                max_batch_tokens: s.max_batch_tokens,
                max_batch_requests: s.max_batch_requests,
            },
            kv_dtype: config.kv_cache.dtype,
            stepping,
            healthy: health[k].clone(),
            prefixes: prefixes[k].clone(),
            online: profile
                .clone()
                .map(|p| OnlineThresholds::new(p, config.role_index(Role::Slm) == Some(*index))),
        };
        workers.push(ModelWorker::new(setup).map_err(|e| model_error(k, e))?);
    }
    let max_len = workers
        .iter()
        .map(ModelWorker::max_len)
        .min()
        .unwrap_or(usize::MAX);
    let mut arbiters = Vec::new();
    let mut addrs = Vec::new();
    for (worker, (index, _)) in workers.into_iter().zip(locals) {
        let device = devices.of_model(*index);
        let pool = device.pool.clone();
        let pinned = device.plan.pinned.clone();
        let seat = devices.seat(*index);
        let arbiter = Arbiter::new();
        let addr = ModelActor::start_in_arbiter(&arbiter.handle(), move |_| {
            // This runs on the actor's thread: its forward passes use its device's pool.
            if !pinned.is_empty() {
                if let Err(e) = pin_current_thread(&pinned) {
                    tracing::warn!("cannot pin a model thread to its cores: {e}");
                }
            }
            install(pool);
            ModelActor::new(worker, seat)
        });
        addrs.push((*index, addr));
        arbiters.push(arbiter);
    }
    for device in &devices.devices {
        let grants = device
            .plan
            .models
            .iter()
            .map(|&i| {
                let (_, addr) = addrs.iter().find(|(j, _)| *j == i).expect("placed");
                addr.clone().recipient()
            })
            .collect();
        device.executor.do_send(Attach(grants));
    }
    arbiters.extend(devices.arbiters);
    Ok(Started {
        addrs,
        health,
        prefixes,
        kv,
        max_len,
        arbiters,
    })
}

/// The started devices: each one's plan, compute pool and executor.
struct Devices {
    devices: Vec<StartedDevice>,
    /// Device of each model, by config index (`None`: not computed here).
    device_of: Vec<Option<usize>>,
    arbiters: Vec<Arbiter>,
}

struct StartedDevice {
    plan: DevicePlan,
    pool: Arc<ComputePool>,
    executor: Addr<DeviceExecutor>,
}

impl Devices {
    fn of_model(&self, index: usize) -> &StartedDevice {
        &self.devices[self.device_of[index].expect("a local model")]
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
fn start_devices(config: &Config, locals: &Locals) -> Result<Devices, RuntimeError> {
    let placements: Vec<ModelPlacement> = locals
        .iter()
        .map(|(i, model)| ModelPlacement {
            device: config.models[*i].device.clone(),
            threads: config.models[*i].threads,
            weight_bytes: model.model.streamed_weight_bytes(),
        })
        .collect();
    let plans = plan_devices(
        &placements,
        &process_cores(),
        available_cores(),
        config.compute.split,
    )
    .map_err(RuntimeError::Config)?
    .into_iter()
    .map(|mut plan| {
        // Placement numbers the models it was given; the runtime, by config index.
        plan.models = plan.models.iter().map(|&k| locals[k].0).collect();
        plan
    });
    let s = &config.scheduler;
    let model_of = |i: ModelIndex| &locals.iter().find(|(j, _)| *j == i).expect("local").1;
    let mut device_of = vec![None; config.models.len()];
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
            .map(|&i| model_of(i).model.describe_device());
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
            device_of[i] = Some(d);
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
/// `pools` are the local models'.
fn online_profile(
    config: &Config,
    locals: &Locals,
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
    let local = |i: ModelIndex| {
        locals.iter().position(|(j, _)| *j == i).ok_or_else(|| {
            RuntimeError::Config(format!(
                "thresholds = \"auto\" measures both models in this process; '{}' is remote",
                config.models[i].name
            ))
        })
    };
    let (slm, llm) = (local(slm)?, local(llm)?);
    let measure = |k: usize| {
        let i = locals[k].0;
        with_pool(&pools[k], || {
            step_latencies(
                &locals[k].1.model,
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
        shared_compute: Arc::ptr_eq(&pools[slm], &pools[llm])
            && config.models[locals[slm].0].device.is_cpu(),
    };
    tracing::info!(?profile, "step latencies for online thresholds");
    Ok(Some(Arc::new(profile)))
}

/// Token routing passes token ids between models: their vocabularies must be identical.
fn check_same_tokenizer(config: &Config, locals: &Locals) -> Result<(), RuntimeError> {
    let (first, model) = &locals[0];
    let vocab = model.tokenizer.get_vocab(true);
    for (i, model) in &locals[1..] {
        if model.tokenizer.get_vocab(true) != vocab {
            return Err(RuntimeError::Config(format!(
                "models '{}' and '{}' have different tokenizers, so tokens cannot be routed between them; pair models of one family (or use routing.algorithm = \"single\")",
                config.models[*first].name, config.models[*i].name
            )));
        }
    }
    Ok(())
}
