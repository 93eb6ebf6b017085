//! Unit tests of the scheduling policy: one test per rule, plus a seeded randomized run that
//! checks accounting, block-table integrity (through a fake KV cache) and exact continuation of
//! every stream through chunking, preemption and drafts.

use std::collections::{BTreeMap, HashSet};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::sched::policy::{NewSeq, PlannedSeq, PolicyConfig, PolicyError, SeqId, StepPlanOut};

fn cfg(budget: usize, max_seqs: usize, block_size: usize, num_blocks: usize) -> PolicyConfig {
    PolicyConfig {
        max_num_batched_tokens: budget,
        max_num_seqs: max_seqs,
        block_size,
        num_blocks,
        page_tokens: 0,
        recurrent_state: false,
        page_aligned_chunks: false,
    }
}

fn policy(budget: usize, max_seqs: usize, block_size: usize, num_blocks: usize) -> Policy {
    Policy::new(cfg(budget, max_seqs, block_size, num_blocks)).expect("valid config")
}

/// The token the fake model produces at `pos` of sequence `id`.
fn truth(id: SeqId, pos: usize) -> u32 {
    ((id as usize * 7919 + pos * 31) % 50_000) as u32
}

fn prompt(id: SeqId, len: usize) -> Vec<u32> {
    (0..len).map(|p| truth(id, p)).collect()
}

fn seq(id: SeqId, priority: i32, prompt_len: usize, max_tokens: usize) -> NewSeq {
    NewSeq { id, priority, prompt: prompt(id, prompt_len), max_tokens }
}

fn add(p: &mut Policy, id: SeqId, priority: i32, prompt_len: usize, max_tokens: usize) {
    p.add(seq(id, priority, prompt_len, max_tokens)).expect("add");
}

/// Completes `plan` as a model that produces `truth` would (drafts verified against it).
fn complete(p: &mut Policy, plan: &StepPlanOut) -> Vec<SeqId> {
    let sampled: Vec<(SeqId, Vec<u32>)> =
        plan.seqs.iter().filter(|s| s.wants_logits).map(|s| (s.id, verify(s))).collect();
    p.on_step_done(&sampled, &[])
}

fn verify(s: &PlannedSeq) -> Vec<u32> {
    let first = s.start_pos + s.tokens.len() - s.num_draft;
    let drafts = &s.tokens[s.tokens.len() - s.num_draft..];
    let mut out = Vec::new();
    for (i, &d) in drafts.iter().enumerate() {
        let t = truth(s.id, first + i);
        out.push(t);
        if t != d {
            return out;
        }
    }
    out.push(truth(s.id, first + s.num_draft));
    out
}

fn step(p: &mut Policy) -> StepPlanOut {
    let plan = p.plan_step().expect("something to plan");
    complete(p, &plan);
    p.assert_accounting();
    plan
}

fn planned(plan: &StepPlanOut, id: SeqId) -> Option<&PlannedSeq> {
    plan.seqs.iter().find(|s| s.id == id)
}

fn ids(plan: &StepPlanOut) -> Vec<SeqId> {
    plan.seqs.iter().map(|s| s.id).collect()
}

// ---- configuration and admission control ----

#[test]
fn invalid_configs_are_refused_with_the_reason() {
    let err = Policy::new(cfg(16, 32, 16, 100)).expect_err("budget below max_num_seqs");
    let msg = err.to_string();
    assert!(msg.contains("16") && msg.contains("32"), "{msg}");
    assert!(matches!(Policy::new(cfg(64, 8, 0, 100)), Err(PolicyError::InvalidConfig(_))));
    assert!(matches!(Policy::new(cfg(64, 8, 16, 0)), Err(PolicyError::InvalidConfig(_))));
    assert!(matches!(Policy::new(cfg(64, 0, 16, 10)), Err(PolicyError::InvalidConfig(_))));
    assert!(Policy::new(cfg(32, 32, 1, 1)).is_ok());
}

#[test]
fn a_sequence_that_can_never_fit_is_rejected_naming_both_numbers() {
    let mut p = policy(64, 4, 4, 10); // 40 tokens of KV
    p.add(seq(1, 0, 30, 10)).expect("exactly fits");
    let err = p.add(seq(2, 0, 30, 11)).expect_err("41 tokens > 40");
    assert_eq!(err, PolicyError::NeverFits { prompt_tokens: 30, max_tokens: 11, needed_tokens: 41, pool_tokens: 40 });
    let msg = err.to_string();
    assert!(msg.contains("30 tokens") && msg.contains("(11)") && msg.contains("40 tokens"), "{msg}");
    assert_eq!(err.error_type(), "never_fits");
    assert_eq!(p.num_waiting(), 1);
}

#[test]
fn malformed_sequences_are_rejected() {
    let mut p = policy(64, 4, 4, 10);
    add(&mut p, 1, 0, 4, 4);
    assert_eq!(p.add(seq(1, 0, 4, 4)), Err(PolicyError::DuplicateId(1)));
    assert_eq!(p.add(NewSeq { id: 2, priority: 0, prompt: vec![], max_tokens: 4 }), Err(PolicyError::EmptyPrompt(2)));
    assert_eq!(p.add(seq(3, 0, 4, 0)), Err(PolicyError::ZeroMaxTokens(3)));
    assert_eq!(p.num_waiting(), 1);
}

#[test]
fn an_empty_policy_plans_nothing_and_is_idle() {
    let mut p = policy(64, 4, 4, 10);
    assert!(p.is_idle());
    assert_eq!(p.plan_step(), None);
    assert_eq!((p.num_waiting(), p.num_running(), p.blocks_used(), p.blocks_free()), (0, 0, 0, 10));
}

