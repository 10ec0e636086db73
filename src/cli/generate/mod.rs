//! `tokenrouter generate`: one prompt, text streamed to stdout, throughput to stderr. With
//! `--model` one model runs alone; without it the prompt is token-routed through the actors of
//! every model in `--config`, and `--show-routing` colours each token by the model that made it.

use std::io::Write;

use clap::Args;
use tokenrouter::model::runner::{generate, GenerationRequest};
use tokenrouter::model::{
    ChatMessage, IncrementalDecoder, KvDtype, LoadedModel, MatmulBackend, SamplingParams,
};

mod routed;

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
    /// Tokens per KV-cache block (single-model generation).
    #[arg(long, default_value_t = 16, env = "TOKENROUTER_BLOCK_SIZE")]
    block_size: usize,
    /// What the KV cache stores (single-model generation).
    #[arg(long, value_enum, default_value_t = KvDtype::default())]
    kv_dtype: KvDtype,
}

pub fn run(args: GenerateArgs, backend: MatmulBackend) -> anyhow::Result<()> {
    let params = args.sampling_params();
    params.validate()?;
    if args.model.model.is_none() {
        return routed::run(&args, params, backend);
    }
    let lm = args.model.load_with(backend)?;
    let prompt = if args.chat {
        lm.encode_chat(&args.messages())?
    } else {
        lm.encode(&args.prompt)?
    };
    run_single(&args, &lm, prompt, params)
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

fn run_single(
    args: &GenerateArgs,
    lm: &LoadedModel,
    prompt: Vec<u32>,
    params: SamplingParams,
) -> anyhow::Result<()> {
    let config = lm.model.config();
    let tokens = (prompt.len() + args.max_tokens).min(config.context_length);
    let mut kv = lm
        .model
        .kv_cache_for(args.block_size, tokens, args.kv_dtype)?;
    let mut decoder = IncrementalDecoder::new();
    let mut stdout = std::io::stdout().lock();
    let request = GenerationRequest {
        prompt,
        params,
        max_tokens: args.max_tokens,
        stop_ids: &lm.special.eos,
    };
    let (_, stats) = generate(&lm.model, &mut kv, request, |token| {
        let text = decoder.push(&lm.tokenizer, token)?;
        // A closed stdout (`| head`) ends the output; it is not an error of the model.
        let _ = stdout
            .write_all(text.as_bytes())
            .and_then(|_| stdout.flush());
        Ok(())
    })?;
    let rest = decoder.flush(&lm.tokenizer)?;
    let _ = writeln!(stdout, "{rest}");
    eprintln!(
        "prefill: {} tokens at {:.1} tok/s; decode: {} tokens at {:.1} tok/s; finish: {:?}",
        stats.prompt_tokens,
        stats.prefill_tok_s(),
        stats.generated_tokens,
        stats.decode_tok_s(),
        stats.finish
    );
    Ok(())
}
