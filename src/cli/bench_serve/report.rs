//! What a load run measured, summarised the way `vllm bench serve` does: request and token
//! throughput, and TTFT, TPOT, ITL and end-to-end latency percentiles. Pure arithmetic over
//! per-request records.
//!
//! Beside the whole-run aggregate (which includes every prefill and the ramps at the start and
//! end), the report gives the *steady decode* rate: tokens streamed while the most streams were
//! decoding at once, over the time they were. That is the serving rate at a known batch, the one
//! number comparable with `shelfserve bench`'s decode tok/s at the same batch.

use serde::Serialize;

/// One request as the client saw it.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RequestRecord {
    /// Seconds from the run's start to sending the request.
    pub sent_at: f64,
    /// `None` when it succeeded.
    pub error: Option<String>,
    /// Prompt tokens (the server's `usage`, else the client's count).
    pub prompt_tokens: usize,
    /// Of those, served from the server's prefix cache (`usage.prompt_tokens_details`; 0 when the
    /// server does not say).
    pub cached_tokens: usize,
    /// Generated tokens (the server's `usage`, else the streamed chunks).
    pub output_tokens: usize,
    /// Seconds from sending to the first generated text.
    pub ttft: Option<f64>,
    /// Seconds between consecutive streamed chunks after the first.
    pub itl: Vec<f64>,
    /// Seconds from sending to the end of the stream.
    pub e2e: f64,
}

impl RequestRecord {
    /// Time per output token after the first: (e2e − TTFT) / (tokens − 1).
    pub fn tpot(&self) -> Option<f64> {
        match (self.ttft, self.output_tokens) {
            (Some(ttft), n) if n > 1 => Some((self.e2e - ttft) / (n - 1) as f64),
            _ => None,
        }
    }
}

/// Mean and percentiles of one latency, in milliseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Latency {
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

/// The `q`-quantile (0..=1) of sorted values, linearly interpolated (numpy's default).
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    match sorted.len() {
        0 => 0.0,
        n => {
            let pos = q.clamp(0.0, 1.0) * (n - 1) as f64;
            let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
            sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
        }
    }
}

impl Latency {
    /// From values in seconds.
    pub fn of(values: impl IntoIterator<Item = f64>) -> Self {
        let mut v: Vec<f64> = values.into_iter().map(|s| s * 1e3).collect();
        if v.is_empty() {
            return Latency::default();
        }
        v.sort_by(f64::total_cmp);
        Latency {
            mean_ms: v.iter().sum::<f64>() / v.len() as f64,
            p50_ms: quantile(&v, 0.50),
            p90_ms: quantile(&v, 0.90),
            p99_ms: quantile(&v, 0.99),
            max_ms: *v.last().unwrap_or(&0.0),
        }
    }
}

/// The summary of a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Report {
    pub completed: usize,
    pub failed: usize,
    /// Wall seconds of the measured run (warm-up excluded).
    pub duration_s: f64,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    pub request_throughput: f64,
    /// Generated tokens per second.
    pub output_throughput: f64,
    /// Prompt and generated tokens per second.
    pub total_token_throughput: f64,
    pub ttft: Latency,
    pub tpot: Latency,
    pub itl: Latency,
    pub e2e: Latency,
    /// Tokens per second while the most streams decoded at once (see the module doc).
    pub steady_decode: Option<SteadyDecode>,
    /// The first few distinct errors, for the reader.
    pub errors: Vec<String>,
}

