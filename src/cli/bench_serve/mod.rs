//! `shelfserve bench-serve`: a load generator against any OpenAI-compatible base URL (ours or a
//! peer's), the role of `vllm bench serve`. Fixed concurrency or Poisson request rate, random or
//! JSONL prompts with input/output length ranges, `ignore_eos`, warm-up, a progress bar; reports
//! request and token throughput and TTFT, TPOT, ITL and end-to-end percentiles as a table and
//! JSON. With `--voice-base-url`, a mixed-lane load instead (`mixed`): agents with long, growing
//! prompts on `--base-url` plus open-loop voice turns, reported per lane.
//!
//! Owns the client side only: `prompts` makes the requests, `load` drives them (a library
//! function, reusable by other load tools), `report` summarises. It never touches the engine.

pub mod load;
pub mod mixed;
pub mod prompts;
pub mod report;

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use self::load::{Arrival, Endpoint, LoadOptions};
use self::prompts::LenRange;
use self::report::Report;
use super::CliError;

#[derive(Args, Debug, Clone)]
pub struct BenchServeArgs {
    /// The server's OpenAI base URL, up to and including `/v1` (plain HTTP).
    #[arg(long, env = "SHELFSERVE_BENCH_BASE_URL", default_value = "http://127.0.0.1:8888/v1")]
    pub base_url: String,
    /// `completions` (token-id prompts: exact input lengths) or `chat`.
    #[arg(long, env = "SHELFSERVE_BENCH_ENDPOINT", default_value = "completions")]
    pub endpoint: String,
    /// Model name sent in requests (default: the first one `GET /models` lists).
    #[arg(long, env = "SHELFSERVE_BENCH_MODEL")]
    pub model: Option<String>,
    /// Bearer key for the server.
    #[arg(long, env = "SHELFSERVE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Requests kept in flight (closed loop). Without --request-rate the default is 1.
    #[arg(long, env = "SHELFSERVE_BENCH_CONCURRENCY", conflicts_with = "request_rate")]
    pub concurrency: Option<usize>,
    /// Poisson arrivals per second (open loop) instead of a fixed concurrency.
    #[arg(long, env = "SHELFSERVE_BENCH_REQUEST_RATE")]
    pub request_rate: Option<f64>,
    /// With --request-rate: at most this many requests in flight (0 = no cap).
    #[arg(long, env = "SHELFSERVE_BENCH_MAX_CONCURRENCY", default_value_t = 0)]
    pub max_concurrency: usize,
    /// Measured requests.
    #[arg(long, env = "SHELFSERVE_BENCH_NUM_PROMPTS", default_value_t = 100)]
    pub num_prompts: usize,
    /// Prompt tokens of a random prompt.
    #[arg(long, env = "SHELFSERVE_BENCH_INPUT_LEN", default_value_t = 256)]
    pub input_len: usize,
    /// Tokens each request asks for (`max_tokens`).
    #[arg(long, env = "SHELFSERVE_BENCH_OUTPUT_LEN", default_value_t = 128)]
    pub output_len: usize,
    /// Spread of random lengths: each prompt's input and output length is drawn uniformly from
    /// len × (1 ± ratio); 0 = fixed lengths.
    #[arg(long, env = "SHELFSERVE_BENCH_INPUT_LEN_RANGE", default_value_t = 0.0)]
    pub input_len_range: f64,
    /// Token ids of random prompts are drawn from FIRST..LAST (inside every vocabulary the
    /// target might have).
    #[arg(long, env = "SHELFSERVE_BENCH_RANDOM_TOKENS", default_value = "1000..20000")]
    pub random_tokens: String,
    /// A JSONL dataset instead of random prompts: `{"prompt": "text" | [ids], "output_len": N}`
    /// per line (output_len optional: --output-len).
    #[arg(long, env = "SHELFSERVE_BENCH_DATASET")]
    pub dataset: Option<PathBuf>,
    /// Ask for exactly --output-len tokens (the server ignores end-of-sequence).
    #[arg(long, env = "SHELFSERVE_BENCH_IGNORE_EOS")]
    pub ignore_eos: bool,
    /// Unmeasured requests sent first (at once), to warm the server.
    #[arg(long, env = "SHELFSERVE_BENCH_WARMUP", default_value_t = 1)]
    pub warmup: usize,
    /// Seeds random prompts and arrival gaps.
    #[arg(long, env = "SHELFSERVE_BENCH_SEED", default_value_t = 0)]
    pub seed: u64,
    /// Longest one request may take, stream included, in seconds.
    #[arg(long, env = "SHELFSERVE_BENCH_TIMEOUT", default_value_t = 600)]
    pub timeout: u64,
    /// Also write the report (and the options) as JSON to this file.
    #[arg(long, env = "SHELFSERVE_BENCH_JSON")]
    pub json: Option<PathBuf>,
    /// No progress bar.
    #[arg(long, env = "SHELFSERVE_BENCH_NO_PROGRESS")]
    pub no_progress: bool,
    #[command(flatten)]
    pub mixed: MixedArgs,
}

