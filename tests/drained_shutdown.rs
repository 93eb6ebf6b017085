//! Drained shutdown (issue 21 item 2) on the real `shelfserve serve` binary with real signals:
//! - SIGTERM while a request streams: new requests get 503 (and `/health` 503), the streaming one
//!   finishes whole, the cached pages go to the spill tier, the process exits 0; a restart on the
//!   same spill directory serves the conversation from disk (a prefix-cache hit). Without the
//!   flush nothing would be on disk: the pool is large enough that nothing was ever evicted.
//! - SIGTERM with a request that outlasts `--shutdown-timeout`: it is cancelled cleanly (its
//!   stream ends with an error event), and the process still exits 0.
//! - A second signal while draining exits at once (status 1).

mod binary_server;
mod common;
mod e2e_http;

use std::path::Path;
use std::time::{Duration, Instant};

use binary_server::Server;
use serde_json::{json, Value};

/// Bound on any wait for the server; nothing is measured against it.
const PATIENCE: Duration = Duration::from_secs(300);

/// A server on the default model whose pool never evicts (so only the drain puts pages on disk),
/// spilling to `spill`.
fn start(model: &Path, spill: &Path, shutdown_timeout: &str, label: &'static str) -> Server {
    let spill = spill.to_str().expect("a UTF-8 temp path");
    let args = ["--page-tokens", "32", "--kv-pool-tokens", "4096", "--spill-budget", "1000000000"];
    let extra: Vec<&str> =
        args.into_iter().chain(["--spill-dir", spill, "--shutdown-timeout", shutdown_timeout]).collect();
    Server::start(model, "default", &extra, label)
}

fn completion(prompt: &str, max_tokens: usize, stream: bool) -> Value {
    json!({
        "model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": true, "stream": stream,
        "stream_options": {"include_usage": true},
    })
}

fn conversation() -> String {
    (0..60).map(|i| format!("Line {i}: the quick brown fox jumps over the lazy dog.")).collect::<Vec<_>>().join("\n")
}

fn cached_tokens(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0)
}

#[test]
fn sigterm_drains_in_flight_writes_the_cache_to_disk_and_a_restart_hits_it() {
    let Some(model) = common::default_gguf() else { return };
    let spill = tempfile::tempdir().expect("tmp");
    let mut server = start(&model, spill.path(), "60", "first");
    let first = server.target("voice").post("/v1/completions", &completion(&conversation(), 4, false)).expect("first");
    assert_eq!(first.status, 200, "{}", first.text());
    let prompt_tokens = first.json()["usage"]["prompt_tokens"].as_u64().expect("usage");
    assert!(prompt_tokens >= 64, "a prompt of several pages: {prompt_tokens}");
    assert!(common::engine::spill_files(spill.path()).is_empty(), "nothing was evicted, so nothing is on disk yet");

    // A request streaming when the signal comes: it must finish whole.
    let mut streaming = server
        .target("voice")
        .stream("/v1/completions", &completion("Count: one two", 48, true))
        .expect("send")
        .unwrap_or_else(|r| panic!("status {}", r.status));
    streaming.read_tokens(1).expect("first token");
    server.signal(libc::SIGTERM);
    // New work is refused while draining; the server is still listening.
    let deadline = Instant::now() + PATIENCE;
    let refused = loop {
        let r = server.target("voice").post("/v1/completions", &completion("late", 2, false)).expect("late request");
        if r.status == 503 {
            break r;
        }
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(Instant::now() < deadline, "never refused while draining");
    };
    assert_eq!(refused.json()["error"]["code"], "shutting_down", "{}", refused.text());
    assert_eq!(server.target("voice").get("/health").expect("health").status, 503);
    let done = streaming.finish().expect("the in-flight stream");
    assert!(done.done && done.error.is_none(), "finished cleanly: {done:?}");
    assert_eq!(done.finish_reason.as_deref(), Some("length"));
    assert_eq!(done.usage.as_ref().and_then(|u| u["completion_tokens"].as_u64()), Some(48));
    assert!(server.wait_exit(PATIENCE).success(), "a drained shutdown exits 0");
    assert!(!common::engine::spill_files(spill.path()).is_empty(), "the cached pages were written to disk");
    drop(server);

    let server = start(&model, spill.path(), "60", "restarted");
    let again = server.target("voice").post("/v1/completions", &completion(&conversation(), 4, false)).expect("again");
    assert_eq!(again.status, 200, "{}", again.text());
    let cached = cached_tokens(&again.json());
    assert!(cached >= 64, "the conversation served before the restart is a prefix-cache hit: {}", again.text());
    assert_eq!(again.json()["choices"][0]["text"], first.json()["choices"][0]["text"], "same reply from disk");
    server.signal(libc::SIGINT);
}

#[test]
fn a_request_past_the_shutdown_timeout_is_cancelled_and_a_second_signal_exits_at_once() {
    let Some(model) = common::default_gguf() else { return };
    let spill = tempfile::tempdir().expect("tmp");

    // Timeout: a long request is cut off cleanly, the process still exits 0.
    let mut server = start(&model, spill.path(), "0.5", "timeout");
    let mut long = server
        .target("voice")
        .stream("/v1/completions", &completion("Once upon a time", 1500, true))
        .expect("send")
        .unwrap_or_else(|r| panic!("status {}", r.status));
    long.read_tokens(1).expect("first token");
    let signalled = Instant::now();
    server.signal(libc::SIGTERM);
    let cut = long.finish().expect("the stream ends");
    assert!(cut.count < 1500, "cancelled before the end");
    assert_eq!(cut.error.as_ref().map(|e| e["code"].clone()), Some(json!("shutting_down")), "{cut:?}");
    assert!(server.wait_exit(PATIENCE).success());
    eprintln!("timeout path exited {:?} after the signal", signalled.elapsed());
    drop(server);

    // Second signal: no waiting for the long request.
    let mut server = start(&model, spill.path(), "600", "second-signal");
    let mut long = server
        .target("voice")
        .stream("/v1/completions", &completion("Once upon a time", 1500, true))
        .expect("send")
        .unwrap_or_else(|r| panic!("status {}", r.status));
    long.read_tokens(1).expect("first token");
    server.signal(libc::SIGTERM);
    let refused_deadline = Instant::now() + PATIENCE;
    while server.target("voice").get("/health").map(|r| r.status).unwrap_or(0) != 503 {
        assert!(Instant::now() < refused_deadline, "draining never began");
        std::thread::sleep(Duration::from_millis(10));
    }
    server.signal(libc::SIGINT);
    let status = server.wait_exit(Duration::from_secs(30));
    assert_eq!(status.code(), Some(1), "a second signal exits at once, without draining");
}
