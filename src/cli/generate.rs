//! `tokenrouter generate`: one prompt, one model, text streamed to stdout, throughput to stderr.

use std::io::Write;

use clap::Args;
use tokenrouter::model::runner::{generate, GenerationRequest};
use tokenrouter::model::{ChatMessage, IncrementalDecoder, KvCache, SamplingParams};

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
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 16, env = "TOKENROUTER_BLOCK_SIZE")]
    block_size: usize,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let params = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        ..SamplingParams::default()
    };
    params.validate()?;
    let lm = args.model.load()?;
    let prompt = if args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::new("system", system));
        }
        messages.push(ChatMessage::new("user", &args.prompt));
        lm.encode_chat(&messages)?
    } else {
        lm.encode(&args.prompt)?
    };
    let config = lm.model.config();
    let tokens = (prompt.len() + args.max_tokens).min(config.context_length);
    let mut kv = KvCache::with_capacity(config, args.block_size, tokens)?;
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
