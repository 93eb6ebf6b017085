//! Prefix cache and spill for a hybrid model (`glm5_next`: KDA recurrent layers + MLA layers) on
//! the tiny transformers-saved checkpoint in `tests/fixtures/glm5/tiny`. A cached page carries the
//! KDA state at its end; a hit resumes from the last hit page's snapshot. Every reply is compared
//! token for token with the reply of an engine that has nothing cached (exactness rule 2), and the
//! backend-level test shows that resuming from the wrong page's snapshot really changes the output
//! (so the engine-level comparisons can fail).

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::engine::{
    assert_concurrent_replies_equal_solo, assert_pool_idle, assert_spilled_corrupt_counted, damage_spill_files,
    pool_stats as stats, set_spill, start_ready, wait_spilled,
};
use shelfserve::actors::{Engine, EngineOptions, InferenceEngine, StreamEvent, Usage};
use shelfserve::backend::cpu::glm5_next::Glm5Backend;
use shelfserve::backend::{Backend, KvGeometry, SeqStep};
use shelfserve::config::engine::EngineConfig;
use shelfserve::generate::DeviceSelection;
use shelfserve::model::default_model::CacheDir;
use shelfserve::model::glm5_next::read_config;
use shelfserve::model::ModelBundle;

const BLOCK: usize = 4;
const PAGE: usize = 8;
const VOCAB: u32 = 256;

fn open_tiny() -> ModelBundle {
    let dir = common::fixture("glm5/tiny");
    shelfserve::model::open(dir.to_str().expect("utf-8"), &CacheDir::from_env()).expect("open the tiny glm5")
}

/// Token ids below the tiny model's vocabulary.
fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 1 + (seed * 7919 + i * 104_729) % (VOCAB - 1)).collect()
}

async fn engine(pool_tokens: usize, spill_dir: Option<&Path>) -> Arc<Engine> {
    engine_with(pool_tokens, spill_dir, false).await
}

/// `drafted`: every lane drafts with the n-gram drafter, 7 tokens a step.
async fn engine_with(pool_tokens: usize, spill_dir: Option<&Path>, drafted: bool) -> Arc<Engine> {
    let mut cfg = EngineConfig::builtin();
    if drafted {
        for l in cfg.lanes.iter_mut() {
            l.speculative = shelfserve::spec::SpeculativeMethod::Ngram;
            l.num_speculative_tokens = 7;
        }
    }
    cfg.scheduler.block_size = BLOCK;
    cfg.scheduler.page_tokens = PAGE;
    cfg.scheduler.kv_pool_tokens = pool_tokens;
    set_spill(&mut cfg, spill_dir);
    let opts =
        EngineOptions { device: DeviceSelection { threads: 2, ..Default::default() }, served_model_name: "t".into() };
    start_ready(open_tiny(), cfg, opts, Duration::from_secs(60)).await
}

/// Bytes of one recurrent-state snapshot of the tiny model.
fn slot_bytes() -> usize {
    let bundle = open_tiny();
    let cfg = read_config(bundle.weights.origin()).expect("config");
    let geom = KvGeometry { block_size: BLOCK, num_blocks: 1, state_slots: 1 };
    Glm5Backend::new(cfg, bundle.weights.as_ref(), 1, geom).expect("backend").state_slot_bytes()
}

/// A greedy reply: the tokens and, bit for bit, the log-probability each was chosen with (so two
/// replies are equal only if every logits row that chose them had the same value at the winner).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Reply {
    ids: Vec<u32>,
    logprob_bits: Vec<u32>,
}

async fn run(e: &Engine, prompt: Vec<u32>, max_tokens: usize) -> (Reply, Usage) {
    let mut req = common::greedy_request(prompt, max_tokens);
    req.sampling.logprobs = Some(0);
    let mut rx = e.submit(req).expect("submit");
    let mut reply = Reply { ids: Vec::new(), logprob_bits: Vec::new() };
    loop {
        match tokio::time::timeout(Duration::from_secs(120), rx.recv()).await.expect("no event in 120 s") {
            Some(StreamEvent::Delta { tokens, .. }) => {
                for t in tokens.iter() {
                    reply.ids.push(t.id);
                    reply.logprob_bits.push(t.logprob.expect("logprobs were asked for").to_bits());
                }
            }
            Some(StreamEvent::Finished { usage, .. }) => return (reply, usage),
            Some(StreamEvent::Error(err)) => panic!("request failed: {err}"),
            None => panic!("stream ended without Finished"),
        }
    }
}

