//! Unit tests of `KvPool`: one test per rule, plus a seeded random run checked against a naive
//! model of the cache (which pages exist, who references what).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::kv::{apply_ops, PoolOp};

fn ident() -> PoolIdentity {
    PoolIdentity { model_fingerprint: "model-a".into(), kv_layout: "f32/b4".into(), rank: 0 }
}

/// 4-token blocks, 8-token pages (2 blocks per page).
fn pool(num_blocks: usize) -> KvPool {
    KvPool::new(KvPoolConfig { num_blocks, block_size: 4, page_tokens: 8, state_slots: 4, snapshot_bytes: 0 }, &ident())
        .expect("valid")
}

fn toks(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed * 1000 + i).collect()
}

/// Registers `seq`, admits it, gives it blocks for all its tokens and marks them computed.
fn run_seq(p: &mut KvPool, seq: SeqId, tokens: &[u32]) -> PrefixHit {
    p.register(seq, tokens.to_vec()).expect("register");
    let hit = p.acquire_prefix(seq).expect("acquire");
    p.grow(seq, tokens.len()).expect("grow");
    p.advance(seq, &[], tokens.len()).expect("advance");
    hit
}

#[test]
fn invalid_configs_are_refused() {
    let bad = |num_blocks, block_size, page_tokens| {
        KvPool::new(KvPoolConfig { num_blocks, block_size, page_tokens, state_slots: 0, snapshot_bytes: 0 }, &ident())
            .is_err()
    };
    assert!(bad(0, 4, 8));
    assert!(bad(4, 0, 0));
    assert!(bad(4, 4, 6), "page not a multiple of the block");
    assert!(!bad(4, 4, 0), "page 0 = prefix cache off");
}

#[test]
fn page_identity_depends_on_parent_tokens_and_identity() {
    let h = PageHasher::new(&ident());
    let a = h.page(None, &[1, 2, 3]);
    assert_eq!(a, h.page(None, &[1, 2, 3]), "deterministic");
    assert_ne!(a, h.page(None, &[1, 2, 4]));
    assert_ne!(a, h.page(Some(a), &[1, 2, 3]), "parent matters");
    for other in [
        PoolIdentity { model_fingerprint: "model-b".into(), ..ident() },
        PoolIdentity { kv_layout: "f16/b4".into(), ..ident() },
        PoolIdentity { rank: 1, ..ident() },
    ] {
        assert_ne!(a, PageHasher::new(&other).page(None, &[1, 2, 3]), "{other:?}");
    }
    // Length-prefixed: moving a byte between fingerprint and layout changes the salt.
    let x = PoolIdentity { model_fingerprint: "ab".into(), kv_layout: "c".into(), rank: 0 };
    let y = PoolIdentity { model_fingerprint: "a".into(), kv_layout: "bc".into(), rank: 0 };
    assert_ne!(PageHasher::new(&x).page(None, &[1]), PageHasher::new(&y).page(None, &[1]));
    let chain = h.chain(&toks(1, 20), 8);
    assert_eq!(chain.len(), 2);
    assert_eq!(chain[1], h.page(Some(chain[0]), &toks(1, 20)[8..16]));
}

#[test]
fn allocations_are_raii() {
    let mut p = pool(8);
    let a = p.allocate(3).expect("3");
    assert_eq!(a.blocks(), &[0, 1, 2], "block 0 first");
    assert_eq!(p.num_free(), 5);
    assert!(p.allocate(6).is_err(), "all or nothing");
    assert_eq!(p.num_free(), 5, "a refused allocation takes nothing");
    p.assert_accounting(&[&a]);
    drop(a);
    assert_eq!(p.num_free(), 5, "returned references are applied at the next operation");
    p.reclaim();
    assert_eq!(p.num_free(), 8);
    p.assert_accounting(&[]);
}

#[test]
fn out_of_blocks_names_both_numbers() {
    let mut p = pool(4);
    let err = p.allocate(5).expect_err("too many");
    assert_eq!(err, KvError::OutOfBlocks { wanted: 5, available: 4 });
    assert!(err.to_string().contains('5') && err.to_string().contains('4'));
}

