//! `shelfserve bench-serve` against the real CPU server (default model, both lanes on free
//! ports): the real binary streams completions and chat requests at a fixed concurrency and at a
//! Poisson rate, with `ignore_eos`, and writes its JSON report; the numbers are checked against
//! what was asked (every request served, exactly `--output-len` tokens each, latencies ordered).

mod common;

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::engine::wait_ready;
use common::serve::{blocking, on_free_ports, Lanes};
use serde_json::Value;
use shelfserve::actors::{start_engine, Engine, EngineOptions};
use shelfserve::config::engine::EngineConfig;

const MODEL: &str = "bench-serve-e2e";

fn bench_serve(base_url: &str, json: &std::path::Path, extra: &[&str]) -> (String, Value) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_shelfserve"));
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("SHELFSERVE_BENCH") || k == "SHELFSERVE_API_KEY") {
        cmd.env_remove(k);
    }
    let out = cmd
        .args(["bench-serve", "--base-url", base_url, "--no-progress", "--ignore-eos", "--json"])
        .arg(json)
        .args(["--num-prompts", "6", "--input-len", "24", "--output-len", "5", "--warmup", "1"])
        .args(extra)
        .output()
        .expect("run bench-serve");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "bench-serve failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let doc: Value = serde_json::from_slice(&std::fs::read(json).expect("the JSON report")).expect("valid JSON");
    (stdout, doc)
}

fn check_report(doc: &Value, want_tokens: u64) {
    let r = &doc["report"];
    assert_eq!(r["completed"], 6, "{r}");
    assert_eq!(r["failed"], 0, "{r}");
    assert_eq!(r["total_output_tokens"], 6 * want_tokens, "ignore_eos: exactly --output-len each");
    assert!(r["total_input_tokens"].as_u64().unwrap() >= 6 * 24, "{r}");
    assert!(r["output_throughput"].as_f64().unwrap() > 0.0);
    for metric in ["ttft", "tpot", "itl", "e2e"] {
        let m = &r[metric];
        let (p50, p90, p99) =
            (m["p50_ms"].as_f64().unwrap(), m["p90_ms"].as_f64().unwrap(), m["p99_ms"].as_f64().unwrap());
        assert!(0.0 < p50 && p50 <= p90 && p90 <= p99, "{metric}: {m}");
    }
    assert!(r["ttft"]["p50_ms"].as_f64() <= r["e2e"]["p50_ms"].as_f64());
}

/// The default model served on both lanes (free ports), loaded; `None` without the model.
async fn serve_default_model() -> Option<(Arc<Engine>, Lanes)> {
    let bundle = common::open_default_model()?;
    let cfg = on_free_ports(EngineConfig::builtin());
    let engine = start_engine(
        bundle,
        cfg.clone(),
        EngineOptions { device: Default::default(), served_model_name: MODEL.into() },
    )
    .await
    .expect("start the engine");
    let lanes = Lanes::serve(&engine, &cfg, MODEL);
    wait_ready(&engine, Duration::from_secs(120)).await;
    Some((engine, lanes))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_serve_drives_the_cpu_server_and_reports_what_it_measured() {
    let Some((engine, lanes)) = serve_default_model().await else { return };
    let base = format!("http://{}/v1", lanes.addr("agent"));
    let dir = tempfile::tempdir().unwrap();

    // Completions with token-id prompts at a fixed concurrency; the model name from /models.
    let (json, b) = (dir.path().join("c.json"), base.clone());
    let (table, doc) = blocking(move || bench_serve(&b, &json, &["--concurrency", "3"])).await;
    assert!(table.contains("Successful requests:") && table.contains("TTFT p90 / p99 (ms):"), "{table}");
    assert_eq!(doc["model"], MODEL);
    check_report(&doc, 5);
    assert_eq!(doc["report"]["total_input_tokens"], 6 * 24, "token-id prompts are exact");

    // Chat at a Poisson rate.
    let (json, b) = (dir.path().join("r.json"), base.clone());
    let (_, doc) =
        blocking(move || bench_serve(&b, &json, &["--endpoint", "chat", "--request-rate", "20", "--seed", "3"])).await;
    check_report(&doc, 5);

    // Nothing listening: a clear failure, not a hang.
    let (json, dead) = (dir.path().join("d.json"), "http://127.0.0.1:9/v1".to_string());
    let out = blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_shelfserve"))
            .args(["bench-serve", "--base-url", &dead, "--model", "m", "--no-progress", "--num-prompts", "2"])
            .args(["--warmup", "0", "--timeout", "5", "--json"])
            .arg(&json)
            .output()
            .unwrap()
    })
    .await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no request succeeded (2 failed)"));
    lanes.stop().await;
    engine.shutdown();
}

/// The mixed-lane mode (`--voice-base-url`): agents with growing prompts on the agent lane and
/// Poisson voice turns on the voice lane of the real CPU server; both lanes are served and
/// reported, voice TTFT is set against its idle value, and the agents' throughput is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_serve_mixed_lanes_reports_each_lane() {
    let Some((engine, lanes)) = serve_default_model().await else { return };
    let (agent, voice) = (format!("http://{}/v1", lanes.addr("agent")), format!("http://{}/v1", lanes.addr("voice")));
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("m.json");
    let (table, doc) = blocking(move || {
        let mixed = [
            "--voice-base-url",
            &voice,
            "--agents",
            "2",
            "--agent-context-tokens",
            "120",
            "--agent-turns",
            "2",
            "--voice-rate",
            "3",
            "--voice-input-len",
            "8",
            "--voice-output-len",
            "3",
            "--idle-voice-samples",
            "2",
            "--duration",
            "4",
        ];
        bench_serve(&agent, &json, &mixed)
    })
    .await;
    assert!(table.contains("| voice (idle) |") && table.contains("voice TTFT over idle"), "{table}");
    assert_eq!(doc["mode"], "mixed");
    let r = &doc["report"];
    for lane in ["voice", "agent"] {
        assert!(r[lane]["completed"].as_u64().unwrap() > 0, "{lane}: {r}");
        assert_eq!(r[lane]["failed"], 0, "{lane}: {r}");
        let ttft = &r[lane]["ttft"];
        assert!(0.0 < ttft["p50_ms"].as_f64().unwrap() && ttft["p50_ms"].as_f64() <= ttft["p99_ms"].as_f64(), "{r}");
    }
    assert!(r["idle_voice_ttft"]["p50_ms"].as_f64().unwrap() > 0.0, "{r}");
    assert!(r["voice_ttft_over_idle_p50"].as_f64().unwrap() > 0.0, "{r}");
    assert!(r["agent_tokens_per_s"].as_f64().unwrap() > 0.0, "{r}");
    assert!(r["duration_s"].as_f64().unwrap() >= 4.0, "{r}");
    lanes.stop().await;
    engine.shutdown();
}
