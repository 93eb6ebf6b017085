//! A `glm5_next` checkpoint with a tokenizer and chat template, served end to end: the real
//! engine and HTTP layer on 127.0.0.1 ports chosen by the OS, driven by a plain socket client.
//!
//! Reference: `tests/fixtures/glm5/chat-golden.json`, written by `scripts/gen_glm5_chat.py` with
//! transformers (prompt ids from `apply_chat_template` / the tokenizer, greedy `generate` ids
//! and their `decode(skip_special_tokens=True)` text). Checked here:
//! - our template + tokenizer build exactly transformers' prompt ids, and decode its outputs to
//!   its text;
//! - chat completions (plain and streaming, explicit `enable_thinking` and the lanes' defaults)
//!   and text completions return transformers' greedy text, finish reason and token counts,
//!   also when every request is in flight at once;
//! - bad input gets an OpenAI error object and the server keeps serving.

mod common;
mod e2e_http;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::engine::wait_ready;
use common::serve::{blocking, on_free_ports, Lanes};
use e2e_http::Target;
use serde_json::{json, Value};
use shelfserve::actors::{start_engine, Engine, EngineOptions};
use shelfserve::config::engine::EngineConfig;
use shelfserve::generate::DeviceSelection;
use shelfserve::model::default_model::CacheDir;
use shelfserve::tokenizer::chat::{ChatRender, ChatTemplate};

/// Bound on any single wait, so a broken engine fails the test instead of hanging it.
const PATIENCE: Duration = Duration::from_secs(120);
const MODEL: &str = "glm5-chat";

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/glm5/chat")
}

/// One case of the golden file.
struct Case {
    name: String,
    /// `messages` for chat cases.
    messages: Option<Value>,
    enable_thinking: Option<bool>,
    /// Plain prompt for completion cases.
    prompt: Option<String>,
    prompt_ids: Vec<u32>,
    output_ids: Vec<u32>,
    text: String,
    finish_reason: String,
}

struct Golden {
    max_tokens: usize,
    eos_token_ids: Vec<u32>,
    cases: Vec<Case>,
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("id list").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

fn golden() -> Golden {
    let path = fixture_dir().with_file_name("chat-golden.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read golden")).expect("golden json");
    let cases = v["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().expect("name").into(),
            messages: c.get("messages").cloned(),
            enable_thinking: c["enable_thinking"].as_bool(),
            prompt: c["prompt"].as_str().map(str::to_owned),
            prompt_ids: ids(&c["prompt_ids"]),
            output_ids: ids(&c["output_ids"]),
            text: c["text"].as_str().expect("text").into(),
            finish_reason: c["finish_reason"].as_str().expect("finish_reason").into(),
        })
        .collect();
    Golden {
        max_tokens: v["max_tokens"].as_u64().expect("max_tokens") as usize,
        eos_token_ids: ids(&v["eos_token_ids"]),
        cases,
    }
}

impl Case {
    /// Generated tokens the API counts: an end-of-generation id ends the reply but, as in the
    /// engine's other models, is not counted (transformers' output holds it).
    fn completion_tokens(&self) -> usize {
        self.output_ids.len() - usize::from(self.finish_reason == "stop")
    }

    /// The request body: chat with explicit `enable_thinking`, or a text completion.
    fn body(&self, max_tokens: usize, stream: bool) -> (&'static str, Value) {
        match (&self.messages, &self.prompt) {
            (Some(m), _) => (
                "/v1/chat/completions",
                json!({"model": MODEL, "messages": m, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                       "chat_template_kwargs": {"enable_thinking": self.enable_thinking.expect("chat case flag")}}),
            ),
            (None, Some(p)) => (
                "/v1/completions",
                json!({"model": MODEL, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "stream": stream}),
            ),
            (None, None) => panic!("{}: neither messages nor prompt", self.name),
        }
    }
}

#[test]
fn tokenizer_and_template_build_transformers_prompt_ids() {
    let g = golden();
    let bundle = shelfserve::model::open(fixture_dir().to_str().unwrap(), &CacheDir::from_env()).expect("open");
    assert_eq!(bundle.eos_token_ids(), g.eos_token_ids, "end-of-generation ids (generation_config.json)");
    let tok = bundle.tokenizer.as_ref().expect("the fixture has a tokenizer");
    let template = ChatTemplate::from_bundle(tok).expect("template compiles").expect("the fixture has a template");
    for c in &g.cases {
        let ours = match (&c.messages, &c.prompt) {
            (Some(m), _) => {
                let mut kwargs = serde_json::Map::new();
                kwargs.insert("enable_thinking".into(), json!(c.enable_thinking));
                let text = template
                    .render(&ChatRender { messages: m, tools: None, add_generation_prompt: true, kwargs: &kwargs })
                    .expect("render");
                tok.encode(&text, false).expect("encode")
            }
            (None, Some(p)) => tok.encode(p, true).expect("encode"),
            (None, None) => unreachable!(),
        };
        assert_eq!(ours, c.prompt_ids, "{}: prompt ids", c.name);
        assert_eq!(tok.decode(&c.output_ids, true).expect("decode"), c.text, "{}: decoded text", c.name);
    }
}

struct Harness {
    engine: Arc<Engine>,
    voice: Target,
    agent: Target,
    lanes: Lanes,
}

