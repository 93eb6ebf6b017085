//! Lane pacing in the planner, as plain data: step composition under mixed lanes, agent chunks
//! shrinking to the voice lane's budget, pausing at a chunk boundary with the KV kept, and
//! resumption at full size once voice is idle.

use super::lane_test_support::{add, small_cfg, step, AGENT, COST, VOICE};
use super::*;
use crate::sched::{LaneTarget, Pacing, SeqId, StepCost, StepCostModel, StepPlanOut, StepShape};

const TARGET: LaneTarget = LaneTarget { priority: VOICE, ttft: 0.200, itl: 0.050 };

fn policy(paced: bool) -> Policy {
    let mut p = Policy::new(small_cfg(1024)).expect("valid config");
    if paced {
        let targets = vec![TARGET, LaneTarget { priority: AGENT, ttft: 10.0, itl: 1.0 }];
        p.set_pacing(Some(Pacing::new(targets, StepCostModel::new(COST, 0.9), 16)));
    }
    p
}

fn tokens_of(plan: &StepPlanOut, id: SeqId) -> usize {
    plan.seqs.iter().find(|s| s.id == id).map_or(0, |s| s.tokens.len())
}

fn predicted(plan: &StepPlanOut) -> f64 {
    StepCostModel::new(COST, 1.0).predict(&plan.shape)
}

#[test]
fn agent_prefill_shrinks_pauses_for_voice_and_resumes_at_full_size_when_voice_is_idle() {
    let mut p = policy(true);
    add(&mut p, 1, AGENT, 2000, 4);
    // Voice idle, none seen yet: the step in flight may take the whole 200 ms TTFT target.
    let s1 = step(&mut p);
    assert_eq!(tokens_of(&s1, 1), 190, "10 ms fixed + 190 tokens = 200 ms");
    // A voice request of 60 tokens arrives: the next step carries it first, whole, and the agent
    // prefill pauses at its chunk boundary (60 ms of voice already exceed the 50 ms ITL budget).
    add(&mut p, 2, VOICE, 60, 3);
    let s2 = step(&mut p);
    assert_eq!(s2.seqs[0].id, 2, "voice first");
    assert_eq!(tokens_of(&s2, 2), 60);
    assert_eq!(tokens_of(&s2, 1), 0, "agent paused");
    let agent = p.seq(1).unwrap();
    assert!(agent.running && agent.num_computed == 190, "paused, not preempted: its KV is kept");
    assert_eq!(agent.block_table.len(), 190usize.div_ceil(16));
    // While voice decodes, the agent fills what its ITL budget leaves: 50 − 10 − 2 = 38 ms.
    for _ in 0..2 {
        let s = step(&mut p);
        assert_eq!((tokens_of(&s, 2), tokens_of(&s, 1)), (1, 38));
        assert!(predicted(&s) <= TARGET.itl + 1e-9, "a voice decode step stays within its ITL target");
    }
    assert!(p.seq(2).is_none(), "voice finished after 3 tokens");
    // Voice idle again: the agent's chunk grows back to what leaves room for a typical 60-token
    // voice turn inside the TTFT target (200 − 70 − 10 ms fixed = 120 tokens).
    let s5 = step(&mut p);
    assert_eq!(tokens_of(&s5, 1), 120);
    assert_eq!(p.seq(1).unwrap().num_computed, 190 + 38 + 38 + 120);
}

#[test]
fn without_pacing_agent_chunks_fill_the_token_budget_and_ride_with_voice() {
    let mut p = policy(false);
    add(&mut p, 1, AGENT, 2000, 4);
    assert_eq!(tokens_of(&step(&mut p), 1), 512);
    add(&mut p, 2, VOICE, 60, 3);
    let s = step(&mut p);
    assert_eq!((tokens_of(&s, 2), tokens_of(&s, 1)), (60, 452), "voice shares its step with agent prefill");
}

#[test]
fn a_lane_with_generous_targets_leaves_agents_their_full_chunks() {
    let mut p = policy(false);
    let relaxed = LaneTarget { priority: VOICE, ttft: 30.0, itl: 10.0 };
    p.set_pacing(Some(Pacing::new(vec![relaxed], StepCostModel::new(COST, 0.9), 16)));
    add(&mut p, 1, AGENT, 2000, 4);
    add(&mut p, 2, VOICE, 60, 3);
    let s = step(&mut p);
    assert_eq!((tokens_of(&s, 2), tokens_of(&s, 1)), (60, 452));
}

#[test]
fn voice_decodes_ride_every_step_and_agent_decodes_are_never_dropped() {
    let mut p = policy(true);
    add(&mut p, 1, AGENT, 20, 50);
    add(&mut p, 2, VOICE, 20, 50);
    step(&mut p);
    add(&mut p, 3, AGENT, 3000, 4);
    for _ in 0..10 {
        let s = step(&mut p);
        assert_eq!((tokens_of(&s, 1), tokens_of(&s, 2)), (1, 1), "both decodes in every step");
        assert!(predicted(&s) <= TARGET.itl + 1e-9, "{:?}", s.shape);
        assert!(tokens_of(&s, 3) > 0, "the long agent prefill still progresses under the voice budget");
    }
}

#[test]
fn chunks_follow_the_step_cost_measured_on_the_device() {
    let mut p = policy(true);
    // The device turns out twice as slow per prefill token as the default assumed.
    let slow = StepCostModel::new(StepCost { per_prefill_token: 0.002, ..COST }, 1.0);
    for n in [16usize, 64, 128, 256, 32, 200, 100, 300] {
        for decodes in 0..3 {
            let mut shape = StepShape::default();
            shape.add(0, n, false);
            for _ in 0..decodes {
                shape.add(50, 1, true);
            }
            p.observe_step(&shape, slow.predict(&shape));
        }
    }
    add(&mut p, 1, AGENT, 2000, 4);
    let n = tokens_of(&step(&mut p), 1);
    assert!((90..=100).contains(&n), "about (200 − 10) / 2 tokens fit the slow device, got {n}");
}
