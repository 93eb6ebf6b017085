//! Unit tests of recurrent-state snapshots in the pool (hybrid models): a page is published only
//! with the state at its end, a hit hands out exactly the last hit page's snapshot, and snapshots
//! leave memory with their pages.

use std::sync::Arc;

use super::*;
use crate::kv::{KvPoolConfig, MissReason, PoolIdentity, PrefixHit, SlotSnapshot};

const SNAP: usize = 12;

fn hybrid_pool(num_blocks: usize) -> KvPool {
    let ident = PoolIdentity { model_fingerprint: "hybrid".into(), kv_layout: "f32/b4".into(), rank: 0 };
    let cfg = KvPoolConfig { num_blocks, block_size: 4, page_tokens: 8, state_slots: 4, snapshot_bytes: SNAP };
    KvPool::new(cfg, &ident).expect("valid")
}

fn toks(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed * 1000 + i).collect()
}

/// A recognisable snapshot: every byte says which sequence and token count it was taken at.
fn snap(seq: SeqId, tokens: usize) -> SlotSnapshot {
    SlotSnapshot { seq, tokens, image: Arc::from(vec![(seq as u8) ^ (tokens as u8); SNAP]) }
}

/// Admits `seq` and computes `tokens` in steps of `chunks`, delivering a snapshot after every step
/// that ends on a page boundary (what the executor and scheduler do).
fn run_chunked(p: &mut KvPool, seq: SeqId, tokens: &[u32], chunks: &[usize]) -> PrefixHit {
    p.register(seq, tokens.to_vec()).expect("register");
    let hit = p.acquire_prefix(seq).expect("acquire");
    let mut at = hit.hit_tokens;
    for &c in chunks {
        p.grow(seq, at + c).expect("grow");
        at += c;
        if at.is_multiple_of(8) {
            p.add_snapshot(snap(seq, at)).expect("snapshot");
        }
        p.advance(seq, &[], at).expect("advance");
    }
    hit
}

#[test]
fn only_pages_with_a_snapshot_at_their_end_are_published() {
    let mut p = hybrid_pool(32);
    // Chunks 8 | 12 (crosses 16 without stopping there) | 4: pages 0 and 2 have snapshots.
    run_chunked(&mut p, 1, &toks(1, 24), &[8, 12, 4]);
    assert_eq!(p.counters().unsnapshotted_pages, 1);
    let chain = p.hasher().chain(&toks(1, 24), 8);
    assert!(p.contains_page(&chain[0]));
    assert!(!p.contains_page(&chain[1]), "page 1 ended inside a step: no snapshot, not published");
    assert!(p.contains_page(&chain[2]), "page 2 is published (reachable once page 1 is)");
    assert_eq!(p.page_snapshot(&chain[0]).map(|s| s[0]), Some(1 ^ 8));
    assert_eq!(p.page_snapshot(&chain[2]).map(|s| s[0]), Some(1 ^ 24));
    p.release(1);
    // A follow-up is served page 0 only and told to resume from page 0's state.
    p.register(2, toks(1, 30)).expect("register");
    let hit = p.acquire_prefix(2).expect("acquire");
    assert_eq!((hit.pages, hit.miss), (1, Some(MissReason::NoEntry)));
    let writes = p.take_state_writes();
    assert_eq!(writes.len(), 1);
    assert_eq!((writes[0].seq, writes[0].slot), (2, p.slot_of(2)));
    assert_eq!(&*writes[0].image, &[1 ^ 8; SNAP][..]);
    assert!(p.take_state_writes().is_empty(), "taken once");
    p.assert_accounting(&[]);
}

#[test]
fn a_hit_resumes_from_the_last_hit_page_not_an_earlier_or_later_one() {
    let mut p = hybrid_pool(32);
    // Decode-completed pages count too: one token per step.
    run_chunked(&mut p, 1, &toks(3, 32), &[1; 32]);
    p.release(1);
    for (len, pages) in [(9usize, 1usize), (17, 2), (25, 3), (33, 4), (32, 3)] {
        let seq = 10 + len as SeqId;
        let mut t = toks(3, 32);
        t.resize(len, 7);
        p.register(seq, t).expect("register");
        let hit = p.acquire_prefix(seq).expect("acquire");
        assert_eq!(hit.pages, pages, "prompt of {len}");
        let w = p.take_state_writes();
        assert_eq!(w.len(), 1);
        assert_eq!(&*w[0].image, &[1 ^ (pages * 8) as u8; SNAP][..], "prompt of {len}: wrong page's state");
        p.release(seq);
    }
    // No hit, no write.
    p.register(99, toks(9, 20)).expect("register");
    assert_eq!(p.acquire_prefix(99).expect("acquire").pages, 0);
    assert!(p.take_state_writes().is_empty());
    p.assert_accounting(&[]);
}

