//! The official `openai` Python client against the real `shelfserve` binary: starts two servers
//! on free ports with the default model — one open, one with `--api-key` and an agent lane that
//! admits one sequence and queues one request (so 401 and 429 are cheap to provoke) — and runs
//! `tests/openai/test_openai_client.py`, which prints PASS/FAIL per check and `N passed, N failed`.
//!
//! The interpreter is `$SHELFSERVE_PYTHON` or `python3`. Without the `openai` package the test is
//! skipped with a reason locally; under CI (`CI` set, `.ci/run` installs the package) it fails.

mod common;
mod e2e_http;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use e2e_http::Target;
use shelfserve::config::engine::EngineConfig;
use shelfserve::model::default_model::CacheDir;

/// Bound on starting a server and on any single HTTP read; nothing is measured against it.
const PATIENCE: Duration = Duration::from_secs(300);
const MODEL: &str = "smollm2";
const API_KEY: &str = "sk-shelfserve-test";
const PROMPT_TEXT: &str = "The capital of France is";

fn python() -> String {
    std::env::var("SHELFSERVE_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// A running `shelfserve serve`, killed when dropped.
struct Server {
    child: Child,
    lanes: Vec<(String, SocketAddr)>,
}

impl Server {
    fn start(model: &Path, extra: &[&str], label: &'static str) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_shelfserve"))
            .arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--device", "cpu", "--host", "127.0.0.1", "--lane-port", "voice=0,agent=0"])
            .args(["--served-model-name", MODEL])
            .args(extra)
            .env("SHELFSERVE_LOG", "info")
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the shelfserve binary");
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, rx) = mpsc::channel();
        // Drain the log for the whole life of the server (a full pipe would block it), echoing
        // it and reporting each lane's address as it binds.
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let line = strip_ansi(&line);
                eprintln!("[{label}] {line}");
                if let Some(lane) = parse_lane(&line) {
                    let _ = tx.send(lane);
                }
            }
        });
        let mut server = Server { child, lanes: Vec::new() };
        let deadline = Instant::now() + PATIENCE;
        while server.lanes.len() < 2 {
            if let Some(status) = server.child.try_wait().expect("poll the server") {
                panic!("{label}: shelfserve exited with {status} before listening");
            }
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(lane) => server.lanes.push(lane),
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    assert!(Instant::now() < deadline, "{label}: no listening address within {PATIENCE:?}")
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => panic!("{label}: the server's log ended"),
            }
        }
        // /health turns 200 once the model is loaded (503 before).
        let target = Target::new(server.addr("voice"), PATIENCE);
        loop {
            if let Some(status) = server.child.try_wait().expect("poll the server") {
                panic!("{label}: shelfserve exited with {status} while loading");
            }
            match target.get("/health") {
                Ok(r) if r.status == 200 => break,
                Ok(r) => assert!(r.status == 503, "{label}: /health answered {}: {}", r.status, r.text()),
                Err(e) => panic!("{label}: /health: {e}"),
            }
            assert!(Instant::now() < deadline, "{label}: not ready within {PATIENCE:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
        server
    }

    fn addr(&self, lane: &str) -> SocketAddr {
        self.lanes.iter().find(|(l, _)| l == lane).map(|(_, a)| *a).unwrap_or_else(|| panic!("no lane {lane}"))
    }

    fn url(&self, lane: &str) -> String {
        format!("http://{}/v1", self.addr(lane))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ params final-byte
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// `… serving the OpenAI API on http://127.0.0.1:PORT/v1 lane=NAME` → (NAME, address).
fn parse_lane(line: &str) -> Option<(String, SocketAddr)> {
    let rest = line.split("serving the OpenAI API on http://").nth(1)?;
    let addr: SocketAddr = rest.split('/').next()?.parse().ok()?;
    let lane = line.split("lane=").nth(1)?.split_whitespace().next()?.trim_matches('"').to_owned();
    Some((lane, addr))
}

#[test]
fn official_openai_client_against_the_real_binary() {
    let py = python();
    let has_openai =
        Command::new(&py).args(["-c", "import openai"]).output().map(|o| o.status.success()).unwrap_or(false);
    if !has_openai {
        assert!(
            std::env::var_os("CI").is_none(),
            "`{py} -c \"import openai\"` failed under CI; .ci/run installs the openai package"
        );
        eprintln!("skipped: `{py}` cannot import the openai package (pip install openai, or set SHELFSERVE_PYTHON)");
        return;
    }
    let Some(model) = common::default_gguf() else { return };
    // The token-id prompt checks compare ids with the text they encode.
    let bundle =
        shelfserve::model::open(model.to_str().expect("utf-8 path"), &CacheDir::from_env()).expect("open model");
    let tok = bundle.tokenizer.as_ref().expect("the default model has a tokenizer");
    let ids = tok.encode(PROMPT_TEXT, true).expect("encode");
    drop(bundle);

    // The second server: API key, and an agent lane with one sequence slot and a queue of one.
    let mut cfg = EngineConfig::builtin();
    cfg.scheduler.max_num_seqs = 1;
    for lane in &mut cfg.lanes {
        if lane.name == "agent" {
            lane.max_queue = 1;
        }
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let cfg_path: PathBuf = dir.path().join("limited.toml");
    std::fs::write(&cfg_path, toml::to_string(&cfg).expect("serialize config")).expect("write config");

    let open = Server::start(&model, &[], "open");
    let limited =
        Server::start(&model, &["--api-key", API_KEY, "--config", cfg_path.to_str().expect("utf-8 path")], "keyed");
    let ids_arg = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai/test_openai_client.py");
    let started = Instant::now();
    let out = Command::new(&py)
        .arg(&script)
        .arg(open.url("voice"))
        .args(["--model", MODEL, "--prompt-text", PROMPT_TEXT, "--prompt-ids", &ids_arg])
        .args(["--auth-url", &limited.url("voice"), "--auth-agent-url", &limited.url("agent"), "--api-key", API_KEY])
        .output()
        .expect("run the python script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    eprintln!("the openai client checks took {:.1} s", started.elapsed().as_secs_f64());
    let last = stdout.lines().last().unwrap_or("");
    assert!(out.status.success() && last.ends_with(" 0 failed"), "openai client checks failed: {last}");
    assert!(!stdout.contains("SKIP"), "every check must run here");
    // Both servers are still serving after every error case.
    for s in [&open, &limited] {
        let r = Target::new(s.addr("voice"), PATIENCE).get("/health").expect("/health");
        assert_eq!(r.status, 200, "{}", r.text());
    }
}
