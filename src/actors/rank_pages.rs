//! Spilled pages of a tensor-parallel group whose ranks are executors of their own (`--tp N` of a
//! llama-family model, and every `serve --head` group): each rank's KV memory holds only its own
//! KV heads' slice of a page, so a page image is every rank's slice in rank order (rank 0's first;
//! a hybrid model's recurrent-state snapshot, already joined by `rank_state::StateParts`, stays
//! appended at the end). Plain data and policy, no actor code:
//!
//! - [`SliceJoin`] joins the slices the ranks copy out of an evicted page (they arrive in any
//!   order, from other processes too) into the one image the spill tier stores, and drops — never
//!   stores short — a page some rank's slice is missing from, of the wrong size, or unreadable.
//!   A rank ends each batch of pages with [`SliceReport::Done`] after its slices, so a slice that
//!   never comes is known at once; a rank that failed ends every open batch.
//! - [`PageParts`] splits a restored image into the ranks' slices (each written by its executor).

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;

use crate::kv::PageHash;

/// What a rank's executor reports while it copies out its slices of a batch of pages (travels from
/// a worker's executor to the head's scheduler, which hands it to the spill tier).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum SliceReport {
    /// Rank `rank`'s slice of the batch's `index`-th page (its KV heads of every block of the page,
    /// block after block), or why it could not be read.
    Page { rank: usize, batch: u64, index: usize, hash: PageHash, image: Result<Vec<u8>, String> },
    /// Every slice of `batch` this rank will send has been sent.
    Done { rank: usize, batch: u64 },
}

/// Why a page's slices could not be joined (or an image split): the page is dropped, not stored.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SliceError {
    #[error("rank {rank}'s slice has {got} bytes, {want} expected")]
    WrongSize { rank: usize, got: usize, want: usize },
    #[error("rank {rank} could not read its slice: {why}")]
    ReadFailed { rank: usize, why: String },
    #[error("rank {rank} sent its slice twice")]
    Duplicate { rank: usize },
    #[error("rank {rank} ended the batch without sending its slice")]
    Missing { rank: usize },
    #[error("rank {rank} failed before its slice came")]
    RankFailed { rank: usize },
    #[error("a page image of {got} bytes, the group's pages of {blocks} blocks hold {want} ({ranks} ranks)")]
    WrongImage { got: usize, want: usize, blocks: usize, ranks: usize },
}

impl SliceError {
    /// A label for `shelfserve_spill_slices_dropped_total{reason}`.
    pub fn kind(&self) -> &'static str {
        match self {
            SliceError::WrongSize { .. } | SliceError::WrongImage { .. } => "wrong_size",
            SliceError::ReadFailed { .. } => "read_failed",
            SliceError::Duplicate { .. } => "duplicate",
            SliceError::Missing { .. } => "missing",
            SliceError::RankFailed { .. } => "rank_failed",
        }
    }
}

/// The width in bytes of each rank's slice of one KV block (the ranks' `kv_block_bytes`, as their
/// `ExecutorReady` reported it), rank 0 first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PageParts {
    widths: Vec<usize>,
}

impl PageParts {
    pub fn new(widths: Vec<usize>) -> Self {
        PageParts { widths }
    }

    pub fn ranks(&self) -> usize {
        self.widths.len()
    }

    /// Bytes of the group's image of one block (every rank's slice).
    pub fn block_bytes(&self) -> usize {
        self.widths.iter().sum()
    }

    /// Rank `rank`'s slice of a page of `blocks` blocks.
    fn slice_bytes(&self, rank: usize, blocks: usize) -> usize {
        self.widths[rank] * blocks
    }

    /// Each rank's slice of the KV part `kv` of a page of `blocks` blocks, rank 0 first (views of
    /// the same bytes, not copies).
    pub fn split(&self, kv: &Bytes, blocks: usize) -> Result<Vec<Bytes>, SliceError> {
        let want = self.block_bytes() * blocks;
        if kv.len() != want {
            return Err(SliceError::WrongImage { got: kv.len(), want, blocks, ranks: self.ranks() });
        }
        let mut at = 0;
        Ok((0..self.ranks())
            .map(|rank| {
                let w = self.slice_bytes(rank, blocks);
                let part = kv.slice(at..at + w);
                at += w;
                part
            })
            .collect())
    }
}