#[test]
fn snapshots_leave_with_evicted_pages_and_come_back_with_restores() {
    let mut p = hybrid_pool(8);
    run_chunked(&mut p, 1, &toks(1, 16), &[8, 8]);
    p.release(1);
    assert_eq!(p.snapshot_bytes_held(), 2 * SNAP);
    drop(p.allocate(8).expect("evicts both pages"));
    let mut evicted = p.take_evicted();
    evicted.sort_by_key(|e| e.parent.is_some());
    assert_eq!(evicted.len(), 2);
    assert!(evicted.iter().all(|e| e.snapshot.as_ref().is_some_and(|s| s.len() == SNAP)));
    p.reclaim();
    assert_eq!(p.snapshot_bytes_held(), 0, "evicted snapshots are not kept");
    // A restore without its snapshot, or with a short one, is a corrupt page.
    let (h0, h1) = (evicted[0].hash, evicted[1].hash);
    p.note_spilled(h0, None);
    p.begin_restore(h0, None).expect("room");
    p.finish_restore(h0, true, None);
    assert!(!p.contains_page(&h0));
    assert_eq!(p.counters().misses.get(&MissReason::SpilledCorrupt), Some(&1));
    p.begin_restore(h1, Some(h0)).expect("room");
    p.finish_restore(h1, true, Some(Arc::from(vec![0u8; SNAP - 1])));
    assert!(!p.contains_page(&h1));
    // With it, the page is served and its snapshot handed to the next hit.
    p.begin_restore(h0, None).expect("room");
    p.finish_restore(h0, true, evicted[0].snapshot.clone());
    p.register(2, toks(1, 12)).expect("register");
    assert_eq!(p.acquire_prefix(2).expect("acquire").pages, 1);
    assert_eq!(p.take_state_writes()[0].image, evicted[0].snapshot.clone().expect("snapshot"));
    p.release(2);
    p.assert_accounting(&[]);
}

#[test]
fn stale_wrong_and_orphan_snapshots_are_not_used() {
    let mut p = hybrid_pool(16);
    let t = toks(1, 17);
    p.register(1, t.clone()).expect("register");
    p.acquire_prefix(1).expect("acquire");
    p.grow(1, 16).expect("grow");
    assert!(p.add_snapshot(snap(1, 7)).is_err(), "not a page boundary");
    let short = SlotSnapshot { seq: 1, tokens: 8, image: Arc::from(vec![0u8; SNAP + 1]) };
    assert!(p.add_snapshot(short).is_err(), "wrong size");
    assert!(p.add_snapshot(snap(42, 8)).is_ok(), "an unknown (cancelled) sequence's snapshot is dropped");
    // A snapshot delivered before a preemption belongs to the discarded computation.
    p.add_snapshot(snap(1, 8)).expect("snapshot");
    p.reset(1).expect("reset");
    assert_eq!(p.snapshot_bytes_held(), 0);
    p.acquire_prefix(1).expect("re-admit");
    p.grow(1, 16).expect("grow");
    p.advance(1, &[], 16).expect("advance");
    assert_eq!(p.num_cached_pages(), 0, "no snapshot since the reset: nothing published");
    assert_eq!(p.counters().unsnapshotted_pages, 2);
    p.release(1);
    p.assert_accounting(&[]);
}

#[test]
fn attention_only_pools_publish_without_snapshots_and_ignore_them() {
    let ident = PoolIdentity { model_fingerprint: "attn".into(), kv_layout: "f32/b4".into(), rank: 0 };
    let cfg = KvPoolConfig { num_blocks: 8, block_size: 4, page_tokens: 8, state_slots: 0, snapshot_bytes: 0 };
    let mut p = KvPool::new(cfg, &ident).expect("valid");
    p.register(1, toks(1, 9)).expect("register");
    p.acquire_prefix(1).expect("acquire");
    p.grow(1, 8).expect("grow");
    p.add_snapshot(snap(1, 8)).expect("ignored");
    p.advance(1, &[], 8).expect("advance");
    assert_eq!(p.num_cached_pages(), 1);
    assert_eq!(p.snapshot_bytes_held(), 0);
    p.release(1);
    p.register(2, toks(1, 9)).expect("register");
    assert_eq!(p.acquire_prefix(2).expect("acquire").pages, 1);
    assert!(p.take_state_writes().is_empty());
    p.assert_accounting(&[]);
}
