//! Mixed-lane load: coding agents resending long, growing contexts on the agent lane while voice
//! turns arrive open-loop on the voice lane; per-lane TTFT / inter-token percentiles and agent
//! throughput, with lane pacing off and on, alternately, in one run.
//!
//! ```text
//! cargo run --release --example mixed_load -- --phase 60s --rounds 2
//! ```
//!
//! Each phase starts the engine in-process (default model, both lanes on free ports) with
//! `lane_pacing` off or on (`off, on, off, on, …`: the machine's other load hits both alike),
//! then:
//! 1. measures idle voice TTFT (`--idle-samples` short turns one after another, after a warm-up);
//! 2. runs `--agents` closed-loop agent clients: each opens a session with its own document of
//!    about `--agent-prompt-words` words (~1.3 tokens a word), asks `--turns` questions in it —
//!    every turn resends the whole conversation, so the context grows — then starts a new session
//!    with a new document; meanwhile voice turns arrive at `--voice-rate` per second (exponential
//!    gaps, seeded);
//! 3. reports per lane TTFT p50/p90/p99/max and inter-token gap p50/p99, voice TTFT over idle,
//!    and agent throughput: prompt tokens computed (not served from the prefix cache) plus
//!    completion tokens, per second of the phase.
//!
//! Every request is greedy and streamed with `logprobs` so each token is timestamped. A request
//! that fails is counted and reported; the run exits non-zero if any did.

#[path = "../tests/e2e_http/mod.rs"]
mod e2e_http;

use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use e2e_http::{percentile, Streamed, Target};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use shelfserve::actors::{start_engine, Engine, EngineOptions, InferenceEngine};
use shelfserve::api::{bind_all, ApiOptions};
use shelfserve::config::engine::DEFAULT_CONFIG_TOML;
use shelfserve::config::layers::{DeviceClass, EngineFile, ModelFamily, SchedulerKnobs};
use shelfserve::generate::DeviceKind;
use shelfserve::model::default_model::CacheDir;

const CHAT: &str = "/v1/chat/completions";
const PATIENCE: Duration = Duration::from_secs(600);

#[derive(Parser, Debug, Clone)]
#[command(about = "Agents with long growing prompts plus open-loop voice turns; lane pacing off vs on")]
struct Args {
    /// Load time of each phase (`60s`, `2m`).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    phase: Duration,
    /// Pairs of phases (pacing off, then on).
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Only run phases with lane pacing on (`on`), off (`off`), or both alternately (`both`).
    #[arg(long, default_value = "both")]
    pacing: String,
    #[arg(long, default_value = "default")]
    model: String,
    /// `cpu` or `cuda`: the engine takes that device's scheduler defaults and lane targets.
    #[arg(long, default_value = "cpu")]
    device: shelfserve::generate::DeviceKind,
    /// CPU threads of the engine (0 = one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    #[arg(long, default_value_t = 4)]
    agents: usize,
    /// Words of an agent session's document (about 1.3 tokens a word).
    #[arg(long, default_value_t = 1750)]
    agent_prompt_words: usize,
    /// Questions per agent session (each resends the grown conversation).
    #[arg(long, default_value_t = 3)]
    turns: usize,
    #[arg(long, default_value_t = 64)]
    agent_max_tokens: usize,
    /// Voice arrivals per second (open loop).
    #[arg(long, default_value_t = 0.5)]
    voice_rate: f64,
    /// The voice lane's time-to-first-token target in ms (default: the device's).
    #[arg(long)]
    voice_target_ttft_ms: Option<f64>,
    /// The voice lane's inter-token target in ms (default: the device's).
    #[arg(long)]
    voice_target_itl_ms: Option<f64>,
    #[arg(long, default_value_t = 24)]
    voice_max_tokens: usize,
    #[arg(long, default_value_t = 8)]
    idle_samples: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write the rows as JSON here too.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Overlapped scheduling in every phase (`true`/`false`; the engine's default is on).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    overlap_scheduling: bool,
    /// Lower-lane prefill steps yield at a layer boundary to voice (`true`/`false`; the engine's
    /// default is on; only with lane pacing).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    yield_lower_prefill: bool,
    /// A decoding voice lane's steps alternate with agent prefill steps that can yield
    /// (`true`/`false`; default: the device's).
    #[arg(long, action = clap::ArgAction::Set)]
    separate_lane_decodes: Option<bool>,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = s.split_at(s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len()));
    let v: f64 = num.parse().map_err(|_| format!("`{s}`: expected a number with s, m or ms"))?;
    let secs = match unit {
        "" | "s" => v,
        "ms" => v / 1e3,
        "m" => v * 60.0,
        other => return Err(format!("`{s}`: unknown unit `{other}` (use s, m or ms)")),
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("`{s}`: not a duration"));
    }
    Ok(Duration::from_secs_f64(secs))
}

