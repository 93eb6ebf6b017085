//! The MTP drafter (`--speculative mtp`) on the tiny glm5_next checkpoint with an MTP layer
//! (`tests/fixtures/glm5/tiny-mtp`, made by `scripts/gen_glm5_mtp.py`): its logits against the
//! reference computed with transformers' own one-layer text model, greedy replies drafted by it
//! equal the un-drafted ones bit for bit through the engine (every k, alone, concurrent, after a
//! prefix-cache hit), its acceptance is measured, and the unsupported setups are refused.

mod common;

use std::sync::Arc;
use std::time::Duration;

use shelfserve::actors::scheduler::SchedulerStats;
use shelfserve::actors::{start_engine, Engine, EngineOptions, GenerationRequest, InferenceEngine, StreamEvent};
use shelfserve::backend::{Backend, KvGeometry, SeqStep};
use shelfserve::config::engine::EngineConfig;
use shelfserve::generate::{any_cpu_backend, DeviceKind, DeviceSelection};
use shelfserve::model::default_model::CacheDir;
use shelfserve::model::ModelBundle;
use shelfserve::spec::mtp::MtpDrafter;
use shelfserve::spec::{DraftSource, HiddenChunk, SpeculativeMethod};

const BLOCK: usize = 4;
const PAGE: usize = 8;

fn open(rel: &str) -> ModelBundle {
    let dir = common::fixture(rel);
    shelfserve::model::open(dir.to_str().expect("utf-8"), &CacheDir::from_env()).expect("open the fixture")
}

fn tensor(st: &safetensors::SafeTensors<'_>, name: &str) -> (Vec<usize>, Vec<u8>) {
    let t = st.tensor(name).unwrap_or_else(|_| panic!("golden tensor {name}"));
    (t.shape().to_vec(), t.data().to_vec())
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// The target's last-layer taps over `ids` in chunks of `chunk` tokens (one sequence, slot 0).
fn target_taps(bundle: &ModelBundle, ids: &[u32], chunk: usize) -> Vec<HiddenChunk> {
    let geom = KvGeometry { block_size: BLOCK, num_blocks: 64, state_slots: 1 };
    let (mut b, _) = any_cpu_backend(bundle, 1, geom).expect("the target backend");
    let layers = shelfserve::model::glm5_next::read_config(bundle.weights.origin()).unwrap().num_hidden_layers;
    b.set_hidden_taps(&[layers - 1]).unwrap();
    let table: Vec<u32> = (0..64).collect();
    let mut out = Vec::new();
    for start in (0..ids.len()).step_by(chunk) {
        let toks = &ids[start..(start + chunk).min(ids.len())];
        let step = SeqStep { tokens: toks, start_pos: start, block_table: &table, logits_rows: 1, state_slot: 0 };
        b.forward(&[step]).expect("target forward");
        let taps = b.take_hidden_taps().expect("taps");
        out.push(HiddenChunk::from_taps(&taps, 0, start, toks.len()));
    }
    out
}

/// max |a - b| over max |b|: the relative error the brief bounds by 1e-4.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// The MTP logits of the fixture `variant` ("" or "-kda") against its reference: the whole
/// sequence at once, in uneven pieces (its own cache continues across calls), and in pieces with a
/// chained 7-token proposal after each (the chain's speculative positions must leave no trace:
/// the recurrent state is put back, the paged records are overwritten).
fn logits_equal_the_reference(variant: &str) {
    let bundle = open(&format!("glm5/tiny-mtp{variant}"));
    let golden = common::fixture(&format!("glm5/golden-mtp{variant}.safetensors"));
    let bytes = std::fs::read(golden).expect("the golden file");
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for case in 0..2 {
        let (_, raw) = tensor(&st, &format!("ids_{case}"));
        let ids: Vec<u32> = raw.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32).collect();
        let (shape, want) = tensor(&st, &format!("mtp_logits_{case}"));
        let want = f32s(&want);
        assert_eq!(shape[0], ids.len() - 1);
        let n = ids.len();
        for (chunk, pieces, propose) in
            [(n, vec![n], false), (7, vec![5, 13, n], false), (6, vec![4, 9, 10, 22, n], true)]
        {
            let mut d = MtpDrafter::open(&bundle, 1, 512).expect("the MTP drafter");
            d.extend_hidden(1, target_taps(&bundle, &ids, chunk));
            let mut got = Vec::new();
            let mut fed = 0;
            for &upto in &pieces {
                d.extend(1, &ids[fed..upto]);
                fed = upto;
                got.extend(d.commit_logits(1).expect("MTP logits"));
                if propose {
                    let drafts = d.propose(1, 7);
                    assert_eq!(drafts.len(), if upto > 1 { 7 } else { 0 }, "drafts after {upto} tokens");
                    assert_eq!(d.propose(1, 7), drafts, "the same state proposes the same drafts");
                }
            }
            let err = rel_err(&got, &want);
            eprintln!(
                "tiny-mtp{variant} case {case}, target chunks of {chunk}, pieces {pieces:?}: relative error {err:.2e}"
            );
            assert!(err <= 1e-4, "case {case}: MTP logits differ from the reference by {err:e} (relative)");
        }
    }
}

