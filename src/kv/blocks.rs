//! The KV block allocator: a fixed set of blocks of `block_size` token slots, a free list, and the
//! per-sequence `BlockTable` that records which blocks a sequence holds.
//!
//! Leaks are made loud rather than silent: a `BlockTable` cannot be cloned, can only give its
//! blocks back through `release`, and dropping one that still holds blocks panics in debug builds
//! (and logs an error in release builds). Owners (the scheduling policy) therefore route every
//! removal of a sequence through one function that releases its table.

use super::KvError;

/// A fixed pool of KV blocks. Block ids are `0..num_blocks`.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    /// LIFO: the most recently freed block is reused first, which keeps the working set of block
    /// ids small and cache-friendly on the executor side.
    free: Vec<u32>,
    /// `in_use[b]` is true while some table holds block `b`; lets `free` detect double frees.
    in_use: Vec<bool>,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self, KvError> {
        if block_size == 0 {
            return Err(KvError::InvalidPool("block_size must be at least 1 token".into()));
        }
        if num_blocks == 0 {
            return Err(KvError::InvalidPool("the pool needs at least one block".into()));
        }
        // Block ids travel as u32 in step plans.
        if num_blocks > u32::MAX as usize {
            return Err(KvError::InvalidPool(format!(
                "{num_blocks} blocks exceed the {} that u32 block ids can name",
                u32::MAX
            )));
        }
        // Reversed so that block 0 is handed out first.
        let free = (0..num_blocks as u32).rev().collect();
        Ok(Self { block_size, free, in_use: vec![false; num_blocks] })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.in_use.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.free.len()
    }

    /// Token slots in the whole pool.
    pub fn capacity_tokens(&self) -> usize {
        self.num_blocks() * self.block_size
    }

    /// Blocks needed to hold `tokens` token slots.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// All-or-nothing: `n` blocks, or `None` (and no change) when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        let mut out = Vec::with_capacity(n);
        self.allocate_into(n, &mut out).then_some(out)
    }

    /// Like `allocate`, appending to `out` (avoids an allocation per growing table).
    fn allocate_into(&mut self, n: usize, out: &mut Vec<u32>) -> bool {
        if n > self.free.len() {
            return false;
        }
        let start = self.free.len() - n;
        for &b in self.free[start..].iter().rev() {
            self.in_use[b as usize] = true;
            out.push(b);
        }
        self.free.truncate(start);
        true
    }

    /// Returns blocks to the pool. Atomic: on an out-of-range id, a block that is already free, or
    /// the same id twice in `blocks`, nothing is freed and the error names the offending block.
    pub fn free(&mut self, blocks: &[u32]) -> Result<(), KvError> {
        for &b in blocks {
            if b as usize >= self.in_use.len() {
                return Err(KvError::OutOfRange { block: b, num_blocks: self.in_use.len() });
            }
        }
        for (i, &b) in blocks.iter().enumerate() {
            if !self.in_use[b as usize] {
                // Undo the part of this call already applied so the pool is as before the call.
                for &done in &blocks[..i] {
                    self.in_use[done as usize] = true;
                }
                self.free.truncate(self.free.len() - i);
                return Err(KvError::DoubleFree { block: b });
            }
            self.in_use[b as usize] = false;
            self.free.push(b);
        }
        Ok(())
    }

    /// Panics unless the free list and the in-use map agree: every block is either free exactly
    /// once or in use, and free + used == total. O(num_blocks); meant for tests and debug checks.
    pub fn assert_accounting(&self) {
        let mut seen_free = vec![false; self.in_use.len()];
        for &b in &self.free {
            let b = b as usize;
            assert!(b < self.in_use.len(), "free list holds out-of-range block {b}");
            assert!(!seen_free[b], "block {b} is on the free list twice");
            assert!(!self.in_use[b], "block {b} is on the free list but marked in use");
            seen_free[b] = true;
        }
        let used = self.in_use.iter().filter(|&&u| u).count();
        assert_eq!(
            self.free.len() + used,
            self.num_blocks(),
            "free ({}) + used ({used}) != total ({})",
            self.free.len(),
            self.num_blocks()
        );
    }
}

/// The blocks one sequence holds, in position order: token position `p` lives in
/// `blocks()[p / block_size]` at slot `p % block_size`.
#[derive(Debug)]
pub struct BlockTable {
    block_size: usize,
    blocks: Vec<u32>,
    /// Token slots whose KV has been written (the owner records progress here).
    num_filled: usize,
}

impl BlockTable {
    pub fn new(block_size: usize) -> Self {
        Self { block_size, blocks: Vec::new(), num_filled: 0 }
    }

    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Token slots the held blocks provide.
    pub fn capacity_tokens(&self) -> usize {
        self.blocks.len() * self.block_size
    }

