//! `tokenrouter subserver`: hosts one model of a config for a front server in another process
//! or on another host; the front's config names it with `remote = "HOST:PORT"`.

use std::path::PathBuf;

use clap::Args;
use tokenrouter::actors::{run_subserver, SubserverArgs};
use tokenrouter::config::Config;
use tokenrouter::model::MatmulBackend;

#[derive(Args)]
pub struct SubserverCliArgs {
    /// The config the front server runs (the same models, routing and scheduling mode).
    #[arg(long, env = "TOKENROUTER_CONFIG", default_value = "config.toml")]
    config: PathBuf,
    /// The model to host, by its name in the config.
    #[arg(long)]
    model: String,
    /// Address to listen on for the front server (port 0: any free port, printed).
    #[arg(long, default_value = "127.0.0.1:7100")]
    listen: String,
    /// File holding the secret the front must prove (at least 16 bytes).
    #[arg(long, env = "TOKENROUTER_SECRET_FILE")]
    secret_file: Option<PathBuf>,
    /// TLS: this subserver's certificate (PEM), presented to the front.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// TLS: the certificate's private key (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// TLS: take only fronts presenting a certificate this CA (PEM) signed; with it,
    /// --secret-file may be left out.
    #[arg(long, requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
}

pub fn run(args: SubserverCliArgs, backend: MatmulBackend) -> anyhow::Result<()> {
    let config = Config::load(&args.config)?;
    let args = SubserverArgs {
        model: args.model,
        listen: args.listen,
        secret_file: args.secret_file,
        tls_cert: args.tls_cert,
        tls_key: args.tls_key,
        tls_client_ca: args.tls_client_ca,
    };
    Ok(run_subserver(config, args, backend)?)
}