// ---- the life of one sequence ----

#[test]
fn a_short_prompt_is_prefilled_whole_then_decodes_its_sampled_token() {
    let mut p = policy(64, 4, 4, 10);
    add(&mut p, 1, 0, 6, 5);
    let plan = step(&mut p);
    assert_eq!(plan.seqs.len(), 1);
    let s = &plan.seqs[0];
    assert_eq!((s.start_pos, s.tokens.clone(), s.wants_logits, s.num_draft), (0, prompt(1, 6), true, 0));
    assert_eq!(s.block_table.len(), 2, "6 tokens in blocks of 4");
    assert!(!s.is_decode());
    assert_eq!((p.num_running(), p.num_waiting()), (1, 0));

    let plan = p.plan_step().expect("decode");
    let s = &plan.seqs[0];
    assert_eq!((s.start_pos, s.tokens.clone(), s.wants_logits), (6, vec![truth(1, 6)], true));
    assert!(s.is_decode());
    complete(&mut p, &plan);
    let v = p.seq(1).expect("still running");
    assert_eq!((v.num_computed, v.tokens.len()), (7, 8));
    assert_eq!(&v.tokens[6..], &[truth(1, 6), truth(1, 7)]);
}

#[test]
fn a_long_prompt_is_split_into_budget_sized_chunks_and_only_the_last_wants_logits() {
    let mut p = policy(32, 4, 4, 40);
    add(&mut p, 1, 0, 100, 4);
    let mut chunks = Vec::new();
    loop {
        let plan = p.plan_step().expect("work");
        let s = &plan.seqs[0];
        assert_eq!(s.start_pos, chunks.iter().sum::<usize>(), "chunks are contiguous");
        assert_eq!(s.tokens, prompt(1, 100)[s.start_pos..s.start_pos + s.tokens.len()].to_vec());
        assert_eq!(s.block_table.len(), (s.start_pos + s.tokens.len()).div_ceil(4));
        chunks.push(s.tokens.len());
        let last = s.wants_logits;
        if !last {
            // A chunk that samples nothing needs no tokens back.
            assert!(p.on_step_done(&[], &[]).is_empty());
        } else {
            complete(&mut p, &plan);
            break;
        }
        p.assert_accounting();
    }
    assert_eq!(chunks, vec![32, 32, 32, 4]);
    assert_eq!(p.seq(1).map(|v| v.num_computed), Some(100));
}

#[test]
fn reaching_max_tokens_ends_the_sequence_and_frees_its_blocks() {
    let mut p = policy(64, 4, 4, 10);
    add(&mut p, 1, 0, 3, 2);
    let plan = p.plan_step().expect("prefill");
    assert!(complete(&mut p, &plan).is_empty());
    let plan = p.plan_step().expect("decode");
    assert_eq!(complete(&mut p, &plan), vec![1]);
    assert!(p.is_idle());
    assert_eq!(p.blocks_used(), 0);
    assert_eq!(p.plan_step(), None);
    p.assert_accounting();
}

#[test]
fn finished_sequences_are_removed_and_free_their_blocks() {
    let mut p = policy(64, 4, 4, 20);
    add(&mut p, 1, 0, 5, 10);
    add(&mut p, 2, 0, 5, 10);
    let plan = p.plan_step().expect("prefill");
    let used = p.blocks_used();
    assert_eq!(used, 4);
    let sampled: Vec<_> = plan.seqs.iter().map(|s| (s.id, verify(s))).collect();
    assert!(p.on_step_done(&sampled, &[2]).is_empty());
    assert_eq!((p.num_running(), p.blocks_used()), (1, 2));
    assert!(p.seq(2).is_none());
    p.assert_accounting();
}

#[test]
fn a_chunk_whose_sample_is_missing_is_computed_again() {
    let mut p = policy(64, 4, 4, 20);
    add(&mut p, 1, 0, 5, 10);
    let first = p.plan_step().expect("prefill");
    assert!(p.on_step_done(&[], &[]).is_empty());
    let again = p.plan_step().expect("same chunk again");
    assert_eq!(first.seqs, again.seqs);
    assert_eq!(first.prefix_hits, vec![(1, 0)], "the admission is reported once");
    complete(&mut p, &again);
    assert_eq!(p.seq(1).map(|v| v.tokens.len()), Some(6));
}

#[test]
fn planning_waits_for_the_step_in_flight_and_a_failed_step_is_replanned() {
    let mut p = policy(64, 4, 4, 20);
    add(&mut p, 1, 0, 5, 10);
    add(&mut p, 2, 0, 7, 10);
    let first = p.plan_step().expect("prefill");
    assert_eq!(p.plan_step(), None, "one step in flight at a time");
    let mut failed = p.on_step_failed();
    failed.sort_unstable();
    assert_eq!(failed, vec![1, 2]);
    let again = p.plan_step().expect("replanned");
    assert_eq!(first.seqs, again.seqs, "nothing of the failed step counts");
    complete(&mut p, &again);
    p.assert_accounting();
}

// ---- rule 1: continuous batching and chunked prefill ----

