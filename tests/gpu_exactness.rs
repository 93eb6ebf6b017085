//! The engine on the CUDA backend, on a real GPU (run by `scripts/gpu_sampling.sh`; ignored in CI
//! with the reason, never passed):
//! - device sampling serves the same sampled text as sampling the copied logits on the host;
//! - the three exactness rules of DESIGN.md (concurrent = solo, prefix hit = fresh, drafted =
//!   undrafted), measured through scheduler, KV pool, drafter and executor, bitwise on token ids
//!   and logprob bits, in f32 and bf16, on the tiny HF fixture and the synthetic 1B config. Rules
//!   listed in [`HOLDS`] are asserted; the others are printed with the reason they do not hold
//!   yet (docs/cuda_exactness.md), never passed silently.

mod common;

use std::sync::Arc;
use std::time::Duration;

use shelfserve::actors::{start_engine, Engine, EngineOptions, GenerationRequest, InferenceEngine, StreamEvent};
use shelfserve::backend::cuda::Precision;
use shelfserve::config::engine::EngineConfig;
use shelfserve::config::LlamaConfig;
use shelfserve::generate::{DeviceKind, DeviceSelection};
use shelfserve::model::default_model::CacheDir;
use shelfserve::model::synthetic::SyntheticWeights;
use shelfserve::model::{DType, ModelBundle, TensorView, WeightSource};
use shelfserve::sampling::SamplingParams;
use shelfserve::spec::SpeculativeMethod;

/// (model, precision, rule) combinations measured to hold bitwise on the H200; asserted.
/// Measured 2026-11-29: everything but f32 concurrent = solo and, since the adaptive draft length
/// prices CUDA verification at 0.05 of a step (so sequences draft all 4 tokens, 5 rows: cuBLAS
/// instead of the 1-4 row GEMVs), f32 drafted = undrafted on the tiny fixture (ids equal there,
/// logprob bits not). Since 2026-12-04 (session 17's run) the tiny fixture's f32 prefix hit = fresh
/// is out too: ids equal, the first token's logprob 1 ulp apart (the tail's prefill step has a
/// different token count than the whole prompt's), so only prefill numerics differ.
const HOLDS: &[(&str, &str, &str)] = &[
    ("llama3-tiny", "bf16", "concurrent = solo"),
    ("llama3-tiny", "bf16", "prefix hit = fresh"),
    ("llama3-tiny", "bf16", "drafted = undrafted"),
    ("synthetic-1b", "f32", "concurrent = solo"),
    ("synthetic-1b", "f32", "prefix hit = fresh"),
    ("synthetic-1b", "f32", "drafted = undrafted"),
    ("synthetic-1b", "bf16", "concurrent = solo"),
    ("synthetic-1b", "bf16", "prefix hit = fresh"),
    ("synthetic-1b", "bf16", "drafted = undrafted"),
];

/// A reply as the rules compare it: ids and the bits of each token's logprob.
type Reply = Vec<(u32, u32)>;

fn tiny() -> ModelBundle {
    let dir = common::fixture("hf/llama3-tiny");
    shelfserve::model::open(dir.to_str().unwrap(), &CacheDir::from_env()).expect("open the tiny fixture")
}

/// Synthetic weights generated once and shared by both precisions' engines (generating 1.2 B
/// values takes a while).
struct SharedWeights(Arc<SyntheticWeights>);

impl WeightSource for SharedWeights {
    fn origin(&self) -> &std::path::Path {
        self.0.origin()
    }
    fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        self.0.tensor(name)
    }
    fn tensor_names(&self) -> Vec<String> {
        self.0.tensor_names()
    }
}

