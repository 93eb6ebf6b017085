//! Speculative decoding exactness on the real default model (CPU backend): with greedy sampling a
//! drafted reply must equal the un-drafted one token for token, for every draft length k in 1..=7,
//! alone and with many drafted streams running concurrently; and drafting must really happen
//! (drafts proposed, some accepted) or the test proves nothing.

mod common;

use std::time::Duration;

use shelfserve::actors::{
    start_engine, Engine, EngineOptions, FinishReason, GenerationRequest, InferenceEngine, StreamEvent,
};
use shelfserve::config::engine::EngineConfig;
use shelfserve::model::default_model::CacheDir;
use shelfserve::sampling::SamplingParams;
use shelfserve::spec::SpeculativeMethod;

const MAX_TOKENS: usize = 32;

/// Prompts whose continuations repeat parts of the prompt (lists, code, a recited text), where an
/// n-gram drafter has something to propose, plus one where it has little.
const PROMPTS: &[&str] = &[
    "Copy the list exactly.\nList: apples, pears, plums, cherries, grapes, lemons, limes.\nCopy: apples, pears,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "Write one sentence about the sea.",
];

/// One lane per draft length (k1..k7) plus an un-drafted lane.
fn config(method: SpeculativeMethod) -> EngineConfig {
    let mut cfg = EngineConfig::builtin();
    let template = cfg.lanes[0].clone();
    cfg.lanes = (0..=7)
        .map(|k| {
            let mut l = template.clone();
            l.name = format!("k{k}");
            l.port = 0;
            l.priority = 0;
            l.speculative = if k == 0 { SpeculativeMethod::None } else { method.clone() };
            l.num_speculative_tokens = k.max(1);
            l
        })
        .collect();
    cfg.scheduler.max_num_seqs = 64;
    cfg.scheduler.max_num_batched_tokens = 1024;
    cfg
}

async fn start(cfg: EngineConfig) -> Option<(std::sync::Arc<Engine>, Vec<Vec<u32>>)> {
    let path = common::default_gguf()?;
    let bundle =
        shelfserve::model::open(path.to_str().unwrap(), &CacheDir::from_env()).expect("open the default model");
    let tok = bundle.tokenizer.clone().expect("tokenizer");
    let prompts = PROMPTS.iter().map(|p| tok.encode(p, true).expect("tokenize")).collect();
    let engine =
        start_engine(bundle, cfg, EngineOptions { device: Default::default(), served_model_name: "default".into() })
            .await
            .expect("start the engine");
    let t0 = std::time::Instant::now();
    while !engine.is_ready() {
        assert!(t0.elapsed() < Duration::from_secs(300), "model did not load");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Some((engine, prompts))
}

async fn generate(engine: &Engine, lane: &str, prompt: &[u32]) -> (Vec<u32>, FinishReason) {
    let req = GenerationRequest {
        lane: lane.into(),
        prompt: prompt.to_vec(),
        sampling: SamplingParams::default(),
        max_tokens: MAX_TOKENS,
        stop_strings: Vec::new(),
        stop_token_ids: Vec::new(),
        ignore_eos: false,
        skip_special_tokens: true,
    };
    let mut events = engine.submit(req).expect("admitted");
    let mut ids = Vec::new();
    while let Some(ev) = events.recv().await {
        match ev {
            StreamEvent::Delta { tokens, .. } => ids.extend(tokens.iter().map(|t| t.id)),
            StreamEvent::Finished { reason, .. } => return (ids, reason),
            StreamEvent::Error(e) => panic!("request failed: {e}"),
        }
    }
    panic!("stream ended without a finish event");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drafted_greedy_equals_undrafted_for_every_k_alone_and_concurrently() {
    let Some((engine, prompts)) = start(config(SpeculativeMethod::Ngram)).await else { return };
    // Reference: the un-drafted lane, one request at a time.
    let mut reference = Vec::new();
    for p in &prompts {
        reference.push(generate(&engine, "k0", p).await);
    }
    // Alone, the longest drafts.
    for k in [7] {
        for (i, p) in prompts.iter().enumerate() {
            let got = generate(&engine, &format!("k{k}"), p).await;
            assert_eq!(got, reference[i], "prompt {i}, k {k}, alone");
        }
    }
    let alone = engine.stats().await.unwrap();
    assert!(alone.drafted_tokens > 0 && alone.accepted_tokens > 0, "drafting never happened: {alone:?}");
    // Every k, every prompt, all at once (plus un-drafted company).
    let mut tasks = Vec::new();
    for k in 0..=7 {
        for (i, p) in prompts.iter().enumerate() {
            let (engine, p) = (engine.clone(), p.clone());
            tasks.push(tokio::spawn(async move { (k, i, generate(&engine, &format!("k{k}"), &p).await) }));
        }
    }
    for t in tasks {
        let (k, i, got) = t.await.unwrap();
        assert_eq!(got, reference[i], "prompt {i}, k {k}, concurrent");
    }
    let s = engine.stats().await.unwrap();
    assert!(s.accepted_tokens > alone.accepted_tokens, "no drafts accepted under concurrency: {s:?}");
    assert!(s.drafted_tokens > s.accepted_tokens, "no draft was ever rejected, so rejection went untested: {s:?}");
    eprintln!(
        "drafted {} accepted {} ({:.0}%) over {} steps",
        s.drafted_tokens,
        s.accepted_tokens,
        100.0 * s.accepted_tokens as f64 / s.drafted_tokens as f64,
        s.steps
    );
    assert_eq!((s.running, s.waiting, s.blocks_used), (0, 0, 0), "pages back to idle: {s:?}");
    engine.shutdown();
}