#[test]
fn computed_whole_pages_are_published_and_survive_their_sequence() {
    let mut p = pool(16);
    let t = toks(1, 20); // 2 whole pages + 4 tokens
    let hit = run_seq(&mut p, 1, &t);
    assert_eq!(hit, PrefixHit { pages: 0, hit_tokens: 0, miss: Some(MissReason::NoEntry) });
    assert_eq!(p.num_cached_pages(), 2);
    assert_eq!(p.num_referenced(), 5, "20 tokens = 5 blocks");
    assert!(p.release(1));
    assert_eq!((p.num_free(), p.num_evictable()), (12, 4), "4 blocks of 2 pages stay cached");
    p.assert_accounting(&[]);
}

#[test]
fn a_follow_up_reuses_exactly_the_whole_shared_pages() {
    let mut p = pool(32);
    let first = toks(1, 21);
    run_seq(&mut p, 1, &first);
    p.release(1);
    // Follow-up: the first 21 tokens, then new ones. floor(21 / 8) = 2 pages.
    let mut follow = first.clone();
    follow.extend(toks(2, 10));
    p.register(2, follow).expect("register");
    let hit = p.acquire_prefix(2).expect("acquire");
    assert_eq!((hit.pages, hit.hit_tokens, hit.miss), (2, 16, Some(MissReason::NoEntry)));
    assert_eq!(p.computed_of(2), 16);
    assert_eq!(p.blocks_of(2).len(), 4);
    assert_eq!(p.counters().hit_tokens, 16);
    p.assert_accounting(&[]);
}

#[test]
fn the_last_token_is_never_served() {
    let mut p = pool(32);
    let t = toks(1, 16); // exactly 2 pages
    run_seq(&mut p, 1, &t);
    p.release(1);
    p.register(2, t.clone()).expect("register");
    let hit = p.acquire_prefix(2).expect("acquire");
    assert_eq!(hit.hit_tokens, 8, "only 15 tokens are eligible: one page");
    assert_eq!(hit.miss, Some(MissReason::TailShorterThanPage));
    let mut longer = t.clone();
    longer.push(7);
    p.register(3, longer).expect("register");
    let hit = p.acquire_prefix(3).expect("acquire");
    assert_eq!((hit.hit_tokens, hit.miss), (16, None), "16 eligible tokens, both pages");
}

#[test]
fn a_shared_prefix_is_referenced_not_copied() {
    let mut p = pool(32);
    run_seq(&mut p, 1, &toks(1, 17));
    let mut b = toks(1, 16);
    b.extend(toks(9, 5));
    p.register(2, b).expect("register");
    let hit = p.acquire_prefix(2).expect("acquire");
    assert_eq!(hit.hit_tokens, 16);
    assert_eq!(&p.blocks_of(2)[..4], &p.blocks_of(1)[..4], "same physical blocks");
    assert_eq!(p.exclusive_blocks(1), 1, "only the tail block is its own");
    assert_eq!(p.exclusive_blocks(2), 0);
    p.assert_accounting(&[]);
    p.release(1);
    assert_eq!(p.num_evictable(), 0, "still referenced by 2");
    p.release(2);
    assert_eq!(p.num_evictable(), 4);
    p.assert_accounting(&[]);
}

#[test]
fn a_different_parent_or_identity_misses() {
    let mut p = pool(32);
    run_seq(&mut p, 1, &toks(1, 17));
    // Same second page, different first page: no hit at all (the chain breaks at page 0).
    let mut t = toks(5, 8);
    t.extend(&toks(1, 17)[8..]);
    p.register(2, t).expect("register");
    assert_eq!(p.acquire_prefix(2).expect("acquire").hit_tokens, 0);
    let mut other = KvPool::new(
        KvPoolConfig { num_blocks: 32, block_size: 4, page_tokens: 8, state_slots: 0, snapshot_bytes: 0 },
        &PoolIdentity { model_fingerprint: "model-b".into(), ..ident() },
    )
    .expect("valid");
    run_seq(&mut other, 1, &toks(1, 17));
    let (_, hit) = p.lookup(&toks(1, 17));
    assert_eq!(hit.hit_tokens, 16);
    assert!(other.contains_page(&other.hasher().chain(&toks(1, 8), 8)[0]));
    assert!(!p.contains_page(&other.hasher().chain(&toks(1, 8), 8)[0]), "pages never cross models");
}