#[test]
fn max_num_seqs_bounds_admission_fifo_within_a_priority() {
    let mut p = policy(64, 2, 4, 40);
    for id in 1..=3 {
        add(&mut p, id, 0, 4, 3);
    }
    let plan = step(&mut p);
    assert_eq!(ids(&plan), vec![1, 2]);
    assert_eq!((p.num_running(), p.num_waiting(), p.num_waiting_for(0)), (2, 1, 1));
    // Seq 1 is stopped by its caller; 3 takes its slot in the next step, behind 2's decode.
    let plan = p.plan_step().expect("decodes");
    let sampled: Vec<_> = plan.seqs.iter().map(|s| (s.id, verify(s))).collect();
    p.on_step_done(&sampled, &[1]);
    let plan = step(&mut p);
    assert_eq!(ids(&plan), vec![2, 3]);
    assert!(planned(&plan, 2).is_some_and(PlannedSeq::is_decode));
}

#[test]
fn higher_priority_waiting_sequences_are_admitted_first() {
    let mut p = policy(64, 1, 4, 40);
    add(&mut p, 1, 0, 4, 3);
    add(&mut p, 2, 5, 4, 3);
    add(&mut p, 3, 5, 4, 3);
    assert_eq!((p.num_waiting_for(0), p.num_waiting_for(5), p.num_waiting_for(9)), (1, 2, 0));
    let plan = step(&mut p);
    assert_eq!(ids(&plan), vec![2], "priority 5 first, FIFO within it");
}

#[test]
fn decodes_are_planned_before_prefill_and_are_never_starved_by_it() {
    let mut p = policy(16, 4, 4, 100);
    add(&mut p, 1, 0, 4, 50);
    add(&mut p, 2, 0, 4, 50);
    step(&mut p);
    add(&mut p, 3, 0, 200, 5);
    let plan = step(&mut p);
    assert_eq!(ids(&plan), vec![1, 2, 3]);
    assert_eq!(plan.seqs[2].tokens.len(), 14, "the prompt takes what the decodes leave");
    assert_eq!(plan.num_tokens(), 16);
}

#[test]
fn a_decode_never_waits_behind_a_10k_token_prefill() {
    let budget = 512;
    let mut p = policy(budget, 8, 16, 2000);
    for id in 1..=3 {
        add(&mut p, id, 0, 10, 1000);
    }
    let plan = step(&mut p);
    assert_eq!(plan.num_tokens(), 30);
    add(&mut p, 99, 0, 10_000, 10);
    let mut chunks = Vec::new();
    loop {
        let plan = step(&mut p);
        for id in 1..=3 {
            let s = planned(&plan, id).expect("every decode rides along every step");
            assert!(s.is_decode() && s.tokens.len() == 1);
        }
        let big = planned(&plan, 99).expect("the prompt progresses every step");
        assert_eq!(big.start_pos, chunks.iter().sum::<usize>());
        chunks.push(big.tokens.len());
        assert!(plan.num_tokens() <= budget);
        if big.wants_logits {
            break;
        }
    }
    let mut expected = vec![budget - 3; 10_000 / (budget - 3)];
    expected.push(10_000 % (budget - 3));
    assert_eq!(chunks, expected);
    // And from then on the former prompt decodes alongside the others.
    let plan = step(&mut p);
    assert_eq!(ids(&plan), vec![1, 2, 3, 99]);
    assert!(plan.seqs.iter().all(PlannedSeq::is_decode));
}

#[test]
fn running_prefills_continue_before_new_admissions_of_the_same_priority() {
    let mut p = policy(40, 4, 4, 100);
    add(&mut p, 1, 0, 100, 5);
    step(&mut p);
    add(&mut p, 2, 0, 30, 5);
    let plan = step(&mut p);
    assert_eq!(ids(&plan), vec![1], "seq 1 takes the whole budget; seq 2 queues");
    assert_eq!(plan.seqs[0].tokens.len(), 40);
    let plan = step(&mut p);
    assert_eq!(ids(&plan), vec![1, 2]);
    assert_eq!((plan.seqs[0].tokens.len(), plan.seqs[1].tokens.len()), (20, 20));
}

// ---- rule 3: priority ----

#[test]
fn a_high_priority_request_preempts_exactly_one_low_decode_when_max_num_seqs_is_full() {
    let mut p = policy(512, 32, 16, 1000);
    for id in 1..=32 {
        add(&mut p, id, 0, 4, 100);
    }
    step(&mut p);
    step(&mut p);
    assert_eq!(p.num_running(), 32);
    add(&mut p, 100, 10, 20, 10);
    let plan = p.plan_step().expect("plan");
    let hi = planned(&plan, 100).expect("the high-priority request starts now");
    assert_eq!((hi.start_pos, hi.tokens.len(), hi.wants_logits), (0, 20, true));
    assert_eq!(plan.preempted, vec![32], "the most recently admitted low sequence");
    assert!(planned(&plan, 32).is_none(), "a preempted sequence is taken out of the plan");
    assert_eq!(plan.seqs.len(), 32);
    assert_eq!(plan.seqs.iter().filter(|s| s.is_decode()).count(), 31);
    assert_eq!(plan.num_tokens(), 31 + 20);
    assert_eq!((p.num_running(), p.num_waiting_for(0)), (32, 1));
    let v = p.seq(32).expect("preempted, not dropped");
    assert_eq!((v.running, v.num_computed, v.tokens.len(), v.block_table.len()), (false, 0, 6, 0));
    complete(&mut p, &plan);
    p.assert_accounting();
}

