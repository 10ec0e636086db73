//! `tokenrouter generate`: one prompt, text streamed to stdout, throughput to stderr. The
//! prompt runs through the actor runtime as a server request would: with `--model`, that
//! model alone (the `single` algorithm); without it, token-routed across every model in
//! `--config`, where `--show-routing` colours each token by the model that made it.

use std::io::Write;
use std::sync::Arc;

use clap::Args;
use tokenrouter::actors::{load_models, GenerateRequest, Prompt, Runtime};
use tokenrouter::config::{Config, KvCacheSettings};
use tokenrouter::model::{ChatMessage, KvDtype, MatmulBackend, SamplingParams};

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: super::ModelArg,
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message (with --chat).
    #[arg(long)]
    system: Option<String>,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 samples greedily.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long)]
    seed: Option<u64>,
    /// Colour each token by the model that produced it (routed generation).
    #[arg(long)]
    show_routing: bool,
    /// Generate `--max-tokens` tokens even past the end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
    /// Tokens per KV-cache block (with --model; routed generation takes the config's).
    #[arg(long, default_value_t = 16, env = "TOKENROUTER_BLOCK_SIZE")]
    block_size: usize,
    /// What the KV cache stores (with --model; routed generation takes the config's).
    #[arg(long, value_enum, default_value_t = KvDtype::default())]
    kv_dtype: KvDtype,
}

/// ANSI colours per model index for `--show-routing` (the first model keeps the default).
const COLOURS: &[&str] = &["", "\x1b[1;35m", "\x1b[1;36m", "\x1b[1;33m"];
const RESET: &str = "\x1b[0m";

pub fn run(args: GenerateArgs, backend: MatmulBackend) -> anyhow::Result<()> {
    let params = args.sampling_params();
    params.validate()?;
    let (config, models) = if args.model.model.is_some() {
        let lm = args.model.load_with(backend)?;
        let name = lm
            .path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned());
        let mut config = Config::alone(&name.unwrap_or_default(), lm.path.clone());
        super::override_device(&mut config, args.model.device.as_deref())?;
        config.kv_cache = KvCacheSettings {
            block_size: args.block_size,
            dtype: args.kv_dtype,
        };
        config.validate().map_err(anyhow::Error::msg)?;
        (config, vec![Arc::new(lm)])
    } else {
        let config = args.model.load_config()?;
        let models = load_models(&config, backend)?;
        (config, models)
    };
    let names: Vec<String> = config.models.iter().map(|m| m.name.clone()).collect();
    let prompt = if args.chat {
        Prompt::Chat(args.messages())
    } else {
        Prompt::Text(args.prompt.clone())
    };
    let mut request = GenerateRequest::new(prompt, params, args.max_tokens);
    request.ignore_eos = args.ignore_eos;
    let show = args.show_routing;
    if show {
        let legend: Vec<String> = names
            .iter()
            .enumerate()
            .map(|(i, n)| format!("{}{n}{RESET}", COLOURS[i % COLOURS.len()]))
            .collect();
        eprintln!("models: {}", legend.join(" "));
    }
    // When each text event came and with how many tokens, for the decode rate.
    let mut arrivals: Vec<(std::time::Instant, usize)> = Vec::new();
    let outcome = Runtime::run(&config, models, async |runtime| {
        let mut stdout = std::io::stdout().lock();
        let handle = runtime.submit(request);
        let summary = handle.finish(|text, tokens| {
            arrivals.push((std::time::Instant::now(), tokens.len()));
            let colour = match tokens.first() {
                Some(&(_, m)) if show => COLOURS[m % COLOURS.len()],
                _ => "",
            };
            let reset = if colour.is_empty() { "" } else { RESET };
            // A closed stdout (`| head`) ends the output; it is not an error.
            let _ = write!(stdout, "{colour}{text}{reset}").and_then(|_| stdout.flush());
        });
        let summary = summary.await;
        let _ = writeln!(stdout);
        summary
    })?;
    let Some(s) = outcome? else {
        anyhow::bail!("the request was cancelled");
    };
    let ttft = s.ttft.unwrap_or_default().as_secs_f64();
    let mut line = format!(
        "prefill: {} tokens at {:.1} tok/s; decode: {} tokens at {:.1} tok/s; e2e: {:.2} s; finish: {:?}",
        s.prompt_tokens,
        s.prompt_tokens as f64 / ttft.max(1e-9),
        s.completion_tokens,
        decode_rate(&arrivals),
        s.e2e.as_secs_f64(),
        s.finish
    );
    if names.len() > 1 {
        let per_model: Vec<String> = names
            .iter()
            .zip(&s.tokens_per_model)
            .map(|(n, t)| format!("{n} {t}"))
            .collect();
        line += &format!(
            "; tokens per model: {}; handoffs: {}",
            per_model.join(", "),
            s.handoffs
        );
    }
    let spec = s.speculation;
    if spec.verifications > 0 {
        line += &format!(
            "; drafts accepted: {} of {} ({:.0} %), {:.2} per verification",
            spec.accepted,
            spec.drafted,
            100.0 * spec.accepted as f64 / spec.drafted.max(1) as f64,
            spec.accepted as f64 / spec.verifications as f64
        );
    }
    eprintln!("{line}");
    Ok(())
}

/// Tokens per second after the first ones: the tokens that arrived after the first burst
/// over the time from the first arrival to the last. A burst is what arrived within a
/// millisecond of the first arrival (one token, or the drafts a verification accepted with
/// the verifier's own token), which the time before it, not after, produced.
fn decode_rate(arrivals: &[(std::time::Instant, usize)]) -> f64 {
    let Some(&(first, _)) = arrivals.first() else {
        return 0.0;
    };
    let burst = std::time::Duration::from_millis(1);
    let later: usize = arrivals
        .iter()
        .filter(|(t, _)| *t - first > burst)
        .map(|&(_, n)| n)
        .sum();
    let span = arrivals
        .last()
        .map_or(0.0, |&(t, _)| (t - first).as_secs_f64());
    later as f64 / span.max(1e-9)
}

impl GenerateArgs {
    fn sampling_params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            ..SamplingParams::default()
        }
    }

    fn messages(&self) -> Vec<ChatMessage> {
        let mut messages = Vec::new();
        if let Some(system) = &self.system {
            messages.push(ChatMessage::new("system", system));
        }
        messages.push(ChatMessage::new("user", &self.prompt));
        messages
    }
}
