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

pub use cost::{PrefillRate, StepCost, StepCostModel, StepShape};
pub use pacing::{DeviceDefaults, LaneTarget, Pacing, StepCap, COST_DECAY};
pub use policy::{NewSeq, PlannedSeq, Planner, PolicyConfig, PolicyError, SeqId, SeqView, StepPlanOut};
pub use pooled::Policy;

/// Corrects a step budget so page-aligned prefill chunks (a hybrid model whose backend reads its
/// recurrent state only at a step's end) fill whole pages: such chunks never cross a page boundary,
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
        (1..=budget).rev().find(|d| page_tokens.is_multiple_of(*d)).unwrap_or(1)
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

/// The page boundaries a step of `len` tokens from `start` reaches, as token counts into the step
/// (ascending; the last may be `len` itself when the step ends on a boundary). Empty when
/// `page_tokens` is 0. These are where a hybrid model's recurrent state is snapshot.
pub fn page_ends_within(start: usize, len: usize, page_tokens: usize) -> Vec<usize> {
    if page_tokens == 0 || len == 0 {
        return Vec::new();
    }
    let first = (start / page_tokens + 1) * page_tokens;
    (first..=start + len).step_by(page_tokens).map(|end| end - start).collect()
}

#[cfg(test)]
mod align_tests {
    use super::{align_budget_to_pages, page_ends_within};

    #[test]
    fn a_step_reaches_every_page_end_inside_it_and_at_its_end() {
        assert_eq!(page_ends_within(0, 30, 8), vec![8, 16, 24]);
        assert_eq!(page_ends_within(0, 32, 8), vec![8, 16, 24, 32], "ends on a boundary");
        assert_eq!(page_ends_within(5, 3, 8), vec![3], "a short chunk that completes its page");
        assert_eq!(page_ends_within(8, 7, 8), Vec::<usize>::new(), "starts on a boundary, ends before the next");
        assert_eq!(page_ends_within(16, 1, 8), Vec::<usize>::new(), "a decode after the boundary");
        assert_eq!(page_ends_within(15, 1, 8), vec![1], "a decode that completes the page");
        assert_eq!(page_ends_within(0, 30, 0), Vec::<usize>::new(), "no prefix cache");
    }

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
