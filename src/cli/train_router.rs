//! `tokenrouter train-router`: router heads for the configured SLM/LLM pair, trained on this
//! machine from data that exists offline. With `--prompts`, the SLM completes each prompt and
//! the positions of its completions where the LLM would have written something else (and, by
//! default, where that changes what the LLM goes on to write) are the ones to route; with
//! `--corpus`, both models read chunks of existing text instead. R2R, CITER and Co-LLM heads
//! are fitted to them and written as safetensors + JSON, each with its thresholds for a
//! target recall and for target shares of LLM tokens, measured on held-out completions.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use tokenrouter::actors::load_models;
use tokenrouter::config::{Config, Role};
use tokenrouter::model::{LoadedModel, MatmulBackend};
use tokenrouter::routing::head::{HeadConfig, HeadKind};
use tokenrouter::routing::train::generated::{collect_generated, CollectSettings, Labels};
use tokenrouter::routing::train::{cache, collect, train, Dataset, Measured, TrainSettings};

#[derive(Args)]
pub struct TrainRouterArgs {
    /// Config naming the pair (models with role = "slm" and role = "llm").
    #[arg(long, env = "TOKENROUTER_CONFIG", default_value = "config.toml")]
    config: PathBuf,
    /// JSON Lines of prompts (`{"prompt": ...}`) for the SLM to complete
    /// (scripts/stdlib-prompts.py writes some from the Python standard library).
    #[arg(long, conflicts_with = "corpus", required_unless_present = "corpus")]
    prompts: Option<PathBuf>,
    /// Tokens the SLM generates per prompt.
    #[arg(long, default_value_t = 128)]
    max_new: usize,
    /// Strings that end a completion (`\n` is a newline), as an evaluation stops its
    /// completions; the default is HumanEval's.
    #[arg(long, num_args = 1.., default_values_t = DEFAULT_STOPS.map(String::from))]
    stop: Vec<String>,
    /// Prompts the SLM completes together.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// How a position where the models differ is labelled: `continuation` (the LLM goes on
    /// both ways for `--horizon` tokens; it needs the LLM unless both write the same code) or
    /// `disagreement` (every difference needs the LLM).
    #[arg(long, default_value = "continuation")]
    labels: String,
    #[arg(long, default_value_t = 16)]
    horizon: usize,
    /// Where collected completions and labels are kept, keyed by models, prompts and settings.
    #[arg(long, default_value = "routers/cache")]
    cache: PathBuf,
    /// Text files, or folders searched for `--extension` files.
    #[arg(long, num_args = 1..)]
    corpus: Vec<PathBuf>,
    #[arg(long, default_value = "py")]
    extension: String,
    /// Prompts to complete, or chunks of text both models read.
    #[arg(long, default_value_t = 160)]
    texts: usize,
    /// Tokens per chunk.
    #[arg(long, default_value_t = 128)]
    text_tokens: usize,
    /// Heads to train: r2r, citer, co_llm.
    #[arg(long, value_delimiter = ',', default_value = "r2r,citer,co_llm")]
    kinds: Vec<String>,
    /// Where the heads go, as `<out>/<name>-<kind>.safetensors` (+ `.json`).
    #[arg(long, default_value = "routers")]
    out: PathBuf,
    #[arg(long, default_value = "router")]
    name: String,
    /// R2R: largest logits read, their projection width, MLP width and residual blocks (the
    /// published router is 100 / 64 / 1024 / 6).
    #[arg(long, default_value_t = 100)]
    top_k: usize,
    /// Give every head the SLM's confidence beside its hidden state: the entropy of the
    /// softmax over this many of its largest logits and the margin between the top two
    /// (default: --top-k; 0: none).
    #[arg(long)]
    confidence_top_k: Option<usize>,
    /// Feed the heads the hidden state as it is, rather than standardised by the training
    /// positions' mean and standard deviation.
    #[arg(long)]
    no_standardize: bool,
    #[arg(long, default_value_t = 64)]
    logits_dim: usize,
    #[arg(long, default_value_t = 256)]
    width: usize,
    #[arg(long, default_value_t = 3)]
    blocks: usize,
    #[arg(long, default_value_t = 0.95)]
    target_recall: f64,
    /// Most epochs; training stops after `--patience` epochs without a better held-out loss.
    #[arg(long, default_value_t = 30)]
    epochs: usize,
    #[arg(long, default_value_t = 4)]
    patience: usize,
    #[arg(long, default_value_t = 1e-3)]
    learning_rate: f64,
    #[arg(long, default_value_t = 1e-2)]
    weight_decay: f64,
    /// Train on this share of the training texts (the held-out ones unchanged), for a point
    /// of a learning curve.
    #[arg(long, default_value_t = 1.0, value_parser = train_share)]
    train_share: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

const DEFAULT_STOPS: [&str; 6] = [
    "\\ndef ",
    "\\nclass ",
    "\\nif __name__",
    "\\nprint(",
    "\\n#",
    "\\nassert ",
];

fn train_share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 1.0 => Ok(v),
        _ => Err(format!("'{s}' is not a share in (0, 1]")),
    }
}

