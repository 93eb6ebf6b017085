//! A higher lane's decodes in steps of their own while lower lanes prefill (issue 24). With lane
//! pacing, a step that carries a voice decode may also carry agent prefill up to voice's ITL
//! target; such a step is not yieldable (it carries voice), so a voice turn that arrives while it
//! runs waits for all of it. Since voice turns are short, most arrive while an earlier one still
//! decodes, and that wait is most of what a voice turn loses under agent load.
//!
//! With `separate_lane_decodes` on, while a lane with targets decodes and a lower lane has prefill
//! work, steps alternate:
//! - *above*: every lane at or above that level — its decodes, and its prefill if a request of it
//!   arrived — and nothing below;
//! - *below*: everything below that level, in the time the lane's ITL target leaves after the
//!   *above* step's predicted cost. This step carries no higher-lane row, so it is yieldable
//!   (`sched::yielding`): a new voice turn stops it at the next layer boundary.
//!
//! So the lane's decodes keep their ITL target (the two steps together last about one target)
//! and its arrivals wait for at most one short decode step and one layer. The price is one extra
//! step's fixed cost per ITL period, small where a step's fixed cost is small next to the
//! target (the CPU: ~10 ms of 150 ms) and large on a GPU, where a decode step is mostly the
//! weights' read (the CUDA default is off; the CUDA backend does not yield anyway). While a
//! yieldable step is suspended there is no *below* step (a second one could not yield): the
//! lane's steps carry only the lanes at or above it, and the lanes below go on in the suspended
//! step's resumed slices.

use super::{Planner, Seq, StepBuild};
use crate::sched::StepCap;

/// Which lanes the step being planned may carry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum SplitTurn {
    /// Every lane (no split).
    Whole,
    /// Lanes at or above `level` only.
    Above { level: i32 },
    /// Lanes below `level` only, after an *above* step predicted to take `after_secs`.
    Below { level: i32, after_secs: f64 },
}

impl SplitTurn {
    /// Whether this step may carry work of `priority`.
    pub(super) fn admits(&self, priority: i32) -> bool {
        match *self {
            SplitTurn::Whole => true,
            SplitTurn::Above { level } => priority >= level,
            SplitTurn::Below { level, .. } => priority < level,
        }
    }

    /// The pacing cap of a *below* step: the higher lane's decode step already took part of its
    /// ITL target.
    pub(super) fn cap(&self, cap: Option<StepCap>) -> Option<StepCap> {
        match (*self, cap) {
            (SplitTurn::Below { after_secs, .. }, Some(c)) => Some(StepCap { secs: c.secs - after_secs, ..c }),
            _ => cap,
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct SplitState {
    /// The last planned step was an *above* step for this level, predicted to take these seconds.
    last_above: Option<(i32, f64)>,
}

impl Planner {
    /// Alternate a decoding higher lane's steps with lower lanes' prefill steps (see the module
    /// doc). Only with yielding on: the point is that the lower steps can yield.
    pub fn set_separate_lane_decodes(&mut self, on: bool) {
        self.separate_decodes = on;
        self.split = SplitState::default();
    }

    /// The turn of the step about to be planned.
    pub(super) fn split_turn(&self) -> SplitTurn {
        if !self.separate_decodes || !self.yielding || self.cfg.recurrent_state {
            return SplitTurn::Whole;
        }
        let Some(pacing) = self.pacing.as_ref() else { return SplitTurn::Whole };
        let has_targets = |p: i32| pacing.targets().iter().any(|t| t.priority == p);
        // The highest lane with targets that has a decode to plan.
        let decoding = self
            .running
            .iter()
            .filter(|((p, _), id)| has_targets(p.0) && self.seqs.get(id).is_some_and(Seq::is_plannable_decode))
            .map(|((p, _), _)| p.0)
            .max();
        let Some(level) = decoding else { return SplitTurn::Whole };
        let prefill_where = |admit: &dyn Fn(i32) -> bool| {
            self.waiting.iter().any(|(p, q)| admit(p.0) && !q.is_empty())
                || self.running.iter().any(|((p, _), id)| {
                    admit(p.0) && self.seqs.get(id).is_some_and(|s| !s.is_decode() && s.in_flight == 0)
                })
        };
        if !prefill_where(&|p| p < level) {
            return SplitTurn::Whole;
        }
        if self.has_yieldable_step() {
            // A second yieldable step could not yield, so lower prefill beside the lane's decodes
            // would hold its next arrival for a whole step: the lanes below go on in the
            // suspended step's slices only (`sched::yielding`).
            return SplitTurn::Above { level };
        }
        match self.split.last_above {
            // A request of the lane (or above) waiting or prefilling goes first, with its decodes.
            Some((l, after_secs)) if l == level && !prefill_where(&|p| p >= level) => {
                SplitTurn::Below { level, after_secs }
            }
            _ => SplitTurn::Above { level },
        }
    }

    /// The step of this turn was planned as `b`.
    pub(super) fn note_split(&mut self, turn: SplitTurn, b: &StepBuild) {
        self.split.last_above = match (turn, self.pacing.as_ref()) {
            (SplitTurn::Above { level }, Some(pacing)) => Some((level, pacing.model().predict(&b.shape()))),
            _ => None,
        };
    }

    /// A *below* step that found nothing to carry: the next plan is a whole one.
    pub(super) fn forget_split(&mut self) {
        self.split.last_above = None;
    }
}