const VOICE_TURNS: [&str; 6] = [
    "What is the capital of Italy?",
    "Set a timer for ten minutes.",
    "How many legs does a spider have?",
    "Say hello in French.",
    "Tell me a one-line joke.",
    "What's two plus two?",
];
const AGENT_QUESTIONS: [&str; 4] = [
    "List the three riskiest changes in this log and why.",
    "Propose a test for the second change.",
    "Rewrite the summary of the first section in two sentences.",
    "Which of these items should be reverted first?",
];
const WORDS: [&str; 24] = [
    "scheduler",
    "queue",
    "robot",
    "battery",
    "charger",
    "warehouse",
    "route",
    "planner",
    "deadline",
    "order",
    "priority",
    "metrics",
    "lock",
    "latency",
    "aisle",
    "report",
    "retry",
    "budget",
    "cache",
    "page",
    "agent",
    "voice",
    "commit",
    "review",
];

/// A session's document: seeded words in sentences, distinct per agent and session so agents
/// never share cached pages with each other.
fn document(rng: &mut ChaCha8Rng, agent: usize, session: usize, words: usize) -> String {
    let mut text = format!("Change log {agent}-{session}. ");
    for i in 0..words {
        text.push_str(WORDS[rng.random_range(0..WORDS.len())]);
        text.push_str(if i % 12 == 11 { ". " } else { " " });
    }
    text
}

fn request(messages: &[Value], max_tokens: usize) -> Value {
    json!({
        "model": "default",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "logprobs": true,
        "stream_options": {"include_usage": true},
    })
}

#[derive(Default)]
struct LaneLog {
    ttft: Vec<Duration>,
    gaps: Vec<Duration>,
    completed: usize,
    failed: Vec<String>,
    /// Prompt tokens computed (prompt minus cached) and completion tokens.
    computed_prompt: u64,
    completion: u64,
    prompt_tokens: u64,
}

impl LaneLog {
    fn record(&mut self, r: &Streamed) {
        if r.error.is_some() || !r.done {
            self.failed.push(r.error.as_ref().map_or_else(|| "no [DONE]".to_string(), Value::to_string));
            return;
        }
        let Some(first) = r.first_token else {
            self.failed.push("no token".into());
            return;
        };
        self.ttft.push(first);
        self.gaps.extend(r.gaps());
        self.completed += 1;
        if let Some(u) = &r.usage {
            let prompt = u["prompt_tokens"].as_u64().unwrap_or(0);
            let cached = u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
            self.prompt_tokens += prompt;
            self.computed_prompt += prompt.saturating_sub(cached);
            self.completion += u["completion_tokens"].as_u64().unwrap_or(0);
        }
    }
}

struct Local {
    rt: tokio::runtime::Runtime,
    engine: Arc<Engine>,
    servers: Vec<actix_web::dev::ServerHandle>,
    voice: Target,
    agent: Target,
}

