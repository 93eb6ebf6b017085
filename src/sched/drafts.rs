//! How many draft tokens a verification run may carry, as far as the KV layout is concerned (the
//! budget, free blocks and max_tokens are the planner's other caps).
//!
//! Models with recurrent state can only resume a cached prefix at a page end, where the page
//! holds a snapshot of that state; the snapshot is taken from the state slot when a step ends
//! exactly on the boundary. A verification run (last token + drafts) that crossed a boundary
//! would leave the slot past it, so the page end's state would never be seen. Capping the run to
//! end at most on the boundary keeps every page end a step end. (Prefill chunks instead have the
//! backend keep the state at the boundaries they cross; a verification run's state there would
//! depend on which drafts are accepted.)

/// Drafts allowed after the last known token at `start` so that the run `start..=start + d`
/// ends at most on the next page boundary. `page_tokens == 0` (no prefix cache) or a model
/// without recurrent state puts no cap (`usize::MAX`).
pub fn max_drafts_before_page_end(start: usize, page_tokens: usize, recurrent_state: bool) -> usize {
    if page_tokens == 0 || !recurrent_state {
        return usize::MAX;
    }
    let next_boundary = (start / page_tokens + 1) * page_tokens;
    next_boundary - start - 1
}

#[cfg(test)]
mod tests {
    use super::max_drafts_before_page_end as cap;

    #[test]
    fn a_verify_run_ends_at_most_on_the_page_boundary() {
        // Page of 4: the last token at 3 ends the page, so no drafts; at 4 three fit (4..=7).
        assert_eq!(cap(3, 4, true), 0);
        assert_eq!(cap(4, 4, true), 3);
        assert_eq!(cap(5, 4, true), 2);
        assert_eq!(cap(6, 4, true), 1);
        assert_eq!(cap(0, 4, true), 3);
        assert_eq!(cap(3583, 3584, true), 0);
        assert_eq!(cap(3584 + 10, 3584, true), 3584 - 11);
    }

    #[test]
    fn no_cap_without_pages_or_recurrent_state() {
        assert_eq!(cap(3, 4, false), usize::MAX);
        assert_eq!(cap(3, 0, true), usize::MAX);
    }

    /// Exhaustive over small pages: the capped run never contains a boundary strictly inside it,
    /// and one more draft always would cross one.
    #[test]
    fn capped_runs_never_straddle_a_boundary() {
        for page in 1..=9usize {
            for start in 0..40usize {
                let d = cap(start, page, true);
                let end = start + 1 + d; // exclusive
                assert!((start + 1..end).all(|p| p % page != 0), "page {page} start {start} d {d}");
                assert_eq!(end % page, 0, "the cap reaches the boundary exactly");
            }
        }
    }
}
