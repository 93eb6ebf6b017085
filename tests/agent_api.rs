//! The agent API end to end.
//!
//! - The official `openai` and `anthropic` Python clients against the real binary serving the
//!   default model (`tests/openai/test_agent_api.py`): forced and required tool calls whose
//!   arguments validate against the tool's schema (grammar-constrained), `response_format`
//!   json_schema / json_object and vLLM's guided fields, a bad schema's 400, constrained replies
//!   with `--speculative ngram` equal to plain ones, streamed equal to non-streamed, a forced
//!   call's arguments streamed in several pieces that join to exactly the non-streamed string
//!   (`delta.tool_calls` and `input_json_delta`), an agent loop
//!   (call → result → answer) with each client, the Messages API's events, usage with prefix-cache
//!   reads, stop sequences, count_tokens, Anthropic-shaped errors, /tokenize and /detokenize.
//! - The glm5 chat fixture (a real GLM template and tokenizer whose `<think>` / `</think>` are
//!   special tokens) served in process: the reasoning split through both APIs, thinking off and
//!   on, a block that never closes, streamed equal to non-streamed.
//!
//! Python is `$SHELFSERVE_PYTHON` or `python3`; without the `openai` and `anthropic` packages the client test is skipped with a reason locally and fails under CI
//! (`.ci/run` installs them).

mod binary_server;
mod common;
mod e2e_http;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use binary_server::{python, python_has, Server};
use common::engine::wait_ready;
use common::serve::{blocking, on_free_ports, Lanes};
use e2e_http::Target;
use serde_json::{json, Value};
use shelfserve::actors::{start_engine, Engine, EngineOptions};
use shelfserve::config::engine::EngineConfig;
use shelfserve::generate::DeviceSelection;
use shelfserve::model::default_model::CacheDir;

const PATIENCE: Duration = Duration::from_secs(120);

#[test]
fn official_clients_drive_the_agent_api() {
    if !python_has(&["openai", "anthropic", "jsonschema"]) {
        assert!(
            std::env::var_os("CI").is_none(),
            "the python client packages are missing under CI; .ci/run installs them"
        );
        eprintln!("skipped: `{}` cannot import openai, anthropic and jsonschema", python());
        return;
    }
    let Some(model) = common::default_gguf() else { return };
    let server = Server::start(&model, "smollm2", &[], "agent-api");
    // The same model drafting with n-grams: constrained greedy replies must not change.
    let drafting = Server::start(&model, "smollm2", &["--speculative", "ngram"], "agent-api-ngram");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai/test_agent_api.py");
    let out = Command::new(python())
        .arg(&script)
        .arg(format!("http://{}", server.addr("agent")))
        .args(["--model", "smollm2"])
        .arg("--speculative-url")
        .arg(format!("http://{}", drafting.addr("agent")))
        .output()
        .expect("run the python script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let last = stdout.lines().last().unwrap_or("");
    assert!(out.status.success() && last.ends_with(" 0 failed"), "agent API client checks failed: {last}");
}

// ---------------------------------------------------------------- the GLM fixture

const GLM: &str = "glm5-chat";
/// `<think>` in the fixture's vocabulary (a special token).
const THINK_ID: &str = "7";

fn glm_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/glm5/chat")
}

async fn serve_glm() -> (Arc<Engine>, Lanes, Target) {
    let mut cfg = on_free_ports(EngineConfig::builtin());
    cfg.scheduler.kv_pool_tokens = 4096;
    let bundle = shelfserve::model::open(glm_dir().to_str().unwrap(), &CacheDir::from_env()).expect("open");
    let opts =
        EngineOptions { device: DeviceSelection { threads: 2, ..Default::default() }, served_model_name: GLM.into() };
    let engine = start_engine(bundle, cfg.clone(), opts).await.expect("start the engine");
    let lanes = Lanes::serve(&engine, &cfg, GLM);
    let target = Target::new(lanes.addr("agent"), PATIENCE);
    wait_ready(&engine, PATIENCE).await;
    (engine, lanes, target)
}

/// The `data:` payloads of an SSE body (without `[DONE]`).
fn sse_events(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("event json"))
        .collect()
}

