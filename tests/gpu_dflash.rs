//! The DFlash drafter with a CUDA target, on a real GPU (run by `scripts/gpu_dflash.sh`; ignored
//! in CI with the reason, never passed):
//! - the CUDA backend's hidden-state taps equal the CPU backend's (prefill, graph-replayed decode
//!   and verification steps);
//! - the drafter's forward pass on the device proposes what the CPU drafter and the reference
//!   (`tests/fixtures/dflash/golden.json`) propose, in f32, with its logits within 1e-3 of the
//!   reference's; a DFlash2 drafter stays on the CPU;
//! - drafted greedy output equals undrafted on CUDA, through the runner and through the engine, in
//!   f32 and bf16.
//!
//! Each test prints one `TABLE|…` line; the script collects them.

mod common;

use common::argmax;
use common::dflash::{golden, path, target};

use std::time::Duration;

use shelfserve::actors::{start_engine, Engine, EngineOptions};
use shelfserve::backend::cuda::{CudaBackend, CudaOptions, Precision};
use shelfserve::backend::{Backend, KvGeometry, SeqStep};
use shelfserve::config::engine::EngineConfig;
use shelfserve::generate::{any_cpu_backend, single_sequence_geometry, DeviceKind, DeviceSelection, Runner};
use shelfserve::model::ModelBundle;
use shelfserve::spec::dflash::{DFlashCudaOptions, DFlashDrafter};
use shelfserve::spec::{DraftSource, HiddenChunk, SpeculativeMethod};

fn cuda(bundle: &ModelBundle, kv: KvGeometry, precision: Precision) -> Box<dyn Backend> {
    let opts = CudaOptions { ordinal: 0, kv, precision };
    Box::new(CudaBackend::new(&bundle.config, bundle.weights.as_ref(), opts).expect("CUDA backend on cuda:0"))
}

fn on_gpu(precision: Precision) -> Option<DFlashCudaOptions> {
    Some(DFlashCudaOptions { ordinal: 0, precision })
}

fn worst_rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / (1.0 + y.abs())).fold(0f32, f32::max)
}

#[test]
#[ignore = "needs a CUDA device; run scripts/gpu_dflash.sh"]
fn cuda_taps_equal_cpu_taps() {
    let bundle = target();
    let geom = KvGeometry { block_size: 16, num_blocks: 8, state_slots: 1 };
    let (mut cpu, _) = any_cpu_backend(&bundle, 2, geom).unwrap();
    let mut gpu = cuda(&bundle, geom, Precision::F32);
    let table: Vec<u32> = (0..8).collect();
    let tokens: Vec<u32> = (0..20).map(|i| (i * 37 + 11) % 500 + 3).collect();
    // A prefill chunk, two decode steps (the second replays the captured graph), a 5-row
    // verification step, all tapping layers 1 and 0 (in that order).
    let steps: [(usize, usize); 4] = [(0, 11), (11, 1), (12, 1), (13, 5)];
    let mut worst = 0f32;
    for b in [cpu.as_mut(), gpu.as_mut()] {
        assert!(b.set_hidden_taps(&[2]).unwrap_err().to_string().contains("has 2 layers"));
        b.set_hidden_taps(&[1, 0]).unwrap();
    }
    for (start, n) in steps {
        let step = SeqStep {
            tokens: &tokens[start..start + n],
            start_pos: start,
            block_table: &table,
            logits_rows: n,
            state_slot: 0,
        };
        cpu.forward(&[step]).unwrap();
        gpu.forward(&[step]).unwrap();
        let (want, got) = (cpu.take_hidden_taps().unwrap(), gpu.take_hidden_taps().unwrap());
        assert!(gpu.take_hidden_taps().is_none(), "taking them leaves nothing");
        assert_eq!((got.layers.clone(), got.hidden, got.offsets.clone()), (want.layers, want.hidden, want.offsets));
        let w = worst_rel(&got.data, &want.data);
        assert!(w < 1e-4, "step at {start} (+{n}): CUDA taps differ from the CPU's by {w}");
        worst = worst.max(w);
    }
    gpu.set_hidden_taps(&[]).unwrap();
    let step = SeqStep { tokens: &tokens[18..19], start_pos: 18, block_table: &table, logits_rows: 1, state_slot: 0 };
    gpu.forward(&[step]).unwrap();
    assert!(gpu.take_hidden_taps().is_none(), "nothing recorded without taps");
    println!("TABLE|taps: CUDA f32 vs CPU (prefill, graph decode, verify)|ok|worst rel {worst:.2e}");
}

