//! Per-block bookkeeping of the KV pool that grows with the blocks ever handed out, not with the
//! pool: a pool sized from a large device (billions of tokens) starts in constant host time and
//! memory. Blocks never handed out are a range (`fresh..num_blocks`), not entries of a free list;
//! the per-block reference counts and page owners exist only for blocks below that high-water mark.
//! Freed blocks go on a LIFO list and are reused first (the most recently freed first), so the
//! working set of block ids stays small, and a fresh pool hands out block 0 first.

use super::page::PageHash;

#[derive(Debug)]
pub struct BlockLedger {
    num_blocks: usize,
    /// Freed blocks, most recently freed last (taken first).
    recycled: Vec<u32>,
    /// Blocks `fresh..num_blocks` were never handed out.
    fresh: usize,
    /// `refcount[b]` for every block below `fresh`.
    refcount: Vec<u32>,
    /// The published page block `b` belongs to, for every block below `fresh`.
    page: Vec<Option<PageHash>>,
}

impl BlockLedger {
    /// A ledger of `num_blocks` free blocks; allocates nothing per block.
    pub fn new(num_blocks: usize) -> Self {
        BlockLedger { num_blocks, recycled: Vec::new(), fresh: 0, refcount: Vec::new(), page: Vec::new() }
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks nobody holds and no cached page owns.
    pub fn num_free(&self) -> usize {
        self.recycled.len() + (self.num_blocks - self.fresh)
    }

    /// Blocks that ever left the free range: what the per-block tables cover.
    pub fn high_water(&self) -> usize {
        self.fresh
    }

    /// Moves `n` free blocks into `out` with one reference each. False (and no change) when fewer
    /// than `n` are free.
    pub fn take(&mut self, n: usize, out: &mut Vec<u32>) -> bool {
        if n > self.num_free() {
            return false;
        }
        let from_recycled = n.min(self.recycled.len());
        let start = self.recycled.len() - from_recycled;
        for &b in self.recycled[start..].iter().rev() {
            self.refcount[b as usize] = 1;
            out.push(b);
        }
        self.recycled.truncate(start);
        let new = n - from_recycled;
        if new > 0 {
            let (a, b) = (self.fresh, self.fresh + new);
            self.refcount.resize(b, 1);
            self.page.resize(b, None);
            // Block ids travel as u32 in step plans; the pool refuses more blocks than that names.
            out.extend((a..b).map(|id| id as u32));
            self.fresh = b;
        }
        true
    }

    /// Puts an unreferenced block that no page owns back on the free list.
    pub fn free(&mut self, b: u32) {
        debug_assert!((b as usize) < self.fresh, "block {b} was never handed out");
        debug_assert_eq!(self.refcount[b as usize], 0, "block {b} is freed while referenced");
        self.page[b as usize] = None;
        self.recycled.push(b);
    }

    /// References to block `b` (0 for a block never handed out).
    pub fn refcount(&self, b: u32) -> u32 {
        self.refcount.get(b as usize).copied().unwrap_or(0)
    }

    /// The reference count of a block that was handed out.
    pub fn refcount_mut(&mut self, b: u32) -> &mut u32 {
        &mut self.refcount[b as usize]
    }

    /// The published page block `b` belongs to.
    pub fn page(&self, b: u32) -> Option<PageHash> {
        self.page.get(b as usize).copied().flatten()
    }

    pub fn set_page(&mut self, b: u32, page: Option<PageHash>) {
        self.page[b as usize] = page;
    }

    /// Every free block (the recycled ones, then the never used range). O(free blocks): for
    /// accounting checks in tests.
    pub fn free_blocks(&self) -> impl Iterator<Item = u32> + '_ {
        self.recycled.iter().copied().chain((self.fresh..self.num_blocks).map(|b| b as u32))
    }

    /// Host bytes the per-block tables hold now (they grow with `high_water`, not the pool).
    pub fn host_bytes(&self) -> usize {
        self.recycled.capacity() * std::mem::size_of::<u32>()
            + self.refcount.capacity() * std::mem::size_of::<u32>()
            + self.page.capacity() * std::mem::size_of::<Option<PageHash>>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hands_out_fresh_blocks_in_order_and_reuses_the_most_recently_freed_first() {
        let mut l = BlockLedger::new(6);
        let mut out = Vec::new();
        assert!(l.take(3, &mut out));
        assert_eq!(out, vec![0, 1, 2]);
        for b in [0, 2] {
            *l.refcount_mut(b) = 0;
            l.free(b);
        }
        assert_eq!(l.num_free(), 5);
        out.clear();
        assert!(l.take(4, &mut out));
        assert_eq!(out, vec![2, 0, 3, 4], "recycled (last freed first), then fresh");
        assert!(!l.take(2, &mut out), "only block 5 is left");
        assert_eq!(l.num_free(), 1);
        assert_eq!(l.free_blocks().collect::<Vec<_>>(), vec![5]);
        assert_eq!((l.refcount(4), l.refcount(5)), (1, 0));
    }

    #[test]
    fn a_huge_ledger_allocates_per_block_memory_only_for_blocks_handed_out() {
        // 2^31 tokens in blocks of 16: 134 M blocks, whose tables would take ~5 GB up front.
        let n = (2usize << 30) / 16;
        let mut l = BlockLedger::new(n);
        assert_eq!(l.num_free(), n);
        assert_eq!(l.host_bytes(), 0);
        let mut out = Vec::new();
        assert!(l.take(1000, &mut out));
        assert_eq!(l.high_water(), 1000);
        assert!(l.host_bytes() < 1 << 20, "{} bytes for 1000 blocks", l.host_bytes());
        assert_eq!(l.num_free(), n - 1000);
    }
}