fn synthetic_1b() -> ModelBundle {
    static WEIGHTS: std::sync::OnceLock<(LlamaConfig, Arc<SyntheticWeights>)> = std::sync::OnceLock::new();
    let (config, weights) = WEIGHTS.get_or_init(|| {
        let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs/bench/llama-1b.json");
        let text = std::fs::read_to_string(&path).expect("read configs/bench/llama-1b.json");
        let config = LlamaConfig::from_hf_json(&text, &path).expect("parse the 1B config");
        let weights = Arc::new(SyntheticWeights::new(&config, DType::BF16, 3));
        (config, weights)
    });
    ModelBundle {
        name: "synthetic-1b".into(),
        config: config.clone(),
        weights: Box::new(SharedWeights(weights.clone())),
        tokenizer: None,
        generation: Default::default(),
    }
}

/// Lanes `plain` and `drafted` (n-gram, 4 draft tokens), small pages so prompts hit the cache.
fn engine_config() -> EngineConfig {
    let mut cfg = EngineConfig::builtin();
    let template = cfg.lanes[0].clone();
    cfg.lanes = ["plain", "drafted"]
        .iter()
        .map(|name| {
            let mut l = template.clone();
            l.name = name.to_string();
            l.port = 0;
            l.priority = 0;
            l.speculative = if *name == "drafted" { SpeculativeMethod::Ngram } else { SpeculativeMethod::None };
            l.num_speculative_tokens = 4;
            l
        })
        .collect();
    cfg.scheduler.page_tokens = 16;
    cfg.scheduler.kv_pool_tokens = 8192;
    cfg.scheduler.max_num_seqs = 16;
    cfg.scheduler.max_num_batched_tokens = 1024;
    cfg
}

async fn start(bundle: ModelBundle, precision: Precision) -> Arc<Engine> {
    let device = DeviceSelection { kind: DeviceKind::Cuda, cuda_precision: precision, ..Default::default() };
    let e = start_engine(bundle, engine_config(), EngineOptions { device, served_model_name: "t".into() })
        .await
        .expect("start the engine on cuda:0");
    common::engine::wait_ready(&e, Duration::from_secs(180)).await;
    e
}

fn request(lane: &str, prompt: &[u32], sampling: SamplingParams, max_tokens: usize) -> GenerationRequest {
    GenerationRequest {
        lane: lane.into(),
        prompt: prompt.to_vec(),
        sampling,
        max_tokens,
        stop_strings: Vec::new(),
        stop_token_ids: Vec::new(),
        ignore_eos: true,
        skip_special_tokens: true,
        loop_guard: shelfserve::sampling::loop_guard::LoopGuardConfig::off(),
        grammar: None,
        images: Vec::new(),
    }
}

/// Runs a request to the end: (id, logprob bits) per token and the prompt tokens served from cache.
async fn run(e: &Engine, req: GenerationRequest) -> (Reply, usize) {
    let mut rx = e.submit(req).expect("submit");
    let mut out = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(120), rx.recv()).await.expect("no event in 120 s") {
            Some(StreamEvent::Delta { tokens, .. }) => {
                out.extend(tokens.iter().map(|t| (t.id, t.logprob.map_or(u32::MAX, f32::to_bits))))
            }
            Some(StreamEvent::Finished { usage, .. }) => return (out, usage.cached_tokens),
            Some(StreamEvent::Error(err)) => panic!("request failed: {err}"),
            None => panic!("stream ended without Finished"),
        }
    }
}

/// Prompts with repeated spans (so the n-gram drafter proposes), all ids below 500.
fn prompts(salt: u32) -> Vec<Vec<u32>> {
    (0..4u32)
        .map(|s| {
            let span: Vec<u32> = (0..5 + s).map(|i| (salt * 31 + s * 53 + i * 29 + 7) % 500).collect();
            let mut p = Vec::new();
            for r in 0..4 + s {
                p.extend(&span);
                p.push((s + r * 11 + salt) % 500);
            }
            p
        })
        .collect()
}

fn greedy_with_logprobs() -> SamplingParams {
    SamplingParams { logprobs: Some(1), ..Default::default() }
}