/// A page of a batch whose slices the ranks were asked to copy out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpectedPage {
    pub hash: PageHash,
    pub parent: Option<PageHash>,
    pub blocks: usize,
    /// The group's recurrent-state snapshot at the page end (hybrid models), appended to the image.
    pub snapshot: Option<Arc<[u8]>>,
}

/// A whole page image, ready for the spill tier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JoinedPage {
    pub hash: PageHash,
    pub parent: Option<PageHash>,
    pub image: Vec<u8>,
}

/// What a report led to.
#[derive(Debug, PartialEq, Eq)]
pub enum JoinEvent<W> {
    /// Every rank's slice of the page came: store it.
    Joined(JoinedPage),
    /// The page cannot be joined; it is not stored (a later lookup recomputes it).
    Dropped { hash: PageHash, error: SliceError },
    /// A batch with a waiter (a drained shutdown's flush) ended, and so did every batch before it:
    /// every page they joined has been handed out before this event.
    Flushed(W),
}

struct Pending {
    page: ExpectedPage,
    /// Each rank's slice once it came.
    slices: Vec<Option<Vec<u8>>>,
}

struct Batch<W> {
    /// By index in the batch; `None` once joined or dropped.
    pages: Vec<Option<Pending>>,
    done: Vec<bool>,
    waiter: Option<W>,
}

/// Joins the ranks' slices of evicted pages, batch by batch (`W`: what waits for a batch, the
/// flush's reply port).
pub struct SliceJoin<W> {
    parts: PageParts,
    /// Open batches by id (ids grow: the pool numbers them).
    batches: BTreeMap<u64, Batch<W>>,
    /// Waiters of batches that ended while an earlier batch is still open.
    parked: Vec<(u64, W)>,
    /// Ranks reported failed: nothing more is expected from them, and no page can be whole.
    failed: Vec<bool>,
}

impl<W> SliceJoin<W> {
    pub fn new(parts: PageParts) -> Self {
        let ranks = parts.ranks();
        SliceJoin { parts, batches: BTreeMap::new(), parked: Vec::new(), failed: vec![false; ranks] }
    }

    /// Pages whose slices are still awaited (diagnostics, tests).
    pub fn pending_pages(&self) -> usize {
        self.batches.values().flat_map(|b| &b.pages).flatten().count()
    }

    /// The ranks were asked for their slices of `pages` as batch `batch`; `waiter` is released
    /// (`Flushed`) once the batch and every earlier one ended.
    pub fn expect(&mut self, batch: u64, pages: Vec<ExpectedPage>, waiter: Option<W>) -> Vec<JoinEvent<W>> {
        let ranks = self.parts.ranks();
        let pages = pages.into_iter().map(|page| Some(Pending { page, slices: vec![None; ranks] })).collect();
        self.batches.insert(batch, Batch { pages, done: vec![false; ranks], waiter });
        let mut events = Vec::new();
        // A failed rank sends nothing more: the batch can only end with its pages dropped.
        self.end_if_done(batch, &mut events);
        self.release_waiters(&mut events);
        events
    }

    /// A rank's report.
    pub fn report(&mut self, report: SliceReport) -> Vec<JoinEvent<W>> {
        let mut events = Vec::new();
        match report {
            SliceReport::Page { rank, batch, index, hash, image } => {
                self.on_slice(rank, batch, index, hash, image, &mut events)
            }
            SliceReport::Done { rank, batch } => {
                match self.batches.get_mut(&batch).and_then(|b| b.done.get_mut(rank)) {
                    Some(done) => *done = true,
                    None => tracing::debug!(rank, batch, "a batch end for no open batch (it ended already)"),
                }
                self.end_if_done(batch, &mut events);
            }
        }
        self.release_waiters(&mut events);
        events
    }

