//! `KvPool`: the shared paged KV pool as plain data. It owns the free list, a reference count per
//! block, every live sequence's block table (as an RAII [`Allocation`]), the per-sequence
//! recurrent-state slots, the page-granular prefix index and the LRU of cached pages nobody
//! references. It never touches tensors and makes no scheduling decision: the scheduler decides
//! who runs, the pool only says which blocks back it.
//!
//! # Blocks, pages, references
//! A block is `block_size` token slots. A page is `page_tokens` tokens (whole blocks). Once a
//! sequence has computed a whole page, the page is *published*: its blocks are entered in the
//! prefix index under the page's identity (see [`PageHasher`]). A block is in exactly one of three
//! states: **free** (on the free list), **referenced** (held by one or more allocations; the
//! refcount says how many) or **cached** (a published page that nobody references, on the LRU).
//! Cached pages are reclaimed, least recently used first, when the free list runs dry; every
//! eviction is reported by [`KvPool::take_evicted`] so the spill tier can copy the page out
//! before the blocks are written again.
//!
//! Allocations give their references back when dropped (through a channel the pool drains at
//! the start of every operation), so a block can only leak if an `Allocation` is kept forever.
//!
//! # Lookups
//! A prefix lookup walks the sequence's pages from the start and takes every cached page it
//! finds, stopping at the first page that is not there. It never serves the last known token: its
//! logits are needed, so a prompt fully covered by pages still recomputes its last token (at
//! most `floor((len - 1) / page_tokens)` pages are served). Every lookup that could not serve all
//! of `len - 1` tokens records why ([`MissReason`]).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

use super::ledger::BlockLedger;
use super::page::{ImageKey, MissReason, PageHash, PageHasher, PoolIdentity, PrefixHit};
use super::restore_cost::RestoreCost;
use super::KvError;

pub type SeqId = u64;

/// Blocks held by one owner. Each block id in it carries one reference; dropping the allocation
/// gives the references back to the pool (RAII), so a dropped table can never leak blocks.
#[derive(Debug)]
pub struct Allocation {
    blocks: Vec<u32>,
    returns: Sender<Vec<u32>>,
}

impl Allocation {
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        if !self.blocks.is_empty() {
            // The receiver lives as long as the pool; after the pool is gone nothing is owed.
            let _ = self.returns.send(std::mem::take(&mut self.blocks));
        }
    }
}

/// A page that left memory: its blocks are free again once the spill tier has read them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EvictedPage {
    pub hash: PageHash,
    pub parent: Option<PageHash>,
    pub blocks: Vec<u32>,
    /// The recurrent-state snapshot at the page end (hybrid models): spilled with the blocks as one
    /// unit.
    pub snapshot: Option<Arc<[u8]>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvPoolConfig {
    pub num_blocks: usize,
    pub block_size: usize,
    /// Prefix-cache page size in tokens: a multiple of `block_size`, or 0 to turn the prefix cache
    /// off (nothing is published or looked up).
    pub page_tokens: usize,
    /// Recurrent-state slots (0 for attention-only models: every sequence gets slot 0).
    pub state_slots: usize,
    /// Bytes of one recurrent-state snapshot (the backend's state slot image). 0 for
    /// attention-only models; otherwise a page is published only with its snapshot (see
    /// [`snapshot`]).
    pub snapshot_bytes: usize,
}

impl KvPoolConfig {
    pub fn validate(&self) -> Result<(), KvError> {
        if self.block_size == 0 {
            return Err(KvError::InvalidPool("block_size must be at least 1 token".into()));
        }
        if self.num_blocks == 0 {
            return Err(KvError::InvalidPool("the pool needs at least one block".into()));
        }
        if self.num_blocks > u32::MAX as usize {
            return Err(KvError::InvalidPool(format!("{} blocks exceed what u32 block ids can name", self.num_blocks)));
        }
        if !self.page_tokens.is_multiple_of(self.block_size) {
            return Err(KvError::InvalidPool(format!(
                "page_tokens ({}) must be a multiple of block_size ({})",
                self.page_tokens, self.block_size
            )));
        }
        Ok(())
    }
}

