//! Prefill and spill on the critical path, measured side by side in one run (issue 25, item 5):
//!
//! 1. **cold prefill**: one cold prompt of `--cold-tokens` tokens: its TTFT and the engine steps
//!    it took (prefill chunks are sized by the step budget, not cut at page boundaries);
//! 2. **full pool, spill off vs on**: `--fill` cold prompts of `--spill-prompt-tokens` tokens each
//!    through a pool of `--pool-tokens`, once with spill off and once with spill on (engine
//!    started afresh each time); the TTFT of the prompts sent after the pool is full (evictions
//!    are writing to disk meanwhile), median of each, and their ratio (target ≤ 1.10);
//! 3. **restore vs recompute**: on the spill-on engine, a prompt whose `--prefix-tokens` prefix
//!    was computed before and then pushed out to disk, against the same prompt's cold TTFT. The
//!    restore cost model chooses to read or recompute; the pool's counters say which it did.
//!
//! ```text
//! cargo run --profile test --example prefill_spill -- --device cpu
//! cargo run --release --example prefill_spill -- --device cuda --pool-tokens 16384
//! ```

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use shelfserve::actors::{start_engine, Engine, EngineOptions, GenerationRequest, InferenceEngine, StreamEvent};
use shelfserve::config::engine::DEFAULT_CONFIG_TOML;
use shelfserve::config::layers::{DeviceClass, EngineFile, ModelFamily, SchedulerKnobs};
use shelfserve::generate::{DeviceKind, DeviceSelection};
use shelfserve::model::default_model::CacheDir;

const PATIENCE: Duration = Duration::from_secs(600);

#[derive(Parser, Debug, Clone)]
#[command(about = "Cold prefill steps and TTFT; spill off vs on with a full pool; restore vs recompute")]
struct Args {
    #[arg(long, default_value = "default")]
    model: String,
    /// `cpu`, `cuda` or `auto`.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// CPU threads of the engine (0 = one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    #[arg(long, default_value_t = 7284)]
    cold_tokens: usize,
    #[arg(long, default_value_t = 16384)]
    pool_tokens: usize,
    #[arg(long, default_value_t = 6243)]
    spill_prompt_tokens: usize,
    /// Cold prompts per spill phase (the pool is full after the first few).
    #[arg(long, default_value_t = 6)]
    fill: usize,
    #[arg(long, default_value_t = 6144)]
    prefix_tokens: usize,
    /// Host memory for evicted pages in front of the spill directory (default: the device's).
    #[arg(long)]
    spill_host_bytes: Option<u64>,
}

/// Distinct deterministic token ids below SmolLM2's vocabulary.
fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 300 + (seed.wrapping_mul(7919).wrapping_add(i.wrapping_mul(104_729))) % 40_000).collect()
}