/// The mixed-lane mode: `--base-url` is the agents' (low) lane, `--voice-base-url` the voice
/// (high) lane. `--output-len`, `--ignore-eos`, `--random-tokens`, `--endpoint`, `--seed` and
/// `--timeout` apply to both; the prompt-count and arrival options do not.
#[derive(Args, Debug, Clone)]
pub struct MixedArgs {
    /// The voice lane's base URL: turns on the mixed-lane load.
    #[arg(long, env = "SHELFSERVE_BENCH_VOICE_BASE_URL")]
    pub voice_base_url: Option<String>,
    /// Closed-loop agent clients.
    #[arg(long, default_value_t = 4)]
    pub agents: usize,
    /// Token ids of an agent's opening document.
    #[arg(long, default_value_t = 2350)]
    pub agent_context_tokens: usize,
    /// Questions per agent session (each resends the whole conversation) before a new document.
    #[arg(long, default_value_t = 4)]
    pub agent_turns: usize,
    /// Token ids of each agent question.
    #[arg(long, default_value_t = 32)]
    pub agent_question_tokens: usize,
    /// Voice turns per second (Poisson arrivals).
    #[arg(long, default_value_t = 0.5)]
    pub voice_rate: f64,
    /// Prompt tokens of a voice turn.
    #[arg(long, default_value_t = 32)]
    pub voice_input_len: usize,
    /// Tokens a voice turn asks for.
    #[arg(long, default_value_t = 32)]
    pub voice_output_len: usize,
    /// Voice turns sent one after another before the load starts (the idle TTFT).
    #[arg(long, default_value_t = 8)]
    pub idle_voice_samples: usize,
    /// Seconds of mixed load.
    #[arg(long, default_value_t = 60.0)]
    pub duration: f64,
}

fn usage(msg: String) -> CliError {
    CliError::Usage(msg)
}

impl BenchServeArgs {
    /// The options of requests to `base_url`; the model from `GET /models` unless --model.
    fn load_options(&self, base_url: &str, arrival: Arrival) -> Result<LoadOptions, CliError> {
        let mut opts = LoadOptions {
            base_url: base_url.to_string(),
            endpoint: self.endpoint()?,
            model: self.model.clone().unwrap_or_default(),
            api_key: self.api_key.clone(),
            arrival,
            ignore_eos: self.ignore_eos,
            seed: self.seed,
            timeout: Duration::from_secs(self.timeout.max(1)),
        };
        if self.model.is_none() {
            let probe = opts.clone();
            opts.model =
                actix_web::rt::System::new().block_on(async move { load::first_model(&probe).await }).map_err(usage)?;
        }
        Ok(opts)
    }

    fn token_range(&self) -> Result<std::ops::Range<u32>, CliError> {
        self.random_tokens
            .split_once("..")
            .and_then(|(a, b)| Some(a.trim().parse::<u32>().ok()?..b.trim().parse::<u32>().ok()?))
            .filter(|r| !r.is_empty())
            .ok_or_else(|| usage(format!("--random-tokens `{}`: expected FIRST..LAST", self.random_tokens)))
    }

    fn arrival(&self) -> Result<Arrival, CliError> {
        match (self.concurrency, self.request_rate) {
            (Some(0), _) => Err(usage("--concurrency must be at least 1".into())),
            (_, Some(r)) if !(r > 0.0 && r.is_finite()) => Err(usage(format!("--request-rate ({r}) must be positive"))),
            (_, Some(rate)) => Ok(Arrival::Rate { rate, max_in_flight: self.max_concurrency }),
            (c, None) => Ok(Arrival::Concurrency(c.unwrap_or(1))),
        }
    }

    fn endpoint(&self) -> Result<Endpoint, CliError> {
        match self.endpoint.as_str() {
            "completions" => Ok(Endpoint::Completions),
            "chat" => Ok(Endpoint::Chat),
            other => Err(usage(format!("--endpoint must be completions or chat, not `{other}`"))),
        }
    }

    /// The measured prompts and the warm-up prompts.
    fn prompts(&self) -> Result<(Vec<prompts::Prompt>, Vec<prompts::Prompt>), CliError> {
        if self.num_prompts == 0 || self.output_len == 0 {
            return Err(usage("--num-prompts and --output-len must be positive".into()));
        }
        let total = self.num_prompts + self.warmup;
        let mut all = match &self.dataset {
            Some(path) => {
                let text =
                    std::fs::read_to_string(path).map_err(|e| usage(format!("--dataset {}: {e}", path.display())))?;
                prompts::from_jsonl(&text, total, self.output_len)
                    .map_err(|e| usage(format!("--dataset {}: {e}", path.display())))?
            }
            None => {
                if self.input_len == 0 {
                    return Err(usage("--input-len must be positive".into()));
                }
                let tokens = self.token_range()?;
                let input = LenRange::around(self.input_len, self.input_len_range).map_err(usage)?;
                let output = LenRange::around(self.output_len, self.input_len_range).map_err(usage)?;
                prompts::random(total, input, output, tokens, self.seed).map_err(usage)?
            }
        };
        let measured = all.split_off(self.warmup);
        Ok((measured, all))
    }
}

