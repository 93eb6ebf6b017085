//! KV pool benchmark (in-process engine, default model, CPU):
//!
//! 1. A long multi-turn conversation: per turn, the follow-up TTFT (its earlier turns are in the
//!    prefix cache) against the cold TTFT of a different conversation of the same length.
//! 2. A spilled long conversation: its pages are pushed out of a small pool to the spill
//!    directory, then the follow-up's TTFT (restore from disk) is compared with recomputing the
//!    same length cold, and with the disk's sequential read bandwidth measured in the same run
//!    (a freshly written file of the same size as the spilled pages, read once).
//!
//! ```text
//! cargo run --release --example kv_pool_bench -- --turns 6 --spill-dir /tmp/kvbench
//! ```

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use shelfserve::actors::{start_engine, Engine, EngineOptions, GenerationRequest, InferenceEngine, StreamEvent};
use shelfserve::config::engine::EngineConfig;
use shelfserve::model::default_model::CacheDir;

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, default_value = "default")]
    model: String,
    /// Conversation turns.
    #[arg(long, default_value_t = 6)]
    turns: usize,
    /// New user tokens per turn.
    #[arg(long, default_value_t = 200)]
    turn_tokens: usize,
    /// Reply tokens per turn.
    #[arg(long, default_value_t = 16)]
    reply_tokens: usize,
    /// Spill directory (a temporary one when absent).
    #[arg(long)]
    spill_dir: Option<std::path::PathBuf>,
    /// Length of the spilled conversation, in tokens.
    #[arg(long, default_value_t = 1500)]
    spill_tokens: usize,
}

fn tokens(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 300 + (seed * 7919 + i * 104_729) % 40_000).collect()
}

async fn engine(args: &Args, pool_tokens: usize, spill: Option<&std::path::Path>) -> Arc<Engine> {
    let bundle = shelfserve::model::open(&args.model, &CacheDir::from_env()).expect("open the model");
    let mut cfg = EngineConfig::builtin();
    cfg.scheduler.kv_pool_tokens = pool_tokens;
    if let Some(dir) = spill {
        cfg.scheduler.spill_dir = Some(dir.display().to_string());
        cfg.scheduler.spill_budget = 4 << 30;
    }
    let e = start_engine(bundle, cfg, EngineOptions { device: Default::default(), served_model_name: "bench".into() })
        .await
        .expect("start");
    while !e.is_ready() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    e
}

/// Runs a greedy request: (time to first token, generated ids, cached prompt tokens).
async fn run(e: &Engine, prompt: Vec<u32>, max_tokens: usize) -> (Duration, Vec<u32>, usize) {
    let req = GenerationRequest::greedy_fixed_length("voice", prompt, max_tokens);
    let t0 = Instant::now();
    let mut rx = e.submit(req).expect("submit");
    let (mut ttft, mut ids) = (None, Vec::new());
    loop {
        match rx.recv().await.expect("stream") {
            StreamEvent::Delta { tokens, .. } => {
                ttft.get_or_insert(t0.elapsed());
                ids.extend(tokens.iter().map(|t| t.id));
            }
            StreamEvent::Finished { usage, .. } => return (ttft.unwrap_or_default(), ids, usage.cached_tokens),
            StreamEvent::Error(err) => panic!("{err}"),
        }
    }
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1e3)
}

/// Sequential read bandwidth of a fresh file of `bytes` in `dir`, in bytes/s.
fn disk_read_bandwidth(dir: &std::path::Path, bytes: usize) -> f64 {
    let path = dir.join("bandwidth.probe");
    let block = vec![0x5au8; 8 << 20];
    let mut f = std::fs::File::create(&path).expect("probe file");
    let mut left = bytes;
    while left > 0 {
        let n = left.min(block.len());
        f.write_all(&block[..n]).expect("write probe");
        left -= n;
    }
    f.sync_all().expect("sync probe");
    drop(f);
    let mut buf = vec![0u8; 8 << 20];
    let t0 = Instant::now();
    let mut f = std::fs::File::open(&path).expect("open probe");
    while f.read(&mut buf).expect("read probe") > 0 {}
    let secs = t0.elapsed().as_secs_f64();
    let _ = std::fs::remove_file(&path);
    bytes as f64 / secs
}

fn main() {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        // 1. Multi-turn conversation.
        let e = engine(&args, 16384, None).await;
        println!("| turn | prompt tokens | cached | follow-up TTFT | cold TTFT (same length) | speed-up |");
        println!("|---|---|---|---|---|---|");
        let mut convo = Vec::new();
        for turn in 0..args.turns {
            convo.extend(tokens(1000 + turn as u32, args.turn_tokens));
            let (warm, reply, cached) = run(&e, convo.clone(), args.reply_tokens).await;
            let cold_prompt: Vec<u32> = tokens(5000 + turn as u32, convo.len());
            let (cold, _, cold_cached) = run(&e, cold_prompt, args.reply_tokens).await;
            assert_eq!(cold_cached, 0);
            println!(
                "| {} | {} | {} | {} | {} | {:.1}x |",
                turn + 1,
                convo.len(),
                cached,
                ms(warm),
                ms(cold),
                cold.as_secs_f64() / warm.as_secs_f64()
            );
            convo.extend(reply);
        }
        e.shutdown();

        // 2. Spill and restore.
        let tmp = tempfile::tempdir().expect("tmp");
        let dir = args.spill_dir.clone().unwrap_or_else(|| tmp.path().to_path_buf());
        std::fs::create_dir_all(&dir).expect("spill dir");
        let pool = (args.spill_tokens + 64).next_power_of_two().max(2048);
        let e = engine(&args, pool, Some(&dir)).await;
        let long = tokens(77, args.spill_tokens);
        let (_, reply, _) = run(&e, long.clone(), 8).await;
        // Push it out: two other prompts of the same length.
        run(&e, tokens(78, args.spill_tokens), 4).await;
        run(&e, tokens(79, args.spill_tokens), 4).await;
        let mut spilled = 0;
        for _ in 0..500 {
            spilled = e.pool_stats().await.map_or(0, |s| s.spilled_pages);
            if spilled * 256 >= args.spill_tokens - 256 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let follow: Vec<u32> = [long.clone(), reply, tokens(80, 40)].concat();
        let (restored, _, cached) = run(&e, follow.clone(), 1).await;
        let (cold, _, _) = run(&e, tokens(81, follow.len()), 1).await;
        let spill_bytes: u64 = walk(&dir);
        e.shutdown();
        let bw = disk_read_bandwidth(&dir, (spill_bytes as usize).max(64 << 20));
        println!();
        println!("spilled pages: {spilled} ({} MiB on disk)", spill_bytes >> 20);
        println!("| follow-up of {} tokens | TTFT |", follow.len());
        println!("|---|---|");
        println!("| restored from spill ({cached} tokens cached) | {} |", ms(restored));
        println!("| recomputed cold | {} |", ms(cold));
        println!(
            "| reading {} MiB at the disk's sequential bandwidth ({:.0} MiB/s) | {} |",
            spill_bytes >> 20,
            bw / (1 << 20) as f64,
            ms(Duration::from_secs_f64(spill_bytes as f64 / bw))
        );
    });
}

fn walk(dir: &std::path::Path) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            total += walk(&p);
        } else if p.extension().is_some_and(|x| x == "kvpage") {
            total += e.metadata().map_or(0, |m| m.len());
        }
    }
    total
}
