//! Running the actor runtime over the tiny SLM/LLM pair from tests: the models, a config
//! next to them, greedy requests, and the collected outcome of each.

use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use candle_core::Device;
use tokenrouter::actors::{GenerateRequest, Prompt, RequestEvent, RequestHandle, Runtime};
use tokenrouter::config::Config;
use tokenrouter::model::tiny::write_gguf;
use tokenrouter::model::{LoadedModel, SamplingParams};

use super::oracle::{greedy_entropies, quantile, OracleToken, Rule};

pub struct Pair {
    pub dir: tempfile::TempDir,
    pub models: Vec<Arc<LoadedModel>>,
}

pub fn tiny_pair() -> Pair {
    let dir = tempfile::tempdir().unwrap();
    let mut models = Vec::new();
    for (name, spec) in super::server::tiny_pair_specs() {
        let path = dir.path().join(format!("{name}.gguf"));
        write_gguf(&spec, &path, &[GgmlDType::Q8_0, GgmlDType::Q4_0]).unwrap();
        models.push(Arc::new(LoadedModel::load(&path, &Device::Cpu).unwrap()));
    }
    Pair { dir, models }
}

/// A drafter and its verifier: the tiny LLM twice, the SLM's copy in Q4_0 and the LLM's in
/// Q8_0, so that their greedy tokens mostly agree (as a real draft model's do) and
/// sometimes not.
pub fn draft_pair() -> Pair {
    let dir = tempfile::tempdir().unwrap();
    let [_, (_, spec)] = super::server::tiny_pair_specs();
    let mut models = Vec::new();
    for (name, format) in [("slm", GgmlDType::Q4_0), ("llm", GgmlDType::Q8_0)] {
        let path = dir.path().join(format!("{name}.gguf"));
        write_gguf(&spec, &path, &[format]).unwrap();
        models.push(Arc::new(LoadedModel::load(&path, &Device::Cpu).unwrap()));
    }
    Pair { dir, models }
}

pub fn config(dir: &Path, rest: &str) -> Config {
    config_on(dir, ["cpu", "cpu"], rest)
}

/// [`config`] with the SLM and the LLM on these devices.
pub fn config_on(dir: &Path, devices: [&str; 2], rest: &str) -> Config {
    let path = dir.join("config.toml");
    let [slm, llm] = devices;
    let text = format!(
        "[[models]]\nname = \"slm\"\npath = \"slm.gguf\"\nbatch_threshold = 3\ndevice = \"{slm}\"\n\
         [[models]]\nname = \"llm\"\npath = \"llm.gguf\"\nbatch_threshold = 2\ndevice = \"{llm}\"\n\
         [kv_cache]\nblock_size = 4\n{rest}"
    );
    std::fs::write(&path, text).unwrap();
    Config::load(&path).unwrap()
}

pub fn prompts() -> Vec<Vec<u32>> {
    (0..5u32)
        .map(|k| (0..3 + 5 * k).map(|i| (i * 31 + k * 17) % 250).collect())
        .collect()
}

#[derive(Debug, Default)]
pub struct Outcome {
    pub tokens: Vec<OracleToken>,
    pub text: String,
    pub terminals: Vec<RequestEvent>,
}

pub async fn collect(mut handle: RequestHandle, cancel_after: Option<usize>) -> Outcome {
    let mut out = Outcome::default();
    while let Some(event) = handle.events.recv().await {
        match &event {
            RequestEvent::Text { text, tokens } => {
                out.text.push_str(text);
                out.tokens.extend(
                    tokens
                        .iter()
                        .map(|&(token, model)| OracleToken { token, model }),
                );
                if cancel_after.is_some_and(|n| out.tokens.len() >= n) {
                    handle.cancel();
                }
            }
            e if e.is_terminal() => out.terminals.push(event),
            _ => {}
        }
    }
    out
}

pub fn greedy(prompt: &[u32], max_tokens: usize) -> GenerateRequest {
    GenerateRequest::new(
        Prompt::Tokens(prompt.to_vec()),
        SamplingParams::greedy(),
        max_tokens,
    )
}

/// Every prompt of [`prompts`], greedy for `max_tokens` tokens past any end-of-sequence,
/// submitted at once and collected; with every model's counters after them.
pub async fn every_prompt(
    rt: &Runtime,
    max_tokens: usize,
) -> (Vec<Outcome>, Vec<tokenrouter::actors::worker::WorkerStats>) {
    let handles: Vec<_> = prompts()
        .iter()
        .map(|p| {
            let mut req = greedy(p, max_tokens);
            req.ignore_eos = true;
            rt.submit(req)
        })
        .collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(collect(h, None).await);
    }
    (out, rt.stats().await)
}

/// Runs `body` inside an actix system with a runtime over `pair`'s models.
pub fn with_runtime<T>(config: &Config, pair: &Pair, body: impl AsyncFnOnce(&Runtime) -> T) -> T {
    Runtime::run(config, pair.models.clone(), async |runtime| {
        let out = body(runtime).await;
        let stats = runtime.stats().await;
        for s in &stats {
            assert_eq!(
                s.free_blocks, s.total_blocks,
                "{} leaked blocks: {s:?}",
                s.name
            );
            assert_eq!(s.requests, 0, "{} still holds requests: {s:?}", s.name);
        }
        out
    })
    .unwrap()
}

/// Thresholds inside the models' own entropy ranges, so that routing really happens.
pub fn rules(pair: &Pair) -> [(Rule, String); 2] {
    let (mut hs, mut hl) = (Vec::new(), Vec::new());
    for p in prompts().iter().take(2) {
        hs.extend(greedy_entropies(&pair.models[0].model, p, 12));
        hl.extend(greedy_entropies(&pair.models[1].model, p, 12));
    }
    let threshold = quantile(&hs, 0.6);
    // `low` at most the SLM's median too, so `low <= high` whatever the random weights.
    let high = quantile(&hs, 0.7);
    let low = quantile(&hl, 0.5).min(quantile(&hs, 0.5));
    [
        (
            Rule::Entropy { threshold },
            format!("[routing]\nalgorithm = \"entropy\"\nthreshold = {threshold}\n"),
        ),
        (
            Rule::RStitch { high, low },
            format!("[routing]\nalgorithm = \"r-stitch\"\nhigh = {high}\nlow = {low}\n"),
        ),
    ]
}
