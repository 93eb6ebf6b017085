//! CPU tensor parallelism against the unsharded backend: TP=2 and TP=4 must give the same greedy
//! continuation as TP=1 and logits within max relative error 1e-5 (max |Δ| / max(|ref|, 1) per
//! position, f32 KV): the shards add the same products in a different order, nothing more. The
//! HF fixtures (whose own goldens come from transformers) run at TP=2 and at TP=4 — where their 2
//! kv heads are replicated, each on the two ranks whose query heads use it — and are also checked
//! against the transformers greedy output; a synthetic
//! llama with 8 heads / 4 kv heads and an uneven vocabulary (301, so the last rank's logits slice
//! is padded) runs at TP=2 and TP=4 in f32 and in quantized (Q8_0, Q4_1) storage; and the real
//! SmolLM2 GGUF runs at TP=3 (9 heads, 3 kv heads), widened to f32 and as shipped (quantized,
//! with looser bounds explained at the test).

mod common;

use shelfserve::backend::cpu::{CpuBackend, CpuOptions, KvPrecision, TpCpuBackend};
use shelfserve::backend::{Backend, KvGeometry, SeqStep};
use shelfserve::config::LlamaConfig;
use shelfserve::generate::{single_sequence_geometry, Runner};
use shelfserve::model::default_model::CacheDir;
use shelfserve::model::synthetic::{tiny_llama_config, SyntheticWeights};
use shelfserve::model::{DType, WeightSource};

const MAX_REL_ERR: f32 = 1e-5;

fn opts(kv: KvGeometry) -> CpuOptions {
    CpuOptions { threads: 2, kv, kv_precision: Some(KvPrecision::F32) }
}

/// Teacher-forced logits of `ids` (chunks of 5) and a 12-token greedy continuation.
fn run<B: Backend>(backend: B, ids: &[u32]) -> (Vec<f32>, Vec<u32>) {
    let mut runner = Runner::new(backend);
    let logits = runner.score(ids, 5).unwrap();
    let opts = common::greedy_options(12, 3);
    let greedy = runner.generate(ids, &opts, |_| true).unwrap().ids();
    (logits, greedy)
}

fn compare(
    what: &str,
    cfg: &LlamaConfig,
    w: &dyn WeightSource,
    worlds: &[usize],
    ids: &[u32],
    failures: &mut Vec<String>,
) {
    compare_within(what, cfg, w, worlds, ids, MAX_REL_ERR, failures)
}

fn compare_within(
    what: &str,
    cfg: &LlamaConfig,
    w: &dyn WeightSource,
    worlds: &[usize],
    ids: &[u32],
    tolerance: f32,
    failures: &mut Vec<String>,
) {
    let geom = single_sequence_geometry(64, 4);
    let (ref_logits, ref_greedy) = run(CpuBackend::new(cfg, w, opts(geom)).unwrap(), ids);
    for &world in worlds {
        let tp = TpCpuBackend::new(cfg, w, opts(geom), world).unwrap();
        assert_eq!(tp.world_size(), world);
        // The shards partition the matrices: together they hold what one unsharded backend holds
        // (more where kv heads are replicated: k/v rows are then held by several ranks).
        let whole = CpuBackend::new(cfg, w, opts(geom)).unwrap().weight_bytes();
        if cfg.num_key_value_heads.is_multiple_of(world) {
            assert_eq!(tp.weight_bytes(), whole, "{what}");
        } else {
            assert!(tp.weight_bytes() > whole, "{what}: replicated kv heads are held twice");
        }
        let (logits, greedy) = run(tp, ids);
        let err = shelfserve::fidelity::compare(&ref_logits, &logits, cfg.vocab_size).max_rel_logit_err;
        println!("{what:<24} tp={world} max rel err {err:.3e} greedy same: {}", greedy == ref_greedy);
        if err > tolerance {
            failures.push(format!("{what} tp={world}: max relative logit error {err:.3e} > {tolerance:e}"));
        }
        if greedy != ref_greedy {
            failures.push(format!("{what} tp={world}: greedy {greedy:?} != tp=1 {ref_greedy:?}"));
        }
    }
}

