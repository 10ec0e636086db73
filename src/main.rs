//! The `tokenrouter` binary: argument parsing and dispatch; each command lives in `cli/`.

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = match cli::Cli::try_parse() {
        Ok(args) => args,
        // --help and --version print to stdout and succeed.
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => {
            eprintln!("{}", one_line(&e.render().to_string()));
            return ExitCode::from(2);
        }
    };
    // Our kernels run on each model's own compute pool (`kernels::parallel`); candle's few
    // remaining parallel ops (large element-wise maps) then run on the calling model's
    // thread rather than on a second set of threads spinning on the same cores. Set before
    // any thread starts.
    if !args.candle_computes() && std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let msg = format!("{e:#}").replace('\n', " ");
            eprintln!("error: {msg}");
            ExitCode::FAILURE
        }
    }
}

/// A command-line error as one line: clap's message without its usage and help hints.
fn one_line(rendered: &str) -> String {
    rendered
        .lines()
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}