impl Report {
    pub fn of(records: &[RequestRecord], duration_s: f64) -> Self {
        let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.error.is_none()).collect();
        let (input, output) = ok.iter().fold((0, 0), |(i, o), r| (i + r.prompt_tokens, o + r.output_tokens));
        let per_s = |x: f64| if duration_s > 0.0 { x / duration_s } else { 0.0 };
        let mut errors: Vec<String> = Vec::new();
        for e in records.iter().filter_map(|r| r.error.clone()) {
            if errors.len() < 5 && !errors.contains(&e) {
                errors.push(e);
            }
        }
        Report {
            completed: ok.len(),
            failed: records.len() - ok.len(),
            duration_s,
            total_input_tokens: input,
            total_output_tokens: output,
            request_throughput: per_s(ok.len() as f64),
            output_throughput: per_s(output as f64),
            total_token_throughput: per_s((input + output) as f64),
            ttft: Latency::of(ok.iter().filter_map(|r| r.ttft)),
            tpot: Latency::of(ok.iter().filter_map(|r| r.tpot())),
            itl: Latency::of(ok.iter().flat_map(|r| r.itl.iter().copied())),
            e2e: Latency::of(ok.iter().map(|r| r.e2e)),
            steady_decode: SteadyDecode::of(&ok),
            errors,
        }
    }

    /// The human-readable table.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let mut line = |k: &str, v: String| out.push_str(&format!("{k:<34}{v:>14}\n"));
        line("Successful requests:", self.completed.to_string());
        line("Failed requests:", self.failed.to_string());
        line("Benchmark duration (s):", format!("{:.2}", self.duration_s));
        line("Total input tokens:", self.total_input_tokens.to_string());
        line("Total generated tokens:", self.total_output_tokens.to_string());
        line("Request throughput (req/s):", format!("{:.2}", self.request_throughput));
        line("Output token throughput (tok/s):", format!("{:.2}", self.output_throughput));
        line("Total token throughput (tok/s):", format!("{:.2}", self.total_token_throughput));
        for (name, l) in [("TTFT", &self.ttft), ("TPOT", &self.tpot), ("ITL", &self.itl), ("E2E", &self.e2e)] {
            line(&format!("{name} mean / p50 (ms):"), format!("{:.2} / {:.2}", l.mean_ms, l.p50_ms));
            line(&format!("{name} p90 / p99 (ms):"), format!("{:.2} / {:.2}", l.p90_ms, l.p99_ms));
        }
        if let Some(s) = &self.steady_decode {
            line(&format!("Steady decode, {} streams (tok/s):", s.streams), format!("{:.2}", s.tok_per_s));
            line("Steady decode window (s):", format!("{:.2}", s.seconds));
        }
        for e in &self.errors {
            out.push_str(&format!("error: {e}\n"));
        }
        out
    }
}

/// The decode rate over the time the most streams were decoding at once.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SteadyDecode {
    /// How many streams were decoding during the window.
    pub streams: usize,
    /// Total seconds of the window (possibly several stretches).
    pub seconds: f64,
    /// Tokens streamed inside the window per second.
    pub tok_per_s: f64,
}

impl SteadyDecode {
    /// A stream decodes from its first chunk to its last; each chunk stands for
    /// `output_tokens / chunks` tokens. Stretches of under 1 ms are ignored, as is a run whose
    /// window holds fewer than two chunks per stream (too short to be a rate).
    fn of(records: &[&RequestRecord]) -> Option<SteadyDecode> {
        // (time, +1 start | -1 end) and (time, tokens) per chunk.
        let mut edges: Vec<(f64, i32)> = Vec::new();
        let mut chunks: Vec<(f64, f64)> = Vec::new();
        for r in records {
            let Some(ttft) = r.ttft else { continue };
            let per_chunk = r.output_tokens as f64 / (r.itl.len() + 1) as f64;
            let mut t = r.sent_at + ttft;
            edges.push((t, 1));
            chunks.push((t, per_chunk));
            for gap in &r.itl {
                t += gap;
                chunks.push((t, per_chunk));
            }
            edges.push((t, -1));
        }
        // Ends sort before starts at the same instant: a stream handing over to the next is not
        // counted twice.
        edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let (mut active, mut peak) = (0i32, 0i32);
        for &(_, d) in &edges {
            active += d;
            peak = peak.max(active);
        }
        if peak == 0 {
            return None;
        }
        let mut windows: Vec<(f64, f64)> = Vec::new();
        active = 0;
        for w in edges.windows(2) {
            active += w[0].1;
            if active == peak && w[1].0 - w[0].0 >= 1e-3 {
                windows.push((w[0].0, w[1].0));
            }
        }
        let seconds: f64 = windows.iter().map(|(a, b)| b - a).sum();
        let inside = |t: f64| windows.iter().any(|&(a, b)| t > a && t <= b);
        let (count, tokens) =
            chunks.iter().filter(|c| inside(c.0)).fold((0usize, 0.0), |(n, sum), c| (n + 1, sum + c.1));
        if seconds <= 0.0 || count < 2 * peak as usize {
            return None;
        }
        Some(SteadyDecode { streams: peak as usize, seconds, tok_per_s: tokens / seconds })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_like_numpy() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(quantile(&v, 0.5), 2.5);
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert_eq!(quantile(&v, 1.0), 4.0);
        assert!((quantile(&v, 0.9) - 3.7).abs() < 1e-12);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }

