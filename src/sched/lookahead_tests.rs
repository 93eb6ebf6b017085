//! Lookahead planning (`sched::lookahead`) against the composed policy: the streams equal the
//! serial ones, sequences that end under a lookahead step leave nothing behind, and a lookahead
//! step is planned only when the step in flight can merely be continued.

use std::collections::VecDeque;

use super::*;

/// What a run produced: every sequence's tokens when it ended, and how many steps were lookahead.
struct Run {
    tokens: BTreeMap<SeqId, Vec<u32>>,
    lookahead_steps: usize,
}

/// Drives `p` as the scheduler and executor do: with `overlap`, a lookahead step is planned
/// whenever exactly one step is in flight; steps complete in order; a lookahead row's input is the
/// token the step before sampled for it (checked against the policy's own sequence). A sequence
/// ends with a stop token once it generated `stop_after(id)` tokens (passed as `finished`, like
/// the scheduler does), which leaves a lookahead step computing it once more.
fn drive(p: &mut Policy, overlap: bool, stop_after: impl Fn(SeqId) -> Option<usize>) -> Run {
    let mut run = Run { tokens: BTreeMap::new(), lookahead_steps: 0 };
    let mut in_flight: VecDeque<StepPlanOut> = VecDeque::new();
    let mut last_sampled: BTreeMap<SeqId, u32> = BTreeMap::new();
    let mut generated: BTreeMap<SeqId, usize> = BTreeMap::new();
    for _ in 0..10_000 {
        if in_flight.is_empty() {
            match p.plan_step() {
                Some(plan) if !plan.seqs.is_empty() => in_flight.push_back(plan),
                Some(_) => continue,
                None if p.is_idle() => return run,
                None => panic!("work left but nothing planned"),
            }
        }
        if overlap && in_flight.len() == 1 {
            if let Some(plan) = p.plan_lookahead(|_| true).filter(|plan| !plan.seqs.is_empty()) {
                run.lookahead_steps += 1;
                in_flight.push_back(plan);
            }
        }
        let plan = in_flight.pop_front().expect("a step in flight");
        let mut sampled = Vec::new();
        let mut finished = Vec::new();
        let mut now_sampled = BTreeMap::new();
        for s in plan.seqs.iter().filter(|s| s.wants_logits) {
            if s.follows_previous {
                let input = last_sampled.get(&s.id).copied().expect("the step before sampled it");
                if let Some(v) = p.seq(s.id) {
                    assert_eq!(v.tokens[s.start_pos], input, "seq {}: the lookahead input is the last sample", s.id);
                }
            }
            let toks = verify(s);
            now_sampled.insert(s.id, *toks.last().expect("a token"));
            if p.seq(s.id).is_none() {
                continue; // ended while this step waited: its result is ignored
            }
            let g = generated.entry(s.id).or_default();
            if stop_after(s.id) == Some(*g) {
                finished.push(s.id);
                run.tokens.insert(s.id, p.seq(s.id).expect("live").tokens.to_vec());
                continue;
            }
            *g += toks.len();
            sampled.push((s.id, toks));
        }
        last_sampled = now_sampled;
        let before: Vec<(SeqId, Vec<u32>)> =
            sampled.iter().filter_map(|(id, _)| p.seq(*id).map(|v| (*id, v.tokens.to_vec()))).collect();
        let ended = p.on_step_done(&sampled, &finished);
        for (id, mut tokens) in before {
            if ended.contains(&id) {
                tokens.extend(&sampled.iter().find(|(s, _)| *s == id).expect("sampled").1);
                run.tokens.insert(id, tokens);
            }
        }
        p.assert_accounting();
    }
    panic!("the run did not end");
}

fn three_streams(overlap: bool) -> (Run, Policy) {
    let mut p = policy(64, 4, 4, 64);
    add(&mut p, 1, 0, 6, 9);
    add(&mut p, 2, 0, 3, 14);
    add(&mut p, 3, 0, 11, 5);
    let run = drive(&mut p, overlap, |id| (id == 2).then_some(6));
    (run, p)
}

#[test]
fn overlapped_steps_give_the_serial_streams_and_free_every_block() {
    let (serial, _) = three_streams(false);
    let (overlapped, p) = three_streams(true);
    assert_eq!(serial.lookahead_steps, 0);
    assert!(overlapped.lookahead_steps >= 5, "only {} lookahead steps", overlapped.lookahead_steps);
    assert_eq!(overlapped.tokens, serial.tokens);
    for (id, tokens) in &overlapped.tokens {
        let want: Vec<u32> = (0..tokens.len()).map(|pos| truth(*id, pos)).collect();
        assert_eq!(tokens, &want, "seq {id} follows the model");
    }
    assert_eq!(overlapped.tokens[&1].len(), 6 + 9, "ended by max_tokens");
    assert_eq!(overlapped.tokens[&2].len(), 3 + 6, "ended by its stop token, under a lookahead step");
    assert!(p.is_idle());
    assert_eq!(p.blocks_used(), 0);
}

