//! `bench-serve --voice-base-url`: the mixed-lane load of issue 24 against any server with a high
//! and a low lane. Coding agents resend long, growing contexts on the low lane (closed loop, one
//! request at a time per agent) while short voice turns arrive open-loop on the high lane; the
//! report gives each lane's TTFT and inter-token percentiles, voice TTFT over its idle value
//! (measured first, nothing else running), and the agents' throughput.
//!
//! An agent's session opens with a document of random token ids and asks `turns` questions in
//! it; each turn resends the whole conversation, so the context grows. The server's answer is
//! stood in by as many fresh ids as it generated (a stream carries text, not ids), so the server
//! may reuse the earlier prompt from its prefix cache, as with a real agent, but not the answer's
//! own pages.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use super::load::{client, one_request, LoadOptions};
use super::prompts::{Prompt, PromptBody};
use super::report::{Latency, RequestRecord};

/// The shape of a mixed-lane run.
#[derive(Clone, Debug)]
pub struct MixedOptions {
    /// The low lane (agents). Its `arrival` is unused.
    pub agent: LoadOptions,
    /// The high lane (voice). Its `arrival` is unused.
    pub voice: LoadOptions,
    pub agents: usize,
    /// Token ids of an agent's opening document.
    pub context_tokens: usize,
    /// Questions per agent session before a new document.
    pub turns: usize,
    /// Token ids of each question.
    pub question_tokens: usize,
    /// `max_tokens` of an agent turn.
    pub agent_output: usize,
    /// Voice turns per second (Poisson).
    pub voice_rate: f64,
    pub voice_input: usize,
    pub voice_output: usize,
    /// Voice turns sent one after another on the quiet server first.
    pub idle_samples: usize,
    /// Load time (after the idle samples).
    pub duration: Duration,
    /// Token ids are drawn from this range.
    pub tokens: std::ops::Range<u32>,
    pub seed: u64,
}

/// One lane's latencies over the loaded phase.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LaneReport {
    pub completed: usize,
    pub failed: usize,
    pub ttft: Latency,
    pub itl: Latency,
}