/// The reference's cases, fed from the CUDA target's taps, proposed by the CUDA drafter (f32).
#[test]
#[ignore = "needs a CUDA device; run scripts/gpu_dflash.sh"]
fn cuda_dflash_proposals_equal_the_cpu_drafter_and_the_reference() {
    let bundle = target();
    let cases = golden();
    let geom = KvGeometry { block_size: 16, num_blocks: 8, state_slots: 1 };
    let mut on_cuda = DFlashDrafter::open_on(&path("dflash/dflash"), &bundle, 2, on_gpu(Precision::F32)).unwrap();
    assert!(on_cuda.on_cuda());
    let mut on_cpu = DFlashDrafter::open(&path("dflash/dflash"), &bundle, 2).unwrap();
    let v2 = DFlashDrafter::open_on(&path("dflash/dflash2"), &bundle, 2, on_gpu(Precision::F32)).unwrap();
    assert!(!v2.on_cuda(), "DFlash2 stays on the CPU");
    let mut b = cuda(&bundle, geom, Precision::F32);
    b.set_hidden_taps(&on_cuda.hidden_taps()).unwrap();
    let table: Vec<u32> = (0..8).collect();
    let (mut fed, mut worst_ref, mut worst_cpu) = (0, 0f32, 0f32);
    for (ci, case) in cases.iter().enumerate() {
        let ctx = case.context.len() - 1;
        let step = SeqStep {
            tokens: &case.context[fed..ctx],
            start_pos: fed,
            block_table: &table,
            logits_rows: 1,
            state_slot: 0,
        };
        let logits = b.forward(&[step]).unwrap();
        assert_eq!(argmax(logits.last_row(0).unwrap()), case.context[ctx], "case {ci}: the anchor");
        let taps = b.take_hidden_taps().expect("taps");
        for d in [&mut on_cuda, &mut on_cpu] {
            d.extend(7, &case.context[d.len(7)..]);
            d.extend_hidden(7, vec![HiddenChunk::from_taps(&taps, 0, fed, ctx - fed)]);
        }
        fed = ctx;
        let got = on_cuda.block_logits(7, 7).expect("CUDA block logits");
        let cpu = on_cpu.block_logits(7, 7).expect("CPU block logits");
        worst_cpu = worst_cpu.max(got.iter().zip(&cpu).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max));
        if let Some(want) = &case.logits {
            let w = got.iter().zip(want.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(w < 1e-3, "case {ci}: CUDA draft logits differ from the reference by {w}");
            worst_ref = worst_ref.max(w);
        }
        assert_eq!(on_cuda.propose(7, 7), case.dflash, "case {ci}: CUDA proposals");
        assert_eq!(on_cpu.propose(7, 7), case.dflash, "case {ci}: CPU proposals");
        assert_eq!(on_cuda.propose(7, 3), case.dflash[..3].to_vec(), "case {ci}: k = 3 is the prefix");
    }
    // Truncation drops context rows on the device too: after rolling back to the first case's
    // context and feeding the same rows again, the proposals are the same.
    let first = cases[0].context.len();
    on_cuda.truncate(7, first);
    on_cpu.truncate(7, first);
    assert_eq!(on_cuda.propose(7, 7), on_cpu.propose(7, 7), "after truncation");
    on_cuda.forget(7);
    assert_eq!(on_cuda.sequences(), 0);
    assert!(worst_cpu < 1e-3, "CUDA and CPU draft logits differ by {worst_cpu}");
    println!(
        "TABLE|dflash f32: CUDA proposals = CPU = reference|ok|logits vs ref {worst_ref:.2e}, vs CPU {worst_cpu:.2e}"
    );
}

