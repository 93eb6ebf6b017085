//! The load loop: streams requests to an OpenAI-compatible server at a fixed concurrency or a
//! Poisson arrival rate and records what each stream's client saw (TTFT, inter-chunk gaps,
//! end-to-end time, token counts from the server's `usage`). A library function so other tools
//! (a mixed-lane load) can drive it with their own prompts.
//!
//! Runs on one thread (awc's client is single-threaded): `run_blocking` starts its own actix
//! system, so call it from a plain thread, not from inside an async runtime.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

use super::prompts::{Prompt, PromptBody};
use super::report::RequestRecord;

/// Which OpenAI route the requests use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/completions`: prompts as token ids or text.
    Completions,
    /// `/chat/completions`: one user message (token-id prompts are sent as words, one per id).
    Chat,
}

/// How requests arrive.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arrival {
    /// `n` requests in flight at all times (closed loop).
    Concurrency(usize),
    /// Poisson arrivals at `rate` requests per second (open loop), at most `max_in_flight` at once
    /// (0 = unbounded).
    Rate { rate: f64, max_in_flight: usize },
}

#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Up to and including `/v1`, e.g. `http://127.0.0.1:8888/v1`.
    pub base_url: String,
    pub endpoint: Endpoint,
    pub model: String,
    pub api_key: Option<String>,
    pub arrival: Arrival,
    /// Ask the server to generate exactly `output_len` tokens (vLLM's `ignore_eos`).
    pub ignore_eos: bool,
    /// Seeds the Poisson gaps.
    pub seed: u64,
    /// Longest one request may take, its stream included.
    pub timeout: Duration,
}

/// Words that are one token in common BPE vocabularies (with their leading space), for chat
/// prompts made from token ids.
const WORDS: [&str; 32] = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not", "he",
    "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they", "you", "were", "their",
];

fn request_body(opts: &LoadOptions, prompt: &Prompt) -> Value {
    let mut body = json!({
        "model": opts.model,
        "max_tokens": prompt.output_len,
        "stream": true,
        "stream_options": {"include_usage": true},
        "temperature": 0.0,
    });
    if opts.ignore_eos {
        body["ignore_eos"] = json!(true);
    }
    match opts.endpoint {
        Endpoint::Completions => {
            body["prompt"] = match &prompt.body {
                PromptBody::Ids(ids) => json!(ids),
                PromptBody::Text(t) => json!(t),
            }
        }
        Endpoint::Chat => {
            let text = match &prompt.body {
                PromptBody::Ids(ids) => {
                    ids.iter().map(|&i| WORDS[i as usize % WORDS.len()]).collect::<Vec<_>>().join(" ")
                }
                PromptBody::Text(t) => t.clone(),
            };
            body["messages"] = json!([{"role": "user", "content": text}]);
        }
    }
    body
}

fn route(opts: &LoadOptions) -> String {
    let base = opts.base_url.trim_end_matches('/');
    match opts.endpoint {
        Endpoint::Completions => format!("{base}/completions"),
        Endpoint::Chat => format!("{base}/chat/completions"),
    }
}

/// The load generator's HTTP client. Its sockets send without Nagle's delay, as `vllm bench
/// serve`'s do: a request goes out as a head and a body, and with Nagle the body would wait for
/// the ACK of the head (up to 40 ms under delayed ACKs), all of it counted as TTFT.
pub fn client(opts: &LoadOptions, max_in_flight: usize) -> awc::Client {
    use actix_tls::connect::{ConnectError, ConnectInfo, Connector as TcpConnector, ConnectorService, Resolver};
    let tcp = TcpConnector::new(Resolver::default()).service();
    type Connect = ConnectInfo<awc::http::Uri>;
    let nodelay = actix_service::apply_fn::<_, _, _, _, Connect, Connect, _, _>(tcp, |req, svc: &ConnectorService| {
        let connecting = actix_service::Service::call(svc, req);
        async move {
            let conn = connecting.await?;
            let _ = conn.io_ref().set_nodelay(true);
            Ok::<_, ConnectError>(conn)
        }
    });
    let connector = awc::Connector::new().connector(nodelay).limit(max_in_flight);
    awc::Client::builder().connector(connector).timeout(opts.timeout).finish()
}

/// The generated text of one streamed chunk (completions `text`, chat `content` or
/// `reasoning_content`), concatenated over its choices.
fn chunk_text(v: &Value) -> String {
    let mut out = String::new();
    for c in v["choices"].as_array().into_iter().flatten() {
        for s in [&c["text"], &c["delta"]["content"], &c["delta"]["reasoning_content"]] {
            if let Some(s) = s.as_str() {
                out.push_str(s);
            }
        }
    }
    out
}