    /// Rank `rank` failed: every page still waiting is dropped (its slice will never come), every
    /// open batch ends, and so will every later one.
    pub fn rank_failed(&mut self, rank: usize) -> Vec<JoinEvent<W>> {
        let mut events = Vec::new();
        if let Some(f) = self.failed.get_mut(rank) {
            *f = true;
        }
        let open: Vec<u64> = self.batches.keys().copied().collect();
        for batch in open {
            self.end_if_done(batch, &mut events);
        }
        self.release_waiters(&mut events);
        events
    }

    fn on_slice(
        &mut self,
        rank: usize,
        batch: u64,
        index: usize,
        hash: PageHash,
        image: Result<Vec<u8>, String>,
        events: &mut Vec<JoinEvent<W>>,
    ) {
        let Some(entry) = self.batches.get_mut(&batch).and_then(|b| b.pages.get_mut(index)) else {
            tracing::debug!(rank, batch, index, "a page slice for no open batch (it ended already)");
            return;
        };
        let Some(pending) = entry.as_mut().filter(|p| p.page.hash == hash && rank < p.slices.len()) else {
            // Already joined or dropped, or not the page the batch has there: nothing to add to.
            tracing::debug!(rank, batch, index, page = %hash.to_hex(), "a page slice for no waiting page");
            return;
        };
        let want = self.parts.slice_bytes(rank, pending.page.blocks);
        let error = match image {
            Err(why) => Some(SliceError::ReadFailed { rank, why }),
            Ok(_) if pending.slices[rank].is_some() => Some(SliceError::Duplicate { rank }),
            Ok(image) if image.len() != want => Some(SliceError::WrongSize { rank, got: image.len(), want }),
            Ok(image) => {
                pending.slices[rank] = Some(image);
                None
            }
        };
        if let Some(error) = error {
            *entry = None;
            events.push(JoinEvent::Dropped { hash, error });
            return;
        }
        if pending.slices.iter().all(Option::is_some) {
            let Some(Pending { page, slices }) = entry.take() else { return };
            let snapshot = page.snapshot.as_deref().unwrap_or_default();
            let mut image = Vec::with_capacity(slices.iter().flatten().map(Vec::len).sum::<usize>() + snapshot.len());
            for s in slices.iter().flatten() {
                image.extend_from_slice(s);
            }
            image.extend_from_slice(snapshot);
            events.push(JoinEvent::Joined(JoinedPage { hash: page.hash, parent: page.parent, image }));
        }
    }

    /// Ends `batch` once every rank is done with it, or at once when a rank failed (its slices
    /// will never come): pages still waiting lack a slice and are dropped.
    fn end_if_done(&mut self, batch: u64, events: &mut Vec<JoinEvent<W>>) {
        let Some(b) = self.batches.get(&batch) else { return };
        let any_failed = self.failed.iter().any(|&f| f);
        if !any_failed && !b.done.iter().all(|&d| d) {
            return;
        }
        let Some(b) = self.batches.remove(&batch) else { return };
        for p in b.pages.into_iter().flatten() {
            // Name a failed rank whose slice is missing, else the first rank done without it.
            let missing =
                |failed: bool| p.slices.iter().enumerate().position(|(r, s)| s.is_none() && self.failed[r] == failed);
            let error = match (missing(true), missing(false)) {
                (Some(rank), _) => SliceError::RankFailed { rank },
                (None, Some(rank)) => SliceError::Missing { rank },
                // Every slice came but the page was not joined: cannot happen (joined on the last).
                (None, None) => continue,
            };
            events.push(JoinEvent::Dropped { hash: p.page.hash, error });
        }
        if let Some(w) = b.waiter {
            self.parked.push((batch, w));
        }
    }