impl Harness {
    async fn start() -> Harness {
        let mut cfg = on_free_ports(EngineConfig::builtin());
        cfg.scheduler.kv_pool_tokens = 4096;
        let bundle = shelfserve::model::open(fixture_dir().to_str().unwrap(), &CacheDir::from_env()).expect("open");
        let opts = EngineOptions {
            device: DeviceSelection { threads: 2, ..Default::default() },
            served_model_name: MODEL.into(),
        };
        let engine = start_engine(bundle, cfg.clone(), opts).await.expect("start the engine");
        let lanes = Lanes::serve(&engine, &cfg, MODEL);
        let (voice, agent) = (Target::new(lanes.addr("voice"), PATIENCE), Target::new(lanes.addr("agent"), PATIENCE));
        wait_ready(&engine, PATIENCE).await;
        Harness { engine, voice, agent, lanes }
    }

    async fn stop(self) {
        self.lanes.stop().await;
        self.engine.shutdown();
    }
}

/// Text, finish reason and usage of a non-streamed chat or completion response.
fn answer(v: &Value) -> (String, String, u64, u64) {
    let choice = &v["choices"][0];
    let text = choice["message"]["content"].as_str().or(choice["text"].as_str()).unwrap_or_default().to_owned();
    let finish = choice["finish_reason"].as_str().unwrap_or_default().to_owned();
    let usage = &v["usage"];
    (text, finish, usage["prompt_tokens"].as_u64().unwrap_or(0), usage["completion_tokens"].as_u64().unwrap_or(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_and_completions_return_transformers_greedy_text() {
    let g = Arc::new(golden());
    let h = Harness::start().await;
    let voice = h.voice.clone();
    let gg = g.clone();
    // One request at a time, not streamed.
    blocking(move || {
        for c in &gg.cases {
            let (path, body) = c.body(gg.max_tokens, false);
            let r = voice.post(path, &body).expect("post");
            assert_eq!(r.status, 200, "{}: {}", c.name, r.text());
            let (text, finish, prompt_tokens, completion_tokens) = answer(&r.json());
            assert_eq!(text, c.text, "{}: text", c.name);
            assert_eq!(finish, c.finish_reason, "{}: finish_reason", c.name);
            assert_eq!(prompt_tokens as usize, c.prompt_ids.len(), "{}: prompt_tokens", c.name);
            assert_eq!(completion_tokens as usize, c.completion_tokens(), "{}: completion_tokens", c.name);
        }
    })
    .await;
    // Every case streamed at once, half on each lane: concurrent streams equal the reference.
    let clients: Vec<_> = g
        .cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let target = if i % 2 == 0 { h.voice.clone() } else { h.agent.clone() };
            let (path, body) = c.body(g.max_tokens, true);
            let (name, text, finish) = (c.name.clone(), c.text.clone(), c.finish_reason.clone());
            std::thread::spawn(move || {
                let r = target.stream_to_clean_end(path, &body);
                assert_eq!(r.text, text, "{name}: streamed text");
                assert_eq!(r.finish_reason.as_deref(), Some(finish.as_str()), "{name}: streamed finish_reason");
            })
        })
        .collect();
    blocking(move || clients.into_iter().for_each(|c| c.join().expect("streaming client"))).await;
    // Without `chat_template_kwargs` each lane's default decides: voice thinks off, agent on.
    let (voice, agent, gg) = (h.voice.clone(), h.agent.clone(), g.clone());
    blocking(move || {
        for (target, thinking) in [(&voice, false), (&agent, true)] {
            let c = gg.cases.iter().find(|c| c.messages.is_some() && c.enable_thinking == Some(thinking)).unwrap();
            let (path, mut body) = c.body(gg.max_tokens, false);
            body.as_object_mut().unwrap().remove("chat_template_kwargs");
            let r = target.post(path, &body).expect("post");
            assert_eq!(r.status, 200, "{}: {}", c.name, r.text());
            assert_eq!(answer(&r.json()).0, c.text, "{} through the lane default", c.name);
        }
    })
    .await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_openai_errors_and_serving_continues() {
    let g = golden();
    let h = Harness::start().await;
    let voice = h.voice.clone();
    let case = g.cases.into_iter().find(|c| c.messages.is_some()).unwrap();
    let max_tokens = g.max_tokens;
    blocking(move || {
        let vocab = 502;
        let bad: Vec<(&str, Value, u16)> = vec![
            ("/v1/completions", json!({"model": MODEL, "prompt": [1, 2, vocab + 7], "max_tokens": 2}), 400),
            ("/v1/completions", json!({"model": MODEL, "prompt": [], "max_tokens": 2}), 400),
            ("/v1/chat/completions", json!({"model": MODEL, "messages": [], "max_tokens": 2}), 400),
            ("/v1/chat/completions", json!({"model": MODEL, "messages": "hi", "max_tokens": 2}), 400),
            (
                "/v1/chat/completions",
                json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1u64 << 40}),
                400,
            ),
            (
                "/v1/chat/completions",
                json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}),
                400,
            ),
        ];
        for (path, body, status) in bad {
            let r = voice.post(path, &body).expect("post");
            let v = r.json();
            assert_eq!(r.status, status, "{body}: {}", r.text());
            let err = &v["error"];
            assert!(err["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}: {v}");
            assert_eq!(err["type"], "invalid_request_error", "{body}: {v}");
        }
        assert_eq!(voice.get("/health").expect("health").status, 200);
        let (path, body) = case.body(max_tokens, false);
        let r = voice.post(path, &body).expect("post");
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(answer(&r.json()).0, case.text, "served after the errors");
    })
    .await;
    h.stop().await;
}