impl LaneReport {
    fn of(records: &[RequestRecord]) -> Self {
        let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.error.is_none()).collect();
        LaneReport {
            completed: ok.len(),
            failed: records.len() - ok.len(),
            ttft: Latency::of(ok.iter().filter_map(|r| r.ttft)),
            itl: Latency::of(ok.iter().flat_map(|r| r.itl.iter().copied())),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct MixedReport {
    /// Voice TTFT with nothing else running.
    pub idle_voice_ttft: Latency,
    pub voice: LaneReport,
    pub agent: LaneReport,
    /// Loaded voice TTFT over idle, at p50 and p99.
    pub voice_ttft_over_idle_p50: f64,
    pub voice_ttft_over_idle_p99: f64,
    /// Agent prompt tokens the server computed (not served from its prefix cache) plus agent
    /// completion tokens, per second of the loaded phase.
    pub agent_tokens_per_s: f64,
    pub duration_s: f64,
    /// The first few distinct errors, for the reader.
    pub errors: Vec<String>,
}

impl MixedReport {
    pub fn of(idle: &[RequestRecord], voice: &[RequestRecord], agent: &[RequestRecord], duration_s: f64) -> Self {
        let idle_ok: Vec<f64> = idle.iter().filter(|r| r.error.is_none()).filter_map(|r| r.ttft).collect();
        let idle_voice_ttft = Latency::of(idle_ok);
        let (voice_lane, agent_lane) = (LaneReport::of(voice), LaneReport::of(agent));
        let ratio = |loaded: f64, quiet: f64| if quiet > 0.0 { loaded / quiet } else { 0.0 };
        let computed: usize = agent
            .iter()
            .filter(|r| r.error.is_none())
            .map(|r| r.prompt_tokens.saturating_sub(r.cached_tokens) + r.output_tokens)
            .sum();
        let mut errors: Vec<String> = Vec::new();
        for e in idle.iter().chain(voice.iter()).chain(agent).filter_map(|r| r.error.clone()) {
            if errors.len() < 5 && !errors.contains(&e) {
                errors.push(e);
            }
        }
        MixedReport {
            voice_ttft_over_idle_p50: ratio(voice_lane.ttft.p50_ms, idle_voice_ttft.p50_ms),
            voice_ttft_over_idle_p99: ratio(voice_lane.ttft.p99_ms, idle_voice_ttft.p99_ms),
            idle_voice_ttft,
            voice: voice_lane,
            agent: agent_lane,
            agent_tokens_per_s: if duration_s > 0.0 { computed as f64 / duration_s } else { 0.0 },
            duration_s,
            errors,
        }
    }

    pub fn table(&self) -> String {
        let row = |name: &str, l: &LaneReport| {
            format!(
                "| {name} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
                l.completed, l.failed, l.ttft.p50_ms, l.ttft.p99_ms, l.ttft.max_ms, l.itl.p50_ms, l.itl.p99_ms
            )
        };
        let mut t = String::from(
            "| lane | done | failed | TTFT p50 ms | TTFT p99 ms | TTFT max ms | ITL p50 ms | ITL p99 ms |\n\
             |---|---|---|---|---|---|---|---|\n",
        );
        let idle = LaneReport { completed: 0, failed: 0, ttft: self.idle_voice_ttft.clone(), itl: Latency::default() };
        t += &row("voice (idle)", &idle);
        t += &row("voice", &self.voice);
        t += &row("agent", &self.agent);
        t += &format!(
            "voice TTFT over idle: p50 {:.2}x, p99 {:.2}x; agent throughput {:.1} tok/s (computed prompt + \
             completion) over {:.1} s\n",
            self.voice_ttft_over_idle_p50, self.voice_ttft_over_idle_p99, self.agent_tokens_per_s, self.duration_s
        );
        for e in &self.errors {
            t += &format!("error: {e}\n");
        }
        t
    }
}

fn random_ids(rng: &mut ChaCha8Rng, n: usize, tokens: &std::ops::Range<u32>) -> Vec<u32> {
    (0..n).map(|_| rng.random_range(tokens.clone())).collect()
}

/// One agent's conversation: the prompts it sends, turn after turn.
struct AgentSession {
    rng: ChaCha8Rng,
    context: Vec<u32>,
    turn: usize,
}

impl AgentSession {
    fn new(seed: u64) -> Self {
        AgentSession { rng: ChaCha8Rng::seed_from_u64(seed), context: Vec::new(), turn: 0 }
    }

    /// The next turn's prompt: the conversation so far plus a new question (a new document every
    /// `turns` turns).
    fn next_prompt(&mut self, o: &MixedOptions) -> Vec<u32> {
        if self.turn.is_multiple_of(o.turns.max(1)) {
            self.context = random_ids(&mut self.rng, o.context_tokens, &o.tokens);
        }
        self.turn += 1;
        let question = random_ids(&mut self.rng, o.question_tokens, &o.tokens);
        self.context.extend(question);
        self.context.clone()
    }

    /// The server answered with `generated` tokens: they join the conversation.
    fn answered(&mut self, generated: usize, o: &MixedOptions) {
        let answer = random_ids(&mut self.rng, generated, &o.tokens);
        self.context.extend(answer);
    }
}

/// Runs the idle voice samples, then agents and voice together for `o.duration`. Call inside an
/// actix system (`actix_web::rt::System::new().block_on`). `on_done` sees every loaded-phase
/// record (a progress line).
pub async fn run(o: &MixedOptions, on_done: &dyn Fn(&RequestRecord)) -> MixedReport {
    let voice_prompt = |rng: &mut ChaCha8Rng| Prompt {
        body: PromptBody::Ids(random_ids(rng, o.voice_input, &o.tokens)),
        output_len: o.voice_output,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(o.seed);
    let voice_client = client(&o.voice, 0);
    let epoch = Instant::now();
    let mut idle = Vec::with_capacity(o.idle_samples);
    for _ in 0..o.idle_samples {
        idle.push(one_request(&voice_client, &o.voice, &voice_prompt(&mut rng), epoch).await);
    }

    let start = Instant::now();
    let deadline = start + o.duration;
    let agent_records = Rc::new(RefCell::new(Vec::new()));
    let agent_client = client(&o.agent, o.agents.max(1));
    let agent = |i: usize| {
        let (records, client) = (Rc::clone(&agent_records), agent_client.clone());
        async move {
            let mut session = AgentSession::new(o.seed.wrapping_add(1 + i as u64));
            while Instant::now() < deadline {
                let prompt = Prompt { body: PromptBody::Ids(session.next_prompt(o)), output_len: o.agent_output };
                let rec = one_request(&client, &o.agent, &prompt, start).await;
                session.answered(rec.output_tokens, o);
                on_done(&rec);
                records.borrow_mut().push(rec);
            }
        }
    };
    let voice = async {
        let mut records = Vec::new();
        let mut in_flight = futures_util::stream::FuturesUnordered::new();
        let mut due = Duration::ZERO;
        loop {
            let u: f64 = rng.random_range(f64::EPSILON..1.0);
            due += Duration::from_secs_f64(-u.ln() / o.voice_rate);
            if due >= o.duration {
                break;
            }
            let sleep = actix_web::rt::time::sleep_until((start + due).into());
            tokio::pin!(sleep);
            loop {
                tokio::select! {
                    _ = &mut sleep => break,
                    Some(rec) = in_flight.next(), if !in_flight.is_empty() => {
                        on_done(&rec);
                        records.push(rec);
                    }
                }
            }
            let (client, prompt) = (voice_client.clone(), voice_prompt(&mut rng));
            in_flight.push(async move { one_request(&client, &o.voice, &prompt, start).await });
        }
        while let Some(rec) = in_flight.next().await {
            on_done(&rec);
            records.push(rec);
        }
        records
    };
    let (voice_records, _) =
        futures_util::future::join(voice, futures_util::future::join_all((0..o.agents).map(agent))).await;
    let secs = start.elapsed().as_secs_f64();
    let agent_records = agent_records.borrow().clone();
    MixedReport::of(&idle, &voice_records, &agent_records, secs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::bench_serve::load::{Arrival, Endpoint};

    fn options() -> MixedOptions {
        let lane = LoadOptions {
            base_url: "http://h/v1".into(),
            endpoint: Endpoint::Completions,
            model: "m".into(),
            api_key: None,
            arrival: Arrival::Concurrency(1),
            ignore_eos: true,
            seed: 0,
            timeout: Duration::from_secs(1),
        };
        MixedOptions {
            agent: lane.clone(),
            voice: lane,
            agents: 2,
            context_tokens: 100,
            turns: 3,
            question_tokens: 10,
            agent_output: 20,
            voice_rate: 1.0,
            voice_input: 8,
            voice_output: 8,
            idle_samples: 2,
            duration: Duration::from_secs(1),
            tokens: 1000..2000,
            seed: 7,
        }
    }

    #[test]
    fn an_agent_conversation_grows_by_question_and_answer_then_starts_over() {
        let o = options();
        let mut s = AgentSession::new(1);
        let first = s.next_prompt(&o);
        assert_eq!(first.len(), 110);
        s.answered(20, &o);
        let second = s.next_prompt(&o);
        assert_eq!(second.len(), 140, "document + question + answer + question");
        assert_eq!(&second[..110], &first[..], "each turn resends the whole conversation");
        s.answered(5, &o);
        let third = s.next_prompt(&o);
        assert_eq!((third.len(), &third[..140]), (155, &second[..]));
        s.answered(20, &o);
        let fourth = s.next_prompt(&o);
        assert_eq!(fourth.len(), 110, "a new session after `turns` questions");
        assert_ne!(&fourth[..100], &first[..100], "with a new document");
        assert!(fourth.iter().all(|t| (1000..2000).contains(t)));
    }

    #[test]
    fn the_report_divides_loaded_voice_ttft_by_idle_and_counts_computed_agent_tokens() {
        let rec = |ttft: f64, prompt: usize, cached: usize, out: usize| RequestRecord {
            ttft: Some(ttft),
            prompt_tokens: prompt,
            cached_tokens: cached,
            output_tokens: out,
            itl: vec![0.01; out.saturating_sub(1)],
            ..Default::default()
        };
        let idle = [rec(0.1, 8, 0, 8), rec(0.1, 8, 0, 8)];
        let voice = [rec(0.2, 8, 0, 8), rec(0.3, 8, 0, 8)];
        let failed = RequestRecord { error: Some("HTTP 503".into()), ..Default::default() };
        let agent = [rec(1.0, 1000, 400, 100), rec(2.0, 500, 0, 50), failed];
        let r = MixedReport::of(&idle, &voice, &agent, 10.0);
        assert!((r.voice_ttft_over_idle_p50 - 2.5).abs() < 1e-9, "{r:?}");
        assert!((r.voice_ttft_over_idle_p99 - 2.99).abs() < 1e-9, "{r:?}");
        assert!((r.agent_tokens_per_s - (600.0 + 100.0 + 500.0 + 50.0) / 10.0).abs() < 1e-9);
        assert_eq!((r.agent.completed, r.agent.failed, r.errors.clone()), (2, 1, vec!["HTTP 503".to_string()]));
        assert!(r.table().contains("| voice (idle) | 0 | 0 | 100.0 |"), "{}", r.table());
    }
}
