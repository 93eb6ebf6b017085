//! Lower-lane prefill that yields at a layer boundary (issue 24). Lane pacing sizes the chunks a
//! step carries, but a voice turn that arrives while a long agent chunk runs still waits for that
//! chunk. So a step that carries prefill of lanes below one with latency targets, and nothing
//! else but those lanes' decodes, is *yieldable* (its decode rows sample after the resume, like
//! its prefill rows): the scheduler gives it a yield signal, raises it when a request of a higher lane
//! arrives, and the executor stops the step at the next layer boundary and keeps its partial
//! state (`actors::yielding`). The planner then:
//!
//! - keeps the suspended step's sequences in flight: no other step carries them, nobody preempts
//!   them, their blocks stay theirs (their KV is written up to the layer reached);
//! - plans the next steps without them (the higher lane's turn, anyone else's paced chunks);
//! - resumes the suspended step (`resume_suspended`) once no lane above its level has a request
//!   waiting or prefilling and at least one step ran since it stopped (or when nothing else can
//!   be planned, so a higher-lane request that cannot be admitted never deadlocks it). While a lane
//!   above still decodes, the resumed step gets a time slice (`resume_slice`: that lane's ITL
//!   target less its decode step) after which the scheduler raises the signal again: the step's
//!   remaining layers interleave with the higher lane's decodes instead of delaying them;
//! - defers a cancellation of one of its sequences until the step has completed: its blocks are
//!   written by the resumed step, so they are released only after it.
//!
//! Only attention-only models yield. A hybrid model (`glm5_next`) would need its recurrent state
//! advanced layer by layer for the suspended rows and left alone by the steps in between, which
//! nobody has checked; its steps are never marked (`PolicyConfig::recurrent_state`), and its
//! backends run every step whole anyway (the default `Backend::forward_yielding`). Lookahead steps
//! and steps with drafts are never yieldable, and no lookahead step is planned on top of a
//! yieldable one.

use super::{Planned, Planner};
use crate::sched::cost::StepShape;
use crate::sched::SeqId;

#[derive(Debug, Default)]
pub(super) struct YieldState {
    /// The sequences of the yieldable step, from its planning until it completes (in flight or
    /// suspended); empty when there is none.
    step: Vec<SeqId>,
    /// The highest priority the step carries: lanes above it make it yield.
    level: i32,
    suspended: Option<Vec<Planned>>,
    /// Sequences of that step cancelled meanwhile: released once it completes.
    cancelled: Vec<SeqId>,
    /// Steps completed since it last stopped: it resumes only after the lanes above had one.
    steps_since_suspended: u32,
}

/// The shortest time slice a resumed step gets (it always runs at least one layer anyway).
const MIN_SLICE_SECS: f64 = 0.005;

impl Planner {
    /// Marks steps that carry lower-lane prefill (and maybe lower-lane decodes) yieldable (with lane pacing on, for lanes
    /// below one with targets). The caller must be able to suspend and resume them: one rank, a
    /// backend that yields, no lookahead scheduling.
    pub fn set_yielding(&mut self, on: bool) {
        self.yielding = on;
    }

    /// The step just planned (the last in flight): its yield level when it is yieldable.
    pub(super) fn mark_yieldable(&mut self) -> Option<i32> {
        if !self.yielding || self.cfg.recurrent_state || !self.yield_state.step.is_empty() {
            return None;
        }
        let pacing = self.pacing.as_ref()?;
        let step = self.in_flight.back()?;
        let (mut level, mut prefill) = (i32::MIN, false);
        for p in step {
            let seq = self.seqs.get(&p.id)?;
            if !p.draft.is_empty() {
                return None;
            }
            prefill |= !(p.n_base == 1 && p.start + 1 == seq.tokens.len());
            level = level.max(seq.priority);
        }
        // Decodes alone are one token each: voice does not wait long behind them.
        if !prefill {
            return None;
        }
        pacing.step_cap(level, |_| false)?;
        self.yield_state.step = step.iter().map(|p| p.id).collect();
        self.yield_state.level = level;
        Some(level)
    }

    /// A yieldable step is in flight or suspended.
    pub fn has_yieldable_step(&self) -> bool {
        !self.yield_state.step.is_empty()
    }

    /// Whether a request of `priority` arriving now makes the yieldable step give way: a step of
    /// its level or above is never interrupted, and nothing is while no step is yieldable.
    pub fn yields_to(&self, priority: i32) -> bool {
        self.has_yieldable_step() && priority > self.yield_state.level
    }