#[test]
fn a_high_priority_request_preempts_low_work_as_needed_when_blocks_run_out() {
    // Four low sequences of 13 tokens fill all 16 blocks but can still decode 3 tokens in place.
    let mut p = policy(256, 8, 4, 16);
    for id in 1..=4 {
        add(&mut p, id, 0, 13, 3);
    }
    step(&mut p);
    assert_eq!(p.blocks_free(), 0);
    add(&mut p, 10, 10, 8, 2); // needs 2 blocks: one victim is enough
    let plan = step(&mut p);
    assert_eq!(plan.preempted, vec![4]);
    assert_eq!(planned(&plan, 10).map(|s| s.tokens.len()), Some(8));
    assert_eq!(ids(&plan), vec![1, 2, 3, 10]);
    assert_eq!(p.blocks_free(), 2, "2 blocks left over...");
    assert_eq!(p.num_waiting_for(0), 1, "...but the victim is not re-admitted in the same step");

    add(&mut p, 11, 10, 24, 2); // needs 6 blocks with 2 free: two more victims
    let plan = step(&mut p);
    assert_eq!(plan.preempted, vec![3, 2]);
    assert_eq!(planned(&plan, 11).map(|s| s.tokens.len()), Some(24));
}

#[test]
fn equal_priority_waiting_sequences_do_not_preempt_and_block_the_queue_behind_them() {
    let mut p = policy(256, 8, 4, 7);
    add(&mut p, 1, 0, 25, 3); // all 7 blocks
    add(&mut p, 2, 0, 8, 3);
    add(&mut p, 3, -1, 2, 3);
    let plan = step(&mut p);
    assert_eq!(ids(&plan), vec![1]);
    assert!(plan.preempted.is_empty());
    assert_eq!(p.num_waiting(), 2);
    // A higher priority does preempt.
    add(&mut p, 4, 1, 4, 3);
    let plan = step(&mut p);
    assert_eq!(plan.preempted, vec![1]);
    assert_eq!(ids(&plan), vec![4]);
}

#[test]
fn a_preempted_sequence_goes_to_the_front_of_its_queue() {
    let mut p = policy(64, 1, 4, 40);
    add(&mut p, 1, 0, 4, 3);
    step(&mut p);
    add(&mut p, 2, 0, 4, 3);
    add(&mut p, 3, 10, 4, 1);
    let plan = step(&mut p);
    assert_eq!((ids(&plan), plan.preempted.clone()), (vec![3], vec![1]));
    assert!(p.seq(3).is_none(), "seq 3 had max_tokens 1");
    let plan = step(&mut p);
    assert_eq!(ids(&plan), vec![1], "the preempted sequence resumes before seq 2, queued earlier");
}

#[test]
fn higher_priority_prefill_is_planned_before_lower_priority_prefill() {
    let mut p = policy(64, 4, 4, 400);
    add(&mut p, 1, 0, 1000, 5);
    step(&mut p);
    add(&mut p, 2, 10, 40, 5);
    let plan = step(&mut p);
    assert_eq!(ids(&plan), vec![2, 1]);
    assert_eq!((plan.seqs[0].tokens.len(), plan.seqs[1].tokens.len()), (40, 24));
    assert!(plan.preempted.is_empty());
}

// ---- rule 2: blocks and preemption among running sequences ----

#[test]
fn a_decode_short_of_blocks_preempts_the_latest_equal_priority_sequence() {
    let mut p = policy(64, 4, 4, 8);
    add(&mut p, 1, 0, 16, 8);
    add(&mut p, 2, 0, 16, 8);
    step(&mut p); // 8 blocks used; both need a fifth to decode
    let plan = step(&mut p);
    assert_eq!((ids(&plan), plan.preempted.clone()), (vec![1], vec![2]));
    let v = p.seq(2).expect("kept");
    assert_eq!((v.running, v.tokens.len(), v.num_computed), (false, 17, 0), "generated token kept");
}

#[test]
fn a_resumed_sequence_recomputes_and_continues_exactly() {
    let mut p = policy(64, 4, 4, 8);
    add(&mut p, 1, 0, 16, 8);
    add(&mut p, 2, 0, 16, 8);
    step(&mut p);
    // Chunks of seq 2 since it was last preempted (seq 1 preempts it again when it grows).
    let mut chunks: Vec<(usize, Vec<u32>, bool)> = Vec::new();
    let mut resumed = false;
    while !resumed {
        let plan = step(&mut p);
        if plan.preempted.contains(&2) {
            chunks.clear();
        }
        if let Some(s) = planned(&plan, 2) {
            chunks.push((s.start_pos, s.tokens.clone(), s.wants_logits));
            resumed = s.wants_logits;
        }
    }
    // The re-prefill covers prompt + the token generated before preemption, and samples only at
    // its end.
    let flat: Vec<u32> = chunks.iter().flat_map(|c| c.1.clone()).collect();
    let mut expected = prompt(2, 16);
    expected.push(truth(2, 16));
    assert_eq!(flat, expected);
    assert_eq!(chunks.iter().filter(|c| c.2).count(), 1);
    assert_eq!(chunks[0].0, 0, "recompute starts from position 0");
    // Every token, before and after, is what an uninterrupted run produces.
    while let Some(v) = p.seq(2) {
        assert_eq!(v.tokens, (0..v.tokens.len()).map(|i| truth(2, i)).collect::<Vec<_>>());
        step(&mut p);
    }
    assert!(p.is_idle());
}

