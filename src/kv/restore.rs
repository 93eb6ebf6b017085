//! The pool's side of the spill tier: which pages are on disk, restores into freshly held blocks,
//! and pages found corrupt. The files themselves are `crate::spill`'s; the image copies are the
//! executor's.

use std::sync::Arc;

use super::{Allocation, KvPool, Page, SeqId};
use crate::kv::restore_cost::RestoreCost;
use crate::kv::{KvError, MissReason, PageHash};

impl KvPool {
    /// The spill tier found this page's copy corrupt: later lookups that stop at it say so.
    pub fn mark_corrupt(&mut self, hash: PageHash) {
        self.corrupt.insert(hash);
    }

    /// The spill tier holds this page on disk (written now, or found in its index at startup).
    pub fn note_spilled(&mut self, hash: PageHash, parent: Option<PageHash>) {
        self.spilled.insert(hash, parent);
    }

    /// The spill tier holds this page in host memory (before or beside its disk copy): restorable
    /// at once, priced as a copy to the device.
    pub fn note_in_host(&mut self, hash: PageHash, parent: Option<PageHash>) {
        self.spilled.insert(hash, parent);
        self.in_host.insert(hash);
    }

    /// The spill tier dropped this page from host memory (its disk copy, if written, remains).
    pub fn forget_in_host(&mut self, hash: &PageHash) {
        self.in_host.remove(hash);
    }

    /// The spill tier no longer holds this page (budget, disk trouble).
    pub fn forget_spilled(&mut self, hash: &PageHash) {
        self.spilled.remove(hash);
        self.in_host.remove(hash);
    }

    /// The spill tier is gone: nothing on disk can be restored any more.
    pub fn forget_all_spilled(&mut self) {
        self.spilled.clear();
        self.in_host.clear();
    }

    /// Whether the spill tier holds this page in host memory.
    pub fn is_in_host(&self, hash: &PageHash) -> bool {
        self.in_host.contains(hash)
    }

    pub fn num_spilled(&self) -> usize {
        self.spilled.len()
    }

    /// Copies of the cached pages the spill tier does not hold yet (they stay cached): what a
    /// drained shutdown writes to disk. Least recently used first, pages still referenced last.
    pub fn unspilled_pages(&self) -> Vec<super::EvictedPage> {
        let mut pages: Vec<(&PageHash, &Page)> =
            self.pages.iter().filter(|(h, _)| !self.spilled.contains_key(*h)).collect();
        pages.sort_by_key(|(_, p)| p.lru_tick.unwrap_or(u64::MAX));
        pages
            .into_iter()
            .map(|(h, p)| super::EvictedPage {
                hash: *h,
                parent: p.parent,
                blocks: p.blocks.clone(),
                snapshot: p.snapshot.clone(),
            })
            .collect()
    }

    /// Pages of `seq`'s eligible prefix that follow its cached pages and are on disk, in chain
    /// order, stopping at the first that is neither. Pages already being restored count as
    /// pending (returned with `pending = true` and no new restore needed).
    pub fn restore_candidates(&self, seq: SeqId) -> (Vec<(PageHash, Option<PageHash>)>, bool) {
        let (found, pending) = self.restore_candidates_indexed(seq);
        (found.into_iter().map(|(_, h, parent)| (h, parent)).collect(), pending)
    }

    /// `restore_candidates` with each page's index in the prefix (what pricing it needs).
    pub fn restore_candidates_indexed(&self, seq: SeqId) -> (Vec<(usize, PageHash, Option<PageHash>)>, bool) {
        let p = self.cfg.page_tokens;
        let Some(s) = self.seqs.get(&seq) else { return (Vec::new(), false) };
        if p == 0 || self.spilled.is_empty() && self.restoring.is_empty() || s.tokens.len() <= 1 {
            return (Vec::new(), false);
        }
        let mut out = Vec::new();
        let mut pending = false;
        let mut parent = None;
        for i in 0..(s.tokens.len() - 1) / p {
            let h = self.hasher.page_at(parent, &s.tokens, i, p, &s.images);
            if self.restoring.contains_key(&h) {
                pending = true;
            } else if !self.pages.contains_key(&h) {
                if self.spilled.get(&h) != Some(&parent) || self.corrupt.contains(&h) {
                    break;
                }
                out.push((i, h, parent));
            }
            parent = Some(h);
        }
        (out, pending)
    }

    /// Takes `seq`'s cached (in-memory, unreferenced) prefix pages off the LRU while restores for
    /// the pages after them take blocks, so that those restores cannot evict the very pages they
    /// continue (which would then be missing when the sequence is admitted: an `evicted` miss).
    /// Give them back with [`KvPool::unpin_pages`] before the next operation.
    pub fn pin_cached_prefix(&mut self, seq: SeqId) -> Vec<PageHash> {
        let p = self.cfg.page_tokens;
        let Some(s) = self.seqs.get(&seq) else { return Vec::new() };
        if p == 0 || s.tokens.len() <= 1 {
            return Vec::new();
        }
        let chain = self.hasher.chain_with_media(&s.tokens[..s.tokens.len() - 1], p, &s.images);
        let pinned: Vec<PageHash> =
            chain.into_iter().filter(|h| self.pages.get(h).is_some_and(|pg| pg.lru_tick.is_some())).collect();
        for h in &pinned {
            self.touch_page(*h);
        }
        pinned
    }