/// (reasoning, content, finish_reason) of a streamed chat completion.
fn streamed_chat(t: &Target, body: &Value) -> (Option<String>, String, String) {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let r = t.post("/v1/chat/completions", &body).expect("post");
    assert_eq!(r.status, 200, "{}", r.text());
    let (mut reasoning, mut content, mut finish) = (None::<String>, String::new(), String::new());
    for ev in sse_events(&r.text()) {
        let choice = &ev["choices"][0];
        if let Some(t) = choice["delta"]["reasoning_content"].as_str() {
            reasoning.get_or_insert_with(String::new).push_str(t);
        }
        content.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = f.to_owned();
        }
    }
    (reasoning, content, finish)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn glm_reasoning_split_through_both_apis() {
    let (engine, lanes, t) = serve_glm().await;
    blocking(move || {
        let golden: Value =
            serde_json::from_str(&std::fs::read_to_string(glm_dir().with_file_name("chat-golden.json")).unwrap())
                .unwrap();
        let user = json!([{"role": "user", "content": "What is the capital of France?"}]);

        // Thinking off: the template closes the block itself (`<think></think>`), so the whole
        // reply is content, equal to transformers' greedy text for the same prompt.
        let off = golden["cases"].as_array().unwrap().iter().find(|c| c["enable_thinking"] == json!(false)).unwrap();
        let body = json!({"model": GLM, "messages": off["messages"], "max_tokens": golden["max_tokens"],
                          "temperature": 0, "chat_template_kwargs": {"enable_thinking": false}});
        let r = t.post("/v1/chat/completions", &body).expect("post").json();
        let msg = &r["choices"][0]["message"];
        assert_eq!(msg["content"], off["text"], "{r}");
        assert!(msg.get("reasoning_content").is_none(), "thinking off has no reasoning: {r}");
        assert_eq!(
            streamed_chat(&t, &body),
            (None, off["text"].as_str().unwrap().to_owned(), off["finish_reason"].as_str().unwrap().to_owned())
        );

        // Thinking on and the model opens the block (`<think>` forced by a logit bias, so every
        // token is `<think>`): the text after the first is reasoning, the block never closes
        // before max tokens, and there is no content.
        let body = json!({"model": GLM, "messages": user, "max_tokens": 4, "temperature": 0,
                          "logit_bias": {THINK_ID: 100}, "chat_template_kwargs": {"enable_thinking": true}});
        let r = t.post("/v1/chat/completions", &body).expect("post").json();
        let msg = &r["choices"][0]["message"];
        assert_eq!(msg["reasoning_content"], "<think><think><think>", "{r}");
        assert_eq!(msg["content"], "", "{r}");
        assert_eq!(r["choices"][0]["finish_reason"], "length");
        assert_eq!(streamed_chat(&t, &body), (Some("<think><think><think>".into()), String::new(), "length".into()));

        // The same through the Messages API: one thinking block, in both shapes.
        let body = json!({"model": GLM, "messages": user, "max_tokens": 4, "temperature": 0,
                          "thinking": {"type": "enabled", "budget_tokens": 1024}});
        // The Messages API has no logit_bias: the reply is the model's own, and thinking on
        // without a `<think>` first is all text.
        let m = t.post("/v1/messages", &body).expect("post").json();
        assert_eq!(m["type"], "message", "{m}");
        assert_eq!(m["stop_reason"], "max_tokens", "{m}");
        let blocks: Vec<&str> = m["content"].as_array().unwrap().iter().map(|b| b["type"].as_str().unwrap()).collect();
        assert!(blocks.iter().all(|b| *b == "text"), "{m}");
        let mut sbody = body.clone();
        sbody["stream"] = json!(true);
        let s = t.post("/v1/messages", &sbody).expect("post");
        let events = sse_events(&s.text());
        let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(kinds.first(), Some(&"message_start"), "{kinds:?}");
        assert_eq!(kinds.last(), Some(&"message_stop"), "{kinds:?}");
        let text: String = events
            .iter()
            .filter(|e| e["type"] == "content_block_delta")
            .map(|e| e["delta"]["text"].as_str().unwrap_or(""))
            .collect();
        let whole: String = m["content"].as_array().unwrap().iter().map(|b| b["text"].as_str().unwrap_or("")).collect();
        assert_eq!(text, whole, "streamed text equals the message's");
        let delta = events.iter().find(|e| e["type"] == "message_delta").unwrap();
        assert_eq!(delta["delta"]["stop_reason"], "max_tokens");
        assert_eq!(delta["usage"]["output_tokens"], 4);
    })
    .await;
    lanes.stop().await;
    engine.shutdown();
}
