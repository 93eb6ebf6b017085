//! Our tokenizer built from the SmolLM2 GGUF must give llama.cpp's ids for every case in
//! `tests/fixtures/tokenizer/smollm2_llamacpp.json` (written by `scripts/gen_tokenizer_golden.py`
//! with llama-cpp-python, and cross-checked there against HF transformers' GGUF tokenizer), and
//! decoding must give the text back. Skipped, with a printed reason, when
//! `SHELFSERVE_DEFAULT_GGUF` (the GGUF path) is not set.

use std::path::Path;

use serde_json::Value;
use shelfserve::model::gguf::GgufFile;
use shelfserve::tokenizer::gguf_vocab::tokenizer_from_gguf;

fn gguf_path() -> Option<std::path::PathBuf> {
    match std::env::var_os("SHELFSERVE_DEFAULT_GGUF") {
        Some(p) => Some(p.into()),
        None => {
            eprintln!("skipped: SHELFSERVE_DEFAULT_GGUF is not set (path to SmolLM2-135M-Instruct.Q4_1.gguf)");
            None
        }
    }
}

fn fixture() -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer/smollm2_llamacpp.json");
    serde_json::from_str(&std::fs::read_to_string(&p).expect("read fixture")).expect("fixture json")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("id array").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

#[test]
fn smollm2_tokenizer_matches_llamacpp_ids_and_round_trips() {
    let Some(path) = gguf_path() else { return };
    let g = GgufFile::open(&path).expect("open gguf");
    let tok = tokenizer_from_gguf(&g, &path).expect("tokenizer");
    let fx = fixture();
    let cases = fx["cases"].as_array().expect("cases");
    assert!(cases.len() >= 30, "fixture too small");
    let mut failures = Vec::new();
    for case in cases {
        let text = case["text"].as_str().expect("text");
        let want = ids(&case["ids"]);
        // add_special = true: SmolLM2 says add_bos_token = false, so nothing may be added.
        let got = tok.encode(text, true).expect("encode");
        if got != want {
            failures.push(format!("{text:?}\n  llama.cpp: {want:?}\n  ours:      {got:?}"));
            continue;
        }
        if let Some(hf) = case.get("hf_ids").filter(|v| !v.is_null()) {
            // Not our reference, but if both references agree and we differ something is off.
            assert_eq!(ids(hf), want, "fixture: HF and llama.cpp disagree on {text:?}");
        }
        let back = tok.decode(&got, false).expect("decode");
        if back != text {
            failures.push(format!("{text:?}: decode gave {back:?}"));
        }
    }
    assert!(failures.is_empty(), "{} of {} cases differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

#[test]
fn smollm2_special_tokens_and_metadata() {
    let Some(path) = gguf_path() else { return };
    let g = GgufFile::open(&path).expect("open gguf");
    let tok = tokenizer_from_gguf(&g, &path).expect("tokenizer");
    // The GGUF says bos = 1 (<|im_start|>), eos = 2 (<|im_end|>), add_bos_token = false.
    assert_eq!(tok.bos_token_id, Some(1));
    assert_eq!(tok.bos_token.as_deref(), Some("<|im_start|>"));
    assert_eq!(tok.eos_token.as_deref(), Some("<|im_end|>"));
    assert!(!tok.add_bos_token);
    // End of generation: the same set llama.cpp reports (eos, <|endoftext|>, and the FIM repo
    // token <reponame>), recorded by scripts/gen_llamacpp_golden.py.
    let greedy = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llamacpp/smollm2_greedy.json");
    let greedy: Value = serde_json::from_str(&std::fs::read_to_string(greedy).expect("read")).expect("json");
    assert_eq!(tok.eos_token_ids, ids(&greedy["eos_token_ids"]));
    assert_eq!(tok.eos_token_ids, vec![0, 2, 4]);
    assert!(tok.chat_template.as_deref().is_some_and(|t| t.contains("<|im_start|>")));
    // Control tokens vanish with skip_special and stay without it.
    let ids = tok.encode("<|im_start|>user\nHi<|im_end|>", false).expect("encode");
    assert_eq!(ids.first(), Some(&1));
    assert_eq!(ids.last(), Some(&2));
    assert_eq!(tok.decode(&ids, true).expect("decode"), "user\nHi");
}
