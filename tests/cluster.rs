//! Tensor-parallel ranks in separate processes (issue 26, deliverable 3), on the real binary over
//! localhost: `shelfserve serve --head --tp 2` plus one `shelfserve worker --rank 1`, joined by
//! ractor_cluster, on the llama fixture with a tokenizer.
//! - Greedy output through the HTTP API equals one process at TP=1 and at `--tp 2` (in-process
//!   ranks): the cross-process collective sums in the same rank order as the in-process one.
//! - SIGKILL of the worker: the request in flight fails with an error naming rank 1 within a
//!   bounded time (no hang), `/health` answers 503 naming the rank, new requests are refused,
//!   and `/metrics` counts the failure. SIGSTOP (a silent worker): the same after
//!   `--cluster-timeout`.
//! - Four ranks (three workers, connected to each other as well) match one process.
//! - A worker with the wrong cookie is turned away and says why.
//! - glm5_next (the `glm5/chat` fixture) at TP=2 across processes, with and without expert
//!   parallel, equals TP=1 in one process; the same prompts again hit the prefix cache (every
//!   rank's slice of the KDA state joined, and written back by rank) with the same replies; n-gram
//!   drafts verified across processes (rank 1 rolled back as rank 0 committed) equal no drafts.

mod binary_server;
mod common;
mod e2e_http;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use binary_server::Server;
use serde_json::{json, Value};

const COOKIE: &str = "cluster-test-cookie";

/// A running `shelfserve worker`, killed when dropped.
struct Worker {
    child: Child,
}

impl Worker {
    fn start(model: &Path, head: &str, rank: usize, extra: &[String]) -> Worker {
        let mut child = Command::new(env!("CARGO_BIN_EXE_shelfserve"))
            .arg("worker")
            .arg("--model")
            .arg(model)
            .args(["--device", "cpu", "--threads", "1", "--head-addr", head, "--cookie", COOKIE])
            // The workers connect to each other at this address (this host's name may not resolve).
            .args(["--advertise-host", "127.0.0.1"])
            .args(extra)
            .args(["--rank", &rank.to_string(), "--join-timeout", "120"])
            .env("SHELFSERVE_LOG", "info")
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the shelfserve worker");
        let stderr = child.stderr.take().expect("piped stderr");
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[worker {rank}] {line}");
            }
        });
        Worker { child }
    }

    /// Stops the process without closing its connections (SIGSTOP): a silent rank.
    fn freeze(&self) {
        // SAFETY: sending a signal to our own child's pid.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, libc::SIGSTOP) }, 0);
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.kill();
    }
}

fn model() -> PathBuf {
    common::fixture("hf/llama-tok")
}