    /// Puts pages taken by [`KvPool::pin_cached_prefix`] back on the LRU (most recently used: the
    /// sequence is about to use them), in chain order.
    pub fn unpin_pages(&mut self, pinned: Vec<PageHash>) {
        for h in pinned {
            if self.pages.get(&h).is_some_and(|pg| pg.lru_tick.is_none()) {
                self.push_lru(h);
            }
        }
    }

    /// Holds one page's blocks for a restore of `hash` from disk. The blocks are returned so the
    /// caller can have the image written into them.
    pub fn begin_restore(&mut self, hash: PageHash, parent: Option<PageHash>) -> Result<Vec<u32>, KvError> {
        let alloc = self.allocate(self.page_blocks())?;
        let blocks = alloc.blocks().to_vec();
        self.restoring.insert(hash, (parent, alloc));
        Ok(blocks)
    }

    /// A restore ended: on success the page joins the cache (unreferenced, most recently used);
    /// otherwise its blocks are freed, the page is never tried from disk again, and the miss is
    /// counted as `spilled_corrupt`.
    pub fn finish_restore(&mut self, hash: PageHash, ok: bool, snapshot: Option<Arc<[u8]>>) {
        let Some((parent, alloc)) = self.restoring.remove(&hash) else { return };
        let ok = ok && self.restored_snapshot_fits(&snapshot);
        if ok {
            if let Err(e) = self.insert_restored(hash, parent, alloc, snapshot) {
                tracing::error!(error = %e, "a restored page could not be cached");
            }
        } else {
            drop(alloc);
            self.spilled.remove(&hash);
            self.corrupt.insert(hash);
            self.count_miss(MissReason::SpilledCorrupt);
            self.reclaim();
        }
    }

    /// Prices restores against recomputation from now on (`None`: restore whenever possible).
    pub fn set_restore_cost(&mut self, cost: Option<RestoreCost>) {
        self.restore_cost = cost;
    }

    pub fn restore_cost(&self) -> Option<&RestoreCost> {
        self.restore_cost.as_ref()
    }

    /// A restore read `bytes` in `secs`: refits the read throughput.
    pub fn observe_restore_read(&mut self, bytes: usize, secs: f64) {
        if let Some(c) = self.restore_cost.as_mut() {
            c.observe_read(bytes, secs);
        }
    }

    /// The step cost model's latest coefficients, for pricing recomputation.
    pub fn set_step_cost(&mut self, step: crate::sched::StepCost) {
        if let Some(c) = self.restore_cost.as_mut() {
            c.set_step_cost(step);
        }
    }

    /// Whether to restore the spilled pages with these prefix indices, `host_pages` of them held
    /// in host memory (always, without a cost model). Counts the decision.
    pub fn choose_restore(&mut self, page_indices: &[usize], host_pages: usize) -> bool {
        let restore = match &self.restore_cost {
            None => true,
            Some(c) => {
                let d = c.decide(page_indices, host_pages);
                tracing::debug!(
                    pages = page_indices.len(),
                    read_secs = d.read_secs,
                    recompute_secs = d.recompute_secs,
                    restore = d.restore,
                    "spilled prefix: restore or recompute"
                );
                d.restore
            }
        };
        if restore {
            self.counters.restores_chosen += 1;
        } else {
            self.counters.restores_declined += 1;
        }
        restore
    }

    /// Counts a prefix-cache lookup miss that the spill tier discovered after the fact.
    pub fn count_miss(&mut self, reason: MissReason) {
        *self.counters.misses.entry(reason).or_default() += 1;
    }

    /// Inserts a page restored from outside (the spill tier) into the cache, unreferenced, on
    /// blocks taken from `alloc` (whose contents the caller has written). Refused if the page is
    /// already cached or `alloc` is not exactly one page.
    pub fn insert_restored(
        &mut self,
        hash: PageHash,
        parent: Option<PageHash>,
        mut alloc: Allocation,
        snapshot: Option<Arc<[u8]>>,
    ) -> Result<(), KvError> {
        self.reclaim();
        if alloc.len() != self.page_blocks() || self.cfg.page_tokens == 0 {
            return Err(KvError::InvalidPool(format!(
                "a restored page needs {} blocks, got {}",
                self.page_blocks(),
                alloc.len()
            )));
        }
        if !self.restored_snapshot_fits(&snapshot) {
            return Err(KvError::InvalidPool(format!(
                "a restored page needs a {}-byte recurrent-state snapshot, got {:?} bytes",
                self.cfg.snapshot_bytes,
                snapshot.as_ref().map(|s| s.len())
            )));
        }
        if self.pages.contains_key(&hash) {
            return Ok(()); // dropping `alloc` frees its blocks again
        }
        let blocks = std::mem::take(&mut alloc.blocks);
        for &b in &blocks {
            self.blocks.set_page(b, Some(hash));
            *self.blocks.refcount_mut(b) -= 1;
        }
        self.corrupt.remove(&hash);
        self.pages.insert(hash, Page { parent, blocks, lru_tick: None, snapshot });
        self.push_lru(hash);
        Ok(())
    }
}
