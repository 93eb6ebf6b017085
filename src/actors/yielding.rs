//! The executor's side of agent prefill that yields to a higher lane (`sched::yielding` has the
//! policy): a step whose plan carries a yield signal runs on `Backend::forward_yielding`, which
//! stops between two decoder layers once the scheduler raises the signal. The executor then
//! reports `StepResult::suspended_after` and keeps the plan (the backend keeps the rows' residual
//! stream); the steps the scheduler sends meanwhile run on other sequences, and
//! `ExecutorMsg::Resume` continues the suspended one from the next layer. Nothing is recomputed,
//! and the logits are bitwise those of an uninterrupted step.

use std::sync::atomic::AtomicBool;
use std::time::Instant;

use super::executor::{sample_logits, StepPlan, StepResult};
use crate::backend::{Backend, SeqStep, StepRun};

/// Whether `plan` runs on the yielding path: it carries a signal, the backend can stop between
/// layers, and nothing in it needs a whole-step path (images, drafts, recurrent-state snapshots,
/// lookahead rows; the scheduler does not mark such steps, this is a second check). One rank.
pub(super) fn yields(backend: &dyn Backend, plan: &StepPlan, rank: usize) -> bool {
    plan.yield_signal.is_some()
        && rank == 0
        && backend.can_yield()
        && plan
            .seqs
            .iter()
            .all(|s| s.images.is_empty() && s.num_draft == 0 && s.snapshot_after.is_empty() && !s.follows_previous)
}

/// Runs `plan` (or continues it, with `resume`) until it ends or yields; a step that ends samples
/// like any other.
pub(super) fn run(backend: &mut dyn Backend, plan: &StepPlan, rank: usize, resume: bool) -> StepResult {
    let start = Instant::now();
    let never = AtomicBool::new(false);
    let signal = plan.yield_signal.as_deref().unwrap_or(&never);
    let steps: Vec<SeqStep<'_>> = plan
        .seqs
        .iter()
        .map(|s| SeqStep {
            tokens: &s.tokens,
            start_pos: s.start_pos,
            block_table: &s.block_table,
            logits_rows: usize::from(s.sample.is_some()),
            state_slot: s.state_slot,
        })
        .collect();
    let mut result = StepResult {
        prefill_tokens: plan.seqs.iter().map(|s| s.tokens.len()).sum(),
        error: None,
        ..StepResult::failed(plan.step_id, rank, String::new())
    };
    let run = if resume { backend.resume_suspended(&steps, signal) } else { backend.forward_yielding(&steps, signal) };
    match run {
        Ok(StepRun::Done(logits)) => sample_logits(backend, &logits, plan, rank, &mut result),
        Ok(StepRun::Suspended { after_layer }) => {
            tracing::debug!(step = plan.step_id, after_layer, resume, "step suspended to give way to a higher lane");
            result.suspended_after = Some(after_layer);
        }
        Err(e) => {
            backend.drop_suspended();
            result.error = Some(e.to_string());
        }
    }
    result.elapsed = start.elapsed();
    result
}