#[test]
fn a_lookahead_step_continues_each_sampling_sequence_by_one_placeholder_token() {
    let mut p = policy(64, 4, 4, 64);
    add(&mut p, 1, 0, 5, 10);
    add(&mut p, 2, 0, 8, 10);
    let prefill = p.plan_step().expect("prefill");
    let next = p.plan_lookahead(|_| true).expect("both sample: continue them");
    assert_eq!(ids(&next), ids(&prefill));
    for (s, before) in next.seqs.iter().zip(&prefill.seqs) {
        assert!(s.follows_previous && s.wants_logits && s.is_decode());
        assert_eq!(s.start_pos, before.start_pos + before.tokens.len(), "after the chunk in flight");
        assert_eq!(s.block_table.len(), (s.start_pos + 1).div_ceil(4), "room for the position it writes");
    }
    assert_eq!(p.plan_lookahead(|_| true), None, "one step ahead at most");
    assert_eq!(p.plan_step(), None, "nothing plans normally while steps are in flight");
    complete(&mut p, &prefill);
    p.assert_accounting();
}

#[test]
fn no_lookahead_unless_the_step_in_flight_can_only_be_continued() {
    // Somebody waits for admission: the next step must be planned with the results in hand.
    let mut p = policy(64, 1, 4, 64);
    add(&mut p, 1, 0, 5, 10);
    add(&mut p, 2, 0, 5, 10);
    p.plan_step().expect("prefill of 1");
    assert_eq!(p.plan_lookahead(|_| true), None, "2 waits");

    // A prefill chunk that samples nothing continues with known tokens, not a sample.
    let mut p = policy(4, 4, 4, 64);
    add(&mut p, 1, 0, 10, 10);
    p.plan_step().expect("first chunk");
    assert_eq!(p.plan_lookahead(|_| true), None, "chunk without a sample");

    // The caller's veto (grammar, penalties, speculation, context) holds for every sequence.
    let mut p = policy(64, 4, 4, 64);
    add(&mut p, 1, 0, 5, 10);
    add(&mut p, 2, 0, 5, 10);
    p.plan_step().expect("prefill");
    assert_eq!(p.plan_lookahead(|id| id != 2), None);
    assert!(p.plan_lookahead(|_| true).is_some());

    // A sequence whose step in flight samples its last allowed token ends there.
    let mut p = policy(64, 4, 4, 64);
    add(&mut p, 1, 0, 5, 1);
    p.plan_step().expect("prefill");
    assert_eq!(p.plan_lookahead(|_| true), None, "max_tokens reached by the step in flight");
}

#[test]
fn no_lookahead_when_the_pool_cannot_hold_the_next_positions() {
    // 4 blocks of 4. After the prefills, 1 holds 2 full blocks and 2 one full block: the sampled
    // tokens' positions (8 and 4) each need a new block, and only one is free.
    let mut p = policy(64, 4, 4, 4);
    add(&mut p, 1, 0, 8, 4);
    add(&mut p, 2, 0, 4, 4);
    let prefill = p.plan_step().expect("prefills");
    assert_eq!(p.blocks_free(), 1);
    assert_eq!(p.plan_lookahead(|_| true), None, "two blocks needed, one free");
    complete(&mut p, &prefill);
    p.assert_accounting();
    // Serially the planner preempts or waits as it always does.
    assert!(p.plan_step().is_some());
}

#[test]
fn an_aborted_sequence_leaves_its_lookahead_step_and_its_result_is_ignored() {
    let mut p = policy(64, 4, 4, 64);
    add(&mut p, 1, 0, 5, 10);
    add(&mut p, 2, 0, 5, 10);
    let prefill = p.plan_step().expect("prefill");
    let next = p.plan_lookahead(|_| true).expect("lookahead");
    assert!(p.abort(2));
    complete(&mut p, &prefill);
    complete(&mut p, &next);
    p.assert_accounting();
    assert_eq!(p.seq(1).map(|v| v.tokens.len()), Some(7));
    assert!(p.seq(2).is_none());
    assert_eq!(p.blocks_used(), p.seq(1).expect("live").held_blocks);
}

#[test]
fn a_failed_step_and_the_lookahead_behind_it_are_planned_again() {
    let mut p = policy(64, 4, 4, 64);
    add(&mut p, 1, 0, 5, 10);
    let prefill = p.plan_step().expect("prefill");
    p.plan_lookahead(|_| true).expect("lookahead");
    assert_eq!(p.on_step_failed(), vec![1]);
    // The executor fails the lookahead step too (nothing was sampled for it to continue).
    assert_eq!(p.on_step_failed(), vec![1]);
    let again = p.plan_step().expect("replanned");
    assert_eq!(again.seqs, prefill.seqs, "nothing of either step counts");
    complete(&mut p, &again);
    p.assert_accounting();
}

#[test]
fn randomized_overlapped_runs_match_serial_runs() {
    for seed in 0..8u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let specs: Vec<(SeqId, usize, usize, Option<usize>)> = (1..=rng.random_range(2..7))
            .map(|id| {
                let stop = rng.random_bool(0.4).then(|| rng.random_range(0..6));
                (id, rng.random_range(1..20), rng.random_range(1..12), stop)
            })
            .collect();
        let block_size = rng.random_range(1..6);
        let runs: Vec<Run> = [false, true]
            .into_iter()
            .map(|overlap| {
                let mut p = policy(32, 8, block_size, 200);
                for &(id, prompt_len, max_tokens, _) in &specs {
                    add(&mut p, id, 0, prompt_len, max_tokens);
                }
                let run = drive(&mut p, overlap, |id| specs.iter().find(|s| s.0 == id).and_then(|s| s.3));
                assert_eq!(p.blocks_used(), 0, "seed {seed}: blocks left behind");
                run
            })
            .collect();
        assert_eq!(runs[0].tokens, runs[1].tokens, "seed {seed}: overlapped streams differ");
    }
}
