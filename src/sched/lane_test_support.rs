//! What the lane tests (pacing, yielding, lane split) share: two lanes, a step cost simple enough
//! to predict by hand, a small pool, and helpers that plan and complete steps with the pool's
//! accounting checked after every move.

use super::*;
use crate::sched::{PolicyConfig, SeqId, StepCost, StepPlanOut};

pub(super) const VOICE: i32 = 10;
pub(super) const AGENT: i32 = 0;
/// 10 ms a step, 1 ms a prefill token, 2 ms a decode; attention free (simple arithmetic).
pub(super) const COST: StepCost =
    StepCost { fixed: 0.010, per_prefill_token: 0.001, per_decode_seq: 0.002, per_million_attended: 0.0 };

/// 512 tokens and 8 sequences a step, 16-token blocks.
pub(super) fn small_cfg(num_blocks: usize) -> PolicyConfig {
    PolicyConfig {
        max_num_batched_tokens: 512,
        max_num_seqs: 8,
        block_size: 16,
        num_blocks,
        page_tokens: 0,
        recurrent_state: false,
        page_aligned_chunks: false,
    }
}

pub(super) fn add(p: &mut Policy, id: SeqId, priority: i32, prompt_len: usize, max_tokens: usize) {
    let prompt = (0..prompt_len).map(|i| (id as u32) * 1000 + i as u32 % 500).collect();
    p.add(NewSeq { id, priority, prompt, max_tokens }).expect("add");
}

/// Completes the step in flight (every chunk that wants logits samples token 7).
pub(super) fn done(p: &mut Policy, plan: &StepPlanOut) {
    let sampled: Vec<(SeqId, Vec<u32>)> =
        plan.seqs.iter().filter(|s| s.wants_logits).map(|s| (s.id, vec![7])).collect();
    p.on_step_done(&sampled, &[]);
    p.assert_accounting();
}

/// Plans and completes one step.
pub(super) fn step(p: &mut Policy) -> StepPlanOut {
    let plan = p.plan_step().expect("something to plan");
    done(p, &plan);
    plan
}

pub(super) fn ids(plan: &StepPlanOut) -> Vec<SeqId> {
    plan.seqs.iter().map(|s| s.id).collect()
}