/// A port nobody listens on now (the OS's choice, released at once).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn completion(prompt: &str, max_tokens: usize) -> Value {
    json!({"model": "t", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

const PROMPTS: [&str; 3] = ["The quick brown fox", "Once upon a time, in a land far away", "1, 2, 3, 4,"];

fn greedy_texts(server: &Server) -> Vec<String> {
    PROMPTS
        .iter()
        .map(|p| {
            let r = server.target("voice").post("/v1/completions", &completion(p, 24)).expect("completion");
            assert_eq!(r.status, 200, "{}", r.text());
            r.json()["choices"][0]["text"].as_str().expect("text").to_string()
        })
        .collect()
}

/// A head of `world` ranks on `port`, its workers started first (they keep trying to reach it).
fn cluster(port: u16, world: usize, collective_timeout: &str) -> (Server, Vec<Worker>) {
    cluster_with(port, world, collective_timeout, &[])
}

/// [`cluster`] with `extra` flags for every node.
fn cluster_with(port: u16, world: usize, collective_timeout: &str, extra: &[String]) -> (Server, Vec<Worker>) {
    let addr = format!("127.0.0.1:{port}");
    let workers = (1..world).map(|rank| Worker::start(&model(), &addr, rank, extra)).collect();
    let tp = world.to_string();
    let head_args = ["--tp", &tp, "--threads", "1", "--head", "--cluster-addr", &addr, "--cluster-cookie", COOKIE];
    let head_args: Vec<&str> = head_args
        .into_iter()
        .chain(["--cluster-timeout", collective_timeout])
        .chain(extra.iter().map(String::as_str))
        .collect();
    // `Server::start` returns once /health is 200: every rank has reported ready.
    let head = Server::start(&model(), "t", &head_args, "head");
    (head, workers)
}

#[test]
fn a_worker_process_serves_rank_1_and_its_death_fails_requests_without_a_hang() {
    let single = Server::start(&model(), "t", &["--threads", "1"], "tp1");
    let expected = greedy_texts(&single);
    drop(single);
    let in_process = Server::start(&model(), "t", &["--threads", "1", "--tp", "2"], "tp2");
    assert_eq!(greedy_texts(&in_process), expected, "--tp 2 in one process differs from --tp 1");
    drop(in_process);

    let (head, mut workers) = cluster(free_port(), 2, "20");
    assert_eq!(greedy_texts(&head), expected, "ranks in two processes differ from one process");
    let metrics = head.target("voice").get("/metrics").expect("metrics").text();
    assert!(metrics.contains("shelfserve_cluster_ranks_joined 2"), "{metrics}");

    // A long request streaming when the worker dies: its stream ends with an error naming the
    // rank, well before the collective timeout (the lost node session is noticed at once).
    let stream = streaming(&head);
    let killed = Instant::now();
    workers[0].kill();
    let streamed = stream.finish().expect("the stream ends");
    let took = killed.elapsed();
    assert!(streamed.count < 1900, "a request whose rank died cannot finish: {streamed:?}");
    let error = streamed.error.as_ref().map(Value::to_string).unwrap_or_default();
    assert!(error.contains("rank 1"), "the error names the rank: {streamed:?}");
    assert!(took < Duration::from_secs(15), "failed after {took:?}");

    let health = head.target("voice").get("/health").expect("health");
    assert_eq!(health.status, 503, "{}", health.text());
    assert!(health.text().contains("worker rank 1"), "{}", health.text());
    let next = head.target("voice").post("/v1/completions", &completion("Hello", 4)).expect("an answer");
    assert_eq!(next.status, 503, "{}", next.text());
    assert!(next.text().contains("rank 1"), "{}", next.text());
    let metrics = head.target("voice").get("/metrics").expect("metrics").text();
    assert!(metrics.contains("shelfserve_cluster_rank_failures_total{rank=\"1\"} 1"), "{metrics}");
    assert!(metrics.contains("shelfserve_cluster_rank_up{rank=\"1\"} 0"), "{metrics}");
}

/// A streaming request past its first tokens.
fn streaming(head: &Server) -> e2e_http::ChatStream {
    let mut body = completion("A long story:", 1900);
    body["stream"] = json!(true);
    let mut stream = match head.target("voice").stream("/v1/completions", &body).expect("send") {
        Ok(s) => s,
        Err(r) => panic!("status {}: {}", r.status, r.text()),
    };
    stream.read_tokens(3).expect("the first tokens");
    stream
}

#[test]
fn a_silent_worker_is_declared_failed_after_the_collective_timeout() {
    let (head, workers) = cluster(free_port(), 2, "3");
    let stream = streaming(&head);
    let frozen = Instant::now();
    workers[0].freeze();
    let streamed = stream.finish().expect("the stream ends");
    let took = frozen.elapsed();
    let error = streamed.error.as_ref().map(Value::to_string).unwrap_or_default();
    assert!(error.contains("rank 1") && error.contains("did not answer"), "{streamed:?}");
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(30), "failed after {took:?}");
    let health = head.target("voice").get("/health").expect("health");
    assert_eq!(health.status, 503, "{}", health.text());
    assert!(health.text().contains("worker rank 1"), "{}", health.text());
}

#[test]
fn four_ranks_in_four_processes_match_one_process() {
    let single = Server::start(&model(), "t", &["--threads", "1"], "tp1");
    let expected = greedy_texts(&single);
    drop(single);
    // Three workers: they connect to each other too (each collective goes to every rank).
    let (head, _workers) = cluster(free_port(), 4, "20");
    assert_eq!(greedy_texts(&head), expected, "ranks in four processes differ from one process");
}

/// A CA, and one certificate for 127.0.0.1 signed by it, as the three `--cluster-tls-*` files.
fn tls_files(dir: &Path) -> Vec<String> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "shelfserve test cluster CA");
    let ca_cert = ca.self_signed(&ca_key).expect("self-sign the CA");
    let key = KeyPair::generate().expect("node key");
    let cert = CertificateParams::new(vec!["127.0.0.1".to_string()])
        .expect("node params")
        .signed_by(&key, &ca_cert, &ca_key)
        .expect("sign the node certificate");
    let mut flags = Vec::new();
    for (flag, file, pem) in [
        ("--cluster-tls-cert", "node.pem", cert.pem()),
        ("--cluster-tls-key", "node.key", key.serialize_pem()),
        ("--cluster-tls-ca", "ca.pem", ca_cert.pem()),
    ] {
        let path = dir.join(file);
        std::fs::write(&path, pem).expect("write a PEM file");
        flags.extend([flag.to_string(), path.to_str().expect("a UTF-8 path").to_string()]);
    }
    flags
}

