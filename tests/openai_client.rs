//! The official `openai` Python client against the real `shelfserve` binary: starts two servers
//! on free ports with the default model — one open, one with `--api-key` and an agent lane that
//! admits one sequence and queues one request (so 401 and 429 are cheap to provoke) — and runs
//! `tests/openai/test_openai_client.py`, which prints PASS/FAIL per check and `N passed, N failed`.
//!
//! The interpreter is `$SHELFSERVE_PYTHON` or `python3`. Without the `openai` package the test is
//! skipped with a reason locally; under CI (`CI` set, `.ci/run` installs the package) it fails.

mod binary_server;
mod common;
mod e2e_http;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use binary_server::{python, Server};
use e2e_http::Target;
use shelfserve::config::engine::EngineConfig;
use shelfserve::model::default_model::CacheDir;

/// Bound on starting a server and on any single HTTP read; nothing is measured against it.
const PATIENCE: Duration = Duration::from_secs(300);
const MODEL: &str = "smollm2";
const API_KEY: &str = "sk-shelfserve-test";
const PROMPT_TEXT: &str = "The capital of France is";

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

    let open = Server::start(&model, MODEL, &[], "open");
    let limited = Server::start(
        &model,
        MODEL,
        &["--api-key", API_KEY, "--config", cfg_path.to_str().expect("utf-8 path")],
        "keyed",
    );
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
