//! The scheduler's book of its executor ranks (tensor parallelism: one `ExecutorActor` per rank,
//! all sent the same `StepPlan`): when every rank has loaded, what the group's KV looks like,
//! and when every rank has answered a step, the step's one result — rank 0's sampled tokens, or
//! the first rank's error, with every rank's recurrent-state snapshots joined. Plain data, no actor
//! code; the scheduler feeds it messages.

use super::executor::StepResult;
use super::rank_pages::PageParts;
use super::rank_state::StateParts;
use crate::backend::KvGeometry;

/// What a rank reports when its backend is loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RankReady {
    pub kv: KvGeometry,
    pub kv_block_bytes: usize,
    pub state_slot_bytes: usize,
}

pub struct RankBook {
    ready: Vec<Option<RankReady>>,
    /// Results of the step in flight, by rank.
    results: Vec<Option<StepResult>>,
}

impl RankBook {
    pub fn new(world: usize) -> Self {
        let world = world.max(1);
        RankBook { ready: vec![None; world], results: (0..world).map(|_| None).collect() }
    }

    pub fn world(&self) -> usize {
        self.ready.len()
    }

    /// Record a rank's load. Returns the group's view once every rank is loaded: the geometry
    /// all ranks share (a mismatch is an error) and the group's KV image and state sizes (the
    /// ranks' parts side by side).
    pub fn on_ready(&mut self, rank: usize, r: RankReady) -> Result<Option<RankReady>, String> {
        let world = self.world();
        let slot =
            self.ready.get_mut(rank).ok_or_else(|| format!("rank {rank} reported ready in a group of {world}"))?;
        if slot.replace(r).is_some() {
            return Err(format!("rank {rank} reported ready twice"));
        }
        if self.ready.iter().any(Option::is_none) {
            return Ok(None);
        }
        let all: Vec<RankReady> = self.ready.iter().flatten().copied().collect();
        if let Some((i, other)) = all.iter().enumerate().find(|(_, o)| o.kv != all[0].kv) {
            return Err(format!("rank {i} has KV geometry {:?}, rank 0 {:?}", other.kv, all[0].kv));
        }
        Ok(Some(RankReady {
            kv: all[0].kv,
            kv_block_bytes: all.iter().map(|r| r.kv_block_bytes).sum(),
            state_slot_bytes: all.iter().map(|r| r.state_slot_bytes).sum(),
        }))
    }

    /// Each rank's slice of a recurrent-state slot, once every rank has reported ready (the group's
    /// image is the slices in rank order).
    pub fn state_parts(&self) -> StateParts {
        StateParts::new(self.ready.iter().map(|r| r.map_or(0, |r| r.state_slot_bytes)).collect())
    }

    /// Each rank's slice of a KV block, once every rank has reported ready (a spilled page's image
    /// is the slices in rank order: `rank_pages`).
    pub fn page_parts(&self) -> PageParts {
        PageParts::new(self.ready.iter().map(|r| r.map_or(0, |r| r.kv_block_bytes)).collect())
    }