#[test]
fn hf_fixtures_at_tp2_and_tp4_match_tp1_and_transformers() {
    let mut failures = Vec::new();
    for name in ["llama3-tiny", "qwen2-tiny", "qwen3-tiny", "mistral-tiny", "llama-tok"] {
        let dir = common::fixture(&format!("hf/{name}"));
        let bundle = shelfserve::model::open(dir.to_str().unwrap(), &CacheDir::from_env()).unwrap();
        let ids: Vec<u32> = (0..19).map(|i| (i * 37 + 11) % 500).collect();
        compare(name, &bundle.config, bundle.weights.as_ref(), &[2, 4], &ids, &mut failures);
        // The sharded model also reproduces the transformers greedy continuation on its golden.
        let bytes = std::fs::read(dir.join("golden.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let ints = |n: &str| -> Vec<u32> {
            let t = st.tensor(n).unwrap();
            t.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32).collect()
        };
        let (prompt, expected) = (ints("ids_0"), ints("greedy_0"));
        for world in [2, 4] {
            let geom = single_sequence_geometry(128, 4);
            let tp = TpCpuBackend::new(&bundle.config, bundle.weights.as_ref(), opts(geom), world);
            let mut runner = Runner::new(tp.unwrap());
            let gen = common::greedy_options(expected.len(), 3);
            let got = runner.generate(&prompt, &gen, |_| true).unwrap().ids();
            if got != expected {
                failures.push(format!("{name} tp={world}: greedy {got:?} != transformers {expected:?}"));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

fn wide_config() -> LlamaConfig {
    LlamaConfig { num_attention_heads: 8, num_key_value_heads: 4, vocab_size: 301, ..tiny_llama_config() }
}

#[test]
fn synthetic_llama_at_tp2_and_tp4_matches_tp1_in_every_storage_format() {
    let mut failures = Vec::new();
    let cfg = wide_config();
    let ids: Vec<u32> = (0..17).map(|i| (i * 53 + 7) % 301).collect();
    for dtype in [DType::F32, DType::Q8_0, DType::Q4_1] {
        let w = SyntheticWeights::new(&cfg, dtype, 5);
        compare(&format!("synthetic {dtype}"), &cfg, &w, &[2, 4], &ids, &mut failures);
    }
    // GGUF-style models: GGML's RoPE (q/k written in adjacent-pair order) and biases on the
    // row-parallel projections, which only rank 0 may add.
    let ggml = LlamaConfig { rope_ggml_style: true, attention_out_bias: true, mlp_bias: true, ..wide_config() };
    for dtype in [DType::F32, DType::Q8_0] {
        let w = SyntheticWeights::new(&ggml, dtype, 6);
        compare(&format!("synthetic ggml+bias {dtype}"), &ggml, &w, &[2, 4], &ids, &mut failures);
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn kv_images_of_a_sharded_backend_round_trip_across_blocks() {
    let cfg = wide_config();
    let w = SyntheticWeights::new(&cfg, DType::Q8_0, 5);
    let kv = KvGeometry { block_size: 4, num_blocks: 8, state_slots: 1 };
    let mut tp = TpCpuBackend::new(&cfg, &w, opts(kv), 2).unwrap();
    let single = CpuBackend::new(&cfg, &w, opts(kv)).unwrap();
    assert_eq!(tp.kv_block_bytes(), single.kv_block_bytes(), "the ranks' kv heads add up to the model's");
    let ids: Vec<u32> = (0..10).collect();
    let step = |b: &mut TpCpuBackend, toks: &[u32], start: usize, table: &[u32]| {
        let s = SeqStep { tokens: toks, start_pos: start, block_table: table, logits_rows: 1, state_slot: 0 };
        b.forward(&[s]).unwrap().data
    };
    step(&mut tp, &ids[..8], 0, &[0, 1, 2]);
    let image = tp.read_kv_blocks(&[0, 1]).unwrap();
    tp.write_kv_blocks(&[5, 6], &image).unwrap();
    let fresh = step(&mut tp, &ids[8..], 8, &[0, 1, 2]);
    let moved = step(&mut tp, &ids[8..], 8, &[5, 6, 3]);
    assert_eq!(fresh, moved);
    assert!(tp.write_kv_blocks(&[5], &image).is_err());
}

#[test]
fn indivisible_tensor_parallel_sizes_are_refused_with_the_number() {
    let cfg = tiny_llama_config(); // 4 heads, 2 kv heads
    let w = SyntheticWeights::new(&cfg, DType::F32, 1);
    let geom = single_sequence_geometry(16, 4);
    let e = TpCpuBackend::new(&cfg, &w, opts(geom), 3).err().unwrap().to_string();
    assert!(e.contains("does not divide the attention heads (4)"), "{e}");
    // Kv heads are replicated when the group size is a multiple of them, refused otherwise.
    let odd = LlamaConfig { num_attention_heads: 12, num_key_value_heads: 4, intermediate_size: 120, ..cfg.clone() };
    let e = TpCpuBackend::new(&odd, &SyntheticWeights::new(&odd, DType::F32, 1), opts(geom), 6).err().unwrap();
    assert!(e.to_string().contains("neither divides the key/value heads (4)"), "{e}");
    assert!(TpCpuBackend::new(&cfg, &w, opts(geom), 0).is_err());
}

#[test]
fn bad_steps_fail_on_every_rank_without_hanging() {
    let cfg = wide_config();
    let w = SyntheticWeights::new(&cfg, DType::F32, 1);
    let mut tp = TpCpuBackend::new(&cfg, &w, opts(single_sequence_geometry(16, 4)), 2).unwrap();
    let bad = SeqStep { tokens: &[400], start_pos: 0, block_table: &[0], logits_rows: 1, state_slot: 0 };
    assert!(tp.forward(&[bad]).unwrap_err().to_string().contains("outside the vocabulary"));
    // The group is still usable afterwards: the bad step never reached a collective.
    let good = SeqStep { tokens: &[4, 5], start_pos: 0, block_table: &[0], logits_rows: 1, state_slot: 0 };
    assert_eq!(tp.forward(&[good]).unwrap().data.len(), 301);
}

#[test]
fn smollm2_gguf_at_tp3_stays_within_llamacpp_fidelity_of_tp1() {
    // SmolLM2-135M: 9 heads, 3 kv heads, MLP 1536, 49152 tokens, Q4_1/Q8_0 blocks: its heads
    // split 3 ways, on block boundaries. Quantized matmuls round their input to Q8 blocks, so the
    // last-bit differences of the sharded sums flip a few roundings and grow over 30 layers: the
    // logits are held to bounds in the spirit of `golden_llamacpp`'s "same model" check: top-1
    // agreement ≥ 0.9, mean KL < 1e-2 and max |Δ| < 2 (there 2e-3 and 0.5).
    // Measured: mean KL 4.9e-3, max |Δ| 0.90 on logits of ~25, top-1 15/16. The same model widened
    // to f32 (next test) agrees to 5e-5, so the spread is the Q8 input rounding, not the shards.
    let Some(gguf) = common::default_gguf() else { return };
    let bundle = shelfserve::model::open(gguf.to_str().unwrap(), &CacheDir::from_env()).unwrap();
    let (cfg, w) = (&bundle.config, bundle.weights.as_ref());
    let ids: Vec<u32> = vec![1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 2, 17, 1041, 280, 5248, 30, 2];
    let geom = single_sequence_geometry(64, 16);
    let reference = Runner::new(CpuBackend::new(cfg, w, opts(geom)).unwrap()).score(&ids, 7).unwrap();
    let tp = TpCpuBackend::new(cfg, w, opts(geom), 3).unwrap();
    assert_eq!(tp.weight_bytes(), CpuBackend::new(cfg, w, opts(geom)).unwrap().weight_bytes());
    let ours = Runner::new(tp).score(&ids, 7).unwrap();
    let r = shelfserve::fidelity::compare(&reference, &ours, cfg.vocab_size);
    println!("smollm2 tp=3 vs tp=1: {r:?}");
    assert!(r.mean_kld < 1e-2 && r.max_abs_logit_diff < 2.0 && r.top1_agreement >= 0.9, "{r:?}");
}

/// A weight source serving another's tensors widened to f32 (no quantized matmuls).
struct Widened {
    origin: std::path::PathBuf,
    tensors: std::collections::HashMap<String, (Vec<usize>, Vec<u8>)>,
}

impl Widened {
    fn new(w: &dyn WeightSource) -> Self {
        let tensors = w
            .tensor_names()
            .into_iter()
            .map(|n| {
                let t = w.tensor(&n).unwrap();
                let vals = shelfserve::model::tensor::to_f32(&t);
                (n, (t.shape.to_vec(), vals.iter().flat_map(|v| v.to_le_bytes()).collect()))
            })
            .collect();
        Widened { origin: w.origin().to_path_buf(), tensors }
    }
}

impl WeightSource for Widened {
    fn origin(&self) -> &std::path::Path {
        &self.origin
    }
    fn tensor(&self, name: &str) -> Option<shelfserve::model::TensorView<'_>> {
        self.tensors.get(name).map(|(s, d)| shelfserve::model::TensorView { dtype: DType::F32, shape: s, data: d })
    }
    fn tensor_names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }
}

#[test]
fn smollm2_widened_to_f32_at_tp3_matches_tp1() {
    // The real model (GGML RoPE, tied 49152-token vocabulary) with no quantized matmuls: only the
    // summation order differs, over 30 layers — held to 1e-4 (measured 5.2e-5) and the same greedy.
    let Some(gguf) = common::default_gguf() else { return };
    let bundle = shelfserve::model::open(gguf.to_str().unwrap(), &CacheDir::from_env()).unwrap();
    let w = Widened::new(bundle.weights.as_ref());
    let ids: Vec<u32> = vec![1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 2, 17, 1041, 280, 5248, 30, 2];
    let mut failures = Vec::new();
    compare_within("smollm2 widened to f32", &bundle.config, &w, &[3], &ids, 1e-4, &mut failures);
    assert!(failures.is_empty(), "{failures:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_with_one_executor_per_rank_serves_what_tp1_serves() {
    // The serving engine with one ExecutorActor per rank (TP=2, and TP=4 with replicated kv
    // heads), all sent the same plans by the scheduler: four concurrent greedy requests of
    // different lengths get exactly the replies of the unsharded engine, and those are the
    // single-sequence runner's (itself checked against transformers above).
    use shelfserve::actors::{start_engine, EngineOptions, InferenceEngine};
    use shelfserve::generate::{DeviceKind, DeviceSelection};
    let dir = common::fixture("hf/llama3-tiny");
    let prompts: Vec<Vec<u32>> =
        (0..4u32).map(|s| (0..9 + s * 5).map(|i| (i * 37 + s * 101 + 11) % 500).collect()).collect();
    let mut replies = Vec::new();
    for tp in [1, 2, 4] {
        let bundle = shelfserve::model::open(dir.to_str().unwrap(), &CacheDir::from_env()).unwrap();
        let mut cfg = shelfserve::config::engine::EngineConfig::builtin();
        cfg.scheduler.kv_pool_tokens = 2048;
        let device = DeviceSelection { kind: DeviceKind::Cpu, threads: 2, tensor_parallel: tp, ..Default::default() };
        let e = start_engine(bundle, cfg, EngineOptions { device, served_model_name: "t".into() }).await.unwrap();
        let t0 = std::time::Instant::now();
        while !e.is_ready() {
            assert!(t0.elapsed() < std::time::Duration::from_secs(120), "tp={tp}: load timed out");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let outs = futures_util::future::join_all(prompts.iter().map(|p| common::run_greedy(&e, p.clone(), 12))).await;
        replies.push(outs.into_iter().map(|(ids, _)| ids).collect::<Vec<_>>());
        e.shutdown();
    }
    let bundle = shelfserve::model::open(dir.to_str().unwrap(), &CacheDir::from_env()).unwrap();
    for (p, served) in prompts.iter().zip(&replies[0]) {
        let backend = CpuBackend::new(&bundle.config, bundle.weights.as_ref(), opts(single_sequence_geometry(64, 4)));
        let (_, greedy) = run(backend.unwrap(), p);
        assert_eq!(&greedy, served, "the tp=1 engine differs from the runner");
    }
    assert_eq!(replies[1], replies[0], "tp=2 engine");
    assert_eq!(replies[2], replies[0], "tp=4 engine");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_refuses_an_impossible_group_before_loading() {
    use shelfserve::actors::{start_engine, EngineOptions};
    use shelfserve::generate::{DeviceKind, DeviceSelection};
    let dir = common::fixture("hf/llama3-tiny"); // 4 heads, 2 kv heads
    let bundle = shelfserve::model::open(dir.to_str().unwrap(), &CacheDir::from_env()).unwrap();
    let device = DeviceSelection { kind: DeviceKind::Cpu, threads: 2, tensor_parallel: 3, ..Default::default() };
    let cfg = shelfserve::config::engine::EngineConfig::builtin();
    let e = start_engine(bundle, cfg, EngineOptions { device, served_model_name: "t".into() }).await.err().unwrap();
    assert!(e.to_string().contains("does not divide the attention heads (4)"), "{e}");
}