async fn start(args: &Args, spill_dir: Option<&Path>) -> Result<Arc<Engine>, String> {
    let bundle = shelfserve::model::open(&args.model, &CacheDir::from_env()).map_err(|e| e.to_string())?;
    // The scheduler knobs the server would pick for this device and model family (on CUDA: a
    // device-sized step budget), with this run's pool and spill settings on top.
    let kind: DeviceKind = args.device.parse().map_err(|e: String| e)?;
    let class = if kind == DeviceKind::Cuda { DeviceClass::Cuda } else { DeviceClass::Cpu };
    let family = ModelFamily::of_model_type(&bundle.config.model_type);
    let (mut cfg, _) = EngineFile::from_toml(DEFAULT_CONFIG_TOML, "configs/default.toml")
        .map_err(|e| e.to_string())?
        .resolve(&SchedulerKnobs::default(), None, family, class)?;
    cfg.scheduler.kv_pool_tokens = args.pool_tokens;
    cfg.scheduler.spill_dir = spill_dir.map(|p| p.display().to_string());
    cfg.scheduler.spill_budget = if spill_dir.is_some() { 64 << 30 } else { 0 };
    if let Some(bytes) = args.spill_host_bytes {
        cfg.scheduler.spill_host_bytes = bytes;
    }
    let device = DeviceSelection { kind, threads: args.threads, ..Default::default() };
    let engine = start_engine(bundle, cfg, EngineOptions { device, served_model_name: "default".into() })
        .await
        .map_err(|e| e.to_string())?;
    let t = Instant::now();
    while !engine.is_ready() {
        if t.elapsed() > PATIENCE {
            return Err("the model did not load".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(engine)
}

/// Time to the first generated token and the prompt tokens served from the prefix cache.
async fn ttft(e: &Engine, prompt: Vec<u32>) -> Result<(Duration, usize), String> {
    let t = Instant::now();
    let mut rx = e.submit(GenerationRequest::greedy_fixed_length("agent", prompt, 1)).map_err(|e| e.to_string())?;
    let mut first = None;
    loop {
        match tokio::time::timeout(PATIENCE, rx.recv()).await.map_err(|_| "no event".to_string())? {
            Some(StreamEvent::Delta { tokens, .. }) if !tokens.is_empty() => {
                first.get_or_insert(t.elapsed());
            }
            Some(StreamEvent::Delta { .. }) => {}
            Some(StreamEvent::Finished { usage, .. }) => {
                return Ok((first.unwrap_or(t.elapsed()), usage.cached_tokens));
            }
            Some(StreamEvent::Error(err)) => return Err(err.to_string()),
            None => return Err("the stream ended early".into()),
        }
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1e3)
}

/// TTFTs of the prompts sent once the pool is full (seeds from `seed0`).
async fn full_pool_ttfts(e: &Engine, args: &Args, seed0: u32) -> Result<Vec<Duration>, String> {
    let per_pool = args.pool_tokens / args.spill_prompt_tokens.max(1);
    let mut out = Vec::new();
    for i in 0..args.fill {
        let (t, _) = ttft(e, prompt(seed0 + i as u32, args.spill_prompt_tokens)).await?;
        if i > per_pool {
            out.push(t);
        }
    }
    Ok(out)
}

async fn run(args: Args) -> Result<(), String> {
    // 1. Cold prefill.
    let e = start(&args, None).await?;
    ttft(&e, prompt(1, 64)).await?; // warm-up
    let steps_before = e.stats().await.map_or(0, |s| s.steps);
    let (cold, _) = ttft(&e, prompt(2, args.cold_tokens)).await?;
    let steps = e.stats().await.map_or(0, |s| s.steps) - steps_before;
    let budget = e.config().scheduler.max_num_batched_tokens;
    println!("cold prefill: {} tokens, TTFT {}, {steps} steps (step budget {budget})", args.cold_tokens, ms(cold));

    // 2. Full pool, spill off (this engine) then on.
    let off = full_pool_ttfts(&e, &args, 100).await?;
    e.shutdown();
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let e = start(&args, Some(dir.path())).await?;
    ttft(&e, prompt(1, 64)).await?;
    let on = full_pool_ttfts(&e, &args, 200).await?;
    let (off_m, on_m) = (median(off.clone()), median(on.clone()));
    println!(
        "full pool, cold {}-token prompts: spill off TTFT p50 {} ({} samples), spill on {} ({} samples): ratio {:.2}",
        args.spill_prompt_tokens,
        ms(off_m),
        off.len(),
        ms(on_m),
        on.len(),
        on_m.as_secs_f64() / off_m.as_secs_f64().max(1e-9)
    );

    // 3. Restore vs recompute: a conversation computed once, pushed out to disk, resumed.
    let suffix = 16;
    let conv = prompt(300, args.prefix_tokens + suffix);
    let (recompute, _) = ttft(&e, conv.clone()).await?;
    for i in 0..args.pool_tokens / args.spill_prompt_tokens.max(1) + 1 {
        ttft(&e, prompt(400 + i as u32, args.spill_prompt_tokens)).await?;
    }
    let spilled = e.pool_stats().await.map_or(0, |s| s.spilled_pages);
    let (resumed, cached) = ttft(&e, conv).await?;
    let c = e.pool_stats().await.map(|s| s.counters).unwrap_or_default();
    println!(
        "{}-token prefix spilled ({spilled} pages spilled, host tier {} MiB): cold TTFT {}, resumed {} ({cached} tokens \
         cached; restores chosen {}, declined {}): ratio {:.2}",
        args.prefix_tokens,
        e.config().scheduler.spill_host_bytes >> 20,
        ms(recompute),
        ms(resumed),
        c.restores_chosen,
        c.restores_declined,
        resumed.as_secs_f64() / recompute.as_secs_f64().max(1e-9)
    );
    e.shutdown();
    Ok(())
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    // The engine's logs on stderr, filtered as the server's are (`SHELFSERVE_LOG`, default warn).
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SHELFSERVE_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("prefill_spill: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