#[test]
fn nodes_talk_over_tls_when_asked() {
    let single = Server::start(&model(), "t", &["--threads", "1"], "tp1");
    let expected = greedy_texts(&single);
    drop(single);
    let dir = tempfile::tempdir().expect("tmp");
    // Four ranks: the workers' sessions with each other are TLS too.
    let tls = tls_files(dir.path());
    let port = free_port();
    let (head, workers) = cluster_with(port, 4, "20", &tls);
    assert_eq!(greedy_texts(&head), expected, "ranks over TLS differ from one process");
    // A node without TLS cannot even authenticate (were TLS ignored, it would get as far as the
    // head refusing a second rank 1).
    let plain = worker_output(&format!("127.0.0.1:{port}"), COOKIE);
    assert!(plain.contains("closed the connection") && !plain.contains("already joined"), "{plain}");
    drop(workers);
}

#[test]
fn a_worker_with_the_wrong_cookie_is_refused_and_says_so() {
    let addr = format!("127.0.0.1:{}", free_port());
    let head_args = ["--tp", "2", "--threads", "1", "--head", "--cluster-addr", &addr, "--cluster-cookie", COOKIE];
    let mut head = Command::new(env!("CARGO_BIN_EXE_shelfserve"))
        .arg("serve")
        .arg("--model")
        .arg(model())
        .args(["--device", "cpu", "--host", "127.0.0.1", "--lane-port", "voice=0,agent=0"])
        .args(head_args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the head");
    // It keeps trying until the head listens, then is turned away at authentication.
    let started = Instant::now();
    let log = worker_output(&addr, "wrong");
    let _ = head.kill();
    let _ = head.wait();
    assert!(log.contains("is the cookie the head's?"), "{log}");
    assert!(started.elapsed() < Duration::from_secs(60), "{log}");
}

/// The log of a plain worker of rank 1 run against `addr` until it exits (which it must, with
/// an error).
fn worker_output(addr: &str, cookie: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_shelfserve"))
        .arg("worker")
        .arg("--model")
        .arg(model())
        .args(["--device", "cpu", "--threads", "1", "--head-addr", addr, "--rank", "1", "--cookie", cookie])
        .args(["--join-timeout", "60"])
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .expect("run a worker");
    let log = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{log}");
    log
}

// ---- glm5_next across processes -------------------------------------------------------------
// The `glm5/chat` fixture (transformers' tiny glm5_next with a tokenizer: 2 MLA heads, 2 KDA
// heads, 8 indexer heads, 8 experts, so TP=2 with and without expert parallel). Every rank is a
// `Glm5Backend::new_rank` in its own process with its own executor; rank 0 samples.

fn glm5_model() -> PathBuf {
    common::fixture("glm5/chat")
}

/// Small blocks and pages so short prompts cross page ends (recurrent-state snapshots) and a
/// repeated prompt hits the prefix cache.
const GLM5_CACHE: [&str; 4] = ["--block-size", "8", "--page-tokens", "16"];

const GLM5_PROMPTS: [&str; 2] = [
    "The quick brown fox jumps over the lazy dog, and the dog sleeps on.",
    "one two three, one two three, one two three, one two three, one two",
];

fn glm5_texts(server: &Server, prompts: &[&str], max_tokens: usize) -> Vec<(String, u64)> {
    prompts
        .iter()
        .map(|p| {
            let r = server.target("voice").post("/v1/completions", &completion(p, max_tokens)).expect("completion");
            assert_eq!(r.status, 200, "{}", r.text());
            let v = r.json();
            let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
            (v["choices"][0]["text"].as_str().expect("text").to_string(), cached)
        })
        .collect()
}

fn texts_only(replies: Vec<(String, u64)>) -> Vec<String> {
    replies.into_iter().map(|(t, _)| t).collect()
}

/// A glm5_next head of two ranks (`head_extra` on the head only: expert parallel and speculative
/// decoding are the head's choices) and its worker.
fn glm5_cluster(label: &'static str, head_extra: &[&str]) -> (Server, Worker) {
    let addr = format!("127.0.0.1:{}", free_port());
    let worker = Worker::start(&glm5_model(), &addr, 1, &[]);
    let mut args = vec!["--tp", "2", "--threads", "1", "--head", "--cluster-addr", &addr, "--cluster-cookie", COOKIE];
    args.extend(GLM5_CACHE);
    args.extend(head_extra);
    (Server::start(&glm5_model(), "t", &args, label), worker)
}

fn glm5_single(label: &'static str, extra: &[&str]) -> Vec<String> {
    glm5_single_tokens(label, extra, 16)
}

fn glm5_single_tokens(label: &'static str, extra: &[&str], max_tokens: usize) -> Vec<String> {
    let mut args = vec!["--threads", "1"];
    args.extend(GLM5_CACHE);
    args.extend(extra);
    let server = Server::start(&glm5_model(), "t", &args, label);
    texts_only(glm5_texts(&server, &GLM5_PROMPTS, max_tokens))
}

#[test]
fn glm5_next_ranks_in_two_processes_match_one_process_and_hit_the_prefix_cache() {
    let expected = glm5_single("glm5-tp1", &[]);
    assert_eq!(glm5_single("glm5-tp2", &["--tp", "2"]), expected, "--tp 2 in one process differs from --tp 1");
    for (label, extra) in [("glm5-head", &[][..]), ("glm5-head-ep", &["--enable-expert-parallel"][..])] {
        let (head, _worker) = glm5_cluster(label, extra);
        let first = glm5_texts(&head, &GLM5_PROMPTS, 16);
        assert_eq!(texts_only(first.clone()), expected, "{label}: ranks in two processes differ from one process");
        // The same prompts again: their pages are cached with every rank's slice of the KDA
        // state (joined from both processes), and each rank resumes from its own slice.
        let again = glm5_texts(&head, &GLM5_PROMPTS, 16);
        assert!(again.iter().all(|(_, cached)| *cached >= 16), "{label}: no prefix hit: {again:?}");
        assert_eq!(texts_only(again), expected, "{label}: a prefix hit across processes changed the reply");
    }
}

/// `name{labels} value` summed over every line of the metric.
fn metric_sum(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

const DRAFTED_TOKENS: usize = 64;

#[test]
fn glm5_next_drafts_verified_across_processes_equal_the_undrafted_reply() {
    // Long enough replies for the fixture's own output to repeat n-grams (the prompt's repeats
    // end before the first decode: the prefill samples the first token).
    let expected = glm5_single_tokens("glm5-undrafted", &[], DRAFTED_TOKENS);
    let (head, _worker) = glm5_cluster("glm5-head-ngram", &["--speculative", "ngram", "--num-speculative-tokens", "4"]);
    let drafted = texts_only(glm5_texts(&head, &GLM5_PROMPTS, DRAFTED_TOKENS));
    let metrics = head.target("voice").get("/metrics").expect("metrics").text();
    let proposed = metric_sum(&metrics, "shelfserve_spec_draft_tokens_total");
    let accepted = metric_sum(&metrics, "shelfserve_spec_accepted_tokens_total");
    // Both kinds of verification ran: rank 1 rolled back to partial acceptances (some drafts
    // rejected) and kept accepted ones, each as rank 0 committed it.
    let spec: Vec<&str> = metrics.lines().filter(|l| l.contains("spec") || l.contains("draft")).collect();
    assert!(accepted > 0.0 && accepted < proposed, "accepted {accepted} of {proposed} drafted tokens: {spec:#?}");
    assert_eq!(drafted, expected, "drafted replies across processes differ from the undrafted ones");
}

// ---- spill across processes ------------------------------------------------------------------
// Each rank holds only its KV heads' slice of a page: the head's spill tier joins rank 0's slice
// and the worker's (sent to the head's scheduler as messages) into one file, and a restore writes
// each rank its slice back.

/// A head of two ranks with the spill tier on `spill` (`--kv-pool-tokens pool`, pages of 32), and
/// its worker.
fn spill_cluster(label: &'static str, spill: &Path, pool: &str) -> (Server, Worker) {
    let addr = format!("127.0.0.1:{}", free_port());
    let worker = Worker::start(&model(), &addr, 1, &[]);
    let spill = spill.to_str().expect("a UTF-8 temp path");
    let mut args = vec!["--tp", "2", "--threads", "1", "--head", "--cluster-addr", &addr, "--cluster-cookie", COOKIE];
    args.extend(["--page-tokens", "32", "--kv-pool-tokens", pool, "--shutdown-timeout", "60"]);
    args.extend(["--spill-dir", spill, "--spill-budget", "1000000000"]);
    (Server::start(&model(), "t", &args, label), worker)
}

/// A prompt of token ids (below the fixture's vocabulary).
fn id_prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 300 + (seed * 7919 + i * 104_729) % 40_000).collect()
}