/// How two sets of replies compare: ids equal, and logprob bits equal too.
fn verdict(a: &[Reply], b: &[Reply]) -> (bool, bool) {
    let ids = |r: &[Reply]| r.iter().map(|x| x.iter().map(|t| t.0).collect::<Vec<_>>()).collect::<Vec<_>>();
    if let Some(d) = first_difference(a, b) {
        println!("  first difference: {d}");
    }
    (ids(a) == ids(b), a == b)
}

/// Where two runs first part (prompt, token, both ids and logprobs), and how many tokens differ:
/// a difference at token 0 only comes from the prefill step, later ones from decode steps.
fn first_difference(a: &[Reply], b: &[Reply]) -> Option<String> {
    let pairs =
        || a.iter().zip(b).enumerate().flat_map(|(p, (x, y))| x.iter().zip(y).enumerate().map(move |(t, v)| (p, t, v)));
    let differing = pairs().filter(|(_, _, (x, y))| x != y).count();
    let (p, t, (x, y)) = pairs().find(|(_, _, (x, y))| x != y)?;
    Some(format!(
        "prompt {p} token {t}: id {} logprob {:e} vs id {} logprob {:e} ({differing} tokens differ)",
        x.0,
        f32::from_bits(x.1),
        y.0,
        f32::from_bits(y.1)
    ))
}

/// The three rules on one engine; returns (rule, ids equal, bitwise incl. logprobs).
async fn rules(e: &Engine) -> Vec<(&'static str, bool, bool)> {
    const N: usize = 24;
    let mut out = Vec::new();
    // Rule 3: concurrent = solo.
    let ps = prompts(1);
    let mut solo = Vec::new();
    for p in &ps {
        solo.push(run(e, request("plain", p, greedy_with_logprobs(), N)).await.0);
    }
    let together =
        futures_util::future::join_all(ps.iter().map(|p| run(e, request("plain", p, greedy_with_logprobs(), N))))
            .await
            .into_iter()
            .map(|r| r.0)
            .collect::<Vec<_>>();
    let (ids, bits) = verdict(&solo, &together);
    out.push(("concurrent = solo", ids, bits));
    // Rule 2: prefix hit = fresh (same prompts again, served from whole cached pages).
    let ps = prompts(2);
    let mut fresh = Vec::new();
    for p in &ps {
        fresh.push(run(e, request("plain", p, greedy_with_logprobs(), N)).await.0);
    }
    let mut hit = Vec::new();
    let mut cached = 0;
    for p in &ps {
        let (r, c) = run(e, request("plain", p, greedy_with_logprobs(), N)).await;
        hit.push(r);
        cached += c;
    }
    assert!(cached > 0, "the repeated prompts hit no cached page");
    let (ids, bits) = verdict(&fresh, &hit);
    out.push(("prefix hit = fresh", ids, bits));
    // Rule 1: drafted = undrafted.
    let ps = prompts(3);
    let before = e.stats().await.expect("stats");
    let mut plain = Vec::new();
    let mut drafted = Vec::new();
    for p in &ps {
        plain.push(run(e, request("plain", p, greedy_with_logprobs(), N)).await.0);
        drafted.push(run(e, request("drafted", p, greedy_with_logprobs(), N)).await.0);
    }
    let after = e.stats().await.expect("stats");
    assert!(after.drafted_tokens > before.drafted_tokens, "nothing was drafted");
    let (ids, bits) = verdict(&plain, &drafted);
    out.push(("drafted = undrafted", ids, bits));
    out
}