    #[test]
    fn the_report_counts_only_successes_and_derives_tpot() {
        let ok = RequestRecord {
            prompt_tokens: 10,
            output_tokens: 5,
            ttft: Some(0.1),
            itl: vec![0.05, 0.05, 0.05, 0.05],
            e2e: 0.3,
            ..Default::default()
        };
        let failed = RequestRecord { error: Some("HTTP 429".into()), e2e: 0.01, ..Default::default() };
        let r = Report::of(&[ok.clone(), ok, failed.clone(), failed], 2.0);
        assert_eq!((r.completed, r.failed, r.total_input_tokens, r.total_output_tokens), (2, 2, 20, 10));
        assert_eq!(r.request_throughput, 1.0);
        assert_eq!(r.output_throughput, 5.0);
        assert_eq!(r.total_token_throughput, 15.0);
        assert!((r.tpot.p50_ms - 50.0).abs() < 1e-9, "(0.3 - 0.1) / 4 tokens");
        assert!((r.ttft.p99_ms - 100.0).abs() < 1e-9);
        assert_eq!(r.errors, vec!["HTTP 429".to_string()], "errors listed once");
        assert!(r.table().contains("Failed requests:") && r.table().contains("error: HTTP 429"));
    }

    /// A stream sent at `sent` whose first chunk comes after `ttft` and then one chunk (one token)
    /// every `every` seconds, `tokens` in all.
    fn stream(sent: f64, ttft: f64, every: f64, tokens: usize) -> RequestRecord {
        RequestRecord {
            sent_at: sent,
            output_tokens: tokens,
            ttft: Some(ttft),
            itl: vec![every; tokens - 1],
            ..Default::default()
        }
    }

    #[test]
    fn steady_decode_counts_only_the_time_all_streams_decode() {
        // Two streams, 10 ms per token; the second starts decoding 0.1 s later and ends 0.1 s
        // later. Both decode together from 0.11 s to 1.0 s: 2 tokens per 10 ms = 200 tok/s,
        // whatever the ramps around it.
        let a = stream(0.0, 0.01, 0.01, 100);
        let b = stream(0.0, 0.11, 0.01, 100);
        let r = Report::of(&[a, b], 1.2);
        let s = r.steady_decode.clone().expect("a window with both streams");
        assert_eq!(s.streams, 2);
        assert!((s.seconds - 0.89).abs() < 1e-6, "{}", s.seconds);
        assert!((s.tok_per_s - 200.0).abs() < 2.5, "{}", s.tok_per_s);
        assert!(r.output_throughput < s.tok_per_s, "the aggregate includes the ramps");
        assert!(r.table().contains("Steady decode, 2 streams"));
    }

    #[test]
    fn steady_decode_scales_chunks_that_carry_several_tokens() {
        // One stream, 50 chunks of 2 tokens each, 20 ms apart: still 100 tok/s.
        let mut a = stream(0.0, 0.05, 0.02, 50);
        a.output_tokens = 100;
        let s = Report::of(&[a], 1.2).steady_decode.unwrap();
        assert!((s.tok_per_s - 100.0).abs() < 2.5, "{}", s.tok_per_s);
    }

    #[test]
    fn no_steady_decode_without_streams() {
        let failed = RequestRecord { error: Some("HTTP 500".into()), ..Default::default() };
        assert_eq!(Report::of(&[failed], 1.0).steady_decode, None);
        assert_eq!(Report::of(&[stream(0.0, 0.1, 0.0, 1)], 1.0).steady_decode, None, "one chunk is no rate");
    }
}
