//! The prefix cache in the real engine (default model, CPU backend, scheduler + KV pool actors),
//! driven through `InferenceEngine::submit`. Checked against references nobody here wrote:
//!
//! - reuse: a follow-up turn (the first turn's prompt and reply plus a new message) is served
//!   exactly `floor(shared computed prefix / page)` pages, reported as `usage.cached_tokens`;
//! - exactness (rule 2): the greedy reply of a request with a prefix hit equals, token for token,
//!   the reply of a fresh engine with an empty cache;
//! - no leaks: once idle, the pool references no block (free + cached == total).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::engine::{assert_concurrent_replies_equal_solo, assert_pool_idle as assert_idle, start_ready};
use common::{run_greedy as run, synthetic_prompt as prompt};
use shelfserve::actors::{Engine, EngineOptions};
use shelfserve::config::engine::EngineConfig;

const PAGE: usize = 32;

async fn engine(page_tokens: usize) -> Option<Arc<Engine>> {
    let bundle = common::open_default_model()?;
    let mut cfg = EngineConfig::builtin();
    cfg.scheduler.page_tokens = page_tokens;
    cfg.scheduler.kv_pool_tokens = 4096;
    let opts = EngineOptions { device: Default::default(), served_model_name: "t".into() };
    Some(start_ready(bundle, cfg, opts, Duration::from_secs(120)).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follow_up_turn_reuses_whole_pages_and_equals_a_fresh_run() {
    let Some(warm) = engine(PAGE).await else { return };
    let first_prompt = prompt(1, 150);
    let (reply, usage) = run(&warm, first_prompt.clone(), 12).await;
    assert_eq!(reply.len(), 12);
    assert_eq!(usage.cached_tokens, 0, "nothing cached yet");
    // Follow-up: first prompt + reply + new message. The first turn computed its prompt and all
    // but its last generated token: 150 + 11 = 161 tokens, so floor(161 / 32) = 5 pages.
    let mut follow = first_prompt.clone();
    follow.extend(&reply);
    follow.extend(prompt(2, 40));
    let (warm_reply, usage) = run(&warm, follow.clone(), 16).await;
    assert_eq!(usage.cached_tokens, 5 * PAGE, "exactly floor(161 / 32) pages reused");
    let stats = warm.pool_stats().await.expect("stats");
    assert_eq!(stats.counters.hit_tokens, 5 * PAGE as u64);
    assert_idle(&warm).await;

    // The same prompt again: now served up to its last whole page below the final token.
    let (again, usage) = run(&warm, follow.clone(), 16).await;
    assert_eq!(usage.cached_tokens, (follow.len() - 1) / PAGE * PAGE);
    assert_eq!(again, warm_reply, "a full hit replies the same");
    assert_idle(&warm).await;
    warm.shutdown();

    let Some(fresh) = engine(PAGE).await else { return };
    let (fresh_reply, usage) = run(&fresh, follow, 16).await;
    assert_eq!(usage.cached_tokens, 0);
    assert_eq!(warm_reply, fresh_reply, "a reply with a prefix hit equals a fresh run bitwise");
    fresh.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_sharing_a_prefix_equal_their_solo_runs() {
    let Some(e) = engine(PAGE).await else { return };
    let stem = prompt(3, 96);
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| [stem.clone(), prompt(10 + i, 20 + 7 * i as usize)].concat()).collect();
    assert_concurrent_replies_equal_solo(&e, &prompts, 96, |e, p| async move { run(&e, p, 8).await }).await;
    assert_idle(&e).await;
    e.shutdown();
}
