//! Lower-lane prefill that yields at a layer boundary (`sched::yielding`), as plain data: which
//! steps are yieldable, which arrivals make them yield, that a suspended step's sequences stay out
//! of other steps and are never preempted, the resume order, and cancellation of a suspended
//! sequence, with the pool's accounting checked after every move.

use super::lane_test_support::{add, done, ids, small_cfg as cfg, step, AGENT, COST, VOICE};
use super::*;
use crate::sched::{LaneTarget, Pacing, PolicyConfig, StepCostModel};

fn policy_with(cfg: PolicyConfig, paced: bool, yielding: bool) -> Policy {
    let mut p = Policy::new(cfg).expect("valid config");
    if paced {
        let voice = LaneTarget { priority: VOICE, ttft: 0.200, itl: 0.050 };
        p.set_pacing(Some(Pacing::new(vec![voice], StepCostModel::new(COST, 0.9), 16)));
    }
    p.set_yielding(yielding);
    p
}

fn policy() -> Policy {
    policy_with(cfg(1024), true, true)
}

#[test]
fn only_steps_of_lower_lane_prefill_below_a_lane_with_targets_are_yieldable() {
    // Off, or without pacing (no lane has targets): never.
    for (paced, yielding) in [(true, false), (false, true)] {
        let mut p = policy_with(cfg(1024), paced, yielding);
        add(&mut p, 1, AGENT, 2000, 4);
        assert_eq!(p.plan_step().unwrap().yield_level, None, "paced {paced}, yielding {yielding}");
    }
    // A hybrid model's steps never yield (its recurrent state is not checked layer by layer).
    let mut p = policy_with(PolicyConfig { recurrent_state: true, ..cfg(1024) }, true, true);
    add(&mut p, 1, AGENT, 2000, 4);
    assert_eq!(p.plan_step().unwrap().yield_level, None);

    let mut p = policy();
    add(&mut p, 1, AGENT, 300, 2);
    let s = p.plan_step().unwrap();
    assert_eq!(s.yield_level, Some(AGENT), "agent prefill alone");
    assert!(p.planner().yields_to(VOICE) && !p.planner().yields_to(AGENT), "only a higher lane interrupts it");
    done(&mut p, &s);
    assert!(!p.planner().yields_to(VOICE), "nothing is yieldable once it completed");
    // The agent's last chunk ends its prompt (it samples there): still prefill, still yieldable.
    let s = p.plan_step().unwrap();
    assert_eq!((s.seqs[0].wants_logits, s.yield_level), (true, Some(AGENT)));
    done(&mut p, &s);
    // A step of decodes alone is never interrupted (one token each; voice does not wait long).
    let s = p.plan_step().unwrap();
    assert!(s.seqs[0].is_decode());
    assert_eq!(s.yield_level, None);
    done(&mut p, &s);
    // A step that carries voice runs whole.
    add(&mut p, 2, AGENT, 2000, 4);
    add(&mut p, 3, VOICE, 40, 4);
    let s = p.plan_step().unwrap();
    assert!(ids(&s).contains(&3));
    assert_eq!(s.yield_level, None);
    assert!(!p.planner().yields_to(VOICE + 1));
}

#[test]
fn a_step_of_agent_prefill_and_agent_decodes_yields_and_its_decodes_sample_after_the_resume() {
    let mut p = policy();
    add(&mut p, 1, AGENT, 40, 8);
    step(&mut p);
    let view = p.seq(1).unwrap();
    assert_eq!(view.num_computed + 1, view.tokens.len(), "agent 1 decodes from here");
    add(&mut p, 2, AGENT, 2000, 4);
    let mixed = p.plan_step().unwrap();
    assert_eq!(ids(&mixed), vec![1, 2], "agent 1's decode beside agent 2's chunk");
    assert!(mixed.seqs[0].is_decode() && !mixed.seqs[1].is_decode());
    assert_eq!(mixed.yield_level, Some(AGENT), "decodes do not keep a prefill step from yielding");
    let generated = p.seq(1).unwrap().tokens.len();
    add(&mut p, 9, VOICE, 60, 3);
    assert!(p.planner().yields_to(VOICE));
    assert_eq!(p.on_step_suspended(), Some(AGENT));
    let s = step(&mut p);
    assert_eq!(ids(&s), vec![9], "voice runs alone while both agents are suspended");
    assert_eq!(p.seq(1).unwrap().tokens.len(), generated, "the decode has not sampled yet");
    while !p.planner().may_resume() {
        step(&mut p);
    }
    assert!(p.resume_suspended());
    done(&mut p, &mixed);
    assert_eq!(p.seq(1).unwrap().tokens.len(), generated + 1, "it samples when the step completes");
    while !p.is_idle() {
        step(&mut p);
    }
    assert_eq!(p.blocks_used(), 0);
}

