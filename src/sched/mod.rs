//! Scheduling policy as plain data: which sequences run in the next step, how many tokens each
//! gets, and who is preempted when KV blocks run out. No actors, no async, no tensors. The
//! `Planner` decides; it plans against a view of the KV pool and commits pool work as `PoolOp`s.
//! The SchedulerActor holds a `Planner` and talks to the `KvPoolActor` by messages; `Policy` is the
//! same pair composed synchronously (one `KvPool` in-process), used by tests and benches.
//! Lane pacing (`pacing`, with the step cost model in `cost`) sizes lower lanes' prefill to higher
//! lanes' latency targets; `admission` decides when a lane answers 429.

pub mod admission;
pub mod cost;
pub mod drafts;
pub mod pacing;
pub mod policy;
pub mod pooled;
pub mod types;

pub use cost::{StepCost, StepCostModel, StepShape};
pub use pacing::{DeviceDefaults, LaneTarget, Pacing, StepCap, COST_DECAY};
pub use policy::{NewSeq, PlannedSeq, Planner, PolicyConfig, PolicyError, SeqId, SeqView, StepPlanOut};
pub use pooled::Policy;

/// Corrects a step budget so prefill chunks fill whole pages: chunks never cross a page boundary,
/// so a budget above a page that is not a multiple of it, or below a page that does not divide
/// it, would leave a ragged tail of every step unused for long prefills. Rounds down to a
/// multiple of the page (or to a divisor of it below a page). Refuses when the corrected budget
/// would fall below `max_num_seqs` (every running sequence needs its decode token each step).
pub fn align_budget_to_pages(budget: usize, page_tokens: usize, max_num_seqs: usize) -> Result<usize, String> {
    if page_tokens == 0 || budget == 0 {
        return Ok(budget);
    }
    let aligned = if budget >= page_tokens {
        budget - budget % page_tokens
    } else {
        (1..=budget).rev().find(|d| page_tokens % d == 0).unwrap_or(1)
    };
    if aligned < max_num_seqs {
        return Err(format!(
            "max_num_batched_tokens ({budget}) aligned to page_tokens ({page_tokens}) is {aligned}, below \
             max_num_seqs ({max_num_seqs}); raise max_num_batched_tokens to a multiple or divisor of \
             page_tokens of at least max_num_seqs, or change page_tokens"
        ));
    }
    Ok(aligned)
}

#[cfg(test)]
mod align_tests {
    use super::align_budget_to_pages;

    #[test]
    fn budgets_are_aligned_to_pages() {
        assert_eq!(align_budget_to_pages(512, 256, 32), Ok(512), "already a multiple");
        assert_eq!(align_budget_to_pages(8192, 3584, 32), Ok(7168), "two whole pages");
        assert_eq!(align_budget_to_pages(2048, 3584, 32), Ok(1792), "a divisor of the page");
        assert_eq!(align_budget_to_pages(200, 256, 32), Ok(128));
        assert_eq!(align_budget_to_pages(300, 0, 32), Ok(300), "prefix cache off");
        let err = align_budget_to_pages(40, 96, 40).expect_err("32 < 40");
        assert!(err.contains("max_num_seqs (40)") && err.contains("page_tokens (96)"), "{err}");
    }
}
