//! Lookahead planning (overlapped scheduling): the step after the one in flight, planned and
//! committed to the pool while the executor still runs that step, so the executor starts it as
//! soon as it has sampled — the device never waits for the scheduler's planning and pool round
//! trip (SGLang's overlap scheduler does the same).
//!
//! A lookahead step only *continues* the step in flight: each of its sequences gets one token,
//! the one that step samples for it, at the position after its chunk. The executor puts that
//! token in (`PlannedSeq::follows_previous`). So it is planned only when nothing else could be
//! planned differently with the results in hand: every running sequence is in the step in flight
//! and samples there, none carries drafts, none can end by length there, nobody waits for
//! admission, and the blocks are there without preempting anyone. The caller adds what only it
//! knows (`may_continue`: no grammar, no penalties, no speculative lane, below the context limit).
//!
//! A sequence that ends with the step in flight (a stop token, a cancellation) has still been
//! computed once more by the lookahead step: its result is ignored when it arrives, like any
//! result for a removed sequence. Its blocks may be released before that step runs; the executor
//! runs steps in order, so whatever reuses them runs after the lookahead step wrote into them,
//! and that write lands past the sequence's last computed token, on a page never published.

use super::{Planned, Planner, StepBuild};
use crate::kv::PoolOp;
use crate::sched::SeqId;

impl Planner {
    /// Plans the step that continues the one in flight (see the module doc), returning its pool
    /// work like `plan_step`; `finish_step` completes it with the pool's reply. `None` when such a
    /// step must not be planned now: the caller waits for the result and plans normally.
    pub fn plan_lookahead(&mut self, may_continue: impl Fn(SeqId) -> bool) -> Option<Vec<PoolOp>> {
        if self.in_flight.len() != 1 || self.awaiting.is_some() || self.num_waiting() > 0 || self.has_yieldable_step() {
            return None;
        }
        let current = &self.in_flight[0];
        if current.is_empty() || current.len() != self.running.len() {
            return None;
        }
        let bs = self.cfg.block_size;
        let mut blocks_needed = 0;
        for p in current {
            let seq = self.seqs.get(&p.id)?;
            let sampled_at = p.start + p.n_base;
            let continues = p.wants_logits
                && p.draft.is_empty()
                && seq.in_flight == 1
                // The token sampled there is the next input, and one more still fits `max_tokens`.
                && sampled_at == seq.tokens.len()
                && seq.tokens.len() + 2 <= seq.prompt_len + seq.max_tokens
                && may_continue(p.id);
            if !continues {
                return None;
            }
            blocks_needed += (sampled_at + 1).div_ceil(bs).saturating_sub(seq.held);
        }
        if current.len() > self.cfg.max_num_batched_tokens || blocks_needed > self.avail {
            return None;
        }
        self.step += 1;
        let mut b = StepBuild {
            budget: self.cfg.max_num_batched_tokens - current.len(),
            lookahead: true,
            planned: Vec::with_capacity(current.len()),
            preempted: Vec::new(),
        };
        let continued: Vec<(SeqId, usize, usize)> =
            current.iter().map(|p| (p.id, p.start + p.n_base, p.n_base)).collect();
        let mut ops = self.take_pending();
        for (id, sampled_at, chunk) in continued {
            self.take_blocks(id, sampled_at + 1);
            b.planned.push(Planned {
                id,
                start: sampled_at,
                n_base: 1,
                wants_logits: true,
                draft: Vec::new(),
                admission: false,
            });
            // The pool has not heard of the step in flight yet (its `Advance` is sent with the
            // commit after its result): hold blocks for that step's tokens and this one's.
            ops.push(PoolOp::Grow { seq: id, new_tokens: chunk + 1 });
        }
        self.awaiting = Some(b);
        Some(ops)
    }

    /// Steps dispatched and not yet done (a lookahead step counts).
    pub fn steps_in_flight(&self) -> usize {
        self.in_flight.len()
    }
}