#[derive(Debug)]
struct Page {
    parent: Option<PageHash>,
    blocks: Vec<u32>,
    /// Set while nobody references the page: its key in the LRU.
    lru_tick: Option<u64>,
    /// Recurrent state at the page end (hybrid models only).
    snapshot: Option<Arc<[u8]>>,
}

#[derive(Debug)]
struct SeqKv {
    /// Every token known for the sequence (prompt and generated).
    tokens: Vec<u32>,
    /// Leading tokens whose KV is in `alloc`.
    computed: usize,
    alloc: Allocation,
    /// Identities of the sequence's whole computed pages, in order (published or not).
    page_hashes: Vec<PageHash>,
    /// Images in its prompt: part of the identity of every page they touch and every page after.
    images: Vec<ImageKey>,
    slot: Option<u32>,
    /// Snapshots delivered for pages not yet published, by page index (hybrid models).
    snapshots: BTreeMap<usize, Arc<[u8]>>,
}

/// Lookup and cache counters since the pool was made (the actor turns them into metrics).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolCounters {
    pub queries: u64,
    pub hit_tokens: u64,
    pub misses: BTreeMap<MissReason, u64>,
    pub evictions: u64,
    /// Whole pages of a hybrid model left unpublished because no snapshot was taken at their end
    /// (a multi-token step crossed the boundary).
    pub unsnapshotted_pages: u64,
    /// Spilled prefixes read back from disk (admissions that waited for restores).
    pub restores_chosen: u64,
    /// Spilled prefixes recomputed instead, because the restore cost model priced the read above
    /// the recompute.
    pub restores_declined: u64,
}

/// Remembered identities of recently evicted pages, for the `evicted` miss reason.
const EVICTED_MEMORY: usize = 1 << 16;

pub struct KvPool {
    cfg: KvPoolConfig,
    hasher: PageHasher,
    /// Free blocks, reference counts and page owners, sized by the blocks ever handed out
    /// (`ledger`), so a pool of billions of tokens starts in constant time.
    blocks: BlockLedger,
    pages: HashMap<PageHash, Page>,
    /// Unreferenced cached pages by last use (oldest first).
    lru: BTreeMap<u64, PageHash>,
    lru_blocks: usize,
    tick: u64,
    seqs: HashMap<SeqId, SeqKv>,
    free_slots: Vec<u32>,
    returns_tx: Sender<Vec<u32>>,
    returns_rx: Receiver<Vec<u32>>,
    evicted_out: Vec<EvictedPage>,
    evicted_recent: HashSet<PageHash>,
    evicted_order: VecDeque<PageHash>,
    /// Pages whose spilled copy turned out corrupt (the spill tier reports them).
    corrupt: HashSet<PageHash>,
    /// Pages the spill tier holds on disk, with their parents.
    spilled: HashMap<PageHash, Option<PageHash>>,
    /// Of those, the pages the spill tier also holds in host memory (restored without a read).
    in_host: HashSet<PageHash>,
    /// Pages being restored from disk: blocks held until the image is written.
    restoring: HashMap<PageHash, (Option<PageHash>, Allocation)>,
    /// Snapshots to write into the slots of sequences that just got a prefix hit.
    state_writes_out: Vec<StateWrite>,
    /// Prices restores against recomputation; `None` restores every spilled prefix it can.
    restore_cost: Option<RestoreCost>,
    counters: PoolCounters,
}

impl std::fmt::Debug for KvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPool")
            .field("cfg", &self.cfg)
            .field("free", &self.blocks.num_free())
            .field("cached", &self.lru_blocks)
            .field("seqs", &self.seqs.len())
            .finish()
    }
}

