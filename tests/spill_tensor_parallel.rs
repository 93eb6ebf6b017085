//! The spill tier under tensor parallelism with one executor per rank (`--tp 2` of a llama-family
//! model in one process; `tests/cluster.rs` covers ranks in other processes). Each rank's KV
//! memory holds only its KV heads' slice of a page: evicted pages are joined from both ranks'
//! slices into one file, and a restore writes each rank its slice back.
//! - Pages evicted from a small pool are restored from disk (the whole prefix cached), and the
//!   reply equals a fresh TP=2 run token for token and logprob bit for bit, and TP=1's tokens; the
//!   spill index survives a restart and serves again.
//! - A TP=1 or TP=4 engine on the TP=2 spill directory finds nothing to restore (the KV layout
//!   names the group, so page identities and folders differ): a clean miss, never wrong KV.
//! - A drained shutdown (`Engine::drain`) writes every cached page of both ranks and syncs before
//!   it answers; a restarted engine serves the conversation from disk.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::engine::{pool_stats, set_spill, spill_files, start_ready, wait_spilled};
use shelfserve::actors::{Engine, EngineOptions, GenerationRequest, InferenceEngine, StreamEvent};
use shelfserve::config::engine::EngineConfig;
use shelfserve::generate::{DeviceKind, DeviceSelection};
use shelfserve::model::default_model::CacheDir;

const PAGE: usize = 32;

async fn engine(tp: usize, pool_tokens: usize, spill_dir: Option<&Path>) -> Arc<Engine> {
    let dir = common::fixture("hf/llama3-tiny"); // 4 heads, 2 kv heads: one kv head per rank at TP=2
    let bundle = shelfserve::model::open(dir.to_str().expect("utf-8"), &CacheDir::from_env()).expect("fixture");
    let mut cfg = EngineConfig::builtin();
    cfg.scheduler.page_tokens = PAGE;
    cfg.scheduler.kv_pool_tokens = pool_tokens;
    set_spill(&mut cfg, spill_dir);
    let device = DeviceSelection { kind: DeviceKind::Cpu, threads: 2, tensor_parallel: tp, ..Default::default() };
    start_ready(bundle, cfg, EngineOptions { device, served_model_name: "t".into() }, Duration::from_secs(120)).await
}

/// A prompt below the fixture's 512-token vocabulary.
fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 3 + (seed * 101 + i * 37) % 500).collect()
}

/// Greedy ids, each token's logprob bits, and the prompt tokens served from the prefix cache.
async fn run(e: &Engine, prompt: Vec<u32>, max_tokens: usize) -> (Vec<u32>, Vec<u32>, usize) {
    let mut req = GenerationRequest::greedy_fixed_length("voice", prompt, max_tokens);
    req.sampling.logprobs = Some(0);
    let mut rx = e.submit(req).expect("submit");
    let (mut ids, mut bits) = (Vec::new(), Vec::new());
    loop {
        match tokio::time::timeout(Duration::from_secs(120), rx.recv()).await.expect("no event in 120 s") {
            Some(StreamEvent::Delta { tokens, .. }) => {
                ids.extend(tokens.iter().map(|t| t.id));
                bits.extend(tokens.iter().map(|t| t.logprob.expect("logprobs asked for").to_bits()));
            }
            Some(StreamEvent::Finished { usage, .. }) => return (ids, bits, usage.cached_tokens),
            Some(StreamEvent::Error(err)) => panic!("request failed: {err}"),
            None => panic!("stream ended without Finished"),
        }
    }
}

/// Turn one (150 prompt tokens: four whole pages once its reply is in) and the follow-up prompt.
async fn first_turn(e: &Engine) -> Vec<u32> {
    let first = prompt(1, 150);
    let (reply, _, _) = run(e, first.clone(), 8).await;
    [first, reply, prompt(50, 30)].concat()
}