    /// Waiters whose batch and every earlier batch ended.
    fn release_waiters(&mut self, events: &mut Vec<JoinEvent<W>>) {
        let first_open = self.batches.keys().next().copied();
        let (ready, parked): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.parked).into_iter().partition(|(b, _)| first_open.is_none_or(|open| *b < open));
        self.parked = parked;
        events.extend(ready.into_iter().map(|(_, w)| JoinEvent::Flushed(w)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(n: u8) -> PageHash {
        PageHash([n; 16])
    }

    fn page(n: u8, blocks: usize, snapshot: Option<&[u8]>) -> ExpectedPage {
        ExpectedPage { hash: hash(n), parent: Some(hash(n - 1)), blocks, snapshot: snapshot.map(Arc::from) }
    }

    fn slice(rank: usize, batch: u64, index: usize, n: u8, bytes: &[u8]) -> SliceReport {
        SliceReport::Page { rank, batch, index, hash: hash(n), image: Ok(bytes.to_vec()) }
    }

    fn done(rank: usize, batch: u64) -> SliceReport {
        SliceReport::Done { rank, batch }
    }

    fn joined(n: u8, image: &[u8]) -> JoinEvent<&'static str> {
        JoinEvent::Joined(JoinedPage { hash: hash(n), parent: Some(hash(n - 1)), image: image.to_vec() })
    }

    #[test]
    fn slices_arriving_in_any_order_join_in_rank_order_with_the_snapshot_last() {
        // Rank 0's blocks are 2 bytes wide, rank 1's 1 byte; pages of 2 blocks.
        let mut j: SliceJoin<&str> = SliceJoin::new(PageParts::new(vec![2, 1]));
        assert!(j.expect(1, vec![page(5, 2, Some(&[9])), page(6, 2, None)], None).is_empty());
        assert!(j.report(slice(1, 1, 1, 6, &[60, 61])).is_empty());
        assert!(j.report(slice(1, 1, 0, 5, &[50, 51])).is_empty());
        assert_eq!(j.report(slice(0, 1, 1, 6, &[1, 2, 3, 4])), vec![joined(6, &[1, 2, 3, 4, 60, 61])]);
        assert!(j.report(done(1, 1)).is_empty());
        assert_eq!(j.report(slice(0, 1, 0, 5, &[5, 6, 7, 8])), vec![joined(5, &[5, 6, 7, 8, 50, 51, 9])]);
        assert_eq!(j.pending_pages(), 0);
        assert!(j.report(done(0, 1)).is_empty());
        // Late or stray reports for an ended batch change nothing.
        assert!(j.report(slice(0, 1, 0, 5, &[5, 6, 7, 8])).is_empty());
        assert!(j.report(done(0, 1)).is_empty());
    }

    #[test]
    fn a_missing_wrong_or_unreadable_slice_drops_its_page_and_only_it() {
        let mut j: SliceJoin<&str> = SliceJoin::new(PageParts::new(vec![1, 1]));
        let pages = (1..=5).map(|n| page(n, 2, None)).collect();
        j.expect(7, pages, None);
        // Page 1: whole. Page 2: rank 1's slice never comes. Page 3: rank 1's is too short.
        // Page 4: rank 0 could not read it. Page 5: rank 1 sends it twice (the first one counts
        // and the page joins; the second is a stray).
        for (index, n) in (1..=5u8).enumerate() {
            if n != 4 {
                j.report(slice(0, 7, index, n, &[n, n]));
            }
        }
        let r0 = SliceReport::Page { rank: 0, batch: 7, index: 3, hash: hash(4), image: Err("device lost".into()) };
        let dropped4 = j.report(r0);
        assert_eq!(
            dropped4,
            vec![JoinEvent::Dropped {
                hash: hash(4),
                error: SliceError::ReadFailed { rank: 0, why: "device lost".into() }
            }]
        );
        assert_eq!(j.report(slice(1, 7, 0, 1, &[10, 11])), vec![joined(1, &[1, 1, 10, 11])]);
        let short = j.report(slice(1, 7, 2, 3, &[30]));
        assert_eq!(
            short,
            vec![JoinEvent::Dropped { hash: hash(3), error: SliceError::WrongSize { rank: 1, got: 1, want: 2 } }]
        );
        // Rank 1's slice of page 4 comes after the page was dropped: ignored.
        assert!(j.report(slice(1, 7, 3, 4, &[40, 41])).is_empty());
        assert_eq!(j.report(slice(1, 7, 4, 5, &[50, 51])), vec![joined(5, &[5, 5, 50, 51])]);
        assert!(j.report(slice(1, 7, 4, 5, &[50, 51])).is_empty(), "a page joined already");
        // A slice under the wrong page's hash is not that page's.
        assert!(j.report(slice(1, 7, 1, 9, &[20, 21])).is_empty());
        assert!(j.report(done(0, 7)).is_empty());
        assert_eq!(j.pending_pages(), 1);
        // Rank 1 ends the batch without page 2's slice: dropped now, never left hanging.
        assert_eq!(
            j.report(done(1, 7)),
            vec![JoinEvent::Dropped { hash: hash(2), error: SliceError::Missing { rank: 1 } }]
        );
        assert_eq!(j.pending_pages(), 0);
        // A page with the same rank's slice twice while still waiting for another rank.
        let mut j: SliceJoin<&str> = SliceJoin::new(PageParts::new(vec![1, 1]));
        j.expect(1, vec![page(1, 1, None)], None);
        assert!(j.report(slice(0, 1, 0, 1, &[1])).is_empty());
        assert_eq!(
            j.report(slice(0, 1, 0, 1, &[1])),
            vec![JoinEvent::Dropped { hash: hash(1), error: SliceError::Duplicate { rank: 0 } }]
        );
    }

    #[test]
    fn a_failed_rank_ends_every_open_batch_and_releases_the_flush() {
        let mut j: SliceJoin<&str> = SliceJoin::new(PageParts::new(vec![1, 1, 1]));
        j.expect(1, vec![page(1, 1, None)], None);
        j.expect(2, vec![page(2, 1, None)], Some("flush"));
        j.report(slice(0, 1, 0, 1, &[1]));
        j.report(slice(2, 1, 0, 1, &[3]));
        let events = j.rank_failed(1);
        assert_eq!(
            events,
            vec![
                JoinEvent::Dropped { hash: hash(1), error: SliceError::RankFailed { rank: 1 } },
                JoinEvent::Dropped { hash: hash(2), error: SliceError::RankFailed { rank: 1 } },
                JoinEvent::Flushed("flush"),
            ]
        );
        // Later batches end at once: no page can be whole without rank 1.
        let events = j.expect(3, vec![page(3, 1, None)], Some("again"));
        assert_eq!(
            events,
            vec![
                JoinEvent::Dropped { hash: hash(3), error: SliceError::RankFailed { rank: 1 } },
                JoinEvent::Flushed("again")
            ]
        );
        assert_eq!(j.pending_pages(), 0);
    }

    #[test]
    fn a_flush_is_released_only_after_every_earlier_batch() {
        let mut j: SliceJoin<&str> = SliceJoin::new(PageParts::new(vec![1, 1]));
        j.expect(1, vec![page(1, 1, None)], None);
        // The flush: no pages of its own (everything cached was already on disk).
        assert!(j.expect(2, Vec::new(), Some("flush")).is_empty());
        assert!(j.report(done(0, 2)).is_empty());
        assert!(j.report(done(1, 2)).is_empty(), "batch 1 is still open");
        j.report(slice(0, 1, 0, 1, &[1]));
        assert_eq!(j.report(slice(1, 1, 0, 1, &[2])), vec![joined(1, &[1, 2])]);
        assert!(j.report(done(0, 1)).is_empty());
        assert_eq!(j.report(done(1, 1)), vec![JoinEvent::Flushed("flush")]);
    }

    #[test]
    fn a_restored_image_splits_into_each_ranks_slice_by_its_block_width() {
        let parts = PageParts::new(vec![3, 1]);
        assert_eq!(parts.block_bytes(), 4);
        let kv = Bytes::from_static(&[0, 0, 0, 0, 0, 0, 1, 1]);
        let split = parts.split(&kv, 2).unwrap();
        assert_eq!(split, [Bytes::from_static(&[0; 6]), Bytes::from_static(&[1, 1])]);
        // The image of another group shape (a different rank count or width) is refused.
        let err = parts.split(&kv, 3).unwrap_err();
        assert_eq!(err, SliceError::WrongImage { got: 8, want: 12, blocks: 3, ranks: 2 });
        assert!(PageParts::new(vec![2, 2, 2]).split(&kv, 2).is_err());
    }
}
