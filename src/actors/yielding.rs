//! The executor's side of agent prefill that yields to a higher lane (`sched::yielding` has the
//! policy): a step whose plan carries a yield signal runs on `Backend::forward_yielding`, which
//! stops between two decoder layers once the scheduler raises the signal. The executor then
//! reports `StepResult::suspended_after` and keeps the plan (the backend keeps the rows' residual
//! stream); the steps the scheduler sends meanwhile run on other sequences, and
//! `ExecutorMsg::Resume` continues the suspended one from the next layer. Nothing is recomputed,
//! and the logits are bitwise those of an uninterrupted step.

use std::sync::atomic::AtomicBool;
use std::time::Instant;

use super::executor::{sample_logits, PlanSeq, StepPlan, StepResult};
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
    // Yieldable rows carry no drafts (`yields`), so each takes at most its one sampled row.
    let steps: Vec<SeqStep<'_>> = plan.seqs.iter().map(PlanSeq::seq_step).collect();
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    use super::*;
    use crate::actors::executor::{run_plan, EncoderCache, PlanSeq, SampleSpec};
    use crate::backend::cpu::{CpuBackend, CpuOptions};
    use crate::backend::KvGeometry;
    use crate::config::LlamaConfig;
    use crate::model::synthetic::{tiny_llama_config, SyntheticWeights};
    use crate::model::DType;
    use crate::sampling::SamplingParams;

    fn backend() -> CpuBackend {
        let cfg = LlamaConfig { num_hidden_layers: 3, ..tiny_llama_config() };
        let w = SyntheticWeights::new(&cfg, DType::F32, 5);
        let opts = CpuOptions {
            threads: 2,
            kv: KvGeometry { block_size: 4, num_blocks: 32, state_slots: 1 },
            kv_precision: None,
        };
        CpuBackend::new(&cfg, &w, opts).unwrap()
    }

    fn row(seq: u64, tokens: Vec<u32>, start_pos: usize, blocks: Vec<u32>, sample: bool) -> PlanSeq {
        let params = SamplingParams { logprobs: Some(3), ..SamplingParams::default() };
        PlanSeq {
            seq,
            tokens,
            start_pos,
            block_table: blocks,
            state_slot: 0,
            num_draft: 0,
            sample: sample.then(|| SampleSpec { params: Arc::new(params), step: 0, penalties: None, grammar: None }),
            snapshot_after: Vec::new(),
            images: Vec::new(),
            follows_previous: false,
        }
    }

    /// Sequence, token, logprob bits and top alternatives (id, logprob bits) of every sample.
    type Emitted = (u64, u32, u32, Vec<(u32, u32)>);

    fn emitted(r: &StepResult) -> Vec<Emitted> {
        assert_eq!(r.error, None);
        r.sampled
            .iter()
            .flat_map(|(id, t)| {
                t.tokens.iter().map(move |s| {
                    (*id, s.token, s.logprob.to_bits(), s.top_logprobs.iter().map(|(t, l)| (*t, l.to_bits())).collect())
                })
            })
            .collect()
    }

    #[test]
    fn a_suspended_then_resumed_plan_samples_what_the_uninterrupted_plan_samples() {
        let agent_rows = || {
            vec![
                row(1, (0..11).map(|i| (i * 29 + 3) % 256).collect(), 0, vec![0, 1, 2], true),
                row(2, (0..6).map(|i| (i * 31 + 8) % 256).collect(), 0, vec![4, 5], false),
            ]
        };
        let voice =
            StepPlan { step_id: 2, seqs: vec![row(3, vec![9, 8, 7, 6, 5], 0, vec![16, 17], true)], yield_signal: None };
        let signal = Arc::new(AtomicBool::new(false));
        let agents = StepPlan { step_id: 1, seqs: agent_rows(), yield_signal: Some(Arc::clone(&signal)) };
        let mut reference = backend();
        assert!(yields(&reference, &agents, 0) && !yields(&reference, &agents, 1), "rank 0 only");
        assert!(!yields(&reference, &voice, 0), "no signal, no yielding");
        let whole = run(&mut reference, &agents, 0, false);
        assert_eq!(whole.suspended_after, None);
        assert_eq!(whole.sampled.len(), 1, "only the chunk that ends its prompt samples");

        let mut b = backend();
        signal.store(true, Ordering::Release);
        let first = run(&mut b, &agents, 0, false);
        assert_eq!((first.suspended_after, first.sampled.len()), (Some(0), 0));
        let v = run_plan(&mut b, &voice, 0, &mut EncoderCache::new(0));
        assert_eq!(
            emitted(&v),
            emitted(&run_plan(&mut reference, &voice, 0, &mut EncoderCache::new(0))),
            "voice in between is exact too"
        );
        signal.store(false, Ordering::Release);
        let resumed = run(&mut b, &agents, 0, true);
        assert_eq!(resumed.suspended_after, None);
        assert_eq!(emitted(&resumed), emitted(&whole), "the resumed step samples bitwise what the whole one did");
        assert!(run(&mut b, &agents, 0, true).error.is_some(), "nothing left to resume");
    }
}