pub fn run_bench_serve(args: &BenchServeArgs) -> Result<(), CliError> {
    if args.mixed.voice_base_url.is_some() {
        return run_mixed(args);
    }
    let arrival = args.arrival()?;
    let (measured, warmup) = args.prompts()?;
    let opts = args.load_options(&args.base_url, arrival)?;
    let bar = if args.no_progress {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(measured.len() as u64)
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} requests, {elapsed} elapsed, eta {eta}")
            .expect("a valid template"),
    );
    eprintln!(
        "bench-serve: {} requests ({} warm-up) to {} ({:?}), model `{}`, {:?}",
        measured.len(),
        warmup.len(),
        args.base_url,
        opts.endpoint,
        opts.model,
        opts.arrival
    );
    let (records, secs) = load::run_blocking(&opts, &warmup, &measured, &|_| bar.inc(1))?;
    bar.finish_and_clear();
    let report = Report::of(&records, secs);
    print!("{}", report.table());
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "base_url": args.base_url,
            "endpoint": args.endpoint,
            "model": opts.model,
            "concurrency": args.concurrency,
            "request_rate": args.request_rate,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "input_len_range": args.input_len_range,
            "dataset": args.dataset,
            "ignore_eos": args.ignore_eos,
            "report": report,
        });
        let text = serde_json::to_string_pretty(&doc).map_err(|e| usage(format!("--json: {e}")))?;
        std::fs::write(path, text).map_err(|e| usage(format!("--json {}: {e}", path.display())))?;
    }
    if report.completed == 0 {
        return Err(usage(format!("no request succeeded ({} failed)", report.failed)));
    }
    Ok(())
}

/// The mixed-lane load (`--voice-base-url`): table on stdout, JSON with --json; fails when a
/// lane completed nothing.
fn run_mixed(args: &BenchServeArgs) -> Result<(), CliError> {
    let m = &args.mixed;
    let voice_url = m.voice_base_url.clone().unwrap_or_default();
    if m.agents == 0 || m.agent_turns == 0 || m.voice_input_len == 0 || m.voice_output_len == 0 || args.output_len == 0
    {
        return Err(usage(
            "--agents, --agent-turns, --voice-input-len, --voice-output-len and --output-len must be positive".into(),
        ));
    }
    let positive = |x: f64| x > 0.0 && x.is_finite();
    if !positive(m.voice_rate) || !positive(m.duration) {
        return Err(usage(format!("--voice-rate ({}) and --duration ({}) must be positive", m.voice_rate, m.duration)));
    }
    let unused = Arrival::Concurrency(1);
    let o = mixed::MixedOptions {
        agent: args.load_options(&args.base_url, unused)?,
        voice: args.load_options(&voice_url, unused)?,
        agents: m.agents,
        context_tokens: m.agent_context_tokens,
        turns: m.agent_turns,
        question_tokens: m.agent_question_tokens,
        agent_output: args.output_len,
        voice_rate: m.voice_rate,
        voice_input: m.voice_input_len,
        voice_output: m.voice_output_len,
        idle_samples: m.idle_voice_samples,
        duration: Duration::from_secs_f64(m.duration),
        tokens: args.token_range()?,
        seed: args.seed,
    };
    eprintln!(
        "bench-serve (mixed lanes): {} agents on {} (~{}-token contexts, {} turns each), voice at {}/s on {}, \
         {:.0} s after {} idle voice turns",
        o.agents, args.base_url, o.context_tokens, o.turns, o.voice_rate, voice_url, m.duration, o.idle_samples
    );
    let bar = if args.no_progress { indicatif::ProgressBar::hidden() } else { indicatif::ProgressBar::new_spinner() };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {pos} requests done, {elapsed} elapsed")
            .expect("a valid template"),
    );
    let report = actix_web::rt::System::new().block_on(mixed::run(&o, &|_| bar.inc(1)));
    bar.finish_and_clear();
    print!("{}", report.table());
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "mode": "mixed",
            "agent_base_url": args.base_url,
            "voice_base_url": voice_url,
            "model": o.agent.model,
            "agents": o.agents,
            "agent_context_tokens": o.context_tokens,
            "agent_turns": o.turns,
            "agent_output_len": o.agent_output,
            "voice_rate": o.voice_rate,
            "voice_input_len": o.voice_input,
            "voice_output_len": o.voice_output,
            "ignore_eos": args.ignore_eos,
            "report": report,
        });
        let text = serde_json::to_string_pretty(&doc).map_err(|e| usage(format!("--json: {e}")))?;
        std::fs::write(path, text).map_err(|e| usage(format!("--json {}: {e}", path.display())))?;
    }
    if report.voice.completed == 0 || report.agent.completed == 0 {
        return Err(usage(format!(
            "a lane completed nothing (voice {} done / {} failed, agents {} / {})",
            report.voice.completed, report.voice.failed, report.agent.completed, report.agent.failed
        )));
    }
    Ok(())
}