#[test]
fn a_suspended_step_waits_while_voice_runs_then_resumes_with_nothing_lost() {
    let mut p = policy();
    add(&mut p, 1, AGENT, 2000, 4);
    add(&mut p, 2, AGENT, 1000, 4);
    let agents = p.plan_step().unwrap();
    assert_eq!(agents.yield_level, Some(AGENT));
    assert_eq!(ids(&agents), vec![1], "pacing gives the first agent the step");
    let chunk = agents.seqs[0].tokens.len();
    // Voice arrives mid-step: the step stops at a layer boundary.
    add(&mut p, 9, VOICE, 60, 3);
    assert!(p.planner().yields_to(VOICE));
    assert_eq!(p.on_step_suspended(), Some(AGENT));
    assert_eq!(p.planner().suspended_level(), Some(AGENT));
    assert!(!p.planner().may_resume(), "voice waits");
    let held = p.seq(1).unwrap().block_table.to_vec();
    let voice_step = |p: &mut Policy| {
        let s = step(p);
        assert!(ids(&s).contains(&9), "the step carries voice");
        assert!(!ids(&s).contains(&1), "the suspended sequence stays out");
        assert_eq!(s.yield_level, None, "one yieldable step at a time");
        assert!(s.preempted.is_empty());
        assert_eq!(p.seq(1).unwrap().block_table, held.as_slice(), "its blocks stay its own");
    };
    // Voice's prefill first.
    voice_step(&mut p);
    // Voice now decodes: the agent resumes for a slice of voice's ITL target less its decode step
    // (50 − 10 − 2 ms), then gives way again; voice's decode runs before it resumes once more.
    assert!(p.planner().may_resume());
    let slice = p.planner().resume_slice().expect("voice decodes");
    assert!((slice - 0.038).abs() < 1e-9, "{slice}");
    assert!(p.resume_suspended());
    assert!(!p.resume_suspended(), "resumed once");
    assert_eq!(p.plan_step(), None, "nothing else is planned while it runs");
    assert_eq!(p.on_step_suspended(), Some(AGENT), "the slice ran out");
    assert!(!p.planner().may_resume(), "voice's decode goes first");
    voice_step(&mut p);
    assert!(p.planner().may_resume());
    assert!(p.resume_suspended());
    // It completes: its chunk counts in full.
    done(&mut p, &agents);
    assert_eq!(p.seq(1).unwrap().num_computed, chunk, "no work lost");
    assert!(!p.planner().yields_to(VOICE));
    step(&mut p);
    assert!(p.seq(9).is_none(), "voice finished after 3 tokens");
    // With voice idle, a suspended step resumes to its end (no slice).
    let s = p.plan_step().unwrap();
    assert_eq!(s.yield_level, Some(AGENT));
    assert_eq!(p.on_step_suspended(), Some(AGENT));
    assert!(p.planner().may_resume());
    assert_eq!(p.planner().resume_slice(), None);
    assert!(p.resume_suspended());
    done(&mut p, &s);
    // Both agents run to the end; every block comes back.
    while !p.is_idle() {
        step(&mut p);
    }
    assert_eq!(p.blocks_used(), 0);
}