/// Sends one streamed request and records it; never fails (errors are recorded).
pub async fn one_request(client: &awc::Client, opts: &LoadOptions, prompt: &Prompt, epoch: Instant) -> RequestRecord {
    let sent = Instant::now();
    let mut rec = RequestRecord { sent_at: sent.duration_since(epoch).as_secs_f64(), ..Default::default() };
    if let PromptBody::Ids(ids) = &prompt.body {
        rec.prompt_tokens = ids.len();
    }
    let mut req = client.post(route(opts));
    if let Some(k) = &opts.api_key {
        req = req.bearer_auth(k);
    }
    let result = async {
        let mut resp = req.send_json(&request_body(opts, prompt)).await.map_err(|e| format!("sending: {e}"))?;
        if !resp.status().is_success() {
            let body = resp.body().limit(64 << 10).await.unwrap_or_default();
            return Err(format!("HTTP {}: {}", resp.status().as_u16(), String::from_utf8_lossy(&body).trim()));
        }
        let mut buf: Vec<u8> = Vec::new();
        let mut last_chunk: Option<Instant> = None;
        let mut chunks = 0usize;
        let mut usage_tokens = None;
        while let Some(piece) = resp.next().await {
            let piece = piece.map_err(|e| format!("reading the stream: {e}"))?;
            buf.extend_from_slice(&piece);
            while let Some(end) = find_event_end(&buf) {
                let event: Vec<u8> = buf.drain(..end.0 + end.1).collect();
                let text = String::from_utf8_lossy(&event[..end.0]).replace('\r', "");
                for data in text.lines().filter_map(|l| l.strip_prefix("data:")).map(str::trim) {
                    if data == "[DONE]" {
                        continue;
                    }
                    let v: Value = serde_json::from_str(data).map_err(|e| format!("bad event `{data}`: {e}"))?;
                    if let Some(err) = v.get("error") {
                        return Err(format!("error event: {err}"));
                    }
                    if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                        usage_tokens = Some((
                            u["prompt_tokens"].as_u64().unwrap_or(0) as usize,
                            u["completion_tokens"].as_u64().unwrap_or(0) as usize,
                        ));
                        rec.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) as usize;
                    }
                    if chunk_text(&v).is_empty() {
                        continue;
                    }
                    let now = Instant::now();
                    match last_chunk {
                        None => rec.ttft = Some(now.duration_since(sent).as_secs_f64()),
                        Some(prev) => rec.itl.push(now.duration_since(prev).as_secs_f64()),
                    }
                    last_chunk = Some(now);
                    chunks += 1;
                }
            }
        }
        match usage_tokens {
            Some((p, c)) => {
                rec.prompt_tokens = p;
                rec.output_tokens = c;
            }
            None => rec.output_tokens = chunks,
        }
        Ok(())
    }
    .await;
    rec.e2e = sent.elapsed().as_secs_f64();
    rec.error = result.err();
    rec
}

/// Where the first server-sent event in `buf` ends: (length of its text, length of the blank
/// line after it).
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// Runs `prompts` under `opts.arrival` and returns one record per prompt, in completion order.
/// `on_done` sees each record as it completes (a progress bar).
pub async fn run(opts: &LoadOptions, prompts: &[Prompt], on_done: &dyn Fn(&RequestRecord)) -> Vec<RequestRecord> {
    let records = Rc::new(RefCell::new(Vec::with_capacity(prompts.len())));
    let epoch = Instant::now();
    match opts.arrival {
        Arrival::Concurrency(n) => {
            let n = n.max(1);
            let client = client(opts, n);
            let next = Rc::new(RefCell::new(0usize));
            let worker = || async {
                loop {
                    let i = {
                        let mut next = next.borrow_mut();
                        let i = *next;
                        *next += 1;
                        i
                    };
                    let Some(p) = prompts.get(i) else { break };
                    let rec = one_request(&client, opts, p, epoch).await;
                    on_done(&rec);
                    records.borrow_mut().push(rec);
                }
            };
            futures_util::future::join_all((0..n).map(|_| worker())).await;
        }
        Arrival::Rate { rate, max_in_flight } => {
            let client = client(opts, max_in_flight);
            let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
            let mut in_flight = futures_util::stream::FuturesUnordered::new();
            let mut due = Duration::ZERO;
            for p in prompts {
                // Exponential gaps: a Poisson process of `rate` arrivals per second.
                let u: f64 = rng.random_range(f64::EPSILON..1.0);
                due += Duration::from_secs_f64(-u.ln() / rate);
                let sleep = actix_web::rt::time::sleep_until((epoch + due).into());
                tokio::pin!(sleep);
                // Keep the streams in flight moving while waiting for the next arrival and, at
                // the in-flight cap, for a stream to end.
                loop {
                    let capped = max_in_flight > 0 && in_flight.len() >= max_in_flight;
                    tokio::select! {
                        _ = &mut sleep, if !capped => break,
                        Some(()) = in_flight.next(), if !in_flight.is_empty() => {}
                    }
                }
                let (client, records) = (client.clone(), Rc::clone(&records));
                in_flight.push(async move {
                    let rec = one_request(&client, opts, p, epoch).await;
                    on_done(&rec);
                    records.borrow_mut().push(rec);
                });
            }
            while in_flight.next().await.is_some() {}
        }
    }
    Rc::try_unwrap(records).map(RefCell::into_inner).unwrap_or_else(|rc| rc.borrow().clone())
}