#[test]
fn a_lower_priority_sequence_never_preempts_a_higher_one_and_a_stuck_decode_waits_keeping_its_blocks() {
    let mut p = policy(64, 4, 4, 8);
    add(&mut p, 1, 10, 13, 3); // 4 blocks, can decode in place until 16 tokens
    add(&mut p, 2, 0, 16, 4); // 4 blocks, needs a fifth to decode
    step(&mut p);
    let plan = step(&mut p);
    assert_eq!(ids(&plan), vec![1]);
    assert!(plan.preempted.is_empty(), "seq 2 has nobody behind it and does not preempt itself");
    let v = p.seq(2).expect("kept");
    assert_eq!((v.running, v.block_table.len(), v.num_computed), (true, 4, 16));
    step(&mut p);
    assert!(p.seq(1).is_none(), "seq 1 reached max_tokens");
    let plan = step(&mut p);
    assert_eq!(ids(&plan), vec![2], "room is back");
    assert_eq!((plan.seqs[0].start_pos, plan.seqs[0].block_table.len()), (16, 5));
}

#[test]
fn a_high_priority_decode_preempts_a_low_one_for_its_block() {
    let mut p = policy(64, 4, 4, 8);
    add(&mut p, 1, 0, 16, 4);
    add(&mut p, 2, 10, 16, 4);
    step(&mut p);
    let plan = step(&mut p);
    assert_eq!((ids(&plan), plan.preempted.clone()), (vec![2], vec![1]));
}

#[test]
fn a_chunk_shrinks_to_the_free_blocks_instead_of_preempting_an_equal() {
    let mut p = policy(64, 4, 4, 10);
    add(&mut p, 1, 0, 26, 2); // 7 blocks; decodes in place
    step(&mut p);
    add(&mut p, 2, 0, 20, 2); // wants 5 blocks, 3 are free
    let plan = p.plan_step().expect("plan");
    assert!(plan.preempted.is_empty());
    assert_eq!(p.blocks_free(), 0);
    let s2 = planned(&plan, 2).expect("admitted with what fits");
    assert_eq!((s2.tokens.len(), s2.wants_logits), (12, false));
    // Seq 1 reaches max_tokens in that step; seq 2 then gets its blocks and finishes its prompt.
    assert_eq!(complete(&mut p, &plan), vec![1]);
    let plan = step(&mut p);
    assert_eq!(planned(&plan, 2).map(|s| (s.start_pos, s.tokens.len(), s.wants_logits)), Some((12, 8, true)));
}

#[test]
fn a_needy_sequence_never_preempts_itself_it_takes_what_fits() {
    let mut p = policy(13, 4, 4, 6);
    add(&mut p, 1, 10, 3, 4); // M: ahead of H
    add(&mut p, 2, 0, 1, 3); // L: one block for its whole life
    step(&mut p);
    add(&mut p, 3, 10, 20, 1); // H: 6 blocks in the end
    let plan = step(&mut p);
    assert_eq!(planned(&plan, 3).map(|s| s.tokens.len()), Some(11));
    // H's next chunk wants 2 more blocks; M's decode takes the last free one. Preempting L gives
    // one block; H is then last in line and must shrink its chunk rather than preempt itself.
    let plan = step(&mut p);
    assert_eq!(plan.preempted, vec![2]);
    let h = planned(&plan, 3).expect("H progresses");
    assert_eq!((h.start_pos, h.tokens.len(), h.wants_logits), (11, 5, false));
    assert_eq!(ids(&plan), vec![1, 3]);
    while !p.is_idle() {
        step(&mut p);
    }
}

#[test]
fn a_strictly_lower_victim_makes_room_for_a_middle_priority_newcomer() {
    let mut p = policy(64, 4, 4, 6);
    add(&mut p, 1, 10, 17, 3); // 5 blocks
    add(&mut p, 2, 0, 4, 2); // 1 block
    step(&mut p);
    assert_eq!(p.blocks_free(), 0);
    add(&mut p, 3, 5, 8, 2);
    let plan = step(&mut p);
    assert_eq!(plan.preempted, vec![2]);
    assert_eq!(planned(&plan, 3).map(|s| s.tokens.len()), Some(4), "one block was all it could free");
}

#[test]
fn nobody_is_preempted_when_all_blocks_belong_to_higher_priorities() {
    let mut p = policy(64, 4, 4, 6);
    add(&mut p, 1, 10, 17, 3); // 5 blocks
    add(&mut p, 2, 10, 4, 2); // 1 block, needs a second to decode
    step(&mut p);
    add(&mut p, 3, 5, 8, 2);
    let plan = step(&mut p);
    assert!(plan.preempted.is_empty());
    assert_eq!(ids(&plan), vec![1], "seq 2 waits for a block, seq 3 for room");
    assert_eq!((p.num_waiting_for(5), p.num_running()), (1, 2));
}

// ---- cancellation ----

#[test]
fn abort_frees_blocks_everywhere_and_unknown_ids_are_refused() {
    let mut p = policy(64, 4, 4, 20);
    add(&mut p, 1, 0, 5, 10);
    add(&mut p, 2, 0, 5, 10);
    step(&mut p);
    add(&mut p, 3, 0, 5, 10);
    assert!(p.abort(3), "waiting");
    assert!(p.abort(1), "running");
    assert!(!p.abort(1) && !p.abort(42));
    assert_eq!((p.num_running(), p.num_waiting(), p.blocks_used()), (1, 0, 2));
    assert!(p.abort(2));
    assert!(p.is_idle());
    assert_eq!(p.blocks_used(), 0);
    p.assert_accounting();
}

