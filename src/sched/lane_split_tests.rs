//! A decoding higher lane's steps apart from lower lanes' prefill (`sched::lane_split`), as plain
//! data: which steps alternate, that the lower steps yield and fit what the lane's ITL target
//! leaves, that the lane's arrivals and decodes never wait for a lower step that cannot run, and
//! when steps stay whole.

use super::lane_test_support::{add, done, ids, small_cfg, step, AGENT, COST, VOICE};
use super::*;
use crate::sched::{LaneTarget, Pacing, StepCostModel, StepPlanOut};

const ITL: f64 = 0.050;

fn policy(itl: f64, separate: bool) -> Policy {
    let mut p = Policy::new(small_cfg(1024)).expect("valid config");
    let voice = LaneTarget { priority: VOICE, ttft: 0.200, itl };
    p.set_pacing(Some(Pacing::new(vec![voice], StepCostModel::new(COST, 0.9), 16)));
    p.set_yielding(true);
    p.set_separate_lane_decodes(separate);
    p
}

fn predicted(p: &Policy, plan: &StepPlanOut) -> f64 {
    p.planner().pacing().expect("paced").model().predict(&plan.shape)
}

/// Voice (9) decoding, an agent (1) with a long prompt waiting.
fn voice_decoding_beside_an_agent(p: &mut Policy) {
    add(p, 9, VOICE, 40, 12);
    let s = step(p);
    assert_eq!(ids(&s), vec![9], "voice's prefill");
    add(p, 1, AGENT, 2000, 4);
}

#[test]
fn a_decoding_voice_lane_alternates_its_own_steps_with_yieldable_agent_prefill() {
    let mut p = policy(ITL, true);
    voice_decoding_beside_an_agent(&mut p);
    let mut agent_chunks = 0;
    for _ in 0..4 {
        let above = step(&mut p);
        assert_eq!(ids(&above), vec![9], "voice's decode alone");
        assert!(above.seqs[0].is_decode());
        assert_eq!(above.yield_level, None, "a voice step runs whole");
        let below = p.plan_step().expect("the agent's chunk");
        assert_eq!(ids(&below), vec![1], "the agent's prefill without voice");
        assert_eq!(below.yield_level, Some(AGENT), "so a voice arrival stops it");
        assert!(p.planner().yields_to(VOICE));
        let pair = predicted(&p, &above) + predicted(&p, &below);
        assert!(pair <= ITL + 1e-9, "the two steps fit voice's ITL target: {pair}");
        agent_chunks += below.seqs[0].tokens.len();
        done(&mut p, &below);
    }
    assert_eq!(p.seq(1).unwrap().num_computed, agent_chunks);
    // The same load with the lanes in one step: one step per ITL target, not yieldable.
    let mut whole = policy(ITL, false);
    voice_decoding_beside_an_agent(&mut whole);
    let s = whole.plan_step().unwrap();
    assert_eq!(ids(&s), vec![9, 1]);
    assert_eq!(s.yield_level, None, "it carries voice: an arrival waits for all of it");
    assert!(predicted(&whole, &s) <= ITL + 1e-9);
}

#[test]
fn a_voice_arrival_goes_in_the_next_voice_step_and_a_yielded_agent_step_resumes_after_it() {
    let mut p = policy(ITL, true);
    voice_decoding_beside_an_agent(&mut p);
    step(&mut p);
    let below = p.plan_step().unwrap();
    assert_eq!(ids(&below), vec![1]);
    // Voice arrives while the agent's chunk runs: it stops at a layer boundary.
    add(&mut p, 10, VOICE, 60, 8);
    assert!(p.planner().yields_to(VOICE));
    assert_eq!(p.on_step_suspended(), Some(AGENT));
    let s = step(&mut p);
    assert_eq!(ids(&s), vec![9, 10], "voice's decode and the new turn's prefill");
    // While the agent's step is suspended, it resumes in slices between voice's decodes
    // (`sched::yielding`), and voice's steps carry no other agent's prefill: nothing else below
    // could yield to the next voice turn.
    add(&mut p, 2, AGENT, 1500, 4);
    let s = step(&mut p);
    assert_eq!(ids(&s), vec![9, 10], "voice's decodes alone while the agent's step is suspended");
    assert!(p.planner().may_resume());
    assert!(p.resume_suspended());
    done(&mut p, &below);
    let s = step(&mut p);
    assert_eq!(ids(&s), vec![9, 10], "both voice turns decode, apart from the agent");
    // A voice request waiting goes first, with voice's decodes, even right after a voice step.
    add(&mut p, 11, VOICE, 60, 2);
    let s = step(&mut p);
    assert_eq!(ids(&s), vec![9, 10, 11], "the arrival is not held behind an agent step");
    assert!(s.seqs.iter().all(|q| q.id != 1));
    while !p.is_idle() {
        step(&mut p);
    }
    assert_eq!(p.blocks_used(), 0);
}

#[test]
fn voice_decodes_never_wait_for_an_agent_step_that_cannot_fit() {
    // Voice's decode step alone (12 ms) uses its whole ITL target: nothing fits below it.
    let mut p = policy(0.012, true);
    voice_decoding_beside_an_agent(&mut p);
    for _ in 0..6 {
        let s = p.plan_step().expect("voice's decode is always planned");
        assert!(ids(&s).contains(&9), "{:?}", ids(&s));
        done(&mut p, &s);
    }
}

#[test]
fn steps_stay_whole_without_lower_prefill_or_a_decoding_lane_with_targets() {
    let mut p = policy(ITL, true);
    // Agents decoding only: voice's decode joins theirs.
    add(&mut p, 1, AGENT, 40, 20);
    step(&mut p);
    add(&mut p, 9, VOICE, 40, 20);
    let mut s = ids(&step(&mut p));
    s.sort_unstable();
    assert_eq!(s, vec![1, 9], "voice's prefill beside the agent's decode");
    let s = step(&mut p);
    assert_eq!(ids(&s), vec![9, 1], "decodes of both lanes in one step");
    // An agent prefilling while voice is idle: its steps are whole (and yieldable already).
    let mut p = policy(ITL, true);
    add(&mut p, 1, AGENT, 2000, 4);
    add(&mut p, 2, AGENT, 40, 20);
    let s = step(&mut p);
    assert_eq!(s.yield_level, Some(AGENT));
    // Off: voice's decode and the agent's prefill share a step, as before.
    let mut p = policy(ITL, false);
    voice_decoding_beside_an_agent(&mut p);
    assert_eq!(ids(&step(&mut p)), vec![9, 1]);
}