/// The pool back to idle (see `assert_pool_idle`), holding one snapshot per cached page.
async fn assert_idle(e: &Engine) {
    let s = assert_pool_idle(e).await;
    assert_eq!(s.snapshot_bytes, s.cached_pages * slot_bytes(), "one snapshot per cached page: {s:?}");
}

/// The reply of an engine that has never seen anything (no cache, no spill).
async fn fresh_reply(prompt: &[u32], max_tokens: usize) -> Reply {
    let e = engine(512, None).await;
    let (reply, usage) = run(&e, prompt.to_vec(), max_tokens).await;
    assert_eq!(usage.cached_tokens, 0);
    e.shutdown();
    reply
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follow_up_turn_resumes_from_page_snapshots_and_equals_a_fresh_run() {
    let warm = engine(512, None).await;
    let first = prompt(1, 21);
    let (reply, usage) = run(&warm, first.clone(), 12).await;
    assert_eq!(usage.cached_tokens, 0);
    // Turn one computed 21 + 11 = 32 tokens: pages 0-1 were completed by prefill chunks, page 2
    // (16..24) and page 3 (24..32) while decoding. floor(32 / 8) = 4 pages.
    let follow = [first.clone(), reply.ids, prompt(2, 9)].concat();
    let (warm_reply, usage) = run(&warm, follow.clone(), 10).await;
    assert_eq!(usage.cached_tokens, 4 * PAGE, "exactly floor(32 / 8) pages reused");
    let s = stats(&warm).await;
    assert_eq!(s.counters.hit_tokens, 4 * PAGE as u64);
    assert_eq!(s.counters.unsnapshotted_pages, 0, "every page boundary was a step boundary");
    assert!(s.snapshot_bytes > 0, "pages hold their recurrent state: {s:?}");
    assert_idle(&warm).await;
    // The same prompt again: served up to the last whole page before its final token.
    let (again, usage) = run(&warm, follow.clone(), 10).await;
    assert_eq!(usage.cached_tokens, (follow.len() - 1) / PAGE * PAGE);
    assert_eq!(again, warm_reply, "a longer hit replies the same");
    assert_idle(&warm).await;
    warm.shutdown();

    assert_eq!(warm_reply, fresh_reply(&follow, 10).await, "a reply with a prefix hit equals a fresh run bitwise");
}

/// Drafting and the page cache together: verify runs stop at page ends, a page completed by a fully
/// accepted run is published with its snapshot, one completed by a partly rejected run is not;
/// either way the drafted follow-up with its hit equals a fresh undrafted run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drafted_turns_publish_pages_and_their_follow_up_equals_a_fresh_undrafted_run() {
    let warm = engine_with(512, None, true).await;
    // A repetitive prompt and a long reply (the tiny model falls into loops), so the n-gram
    // drafter has matches to propose.
    let first: Vec<u32> = prompt(3, 6).into_iter().cycle().take(30).collect();
    let (reply, _) = run(&warm, first.clone(), 60).await;
    assert_eq!(reply, fresh_reply(&first, 60).await, "a drafted first turn equals an undrafted one");
    let follow = [first.clone(), reply.ids, prompt(4, 9)].concat();
    let (warm_reply, usage) = run(&warm, follow.clone(), 10).await;
    let s = stats(&warm).await;
    let drafts = warm.stats().await.expect("scheduler stats");
    assert!(drafts.drafted_tokens > 0 && drafts.accepted_tokens > 0, "drafts were proposed and accepted: {drafts:?}");
    eprintln!(
        "drafted {} accepted {}; follow-up reused {} tokens, {} pages unsnapshotted",
        drafts.drafted_tokens, drafts.accepted_tokens, usage.cached_tokens, s.counters.unsnapshotted_pages
    );
    // Prefill published pages 0-2 (30 prompt tokens); a page completed while decoding is reused
    // only if it and every page before it got a snapshot.
    assert!(usage.cached_tokens >= 3 * PAGE, "the prefilled pages are reused: {usage:?} {s:?}");
    assert!(usage.cached_tokens <= (first.len() + 59) / PAGE * PAGE, "no page beyond the first turn: {usage:?}");
    assert_idle(&warm).await;
    warm.shutdown();
    assert_eq!(warm_reply, fresh_reply(&follow, 10).await, "a drafted reply with a prefix hit equals a fresh run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_hybrid_requests_sharing_a_prefix_equal_their_solo_runs() {
    let e = engine(1024, None).await;
    let stem = prompt(3, 24);
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| [stem.clone(), prompt(10 + i, 3 + 5 * i as usize)].concat()).collect();
    assert_concurrent_replies_equal_solo(&e, &prompts, 24, |e, p| async move { run(&e, p, 8).await }).await;
    assert_idle(&e).await;
    e.shutdown();
}