#[test]
fn aborting_during_a_step_ignores_its_results_and_frees_the_id() {
    let mut p = policy(64, 4, 4, 20);
    add(&mut p, 1, 0, 5, 10);
    add(&mut p, 2, 0, 5, 10);
    let plan = p.plan_step().expect("prefill");
    assert!(p.abort(1));
    assert_eq!(p.blocks_used(), 2);
    // The id may be reused before the old step reports back; the stale result must not touch it.
    add(&mut p, 1, 0, 3, 10);
    complete(&mut p, &plan);
    let v = p.seq(1).expect("the new seq 1");
    assert_eq!((v.running, v.tokens.len()), (false, 3));
    assert_eq!(p.seq(2).map(|v| v.tokens.len()), Some(6));
    p.assert_accounting();
}

#[test]
fn finishing_a_waiting_sequence_through_on_step_done_removes_it() {
    let mut p = policy(64, 1, 4, 20);
    add(&mut p, 1, 0, 5, 10);
    add(&mut p, 2, 0, 5, 10);
    let plan = p.plan_step().expect("prefill");
    let sampled: Vec<_> = plan.seqs.iter().map(|s| (s.id, verify(s))).collect();
    p.on_step_done(&sampled, &[2]);
    assert_eq!(p.num_waiting(), 0);
    p.assert_accounting();
}

#[test]
fn dropping_a_busy_policy_does_not_trip_the_leak_check() {
    let mut p = policy(64, 4, 4, 20);
    add(&mut p, 1, 0, 5, 10);
    step(&mut p);
    drop(p);
}

// ---- rule 4: several query tokens per sequence (drafts) ----

#[test]
fn drafts_ride_along_a_decode_and_count_in_budget_and_blocks() {
    let mut p = policy(64, 4, 4, 20);
    add(&mut p, 1, 0, 5, 20);
    step(&mut p);
    let d = vec![truth(1, 6), truth(1, 7), 12_345];
    assert_eq!(p.set_draft(1, d.clone()), 3);
    let plan = p.plan_step().expect("decode + drafts");
    let s = &plan.seqs[0];
    assert_eq!((s.start_pos, s.num_draft, s.wants_logits), (5, 3, true));
    assert_eq!(s.tokens, [vec![truth(1, 5)], d].concat());
    assert_eq!(s.block_table.len(), 9usize.div_ceil(4));
    assert!(s.is_decode());
    assert_eq!(plan.num_tokens(), 4);
    // The model agrees with two drafts, then corrects the third.
    let out = verify(s);
    assert_eq!(out, vec![truth(1, 6), truth(1, 7), truth(1, 8)]);
    p.on_step_done(&[(1, out)], &[]);
    let v = p.seq(1).expect("running");
    assert_eq!((v.tokens.len(), v.num_computed), (9, 8));
    // Drafts are for one step: the next one is a plain decode of the corrected token.
    let plan = p.plan_step().expect("decode");
    assert_eq!((plan.seqs[0].start_pos, plan.seqs[0].tokens.clone()), (8, vec![truth(1, 8)]));
}

#[test]
fn tokens_after_the_first_disagreement_with_the_draft_are_ignored() {
    let mut p = policy(64, 4, 4, 20);
    add(&mut p, 1, 0, 5, 20);
    step(&mut p);
    p.set_draft(1, vec![100, 101, 102]);
    p.plan_step().expect("decode + drafts");
    // Claims 100 accepted, then 7 (disagreeing with 101), then junk.
    p.on_step_done(&[(1, vec![100, 7, 8, 9])], &[]);
    let v = p.seq(1).expect("running");
    assert_eq!(&v.tokens[6..], &[100, 7]);
    assert_eq!(v.num_computed, 7);
}

#[test]
fn drafts_are_capped_by_max_tokens_and_refused_when_they_cannot_apply() {
    let mut p = policy(32, 4, 4, 20);
    add(&mut p, 1, 0, 5, 3);
    add(&mut p, 2, 0, 40, 3);
    assert_eq!(p.set_draft(1, vec![1, 2]), 0, "waiting");
    assert_eq!(p.set_draft(9, vec![1, 2]), 0, "unknown");
    let plan = p.plan_step().expect("prefill");
    assert_eq!(p.set_draft(1, vec![1, 2]), 0, "in flight");
    complete(&mut p, &plan);
    assert_eq!(p.set_draft(2, vec![1, 2]), 0, "still prefilling");
    // One token generated of 3: a draft may add at most 3 - 1 - 1 tokens plus the bonus one.
    assert_eq!(p.set_draft(1, vec![1, 2, 3, 4]), 1);
}

#[test]
fn drafts_only_use_budget_that_prefill_leaves() {
    let mut p = policy(16, 4, 4, 100);
    add(&mut p, 1, 0, 4, 50);
    step(&mut p);
    add(&mut p, 2, 0, 100, 5);
    p.set_draft(1, vec![1, 2, 3, 4, 5, 6, 7]);
    let plan = step(&mut p);
    assert_eq!((plan.seqs[0].num_draft, plan.seqs[1].tokens.len()), (0, 15));
    p.abort(2);
    add(&mut p, 3, 0, 10, 5);
    p.set_draft(1, vec![1, 2, 3, 4, 5, 6, 7]);
    let plan = step(&mut p);
    assert_eq!(ids(&plan), vec![1, 3]);
    assert_eq!((plan.seqs[0].num_draft, plan.num_tokens()), (5, 16));
}

