//! Chat templates rendered by `ChatTemplate` must equal HF transformers' `apply_chat_template`
//! output for the same inputs. The fixtures in tests/fixtures/chat/ are written by
//! scripts/gen_chat_golden.py (transformers' Jinja2 environment, clock frozen at `now`).

use std::path::{Path, PathBuf};

use serde_json::Value;
use shelfserve::tokenizer::chat::{ChatRender, ChatTemplate};
use shelfserve::tokenizer::TokenizerError;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat")
}

fn load(name: &str) -> Value {
    let path = fixture_dir().join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A readable account of the first difference: position, line, and both sides around it.
fn describe_diff(want: &str, got: &str) -> String {
    let pos = want.char_indices().zip(got.chars()).find(|((_, a), b)| a != b).map(|((i, _), _)| i);
    let pos = pos.unwrap_or_else(|| want.len().min(got.len()));
    let line = want[..pos].matches('\n').count() + 1;
    let window = |s: &str| {
        let start = s[..pos.min(s.len())].char_indices().rev().nth(60).map(|(i, _)| i).unwrap_or(0);
        let end = s[pos.min(s.len())..].char_indices().nth(60).map(|(i, _)| pos + i).unwrap_or(s.len());
        format!("{:?}", &s[start..end])
    };
    format!(
        "first difference at byte {pos} (line {line}); lengths {} vs {}\n  expected: …{}…\n  rendered: …{}…\n\
         --- full expected ---\n{want}\n--- full rendered ---\n{got}\n---",
        want.len(),
        got.len(),
        window(want),
        window(got)
    )
}

fn run_fixture(name: &str) {
    let doc = load(name);
    let now = chrono::NaiveDateTime::parse_from_str(doc["now"].as_str().expect("now"), "%Y-%m-%dT%H:%M:%S")
        .expect("fixture `now` is an ISO date-time");
    let bos = doc["bos_token"].as_str();
    let eos = doc["eos_token"].as_str();
    let cases = doc["cases"].as_array().expect("cases");
    assert!(!cases.is_empty(), "{name}: no cases");
    let mut failures = Vec::new();
    for case in cases {
        let case_name = case["name"].as_str().unwrap_or("?");
        let source = case.get("template").and_then(Value::as_str).or(doc["template"].as_str()).expect("template");
        let label = format!("{name}/{case_name}");
        let template = match ChatTemplate::new(source, bos, eos) {
            Ok(t) => t.with_fixed_now(now),
            Err(e) => {
                failures.push(format!("{label}: template does not compile: {e}"));
                continue;
            }
        };
        let kwargs = case["kwargs"].as_object().cloned().unwrap_or_default();
        let tools = case.get("tools").filter(|t| !t.is_null());
        let req = ChatRender {
            messages: &case["messages"],
            tools,
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap_or(false),
            kwargs: &kwargs,
        };
        let result = template.render(&req);
        match (case.get("expected").and_then(Value::as_str), result) {
            (Some(want), Ok(got)) => {
                if want != got {
                    failures.push(format!("{label}: {}", describe_diff(want, &got)));
                }
            }
            (Some(_), Err(e)) => failures.push(format!("{label}: HF renders it, we fail: {e}")),
            (None, Ok(got)) => failures.push(format!(
                "{label}: HF raises {:?}, we rendered {got:?}",
                case["expected_error"].as_str().unwrap_or_default()
            )),
            (None, Err(TokenizerError::Template(msg))) => {
                let want = case["expected_error"].as_str().unwrap_or_default();
                // Messages from the template's own raise_exception must reach clients verbatim;
                // other errors (unknown filter...) are worded by the engine and only need to fail.
                if source.contains("raise_exception") && msg != want {
                    failures.push(format!("{label}: error message differs\n  HF: {want:?}\n  we: {msg:?}"));
                }
            }
            (None, Err(e)) => failures.push(format!("{label}: wrong error kind: {e:?}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from HF:\n\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n\n")
    );
}

#[test]
fn smollm2_matches_hf() {
    run_fixture("smollm2");
}

#[test]
fn qwen3_matches_hf() {
    run_fixture("qwen3");
}

#[test]
fn llama3_1_matches_hf() {
    run_fixture("llama3_1");
}

#[test]
fn gpt_oss_matches_hf() {
    run_fixture("gpt_oss");
}

#[test]
fn jinja2_behaviours_match_hf() {
    run_fixture("misc");
}

/// The SmolLM2 fixture must use the template that ships in the default model's GGUF, so a
/// fixture regenerated from another file cannot silently pass.
#[test]
fn smollm2_fixture_is_the_gguf_template() {
    let doc = load("smollm2");
    let tpl = doc["template"].as_str().unwrap_or_default();
    assert!(tpl.contains("You are a helpful AI assistant named SmolLM, trained by Hugging Face"), "{tpl}");
    assert_eq!(doc["bos_token"], "<|im_start|>");
    assert_eq!(doc["eos_token"], "<|im_end|>");
}