fn runner_case(precision: Precision) {
    let bundle = target();
    let opts = common::greedy_options(40, 5);
    let prompts: [Vec<u32>; 2] = [(0..12).map(|i| (i * 37 + 11) % 500 + 3).collect(), [10, 11, 12, 13, 14].repeat(4)];
    for prompt in &prompts {
        let run = |drafter: Option<&mut DFlashDrafter>| {
            let geom = single_sequence_geometry(prompt.len() + opts.max_tokens + 8, 16);
            let mut runner = Runner::new(cuda(&bundle, geom, precision));
            let d = drafter.map(|d| (d as &mut dyn DraftSource, 7));
            let out = runner.generate_drafted(prompt, &opts, d, |_| true).unwrap();
            out.tokens.iter().map(|s| s.token).collect::<Vec<_>>()
        };
        let plain = run(None);
        let mut d = DFlashDrafter::open_on(&path("dflash/dflash"), &bundle, 2, on_gpu(precision)).unwrap();
        assert!(d.on_cuda());
        assert_eq!(run(Some(&mut d)), plain, "{precision:?}");
    }
    println!("TABLE|runner {precision:?}: dflash on CUDA drafted = undrafted|ok|2 prompts x 40 tokens");
}

#[test]
#[ignore = "needs a CUDA device; run scripts/gpu_dflash.sh"]
fn runner_drafted_equals_undrafted_on_cuda_f32() {
    runner_case(Precision::F32);
}

#[test]
#[ignore = "needs a CUDA device; run scripts/gpu_dflash.sh"]
fn runner_drafted_equals_undrafted_on_cuda_bf16() {
    runner_case(Precision::Bf16);
}

fn engine_config(method: SpeculativeMethod) -> EngineConfig {
    let mut cfg = EngineConfig::builtin();
    cfg.lanes = common::engine::free_drafting_lanes(&cfg, [0, 3, 7], &method);
    cfg.scheduler.max_num_seqs = 32;
    cfg.scheduler.max_num_batched_tokens = 1024;
    cfg.scheduler.kv_pool_tokens = 16_384;
    cfg
}

async fn generate(engine: &Engine, lane: &str, prompt: &[u32]) -> Vec<u32> {
    common::engine::greedy_ids(engine, lane, prompt, 32).await
}

async fn engine_case(precision: Precision) {
    let prompts: Vec<Vec<u32>> = vec![
        (0..24).map(|i| 3 + (i * 37) % 500).collect(),
        [10, 11, 12, 13, 14].repeat(5),
        (0..40).map(|i| 100 + (i * i) % 300).collect(),
        vec![1, 200, 7, 45, 300, 2, 9],
    ];
    let device = DeviceSelection { kind: DeviceKind::Cuda, cuda_precision: precision, ..Default::default() };
    let engine = start_engine(
        target(),
        engine_config(SpeculativeMethod::DFlash(path("dflash/dflash"))),
        EngineOptions { device, served_model_name: "t".into() },
    )
    .await
    .expect("start the engine on cuda:0");
    common::engine::wait_ready(&engine, Duration::from_secs(180)).await;
    let mut want = Vec::new();
    for p in &prompts {
        want.push(generate(&engine, "k0", p).await);
    }
    for k in [3, 7] {
        for (i, p) in prompts.iter().enumerate() {
            assert_eq!(generate(&engine, &format!("k{k}"), p).await, want[i], "{precision:?} prompt {i}, k {k}, alone");
        }
    }
    let mut tasks = Vec::new();
    for k in [0, 3, 7] {
        for (i, p) in prompts.iter().enumerate() {
            let (engine, p) = (engine.clone(), p.clone());
            tasks.push(tokio::spawn(async move { (k, i, generate(&engine, &format!("k{k}"), &p).await) }));
        }
    }
    for t in tasks {
        let (k, i, got) = t.await.unwrap();
        assert_eq!(got, want[i], "{precision:?} prompt {i}, k {k}, concurrent");
    }
    let s = engine.stats().await.unwrap();
    assert!(s.drafted_tokens > 100, "the DFlash drafter proposed too little: {s:?}");
    assert_eq!(engine.drafter_sequences().await, Some(vec![0; 3]), "every sequence's drafter state was dropped");
    println!(
        "TABLE|engine {precision:?}: dflash drafted = undrafted (alone + concurrent)|ok|drafted {} accepted {} steps {}",
        s.drafted_tokens, s.accepted_tokens, s.steps
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA device; run scripts/gpu_dflash.sh"]
async fn engine_drafted_equals_undrafted_on_cuda_f32() {
    engine_case(Precision::F32).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA device; run scripts/gpu_dflash.sh"]
async fn engine_drafted_equals_undrafted_on_cuda_bf16() {
    engine_case(Precision::Bf16).await;
}