#[test]
fn mtp_logits_equal_the_reference() {
    logits_equal_the_reference("");
}

/// The same with a KDA mixer in the MTP block (recurrent state instead of paged records).
#[test]
fn kda_mtp_logits_equal_the_reference() {
    logits_equal_the_reference("-kda");
}

#[test]
fn checkpoints_without_an_mtp_layer_and_other_targets_are_refused() {
    let e = MtpDrafter::open(&open("glm5/tiny"), 1, 64).err().expect("refused").to_string();
    assert!(e.contains("no MTP layer") && e.contains("num_nextn_predict_layers"), "{e}");
    let e = MtpDrafter::open(&open("hf/llama3-tiny"), 1, 64).err().expect("refused").to_string();
    assert!(e.contains("needs a glm5_next checkpoint with an MTP layer"), "{e}");
    // config.json declares an MTP layer that the weights do not have.
    let dir = tempfile::tempdir().unwrap();
    let src = common::fixture("glm5/tiny");
    std::fs::copy(src.join("model.safetensors"), dir.path().join("model.safetensors")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg["text_config"]["num_nextn_predict_layers"] = 1.into();
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let bundle = shelfserve::model::open(dir.path().to_str().unwrap(), &CacheDir::from_env()).unwrap();
    let e = MtpDrafter::open(&bundle, 1, 64).err().expect("refused").to_string();
    assert!(e.contains("MTP layer 5") && e.contains("eh_proj.weight"), "{e}");
}

fn engine_config() -> EngineConfig {
    let mut cfg = EngineConfig::builtin();
    cfg.lanes = common::engine::free_drafting_lanes(&cfg, 0..=7, &SpeculativeMethod::Mtp);
    cfg.scheduler.block_size = BLOCK;
    cfg.scheduler.page_tokens = PAGE;
    cfg.scheduler.max_num_seqs = 40;
    cfg.scheduler.kv_pool_tokens = 8192;
    cfg
}

#[tokio::test]
async fn mtp_is_refused_on_cuda() {
    let opts = EngineOptions {
        device: DeviceSelection { kind: DeviceKind::Cuda, ..Default::default() },
        served_model_name: "t".into(),
    };
    let e = start_engine(open("glm5/tiny-mtp"), engine_config(), opts).await.err().expect("refused").to_string();
    assert!(e.contains("not supported on the CUDA backend yet") && e.contains("--speculative mtp"), "{e}");
}

/// A greedy reply: the ids and, bit for bit, each chosen token's log-probability, plus the
/// prompt tokens served from the prefix cache.
#[derive(Debug, PartialEq, Eq)]
struct Reply {
    ids: Vec<u32>,
    logprob_bits: Vec<u32>,
}

async fn generate(engine: &Engine, lane: &str, prompt: &[u32], max_tokens: usize) -> (Reply, usize) {
    let mut req = GenerationRequest::greedy_fixed_length(lane, prompt.to_vec(), max_tokens);
    req.sampling.logprobs = Some(0);
    let mut events = engine.submit(req).expect("admitted");
    let mut r = Reply { ids: Vec::new(), logprob_bits: Vec::new() };
    loop {
        match tokio::time::timeout(Duration::from_secs(120), events.recv()).await.expect("no event in 120 s") {
            Some(StreamEvent::Delta { tokens, .. }) => {
                for t in tokens.iter() {
                    r.ids.push(t.id);
                    r.logprob_bits.push(t.logprob.expect("logprobs were asked for").to_bits());
                }
            }
            Some(StreamEvent::Finished { usage, .. }) => return (r, usage.cached_tokens),
            Some(StreamEvent::Error(e)) => panic!("request failed: {e}"),
            None => panic!("stream ended without a finish event"),
        }
    }
}

/// Random prompts (the MTP layer was trained on the target's greedy continuations of such).
fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 1 + (seed * 7919 + i * 104_729 + i * i * 31) % 127).collect()
}

