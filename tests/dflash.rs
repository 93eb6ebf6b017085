//! The DFlash / DFlash2 block drafter (`--speculative dflash:PATH`) against the reference
//! implementation (z-lab's `dflash` package, `scripts/gen_dflash_tiny.py`): fed the CPU backend's
//! tapped hidden states of the tiny llama target, it proposes exactly the reference's blocks, and
//! through the engine a drafted greedy reply equals the un-drafted one for every k.

mod common;

use common::argmax;
use common::dflash::{golden, path, target};

use std::sync::Arc;
use std::time::Duration;

use shelfserve::actors::{start_engine, Engine, EngineOptions};
use shelfserve::backend::{Backend, KvGeometry, SeqStep};
use shelfserve::config::engine::EngineConfig;
use shelfserve::generate::{any_cpu_backend, single_sequence_geometry, DeviceSelection, GenerateOptions, Runner};
use shelfserve::model::default_model::CacheDir;
use shelfserve::sampling::SamplingParams;
use shelfserve::spec::dflash::DFlashDrafter;
use shelfserve::spec::{DraftSource, HiddenChunk, SpeculativeMethod};

/// Runs the target over `tokens` at `start` and returns the taps as one chunk, plus the last row's
/// argmax.
fn target_step(b: &mut dyn Backend, tokens: &[u32], start: usize) -> (HiddenChunk, u32) {
    let table: Vec<u32> = (0..8).collect();
    let step = SeqStep { tokens, start_pos: start, block_table: &table, logits_rows: 1, state_slot: 0 };
    let logits = b.forward(&[step]).expect("target forward");
    let taps = b.take_hidden_taps().expect("taps");
    (HiddenChunk::from_taps(&taps, 0, start, tokens.len()), argmax(logits.last_row(0).unwrap()))
}

#[test]
fn dflash_and_dflash2_proposals_equal_the_reference() {
    let bundle = target();
    let cases = golden();
    for kind in ["dflash", "dflash2"] {
        let mut drafter = DFlashDrafter::open(&path(&format!("dflash/{kind}")), &bundle, 2).expect("open the drafter");
        assert_eq!(drafter.hidden_taps(), vec![0, 1]);
        let geom = KvGeometry { block_size: 16, num_blocks: 8, state_slots: 1 };
        let (mut b, _) = any_cpu_backend(&bundle, 2, geom).unwrap();
        b.set_hidden_taps(&drafter.hidden_taps()).unwrap();
        // Case 0: the prompt's states; case 1: three more tokens ran (as after a verification
        // that accepted two drafts), so the drafter's context cache grows incrementally.
        let mut fed = 0;
        for (ci, case) in cases.iter().enumerate() {
            let ctx = case.context.len() - 1;
            let (chunk, next) = target_step(b.as_mut(), &case.context[fed..ctx], fed);
            assert_eq!(next, case.context[ctx], "case {ci}: the target's greedy token is the anchor");
            drafter.extend(7, &case.context[drafter.len(7)..]);
            drafter.extend_hidden(7, vec![chunk]);
            fed = ctx;
            if let (Some(want), "dflash") = (&case.logits, kind) {
                let got = drafter.block_logits(7, 7).expect("block logits");
                let worst = got.iter().zip(want.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(worst < 1e-3, "case {ci}: draft logits differ from the reference by {worst}");
            }
            let want = if kind == "dflash" { &case.dflash } else { &case.dflash2 };
            assert_eq!(&drafter.propose(7, 7), want, "{kind} case {ci}");
            assert_eq!(drafter.propose(7, 3), want[..3].to_vec(), "{kind} case {ci}: k = 3 is the block's prefix");
        }
        drafter.forget(7);
        assert_eq!(drafter.sequences(), 0);
    }
}

#[test]
fn a_drafter_for_another_target_is_refused_with_the_reason() {
    let other = shelfserve::model::open(&path("hf/llama-tok"), &CacheDir::from_env()).expect("open llama-tok");
    let e = DFlashDrafter::open(&path("dflash/dflash"), &other, 1).err().expect("refused").to_string();
    assert!(e.contains("hidden size 64 / vocabulary 512 do not match the target's 32 / 49152"), "{e}");
    let e = DFlashDrafter::open("/nonexistent/drafter", &target(), 1).err().expect("refused").to_string();
    assert!(e.contains("not a directory"), "{e}");
}

#[test]
fn runner_with_dflash_drafts_equals_plain_generate() {
    let bundle = target();
    let opts = GenerateOptions {
        max_tokens: 40,
        sampling: SamplingParams::default(),
        eos_token_ids: vec![],
        prefill_chunk: 5,
    };
    let prompt: Vec<u32> = (0..12).map(|i| (i * 37 + 11) % 500 + 3).collect();
    let run = |drafter: Option<&mut DFlashDrafter>| {
        let geom = single_sequence_geometry(prompt.len() + opts.max_tokens + 8, 16);
        let mut runner = Runner::new(any_cpu_backend(&bundle, 2, geom).unwrap().0);
        let d = drafter.map(|d| (d as &mut dyn DraftSource, 7));
        runner.generate_drafted(&prompt, &opts, d, |_| true).unwrap().tokens.iter().map(|s| s.token).collect::<Vec<_>>()
    };
    let plain = run(None);
    for kind in ["dflash", "dflash2"] {
        let mut d = DFlashDrafter::open(&path(&format!("dflash/{kind}")), &bundle, 2).unwrap();
        assert_eq!(run(Some(&mut d)), plain, "{kind}");
    }
}

fn engine_config(method: SpeculativeMethod) -> EngineConfig {
    let mut cfg = EngineConfig::builtin();
    cfg.lanes = common::engine::free_drafting_lanes(&cfg, 0..=7, &method);
    cfg.scheduler.max_num_seqs = 48;
    cfg.scheduler.max_num_batched_tokens = 1024;
    cfg.scheduler.kv_pool_tokens = 16_384;
    cfg
}

async fn generate(engine: &Engine, lane: &str, prompt: &[u32]) -> Vec<u32> {
    common::engine::greedy_ids(engine, lane, prompt, 32).await
}

/// Through scheduler, drafter and executor: the target taps the drafter's layers, the drafter
/// proposes from them, and greedy replies equal the un-drafted ones for k = 1..=7, alone and all
/// at once; drafting really happened and is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dflash_drafted_greedy_equals_undrafted_through_the_engine() {
    drafted_equals_undrafted(1).await;
}