    /// Record a rank's answer to the step in flight. Returns the step's result once every rank
    /// answered: rank 0's, with the first failing rank's error (and no tokens) if any failed, and
    /// its recurrent-state snapshots joined with the other ranks' slices (ranks in separate
    /// executors each snapshot only their own KDA heads).
    pub fn on_result(&mut self, rank: usize, r: StepResult) -> Option<StepResult> {
        let world = self.world();
        let Some(slot) = self.results.get_mut(rank) else {
            tracing::error!(rank, world, "a step result from a rank outside the group");
            return None;
        };
        *slot = Some(r);
        if self.results.iter().any(Option::is_none) {
            return None;
        }
        let mut all: Vec<StepResult> = self.results.iter_mut().map(|r| r.take().expect("checked above")).collect();
        let elapsed = all.iter().map(|r| r.elapsed).max().unwrap_or_default();
        let error = all
            .iter()
            .enumerate()
            .find_map(|(i, r)| r.error.as_ref().map(|e| if world > 1 { format!("rank {i}: {e}") } else { e.clone() }));
        let mut lead = all.remove(0);
        if world > 1 && !lead.snapshots.is_empty() {
            let others: Vec<_> = all.iter_mut().map(|r| std::mem::take(&mut r.snapshots)).collect();
            lead.snapshots = self.state_parts().join(std::mem::take(&mut lead.snapshots), &others);
        }
        if let Some(id) = all.iter().map(|r| r.step_id).find(|&id| id != lead.step_id) {
            lead.error = Some(format!("ranks answered different steps ({} and {id})", lead.step_id));
            lead.sampled.clear();
        } else if error.is_some() {
            lead.error = error;
            lead.sampled.clear();
        }
        lead.elapsed = elapsed;
        Some(lead)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::spec::step::StepTokens;

    fn result(step_id: u64, ms: u64, error: Option<&str>, sampled: bool) -> StepResult {
        StepResult {
            step_id,
            rank: 0,
            sampled: if sampled {
                vec![(7, StepTokens { tokens: Vec::new(), drafted: 0, accepted: 0 })]
            } else {
                Vec::new()
            },
            snapshots: Vec::new(),
            elapsed: Duration::from_millis(ms),
            prefill_tokens: 3,
            decode_tokens: 1,
            error: error.map(String::from),
            hidden: Vec::new(),
            rejected: Vec::new(),
            suspended_after: None,
            verified: Vec::new(),
        }
    }

    fn ready(blocks: usize, bytes: usize) -> RankReady {
        RankReady {
            kv: KvGeometry { block_size: 16, num_blocks: blocks, state_slots: 2 },
            kv_block_bytes: bytes,
            state_slot_bytes: 0,
        }
    }

    #[test]
    fn the_group_is_ready_when_every_rank_is_and_sums_the_kv_image() {
        let mut b = RankBook::new(3);
        assert_eq!(b.on_ready(2, ready(10, 100)).unwrap(), None);
        assert_eq!(b.on_ready(0, ready(10, 100)).unwrap(), None);
        let all = b.on_ready(1, ready(10, 50)).unwrap().unwrap();
        assert_eq!((all.kv.num_blocks, all.kv_block_bytes), (10, 250));
        assert_eq!(b.page_parts(), PageParts::new(vec![100, 50, 100]), "each rank's slice of a block");
        assert!(b.on_ready(1, ready(10, 50)).unwrap_err().contains("twice"));
        assert!(b.on_ready(3, ready(10, 50)).unwrap_err().contains("group of 3"));
        let mut odd = RankBook::new(2);
        odd.on_ready(0, ready(10, 1)).unwrap();
        assert!(odd.on_ready(1, ready(9, 1)).unwrap_err().contains("KV geometry"));
        assert!(RankBook::new(2).on_ready(5, ready(1, 1)).is_err());
    }

    #[test]
    fn a_step_ends_when_every_rank_answered_with_rank_0s_tokens() {
        let mut b = RankBook::new(2);
        assert!(b.on_result(1, result(4, 30, None, false)).is_none());
        let r = b.on_result(0, result(4, 20, None, true)).unwrap();
        assert_eq!((r.step_id, r.sampled.len(), r.elapsed, r.error), (4, 1, Duration::from_millis(30), None));
        // The book is empty again for the next step.
        assert!(b.on_result(0, result(5, 1, None, true)).is_none());
        let r = b.on_result(1, result(5, 1, None, false)).unwrap();
        assert_eq!(r.step_id, 5);
    }

    #[test]
    fn a_steps_snapshots_carry_every_ranks_slice_in_rank_order() {
        use std::sync::Arc;

        use crate::kv::SlotSnapshot;
        let snap = |bytes: &[u8]| SlotSnapshot { seq: 7, tokens: 16, image: Arc::from(bytes) };
        let mut b = RankBook::new(3);
        for (rank, width) in [(0, 2), (1, 1), (2, 1)] {
            b.on_ready(rank, RankReady { state_slot_bytes: width, ..ready(10, 4) }).unwrap();
        }
        let with = |bytes: &[u8]| StepResult { snapshots: vec![snap(bytes)], ..result(3, 1, None, false) };
        assert!(b.on_result(2, with(&[5])).is_none());
        assert!(b.on_result(0, StepResult { sampled: result(3, 1, None, true).sampled, ..with(&[1, 2]) }).is_none());
        let r = b.on_result(1, with(&[3])).unwrap();
        assert_eq!(r.snapshots, vec![snap(&[1, 2, 3, 5])]);
        assert_eq!(r.sampled.len(), 1, "rank 0's tokens");
    }

    #[test]
    fn any_ranks_failure_fails_the_step() {
        let mut b = RankBook::new(3);
        b.on_result(0, result(1, 1, None, true));
        b.on_result(2, result(1, 1, Some("collective aborted"), false));
        let r = b.on_result(1, result(1, 1, Some("out of memory"), false)).unwrap();
        assert_eq!(r.error.as_deref(), Some("rank 1: out of memory"));
        assert!(r.sampled.is_empty());
        let mut b = RankBook::new(2);
        b.on_result(0, result(1, 1, None, true));
        let r = b.on_result(1, result(2, 1, None, false)).unwrap();
        assert!(r.error.unwrap().contains("different steps"));
        // One rank: its result as it is.
        let mut one = RankBook::new(1);
        let r = one.on_result(0, result(9, 1, Some("bad"), true)).unwrap();
        assert_eq!(r.error.as_deref(), Some("bad"));
        assert!(one.on_result(3, result(9, 1, None, true)).is_none());
    }
}