#[test]
fn drafts_never_preempt() {
    let mut p = policy(64, 4, 4, 5);
    add(&mut p, 1, 10, 7, 10); // 2 blocks
    add(&mut p, 2, 0, 12, 3); // 3 blocks
    step(&mut p);
    assert_eq!(p.blocks_free(), 0);
    p.set_draft(1, vec![1, 2, 3, 4, 5]);
    let plan = step(&mut p);
    assert!(plan.preempted.is_empty());
    assert_eq!(planned(&plan, 1).map(|s| s.num_draft), Some(0), "position 7 fits block 2; drafts need a new one");
}

// ---- rule 5: accounting under random operations ----

/// A fake executor with a real KV layout: each block slot records which sequence wrote which token
/// at which position, so a block table that points at someone else's data or at unwritten slots
/// fails the read check.
/// As in a real model, the KV at a position depends on every token up to it: a slot records the
/// position and a hash of the tokens `0..=pos`, so reading a prefix page that some other
/// sequence wrote is fine exactly when the tokens agree.
struct FakeKv {
    block_size: usize,
    slots: Vec<Option<(usize, u64)>>,
}

fn prefix_hashes(full: &[u32]) -> Vec<u64> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    full.iter()
        .map(|&t| {
            h = (h ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3);
            h
        })
        .collect()
}

impl FakeKv {
    fn run(&mut self, s: &PlannedSeq, full: &[u32]) {
        let bs = self.block_size;
        let slot = |pos: usize| s.block_table[pos / bs] as usize * bs + pos % bs;
        assert!(s.block_table.len() * bs >= s.start_pos + s.tokens.len(), "blocks too short");
        let mut with_query = full[..s.start_pos].to_vec();
        with_query.extend_from_slice(&s.tokens);
        let hashes = prefix_hashes(&with_query);
        for (pos, h) in hashes.iter().enumerate().take(s.start_pos) {
            assert_eq!(self.slots[slot(pos)], Some((pos, *h)), "seq {} reads bad KV at {pos}", s.id);
        }
        for i in 0..s.tokens.len() {
            let pos = s.start_pos + i;
            self.slots[slot(pos)] = Some((pos, hashes[pos]));
        }
    }
}

struct Client {
    prompt: Vec<u32>,
    emitted: Vec<u32>,
    max_tokens: usize,
}

fn check_plan(p: &Policy, plan: &StepPlanOut, clients: &BTreeMap<SeqId, Client>) {
    let c = p.config();
    assert!(plan.num_tokens() <= c.max_num_batched_tokens);
    assert!(plan.seqs.len() <= c.max_num_seqs);
    let mut seen = HashSet::new();
    let mut written = HashSet::new();
    for s in &plan.seqs {
        assert!(seen.insert(s.id), "seq {} planned twice", s.id);
        assert!(!plan.preempted.contains(&s.id));
        assert!(!s.tokens.is_empty() && s.num_draft < s.tokens.len());
        assert_eq!(s.block_table.len(), (s.start_pos + s.tokens.len()).div_ceil(c.block_size));
        // Blocks a step writes are never written by another sequence in the same step (only
        // cached prefix pages, which are read, may be shared).
        for &b in &s.block_table[s.start_pos / c.block_size..] {
            assert!(written.insert(b), "block {b} written by two sequences in one step");
        }
        if c.page_aligned_chunks && c.page_tokens > 0 && s.tokens.len() > 1 && s.num_draft == 0 {
            let room = c.page_tokens - s.start_pos % c.page_tokens;
            assert!(s.tokens.len() <= room, "a prefill chunk crosses a page boundary");
        }
        let client = &clients[&s.id];
        let full = [client.prompt.as_slice(), client.emitted.as_slice()].concat();
        let known = s.tokens.len() - s.num_draft;
        assert_eq!(&s.tokens[..known], &full[s.start_pos..s.start_pos + known]);
        assert_eq!(s.wants_logits, s.start_pos + known == full.len());
        assert!(s.num_draft == 0 || s.wants_logits);
    }
}