impl KvPool {
    pub fn new(cfg: KvPoolConfig, identity: &PoolIdentity) -> Result<Self, KvError> {
        cfg.validate()?;
        let (returns_tx, returns_rx) = channel();
        let n = cfg.num_blocks;
        Ok(Self {
            hasher: PageHasher::new(identity),
            blocks: BlockLedger::new(n),
            pages: HashMap::new(),
            lru: BTreeMap::new(),
            lru_blocks: 0,
            tick: 0,
            seqs: HashMap::new(),
            free_slots: (0..cfg.state_slots as u32).rev().collect(),
            returns_tx,
            returns_rx,
            evicted_out: Vec::new(),
            evicted_recent: HashSet::new(),
            evicted_order: VecDeque::new(),
            corrupt: HashSet::new(),
            spilled: HashMap::new(),
            in_host: HashSet::new(),
            restoring: HashMap::new(),
            state_writes_out: Vec::new(),
            restore_cost: None,
            counters: PoolCounters::default(),
            cfg,
        })
    }

    pub fn config(&self) -> &KvPoolConfig {
        &self.cfg
    }

    pub fn hasher(&self) -> &PageHasher {
        &self.hasher
    }

    pub fn counters(&self) -> &PoolCounters {
        &self.counters
    }

    pub fn num_blocks(&self) -> usize {
        self.cfg.num_blocks
    }

    /// Host bytes of the per-block bookkeeping: grows with the blocks ever handed out, not with
    /// the pool's size.
    pub fn block_bookkeeping_bytes(&self) -> usize {
        self.blocks.host_bytes()
    }

    /// Blocks on the free list.
    pub fn num_free(&self) -> usize {
        self.blocks.num_free()
    }

    /// Blocks of cached pages nobody references (reclaimable by eviction).
    pub fn num_evictable(&self) -> usize {
        self.lru_blocks
    }

    /// Blocks a new allocation can get: free plus evictable.
    pub fn num_available(&self) -> usize {
        self.blocks.num_free() + self.lru_blocks
    }

    /// Blocks referenced by someone.
    pub fn num_referenced(&self) -> usize {
        self.num_blocks() - self.num_available()
    }

    /// Cached pages (referenced or not).
    pub fn num_cached_pages(&self) -> usize {
        self.pages.len()
    }

    pub fn contains_page(&self, hash: &PageHash) -> bool {
        self.pages.contains_key(hash)
    }

    pub fn is_registered(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }

    /// The block table of a sequence (empty for unknown ones).
    pub fn blocks_of(&self, seq: SeqId) -> &[u32] {
        self.seqs.get(&seq).map_or(&[], |s| s.alloc.blocks())
    }

