//! Prefix-cache rules of the composed policy (planner + pool): page reuse, the last token, chunks
//! that cross pages (and page-aligned ones where a backend needs them), resume after preemption,
//! eviction.

use super::*;

fn cached(budget: usize, block_size: usize, num_blocks: usize, page_tokens: usize) -> Policy {
    Policy::new(PolicyConfig { page_tokens, ..cfg(budget, 4, block_size, num_blocks) }).expect("valid config")
}

/// Runs until `id` ends, returning every token it holds (prompt + generated).
fn run_to_end(p: &mut Policy, id: SeqId) -> Vec<u32> {
    let mut tokens = Vec::new();
    while let Some(v) = p.seq(id) {
        tokens = v.tokens.to_vec();
        step(p);
    }
    tokens
}

#[test]
fn a_follow_up_turn_reuses_exactly_the_whole_pages_of_its_prefix() {
    let mut p = cached(64, 4, 64, 8);
    add(&mut p, 1, 0, 21, 3);
    let mut conversation = run_to_end(&mut p, 1);
    conversation.truncate(23); // prompt + 2 of the generated tokens (the last was never computed)
    conversation.extend([7, 8, 9, 10, 11]);
    p.add(NewSeq { id: 2, priority: 0, prompt: conversation.clone(), max_tokens: 2 }).expect("add");
    let plan = step(&mut p);
    assert_eq!(plan.prefix_hits, vec![(2, 16)], "floor(23 / 8) = 2 pages");
    let s = planned(&plan, 2).expect("planned");
    assert_eq!((s.start_pos, s.tokens.as_slice()), (16, &conversation[16..]), "the rest in one chunk");
    assert!(s.wants_logits);
    assert_eq!(p.pool().counters().hit_tokens, 16);
}

#[test]
fn a_prompt_fully_covered_by_pages_recomputes_only_its_last_token() {
    let mut p = cached(64, 4, 64, 8);
    add(&mut p, 1, 0, 17, 1);
    run_to_end(&mut p, 1);
    let prompt1 = prompt(1, 17);
    p.add(NewSeq { id: 3, priority: 0, prompt: prompt1.clone(), max_tokens: 1 }).expect("add");
    let plan = step(&mut p);
    let s = planned(&plan, 3).expect("planned");
    assert_eq!((s.start_pos, s.tokens.as_slice(), s.wants_logits), (16, &prompt1[16..], true));
    assert_eq!(plan.prefix_hits, vec![(3, 16)]);
}

/// (start, length) of the first `n` steps' only chunk.
fn chunks(p: &mut Policy, n: usize) -> Vec<(usize, usize)> {
    (0..n)
        .map(|_| {
            let plan = step(p);
            (plan.seqs[0].start_pos, plan.seqs[0].tokens.len())
        })
        .collect()
}

#[test]
fn prefill_chunks_are_sized_by_the_budget_and_publish_every_page_they_complete() {
    let mut p = cached(12, 4, 64, 8);
    add(&mut p, 1, 0, 30, 1);
    assert_eq!(chunks(&mut p, 3), vec![(0, 12), (12, 12), (24, 6)]);
    assert!(p.is_idle());
    // Every whole page of the prompt was published, including the ones a chunk crossed.
    p.add(NewSeq { id: 2, priority: 0, prompt: prompt(1, 30), max_tokens: 1 }).expect("add");
    let plan = step(&mut p);
    assert_eq!(plan.prefix_hits, vec![(2, 24)], "3 whole pages of 30 tokens");
}

#[test]
fn page_aligned_chunks_stop_at_every_page_boundary() {
    let cfg = PolicyConfig { page_tokens: 8, recurrent_state: true, page_aligned_chunks: true, ..cfg(64, 4, 4, 64) };
    let mut p = Policy::new(cfg).expect("valid config");
    add(&mut p, 1, 0, 30, 1);
    assert_eq!(chunks(&mut p, 4), vec![(0, 8), (8, 8), (16, 8), (24, 6)]);
}

