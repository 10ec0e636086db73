//! `tokenrouter train-router`: router heads for the configured SLM/LLM pair, trained on this
//! machine from text that exists offline (for example the Python sources of the local Python
//! installation). Both models read the same chunks of text; positions where their greedy
//! tokens differ are the ones to route; R2R, CITER and Co-LLM heads are fitted to them and
//! written as safetensors + JSON, each with the threshold for the target recall.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use tokenrouter::actors::load_models;
use tokenrouter::config::{Config, Role};
use tokenrouter::routing::head::{HeadConfig, HeadKind};
use tokenrouter::routing::train::{collect, train, TrainSettings};

#[derive(Args)]
pub struct TrainRouterArgs {
    /// Config naming the pair (models with role = "slm" and role = "llm").
    #[arg(long, env = "TOKENROUTER_CONFIG", default_value = "config.toml")]
    config: PathBuf,
    /// Text files, or folders searched for `--extension` files.
    #[arg(long, num_args = 1.., required = true)]
    corpus: Vec<PathBuf>,
    #[arg(long, default_value = "py")]
    extension: String,
    /// Chunks of text both models read.
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
    #[arg(long, default_value_t = 64)]
    logits_dim: usize,
    #[arg(long, default_value_t = 256)]
    width: usize,
    #[arg(long, default_value_t = 3)]
    blocks: usize,
    #[arg(long, default_value_t = 0.95)]
    target_recall: f64,
    #[arg(long, default_value_t = 30)]
    epochs: usize,
    #[arg(long, default_value_t = 1e-3)]
    learning_rate: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
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

pub fn run(
    args: TrainRouterArgs,
    backend: tokenrouter::model::MatmulBackend,
) -> anyhow::Result<()> {
    let kinds: Vec<HeadKind> = args
        .kinds
        .iter()
        .map(|k| kind(k))
        .collect::<Result<_, _>>()?;
    if args.text_tokens < 2 || args.texts < 2 {
        anyhow::bail!("--texts and --text-tokens must be at least 2, --top-k at least 1");
    }
    let config = Config::load(&args.config)?;
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
    let files = corpus_files(&args.corpus, &args.extension)?;
    let texts = chunks(
        &files,
        &models[slm].tokenizer,
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
    let data = collect(
        &models[slm].model,
        &models[llm].model,
        &texts,
        args.top_k,
        |done| bar.set_position(done as u64),
    )?;
    bar.finish_and_clear();
    eprintln!(
        "{} chunks in {:.0} s: {} positions, the models disagree on {:.1} %",
        texts.len(),
        started.elapsed().as_secs_f64(),
        data.rows(),
        100.0 * data.positive_share()
    );
    std::fs::create_dir_all(&args.out)?;
    let settings = TrainSettings {
        epochs: args.epochs,
        learning_rate: args.learning_rate,
        target_recall: args.target_recall,
        seed: args.seed,
        ..Default::default()
    };
    println!("| head | threshold | precision | recall | routed share | thresholds for 5 / 10 / 20 % routed |\n|---|---|---|---|---|---|");
    for kind in kinds {
        let shape = match kind {
            HeadKind::R2r => HeadConfig::new(kind, data.hidden_size).with_r2r_shape(
                args.top_k,
                args.logits_dim,
                args.width,
                args.blocks,
            ),
            _ => HeadConfig::new(kind, data.hidden_size),
        };
        let (head, vars, report) = train(shape, &data, &settings)?;
        let file = format!("{}-{}.safetensors", args.name, kind.name());
        let path = args.out.join(file);
        head.save(&vars, &path)?;
        let shares: Vec<String> = report
            .share_thresholds
            .values()
            .map(|t| format!("{t:.4}"))
            .collect();
        println!(
            "| {} | {:.4} | {:.3} | {:.3} | {:.3} | {} |",
            path.display(),
            report.threshold,
            report.precision,
            report.recall,
            report.routed_share,
            shares.join(" / ")
        );
    }
    Ok(())
}