fn kind(name: &str) -> anyhow::Result<HeadKind> {
    Ok(match name.replace('-', "_").as_str() {
        "r2r" => HeadKind::R2r,
        "citer" => HeadKind::Citer,
        "co_llm" => HeadKind::CoLlm,
        _ => anyhow::bail!("--kinds: '{name}' is not r2r, citer or co_llm"),
    })
}

/// Every file under `paths` with the extension (files given directly are taken as they are),
/// sorted so the corpus is the same on every run.
fn corpus_files(paths: &[PathBuf], extension: &str) -> anyhow::Result<Vec<PathBuf>> {
    fn walk(dir: &Path, extension: &str, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            if path.is_dir() {
                walk(&path, extension, out)?;
            } else if path.extension().is_some_and(|e| e == extension) {
                out.push(path);
            }
        }
        Ok(())
    }
    let mut files = Vec::new();
    for p in paths {
        if p.is_dir() {
            walk(p, extension, &mut files)
                .map_err(|e| anyhow::anyhow!("--corpus {}: {e}", p.display()))?;
        } else if p.is_file() {
            files.push(p.clone());
        } else {
            anyhow::bail!("--corpus {}: no such file or folder", p.display());
        }
    }
    files.sort();
    Ok(files)
}

/// Up to `count` chunks of `len` tokens, at most two per file, files in seeded order.
fn chunks(
    files: &[PathBuf],
    tokenizer: &tokenizers::Tokenizer,
    count: usize,
    len: usize,
    seed: u64,
) -> Vec<Vec<u32>> {
    let mut order: Vec<&PathBuf> = files.iter().collect();
    order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
    let mut out = Vec::new();
    for file in order {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        let Ok(encoding) = tokenizer.encode(text.as_str(), false) else {
            continue;
        };
        for chunk in encoding.get_ids().chunks_exact(len).take(2) {
            out.push(chunk.to_vec());
            if out.len() == count {
                return out;
            }
        }
    }
    out
}