/// The greedy reply to a prompt of token ids, and how many of its tokens the prefix cache served.
fn reply_to(server: &Server, ids: &[u32], max_tokens: usize) -> (String, u64) {
    let body = json!({"model": "t", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true});
    let r = server.target("voice").post("/v1/completions", &body).expect("completion");
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    (v["choices"][0]["text"].as_str().expect("text").to_string(), cached)
}

/// Waits until the spill directory holds at least `files` page files.
fn wait_for_spill_files(dir: &Path, files: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let n = common::engine::spill_files(dir).len();
        if n >= files {
            return n;
        }
        assert!(Instant::now() < deadline, "only {n} page files were spilled, {files} expected");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn pages_spilled_across_processes_restore_exactly_and_a_drained_restart_serves_from_disk() {
    // Turn one (150 tokens: four whole pages), its follow-up, and a conversation that is still
    // only in memory when the head is told to stop.
    let turn_one = id_prompt(1, 150);
    let follow_up = [turn_one.clone(), id_prompt(50, 30)].concat();
    let last = id_prompt(9, 100);
    let single = Server::start(&model(), "t", &["--threads", "1", "--page-tokens", "32"], "spill-tp1");
    let (expected_follow_up, _) = reply_to(&single, &follow_up, 12);
    let (expected_last, _) = reply_to(&single, &last, 12);
    drop(single);

    let spill = tempfile::tempdir().expect("tmp");
    let (mut head, worker) = spill_cluster("spill-head", spill.path(), "256");
    reply_to(&head, &turn_one, 8);
    assert!(common::engine::spill_files(spill.path()).is_empty(), "nothing evicted yet");
    // Two other prompts push turn one's pages out of the 256-token pool, to disk.
    reply_to(&head, &id_prompt(60, 200), 4);
    reply_to(&head, &id_prompt(61, 200), 4);
    wait_for_spill_files(spill.path(), 4);
    let (reply, cached) = reply_to(&head, &follow_up, 12);
    assert_eq!(cached, 4 * 32, "turn one's four pages restored from disk, each rank's slice written back");
    assert_eq!(reply, expected_follow_up, "a reply restored from spill across processes equals a fresh run");

    // A drained shutdown: the last conversation's pages, in memory only, go to disk with both
    // ranks' slices before the head exits.
    let (reply, _) = reply_to(&head, &last, 12);
    assert_eq!(reply, expected_last);
    let before = common::engine::spill_files(spill.path()).len();
    head.signal(libc::SIGTERM);
    assert!(head.wait_exit(Duration::from_secs(120)).success(), "a drained shutdown exits 0");
    let after = common::engine::spill_files(spill.path()).len();
    assert!(after >= before + 3, "the drain wrote the last conversation's three pages: {before} -> {after}");
    drop((head, worker));

    let (head, _worker) = spill_cluster("spill-head-restarted", spill.path(), "256");
    let (reply, cached) = reply_to(&head, &last, 12);
    assert!(cached >= 3 * 32, "served from disk after the restart: {cached}");
    assert_eq!(reply, expected_last, "same reply from disk");
}

#[test]
fn glm5_next_pages_spilled_across_processes_restore_with_every_ranks_state_slice() {
    // Token ids below the glm5/chat fixture's vocabulary of 502.
    let ids = |seed: u32, len: u32| -> Vec<u32> { (0..len).map(|i| 3 + (seed * 7919 + i * 104_729) % 490).collect() };
    // Turn one: 60 tokens, of which three whole pages of 16 are the follow-up's prefix.
    let turn_one = ids(1, 60);
    let follow_up = [turn_one.clone(), ids(50, 10)].concat();
    let mut args = vec!["--threads", "1"];
    args.extend(GLM5_CACHE);
    let single = Server::start(&glm5_model(), "t", &args, "glm5-spill-tp1");
    let (expected, _) = reply_to(&single, &follow_up, 12);
    drop(single);

    let spill = tempfile::tempdir().expect("tmp");
    let dir = spill.path().to_str().expect("a UTF-8 temp path");
    let spill_args = ["--kv-pool-tokens", "128", "--spill-dir", dir, "--spill-budget", "1000000000"];
    let (head, _worker) = glm5_cluster("glm5-spill-head", &spill_args);
    reply_to(&head, &turn_one, 8);
    // Two other prompts push turn one's pages (KV records and both ranks' KDA state slices) to disk.
    reply_to(&head, &ids(60, 90), 4);
    reply_to(&head, &ids(61, 90), 4);
    wait_for_spill_files(spill.path(), 3);
    let (reply, cached) = reply_to(&head, &follow_up, 12);
    assert_eq!(cached, 3 * 16, "turn one's pages restored from disk, each rank given its slice");
    assert_eq!(reply, expected, "a glm5_next reply restored from spill across processes equals a fresh run");
}
