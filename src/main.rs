//! The `shelfserve` binary: parses the command line, sets up logging, and runs a command.
//! Errors become one readable message and a non-zero exit status.

use clap::Parser;
use shelfserve::cli::{run_fetch_default, run_generate, run_kld, run_score, Cli, Command};

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SHELFSERVE_LOG").unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match &cli.command {
        Some(Command::Generate(a)) => run_generate(a),
        Some(Command::Score(a)) => run_score(a),
        Some(Command::Kld(a)) => run_kld(a),
        Some(Command::FetchDefault) => run_fetch_default(),
        None => {
            use clap::CommandFactory;
            Cli::command().print_help()?;
            return Ok(());
        }
    };
    result.map_err(anyhow::Error::from)
}