pub fn run(args: TrainRouterArgs, backend: MatmulBackend) -> anyhow::Result<()> {
    let kinds: Vec<HeadKind> = args
        .kinds
        .iter()
        .map(|k| kind(k))
        .collect::<Result<_, _>>()?;
    if args.text_tokens < 2 || args.texts < 2 || args.top_k < 1 {
        anyhow::bail!("--texts and --text-tokens must be at least 2, --top-k at least 1");
    }
    let labels = match args.labels.as_str() {
        "continuation" => Labels::Continuation {
            horizon: args.horizon.max(1),
        },
        "disagreement" => Labels::Disagreement,
        other => anyhow::bail!("--labels: '{other}' is not continuation or disagreement"),
    };
    let mut config = Config::load(&args.config)?;
    // The heads serve the routing they are trained for, not this config's: in particular, no
    // model is loaded as a drafter over part of its vocabulary.
    config.routing = Default::default();
    let (Some(slm), Some(llm)) = (config.role_index(Role::Slm), config.role_index(Role::Llm))
    else {
        anyhow::bail!(
            "{}: needs models with role = \"slm\" and role = \"llm\"",
            args.config.display()
        );
    };
    config
        .require_local("train-router")
        .map_err(anyhow::Error::msg)?;
    let models = load_models(&config, backend)?;
    let data = match &args.prompts {
        Some(path) => {
            let identity = [
                model_identity(&config, slm, backend),
                model_identity(&config, llm, backend),
            ];
            from_prompts(&args, path, labels, &models[slm], &models[llm], identity)?
        }
        None => from_corpus(&args, &models[slm], &models[llm])?,
    };
    std::fs::create_dir_all(&args.out)?;
    let settings = TrainSettings {
        epochs: args.epochs,
        patience: args.patience,
        learning_rate: args.learning_rate,
        weight_decay: args.weight_decay,
        train_share: args.train_share,
        target_recall: args.target_recall,
        seed: args.seed,
        ..Default::default()
    };
    println!(
        "| head | threshold for | threshold | LLM share (test) | precision | recall | epochs |\n|---|---|---|---|---|---|---|"
    );
    for kind in kinds {
        let shape = match kind {
            HeadKind::R2r => HeadConfig::new(kind, data.hidden_size).with_r2r_shape(
                args.top_k,
                args.logits_dim,
                args.width,
                args.blocks,
            ),
            _ => HeadConfig::new(kind, data.hidden_size),
        }
        .with_confidence(args.confidence_top_k.unwrap_or(args.top_k));
        let shape = if args.no_standardize {
            shape
        } else {
            shape.standardized()
        };
        let (head, vars, report) = train(shape, &data, &settings)?;
        let file = format!("{}-{}.safetensors", args.name, kind.name());
        let path = args.out.join(file);
        head.save(&vars, &path)?;
        let target = format!("recall {:.2}", args.target_recall);
        let recall = Measured {
            threshold: report.threshold,
            routed: report.routed_share,
            precision: report.precision,
            recall: report.recall,
        };
        let rows = std::iter::once((target, &recall)).chain(
            report
                .shares
                .iter()
                .map(|(share, m)| (format!("share {share}"), m)),
        );
        for (target, m) in rows {
            println!(
                "| {} | {target} | {:.4} | {:.3} | {:.3} | {:.3} | best {} of {} |",
                path.display(),
                m.threshold,
                m.routed,
                m.precision,
                m.recall,
                report.best_epoch,
                report.epochs_run
            );
        }
        eprintln!(
            "{}: {} training, {} calibration, {} test positions ({:.1} % for the LLM); test AUC {:.3} (the SLM's entropy: {:.3}); {:.1} % of test scores within 0.01 of 0 or 1",
            kind.name(),
            report.train_positions,
            report.calibration_positions,
            report.test_positions,
            100.0 * report.positive_share,
            report.auc,
            report.entropy_auc,
            100.0 * report.saturated
        );
    }
    Ok(())
}

/// What a model's collected data depends on: its configuration, its file as it is now and
/// the kernels it runs on.
fn model_identity(config: &Config, i: usize, backend: MatmulBackend) -> String {
    let spec = &config.models[i];
    let file = std::fs::metadata(&spec.path)
        .map(|m| format!("{} bytes, modified {:?}", m.len(), m.modified().ok()))
        .unwrap_or_default();
    format!("{spec:?} {file} {backend:?}")
}

/// Rows from chunks of existing text both models read.
fn from_corpus(
    args: &TrainRouterArgs,
    slm: &LoadedModel,
    llm: &LoadedModel,
) -> anyhow::Result<Dataset> {
    let files = corpus_files(&args.corpus, &args.extension)?;
    let texts = chunks(
        &files,
        &slm.tokenizer,
        args.texts,
        args.text_tokens,
        args.seed,
    );
    if texts.len() < 2 {
        anyhow::bail!(
            "--corpus: found only {} chunks of {} tokens in {} files",
            texts.len(),
            args.text_tokens,
            files.len()
        );
    }
    eprintln!(
        "running both models over {} chunks of {} tokens from {} files",
        texts.len(),
        args.text_tokens,
        files.len()
    );
    let started = Instant::now();
    let bar = super::progress_bar(texts.len(), "chunks");
    let data = collect(&slm.model, &llm.model, &texts, args.top_k, |done| {
        bar.set_position(done as u64)
    })?;
    bar.finish_and_clear();
    eprintln!(
        "{} chunks in {:.0} s: {} positions, the models disagree on {:.1} %",
        texts.len(),
        started.elapsed().as_secs_f64(),
        data.rows(),
        100.0 * data.positive_share()
    );
    Ok(data)
}