/// Why a rule does not hold bitwise on CUDA yet (see docs/cuda_exactness.md).
fn reason(rule: &str) -> &'static str {
    match rule {
        "concurrent = solo" => {
            "prompts prefilled in one step run their projections on cuBLAS, whose GEMM algorithm (tiling, split-K) depends on the step's token count"
        }
        "prefix hit = fresh" => {
            "the prompt's tail is prefilled in a step of another token count (cuBLAS picks its GEMM algorithm by shape)"
        }
        _ => "verify steps run several query rows per sequence, plain decode one (a different GEMV or GEMM shape)",
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device; run scripts/gpu_sampling.sh"]
async fn exactness_rules_through_the_engine_on_cuda() {
    println!("{:<14} {:<5} {:<20} {:>9} {:>17}", "model", "prec", "rule", "ids equal", "bitwise + logprob");
    let mut failures = Vec::new();
    for (model, make) in [("llama3-tiny", tiny as fn() -> ModelBundle), ("synthetic-1b", synthetic_1b)] {
        for prec in [Precision::F32, Precision::Bf16] {
            let e = start(make(), prec).await;
            for (rule, ids, bits) in rules(&e).await {
                let expected = HOLDS.contains(&(model, prec.suffix(), rule));
                println!("{:<14} {:<5} {:<20} {:>9} {:>17}", model, prec.suffix(), rule, ids, bits);
                if !bits {
                    println!("  does not hold bitwise: {}", reason(rule));
                }
                if expected && !bits {
                    failures.push(format!("{model} {} {rule}", prec.suffix()));
                }
                if bits && !expected {
                    println!("  holds now: add ({model:?}, {:?}, {rule:?}) to HOLDS", prec.suffix());
                }
            }
            e.shutdown();
        }
    }
    assert!(failures.is_empty(), "rules that held before no longer hold: {failures:?}");
}

/// The same prompts served at once with sampling on the device and with logits copied to the
/// host, on the tiny fixture in f32.
async fn device_then_host(ps: &[Vec<u32>], params: impl Fn(u64) -> SamplingParams) -> Vec<Vec<Reply>> {
    let mut replies = Vec::new();
    for device_sampling in [true, false] {
        // Read when the backend opens (on the executor thread this engine starts).
        std::env::set_var("SHELFSERVE_CUDA_SAMPLING", if device_sampling { "1" } else { "0" });
        let e = start(tiny(), Precision::F32).await;
        let r = futures_util::future::join_all(
            ps.iter().enumerate().map(|(i, p)| run(&e, request("plain", p, params(100 + i as u64), 32))),
        )
        .await
        .into_iter()
        .map(|r| r.0)
        .collect::<Vec<_>>();
        replies.push(r);
        e.shutdown();
    }
    std::env::remove_var("SHELFSERVE_CUDA_SAMPLING");
    replies
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device; run scripts/gpu_sampling.sh"]
async fn device_sampling_serves_what_host_sampling_serves() {
    // Temperature 0.8, top-p 0.9, four seeds, all at once: the full device pipeline. Then plain
    // greedy without logprobs: the device's one-pass argmax path.
    let ps = prompts(4);
    let sampled =
        |seed: u64| SamplingParams { temperature: 0.8, top_p: 0.9, seed, logprobs: Some(2), ..Default::default() };
    let replies = device_then_host(&ps, sampled).await;
    let (ids, bits) = verdict(&replies[0], &replies[1]);
    let tokens: usize = replies[0].iter().map(Vec::len).sum();
    println!("device vs host sampling through the engine: {tokens} tokens, ids equal {ids}, logprob bits equal {bits}");
    assert!(ids, "device sampling served different tokens:\n{:?}\n{:?}", replies[0], replies[1]);
    let greedy = device_then_host(&ps, |seed| SamplingParams { seed, ..Default::default() }).await;
    let ids: Vec<Vec<u32>> = greedy[0].iter().map(|r| r.iter().map(|t| t.0).collect()).collect();
    let host_ids: Vec<Vec<u32>> = greedy[1].iter().map(|r| r.iter().map(|t| t.0).collect()).collect();
    println!(
        "plain greedy (device argmax path) vs host: {} tokens, ids equal {}",
        ids.iter().map(Vec::len).sum::<usize>(),
        ids == host_ids
    );
    assert_eq!(ids, host_ids, "the device argmax path served different greedy tokens");
}