#[test]
fn eviction_takes_the_least_recently_used_unreferenced_page() {
    let mut p = pool(8); // room for 4 pages
    for s in 1..=4 {
        run_seq(&mut p, s, &toks(s as u32, 8));
        p.release(s);
    }
    assert_eq!((p.num_free(), p.num_evictable()), (0, 8));
    // Touch seq 1's page: it becomes the most recently used.
    p.register(10, [toks(1, 8), vec![99]].concat()).expect("register");
    assert_eq!(p.acquire_prefix(10).expect("acquire").hit_tokens, 8);
    p.release(10);
    let a = p.allocate(2).expect("evicts one page");
    let ev = p.take_evicted();
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].hash, p.hasher().chain(&toks(2, 8), 8)[0], "page of seq 2 is now the oldest");
    assert_eq!(a.blocks().len(), 2);
    let (_, hit) = p.lookup(&[toks(2, 8), vec![1]].concat());
    assert_eq!(hit.miss, Some(MissReason::Evicted));
    let (_, hit) = p.lookup(&[toks(1, 8), vec![1]].concat());
    assert_eq!(hit.miss, None);
    assert_eq!(p.counters().evictions, 1);
    p.assert_accounting(&[&a]);
}

#[test]
fn referenced_pages_are_never_evicted() {
    let mut p = pool(4);
    run_seq(&mut p, 1, &toks(1, 8)); // 2 blocks, referenced
    assert!(p.allocate(3).is_err());
    let a = p.allocate(2).expect("the two free ones");
    assert!(p.take_evicted().is_empty());
    p.assert_accounting(&[&a]);
}

#[test]
fn preemption_keeps_finished_pages_for_the_resume() {
    let mut p = pool(32);
    let t = toks(1, 30);
    p.register(1, t.clone()).expect("register");
    p.acquire_prefix(1).expect("acquire");
    p.grow(1, 20).expect("grow");
    p.advance(1, &[], 20).expect("advance");
    p.reset(1).expect("preempt");
    assert_eq!((p.blocks_of(1).len(), p.computed_of(1)), (0, 0));
    assert_eq!(p.num_evictable(), 4, "two finished pages cached");
    let hit = p.acquire_prefix(1).expect("resume");
    assert_eq!(hit.hit_tokens, 16, "resumes after its finished pages");
    p.assert_accounting(&[]);
}

#[test]
fn generated_tokens_join_the_pages() {
    let mut p = pool(32);
    p.register(1, toks(1, 6)).expect("register");
    p.acquire_prefix(1).expect("acquire");
    p.grow(1, 6).expect("grow");
    p.advance(1, &[], 6).expect("prefill");
    assert_eq!(p.num_cached_pages(), 0);
    // Decode: each step appends the sampled token and computes the previous one.
    for (i, t) in [500u32, 501, 502].iter().enumerate() {
        p.grow(1, 7 + i).expect("grow");
        p.advance(1, &[*t], 7 + i).expect("decode");
    }
    assert_eq!(p.num_cached_pages(), 1, "8 computed tokens = 1 page");
    let mut want = toks(1, 6);
    want.extend([500, 501]);
    assert!(p.contains_page(&p.hasher().chain(&want, 8)[0]));
}

#[test]
fn advance_beyond_blocks_or_tokens_is_an_error() {
    let mut p = pool(8);
    p.register(1, toks(1, 6)).expect("register");
    p.acquire_prefix(1).expect("acquire");
    p.grow(1, 4).expect("grow");
    assert!(matches!(p.advance(1, &[], 5), Err(KvError::BeyondBlocks { .. })));
    p.grow(1, 8).expect("grow");
    assert!(matches!(p.advance(1, &[], 7), Err(KvError::BeyondBlocks { .. })), "only 6 tokens known");
    assert_eq!(p.advance(9, &[], 1), Err(KvError::UnknownSeq(9)));
    assert_eq!(p.register(1, vec![1]), Err(KvError::DuplicateSeq(1)));
    assert_eq!(p.acquire_prefix(1), Err(KvError::AlreadyAdmitted(1)));
}

#[test]
fn state_slots_are_distinct_and_returned() {
    let mut p = pool(32);
    for s in 0..4 {
        p.register(s, toks(s as u32, 3)).expect("register");
        p.acquire_prefix(s).expect("acquire");
    }
    let mut slots: Vec<u32> = (0..4).map(|s| p.slot_of(s)).collect();
    slots.sort_unstable();
    assert_eq!(slots, vec![0, 1, 2, 3]);
    p.release(2);
    p.register(9, toks(9, 3)).expect("register");
    p.acquire_prefix(9).expect("acquire");
    assert_eq!(p.slot_of(9), 2, "the freed slot is reused");
    p.reset(9).expect("reset");
    p.assert_accounting(&[]);
}

