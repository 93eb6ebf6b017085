//! Blocks for the planner's sequences (part of `sched::policy`): how much of the pool view a
//! sequence may take, making room by preempting sequences behind it, and the ways out of the
//! running set (preemption back to the queue, release), and blocks for a step's drafts. Plain data like the rest of the planner;
//! the pool itself is only told through the `PoolOp`s queued here.

use std::cmp::Reverse;
use std::collections::BTreeSet;

use super::{Planner, RunKey, StepBuild};
use crate::kv::PoolOp;
use crate::sched::drafts::max_drafts_before_page_end;
use crate::sched::SeqId;

impl Planner {
    /// Gives a sequence's blocks back (in the view now, in the pool with the next commit).
    pub(super) fn let_go(&mut self, id: SeqId, op: PoolOp) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            self.avail += seq.exclusive;
            self.pending_credit += seq.exclusive;
            seq.held = 0;
            seq.exclusive = 0;
        }
        self.pending.push(op);
    }

    /// The one exit of a sequence: drops it from its queue and the step in flight and releases it
    /// in the pool.
    pub(super) fn remove_seq(&mut self, id: SeqId) -> bool {
        if !self.seqs.contains_key(&id) {
            return false;
        }
        self.let_go(id, PoolOp::Release { seq: id });
        let Some(seq) = self.seqs.remove(&id) else { return false };
        match seq.admitted {
            Some(adm) => match self.running.binary_search(&((Reverse(seq.priority), adm), id)) {
                Ok(i) => {
                    self.running.remove(i);
                }
                Err(_) => {
                    tracing::error!(seq = id, "running sequence missing from the running order");
                    if cfg!(debug_assertions) {
                        panic!("running sequence {id} missing from the running order");
                    }
                }
            },
            None => {
                let key = Reverse(seq.priority);
                if let Some(q) = self.waiting.get_mut(&key) {
                    q.retain(|&w| w != id);
                    if q.is_empty() {
                        self.waiting.remove(&key);
                    }
                }
            }
        }
        for planned in &mut self.in_flight {
            planned.retain(|p| p.id != id);
        }
        if let Some(b) = &mut self.awaiting {
            b.planned.retain(|p| p.id != id);
        }
        true
    }

    /// Tokens a prefill chunk starting at `start` may take: up to the next page boundary when
    /// chunks are page-aligned, otherwise unbounded (the budget decides).
    pub(super) fn page_room(&self, start: usize) -> usize {
        match self.cfg.page_tokens {
            p if p > 0 && self.cfg.page_aligned_chunks => p - start % p,
            _ => usize::MAX,
        }
    }

    /// Ensures blocks for up to `want` more tokens of `id` (from its `num_computed`), preempting
    /// running sequences behind `key` as allowed. Returns the tokens that fit (blocks taken from
    /// the view), 0 when not even one does (then nobody was preempted).
    pub(super) fn make_room(&mut self, id: SeqId, key: RunKey, want: usize, b: &mut StepBuild) -> usize {
        let bs = self.cfg.block_size;
        let Some(seq) = self.seqs.get(&id) else { return 0 };
        let (prio, start, held) = (seq.priority, seq.num_computed, seq.held);
        let want = if seq.is_decode() { want } else { want.min(self.page_room(start)) };
        let extra = if seq.admitted.is_none() { seq.admit_extra } else { 0 };
        let need_min = (start + 1).div_ceil(bs).saturating_sub(held) + extra;
        let need_want = (start + want).div_ceil(bs).saturating_sub(held) + extra;
        if self.avail < need_min {
            // Preempt only if it will actually let this sequence run.
            let first_behind = self.running.partition_point(|(k, _)| *k <= key);
            // A suspended step's sequences are never preempted: their blocks are not reclaimable.
            let reclaimable: usize = self.running[first_behind..]
                .iter()
                .rev()
                .map_while(|(_, v)| self.seqs.get(v).filter(|s| s.in_flight == 0))
                .map(|s| s.exclusive)
                .sum();
            if self.avail + reclaimable < need_min {
                return 0;
            }
        }
        while self.avail < need_want {
            let Some(&(victim_key, victim)) = self.running.last() else { break };
            if victim_key <= key || self.seqs.get(&victim).is_some_and(|s| s.in_flight > 0) {
                break;
            }
            let strictly_lower = victim_key.0 .0 < prio;
            if !strictly_lower && self.avail >= need_min {
                break;
            }
            self.preempt(victim, b);
        }
        let fit = ((held + self.avail.saturating_sub(extra)) * bs).saturating_sub(start);
        let n = want.min(fit);
        if n == 0 {
            return 0;
        }
        self.take_blocks(id, start + n);
        // The pinned prefix is charged to the view too (released again if it is preempted).
        let extra = extra.min(self.avail);
        self.avail -= extra;
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.held += extra;
            seq.exclusive += extra;
        }
        n
    }

    /// Counts blocks for `total_tokens` positions of `id` as taken from the view.
    pub(super) fn take_blocks(&mut self, id: SeqId, total_tokens: usize) {
        let bs = self.cfg.block_size;
        let Some(seq) = self.seqs.get_mut(&id) else { return };
        let missing = total_tokens.div_ceil(bs).saturating_sub(seq.held);
        debug_assert!(missing <= self.avail, "planned more blocks than the view has");
        let missing = missing.min(self.avail);
        self.avail -= missing;
        seq.held += missing;
        seq.exclusive += missing;
    }

    /// Sends a running sequence back to the front of its waiting queue, letting go of its blocks
    /// (finished pages stay cached) and taking it out of the step being planned.
    pub(super) fn preempt(&mut self, id: SeqId, b: &mut StepBuild) {
        if !self.unadmit(id) {
            return;
        }
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.preempted_at = Some(self.step);
        }
        if let Some(i) = b.planned.iter().position(|p| p.id == id) {
            let p = b.planned.remove(i);
            b.budget += p.n_base + p.draft.len();
        }
        b.preempted.push(id);
        tracing::debug!(seq = id, "preempted; resumes after its cached pages");
    }

    /// Running → front of its waiting queue, blocks let go. False if it was not running.
    pub(super) fn unadmit(&mut self, id: SeqId) -> bool {
        let Some(seq) = self.seqs.get_mut(&id) else { return false };
        let Some(adm) = seq.admitted.take() else { return false };
        let priority = seq.priority;
        if let Ok(i) = self.running.binary_search(&((Reverse(priority), adm), id)) {
            self.running.remove(i);
        }
        seq.num_computed = 0;
        seq.draft.clear();
        self.let_go(id, PoolOp::Reset { seq: id });
        self.waiting.entry(Reverse(priority)).or_default().push_front(id);
        true
    }

    /// Step 3: attach drafts to planned decodes from leftover budget and available blocks, then
    /// drop every unused draft (drafts are for one step).
    pub(super) fn plan_drafts(&mut self, b: &mut StepBuild, active: &BTreeSet<i32>) {
        if self.with_draft.is_empty() {
            return;
        }
        let bs = self.cfg.block_size;
        for i in 0..b.planned.len() {
            if b.budget == 0 {
                break;
            }
            let p = &b.planned[i];
            let (id, start) = (p.id, p.start);
            let Some(seq) = self.seqs.get(&id) else { continue };
            if seq.draft.is_empty() || !p.wants_logits || !seq.is_decode() {
                continue;
            }
            let fit = ((seq.held + self.avail) * bs).saturating_sub(start + 1);
            let page_cap = max_drafts_before_page_end(start, self.cfg.page_tokens, self.cfg.recurrent_state);
            // Drafts cost like prefill tokens: a lane above with targets bounds them too.
            let cap = self.pacing.as_ref().and_then(|pc| pc.step_cap(seq.priority, |prio| active.contains(&prio)));
            let paced = self.paced_allowance(cap.as_ref(), b, start + 1);
            let d = seq.draft.len().min(b.budget).min(fit).min(page_cap).min(paced);
            if d == 0 {
                continue;
            }
            self.take_blocks(id, start + 1 + d);
            let Some(seq) = self.seqs.get_mut(&id) else { continue };
            let mut draft = std::mem::take(&mut seq.draft);
            draft.truncate(d);
            b.planned[i].draft = draft;
            b.budget -= d;
        }
        for id in self.with_draft.drain(..) {
            if let Some(seq) = self.seqs.get_mut(&id) {
                seq.draft.clear();
            }
        }
    }
}