    /// Tokens known for a sequence (prompt and generated).
    pub fn known_tokens(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.tokens.len())
    }

    pub fn computed_of(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.computed)
    }

    /// Recurrent-state slot of a sequence holding blocks (0 when the model has no recurrent state).
    pub fn slot_of(&self, seq: SeqId) -> u32 {
        self.seqs.get(&seq).and_then(|s| s.slot).unwrap_or(0)
    }

    /// Blocks that would become available if `seq` let go of everything: those only it references.
    pub fn exclusive_blocks(&self, seq: SeqId) -> usize {
        let Some(s) = self.seqs.get(&seq) else { return 0 };
        s.alloc.blocks().iter().filter(|&&b| self.blocks.refcount(b) == 1).count()
    }

    /// Sequences holding a block table.
    pub fn seq_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    /// Hands out `n` blocks (evicting cached pages if the free list is short). All or nothing.
    pub fn allocate(&mut self, n: usize) -> Result<Allocation, KvError> {
        self.reclaim();
        let mut alloc = Allocation { blocks: Vec::with_capacity(n), returns: self.returns_tx.clone() };
        self.take_blocks(n, &mut alloc.blocks)?;
        Ok(alloc)
    }

    /// A new sequence with its known tokens and no blocks yet.
    pub fn register(&mut self, seq: SeqId, tokens: Vec<u32>) -> Result<(), KvError> {
        self.register_with_images(seq, tokens, Vec::new())
    }

    /// [`Self::register`] for a prompt with images (their placeholder spans and content hashes),
    /// which key the pages they touch: the same image and text hit, a different image never does.
    pub fn register_with_images(&mut self, seq: SeqId, tokens: Vec<u32>, images: Vec<ImageKey>) -> Result<(), KvError> {
        if self.seqs.contains_key(&seq) {
            return Err(KvError::DuplicateSeq(seq));
        }
        let alloc = Allocation { blocks: Vec::new(), returns: self.returns_tx.clone() };
        let kv = SeqKv {
            tokens,
            computed: 0,
            alloc,
            page_hashes: Vec::new(),
            images,
            slot: None,
            snapshots: BTreeMap::new(),
        };
        self.seqs.insert(seq, kv);
        Ok(())
    }

    /// Looks up the cached prefix of `tokens` without taking it.
    pub fn lookup(&self, tokens: &[u32]) -> (Vec<PageHash>, PrefixHit) {
        self.lookup_with_images(tokens, &[])
    }

    /// [`Self::lookup`] for tokens with images at `images`.
    pub fn lookup_with_images(&self, tokens: &[u32], images: &[ImageKey]) -> (Vec<PageHash>, PrefixHit) {
        let p = self.cfg.page_tokens;
        if p == 0 || tokens.len() <= 1 {
            return (Vec::new(), PrefixHit { pages: 0, hit_tokens: 0, miss: None });
        }
        let eligible = tokens.len() - 1;
        let mut hashes = Vec::new();
        let mut parent = None;
        let mut miss = None;
        for i in 0..eligible / p {
            let h = self.hasher.page_at(parent, tokens, i, p, images);
            if !self.pages.contains_key(&h) {
                miss = Some(if self.corrupt.contains(&h) {
                    MissReason::SpilledCorrupt
                } else if self.evicted_recent.contains(&h) {
                    MissReason::Evicted
                } else {
                    MissReason::NoEntry
                });
                break;
            }
            hashes.push(h);
            parent = Some(h);
        }
        let hit_tokens = hashes.len() * p;
        if miss.is_none() && hit_tokens < eligible {
            miss = Some(MissReason::TailShorterThanPage);
        }
        let hit = PrefixHit { pages: hashes.len(), hit_tokens, miss };
        (hashes, hit)
    }

    /// Admission of a registered sequence that holds no blocks: takes its longest cached prefix
    /// (the pages gain a reference each) and a recurrent-state slot. Counts the lookup.
    pub fn acquire_prefix(&mut self, seq: SeqId) -> Result<PrefixHit, KvError> {
        self.reclaim();
        let s = self.seqs.get(&seq).ok_or(KvError::UnknownSeq(seq))?;
        if !s.alloc.is_empty() || s.computed != 0 {
            return Err(KvError::AlreadyAdmitted(seq));
        }
        let (hashes, hit) = self.lookup_with_images(&s.tokens, &s.images);
        let mut blocks = Vec::with_capacity(hashes.len() * self.page_blocks());
        for h in &hashes {
            self.touch_page(*h);
            let page = &self.pages[h];
            blocks.extend_from_slice(&page.blocks);
        }
        for &b in &blocks {
            *self.blocks.refcount_mut(b) += 1;
        }
        let slot = if self.cfg.state_slots == 0 { None } else { self.free_slots.pop() };
        let s = self.seqs.get_mut(&seq).ok_or(KvError::UnknownSeq(seq))?;
        s.alloc.blocks = blocks;
        s.computed = hit.hit_tokens;
        s.slot = slot;
        // A hybrid sequence resumes from the recurrent state at the last hit page's end.
        if let (Some(last), Some(slot)) = (hashes.last(), slot) {
            if let Some(image) = self.pages.get(last).and_then(|p| p.snapshot.clone()) {
                self.state_writes_out.push(StateWrite { seq, slot, image });
            }
        }
        let s = self.seqs.get_mut(&seq).ok_or(KvError::UnknownSeq(seq))?;
        s.page_hashes = hashes;
        if self.cfg.page_tokens > 0 {
            self.counters.queries += 1;
            self.counters.hit_tokens += hit.hit_tokens as u64;
            if let Some(m) = hit.miss {
                *self.counters.misses.entry(m).or_default() += 1;
            }
        }
        Ok(hit)
    }

    /// Makes `seq` hold blocks for at least `total_tokens` positions, evicting cached pages if the
    /// free list is short. All or nothing.
    pub fn grow(&mut self, seq: SeqId, total_tokens: usize) -> Result<(), KvError> {
        self.reclaim();
        let held = self.seqs.get(&seq).ok_or(KvError::UnknownSeq(seq))?.alloc.len();
        let missing = total_tokens.div_ceil(self.cfg.block_size).saturating_sub(held);
        if missing == 0 {
            return Ok(());
        }
        let mut got = Vec::with_capacity(missing);
        self.take_blocks(missing, &mut got)?;
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.alloc.blocks.extend_from_slice(&got);
        }
        Ok(())
    }

    /// Records progress: `new_tokens` were appended to the sequence's known tokens and KV is now
    /// written for its first `computed` tokens. Whole computed pages are published.
    pub fn advance(&mut self, seq: SeqId, new_tokens: &[u32], computed: usize) -> Result<(), KvError> {
        self.reclaim();
        let bs = self.cfg.block_size;
        let s = self.seqs.get_mut(&seq).ok_or(KvError::UnknownSeq(seq))?;
        s.tokens.extend_from_slice(new_tokens);
        if computed > s.tokens.len() || computed > s.alloc.len() * bs {
            return Err(KvError::BeyondBlocks { seq, computed, capacity: s.alloc.len() * bs, known: s.tokens.len() });
        }
        s.computed = computed;
        self.publish(seq);
        Ok(())
    }

    /// Preemption: `seq` lets go of its blocks and slot but stays registered with its tokens, so a
    /// later `acquire_prefix` finds its published pages (if still cached) and resumes there.
    pub fn reset(&mut self, seq: SeqId) -> Result<(), KvError> {
        let s = self.seqs.get_mut(&seq).ok_or(KvError::UnknownSeq(seq))?;
        let blocks = std::mem::take(&mut s.alloc.blocks);
        s.computed = 0;
        s.page_hashes.clear();
        s.snapshots.clear();
        let slot = s.slot.take();
        drop(Allocation { blocks, returns: self.returns_tx.clone() });
        if let Some(slot) = slot {
            self.free_slots.push(slot);
        }
        self.reclaim();
        Ok(())
    }

    /// The sequence is gone: its blocks and slot go back (published pages stay cached).
    pub fn release(&mut self, seq: SeqId) -> bool {
        let Some(s) = self.seqs.remove(&seq) else { return false };
        if let Some(slot) = s.slot {
            self.free_slots.push(slot);
        }
        drop(s);
        self.reclaim();
        true
    }

    /// Pages evicted since the last call, oldest first. Their blocks are already free: whoever
    /// copies them out must do so before the next step that writes KV.
    pub fn take_evicted(&mut self) -> Vec<EvictedPage> {
        std::mem::take(&mut self.evicted_out)
    }

    /// Panics unless every block is in exactly one state (free, cached-unreferenced, referenced),
    /// refcounts equal the references held by live sequences plus `extra_refs` (allocations held
    /// outside the pool), the LRU holds exactly the unreferenced pages, and slots are not shared.
    pub fn assert_accounting(&mut self, extra_refs: &[&Allocation]) {
        self.reclaim();
        let n = self.num_blocks();
        let mut refs = vec![0u32; n];
        for s in self.seqs.values() {
            for &b in s.alloc.blocks() {
                refs[b as usize] += 1;
            }
        }
        for a in extra_refs.iter().copied().chain(self.restoring.values().map(|(_, a)| a)) {
            for &b in a.blocks() {
                refs[b as usize] += 1;
            }
        }
        let held: Vec<u32> = (0..n as u32).map(|b| self.blocks.refcount(b)).collect();
        assert_eq!(refs, held, "refcounts differ from the references held");
        let mut on_free = vec![false; n];
        for b in self.blocks.free_blocks() {
            assert!(!on_free[b as usize], "block {b} is on the free list twice");
            on_free[b as usize] = true;
            assert_eq!(self.blocks.refcount(b), 0, "free block {b} is referenced");
            assert!(self.blocks.page(b).is_none(), "free block {b} belongs to a cached page");
        }
        let mut lru_blocks = 0;
        for (h, page) in &self.pages {
            let refd = page.blocks.iter().any(|&b| self.blocks.refcount(b) > 0);
            assert_eq!(page.lru_tick.is_none(), refd, "page {} is on the LRU iff unreferenced", h.to_hex());
            if let Some(t) = page.lru_tick {
                assert_eq!(self.lru.get(&t), Some(h), "LRU entry of page {} is stale", h.to_hex());
                lru_blocks += page.blocks.len();
            }
            for &b in &page.blocks {
                assert_eq!(self.blocks.page(b), Some(*h), "block {b} does not point at its page");
            }
            assert_eq!(
                page.snapshot.as_ref().map(|s| s.len()),
                self.needs_snapshots().then_some(self.cfg.snapshot_bytes),
                "page {} has a snapshot iff the model keeps recurrent state",
                h.to_hex()
            );
        }
        assert_eq!(self.lru.len(), self.pages.values().filter(|p| p.lru_tick.is_some()).count());
        assert_eq!(lru_blocks, self.lru_blocks, "LRU block count is off");
        for (b, &free) in on_free.iter().enumerate() {
            let (rc, page) = (self.blocks.refcount(b as u32), self.blocks.page(b as u32));
            let states = [free, rc > 0, page.is_some() && rc == 0];
            assert_eq!(states.iter().filter(|&&x| x).count(), 1, "block {b} is in {states:?}");
        }
        let mut slots = HashSet::new();
        for s in self.seqs.values() {
            if let Some(slot) = s.slot {
                assert!(slots.insert(slot), "state slot {slot} is shared");
            }
        }
        assert_eq!(slots.len() + self.free_slots.len(), self.cfg.state_slots, "a state slot leaked");
        if self.seqs.is_empty() && extra_refs.is_empty() && self.restoring.is_empty() {
            assert_eq!(self.blocks.num_free() + self.lru_blocks, n, "an idle pool holds referenced blocks");
        }
    }

    fn page_blocks(&self) -> usize {
        self.cfg.page_tokens / self.cfg.block_size
    }

    /// Applies every reference given back by dropped allocations. Every operation does this first
    /// and the sequence operations last, so counts are current except for allocations dropped
    /// outside the pool since its last operation.
    pub fn reclaim(&mut self) {
        while let Ok(blocks) = self.returns_rx.try_recv() {
            for b in blocks {
                let rc = self.blocks.refcount_mut(b);
                debug_assert!(*rc > 0, "block {b} returned more often than it was handed out");
                *rc = rc.saturating_sub(1);
                if *rc > 0 {
                    continue;
                }
                match self.blocks.page(b) {
                    None => self.blocks.free(b),
                    Some(h) => {
                        let unreferenced = self.pages.get(&h).is_some_and(|p| {
                            p.lru_tick.is_none() && p.blocks.iter().all(|&x| self.blocks.refcount(x) == 0)
                        });
                        if unreferenced {
                            self.push_lru(h);
                        }
                    }
                }
            }
        }
    }

    fn push_lru(&mut self, h: PageHash) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(p) = self.pages.get_mut(&h) {
            p.lru_tick = Some(tick);
            self.lru_blocks += p.blocks.len();
            self.lru.insert(tick, h);
        }
    }

    /// Takes a page off the LRU (it is about to be referenced).
    fn touch_page(&mut self, h: PageHash) {
        if let Some(p) = self.pages.get_mut(&h) {
            if let Some(t) = p.lru_tick.take() {
                self.lru.remove(&t);
                self.lru_blocks -= p.blocks.len();
            }
        }
    }

    /// Moves `n` blocks into `out` with one reference each, evicting LRU pages as needed.
    fn take_blocks(&mut self, n: usize, out: &mut Vec<u32>) -> Result<(), KvError> {
        let available = self.blocks.num_free() + self.lru_blocks;
        if n > available {
            return Err(KvError::OutOfBlocks { wanted: n, available });
        }
        while self.blocks.num_free() < n {
            let Some((_, h)) = self.lru.pop_first() else { break };
            self.evict(h);
        }
        if !self.blocks.take(n, out) {
            return Err(KvError::OutOfBlocks { wanted: n, available: self.blocks.num_free() });
        }
        Ok(())
    }

    fn evict(&mut self, h: PageHash) {
        let Some(page) = self.pages.remove(&h) else { return };
        self.lru_blocks -= page.blocks.len();
        for &b in &page.blocks {
            self.blocks.free(b);
        }
        self.counters.evictions += 1;
        if self.evicted_recent.insert(h) {
            self.evicted_order.push_back(h);
            if self.evicted_order.len() > EVICTED_MEMORY {
                if let Some(old) = self.evicted_order.pop_front() {
                    self.evicted_recent.remove(&old);
                }
            }
        }
        self.evicted_out.push(EvictedPage {
            hash: h,
            parent: page.parent,
            blocks: page.blocks,
            snapshot: page.snapshot,
        });
    }

    /// Enters every whole computed page of `seq` not yet in its chain into the index. A page some
    /// other sequence already published stays private to `seq` (its blocks are freed with it).
    fn publish(&mut self, seq: SeqId) {
        let p = self.cfg.page_tokens;
        if p == 0 {
            return;
        }
        let pb = p / self.cfg.block_size;
        let needs_snapshot = self.needs_snapshots();
        let Some(s) = self.seqs.get_mut(&seq) else { return };
        let whole = s.computed / p;
        while s.page_hashes.len() < whole {
            let i = s.page_hashes.len();
            let parent = s.page_hashes.last().copied();
            let h = self.hasher.page_at(parent, &s.tokens, i, p, &s.images);
            s.page_hashes.push(h);
            let snapshot = s.snapshots.remove(&i);
            let blocks = &s.alloc.blocks[i * pb..(i + 1) * pb];
            if self.pages.contains_key(&h) || blocks.iter().any(|&b| self.blocks.page(b).is_some()) {
                continue;
            }
            if needs_snapshot && snapshot.is_none() {
                // Without the state at its end the page cannot be resumed from: recompute it.
                self.counters.unsnapshotted_pages += 1;
                continue;
            }
            for &b in blocks {
                self.blocks.set_page(b, Some(h));
            }
            self.corrupt.remove(&h);
            self.pages.insert(h, Page { parent, blocks: blocks.to_vec(), lru_tick: None, snapshot });
        }
        // Snapshots of pages this sequence has passed are of no further use.
        s.snapshots = s.snapshots.split_off(&whole);
    }
}

#[path = "restore.rs"]
mod restore;
#[path = "snapshot.rs"]
pub mod snapshot;
use snapshot::StateWrite;

#[cfg(test)]
#[path = "pool_tests.rs"]
mod tests;