#[test]
fn prefix_cache_off_publishes_and_serves_nothing() {
    let mut p = KvPool::new(
        KvPoolConfig { num_blocks: 16, block_size: 4, page_tokens: 0, state_slots: 0, snapshot_bytes: 0 },
        &ident(),
    )
    .expect("valid");
    run_seq(&mut p, 1, &toks(1, 20));
    p.release(1);
    assert_eq!((p.num_cached_pages(), p.num_free()), (0, 16));
    p.register(2, toks(1, 20)).expect("register");
    assert_eq!(p.acquire_prefix(2).expect("acquire").hit_tokens, 0);
    assert_eq!(p.counters().queries, 0, "no lookup is counted when the cache is off");
}

#[test]
fn miss_reasons_are_counted() {
    let mut p = pool(8);
    run_seq(&mut p, 1, &toks(1, 9)); // publishes 1 page, 3 blocks
    p.release(1);
    p.register(2, toks(1, 9)).expect("register");
    assert_eq!(p.acquire_prefix(2).expect("acquire").miss, None, "a full hit");
    p.release(2);
    p.register(3, toks(3, 4)).expect("register");
    assert_eq!(p.acquire_prefix(3).expect("acquire").miss, Some(MissReason::TailShorterThanPage));
    p.release(3);
    let all = p.allocate(8).expect("evicts the page");
    drop(all);
    p.reclaim();
    p.mark_corrupt(p.hasher().chain(&toks(1, 8), 8)[0]);
    p.register(4, toks(1, 9)).expect("register");
    assert_eq!(p.acquire_prefix(4).expect("acquire").miss, Some(MissReason::SpilledCorrupt));
    p.register(5, toks(5, 9)).expect("register");
    assert_eq!(p.acquire_prefix(5).expect("acquire").miss, Some(MissReason::NoEntry));
    let c = p.counters();
    assert_eq!(c.queries, 5);
    let got: Vec<(MissReason, u64)> = c.misses.iter().map(|(k, v)| (*k, *v)).collect();
    assert_eq!(
        got,
        vec![(MissReason::NoEntry, 2), (MissReason::SpilledCorrupt, 1), (MissReason::TailShorterThanPage, 1)]
    );
}

#[test]
fn a_restored_page_is_cached_and_served() {
    let mut p = pool(8);
    let t = toks(1, 9);
    let h = p.hasher().chain(&t, 8)[0];
    let a = p.allocate(2).expect("2");
    p.insert_restored(h, None, a, None).expect("insert");
    assert_eq!(p.num_evictable(), 2);
    p.register(1, t).expect("register");
    assert_eq!(p.acquire_prefix(1).expect("acquire").hit_tokens, 8);
    let wrong = p.allocate(1).expect("1");
    assert!(p.insert_restored(h, None, wrong, None).is_err(), "one block is not a page");
    p.assert_accounting(&[]);
}

/// Random operations against a naive model: every block is in exactly one state, the pages the
/// model says are cached are exactly the ones the pool serves, and an idle pool returns to
/// free + cached == total.
#[test]
fn random_operations_keep_exact_accounting() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let mut p = pool(48);
    let mut live: Vec<(SeqId, Vec<u32>, bool)> = Vec::new(); // id, tokens, admitted
    let mut next = 0u64;
    let mut held: Vec<Allocation> = Vec::new();
    for _ in 0..4000 {
        match rng.random_range(0..10) {
            0..=2 => {
                next += 1;
                // Prompts share prefixes drawn from a few stems so that hits happen.
                let stem = rng.random_range(0..4u32);
                let mut t = toks(stem, rng.random_range(1..30));
                t.extend(toks(100 + next as u32, rng.random_range(0..6)));
                p.register(next, t.clone()).expect("register");
                live.push((next, t, false));
            }
            3..=5 if !live.is_empty() => {
                let i = rng.random_range(0..live.len());
                let (id, t, admitted) = &mut live[i];
                if !*admitted {
                    let hit = p.acquire_prefix(*id).expect("acquire");
                    assert_eq!(hit.hit_tokens % 8, 0);
                    assert!(hit.hit_tokens < t.len());
                    assert_eq!(p.computed_of(*id), hit.hit_tokens);
                    *admitted = true;
                }
                let c = p.computed_of(*id);
                let want = (c + rng.random_range(1..10)).min(t.len());
                if p.grow(*id, want).is_ok() {
                    p.advance(*id, &[], want).expect("advance");
                }
            }
            6 if !live.is_empty() => {
                let i = rng.random_range(0..live.len());
                let (id, _, admitted) = &mut live[i];
                p.reset(*id).expect("reset");
                *admitted = false;
            }
            7 if !live.is_empty() => {
                let i = rng.random_range(0..live.len());
                let (id, _, _) = live.swap_remove(i);
                assert!(p.release(id));
            }
            8 => {
                if let Ok(a) = p.allocate(rng.random_range(0..4)) {
                    held.push(a);
                }
            }
            _ => {
                if !held.is_empty() {
                    held.swap_remove(rng.random_range(0..held.len()));
                }
            }
        }
        let refs: Vec<&Allocation> = held.iter().collect();
        p.assert_accounting(&refs);
    }
    for (id, _, _) in live.drain(..) {
        p.release(id);
    }
    held.clear();
    p.assert_accounting(&[]);
    assert_eq!(p.num_available(), 48);
    assert!(p.counters().queries > 100 && p.counters().hit_tokens > 0 && p.counters().evictions > 0);
}