fn random_run(seed: u64, page_tokens: usize, paced: bool) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (bs, nb) = (4, 40);
    let mut p = Policy::new(PolicyConfig { page_tokens, ..cfg(48, 6, bs, nb) }).expect("config");
    if paced {
        // Targets tight enough that lower prefill shrinks and pauses most steps.
        use crate::sched::{LaneTarget, Pacing, StepCost, StepCostModel};
        let cost = StepCost { fixed: 0.01, per_prefill_token: 0.001, per_decode_seq: 0.002, per_million_attended: 1.0 };
        let targets =
            vec![LaneTarget { priority: 10, ttft: 0.03, itl: 0.02 }, LaneTarget { priority: 5, ttft: 0.05, itl: 0.03 }];
        p.set_pacing(Some(Pacing::new(targets, StepCostModel::new(cost, 0.9), bs)));
    }
    let mut kv = FakeKv { block_size: bs, slots: vec![None; bs * nb] };
    let mut clients: BTreeMap<SeqId, Client> = BTreeMap::new();
    let mut next_id: SeqId = 0;
    let mut preemptions = 0;
    let mut accepted_drafts = 0;

    let mut one_step = |p: &mut Policy, rng: &mut ChaCha8Rng, clients: &mut BTreeMap<SeqId, Client>| {
        let Some(plan) = p.plan_step() else {
            assert!(p.is_idle(), "nothing planned while work is queued");
            return;
        };
        check_plan(p, &plan, clients);
        preemptions += plan.preempted.len();
        // A device whose step times wander: the cost model refits as it goes.
        let secs = 0.01 + plan.shape.prefill_tokens as f64 * rng.random_range(0.0005..0.002);
        p.observe_step(&plan.shape, secs);
        for s in &plan.seqs {
            let c = &clients[&s.id];
            kv.run(s, &[c.prompt.as_slice(), c.emitted.as_slice()].concat());
        }
        if rng.random_bool(0.02) {
            p.on_step_failed();
            return;
        }
        let mut sampled = Vec::new();
        let mut finished = Vec::new();
        for s in plan.seqs.iter().filter(|s| s.wants_logits) {
            let out = verify(s);
            accepted_drafts += out.len() - 1;
            let c = clients.get_mut(&s.id).expect("client");
            let room = c.max_tokens - c.emitted.len();
            c.emitted.extend_from_slice(&out[..out.len().min(room)]);
            if rng.random_bool(0.05) {
                finished.push(s.id);
            }
            sampled.push((s.id, out));
        }
        let ended = p.on_step_done(&sampled, &finished);
        for id in finished.iter().chain(&ended) {
            let Some(c) = clients.remove(id) else { continue };
            assert!(ended.contains(id) == (c.emitted.len() == c.max_tokens) || finished.contains(id));
            let expected: Vec<u32> = (0..c.emitted.len()).map(|i| truth(*id, c.prompt.len() + i)).collect();
            assert_eq!(c.emitted, expected, "seq {id} diverged from its uninterrupted stream");
        }
        for (id, c) in clients.iter() {
            let v = p.seq(*id).expect("live client has a live sequence");
            assert_eq!(v.tokens, [c.prompt.as_slice(), c.emitted.as_slice()].concat());
        }
    };

    for _ in 0..3000 {
        let r: f64 = rng.random();
        if r < 0.3 {
            next_id += 1;
            let id = next_id;
            let priority = [0, 0, 5, 10][rng.random_range(0..4)];
            let (plen, max_tokens) = (rng.random_range(1..80), rng.random_range(1..40));
            // Half the prompts start with one of a few shared stems, so prefix hits happen.
            let mut prompt = prompt(id, plen);
            if rng.random_bool(0.5) {
                let stem = 1_000 + rng.random_range(0..3);
                for (pos, t) in prompt.iter_mut().enumerate().take(rng.random_range(0..plen + 1)) {
                    *t = truth(stem, pos);
                }
            }
            let res = p.add(NewSeq { id, priority, prompt: prompt.clone(), max_tokens });
            if (plen + max_tokens).div_ceil(bs) > nb {
                assert!(matches!(res, Err(PolicyError::NeverFits { .. })));
            } else {
                res.expect("fits");
                clients.insert(id, Client { prompt, emitted: Vec::new(), max_tokens });
            }
        } else if r < 0.35 {
            let id = if clients.is_empty() || rng.random_bool(0.2) {
                next_id + 1000
            } else {
                *clients.keys().nth(rng.random_range(0..clients.len())).expect("nonempty")
            };
            assert_eq!(p.abort(id), clients.remove(&id).is_some());
        } else if r < 0.6 {
            // Offer drafts to a random subset of the decoding sequences, as a drafter would.
            let mut decoding: Vec<(SeqId, usize, usize)> = clients
                .keys()
                .filter_map(|&id| p.seq(id))
                .filter(|v| v.running && v.num_computed + 1 == v.tokens.len())
                .map(|v| (v.id, v.tokens.len(), v.prompt_len + v.max_tokens))
                .collect();
            decoding.retain(|_| rng.random_bool(0.5));
            for (id, len, limit) in decoding {
                let draft: Vec<u32> = (0..rng.random_range(1..8))
                    .map(|i| if rng.random_bool(0.7) { truth(id, len + i) } else { rng.random_range(0..10) })
                    .collect();
                let kept = p.set_draft(id, draft.clone());
                assert!(kept <= draft.len() && len + kept < limit);
            }
        }
        one_step(&mut p, &mut rng, &mut clients);
        p.assert_accounting();
    }
    // Liveness: without new work everything drains, and an idle policy holds nothing.
    let mut steps = 0;
    while !p.is_idle() {
        one_step(&mut p, &mut rng, &mut clients);
        p.assert_accounting();
        steps += 1;
        assert!(steps < 20_000, "the policy does not drain: livelock");
    }
    assert!(clients.is_empty());
    assert_eq!((p.blocks_used(), p.blocks_free()), (0, nb));
    let hits = p.pool().counters().hit_tokens;
    if page_tokens > 0 {
        eprintln!("seed {seed}: {hits} tokens served from the prefix cache");
        assert!(hits > 100, "only {hits} cached tokens served");
    }
    // The run must have exercised the interesting paths.
    eprintln!("seed {seed}: {preemptions} preemptions, {accepted_drafts} accepted draft tokens");
    assert!(preemptions > 10, "only {preemptions} preemptions");
    assert!(accepted_drafts > 10, "only {accepted_drafts} accepted drafts");
}

#[test]
fn randomized_operations_keep_accounting_and_streams_exact() {
    for seed in 0..6 {
        random_run(seed, 0, false);
    }
}

#[test]
fn randomized_operations_with_the_prefix_cache_keep_accounting_and_streams_exact() {
    for seed in 0..6 {
        random_run(seed, 8, false);
    }
}

#[test]
fn randomized_operations_with_lane_pacing_keep_accounting_and_streams_exact() {
    for seed in 0..6 {
        random_run(seed, if seed % 2 == 0 { 0 } else { 8 }, true);
    }
}

#[path = "prefix_tests.rs"]
mod prefix;

#[path = "lookahead_tests.rs"]
mod lookahead;
