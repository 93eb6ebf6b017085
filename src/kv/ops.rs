//! The scheduler ↔ pool protocol as plain data: the operations a planned step commits
//! ([`PoolOp`], applied in order), and the reply ([`PoolReply`]): each planned sequence's block
//! table, where its computation really starts (after a prefix hit), and the exact view of the pool
//! the scheduler plans the next step against. `apply_ops` is the one implementation, used by the
//! `KvPoolActor` and by the synchronous `sched::Policy` alike.

use super::page::{ImageKey, PageHash, PrefixHit};
use super::pool::{KvPool, SeqId};
use super::KvError;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PoolOp {
    /// A new sequence and its known tokens (no blocks yet), with the images among them (their
    /// placeholder spans and content hashes: part of the identity of the pages they touch).
    Register { seq: SeqId, tokens: Vec<u32>, images: Vec<ImageKey> },
    /// Tokens were appended (sampled) and KV is written for the first `computed` tokens.
    Advance { seq: SeqId, new_tokens: Vec<u32>, computed: usize },
    /// Preempted: let go of the blocks, keep the tokens (finished pages stay cached).
    Reset { seq: SeqId },
    /// The sequence is gone.
    Release { seq: SeqId },
    /// Admission: take the cached prefix, then hold blocks for `new_tokens` tokens after it.
    Admit { seq: SeqId, new_tokens: usize },
    /// Hold blocks for `new_tokens` tokens after the computed ones.
    Grow { seq: SeqId, new_tokens: usize },
}

/// The outcome for one sequence that was admitted or grown.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqGrant {
    pub seq: SeqId,
    /// False when the blocks could not be had: the sequence does not run this step.
    pub ok: bool,
    /// Tokens whose KV is already in `blocks` (the prefix hit, for an admission).
    pub start: usize,
    /// The sequence's whole block table.
    pub blocks: Vec<u32>,
    /// Recurrent-state slot.
    pub slot: u32,
    /// The lookup, for an admission.
    pub hit: Option<PrefixHit>,
    /// Refused because pages of its prefix are being restored from disk.
    pub restoring: bool,
}

/// What the scheduler plans the next step against.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolView {
    /// Free blocks plus blocks of cached pages nobody references.
    pub available: usize,
    /// Per sequence holding blocks: how many only it references (what preempting it frees).
    pub exclusive: Vec<(SeqId, usize)>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolReply {
    pub grants: Vec<SeqGrant>,
    pub view: PoolView,
    /// Operations the pool refused (bookkeeping bugs on the scheduler side; logged by callers).
    pub errors: Vec<KvError>,
    /// Pages to read back from disk (blocks already held for them). Admissions waiting for them
    /// were refused this step and retried when the restores end.
    pub restores: Vec<Restore>,
}

/// One page to restore from the spill tier into `blocks`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Restore {
    pub hash: PageHash,
    pub parent: Option<PageHash>,
    pub blocks: Vec<u32>,
}

/// Applies `ops` in order and returns the grants and the view afterwards.
pub fn apply_ops(pool: &mut KvPool, ops: Vec<PoolOp>) -> PoolReply {
    let mut reply = PoolReply::default();
    let mut registered = Vec::new();
    for op in ops {
        let result = match op {
            PoolOp::Register { seq, tokens, images } => {
                pool.register_with_images(seq, tokens, images).map(|()| registered.push(seq))
            }
            PoolOp::Advance { seq, new_tokens, computed } => pool.advance(seq, &new_tokens, computed),
            PoolOp::Reset { seq } => pool.reset(seq),
            PoolOp::Release { seq } => {
                pool.release(seq);
                Ok(())
            }
            PoolOp::Admit { seq, new_tokens } if restoring(pool, seq, &mut reply) => {
                // Its prefix continues on disk: admit it once those pages are back in memory.
                let _ = new_tokens;
                reply.grants.push(SeqGrant { restoring: true, ..refused(seq) });
                Ok(())
            }
            PoolOp::Admit { seq, new_tokens } => match pool.acquire_prefix(seq) {
                Ok(hit) => {
                    // The chunk was planned before the hit was known: after the hit it may need
                    // fewer tokens than planned, never more.
                    let left = pool.known_tokens(seq).saturating_sub(hit.hit_tokens);
                    grant(pool, seq, new_tokens.min(left), Some(hit), &mut reply);
                    Ok(())
                }
                Err(e) => {
                    reply.grants.push(refused(seq));
                    Err(e)
                }
            },
            PoolOp::Grow { seq, new_tokens } => {
                if pool.is_registered(seq) {
                    grant(pool, seq, new_tokens, None, &mut reply);
                    Ok(())
                } else {
                    reply.grants.push(refused(seq));
                    Err(KvError::UnknownSeq(seq))
                }
            }
        };
        if let Err(e) = result {
            reply.errors.push(e);
        }
    }
    // After the step's own grants, so a prefetch never takes blocks the step was planned with.
    for seq in registered {
        if pool.is_registered(seq) && pool.blocks_of(seq).is_empty() {
            prefetch(pool, seq, &mut reply);
        }
    }
    reply.view = view(pool);
    reply
}