/// The soak's spill phase saw `evicted` misses on prompts whose every page was in memory or on
/// disk: restoring the pages at the front of a chain took blocks by evicting the same chain's
/// cached later pages, which were then missing (and not yet spilled) when the sequence was
/// admitted. Restores now never evict the chain they continue.
#[test]
fn restores_do_not_evict_the_chain_they_continue() {
    let mut p = pool(12);
    let a = toks(1, 33);
    run_seq(&mut p, 1, &a[..32]);
    p.release(1); // LRU: pages 0, 1, 2, 3 (oldest first); 4 blocks free
    run_seq(&mut p, 2, &toks(2, 8));
    p.release(2); // LRU: pages 0-3, then the unrelated page X; 2 blocks free
    let hold = p.allocate(6).expect("evicts pages 0 and 1");
    let evicted = p.take_evicted();
    assert_eq!(evicted.len(), 2);
    for e in &evicted {
        p.note_spilled(e.hash, e.parent);
    }
    drop(hold);
    let _busy = p.allocate(4).expect("leaves 2 blocks free");
    p.register(3, a.clone()).expect("register");
    let reply = apply_ops(&mut p, vec![PoolOp::Admit { seq: 3, new_tokens: 1 }]);
    assert!(reply.grants[0].restoring, "pages 0 and 1 are restored first");
    assert_eq!(reply.restores.len(), 2);
    let chain = p.hasher().chain(&a[..32], 8);
    assert!(p.contains_page(&chain[2]) && p.contains_page(&chain[3]), "the restores evicted their own chain");
    for r in reply.restores {
        p.finish_restore(r.hash, true, None);
    }
    let reply = apply_ops(&mut p, vec![PoolOp::Admit { seq: 3, new_tokens: 1 }]);
    let hit = reply.grants[0].hit.clone().expect("admitted");
    assert_eq!((hit.pages, hit.miss), (4, None), "every page served, none `evicted`");
    p.release(3);
    drop(_busy);
    p.assert_accounting(&[]);
}