/// Greedy replies of every k-lane against the un-drafted lane on fixture `variant`: 4 prompts
/// alone for each k in `ks`, all of them at once, and a continuation whose prefix is served from
/// the prefix cache (so the target never runs, nor taps, those positions). Returns the engine's
/// counters after the "alone" runs and at the end, and the un-drafted replies.
async fn drafted_equals_undrafted(
    variant: &str,
    ks: &[usize],
    tensor_parallel: usize,
) -> (SchedulerStats, SchedulerStats, Vec<Reply>) {
    const TOKENS: usize = 40;
    let prompts: Vec<Vec<u32>> = vec![prompt(1, 12), prompt(2, 21), prompt(3, 9), prompt(4, 30)];
    let device = DeviceSelection { threads: 2, tensor_parallel, ..Default::default() };
    let opts = EngineOptions { device, served_model_name: "t".into() };
    let bundle = open(&format!("glm5/tiny-mtp{variant}"));
    let engine = start_engine(bundle, engine_config(), opts).await.expect("start the engine");
    common::engine::wait_ready(&engine, Duration::from_secs(120)).await;
    let mut want = Vec::new();
    for p in &prompts {
        want.push(generate(&engine, "k0", p, TOKENS).await.0);
    }
    for &k in ks {
        for (i, p) in prompts.iter().enumerate() {
            assert_eq!(generate(&engine, &format!("k{k}"), p, TOKENS).await.0, want[i], "prompt {i}, k {k}, alone");
        }
    }
    let alone = engine.stats().await.unwrap();
    let mut tasks = Vec::new();
    for k in 0..=7 {
        for (i, p) in prompts.iter().enumerate() {
            let (engine, p): (Arc<Engine>, Vec<u32>) = (engine.clone(), p.clone());
            tasks.push(tokio::spawn(async move { (k, i, generate(&engine, &format!("k{k}"), &p, TOKENS).await.0) }));
        }
    }
    for t in tasks {
        let (k, i, got) = t.await.unwrap();
        assert_eq!(got, want[i], "prompt {i}, k {k}, concurrent");
    }
    let mut longer = prompts[3].clone();
    longer.extend_from_slice(&want[3].ids[..20]);
    let (plain, _) = generate(&engine, "k0", &longer, TOKENS).await;
    for k in [3, 7] {
        let (got, cached) = generate(&engine, &format!("k{k}"), &longer, TOKENS).await;
        assert!(cached > 0, "k {k}: the prefix cache was not hit");
        assert_eq!(got, plain, "k {k}, after a prefix-cache hit");
    }
    let all = engine.stats().await.unwrap();
    assert_eq!(engine.drafter_sequences().await, Some(vec![0; 8]), "every sequence's drafter state was dropped");
    (alone, all, want)
}

/// Through scheduler, drafter and executor: the target taps its last layer, the MTP layer drafts
/// from it, greedy replies equal the un-drafted ones bit for bit, and drafts are accepted (the
/// fixture's MTP layer was trained on the target's own greedy continuations).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtp_drafted_greedy_equals_undrafted_through_the_engine() {
    let (alone, all, _) = drafted_equals_undrafted("", &[1, 2, 3, 4, 5, 6, 7], 1).await;
    let rate = alone.accepted_tokens as f64 / alone.drafted_tokens.max(1) as f64;
    eprintln!(
        "mtp on tiny-mtp: alone (k = 1..7, 28 replies) drafted {} accepted {} ({:.1}% of drafts); all runs: \
         drafted {} accepted {} over {} steps",
        alone.drafted_tokens,
        alone.accepted_tokens,
        100.0 * rate,
        all.drafted_tokens,
        all.accepted_tokens,
        all.steps
    );
    assert!(alone.drafted_tokens > 200, "the MTP drafter proposed too little: {alone:?}");
    assert!(alone.accepted_tokens > 0, "no MTP draft was ever accepted: {alone:?}");
    assert!(all.drafted_tokens > all.accepted_tokens, "no draft was rejected: {all:?}");
}

/// The KDA-block variant (random MTP layer: its drafts are rarely right, so every verification
/// rolls the target back and the MTP's recurrent state is restored after every chain).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kda_mtp_drafted_greedy_equals_undrafted_through_the_engine() {
    let (alone, all, _) = drafted_equals_undrafted("-kda", &[1, 4, 7], 1).await;
    eprintln!("mtp on tiny-mtp-kda: drafted {} accepted {}", all.drafted_tokens, all.accepted_tokens);
    assert!(alone.drafted_tokens > 100, "the MTP drafter proposed too little: {alone:?}");
}

/// Under tensor parallelism (2 CPU ranks, heads and experts split): rank 0 taps the target, the
/// MTP layer drafts beside the group, drafted replies equal the group's un-drafted ones bit for
/// bit, and the group's greedy ids equal one rank's (logits agree within the TP tolerance, so the
/// log-probabilities are compared only within one group size).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtp_under_tensor_parallelism_equals_undrafted_and_one_rank() {
    let (alone, _, tp2) = drafted_equals_undrafted("", &[1, 4, 7], 2).await;
    assert!(alone.accepted_tokens > 0, "no MTP draft was accepted under --tp 2: {alone:?}");
    let (_, _, tp1) = drafted_equals_undrafted("", &[], 1).await;
    for (i, (a, b)) in tp1.iter().zip(&tp2).enumerate() {
        assert_eq!(a.ids, b.ids, "prompt {i}: --tp 2 greedy ids differ from --tp 1");
    }
}