/// The pool as the scheduler sees it.
pub fn view(pool: &KvPool) -> PoolView {
    let mut exclusive: Vec<(SeqId, usize)> = pool.seq_ids().map(|s| (s, pool.exclusive_blocks(s))).collect();
    exclusive.sort_unstable();
    PoolView { available: pool.num_available(), exclusive }
}

/// For a sequence registered (and not admitted) in this commit: starts the restores its admission
/// would start, so the reads run while it waits for its turn, if free blocks (no eviction) can
/// hold them and reading beats recomputing. Its admission then waits for them as for any restore.
fn prefetch(pool: &mut KvPool, seq: SeqId, reply: &mut PoolReply) {
    // Blocks of allocations dropped since the last operation count as free.
    pool.reclaim();
    let (candidates, _) = pool.restore_candidates_indexed(seq);
    let page_blocks = pool.config().page_tokens / pool.config().block_size.max(1);
    if candidates.is_empty() || candidates.len() * page_blocks > pool.num_free() {
        return;
    }
    let indices: Vec<usize> = candidates.iter().map(|&(i, _, _)| i).collect();
    let host_pages = candidates.iter().filter(|(_, h, _)| pool.is_in_host(h)).count();
    if !pool.choose_restore(&indices, host_pages) {
        return;
    }
    for (_, hash, parent) in candidates {
        match pool.begin_restore(hash, parent) {
            Ok(blocks) => reply.restores.push(Restore { hash, parent, blocks }),
            Err(_) => break,
        }
    }
}

/// Starts restores for the spilled pages that continue `seq`'s cached prefix. True when the
/// admission must wait for restores (new or already running).
fn restoring(pool: &mut KvPool, seq: SeqId, reply: &mut PoolReply) -> bool {
    let (candidates, mut pending) = pool.restore_candidates_indexed(seq);
    if candidates.is_empty() {
        return pending;
    }
    // Read back only when the cost model says the read beats recomputing those pages.
    let indices: Vec<usize> = candidates.iter().map(|&(i, _, _)| i).collect();
    let host_pages = candidates.iter().filter(|(_, h, _)| pool.is_in_host(h)).count();
    if !pool.choose_restore(&indices, host_pages) {
        return pending;
    }
    // The blocks for the restores must not come from evicting this chain's own cached pages.
    let pinned = pool.pin_cached_prefix(seq);
    for (_, hash, parent) in candidates {
        match pool.begin_restore(hash, parent) {
            Ok(blocks) => {
                reply.restores.push(Restore { hash, parent, blocks });
                pending = true;
            }
            // No room to restore into: serve what is in memory, recompute the rest.
            Err(_) => break,
        }
    }
    pool.unpin_pages(pinned);
    pending
}

fn refused(seq: SeqId) -> SeqGrant {
    SeqGrant { seq, ok: false, start: 0, blocks: Vec::new(), slot: 0, hit: None, restoring: false }
}

fn grant(pool: &mut KvPool, seq: SeqId, new_tokens: usize, hit: Option<PrefixHit>, reply: &mut PoolReply) {
    let start = pool.computed_of(seq);
    let mut ok = pool.grow(seq, start + new_tokens).is_ok();
    if !ok && hit.is_some() {
        // The planner did not know the hit would pin cached pages that were evictable: grant a
        // shorter first chunk rather than none (the planner cuts the chunk to the blocks).
        let bs = pool.config().block_size;
        let fit = ((pool.blocks_of(seq).len() + pool.num_available()) * bs).saturating_sub(start);
        ok = fit > 0 && pool.grow(seq, start + fit.min(new_tokens)).is_ok();
    }
    reply.grants.push(SeqGrant {
        seq,
        ok,
        start,
        blocks: pool.blocks_of(seq).to_vec(),
        slot: pool.slot_of(seq),
        hit,
        restoring: false,
    });
}