fn start(args: &Args, pacing: bool) -> Result<Local, String> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| e.to_string())?;
    let bundle = shelfserve::model::open(&args.model, &CacheDir::from_env()).map_err(|e| e.to_string())?;
    let class = if args.device == DeviceKind::Cuda { DeviceClass::Cuda } else { DeviceClass::Cpu };
    let family = ModelFamily::of_model_type(&bundle.config.model_type);
    let (mut cfg, _) = EngineFile::from_toml(DEFAULT_CONFIG_TOML, "configs/default.toml")
        .map_err(|e| e.to_string())?
        .resolve(&SchedulerKnobs::default(), None, family, class)?;
    cfg.scheduler.lane_pacing = pacing;
    cfg.scheduler.overlap_scheduling = args.overlap_scheduling;
    cfg.scheduler.yield_lower_prefill = args.yield_lower_prefill;
    if let Some(on) = args.separate_lane_decodes {
        cfg.scheduler.separate_lane_decodes = on;
    }
    if let Some(ms) = args.voice_target_ttft_ms {
        cfg.lanes.iter_mut().filter(|l| l.name == "voice").for_each(|l| l.target_ttft_ms = Some(ms));
    }
    if let Some(ms) = args.voice_target_itl_ms {
        cfg.lanes.iter_mut().filter(|l| l.name == "voice").for_each(|l| l.target_itl_ms = Some(ms));
    }
    cfg.host = "127.0.0.1".into();
    cfg.lanes.iter_mut().for_each(|l| l.port = 0);
    let device =
        shelfserve::generate::DeviceSelection { kind: args.device, threads: args.threads, ..Default::default() };
    let (engine, servers, addrs) = rt.block_on(async {
        let engine = start_engine(bundle, cfg.clone(), EngineOptions { device, served_model_name: "default".into() })
            .await
            .map_err(|e| e.to_string())?;
        let dyn_engine: Arc<dyn InferenceEngine> = engine.clone();
        let bound = bind_all(dyn_engine, &cfg, ApiOptions::new("default")).map_err(|e| e.to_string())?;
        let addrs: Vec<(String, std::net::SocketAddr)> = bound.iter().map(|s| (s.lane.clone(), s.addrs[0])).collect();
        let handles = bound.iter().map(|s| s.server.handle()).collect::<Vec<_>>();
        for s in bound {
            tokio::spawn(s.server);
        }
        let start = Instant::now();
        while !engine.is_ready() {
            if start.elapsed() > PATIENCE {
                return Err("the model did not load".to_string());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok::<_, String>((engine, handles, addrs))
    })?;
    let target = |lane: &str| {
        addrs.iter().find(|(l, _)| l == lane).map(|(_, a)| Target::new(*a, PATIENCE)).ok_or(format!("no lane {lane}"))
    };
    Ok(Local { voice: target("voice")?, agent: target("agent")?, rt, engine, servers })
}

impl Local {
    fn stop(self) {
        self.rt.block_on(async {
            for h in &self.servers {
                h.stop(false).await;
            }
        });
        self.engine.shutdown();
    }
}

struct Row {
    pacing: bool,
    wall: Duration,
    idle: Vec<Duration>,
    /// Inter-token gaps of the idle voice turns.
    idle_gaps: Vec<Duration>,
    voice: LaneLog,
    agent: LaneLog,
}

fn run_phase(args: &Args, pacing: bool, round: usize) -> Result<Row, String> {
    let local = start(args, pacing)?;
    let voice_turn = |i: usize| {
        request(&[json!({"role": "user", "content": VOICE_TURNS[i % VOICE_TURNS.len()]})], args.voice_max_tokens)
    };
    // Warm-up, then idle voice TTFT.
    local.voice.stream_to_clean_end(CHAT, &voice_turn(0));
    let (mut idle, mut idle_gaps) = (Vec::new(), Vec::new());
    for i in 0..args.idle_samples {
        let r = local.voice.stream_to_clean_end(CHAT, &voice_turn(i));
        idle.push(r.first_token.ok_or("an idle voice turn produced no token")?);
        idle_gaps.extend(r.gaps());
    }

    let voice = Arc::new(Mutex::new(LaneLog::default()));
    let agent = Arc::new(Mutex::new(LaneLog::default()));
    let start = Instant::now();
    let end = start + args.phase;
    let mut threads = Vec::new();
    for a in 0..args.agents {
        let (target, log, args) = (local.agent.clone(), Arc::clone(&agent), args.clone());
        threads.push(std::thread::spawn(move || {
            // Seeded per round and agent: both phases of a round see the same documents.
            let mut rng = ChaCha8Rng::seed_from_u64(args.seed ^ ((round as u64) << 32) ^ a as u64);
            let mut session = 0;
            while Instant::now() < end {
                let doc = document(&mut rng, a, session, args.agent_prompt_words);
                let mut messages = vec![json!({"role": "system", "content": doc})];
                for t in 0..args.turns {
                    if Instant::now() >= end {
                        break;
                    }
                    let q = AGENT_QUESTIONS[(a + t + session) % AGENT_QUESTIONS.len()];
                    messages.push(json!({"role": "user", "content": q}));
                    let r = target.stream_to_clean_end(CHAT, &request(&messages, args.agent_max_tokens));
                    messages.push(json!({"role": "assistant", "content": r.text.clone()}));
                    log.lock().expect("agent log").record(&r);
                }
                session += 1;
            }
        }));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed.wrapping_add(round as u64));
    let gap = |rng: &mut ChaCha8Rng| Duration::from_secs_f64(-(1.0 - rng.random::<f64>()).ln() / args.voice_rate);
    let mut next = start + gap(&mut rng);
    let mut k = 0;
    while next < end {
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
        let (target, log, body) = (local.voice.clone(), Arc::clone(&voice), voice_turn(k));
        threads.push(std::thread::spawn(move || {
            let r = target.stream_to_clean_end(CHAT, &body);
            log.lock().expect("voice log").record(&r);
        }));
        k += 1;
        next += gap(&mut rng);
    }
    for t in threads {
        t.join().map_err(|_| "a client thread panicked")?;
    }
    let wall = start.elapsed();
    local.stop();
    let take = |l: Arc<Mutex<LaneLog>>| std::mem::take(&mut *l.lock().expect("log"));
    Ok(Row { pacing, wall, idle, idle_gaps, voice: take(voice), agent: take(agent) })
}

fn ms(d: Option<Duration>) -> String {
    d.map_or("-".into(), |d| format!("{:.1}", d.as_secs_f64() * 1e3))
}

fn ratio(a: Option<Duration>, b: Option<Duration>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if !b.is_zero() => format!("{:.2}×", a.as_secs_f64() / b.as_secs_f64()),
        _ => "-".into(),
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    // The engine's logs on stderr, filtered as the server's are (`SHELFSERVE_LOG`, default warn).
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SHELFSERVE_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let order: Vec<bool> = match args.pacing.as_str() {
        "on" => vec![true; args.rounds],
        "off" => vec![false; args.rounds],
        _ => (0..args.rounds).flat_map(|_| [false, true]).collect(),
    };
    let mut rows = Vec::new();
    for (i, &pacing) in order.iter().enumerate() {
        eprintln!("phase {} of {}: lane pacing {}", i + 1, order.len(), if pacing { "on" } else { "off" });
        match run_phase(&args, pacing, i / 2) {
            Ok(r) => rows.push(r),
            Err(e) => {
                eprintln!("phase failed: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    println!(
        "\n{} agents (~{} words/document, {} turns/session, {} tokens/turn), voice {}/s ({} tokens/turn), {} s phases\n",
        args.agents,
        args.agent_prompt_words,
        args.turns,
        args.agent_max_tokens,
        args.voice_rate,
        args.voice_max_tokens,
        args.phase.as_secs()
    );
    println!(
        "| pacing | voice idle TTFT p50 | voice TTFT p50 | p90 | p99 | max | p50/idle | p99/idle | voice ITL p50 | p99 | idle ITL p50 | ITL p99/idle p50 \
         | voice done | agent TTFT p50 | agent ITL p50 | agent turns | mean agent prompt | agent tok/s (computed prompt + out) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut json_rows = Vec::new();
    let mut failed = 0;
    for r in &rows {
        let idle = percentile(&r.idle, 50.0);
        let idle_itl = percentile(&r.idle_gaps, 50.0);
        let v = |p| percentile(&r.voice.ttft, p);
        let agent_tps = (r.agent.computed_prompt + r.agent.completion) as f64 / r.wall.as_secs_f64();
        let mean_prompt = r.agent.prompt_tokens as f64 / r.agent.completed.max(1) as f64;
        println!(
            "| {} | {} ms | {} ms | {} ms | {} ms | {} ms | {} | {} | {} ms | {} ms | {} ms | {} | {} | {} ms | {} ms | {} | {:.0} | {:.1} |",
            if r.pacing { "on" } else { "off" },
            ms(idle),
            ms(v(50.0)),
            ms(v(90.0)),
            ms(v(99.0)),
            ms(v(100.0)),
            ratio(v(50.0), idle),
            ratio(v(99.0), idle),
            ms(percentile(&r.voice.gaps, 50.0)),
            ms(percentile(&r.voice.gaps, 99.0)),
            ms(idle_itl),
            ratio(percentile(&r.voice.gaps, 99.0), idle_itl),
            r.voice.completed,
            ms(percentile(&r.agent.ttft, 50.0)),
            ms(percentile(&r.agent.gaps, 50.0)),
            r.agent.completed,
            mean_prompt,
            agent_tps,
        );
        failed += r.voice.failed.len() + r.agent.failed.len();
        for f in r.voice.failed.iter().chain(&r.agent.failed).take(3) {
            eprintln!("failed request: {f}");
        }
        let secs = |d: Option<Duration>| d.map(|d| d.as_secs_f64());
        json_rows.push(json!({
            "pacing": r.pacing, "wall_s": r.wall.as_secs_f64(),
            "voice_idle_ttft_p50_s": secs(idle),
            "voice_ttft_s": {"p50": secs(v(50.0)), "p90": secs(v(90.0)), "p99": secs(v(99.0)), "max": secs(v(100.0))},
            "voice_itl_s": {"p50": secs(percentile(&r.voice.gaps, 50.0)), "p99": secs(percentile(&r.voice.gaps, 99.0))},
            "voice_idle_itl_p50_s": secs(idle_itl),
            "voice_completed": r.voice.completed, "voice_failed": r.voice.failed.len(),
            "agent_ttft_p50_s": secs(percentile(&r.agent.ttft, 50.0)),
            "agent_itl_p50_s": secs(percentile(&r.agent.gaps, 50.0)),
            "agent_completed": r.agent.completed, "agent_failed": r.agent.failed.len(),
            "agent_mean_prompt_tokens": mean_prompt, "agent_tokens_per_s": agent_tps,
        }));
    }
    if let Some(path) = &args.json {
        if let Err(e) = std::fs::write(path, serde_json::to_string_pretty(&json_rows).unwrap_or_default()) {
            eprintln!("writing {}: {e}", path.display());
        }
    }
    if failed > 0 {
        eprintln!("{failed} requests failed");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