    pub fn num_filled(&self) -> usize {
        self.num_filled
    }

    /// Records how many token slots hold written KV. Clamped to the capacity: a larger value is a
    /// caller bug (debug panic).
    pub fn set_num_filled(&mut self, n: usize) {
        debug_assert!(n <= self.capacity_tokens(), "{n} filled slots exceed capacity {}", self.capacity_tokens());
        self.num_filled = n.min(self.capacity_tokens());
    }

    /// Makes the table hold blocks for at least `total_tokens` token slots, allocating only the
    /// missing blocks. All-or-nothing: false (and no change) when the pool is short.
    pub fn ensure_capacity(&mut self, pool: &mut BlockPool, total_tokens: usize) -> bool {
        debug_assert_eq!(pool.block_size(), self.block_size, "table and pool disagree on block_size");
        let missing = total_tokens.div_ceil(self.block_size).saturating_sub(self.blocks.len());
        missing == 0 || pool.allocate_into(missing, &mut self.blocks)
    }

    /// Gives every block back to `pool` and empties the table.
    pub fn release(&mut self, pool: &mut BlockPool) {
        if let Err(e) = pool.free(&self.blocks) {
            // The table only ever holds blocks the pool handed out, so this means the table was
            // used with another pool or the pool was corrupted: a bug, not an input problem.
            tracing::error!(error = %e, "releasing a KV block table failed");
            if cfg!(debug_assertions) {
                panic!("releasing a KV block table failed: {e}");
            }
        }
        self.blocks.clear();
        self.num_filled = 0;
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        // A table dropped while holding blocks would leak them from the pool forever.
        if !self.blocks.is_empty() && !std::thread::panicking() {
            tracing::error!(blocks = self.blocks.len(), "KV block table dropped without release: blocks leaked");
            if cfg!(debug_assertions) {
                panic!("BlockTable dropped while holding {} blocks; release it to its BlockPool", self.blocks.len());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn pool(n: usize, bs: usize) -> BlockPool {
        BlockPool::new(n, bs).expect("valid pool")
    }

    #[test]
    fn new_pool_is_all_free() {
        let p = pool(10, 16);
        assert_eq!((p.num_blocks(), p.num_free(), p.num_used(), p.block_size()), (10, 10, 0, 16));
        assert_eq!(p.capacity_tokens(), 160);
        p.assert_accounting();
    }

    #[test]
    fn invalid_pools_are_refused() {
        assert!(matches!(BlockPool::new(10, 0), Err(KvError::InvalidPool(_))));
        assert!(matches!(BlockPool::new(0, 16), Err(KvError::InvalidPool(_))));
    }

    #[test]
    fn blocks_for_rounds_up() {
        let p = pool(4, 16);
        let got: Vec<usize> = [0, 1, 15, 16, 17, 32, 33].iter().map(|&t| p.blocks_for(t)).collect();
        assert_eq!(got, vec![0, 1, 1, 1, 2, 2, 3]);
        assert_eq!(pool(4, 1).blocks_for(7), 7);
    }

    #[test]
    fn allocate_hands_out_distinct_in_range_blocks() {
        let mut p = pool(8, 4);
        let a = p.allocate(3).expect("3 free");
        let b = p.allocate(5).expect("5 free");
        let mut all: Vec<u32> = a.iter().chain(&b).copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..8).collect::<Vec<u32>>());
        assert_eq!((p.num_free(), p.num_used()), (0, 8));
        p.free(&a).expect("free a");
        p.free(&b).expect("free b");
        p.assert_accounting();
    }

    #[test]
    fn allocate_is_all_or_nothing() {
        let mut p = pool(4, 4);
        let a = p.allocate(3).expect("3 free");
        assert_eq!(p.allocate(2), None);
        assert_eq!(p.num_free(), 1, "a failed allocation must not take blocks");
        assert_eq!(p.allocate(0), Some(vec![]));
        let b = p.allocate(1).expect("1 free");
        p.free(&a).expect("free");
        p.free(&b).expect("free");
        p.assert_accounting();
    }

    #[test]
    fn freed_blocks_are_reused_lifo() {
        let mut p = pool(4, 4);
        let a = p.allocate(2).expect("2");
        assert_eq!(a, vec![0, 1], "block 0 first");
        p.free(&[1]).expect("free 1");
        assert_eq!(p.allocate(1), Some(vec![1]));
        p.free(&[0, 1]).expect("free");
    }

    #[test]
    fn double_free_is_an_error_and_changes_nothing() {
        let mut p = pool(4, 4);
        let a = p.allocate(2).expect("2");
        p.free(&a[..1]).expect("first free");
        assert_eq!(p.free(&a[..1]), Err(KvError::DoubleFree { block: a[0] }));
        // A call that frees a held block and then a free one must not half-apply.
        assert_eq!(p.free(&[a[1], a[0]]), Err(KvError::DoubleFree { block: a[0] }));
        assert_eq!(p.num_used(), 1);
        p.assert_accounting();
        p.free(&a[1..]).expect("still held");
        p.assert_accounting();
    }

    #[test]
    fn duplicate_ids_in_one_free_call_are_rejected_atomically() {
        let mut p = pool(4, 4);
        let a = p.allocate(2).expect("2");
        assert_eq!(p.free(&[a[0], a[1], a[0]]), Err(KvError::DoubleFree { block: a[0] }));
        assert_eq!(p.num_used(), 2);
        p.assert_accounting();
        p.free(&a).expect("free");
    }

    #[test]
    fn out_of_range_free_is_an_error() {
        let mut p = pool(4, 4);
        let a = p.allocate(1).expect("1");
        let err = p.free(&[a[0], 4]).expect_err("4 is out of range");
        assert_eq!(err, KvError::OutOfRange { block: 4, num_blocks: 4 });
        assert!(err.to_string().contains("4 blocks"), "{err}");
        assert_eq!(p.num_used(), 1, "nothing freed");
        p.free(&a).expect("free");
    }

    #[test]
    fn table_grows_only_by_missing_blocks() {
        let mut p = pool(10, 4);
        let mut t = BlockTable::new(4);
        assert!(t.ensure_capacity(&mut p, 5));
        assert_eq!((t.num_blocks(), t.capacity_tokens()), (2, 8));
        assert!(t.ensure_capacity(&mut p, 8), "already enough");
        assert_eq!(t.num_blocks(), 2);
        assert!(t.ensure_capacity(&mut p, 3), "shrinking requests keep blocks");
        assert_eq!(t.num_blocks(), 2);
        assert!(t.ensure_capacity(&mut p, 9));
        assert_eq!(t.blocks(), &[0, 1, 2]);
        assert_eq!(p.num_used(), 3);
        t.release(&mut p);
        assert_eq!((t.num_blocks(), p.num_used()), (0, 0));
    }

    #[test]
    fn table_growth_is_all_or_nothing() {
        let mut p = pool(3, 4);
        let mut t = BlockTable::new(4);
        assert!(t.ensure_capacity(&mut p, 4));
        assert!(!t.ensure_capacity(&mut p, 4 * 5), "needs 4 more, only 2 free");
        assert_eq!((t.num_blocks(), p.num_free()), (1, 2));
        t.release(&mut p);
        p.assert_accounting();
    }

    #[test]
    fn table_tracks_filled_slots() {
        let mut p = pool(3, 4);
        let mut t = BlockTable::new(4);
        assert!(t.ensure_capacity(&mut p, 6));
        t.set_num_filled(6);
        assert_eq!(t.num_filled(), 6);
        t.release(&mut p);
        assert_eq!(t.num_filled(), 0);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "dropped while holding 2 blocks")]
    fn dropping_a_table_that_holds_blocks_panics_in_debug() {
        let mut p = pool(3, 4);
        let mut t = BlockTable::new(4);
        assert!(t.ensure_capacity(&mut p, 8));
        drop(t);
    }