#[test]
fn when_nothing_else_can_run_the_suspended_step_may_resume_and_is_never_preempted() {
    // 32 blocks of 16: the agent's 500-token prompt takes them all.
    let mut p = policy_with(PolicyConfig { max_num_seqs: 2, ..cfg(32) }, false, true);
    // A TTFT target so loose that pacing lets the agent take the whole budget.
    let voice = LaneTarget { priority: VOICE, ttft: 100.0, itl: 100.0 };
    p.set_pacing(Some(Pacing::new(vec![voice], StepCostModel::new(COST, 0.9), 16)));
    add(&mut p, 1, AGENT, 500, 2);
    let agents = p.plan_step().unwrap();
    assert_eq!((ids(&agents), agents.seqs[0].tokens.len(), agents.yield_level), (vec![1], 500, Some(AGENT)));
    add(&mut p, 9, VOICE, 100, 2);
    assert_eq!(p.on_step_suspended(), Some(AGENT));
    assert!(!p.planner().may_resume(), "voice waits");
    // Voice cannot be admitted without preempting the suspended agent, which is not allowed:
    // nothing is planned, so the caller resumes the suspended step (it never deadlocks).
    assert_eq!(p.plan_step(), None);
    assert_eq!(p.seq(1).unwrap().num_computed, 0);
    assert_eq!(p.seq(1).unwrap().block_table.len(), 32, "not preempted");
    p.assert_accounting();
    assert!(p.resume_suspended());
    done(&mut p, &agents);
    // Now the agent is between chunks: voice preempts it as usual.
    let s = step(&mut p);
    assert!(ids(&s).contains(&9));
    while !p.is_idle() {
        step(&mut p);
    }
    assert_eq!(p.blocks_used(), 0);
}

#[test]
fn cancelling_a_suspended_sequence_releases_its_blocks_once_the_step_completes() {
    for fails in [false, true] {
        let mut p = policy();
        add(&mut p, 1, AGENT, 2000, 4);
        let agents = p.plan_step().unwrap();
        add(&mut p, 9, VOICE, 60, 1);
        assert_eq!(p.on_step_suspended(), Some(AGENT));
        assert!(p.abort(1), "known");
        assert!(p.abort(1), "still known until its step completes");
        // Its blocks stay referenced: the resumed step still writes them.
        assert!(!p.seq(1).unwrap().block_table.is_empty());
        let s = step(&mut p);
        assert_eq!(ids(&s), vec![9], "the cancelled agent is not planned");
        assert!(p.seq(1).is_some());
        assert!(p.planner().may_resume());
        assert!(p.resume_suspended());
        if fails {
            assert_eq!(p.on_step_failed(), Vec::<SeqId>::new(), "a cancelled sequence is not retried");
        } else {
            done(&mut p, &agents);
        }
        assert!(p.seq(1).is_none(), "released once the step completed");
        p.assert_accounting();
        assert!(p.is_idle());
        assert_eq!(p.blocks_used(), 0, "no block leaks");
    }
}

#[test]
fn a_sequence_cancelled_while_its_yieldable_step_runs_is_released_after_it() {
    let mut p = policy();
    add(&mut p, 1, AGENT, 2000, 4);
    let agents = p.plan_step().unwrap();
    // Cancelled before the step had a chance to yield: it may still suspend and resume later.
    assert!(p.abort(1));
    assert!(p.seq(1).is_some());
    done(&mut p, &agents);
    assert!(p.seq(1).is_none());
    assert_eq!(p.blocks_used(), 0);
}

#[test]
fn a_higher_request_waiting_when_the_step_is_dispatched_is_seen() {
    let mut p = policy();
    add(&mut p, 1, AGENT, 2000, 4);
    let s = p.plan_step().unwrap();
    assert_eq!(s.yield_level, Some(AGENT));
    assert!(!p.planner().waits_above(AGENT));
    add(&mut p, 9, VOICE, 60, 1);
    assert!(p.planner().waits_above(AGENT) && !p.planner().waits_above(VOICE));
    done(&mut p, &s);
}
