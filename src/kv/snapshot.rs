//! Recurrent-state snapshots of cached pages (hybrid models, e.g. `glm5_next`'s KDA layers).
//!
//! A hybrid model's sequence cannot resume from attention blocks alone: its recurrent state (KDA
//! conv window + recurrent state, the backend's `read_state_slot` image) must be the one at the
//! exact position where the cached prefix ends. So on such a model a page is published only with
//! the snapshot of that state taken when the sequence's computed length reached the page's end
//! (the executor reads the slot after a step that ends exactly on a page boundary, and has the
//! backend keep the state at the boundaries a prefill chunk crosses). A page whose snapshot never
//! came (a step crossed the boundary on a backend that cannot read state inside a step) is not
//! published: a lookup stops before it and the tokens are recomputed.
//!
//! Where the bytes live: in host memory, owned by the `KvPool` (hence by the `KvPoolActor`), one
//! `Arc<[u8]>` per cached page, dropped with the page when it is evicted (the spill tier gets it
//! as part of the page's image). Bounded: at most one per cached page (`num_blocks / page_blocks`
//! pages) plus the snapshots delivered for pages not yet published (at most the pages a running
//! sequence completed in one step). [`KvPool::snapshot_bytes_held`] reports the total.
//!
//! On a prefix hit the pool emits a [`StateWrite`] with the last hit page's snapshot for the
//! sequence's slot; the pool actor sends it to the executor before the step that continues from it.

use std::sync::Arc;

use super::{KvPool, SeqId};
use crate::kv::{KvError, PageHash};

/// The recurrent state of `seq` after its first `tokens` tokens (a page boundary), as the backend's
/// `read_state_slot` wrote it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SlotSnapshot {
    pub seq: SeqId,
    pub tokens: usize,
    pub image: Arc<[u8]>,
}

/// A prefix hit on a hybrid model: write `image` (the last hit page's snapshot) into `slot` before
/// `seq`'s next step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateWrite {
    pub seq: SeqId,
    pub slot: u32,
    pub image: Arc<[u8]>,
}

impl KvPool {
    /// True when pages need a recurrent-state snapshot to be published (a hybrid model).
    pub fn needs_snapshots(&self) -> bool {
        self.cfg.snapshot_bytes > 0
    }

    /// Takes the snapshot of `seq`'s state at its `tokens`-th token, which must be a page
    /// boundary. It is kept until the page is published with it (the `Advance` that follows the
    /// step); a snapshot for a page already published, or for an unknown sequence (cancelled while
    /// its step ran), is dropped.
    pub fn add_snapshot(&mut self, snap: SlotSnapshot) -> Result<(), KvError> {
        let p = self.cfg.page_tokens;
        if !self.needs_snapshots() || p == 0 {
            return Ok(());
        }
        if snap.tokens == 0 || !snap.tokens.is_multiple_of(p) || snap.image.len() != self.cfg.snapshot_bytes {
            return Err(KvError::InvalidPool(format!(
                "a state snapshot of {} bytes at token {} does not fit pages of {p} tokens and {}-byte snapshots",
                snap.image.len(),
                snap.tokens,
                self.cfg.snapshot_bytes
            )));
        }
        let Some(s) = self.seqs.get_mut(&snap.seq) else { return Ok(()) };
        let page = snap.tokens / p - 1;
        if page >= s.page_hashes.len() {
            s.snapshots.insert(page, snap.image);
        }
        Ok(())
    }

    /// State writes for prefix hits since the last call, in admission order.
    pub fn take_state_writes(&mut self) -> Vec<StateWrite> {
        std::mem::take(&mut self.state_writes_out)
    }

    /// Host bytes of every snapshot the pool holds (cached pages and not yet published ones).
    pub fn snapshot_bytes_held(&self) -> usize {
        let pages = self.pages.values().filter_map(|p| p.snapshot.as_ref()).map(|s| s.len());
        let pending = self.seqs.values().flat_map(|s| s.snapshots.values()).map(|s| s.len());
        pages.chain(pending).sum()
    }

    /// The snapshot of a cached page, if it has one.
    pub fn page_snapshot(&self, hash: &PageHash) -> Option<&Arc<[u8]>> {
        self.pages.get(hash).and_then(|p| p.snapshot.as_ref())
    }

    /// Checks a snapshot that came back from the spill tier with a restored page: hybrid pools
    /// need one of the right size, attention-only pools none.
    pub(super) fn restored_snapshot_fits(&self, snapshot: &Option<Arc<[u8]>>) -> bool {
        match snapshot {
            None => !self.needs_snapshots(),
            Some(s) => s.len() == self.cfg.snapshot_bytes && self.needs_snapshots(),
        }
    }
}

#[cfg(test)]
#[path = "snapshot_tests.rs"]
mod tests;