/// With a restore cost model, a spilled prefix is read back only when the read beats recomputing
/// it: priced slower, the admission goes ahead at once from what is in memory and recomputes the
/// rest (no restore, no wait); priced faster, it waits for the restores as before.
#[test]
fn a_spilled_prefix_is_restored_only_when_reading_beats_recomputing() {
    use crate::kv::restore_cost::RestoreCost;
    use crate::sched::StepCost;
    let spill_all = |p: &mut KvPool, a: &[u32]| {
        run_seq(p, 1, &a[..32]);
        p.release(1);
        let hold = p.allocate(12).expect("evicts every page");
        for e in p.take_evicted() {
            p.note_spilled(e.hash, e.parent);
        }
        drop(hold);
    };
    let a = toks(1, 33);
    // 4 pages of 8 tokens, 1 MiB images; prefill at 1 ms a token: 8 ms a page to recompute.
    let step = StepCost { fixed: 0.0, per_prefill_token: 1e-3, per_decode_seq: 0.0, per_million_attended: 0.0 };
    let mut slow_disk = RestoreCost::new(1 << 20, 8, 1, step);
    slow_disk.observe_read(1 << 20, 0.1); // 10 MB/s: 100 ms a page
    let mut p = pool(12);
    p.set_restore_cost(Some(slow_disk));
    spill_all(&mut p, &a);
    p.register(3, a.clone()).expect("register");
    let reply = apply_ops(&mut p, vec![PoolOp::Admit { seq: 3, new_tokens: 33 }]);
    assert!(reply.restores.is_empty() && !reply.grants[0].restoring, "recomputed, not read");
    assert!(reply.grants[0].ok && reply.grants[0].start == 0, "admitted at once from position 0");
    assert_eq!((p.counters().restores_declined, p.counters().restores_chosen), (1, 0));
    p.release(3);
    p.assert_accounting(&[]);

    let mut fast_disk = RestoreCost::new(1 << 20, 8, 1, step);
    fast_disk.observe_read(1 << 20, 0.001); // 1 GB/s: 1 ms a page
    let mut p = pool(12);
    p.set_restore_cost(Some(fast_disk));
    spill_all(&mut p, &a);
    p.register(3, a.clone()).expect("register");
    let reply = apply_ops(&mut p, vec![PoolOp::Admit { seq: 3, new_tokens: 33 }]);
    assert!(reply.grants[0].restoring && reply.restores.len() == 4, "every page read back");
    assert_eq!(p.counters().restores_chosen, 1);
    for r in reply.restores {
        p.finish_restore(r.hash, true, None);
    }
    let reply = apply_ops(&mut p, vec![PoolOp::Admit { seq: 3, new_tokens: 1 }]);
    assert_eq!(reply.grants[0].start, 32, "served from the restored pages");
    p.release(3);
    p.assert_accounting(&[]);
}

/// A pool sized from a large device (2^31 tokens in blocks of 16: 134 M blocks) is created and
/// used without per-block host memory up front: its bookkeeping covers only the blocks handed out.
#[test]
fn a_two_billion_token_pool_starts_without_per_block_host_memory() {
    let num_blocks = (1usize << 31) / 16;
    let cfg = KvPoolConfig { num_blocks, block_size: 16, page_tokens: 256, state_slots: 256, snapshot_bytes: 0 };
    let mut p = KvPool::new(cfg, &ident()).expect("valid");
    assert_eq!((p.num_free(), p.num_available()), (num_blocks, num_blocks));
    assert_eq!(p.block_bookkeeping_bytes(), 0, "nothing per block before the first allocation");
    let prompt = toks(1, 4097);
    p.register(1, prompt.clone()).expect("register");
    let reply = apply_ops(&mut p, vec![PoolOp::Admit { seq: 1, new_tokens: 4097 }]);
    assert!(reply.grants[0].ok);
    p.advance(1, &[], 4097).expect("advance");
    p.release(1);
    p.register(2, prompt).expect("register");
    let reply = apply_ops(&mut p, vec![PoolOp::Admit { seq: 2, new_tokens: 4097 }]);
    assert_eq!(reply.grants[0].start, 4096, "16 published pages served");
    p.release(2);
    p.reclaim();
    assert_eq!(p.num_available(), num_blocks);
    assert!(p.block_bookkeeping_bytes() < 1 << 20, "{} bytes", p.block_bookkeeping_bytes());
}

/// The restore of a spilled prefix starts when its sequence registers (prefetch), not when it is
/// admitted: the reads overlap its wait in the queue; the admission then waits only for what is
/// still being read, and starts no second restore.
#[test]
fn restores_start_at_registration_and_the_admission_waits_for_them() {
    let mut p = pool(12);
    let a = toks(1, 33);
    run_seq(&mut p, 1, &a[..32]);
    p.release(1);
    let hold = p.allocate(12).expect("evicts every page");
    for e in p.take_evicted() {
        p.note_spilled(e.hash, e.parent);
    }
    drop(hold);
    let reply = apply_ops(&mut p, vec![PoolOp::Register { seq: 3, tokens: a.clone(), images: Vec::new() }]);
    assert_eq!(reply.restores.len(), 4, "all four pages are being read while seq 3 waits");
    assert_eq!(reply.view.available, 12 - 8, "the view shows the blocks the reads hold");
    let admit = apply_ops(&mut p, vec![PoolOp::Admit { seq: 3, new_tokens: 33 }]);
    assert!(admit.grants[0].restoring && admit.restores.is_empty(), "waits for the prefetch, no second read");
    for r in reply.restores {
        p.finish_restore(r.hash, true, None);
    }
    let admit = apply_ops(&mut p, vec![PoolOp::Admit { seq: 3, new_tokens: 1 }]);
    assert_eq!(admit.grants[0].start, 32);
    p.release(3);
    p.assert_accounting(&[]);
}