/// Turn one, then two other prompts that push its pages out of a 96-token pool. Returns the
/// follow-up prompt.
async fn first_turn_then_evict(e: &Engine, first: &[u32]) -> Vec<u32> {
    let (reply, _) = run(e, first.to_vec(), 8).await;
    run(e, prompt(60, 70), 4).await;
    run(e, prompt(61, 70), 4).await;
    [first.to_vec(), reply.ids, prompt(50, 6)].concat()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hybrid_pages_spill_with_their_snapshots_restore_after_restarts_and_corruption_is_recomputed() {
    let first = prompt(1, 30);
    let dir = tempfile::tempdir().expect("tmp");
    let e = engine(96, Some(dir.path())).await;
    let follow = first_turn_then_evict(&e, &first).await;
    // Turn one computed 30 + 7 = 37 tokens: 4 whole pages, now on disk only.
    wait_spilled(&e, 4).await;
    let (reply, usage) = run(&e, follow.clone(), 10).await;
    assert_eq!(usage.cached_tokens, 4 * PAGE, "all four pages restored from disk with their snapshots");
    e.shutdown();
    drop(e);
    let reference = fresh_reply(&follow, 10).await;
    assert_eq!(reply, reference, "a reply restored from spill equals a fresh run");

    // A new engine on the same directory: the index and the snapshots in the page files survive.
    let e = engine(96, Some(dir.path())).await;
    assert!(stats(&e).await.spilled_pages >= 4, "the spill index survives a restart");
    let (reply, usage) = run(&e, follow.clone(), 10).await;
    assert_eq!(usage.cached_tokens, 4 * PAGE, "restored after the restart");
    assert_eq!(reply, reference, "a reply restored after a restart equals a fresh run");
    e.shutdown();
    drop(e);

    // Damage the files (the snapshot is the tail of each image, so truncation hits it): detected,
    // counted, recomputed, same reply.
    type Damage = fn(&Path);
    let damages: [(&str, Damage); 2] = [
        ("flipped byte in the snapshot", |p| {
            // A file the spill tier of the stopped engine dropped in the meantime is skipped.
            let Ok(mut b) = std::fs::read(p) else { return };
            let at = b.len() - 9;
            b[at] ^= 0x10;
            std::fs::write(p, b).expect("write");
        }),
        ("truncated", |p| {
            let Ok(b) = std::fs::read(p) else { return };
            std::fs::write(p, &b[..b.len() - 5]).expect("write");
        }),
    ];
    for (what, damage) in damages {
        let e = engine(96, Some(dir.path())).await;
        first_turn_then_evict(&e, &first).await;
        wait_spilled(&e, 4).await;
        e.shutdown();
        drop(e);
        damage_spill_files(dir.path(), damage);
        let e = engine(96, Some(dir.path())).await;
        let (reply, usage) = run(&e, follow.clone(), 10).await;
        assert_eq!(reply, reference, "{what}: the damaged pages are recomputed, output unchanged");
        assert_eq!(usage.cached_tokens, 0, "{what}: nothing damaged is served");
        let s = stats(&e).await;
        assert_spilled_corrupt_counted(&s, what);
        assert_idle(&e).await;
        e.shutdown();
        drop(e);
    }
}

/// One sequence's greedy continuation on the backend directly, and the logits it was chosen from.
fn greedy(
    b: &mut Glm5Backend,
    table: &[u32],
    slot: u32,
    start: usize,
    first: &[u32],
    n: usize,
) -> (Vec<u32>, Vec<f32>) {
    let (mut pos, mut toks, mut out, mut all) = (start, first.to_vec(), Vec::new(), Vec::new());
    for _ in 0..n {
        let step = SeqStep { tokens: &toks, start_pos: pos, block_table: table, logits_rows: 1, state_slot: slot };
        let logits = b.forward(&[step]).expect("forward");
        let row: Vec<f32> = logits.rows(0).flatten().copied().collect();
        let next = row.iter().enumerate().fold(0, |best, (i, v)| if *v > row[best] { i } else { best }) as u32;
        all.extend(row);
        pos += toks.len();
        toks = vec![next];
        out.push(next);
    }
    (out, all)
}

/// What the engine does on a hit, done by hand: a second sequence shares the first one's page
/// blocks and gets a page-end snapshot written into its slot. With the snapshot of the last hit
/// page it continues bitwise like a fresh run; with the previous page's snapshot (the bug the
/// engine must never have) its logits and its greedy continuation change.
#[test]
fn resuming_from_the_wrong_pages_snapshot_changes_the_output() {
    let bundle = open_tiny();
    let cfg = read_config(bundle.weights.origin()).expect("config");
    let geom = KvGeometry { block_size: BLOCK, num_blocks: 64, state_slots: 3 };
    let mut b = Glm5Backend::new(cfg, bundle.weights.as_ref(), 2, geom).expect("backend");
    let p = prompt(5, 3 * PAGE);
    let tail = prompt(6, 5);
    let owner: Vec<u32> = (0..16).collect();
    // The owner prefills three pages chunk by chunk, snapshotting its slot at each page end.
    let mut snaps = Vec::new();
    for (i, chunk) in p.chunks(PAGE).enumerate() {
        let step = SeqStep { tokens: chunk, start_pos: i * PAGE, block_table: &owner, logits_rows: 0, state_slot: 0 };
        b.forward(&[step]).expect("prefill");
        snaps.push(b.read_state_slot(0).expect("snapshot"));
    }
    assert_ne!(snaps[1], snaps[2], "the state moves from page to page");
    // Fresh: the whole prompt + tail in its own blocks and slot.
    let fresh_table: Vec<u32> = (16..32).collect();
    let (fresh, fresh_logits) = greedy(&mut b, &fresh_table, 1, 0, &[p.clone(), tail.clone()].concat(), 8);
    // Hits: the owner's three page blocks shared, the rest private, slot 2 restored.
    let hit_table: Vec<u32> = owner[..3 * PAGE / BLOCK].iter().copied().chain(32..48).collect();
    b.write_state_slot(2, &snaps[2]).expect("restore");
    let (right, right_logits) = greedy(&mut b, &hit_table, 2, 3 * PAGE, &tail, 8);
    assert_eq!(right, fresh, "the last hit page's snapshot resumes exactly");
    assert!(right_logits.iter().zip(&fresh_logits).all(|(a, c)| a.to_bits() == c.to_bits()), "bitwise equal logits");
    b.write_state_slot(2, &snaps[1]).expect("restore the wrong page's state");
    let (wrong, wrong_logits) = greedy(&mut b, &hit_table, 2, 3 * PAGE, &tail, 8);
    assert!(right_logits.iter().zip(&wrong_logits).any(|(a, c)| a.to_bits() != c.to_bits()), "logits change");
    assert_ne!(wrong, fresh, "the wrong page's snapshot changes the greedy continuation");
}

/// Prefill chunks cross page boundaries: the backend keeps the KDA state at the page ends inside
/// a chunk (`mark_state_snapshots`), and those images are bitwise the ones a step ending exactly on
/// each boundary leaves in the slot, so pages published from them resume exactly.
#[test]
fn state_snapshots_inside_a_chunk_equal_the_state_at_a_step_boundary() {
    let bundle = open_tiny();
    let cfg = read_config(bundle.weights.origin()).expect("config");
    let geom = KvGeometry { block_size: BLOCK, num_blocks: 64, state_slots: 2 };
    let mut b = Glm5Backend::new(cfg, bundle.weights.as_ref(), 2, geom).expect("backend");
    assert!(b.snapshots_inside_step());
    let p = prompt(7, 3 * PAGE + 3);
    // Page by page, reading the slot at each page end.
    let paged: Vec<u32> = (0..16).collect();
    let mut at_ends = Vec::new();
    for (i, chunk) in p.chunks(PAGE).enumerate() {
        let step = SeqStep { tokens: chunk, start_pos: i * PAGE, block_table: &paged, logits_rows: 0, state_slot: 0 };
        b.forward(&[step]).expect("prefill");
        if chunk.len() == PAGE {
            at_ends.push(b.read_state_slot(0).expect("snapshot"));
        }
    }
    // One chunk over the whole prompt, the three page ends marked inside it.
    let whole: Vec<u32> = (16..32).collect();
    b.mark_state_snapshots(1, &[PAGE, 2 * PAGE, 3 * PAGE]).expect("mark");
    let step = SeqStep { tokens: &p, start_pos: 0, block_table: &whole, logits_rows: 1, state_slot: 1 };
    b.forward(&[step]).expect("prefill");
    let inside = b.take_state_snapshots(1);
    assert_eq!(inside.len(), 3);
    assert_ne!(at_ends[0], at_ends[1], "the state moves from page to page");
    for (i, (a, c)) in inside.iter().zip(&at_ends).enumerate() {
        assert!(a == c, "page {i}: the state marked inside the chunk differs from the step-end state");
    }
    assert!(b.take_state_snapshots(1).is_empty(), "marks are for one step");
    // A mark at or past the step's end is never filled: nothing is handed out for it.
    b.mark_state_snapshots(1, &[PAGE, 4 * PAGE]).expect("mark");
    let step = SeqStep { tokens: &p[..PAGE + 1], start_pos: 0, block_table: &whole, logits_rows: 1, state_slot: 1 };
    b.forward(&[step]).expect("prefill");
    assert!(b.take_state_snapshots(1).is_empty());
    assert!(b.mark_state_snapshots(1, &[2 * PAGE, PAGE]).is_err(), "offsets must ascend");
}

/// Issue 4: the disk stops taking spill writes while pages are being spilled. (It used to be a
/// link to `/dev/full` at the index's temporary name, for a real ENOSPC; since issue 23 the spill
/// tier never opens a file through a link, so that no longer reaches the disk.) A directory sits
/// at the index's temporary name: it cannot be unlinked as a file nor created over, so the index
/// write that follows the page writes fails with a real I/O error. Spill turns off with a
/// warning, nothing written before is ever offered for restore, and serving continues with replies
/// equal to a fresh run.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spill_write_that_fails_turns_spill_off_and_serving_continues() {
    let first = prompt(1, 30);
    let dir = tempfile::tempdir().expect("tmp");
    let e = engine(96, Some(dir.path())).await;
    let model_dir = std::fs::read_dir(dir.path()).expect("spill dir").next().expect("a model dir").expect("entry");
    std::fs::create_dir(model_dir.path().join("index.kvidx.tmp")).expect("a directory at the index's temp name");
    let follow = first_turn_then_evict(&e, &first).await;
    // The evicted pages reached the spill tier, whose first write failed: it is off.
    let mut s = stats(&e).await;
    for _ in 0..200 {
        if s.counters.evictions > 0 && s.spilled_pages == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        s = stats(&e).await;
    }
    assert!(s.counters.evictions >= 4, "pages were evicted: {s:?}");
    assert_eq!(s.spilled_pages, 0, "nothing on a failing disk is restorable: {s:?}");
    let (reply, usage) = run(&e, follow.clone(), 10).await;
    assert_eq!(usage.cached_tokens, 0, "the evicted pages are recomputed");
    // More work after the failure: the engine keeps serving, and caching in memory.
    let (again, usage) = run(&e, follow.clone(), 10).await;
    assert!(usage.cached_tokens > 0, "the in-memory cache still works");
    assert_eq!(again, reply);
    assert_idle(&e).await;
    e.shutdown();
    drop(e);
    assert_eq!(reply, fresh_reply(&follow, 10).await, "served correctly after the disk filled");
}

