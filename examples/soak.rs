//! Soak test: drive both lanes at once for a bounded time and check the engine's promises.
//!
//! ```text
//! cargo run --release --example soak -- --duration 60s
//! cargo run --release --example soak -- --duration 60s --url http://127.0.0.1:8888 --agent-url http://127.0.0.1:8889
//! ```
//!
//! Without `--url` it starts the engine in-process (default model, both lanes on free ports).
//! Closed-loop clients send greedy streaming chat requests: short questions on `voice`, notes of a
//! few hundred tokens to summarise on `agent`. A seeded RNG picks each request's prompt and
//! whether (and after how many tokens) the client hangs up mid-stream. Afterwards every prompt
//! that produced tokens is run once more alone, and:
//! - each completed stream must equal its solo run (tokens, text, finish reason);
//! - each cancelled stream must be a prefix of it;
//! - no request may fail (any non-200, error event or stream without `[DONE]`);
//! - in-process, the KV pages must return to idle (nothing waiting or running, no block used).
//!
//! In-process, a spill phase follows (`--spill-phase`, on by default): a second engine with a
//! small KV pool (`--spill-pool-tokens`), 32-token pages and a temporary spill directory runs
//! every agent prompt twice, round robin, so the first run's pages are evicted to disk before the
//! second; the second runs must restore pages from disk and still equal the solo runs, and the
//! pool must return to idle. Then a restart: the engine is drained (cached pages written to
//! disk), a new engine opens the same directory, and every agent prompt must be served again with
//! prefix hits from disk and the same replies.
//!
//! In-process, a drafted phase follows too (`--drafted-phase`, on by default): a third engine whose
//! lanes both draft with the n-gram drafter (k = 7) runs every prompt that has a solo run, all at
//! once; each reply must equal the un-drafted solo run (exactness rule 1 under concurrency), and
//! drafts must have been both accepted and rejected.
//!
//! Prints per lane the request count, TTFT p50/p99, tokens/s and violations; exits non-zero on
//! any violation.

#[path = "../tests/e2e_http/mod.rs"]
mod e2e_http;

use std::collections::btree_map::{BTreeMap, Entry};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use e2e_http::{ms, percentile, StreamedToken, Target};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use shelfserve::actors::{start_engine, Engine, EngineOptions, InferenceEngine};
use shelfserve::api::{bind_all, ApiOptions};
use shelfserve::config::engine::EngineConfig;
use shelfserve::model::default_model::CacheDir;
use shelfserve::spec::SpeculativeMethod;

const CHAT: &str = "/v1/chat/completions";
/// Bound on any single read from the server, so a hung request is reported instead of hanging
/// the soak.
const PATIENCE: Duration = Duration::from_secs(300);
const LANES: [&str; 2] = ["voice", "agent"];