/// The same under tensor parallelism (2 CPU ranks): rank 0 taps the target for the drafter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dflash_under_tensor_parallelism_equals_undrafted() {
    drafted_equals_undrafted(2).await;
}

async fn drafted_equals_undrafted(tensor_parallel: usize) {
    let prompts: Vec<Vec<u32>> = vec![
        (0..24).map(|i| 3 + (i * 37) % 500).collect(),
        [10, 11, 12, 13, 14].repeat(5),
        (0..40).map(|i| 100 + (i * i) % 300).collect(),
        vec![1, 200, 7, 45, 300, 2, 9],
    ];
    let method = SpeculativeMethod::DFlash(path("dflash/dflash2"));
    let engine = start_engine(
        target(),
        engine_config(method),
        EngineOptions {
            device: DeviceSelection { tensor_parallel, ..Default::default() },
            served_model_name: "t".into(),
        },
    )
    .await
    .expect("start the engine");
    common::engine::wait_ready(&engine, Duration::from_secs(120)).await;
    let mut want = Vec::new();
    for p in &prompts {
        want.push(generate(&engine, "k0", p).await);
    }
    for k in 1..=7 {
        for (i, p) in prompts.iter().enumerate() {
            assert_eq!(generate(&engine, &format!("k{k}"), p).await, want[i], "prompt {i}, k {k}, alone");
        }
    }
    let mut tasks = Vec::new();
    for k in 0..=7 {
        for (i, p) in prompts.iter().enumerate() {
            let (engine, p): (Arc<Engine>, Vec<u32>) = (engine.clone(), p.clone());
            tasks.push(tokio::spawn(async move { (k, i, generate(&engine, &format!("k{k}"), &p).await) }));
        }
    }
    for t in tasks {
        let (k, i, got) = t.await.unwrap();
        assert_eq!(got, want[i], "prompt {i}, k {k}, concurrent");
    }
    let s = engine.stats().await.unwrap();
    eprintln!(
        "dflash2 (random weights), --tp {tensor_parallel}: drafted {} accepted {} over {} steps",
        s.drafted_tokens, s.accepted_tokens, s.steps
    );
    assert!(s.drafted_tokens > 100, "the DFlash drafter proposed too little: {s:?}");
    assert!(s.drafted_tokens > s.accepted_tokens, "no draft was rejected: {s:?}");
    assert_eq!(engine.drafter_sequences().await, Some(vec![0; 8]), "every sequence's drafter state was dropped");
}