/// `--prompts`: one JSON object with a `prompt` string per line.
fn read_prompts(path: &Path) -> anyhow::Result<Vec<String>> {
    #[derive(serde::Deserialize)]
    struct Line {
        prompt: String,
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("--prompts {}: {e}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(i, line)| {
            serde_json::from_str::<Line>(line)
                .map(|l| l.prompt)
                .map_err(|e| anyhow::anyhow!("--prompts {}:{}: {e}", path.display(), i + 1))
        })
        .collect()
}

/// Rows from the SLM's completions of `--texts` prompts (in seeded order, those that leave
/// room for the completion and its continuations), collected once per models, prompts and
/// settings and then read from `--cache`.
fn from_prompts(
    args: &TrainRouterArgs,
    path: &Path,
    labels: Labels,
    slm: &LoadedModel,
    llm: &LoadedModel,
    identity: [String; 2],
) -> anyhow::Result<Dataset> {
    let all = read_prompts(path)?;
    let context = slm
        .model
        .config()
        .context_length
        .min(llm.model.config().context_length);
    let room = args.max_new + args.horizon + 1;
    let mut order: Vec<usize> = (0..all.len()).collect();
    order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(args.seed));
    let prompts: Vec<Vec<u32>> = order
        .into_iter()
        .filter_map(|i| slm.tokenizer.encode(all[i].as_str(), false).ok())
        .map(|e| e.get_ids().to_vec())
        .filter(|p| !p.is_empty() && p.len() + room <= context)
        .take(args.texts)
        .collect();
    if prompts.len() < 2 {
        anyhow::bail!(
            "--prompts {}: only {} of {} prompts leave room for {} new tokens in a context of {}",
            path.display(),
            prompts.len(),
            all.len(),
            args.max_new,
            context
        );
    }
    let settings = CollectSettings {
        max_new: args.max_new,
        batch: args.batch,
        top_k: args.top_k,
        labels,
    };
    let stops: Vec<String> = args.stop.iter().map(|s| s.replace("\\n", "\n")).collect();
    let key = (1u32, &identity, &prompts, &settings, &stops);
    let started = Instant::now();
    let decode = |tokens: &[u32]| slm.tokenizer.decode(tokens, false).unwrap_or_default();
    let finished = |out: &[u32]| {
        out.last().is_some_and(|t| slm.special.eos.contains(t)) || {
            let text = decode(out);
            stops.iter().any(|s| text.contains(s.as_str()))
        }
    };
    let entry = cache::entry_path(&args.cache, &key);
    let (collected, read) = cache::cached(&args.cache, &key, || {
        eprintln!(
            "the SLM completes {} prompts ({} new tokens at most), labelled by {labels:?}, kept in {}",
            prompts.len(),
            args.max_new,
            entry.display()
        );
        let bar = super::progress_bar(2 * prompts.len(), "completions generated, then labelled");
        let collected = collect_generated(
            &slm.model,
            &llm.model,
            &prompts,
            &finished,
            &settings,
            &decode,
            |done| bar.set_position(done as u64),
        );
        bar.finish_and_clear();
        collected
    })?;
    let c = collected.counts;
    eprintln!(
        "{} {} completions in {:.0} s: {} positions, the models differ at {} ({:.1} %), {} of them matter ({:.1} % of positions)",
        if read { "read" } else { "collected" },
        collected.completions.len(),
        started.elapsed().as_secs_f64(),
        c.positions,
        c.differences,
        100.0 * c.differences as f64 / c.positions.max(1) as f64,
        c.matter,
        100.0 * c.matter as f64 / c.positions.max(1) as f64
    );
    Ok(collected.data)
}
