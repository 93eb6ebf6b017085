//! The spill tier in the real engine (default model, CPU backend): pages evicted from a small KV
//! pool go to disk and come back on a later prefix hit; the index survives an engine restart;
//! flipped bytes, truncated and deleted files, a FIFO and a symlink at a page path are detected,
//! counted and recomputed (the FIFO never hangs the request, the link's target is untouched); an
//! unusable spill directory leaves serving untouched. Every reply is compared, token for token, with the
//! reply of a fresh engine that has nothing cached (exactness rule 2).

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::engine::{
    assert_spilled_corrupt_counted, damage_spill_files, pool_stats as stats, set_spill, start_ready, wait_spilled,
};
use common::{run_greedy as run, synthetic_prompt as prompt};
use shelfserve::actors::{Engine, EngineOptions};
use shelfserve::config::engine::EngineConfig;

const PAGE: usize = 32;

async fn engine(spill_dir: Option<&Path>) -> Option<Arc<Engine>> {
    let bundle = common::open_default_model()?;
    let mut cfg = EngineConfig::builtin();
    cfg.scheduler.page_tokens = PAGE;
    // 32 blocks of 16: one long conversation and one more prompt evict the oldest pages.
    cfg.scheduler.kv_pool_tokens = 512;
    set_spill(&mut cfg, spill_dir);
    let opts = EngineOptions { device: Default::default(), served_model_name: "t".into() };
    Some(start_ready(bundle, cfg, opts, Duration::from_secs(120)).await)
}

struct Conversation {
    first: Vec<u32>,
    follow_up: Vec<u32>,
}

/// Turn one, then two other prompts that push turn one's pages out of the 512-token pool.
async fn first_turn_then_evict(e: &Engine, conv: &mut Conversation) {
    let (reply, _) = run(e, conv.first.clone(), 8).await;
    conv.follow_up = [conv.first.clone(), reply, prompt(50, 30)].concat();
    run(e, prompt(60, 300), 4).await;
    run(e, prompt(61, 300), 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spilled_pages_restore_survive_restarts_and_corruption_is_recomputed() {
    let Some(fresh) = engine(None).await else { return };
    let mut conv = Conversation { first: prompt(1, 150), follow_up: Vec::new() };
    first_turn_then_evict(&fresh, &mut conv).await;
    fresh.shutdown();
    drop(fresh);
    // The reference: the follow-up on an engine that has never seen the conversation.
    let Some(reference_engine) = engine(None).await else { return };
    let (reference, usage) = run(&reference_engine, conv.follow_up.clone(), 12).await;
    assert_eq!(usage.cached_tokens, 0);
    reference_engine.shutdown();

    let dir = tempfile::tempdir().expect("tmp");
    let Some(e) = engine(Some(dir.path())).await else { return };
    let mut conv2 = Conversation { first: conv.first.clone(), follow_up: Vec::new() };
    first_turn_then_evict(&e, &mut conv2).await;
    assert_eq!(conv2.follow_up, conv.follow_up, "greedy turn one is deterministic");
    let s = wait_spilled(&e, 4).await;
    eprintln!("after eviction: {s:?}");
    // Turn one computed 150 + 7 tokens: 4 whole pages, now on disk only.
    let (reply, usage) = run(&e, conv.follow_up.clone(), 12).await;
    assert_eq!(reply, reference, "a reply restored from spill equals a fresh run");
    assert_eq!(usage.cached_tokens, 4 * PAGE, "all four pages restored from disk");
    e.shutdown();
    drop(e);

    // A new engine on the same spill directory: the index was kept.
    let Some(e) = engine(Some(dir.path())).await else { return };
    assert!(stats(&e).await.spilled_pages >= 4, "the spill index survives a restart");
    let (reply, usage) = run(&e, conv.follow_up.clone(), 12).await;
    assert_eq!(reply, reference, "a reply restored after a restart equals a fresh run");
    assert!(usage.cached_tokens >= 4 * PAGE, "restored after the restart: {}", usage.cached_tokens);
    e.shutdown();
    drop(e);

    // Corrupt every spill file one way per restart: each is detected, counted, recomputed.
    type Damage = fn(&Path);
    let damages: [(&str, Damage); 5] = [
        ("flipped byte", |p| {
            let mut b = std::fs::read(p).expect("read");
            let mid = b.len() / 2;
            b[mid] ^= 0x01;
            std::fs::write(p, b).expect("write");
        }),
        ("truncated", |p| {
            let b = std::fs::read(p).expect("read");
            std::fs::write(p, &b[..b.len() - 7]).expect("write");
        }),
        ("deleted", |p| std::fs::remove_file(p).expect("delete")),
        // A FIFO without a writer would block a plain open forever: the request must complete.
        ("replaced by a FIFO", |p| {
            std::fs::remove_file(p).expect("delete");
            let c = std::ffi::CString::new(p.to_str().expect("utf-8")).expect("path");
            // SAFETY: a valid NUL-terminated path.
            assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
        }),
        ("replaced by a symlink", |p| {
            let target = victim_of(p);
            std::fs::copy(p, &target).expect("copy aside");
            std::fs::remove_file(p).expect("delete");
            std::os::unix::fs::symlink(&target, p).expect("symlink");
        }),
    ];
    for (what, damage) in damages {
        // Re-spill cleanly first (the previous round removed the damaged pages).
        let Some(e) = engine(Some(dir.path())).await else { return };
        first_turn_then_evict(&e, &mut Conversation { first: conv.first.clone(), follow_up: Vec::new() }).await;
        wait_spilled(&e, 4).await;
        e.shutdown();
        drop(e);
        // Damaged while the next engine runs (its index still lists the pages): caught at read.
        let Some(e) = engine(Some(dir.path())).await else { return };
        let damaged = common::engine::spill_files(dir.path());
        damage_spill_files(dir.path(), damage);
        let (reply, usage) = run(&e, conv.follow_up.clone(), 12).await;
        assert_eq!(reply, reference, "{what}: the damaged pages are recomputed, output unchanged");
        assert_eq!(usage.cached_tokens, 0, "{what}: nothing damaged is served");
        let s = stats(&e).await;
        assert_spilled_corrupt_counted(&s, what);
        if what == "replaced by a symlink" {
            for f in &damaged {
                // Links are removed unread when a restore meets them; their targets are untouched.
                let victim = victim_of(f);
                assert!(std::fs::metadata(&victim).expect("victim").len() > 0);
                std::fs::remove_file(victim).expect("clean up");
            }
        }
        e.shutdown();
        drop(e);
    }
}

/// Where the symlink damage copies a page file before linking to it: outside the spill
/// directory, as an attacker's target would be.
fn victim_of(page: &Path) -> std::path::PathBuf {
    let name = page.file_name().expect("name").to_string_lossy();
    std::env::temp_dir().join(format!("shelfserve-spill-victim-{}-{name}", std::process::id()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unusable_spill_directory_keeps_serving() {
    let tmp = tempfile::tempdir().expect("tmp");
    let not_a_dir = tmp.path().join("file");
    std::fs::write(&not_a_dir, b"x").expect("file");
    let Some(e) = engine(Some(&not_a_dir)).await else { return };
    let mut conv = Conversation { first: prompt(1, 150), follow_up: Vec::new() };
    first_turn_then_evict(&e, &mut conv).await;
    let (reply, _) = run(&e, conv.follow_up.clone(), 4).await;
    assert_eq!(reply.len(), 4, "serving continues with spill off");
    assert_eq!(stats(&e).await.spilled_pages, 0);
    e.shutdown();
}
