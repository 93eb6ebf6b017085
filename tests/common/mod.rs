//! Shared helpers for integration tests: locating the real default model, greedy requests,
//! starting engines and watching their KV pool (`engine`), serving them over HTTP (`serve`).
#![allow(dead_code)]

pub mod dflash;
pub mod engine;
pub mod serve;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use shelfserve::actors::{Engine, GenerationRequest, InferenceEngine, StreamEvent, Usage};
use shelfserve::generate::GenerateOptions;
use shelfserve::model::default_model::{ensure_default, CacheDir};
use shelfserve::model::ModelBundle;

/// Greedy generation of `max_tokens` tokens with no stop ids, prefilling `prefill_chunk` tokens
/// a step (the shape every golden and exactness test drives a `Runner` with).
pub fn greedy_options(max_tokens: usize, prefill_chunk: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        sampling: shelfserve::sampling::SamplingParams::default(),
        eos_token_ids: Vec::new(),
        prefill_chunk,
    }
}

/// The SmolLM2 GGUF: `SHELFSERVE_DEFAULT_GGUF` if set, else the default model from the cache
/// (fetched once per test binary). Without it a test is skipped with a printed reason — except
/// under CI (`CI` set), where a missing model is a failure, never a silent pass.
pub fn default_gguf() -> Option<PathBuf> {
    static PATH: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let r = PATH.get_or_init(|| {
        if let Some(p) = std::env::var_os("SHELFSERVE_DEFAULT_GGUF") {
            return Ok(PathBuf::from(p));
        }
        ensure_default(&CacheDir::from_env(), false).map_err(|e| e.to_string())
    });
    match r {
        Ok(p) => Some(p.clone()),
        Err(e) if std::env::var_os("CI").is_some() => panic!("default model unavailable under CI: {e}"),
        Err(e) => {
            eprintln!("skipped: default model unavailable: {e}");
            None
        }
    }
}

/// The default model, opened: `None` (with the reason printed) as for [`default_gguf`].
pub fn open_default_model() -> Option<ModelBundle> {
    let path = default_gguf()?;
    let bundle = shelfserve::model::open(path.to_str().expect("utf-8 model path"), &CacheDir::from_env())
        .expect("open the default model");
    Some(bundle)
}

/// Tensor `name` of a golden safetensors file as token ids (stored as i64 by the generators).
pub fn tensor_ids(st: &safetensors::SafeTensors<'_>, name: &str) -> Vec<u32> {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("golden tensor `{name}`: {e}"));
    t.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")) as u32).collect()
}

/// Tensor `name` of a golden safetensors file as f32 values.
pub fn tensor_f32s(st: &safetensors::SafeTensors<'_>, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("golden tensor `{name}`: {e}"));
    t.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect()
}

pub fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(rel)
}

/// The index of a row's largest value (the first of equals): the greedy token.
pub fn argmax(row: &[f32]) -> u32 {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0 as u32
}

/// A greedy request on the voice lane that runs to `max_tokens` (EOS ignored).
pub fn greedy_request(prompt: Vec<u32>, max_tokens: usize) -> GenerationRequest {
    GenerationRequest::greedy_fixed_length("voice", prompt, max_tokens)
}

/// Runs a greedy request to the end: generated ids and usage.
pub async fn run_greedy(e: &Engine, prompt: Vec<u32>, max_tokens: usize) -> (Vec<u32>, Usage) {
    let mut rx = e.submit(greedy_request(prompt, max_tokens)).expect("submit");
    let mut ids = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(120), rx.recv()).await.expect("no event in 120 s") {
            Some(StreamEvent::Delta { tokens, .. }) => ids.extend(tokens.iter().map(|t| t.id)),
            Some(StreamEvent::Finished { usage, .. }) => return (ids, usage),
            Some(StreamEvent::Error(err)) => panic!("request failed: {err}"),
            None => panic!("stream ended without Finished"),
        }
    }
}

/// A deterministic prompt of real-looking token ids (all below SmolLM2's 49152 vocabulary).
pub fn synthetic_prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 300 + (seed * 7919 + i * 104_729) % 40_000).collect()
}
