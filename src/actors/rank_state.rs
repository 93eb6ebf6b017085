//! Keeping the ranks' recurrent state in step when a tensor-parallel group runs in several
//! executors (`serve --head` with workers): each rank holds only its own KDA heads' slice of every
//! state slot, and only rank 0 samples. Plain data and policy, no actor code.
//!
//! - **Verification commits.** A verify step leaves every rank's slot past drafts that may be
//!   rejected; rank 0 rolls its slice back at once (it sampled), and reports what it kept as
//!   [`VerifiedSlot`]s. The scheduler relays them to the other ranks (`ExecutorMsg::CommitVerified`)
//!   as soon as the step's result is in, before anything else reaches those ranks (a prefix hit's
//!   state write to a freed slot, the next step), so every rank's slice is rolled back to the same
//!   length before it is read or continued.
//! - **State images.** The group's image of a slot (a page snapshot held by the KV pool) is every
//!   rank's slice in rank order, as `Glm5TpBackend` lays it out in one process: [`StateParts`]
//!   joins the ranks' snapshots of a step and splits a prefix hit's image into the ranks' writes.
//!
//! With one executor (every single-process group) nothing here is used: its backend commits and
//! snapshots the whole group itself.

use std::sync::Arc;

use crate::kv::SlotSnapshot;

/// A verification that rank 0 committed: the slot's state was rolled back to the first `kept`
/// tokens of its step (last known token + accepted drafts). The other ranks apply the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VerifiedSlot {
    pub slot: u32,
    pub kept: usize,
}

/// The width in bytes of each rank's slice of a state slot, rank 0 first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StateParts {
    widths: Vec<usize>,
}

impl StateParts {
    pub fn new(widths: Vec<usize>) -> Self {
        StateParts { widths }
    }

    pub fn ranks(&self) -> usize {
        self.widths.len()
    }

    /// Bytes of the group's image of one slot.
    pub fn total(&self) -> usize {
        self.widths.iter().sum()
    }

    /// Each rank's slice of the group image `image`, rank 0 first.
    pub fn split(&self, image: &[u8]) -> Result<Vec<Arc<[u8]>>, String> {
        if image.len() != self.total() {
            return Err(format!(
                "a recurrent-state image of {} bytes, the group's slot holds {} ({} ranks)",
                image.len(),
                self.total(),
                self.ranks()
            ));
        }
        let mut at = 0;
        Ok(self
            .widths
            .iter()
            .map(|&w| {
                let part = Arc::from(&image[at..at + w]);
                at += w;
                part
            })
            .collect())
    }

    /// The group's snapshots of one step: each of rank 0's (`lead`, which decides what is kept: a
    /// verify row's end only when every draft was accepted) joined with the other ranks' snapshot
    /// of the same sequence and length, in rank order. A snapshot some rank lacks, or whose slice
    /// has the wrong width, is dropped with a warning: its page is then not published (recomputed
    /// on a later hit), never published with a part missing.
    pub fn join(&self, lead: Vec<SlotSnapshot>, others: &[Vec<SlotSnapshot>]) -> Vec<SlotSnapshot> {
        lead.into_iter()
            .filter_map(|snap| {
                let mut parts: Vec<&[u8]> = vec![&snap.image];
                for rank_snaps in others {
                    let part = rank_snaps.iter().find(|o| o.seq == snap.seq && o.tokens == snap.tokens)?;
                    parts.push(&part.image);
                }
                let widths_match =
                    parts.len() == self.ranks() && parts.iter().zip(&self.widths).all(|(p, &w)| p.len() == w);
                if !widths_match {
                    tracing::warn!(
                        seq = snap.seq,
                        tokens = snap.tokens,
                        "a rank's recurrent-state snapshot is missing or of the wrong size; the page stays unpublished"
                    );
                    return None;
                }
                Some(SlotSnapshot { seq: snap.seq, tokens: snap.tokens, image: parts.concat().into() })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(seq: u64, tokens: usize, bytes: &[u8]) -> SlotSnapshot {
        SlotSnapshot { seq, tokens, image: Arc::from(bytes) }
    }

    #[test]
    fn a_group_image_splits_into_the_ranks_slices_in_rank_order() {
        let parts = StateParts::new(vec![2, 3, 1]);
        assert_eq!(parts.total(), 6);
        let split = parts.split(&[1, 2, 3, 4, 5, 6]).unwrap();
        let split: Vec<&[u8]> = split.iter().map(|p| &p[..]).collect();
        assert_eq!(split, [&[1u8, 2][..], &[3, 4, 5], &[6]]);
        assert!(parts.split(&[1, 2, 3]).unwrap_err().contains("3 ranks"));
    }

    #[test]
    fn the_ranks_snapshots_join_behind_rank_0s_in_rank_order() {
        let parts = StateParts::new(vec![1, 2, 2]);
        // Rank 0 kept two snapshots; the others also took one at the end of a verify row whose
        // drafts were not all accepted (rank 0 left it out: it is not the state at the page end).
        let lead = vec![snap(1, 8, &[10]), snap(2, 16, &[20])];
        let rank1 = vec![snap(2, 16, &[21, 22]), snap(3, 8, &[0, 0]), snap(1, 8, &[11, 12])];
        let rank2 = vec![snap(1, 8, &[13, 14]), snap(2, 16, &[23, 24])];
        let joined = parts.join(lead, &[rank1, rank2.clone()]);
        assert_eq!(joined, vec![snap(1, 8, &[10, 11, 12, 13, 14]), snap(2, 16, &[20, 21, 22, 23, 24])]);
        // A part missing on one rank, or of the wrong width: that snapshot goes, the others stay.
        let lead = vec![snap(1, 8, &[10]), snap(2, 16, &[20])];
        let short = vec![snap(1, 8, &[11, 12])];
        assert_eq!(parts.join(lead.clone(), &[short, rank2.clone()]), vec![snap(1, 8, &[10, 11, 12, 13, 14])]);
        let wide = vec![snap(1, 8, &[11, 12, 0]), snap(2, 16, &[21, 22])];
        assert_eq!(parts.join(lead, &[wide, rank2]), vec![snap(2, 16, &[20, 21, 22, 23, 24])]);
    }
}