/// Two other prompts that push turn one's pages out of a 256-token pool.
async fn evict(e: &Engine) {
    run(e, prompt(60, 200), 4).await;
    run(e, prompt(61, 200), 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tp2_pages_spill_from_every_rank_restore_exactly_and_other_group_shapes_miss() {
    // References: the follow-up on engines that never saw the conversation.
    let tp1 = engine(1, 256, None).await;
    let follow_up = first_turn(&tp1).await;
    tp1.shutdown();
    let tp1 = engine(1, 256, None).await;
    let (tp1_ids, _, cached) = run(&tp1, follow_up.clone(), 12).await;
    assert_eq!(cached, 0);
    tp1.shutdown();
    let fresh = engine(2, 256, None).await;
    let (fresh_ids, fresh_bits, cached) = run(&fresh, follow_up.clone(), 12).await;
    assert_eq!(cached, 0);
    assert_eq!(fresh_ids, tp1_ids, "TP=2 serves what TP=1 serves");
    fresh.shutdown();

    let dir = tempfile::tempdir().expect("tmp");
    let e = engine(2, 256, Some(dir.path())).await;
    assert_eq!(first_turn(&e).await, follow_up, "greedy turn one is deterministic");
    evict(&e).await;
    let s = wait_spilled(&e, 4).await;
    assert!(s.counters.evictions >= 4, "turn one's pages were evicted: {s:?}");
    let (ids, bits, cached) = run(&e, follow_up.clone(), 12).await;
    let s = pool_stats(&e).await;
    assert_eq!(cached, 4 * PAGE, "all four pages restored from both ranks' slices on disk: {s:?}");
    assert!(s.counters.restores_chosen >= 1, "{s:?}");
    assert_eq!(ids, fresh_ids, "a reply restored from spill equals a fresh run");
    assert_eq!(bits, fresh_bits, "and its logprobs bit for bit");
    e.shutdown();
    drop(e);

    // The same group on the same directory after a restart: the index was kept.
    let e = engine(2, 256, Some(dir.path())).await;
    assert!(pool_stats(&e).await.spilled_pages >= 4, "the spill index survives a restart");
    let (ids, bits, cached) = run(&e, follow_up.clone(), 12).await;
    assert!(cached >= 4 * PAGE, "restored after the restart: {cached}");
    assert_eq!((ids, bits), (fresh_ids.clone(), fresh_bits.clone()), "restored after a restart");
    e.shutdown();
    drop(e);

    // Other group shapes on the TP=2 directory: nothing of it is theirs to restore.
    for tp in [1, 4] {
        let e = engine(tp, 256, Some(dir.path())).await;
        assert_eq!(pool_stats(&e).await.spilled_pages, 0, "tp={tp} sees none of the TP=2 pages");
        let (ids, _, cached) = run(&e, follow_up.clone(), 12).await;
        assert_eq!(cached, 0, "tp={tp}: a clean miss");
        assert_eq!(ids, tp1_ids, "tp={tp}: recomputed, same tokens");
        let s = pool_stats(&e).await;
        assert!(!s.counters.misses.contains_key(&shelfserve::kv::MissReason::SpilledCorrupt), "tp={tp}: {s:?}");
        e.shutdown();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_tp2_engine_writes_both_ranks_slices_and_a_restart_serves_them() {
    let dir = tempfile::tempdir().expect("tmp");
    // A pool that never evicts: only the drain puts pages on disk.
    let e = engine(2, 2048, Some(dir.path())).await;
    let conversation = prompt(7, 200);
    let (first_ids, first_bits, _) = run(&e, conversation.clone(), 8).await;
    assert!(spill_files(dir.path()).is_empty(), "nothing was evicted, so nothing is on disk yet");
    let report = e.drain(Duration::from_secs(60)).await;
    assert!(report.flushed, "every rank's slices were joined, written and synced before the answer");
    assert!(spill_files(dir.path()).len() >= 6, "200 prompt tokens: six whole pages on disk");
    e.shutdown();
    drop(e);

    let e = engine(2, 2048, Some(dir.path())).await;
    let (ids, bits, cached) = run(&e, conversation, 8).await;
    assert!(cached >= 6 * PAGE, "served from disk after the restart: {cached}");
    assert_eq!((ids, bits), (first_ids, first_bits), "same reply from disk");
    e.shutdown();
}