#[derive(Parser, Debug)]
#[command(about = "Drive both lanes with mixed load and cancellations; check exactness and page accounting")]
struct Args {
    /// How long clients keep starting requests (`60s`, `2m`, `500ms`).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    duration: Duration,
    /// Voice lane root (e.g. `http://127.0.0.1:8888`); without it the engine runs in-process.
    #[arg(long)]
    url: Option<String>,
    /// Agent lane root; defaults to `--url`.
    #[arg(long)]
    agent_url: Option<String>,
    /// Model for the in-process engine.
    #[arg(long, default_value = "default")]
    model: String,
    /// `model` sent with each request (in-process: the name the engine serves, `soak` by
    /// default); against `--url` the field is left out unless this is given.
    #[arg(long)]
    served_model_name: Option<String>,
    /// Seeds prompt choice and cancellations.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long, default_value_t = 2)]
    voice_clients: usize,
    #[arg(long, default_value_t = 2)]
    agent_clients: usize,
    /// Probability that a client hangs up mid-stream.
    #[arg(long, default_value_t = 0.25)]
    cancel_rate: f64,
    #[arg(long, default_value_t = 12)]
    voice_max_tokens: usize,
    #[arg(long, default_value_t = 24)]
    agent_max_tokens: usize,
    /// Approximate length of an agent prompt in words (a word is about 1.3 tokens).
    #[arg(long, default_value_t = 200)]
    agent_prompt_words: usize,
    /// Distinct agent prompts.
    #[arg(long, default_value_t = 3)]
    agent_prompts: usize,
    /// Run the spill phase after the load phase (in-process only).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    spill_phase: bool,
    /// KV pool of the spill phase's engine, in tokens (small, so pages are evicted to disk).
    #[arg(long, default_value_t = 768)]
    spill_pool_tokens: usize,
    /// Run the drafted phase (n-gram speculative decoding checked against the solo runs).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    drafted_phase: bool,
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

const VOICE_PROMPTS: [&str; 6] = [
    "What is the capital of Italy?",
    "How many minutes are in an hour?",
    "Set a timer for ten minutes.",
    "What's the weather usually like in spring?",
    "Spell the word 'banana'.",
    "Who painted the Mona Lisa?",
];

const NOTES: [&str; 16] = [
    "The team agreed to move the release date by two weeks to finish the migration.",
    "Maria will own the database schema review and report back on Friday.",
    "Customers reported slow page loads during the evening peak.",
    "The cache hit rate dropped after the last deployment and nobody knows why yet.",
    "We decided to keep the old API running until every client has upgraded.",
    "The budget for new hardware was approved, but only for two machines.",
    "Testing on the staging cluster found a memory leak in the upload service.",
    "The design team proposed a simpler onboarding flow with three steps instead of five.",
    "Legal asked for a review of the data retention policy before the launch.",
    "Support tickets about password resets doubled this month.",
    "The mobile app crash rate is down to half a percent after the fix.",
    "John suggested writing a postmortem for the outage on Tuesday.",
    "Everyone agreed that on-call rotations should be one week, not two.",
    "The analytics pipeline will move to hourly batches to cut costs.",
    "A new contractor starts next Monday and needs access to the repositories.",
    "The security audit found no critical issues, but three medium ones.",
];

/// Agent prompts: meeting notes of about `words` words drawn from `NOTES`, then a question.
fn agent_prompts(rng: &mut ChaCha8Rng, count: usize, words: usize) -> Vec<String> {
    (0..count)
        .map(|i| {
            let mut text = format!("Notes from planning meeting number {}:\n", i + 1);
            let mut n = 0;
            while n < words {
                let s = NOTES[rng.random_range(0..NOTES.len())];
                n += s.split_whitespace().count();
                text.push_str("- ");
                text.push_str(s);
                text.push('\n');
            }
            text.push_str("\nWhat are the two most important decisions in these notes?");
            text
        })
        .collect()
}

fn body(model: Option<&str>, prompt: &str, max_tokens: usize) -> Value {
    let mut body = json!({
        "messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
        "logprobs": true,
    });
    if let Some(m) = model {
        body["model"] = json!(m);
    }
    body
}

/// One request as the client saw it.
#[derive(Debug)]
struct Outcome {
    lane: usize,
    prompt: usize,
    ttft: Option<Duration>,
    tokens: Vec<StreamedToken>,
    text: String,
    finish: Option<String>,
    /// The client hung up on purpose after this many tokens.
    cancelled_after: Option<usize>,
    error: Option<String>,
}

struct Plan {
    model: Option<String>,
    prompts: [Vec<String>; 2],
    max_tokens: [usize; 2],
    targets: [Target; 2],
}

/// Send one greedy streaming request; `cancel_after` hangs up after that many tokens.
fn run_one(plan: &Plan, lane: usize, prompt: usize, cancel_after: Option<usize>) -> Outcome {
    let mut out = Outcome {
        lane,
        prompt,
        ttft: None,
        tokens: Vec::new(),
        text: String::new(),
        finish: None,
        cancelled_after: None,
        error: None,
    };
    let req = body(plan.model.as_deref(), &plan.prompts[lane][prompt], plan.max_tokens[lane]);
    let mut stream = match plan.targets[lane].stream(CHAT, &req) {
        Ok(Ok(s)) => s,
        Ok(Err(resp)) => {
            out.error = Some(format!("HTTP {}: {}", resp.status, resp.text()));
            return out;
        }
        Err(e) => {
            out.error = Some(format!("request failed: {e}"));
            return out;
        }
    };
    let read = match cancel_after {
        Some(k) => stream.read_tokens(k).map(|_| ()),
        None => loop {
            match stream.step() {
                Ok(Some(_)) => {}
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            }
        },
    };
    let r = &stream.result;
    out.ttft = r.first_token;
    out.tokens = r.tokens.clone();
    out.text = r.text.clone();
    out.finish = r.finish_reason.clone();
    if let Err(e) = read {
        out.error = Some(format!("reading the stream: {e}"));
    } else if let Some(e) = &r.error {
        out.error = Some(format!("error event: {e}"));
    } else if cancel_after.is_some() && !r.done {
        out.cancelled_after = Some(r.tokens.len());
    } else if !r.done {
        out.error = Some("the stream ended without [DONE]".into());
    }
    // Dropping the stream closes the connection: a cancellation when it was cut short.
    drop(stream);
    out
}

fn client(plan: Arc<Plan>, lane: usize, seed: u64, cancel_rate: f64, deadline: Instant) -> Vec<Outcome> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut outcomes = Vec::new();
    while Instant::now() < deadline {
        let prompt = rng.random_range(0..plan.prompts[lane].len());
        let max = plan.max_tokens[lane];
        let cancel = (max > 1 && rng.random_bool(cancel_rate)).then(|| rng.random_range(1..max));
        let o = run_one(&plan, lane, prompt, cancel);
        if o.error.is_some() {
            // Already a violation; back off rather than spin against a dead server.
            std::thread::sleep(Duration::from_millis(200));
        }
        outcomes.push(o);
    }
    outcomes
}