#[test]
fn a_preempted_sequence_resumes_after_its_cached_pages() {
    // 6 blocks of 4: the low-priority sequence computes 2 pages in one chunk and starts
    // decoding, then a high-priority one takes its blocks; when it resumes, its pages are still
    // cached.
    let mut p = cached(64, 4, 6, 8);
    add(&mut p, 1, 0, 20, 4);
    step(&mut p);
    assert_eq!(p.seq(1).map(|v| v.num_computed), Some(20));
    add(&mut p, 2, 10, 8, 1);
    let plan = step(&mut p);
    assert_eq!(plan.preempted, vec![1]);
    run_to_end(&mut p, 2);
    let plan = step(&mut p);
    let s = planned(&plan, 1).expect("resumed");
    assert_eq!(plan.prefix_hits, vec![(1, 16)], "two finished pages served from the cache");
    assert_eq!(s.start_pos, 16);
}

#[test]
fn cached_pages_are_evicted_when_blocks_run_out_and_accounting_returns_to_idle() {
    let mut p = cached(64, 4, 8, 8);
    for id in 1..=4 {
        add(&mut p, id, 0, 9, 1);
        run_to_end(&mut p, id);
    }
    assert!(p.pool().counters().evictions > 0);
    assert_eq!((p.blocks_used(), p.blocks_free()), (0, 8));
    p.assert_accounting();
}

#[test]
fn an_admission_whose_hit_pins_the_last_blocks_still_progresses() {
    // 10 blocks of 4. Turn one leaves 3 pages (6 blocks) cached; a running decoder holds the
    // free blocks, so the follow-up's hit would pin everything the planner counted as available.
    let mut p = cached(64, 4, 10, 8);
    add(&mut p, 1, 0, 25, 1);
    run_to_end(&mut p, 1);
    add(&mut p, 2, 0, 12, 4);
    step(&mut p);
    let follow = [prompt(1, 25), prompt(3, 10)].concat();
    p.add(NewSeq { id: 3, priority: 0, prompt: follow, max_tokens: 2 }).expect("add");
    let mut steps = 0;
    while !p.is_idle() {
        if let Some(plan) = p.plan_step() {
            complete(&mut p, &plan);
        }
        p.assert_accounting();
        steps += 1;
        assert!(steps < 200, "no progress: livelock");
    }
    assert!(p.pool().counters().hit_tokens >= 16, "the follow-up was served from the cache");
}

/// Hybrid models: a verification run (last token + drafts) ends at most on a page boundary, so
/// every page end is a step end where the recurrent state can be snapshot. Attention-only models
/// draft across boundaries.
#[test]
fn hybrid_verify_runs_end_at_most_on_a_page_boundary() {
    let hybrid = |page_tokens| {
        Policy::new(PolicyConfig { page_tokens, recurrent_state: true, ..cfg(64, 4, 4, 64) }).expect("valid config")
    };
    let drafts = |id, from: usize| (from..from + 7).map(|p| truth(id, p)).collect::<Vec<_>>();
    // Prompt of 5: the last token sits at 5, the run may cover 5..=7.
    let mut p = hybrid(8);
    add(&mut p, 1, 0, 5, 30);
    step(&mut p);
    assert_eq!(p.set_draft(1, drafts(1, 6)), 7);
    let plan = p.plan_step().expect("decode + drafts");
    assert_eq!((plan.seqs[0].start_pos, plan.seqs[0].num_draft), (5, 2));
    complete(&mut p, &plan);
    // Both accepted plus the bonus token: the next run starts on the boundary, a whole page fits.
    assert_eq!(p.seq(1).expect("running").num_computed, 8);
    p.set_draft(1, drafts(1, 9));
    let plan = p.plan_step().expect("decode + drafts");
    assert_eq!((plan.seqs[0].start_pos, plan.seqs[0].num_draft), (8, 7));
    complete(&mut p, &plan);
    // The last token is a page's last position: no drafts at all, the decode alone ends the page.
    let mut p = hybrid(8);
    add(&mut p, 2, 0, 7, 30);
    step(&mut p);
    p.set_draft(2, drafts(2, 8));
    let plan = p.plan_step().expect("decode");
    assert_eq!((plan.seqs[0].start_pos, plan.seqs[0].num_draft), (7, 0));
    complete(&mut p, &plan);
    // The same sequence on an attention-only model drafts across the boundary.
    let mut p = cached(64, 4, 64, 8);
    add(&mut p, 3, 0, 7, 30);
    step(&mut p);
    p.set_draft(3, drafts(3, 8));
    let plan = p.plan_step().expect("decode + drafts");
    assert_eq!((plan.seqs[0].start_pos, plan.seqs[0].num_draft), (7, 7));
    complete(&mut p, &plan);
}
