//! Engine helpers shared by the prefix-cache, spill and hybrid-cache tests: start an engine and
//! wait for its model, read and wait on the KV pool's stats, find the spill tier's page files,
//! and the concurrent-versus-solo exactness check.

use std::fmt::Debug;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use shelfserve::actors::kvpool::PoolStats;
use shelfserve::actors::{start_engine, Engine, EngineOptions, GenerationRequest, InferenceEngine, StreamEvent, Usage};
use shelfserve::config::engine::{EngineConfig, LaneConfig};
use shelfserve::kv::MissReason;
use shelfserve::model::ModelBundle;
use shelfserve::spec::SpeculativeMethod;

/// Starts an engine and waits until its model is loaded; a load slower than `patience` fails.
pub async fn start_ready(
    bundle: ModelBundle,
    cfg: EngineConfig,
    opts: EngineOptions,
    patience: Duration,
) -> Arc<Engine> {
    let e = start_engine(bundle, cfg, opts).await.expect("start the engine");
    wait_ready(&e, patience).await;
    e
}

/// Waits until the engine's model is loaded; a load slower than `patience` fails.
pub async fn wait_ready(e: &Engine, patience: Duration) {
    let t0 = Instant::now();
    while !e.is_ready() {
        if t0.elapsed() >= patience {
            // The engine's own reason, if loading failed, says more than the timeout.
            let probe = e.submit(GenerationRequest::greedy_fixed_length(&e.config().lanes[0].name, vec![1], 1));
            panic!("the model did not load within {patience:?}: {:?}", probe.err());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One lane `k{k}` per draft length in `ks`, copied from `cfg`'s first lane: `k0` does not
/// draft, the others draft up to k tokens with `method` (port 0, one priority).
pub fn draft_length_lanes(
    cfg: &EngineConfig,
    ks: impl IntoIterator<Item = usize>,
    method: &SpeculativeMethod,
) -> Vec<LaneConfig> {
    let template = &cfg.lanes[0];
    ks.into_iter()
        .map(|k| {
            let mut l = template.clone();
            l.name = format!("k{k}");
            l.port = 0;
            l.priority = 0;
            l.speculative = if k == 0 { SpeculativeMethod::None } else { method.clone() };
            l.num_speculative_tokens = k.max(1);
            l
        })
        .collect()
}

/// [`draft_length_lanes`] with drafting priced at nothing, so the adaptive draft length keeps
/// proposing even when the drafts (random weights) are rarely right.
pub fn free_drafting_lanes(
    cfg: &EngineConfig,
    ks: impl IntoIterator<Item = usize>,
    method: &SpeculativeMethod,
) -> Vec<LaneConfig> {
    let mut lanes = draft_length_lanes(cfg, ks, method);
    for l in &mut lanes {
        l.speculative_row_cost = Some(0.0);
        l.speculative_draft_cost = Some(0.0);
    }
    lanes
}

/// The ids of one greedy request of exactly `max_tokens` tokens on `lane`.
pub async fn greedy_ids(e: &Engine, lane: &str, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let mut events =
        e.submit(GenerationRequest::greedy_fixed_length(lane, prompt.to_vec(), max_tokens)).expect("admitted");
    let mut ids = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(60), events.recv()).await.expect("no event in 60 s") {
            Some(StreamEvent::Delta { tokens, .. }) => ids.extend(tokens.iter().map(|t| t.id)),
            Some(StreamEvent::Finished { .. }) => return ids,
            Some(StreamEvent::Error(e)) => panic!("request failed: {e}"),
            None => panic!("stream ended without a finish event"),
        }
    }
}

/// The spill tier on `dir` with a 1 GiB budget, or off.
pub fn set_spill(cfg: &mut EngineConfig, dir: Option<&Path>) {
    cfg.scheduler.spill_dir = dir.map(|p| p.display().to_string());
    cfg.scheduler.spill_budget = if dir.is_some() { 1 << 30 } else { 0 };
}

pub async fn pool_stats(e: &Engine) -> PoolStats {
    e.pool_stats().await.expect("pool stats")
}

/// Waits until the pool references no block and holds no sequence (releases reach the pool with
/// the next commit; the scheduler flushes them when idle), then checks that every block is free
/// or cached. Returns the idle stats for further checks.
pub async fn assert_pool_idle(e: &Engine) -> PoolStats {
    for _ in 0..100 {
        let s = pool_stats(e).await;
        if s.referenced_blocks == 0 && s.sequences == 0 {
            assert_eq!(s.free_blocks + s.evictable_blocks, s.num_blocks, "idle blocks are free or cached: {s:?}");
            return s;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the pool did not return to idle: {:?}", pool_stats(e).await);
}

/// Waits until the spill tier holds at least `pages` pages.
pub async fn wait_spilled(e: &Engine, pages: usize) -> PoolStats {
    for _ in 0..500 {
        let s = pool_stats(e).await;
        if s.spilled_pages >= pages {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("nothing was spilled: {:?}", pool_stats(e).await);
}

/// The page files (`*.kvpage`) in every model folder of a spill directory.
pub fn spill_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for model in std::fs::read_dir(dir).expect("spill dir") {
        for f in std::fs::read_dir(model.expect("entry").path()).expect("model dir") {
            let p = f.expect("entry").path();
            if p.extension().is_some_and(|x| x == "kvpage") {
                out.push(p);
            }
        }
    }
    out
}

/// Applies `damage` to every page file of a spill directory; there must be at least one.
pub fn damage_spill_files(dir: &Path, damage: impl Fn(&Path)) {
    let files = spill_files(dir);
    assert!(!files.is_empty(), "no page files to damage in {}", dir.display());
    for f in &files {
        damage(f);
    }
}

/// Asserts that the pool counted at least one spilled page as corrupt (`what`: the damage done).
pub fn assert_spilled_corrupt_counted(s: &PoolStats, what: &str) {
    assert!(
        s.counters.misses.get(&MissReason::SpilledCorrupt).copied().unwrap_or(0) >= 1,
        "{what}: counted as spilled_corrupt: {s:?}"
    );
}

/// Runs every prompt alone, then all of them at once: each concurrent reply must equal its solo
/// run, and at least `stem` of its prompt tokens must come from the prefix cache.
pub async fn assert_concurrent_replies_equal_solo<R, F, Fut>(e: &Arc<Engine>, prompts: &[Vec<u32>], stem: usize, run: F)
where
    R: PartialEq + Debug + Send + 'static,
    F: Fn(Arc<Engine>, Vec<u32>) -> Fut,
    Fut: Future<Output = (R, Usage)> + Send + 'static,
{
    let mut solo = Vec::new();
    for p in prompts {
        solo.push(run(Arc::clone(e), p.clone()).await.0);
    }
    let handles: Vec<_> = prompts.iter().map(|p| tokio::spawn(run(Arc::clone(e), p.clone()))).collect();
    for (i, h) in handles.into_iter().enumerate() {
        let (reply, usage) = h.await.expect("join");
        assert_eq!(reply, solo[i], "request {i} with a shared cached prefix differs from its solo run");
        assert!(usage.cached_tokens >= stem, "request {i}: the shared stem is cached ({})", usage.cached_tokens);
    }
}
