//! The `shelfserve` binary: parses the command line, sets up logging, and runs a command.
//! Errors become one readable message and a non-zero exit status.

use clap::Parser;
use shelfserve::cli::bench::run_bench;
use shelfserve::cli::bench_serve::run_bench_serve;
use shelfserve::cli::serve::run_serve;
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
        Some(Command::Serve(a)) => run_serve(a),
        Some(Command::Bench(a)) => run_bench(a),
        Some(Command::BenchServe(a)) => run_bench_serve(a),
        Some(Command::Worker(a)) => shelfserve::cli::cluster::run_worker_cmd(a),
        // No command: serve the default model with flags taken from the environment.
        None => match Cli::parse_from(["shelfserve", "serve"]).command {
            Some(Command::Serve(a)) => run_serve(&a),
            _ => unreachable!("`serve` parses as the serve command"),
        },
    };
    result.map_err(anyhow::Error::from)
}