    /// A request of a lane above `level` waits for admission (it arrived while the step was
    /// being committed): the step is dispatched with its signal already raised.
    pub fn waits_above(&self, level: i32) -> bool {
        self.waiting.keys().any(|p| p.0 > level)
    }

    /// The step in flight stopped at a layer boundary: it waits, suspended, for
    /// `resume_suspended`. Returns its yield level; `None` if it was not the yieldable step (it
    /// is then left in flight).
    pub fn on_step_suspended(&mut self) -> Option<i32> {
        if self.yield_state.step.is_empty() || self.yield_state.suspended.is_some() || self.in_flight.len() != 1 {
            tracing::warn!("a step suspended that was not planned yieldable");
            return None;
        }
        self.yield_state.suspended = self.in_flight.pop_front();
        self.yield_state.steps_since_suspended = 0;
        Some(self.yield_state.level)
    }

    /// The level of the suspended step, if one is suspended.
    pub fn suspended_level(&self) -> Option<i32> {
        self.yield_state.suspended.as_ref().map(|_| self.yield_state.level)
    }

    /// A step is suspended, nothing else is in flight or being planned, and no lane above its
    /// level has a request waiting or prefilling; if a lane above still decodes, a step ran since
    /// the suspension (its decodes were served).
    pub fn may_resume(&self) -> bool {
        let Some(level) = self.suspended_level() else { return false };
        let above = |p: &i32| *p > level;
        let decoding_above = self.running.iter().any(|((p, _), _)| above(&p.0));
        self.in_flight.is_empty()
            && self.awaiting.is_none()
            && !self.waits_above(level)
            && !self.running.iter().any(|((p, _), id)| above(&p.0) && self.seqs.get(id).is_some_and(|s| !s.is_decode()))
            && (!decoding_above || self.yield_state.steps_since_suspended > 0)
    }

    /// How long the step about to be resumed may run before it yields again, in seconds: `None`
    /// when no lane above with targets has work (it runs to its end); otherwise the strictest such
    /// lane's ITL target less the predicted cost of that lane's next decode step.
    pub fn resume_slice(&self) -> Option<f64> {
        let level = self.yield_state.level;
        let pacing = self.pacing.as_ref()?;
        let mut decodes = StepShape::default();
        let mut itl = f64::INFINITY;
        for ((p, _), id) in self.running.iter().filter(|((p, _), _)| p.0 > level) {
            if let (Some(t), Some(s)) = (pacing.targets().iter().find(|t| t.priority == p.0), self.seqs.get(id)) {
                itl = itl.min(t.itl);
                decodes.add(s.num_computed, 1, true);
            }
        }
        if decodes.is_empty() {
            return None;
        }
        Some((itl - pacing.model().predict(&decodes)).max(MIN_SLICE_SECS))
    }

    /// Called for every completed step.
    pub(super) fn count_step_while_suspended(&mut self) {
        if self.yield_state.suspended.is_some() {
            self.yield_state.steps_since_suspended += 1;
        }
    }

    /// Puts the suspended step back in flight (the caller tells the executor to continue it).
    /// False when none is suspended or another step is in flight or being planned.
    pub fn resume_suspended(&mut self) -> bool {
        if !self.in_flight.is_empty() || self.awaiting.is_some() {
            return false;
        }
        match self.yield_state.suspended.take() {
            Some(step) => {
                self.in_flight.push_back(step);
                // The resumed slice is the lower lanes' turn (`sched::lane_split`): the higher
                // lane's step comes next.
                self.forget_split();
                true
            }
            None => false,
        }
    }

    /// `abort` of a sequence of the yieldable step: deferred until the step completes.
    pub(super) fn defer_release_if_suspended(&mut self, id: SeqId) -> bool {
        let ys = &mut self.yield_state;
        if !ys.step.contains(&id) || !self.seqs.contains_key(&id) {
            return false;
        }
        if !ys.cancelled.contains(&id) {
            ys.cancelled.push(id);
        }
        true
    }

    /// A sequence cancelled while its yieldable step ran: its results are ignored.
    pub(super) fn release_deferred(&self, id: SeqId) -> bool {
        self.yield_state.cancelled.contains(&id)
    }

    /// After a step completed or failed: if it was the yieldable step (none is suspended any
    /// more), its cancelled sequences go now.
    pub(super) fn release_cancelled(&mut self) {
        if self.yield_state.step.is_empty() || self.yield_state.suspended.is_some() {
            return;
        }
        self.yield_state.step.clear();
        for id in std::mem::take(&mut self.yield_state.cancelled) {
            self.remove_seq(id);
        }
    }
}