/// The capacity card counts one recurrent-state snapshot per cached page, sized exactly like the
/// backend's slot image, and refuses a pool whose snapshots would not fit, naming the knobs.
#[test]
fn the_capacity_card_counts_snapshot_memory() {
    use shelfserve::capacity::{plan, Memory};
    use shelfserve::generate::ResolvedDevice;
    let mut s = EngineConfig::builtin().scheduler;
    (s.block_size, s.kv_pool_tokens, s.max_num_seqs) = (BLOCK, 512, 4);
    let unchecked = Memory::Host { available: None };
    let card = plan(&open_tiny(), &ResolvedDevice::cpu(1), &s, PAGE, unchecked).expect("card");
    assert_eq!(card.snapshot_bytes_per_page(), slot_bytes() as u64, "the card's snapshot is the backend's slot");
    assert_eq!(card.max_snapshot_bytes(), (512 / PAGE) as u64 * slot_bytes() as u64);
    let without = card.weight_bytes + card.kv_pool_bytes() + card.state_bytes();
    assert!(card.check_host_fits(Some(without + card.max_snapshot_bytes())).is_ok());
    let err = card.check_host_fits(Some(without + card.max_snapshot_bytes() - 1)).expect_err("snapshots do not fit");
    assert!(err.contains("--kv-pool-tokens") && err.contains("--page-tokens"), "{err}");
    let no_pages = plan(&open_tiny(), &ResolvedDevice::cpu(1), &s, 0, unchecked).expect("card");
    assert_eq!(no_pages.max_snapshot_bytes(), 0, "no pages, no snapshots");
}