    #[test]
    fn released_tables_drop_quietly() {
        let mut p = pool(3, 4);
        let mut t = BlockTable::new(4);
        assert!(t.ensure_capacity(&mut p, 8));
        t.release(&mut p);
        drop(t);
        drop(BlockTable::new(4));
    }

    #[test]
    fn random_tables_keep_the_pool_consistent() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut p = pool(64, 8);
        let mut tables: Vec<BlockTable> = (0..10).map(|_| BlockTable::new(8)).collect();
        for _ in 0..5000 {
            let i = rng.random_range(0..tables.len());
            if rng.random_bool(0.2) {
                tables[i].release(&mut p);
            } else {
                let want = rng.random_range(0..200);
                let before = tables[i].num_blocks();
                let free_before = p.num_free();
                let ok = tables[i].ensure_capacity(&mut p, want);
                let missing = p.blocks_for(want).saturating_sub(before);
                assert_eq!(ok, missing <= free_before);
                if !ok {
                    assert_eq!(tables[i].num_blocks(), before);
                }
            }
            let held: usize = tables.iter().map(BlockTable::num_blocks).sum();
            assert_eq!(held, p.num_used());
            let mut all: Vec<u32> = tables.iter().flat_map(|t| t.blocks().iter().copied()).collect();
            all.sort_unstable();
            all.dedup();
            assert_eq!(all.len(), held, "a block is held by two tables");
        }
        p.assert_accounting();
        for t in &mut tables {
            t.release(&mut p);
        }
        assert_eq!(p.num_free(), 64);
        p.assert_accounting();
    }
}
