//! Routed generation: the prompt goes through the runtime's actors, as a server request would.

use std::io::Write;

use tokenrouter::actors::{load_models, GenerateRequest, Prompt, RequestEvent, Runtime};
use tokenrouter::config::Config;
use tokenrouter::model::{MatmulBackend, SamplingParams};

use super::GenerateArgs;

/// ANSI colours per model index for `--show-routing` (the first model keeps the default).
const COLOURS: &[&str] = &["", "\x1b[1;35m", "\x1b[1;36m", "\x1b[1;33m"];
const RESET: &str = "\x1b[0m";

pub fn run(
    args: &GenerateArgs,
    params: SamplingParams,
    backend: MatmulBackend,
) -> anyhow::Result<()> {
    let config = Config::load(&args.model.config)?;
    let target = super::super::parse_device(&args.model.device, backend)?;
    let models = load_models(&config, target)?;
    let names: Vec<String> = config.models.iter().map(|m| m.name.clone()).collect();
    let prompt = if args.chat {
        Prompt::Chat(args.messages())
    } else {
        Prompt::Text(args.prompt.clone())
    };
    let request = GenerateRequest::new(prompt, params, args.max_tokens);
    let show = args.show_routing;
    if show {
        let legend: Vec<String> = names
            .iter()
            .enumerate()
            .map(|(i, n)| format!("{}{n}{RESET}", COLOURS[i % COLOURS.len()]))
            .collect();
        eprintln!("models: {}", legend.join(" "));
    }
    actix::System::new().block_on(async move {
        let runtime = Runtime::start(&config, models)?;
        let mut handle = runtime.submit(request);
        let mut stdout = std::io::stdout().lock();
        let mut outcome = Ok(());
        while let Some(event) = handle.events.recv().await {
            match event {
                RequestEvent::Text { text, tokens } => {
                    let colour = match tokens.first() {
                        Some(&(_, m)) if show => COLOURS[m % COLOURS.len()],
                        _ => "",
                    };
                    let reset = if colour.is_empty() { "" } else { RESET };
                    // A closed stdout (`| head`) ends the output; it is not an error.
                    let _ = write!(stdout, "{colour}{text}{reset}").and_then(|_| stdout.flush());
                }
                RequestEvent::Finished(s) => {
                    let _ = writeln!(stdout);
                    let secs = s.e2e.as_secs_f64();
                    let per_model: Vec<String> = names
                        .iter()
                        .zip(&s.tokens_per_model)
                        .map(|(n, t)| format!("{n} {t}"))
                        .collect();
                    eprintln!(
                        "{} prompt + {} generated tokens in {secs:.2} s ({:.1} tok/s, first token after {:.0} ms); tokens per model: {}; handoffs: {}; finish: {:?}",
                        s.prompt_tokens,
                        s.completion_tokens,
                        s.completion_tokens as f64 / secs.max(1e-9),
                        s.ttft.unwrap_or_default().as_secs_f64() * 1e3,
                        per_model.join(", "),
                        s.handoffs,
                        s.finish
                    );
                }
                RequestEvent::Failed(e) => outcome = Err(anyhow::anyhow!("{e}")),
                RequestEvent::Cancelled => outcome = Err(anyhow::anyhow!("the request was cancelled")),
                RequestEvent::Admitted { .. } | RequestEvent::Moved { .. } => {}
            }
        }
        runtime.stop();
        outcome
    })
}