/// The first model id `GET {base_url}/models` lists.
pub async fn first_model(opts: &LoadOptions) -> Result<String, String> {
    let c = client(opts, 1);
    let mut req = c.get(format!("{}/models", opts.base_url.trim_end_matches('/')));
    if let Some(k) = &opts.api_key {
        req = req.bearer_auth(k);
    }
    let mut resp = req.send().await.map_err(|e| format!("GET /models: {e}"))?;
    let v: Value = resp.json().await.map_err(|e| format!("GET /models: {e}"))?;
    v["data"][0]["id"].as_str().map(str::to_string).ok_or_else(|| format!("GET /models listed no model: {v}"))
}

/// [`run`] on a fresh single-threaded actix system (blocking the calling thread), after
/// `warmup` requests whose records are dropped. Returns the records and the measured seconds.
pub fn run_blocking(
    opts: &LoadOptions,
    warmup: &[Prompt],
    prompts: &[Prompt],
    on_done: &dyn Fn(&RequestRecord),
) -> std::io::Result<(Vec<RequestRecord>, f64)> {
    actix_web::rt::System::new().block_on(async {
        if !warmup.is_empty() {
            let warm = LoadOptions { arrival: Arrival::Concurrency(warmup.len()), ..opts.clone() };
            run(&warm, warmup, &|_| {}).await;
        }
        let t0 = Instant::now();
        let records = run(opts, prompts, on_done).await;
        Ok((records, t0.elapsed().as_secs_f64()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_on_blank_lines_of_either_kind() {
        assert_eq!(find_event_end(b"data: 1\n\ndata: 2\n\n"), Some((7, 2)));
        assert_eq!(find_event_end(b"data: 1\r\n\r\n"), Some((7, 4)));
        assert_eq!(find_event_end(b"data: 1\n"), None);
    }

    #[test]
    fn chat_and_completion_chunks_yield_their_text() {
        let c = json!({"choices": [{"text": "ab"}]});
        let d = json!({"choices": [{"delta": {"content": "x", "reasoning_content": "y"}}]});
        let u = json!({"choices": [], "usage": {"completion_tokens": 3}});
        assert_eq!((chunk_text(&c), chunk_text(&d), chunk_text(&u)), ("ab".into(), "xy".into(), String::new()));
    }

    #[test]
    fn bodies_carry_the_prompt_in_the_endpoint_form() {
        let opts = LoadOptions {
            base_url: "http://h/v1/".into(),
            endpoint: Endpoint::Completions,
            model: "m".into(),
            api_key: None,
            arrival: Arrival::Concurrency(1),
            ignore_eos: true,
            seed: 0,
            timeout: Duration::from_secs(1),
        };
        let p = Prompt { body: PromptBody::Ids(vec![1, 33]), output_len: 4 };
        let b = request_body(&opts, &p);
        assert_eq!((b["prompt"].clone(), b["ignore_eos"].clone()), (json!([1, 33]), json!(true)));
        assert_eq!(route(&opts), "http://h/v1/completions");
        let chat = LoadOptions { endpoint: Endpoint::Chat, ..opts };
        assert_eq!(request_body(&chat, &p)["messages"][0]["content"], json!("of of"));
        assert_eq!(route(&chat), "http://h/v1/chat/completions");
    }
}
