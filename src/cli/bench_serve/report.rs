//! What a load run measured, summarised the way `vllm bench serve` does: request and token
//! throughput, and TTFT, TPOT, ITL and end-to-end latency percentiles. Pure arithmetic over
//! per-request records.

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
        for e in &self.errors {
            out.push_str(&format!("error: {e}\n"));
        }
        out
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
}