fn served_name(args: &Args) -> String {
    args.served_model_name.clone().unwrap_or_else(|| "soak".into())
}

/// The in-process engine and its lane servers.
struct Local {
    rt: tokio::runtime::Runtime,
    engine: Arc<Engine>,
    servers: Vec<actix_web::dev::ServerHandle>,
}

fn start_local(args: &Args, spill: Option<&std::path::Path>) -> Result<(Local, [Target; 2]), String> {
    start_local_with(args, spill, SpeculativeMethod::None)
}

/// [`start_local`] with every lane drafting by `speculative` (k = 7).
fn start_local_with(
    args: &Args,
    spill: Option<&std::path::Path>,
    speculative: SpeculativeMethod,
) -> Result<(Local, [Target; 2]), String> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| e.to_string())?;
    let bundle = shelfserve::model::open(&args.model, &CacheDir::from_env()).map_err(|e| e.to_string())?;
    let mut cfg = EngineConfig::builtin();
    if speculative != SpeculativeMethod::None {
        for l in cfg.lanes.iter_mut() {
            l.speculative = speculative.clone();
            l.num_speculative_tokens = shelfserve::spec::MAX_SPECULATIVE_TOKENS;
        }
    }
    if let Some(dir) = spill {
        cfg.scheduler.kv_pool_tokens = args.spill_pool_tokens;
        cfg.scheduler.page_tokens = 32;
        cfg.scheduler.spill_dir = Some(dir.display().to_string());
        cfg.scheduler.spill_budget = 1 << 30;
    }
    cfg.host = "127.0.0.1".into();
    cfg.lanes.iter_mut().for_each(|l| l.port = 0);
    let name = served_name(args);
    let (engine, servers, addrs) = rt.block_on(async {
        let engine = start_engine(
            bundle,
            cfg.clone(),
            EngineOptions { device: Default::default(), served_model_name: name.clone() },
        )
        .await
        .map_err(|e| e.to_string())?;
        let dyn_engine: Arc<dyn InferenceEngine> = engine.clone();
        let bound = bind_all(dyn_engine, &cfg, ApiOptions::new(name)).map_err(|e| e.to_string())?;
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
    let targets = [target("voice")?, target("agent")?];
    for (lane, addr) in &addrs {
        println!("in-process engine: {lane} lane on http://{addr}/v1");
    }
    Ok((Local { rt, engine, servers }, targets))
}

impl Local {
    /// Wait until nothing waits or runs and no block is used; `Err` describes what is left.
    fn wait_idle(&self, patience: Duration) -> Result<Duration, String> {
        self.rt.block_on(async {
            let start = Instant::now();
            loop {
                let s = self.engine.stats().await.ok_or("the scheduler does not answer")?;
                if s.waiting == 0 && s.running == 0 && s.blocks_used == 0 && s.steps_in_flight == 0 {
                    return Ok(start.elapsed());
                }
                if start.elapsed() > patience {
                    return Err(format!("not idle after {patience:?}: {s:?}"));
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    }

    fn stop(self) {
        self.rt.block_on(async {
            for h in &self.servers {
                h.stop(false).await;
            }
        });
        self.engine.shutdown();
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SHELFSERVE_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    match run(&args) {
        Ok(0) => ExitCode::SUCCESS,
        Ok(_) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("soak: {e}");
            ExitCode::from(2)
        }
    }
}

/// Returns the number of violations.
fn run(args: &Args) -> Result<usize, String> {
    if !(0.0..=1.0).contains(&args.cancel_rate) {
        return Err("--cancel-rate must be in [0, 1]".into());
    }
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let agent = agent_prompts(&mut rng, args.agent_prompts.max(1), args.agent_prompt_words);
    let (local, targets) = match &args.url {
        Some(url) => {
            let voice = Target::from_url(url, PATIENCE)?;
            let agent = Target::from_url(args.agent_url.as_deref().unwrap_or(url), PATIENCE)?;
            (None, [voice, agent])
        }
        None if args.agent_url.is_some() => return Err("--agent-url needs --url".into()),
        None => {
            let (local, targets) = start_local(args, None)?;
            (Some(local), targets)
        }
    };
    let plan = Arc::new(Plan {
        model: if local.is_some() { Some(served_name(args)) } else { args.served_model_name.clone() },
        prompts: [VOICE_PROMPTS.iter().map(|s| s.to_string()).collect(), agent],
        max_tokens: [args.voice_max_tokens.max(1), args.agent_max_tokens.max(1)],
        targets,
    });

    println!(
        "soak: {:?} with {} voice and {} agent clients, cancel rate {}, seed {}",
        args.duration, args.voice_clients, args.agent_clients, args.cancel_rate, args.seed
    );
    let started = Instant::now();
    let deadline = started + args.duration;
    let clients: Vec<_> = (0..args.voice_clients)
        .map(|i| (0, i))
        .chain((0..args.agent_clients).map(|i| (1, i)))
        .map(|(lane, i)| {
            let plan = Arc::clone(&plan);
            let seed = args.seed.wrapping_mul(1000).wrapping_add((lane * 100 + i) as u64);
            let rate = args.cancel_rate;
            std::thread::spawn(move || client(plan, lane, seed, rate, deadline))
        })
        .collect();
    let mut outcomes = Vec::new();
    for c in clients {
        outcomes.extend(c.join().map_err(|_| "a client thread panicked")?);
    }
    let load_secs = started.elapsed().as_secs_f64();

    let mut violations: Vec<String> = Vec::new();
    let mut idle_note = String::from("not checked (remote server)");
    if let Some(local) = &local {
        match local.wait_idle(Duration::from_secs(30)) {
            Ok(t) => idle_note = format!("idle after the run in {} (no block used)", ms(t)),
            Err(e) => violations.push(format!("pages: {e}")),
        }
    }
    for o in &outcomes {
        if let Some(e) = &o.error {
            violations.push(format!("{} prompt {}: {e}", LANES[o.lane], o.prompt));
        }
    }

    // Solo runs, one per prompt that produced tokens, on the now idle engine.
    let solo_started = Instant::now();
    let mut solo: BTreeMap<(usize, usize), Outcome> = BTreeMap::new();
    for o in outcomes.iter().filter(|o| o.error.is_none() && !o.tokens.is_empty()) {
        if let Entry::Vacant(slot) = solo.entry((o.lane, o.prompt)) {
            let s = run_one(&plan, o.lane, o.prompt, None);
            if let Some(e) = &s.error {
                violations.push(format!("solo run of {} prompt {}: {e}", LANES[o.lane], o.prompt));
            }
            slot.insert(s);
        }
    }
    let solo_secs = solo_started.elapsed().as_secs_f64();
    let (mut equal, mut prefixes) = (0, 0);
    for o in outcomes.iter().filter(|o| o.error.is_none()) {
        let Some(s) = solo.get(&(o.lane, o.prompt)).filter(|s| s.error.is_none()) else { continue };
        let got: Vec<&[u8]> = o.tokens.iter().map(|t| t.bytes.as_slice()).collect();
        let want: Vec<&[u8]> = s.tokens.iter().map(|t| t.bytes.as_slice()).collect();
        let what = format!("{} prompt {}", LANES[o.lane], o.prompt);
        match o.cancelled_after {
            Some(_) if want.starts_with(&got) => prefixes += 1,
            Some(n) => {
                violations.push(format!("{what}: the {n} tokens before hanging up are not a prefix of the solo run"))
            }
            None if got == want && o.text == s.text && o.finish == s.finish => equal += 1,
            None => violations.push(format!(
                "{what}: differs from its solo run\n    solo: {:?} ({:?})\n    load: {:?} ({:?})",
                s.text, s.finish, o.text, o.finish
            )),
        }
    }
    if let Some(local) = &local {
        if let Err(e) = local.wait_idle(Duration::from_secs(30)) {
            violations.push(format!("pages after the solo runs: {e}"));
        }
    }

    println!(
        "\n{:<6} {:>8} {:>9} {:>9} {:>6} {:>10} {:>10} {:>8} {:>8}",
        "lane", "requests", "completed", "cancelled", "errors", "TTFT p50", "TTFT p99", "tokens", "tok/s"
    );
    for (lane, name) in LANES.iter().enumerate() {
        let mine: Vec<&Outcome> = outcomes.iter().filter(|o| o.lane == lane).collect();
        let ttfts: Vec<Duration> = mine.iter().filter_map(|o| o.ttft).collect();
        let tokens: usize = mine.iter().map(|o| o.tokens.len()).sum();
        let show = |p: f64| percentile(&ttfts, p).map_or("-".to_string(), ms);
        println!(
            "{:<6} {:>8} {:>9} {:>9} {:>6} {:>10} {:>10} {:>8} {:>8.1}",
            name,
            mine.len(),
            mine.iter().filter(|o| o.error.is_none() && o.cancelled_after.is_none()).count(),
            mine.iter().filter(|o| o.cancelled_after.is_some()).count(),
            mine.iter().filter(|o| o.error.is_some()).count(),
            show(50.0),
            show(99.0),
            tokens,
            tokens as f64 / load_secs,
        );
    }
    println!(
        "\nload phase {load_secs:.1} s; solo runs of {} prompts {solo_secs:.1} s; {equal} completed streams equal \
         their solo runs, {prefixes} cancelled streams are prefixes of theirs",
        solo.len()
    );
    println!("pages: {idle_note}");
    if let Some(local) = local {
        local.stop();
        if args.drafted_phase {
            drafted_phase(args, &plan, &solo, &mut violations)?;
        }
        if args.spill_phase {
            spill_phase(args, &plan, &solo, &mut violations)?;
        }
    }
    if violations.is_empty() {
        println!("violations: 0");
    } else {
        println!("violations: {}", violations.len());
        for v in violations.iter().take(20) {
            println!("  {v}");
        }
    }
    Ok(violations.len())
}

/// The spill phase (see the module doc): every agent prompt twice, round robin, through a small
/// pool that evicts to a temporary spill directory.
fn spill_phase(
    args: &Args,
    plan: &Plan,
    solo: &BTreeMap<(usize, usize), Outcome>,
    violations: &mut Vec<String>,
) -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let (local, targets) = start_local(args, Some(dir.path()))?;
    let spill_plan =
        Plan { model: plan.model.clone(), prompts: plan.prompts.clone(), max_tokens: plan.max_tokens, targets };
    let started = Instant::now();
    let n = spill_plan.prompts[1].len();
    let mut firsts = Vec::new();
    for round in 0..2 {
        for prompt in 0..n {
            let o = run_one(&spill_plan, 1, prompt, None);
            let what = format!("spill phase round {round}, agent prompt {prompt}");
            if let Some(e) = &o.error {
                violations.push(format!("{what}: {e}"));
                continue;
            }
            let want = solo.get(&(1, prompt)).or(firsts.get(prompt));
            let same = |a: &Outcome, b: &Outcome| {
                a.tokens.iter().map(|t| &t.bytes).eq(b.tokens.iter().map(|t| &t.bytes)) && a.text == b.text
            };
            if let Some(w) = want.filter(|w| !same(w, &o)) {
                violations
                    .push(format!("{what}: differs from its solo run\n    solo: {:?}\n    now:  {:?}", w.text, o.text));
            }
            if round == 0 {
                firsts.push(o);
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let stats = local.rt.block_on(local.engine.pool_stats()).ok_or("the pool does not answer")?;
    if stats.spilled_pages == 0 {
        violations.push(format!("spill phase: nothing was spilled ({stats:?})"));
    }
    if stats.counters.hit_tokens == 0 {
        violations.push(format!("spill phase: no prefix hit in the second round ({stats:?})"));
    }
    if let Err(e) = local.wait_idle(Duration::from_secs(30)) {
        violations.push(format!("spill phase pages: {e}"));
    }
    println!(
        "spill phase: {} agent prompts x 2 through a {}-token pool in {secs:.1} s; {} pages on disk, {} tokens \
         served from the cache, misses {:?}",
        n, args.spill_pool_tokens, stats.spilled_pages, stats.counters.hit_tokens, stats.counters.misses
    );
    // Restart: a drained shutdown writes what is only in RAM to disk; a new engine on the same
    // directory must serve every agent prompt again, from disk, with the same replies.
    let drained = local.rt.block_on(local.engine.drain(Duration::from_secs(30)));
    if !drained.flushed || drained.cancelled > 0 {
        violations.push(format!("restart phase: the drain did not end cleanly ({drained:?})"));
    }
    local.stop();
    let started = Instant::now();
    let (local, targets) = start_local(args, Some(dir.path()))?;
    let restart_plan =
        Plan { model: plan.model.clone(), prompts: plan.prompts.clone(), max_tokens: plan.max_tokens, targets };
    for prompt in 0..n {
        let o = run_one(&restart_plan, 1, prompt, None);
        let what = format!("restart phase, agent prompt {prompt}");
        if let Some(e) = &o.error {
            violations.push(format!("{what}: {e}"));
            continue;
        }
        let want = solo.get(&(1, prompt)).or(firsts.get(prompt));
        if let Some(w) = want.filter(|w| !(w.tokens.iter().map(|t| &t.bytes).eq(o.tokens.iter().map(|t| &t.bytes)))) {
            violations
                .push(format!("{what}: differs from its solo run\n    solo: {:?}\n    now:  {:?}", w.text, o.text));
        }
    }
    let stats = local.rt.block_on(local.engine.pool_stats()).ok_or("the pool does not answer")?;
    if stats.counters.hit_tokens == 0 {
        violations.push(format!("restart phase: nothing was served from disk after the restart ({stats:?})"));
    }
    println!(
        "restart phase: drained ({drained:?}), restarted and served {n} agent prompts in {:.1} s; {} tokens from \
         the cache",
        started.elapsed().as_secs_f64(),
        stats.counters.hit_tokens
    );
    local.stop();
    Ok(())
}

/// The drafted phase (see the module doc): every prompt with a solo run, all at once, through an
/// engine whose lanes draft with n-grams; each reply must equal its un-drafted solo run.
fn drafted_phase(
    args: &Args,
    plan: &Plan,
    solo: &BTreeMap<(usize, usize), Outcome>,
    violations: &mut Vec<String>,
) -> Result<(), String> {
    let (local, targets) = start_local_with(args, None, SpeculativeMethod::Ngram)?;
    let drafted_plan = Arc::new(Plan {
        model: plan.model.clone(),
        prompts: plan.prompts.clone(),
        max_tokens: plan.max_tokens,
        targets,
    });
    let started = Instant::now();
    let keys: Vec<(usize, usize)> = solo.iter().filter(|(_, s)| s.error.is_none()).map(|(k, _)| *k).collect();
    let runs: Vec<_> = keys
        .iter()
        .map(|&(lane, prompt)| {
            let p = Arc::clone(&drafted_plan);
            std::thread::spawn(move || run_one(&p, lane, prompt, None))
        })
        .collect();
    for (key, run) in keys.iter().zip(runs) {
        let o = run.join().map_err(|_| "a drafted-phase client panicked")?;
        let what = format!("drafted phase, {} prompt {}", LANES[key.0], key.1);
        if let Some(e) = &o.error {
            violations.push(format!("{what}: {e}"));
            continue;
        }
        let s = &solo[key];
        let same = o.tokens.iter().map(|t| &t.bytes).eq(s.tokens.iter().map(|t| &t.bytes));
        if !(same && o.text == s.text && o.finish == s.finish) {
            violations.push(format!(
                "{what}: differs from the un-drafted solo run\n    solo:    {:?} ({:?})\n    drafted: {:?} ({:?})",
                s.text, s.finish, o.text, o.finish
            ));
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let stats = local.rt.block_on(local.engine.stats()).ok_or("the scheduler does not answer")?;
    if stats.accepted_tokens == 0 || stats.drafted_tokens == stats.accepted_tokens {
        violations.push(format!("drafted phase: drafts were not both accepted and rejected ({stats:?})"));
    }
    if let Err(e) = local.wait_idle(Duration::from_secs(30)) {
        violations.push(format!("drafted phase pages: {e}"));
    }
    println!(
        "drafted phase: {} prompts at once with n-gram drafts (k = 7) in {secs:.1} s; {} of {} draft tokens accepted",
        keys.len(),
        stats.accepted_tokens,
        stats.drafted_tokens
    );
    local.stop();
    Ok(())
}
