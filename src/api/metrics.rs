//! HTTP-side metrics: names, what they measure, and the recording calls the handlers make
//! (requests per lane/route/status, time to first token, inter-token latency, prompt and
//! generated tokens per lane, cancellations and mid-stream errors). The engine records its own
//! (queue depth, running sequences, step durations, KV pages) into the same recorder; `/metrics`
//! renders whatever the installed recorder holds.

use std::time::Instant;

use metrics::{counter, describe_counter, describe_histogram, histogram, Unit};
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};

pub const HTTP_REQUESTS: &str = "shelfserve_http_requests_total";
pub const TIME_TO_FIRST_TOKEN: &str = "shelfserve_time_to_first_token_seconds";
pub const INTER_TOKEN_LATENCY: &str = "shelfserve_inter_token_latency_seconds";
pub const PROMPT_TOKENS: &str = "shelfserve_prompt_tokens_total";
pub const GENERATION_TOKENS: &str = "shelfserve_generation_tokens_total";
pub const REQUESTS_CANCELLED: &str = "shelfserve_requests_cancelled_total";
pub const REQUEST_ERRORS: &str = "shelfserve_request_errors_total";
pub const LOOP_GUARD_STOPS: &str = "shelfserve_loop_guard_stops_total";

/// Latency buckets (seconds) for every `*_seconds` histogram: from a fast decode step to a long
/// queue wait.
pub const LATENCY_BUCKETS: [f64; 16] =
    [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96];

/// A Prometheus builder with real histogram buckets for `*_seconds` metrics (without buckets the
/// exporter renders summaries, which cannot be aggregated across lanes).
pub fn prometheus_builder() -> Result<PrometheusBuilder, BuildError> {
    PrometheusBuilder::new().set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &LATENCY_BUCKETS)
}

/// Install the process-wide recorder (once, at startup) and return the handle `/metrics` renders.
/// `/metrics` runs the exporter's upkeep on each scrape, so no timer task is needed.
pub fn install_prometheus() -> Result<PrometheusHandle, BuildError> {
    let handle = prometheus_builder()?.install_recorder()?;
    describe();
    Ok(handle)
}

/// Help texts, shown by the exporter. Harmless to call more than once.
pub fn describe() {
    describe_counter!(HTTP_REQUESTS, "HTTP requests answered, by lane, route and status code");
    describe_histogram!(TIME_TO_FIRST_TOKEN, Unit::Seconds, "Request arrival to first generated token, per choice");
    describe_histogram!(INTER_TOKEN_LATENCY, Unit::Seconds, "Time between generated tokens of one choice");
    describe_counter!(PROMPT_TOKENS, "Prompt tokens submitted to the engine (once per choice)");
    describe_counter!(GENERATION_TOKENS, "Tokens generated and delivered to clients");
    describe_counter!(REQUESTS_CANCELLED, "Requests whose client went away before they finished");
    describe_counter!(REQUEST_ERRORS, "Requests that failed after submission, by engine error kind");
    describe_counter!(LOOP_GUARD_STOPS, "Choices the loop guard stopped because their output kept repeating");
}

pub fn http_request(lane: &str, route: &str, status: u16) {
    counter!(HTTP_REQUESTS, "lane" => lane.to_owned(), "route" => route.to_owned(), "status" => status.to_string())
        .increment(1);
}

pub fn prompt_tokens(lane: &str, n: usize) {
    counter!(PROMPT_TOKENS, "lane" => lane.to_owned()).increment(n as u64);
}

pub fn request_cancelled(lane: &str) {
    counter!(REQUESTS_CANCELLED, "lane" => lane.to_owned()).increment(1);
}

pub fn loop_guard_stop(lane: &str) {
    counter!(LOOP_GUARD_STOPS, "lane" => lane.to_owned()).increment(1);
}

pub fn request_error(lane: &str, kind: &'static str) {
    counter!(REQUEST_ERRORS, "lane" => lane.to_owned(), "kind" => kind).increment(1);
}

/// Per-choice token timing: the first token feeds TTFT, later ones inter-token latency.
#[derive(Debug)]
pub struct TokenClock {
    start: Instant,
    last: Option<Instant>,
}

impl TokenClock {
    pub fn new(start: Instant) -> Self {
        Self { start, last: None }
    }

    /// `tokens` arrived now (one delta may carry several; the gap is split evenly).
    pub fn tokens(&mut self, lane: &str, tokens: usize) {
        if tokens == 0 {
            return;
        }
        let now = Instant::now();
        counter!(GENERATION_TOKENS, "lane" => lane.to_owned()).increment(tokens as u64);
        match self.last {
            None => {
                histogram!(TIME_TO_FIRST_TOKEN, "lane" => lane.to_owned()).record(now - self.start);
                if tokens > 1 {
                    let itl = histogram!(INTER_TOKEN_LATENCY, "lane" => lane.to_owned());
                    for _ in 1..tokens {
                        itl.record(0.0);
                    }
                }
            }
            Some(last) => {
                let gap = (now - last).as_secs_f64() / tokens as f64;
                let itl = histogram!(INTER_TOKEN_LATENCY, "lane" => lane.to_owned());
                for _ in 0..tokens {
                    itl.record(gap);
                }
            }
        }
        self.last = Some(now);
    }
}
