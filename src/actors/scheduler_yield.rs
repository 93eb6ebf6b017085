//! The scheduler's side of lower-lane prefill that yields (`sched::yielding` has the policy,
//! `actors::yielding` the executor's side): it arms a yield signal for each yieldable step, raises
//! it when a request of a higher lane arrives, takes the step's suspension, and sends
//! `ExecutorMsg::Resume` when the planner says the step may continue.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::{ExecutorMsg, SchedulerState, StepResult};
use crate::actors::handle::EngineError;
use crate::sched::StepShape;

/// The yieldable step in flight or suspended.
pub(super) struct YieldWatch {
    step_id: u64,
    /// Its yield level: a request of a higher priority raises the signal.
    level: i32,
    signal: Arc<AtomicBool>,
    /// While suspended: what the step computes (back in flight when resumed).
    shape: StepShape,
    /// It was suspended at least once (its measured time no longer fits its shape).
    resumed: bool,
    /// Counts resumes: a time slice's timer raises the signal only for the resume that set it.
    resumes: Arc<AtomicU64>,
}

impl SchedulerState {
    /// The signal for step `step_id` when it is yieldable (`yield_level` from the planner).
    pub(super) fn arm_yield(&mut self, step_id: u64, yield_level: Option<i32>) -> Option<Arc<AtomicBool>> {
        let level = yield_level?;
        // A higher request that arrived while the step was being committed is already waiting.
        let waits = self.policy.as_ref().is_some_and(|p| p.waits_above(level));
        let signal = Arc::new(AtomicBool::new(waits));
        self.yield_watch = Some(YieldWatch {
            step_id,
            level,
            signal: Arc::clone(&signal),
            shape: StepShape::default(),
            resumed: false,
            resumes: Arc::default(),
        });
        Some(signal)
    }

    /// A request of `priority` arrived: a yieldable step of lower prefill in flight stops at its
    /// next layer boundary.
    pub(super) fn raise_yield(&self, priority: i32) {
        if !self.policy.as_ref().is_some_and(|p| p.yields_to(priority)) {
            return;
        }
        if let Some(w) = &self.yield_watch {
            if !w.signal.swap(true, Ordering::AcqRel) {
                tracing::debug!(step = w.step_id, priority, level = w.level, "asking lower-lane prefill to yield");
            }
        }
    }

    /// The executor stopped the yieldable step at a layer boundary.
    pub(super) fn on_step_suspended(&mut self, r: &StepResult) {
        let shape = self.in_flight.pop_front().unwrap_or_default();
        let Some(policy) = self.policy.as_mut() else { return };
        let level = policy.on_step_suspended();
        let watch = self.yield_watch.as_mut().filter(|w| w.step_id == r.step_id);
        let (Some(level), Some(w)) = (level, watch) else {
            tracing::error!(step = r.step_id, "a step suspended that was not armed to yield");
            let ids = if level.is_some() { Vec::new() } else { policy.on_step_failed() };
            for id in ids {
                self.fail(id, EngineError::Executor("a step suspended that was not armed to yield".into()));
            }
            return;
        };
        w.shape = shape;
        w.resumed = true;
        self.stats.prefill_yields += 1;
        let lane =
            self.args.lanes.iter().find(|l| l.priority == level).map_or_else(|| level.to_string(), |l| l.name.clone());
        metrics::counter!("shelfserve_prefill_yields_total", "lane" => lane.clone()).increment(1);
        tracing::debug!(step = r.step_id, after_layer = r.suspended_after, %lane, "lower-lane prefill yielded");
    }

    /// Continues the suspended step on the executor.
    pub(super) fn resume_suspended(&mut self) {
        let (Some(policy), Some(exec)) = (self.policy.as_mut(), self.executor.as_ref()) else { return };
        let Some(w) = self.yield_watch.as_mut() else {
            tracing::error!("a suspended step has no yield watch");
            return;
        };
        // While a lane above decodes, the step runs for a slice and then gives way again.
        let slice = policy.resume_slice();
        if !policy.resume_suspended() {
            return;
        }
        // Lowered before the executor sees the resume: only a later arrival stops it again.
        w.signal.store(false, Ordering::Release);
        let step_id = w.step_id;
        if exec.cast(ExecutorMsg::Resume { step_id }).is_err() {
            for id in policy.on_step_failed() {
                self.fail(id, EngineError::Executor("the executor is gone".into()));
            }
            return;
        }
        self.in_flight.push_back(w.shape);
        let resume = w.resumes.fetch_add(1, Ordering::AcqRel) + 1;
        if let Some(secs) = slice {
            let (signal, resumes) = (Arc::clone(&w.signal), Arc::clone(&w.resumes));
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs_f64(secs)).await;
                if resumes.load(Ordering::Acquire) == resume {
                    signal.store(true, Ordering::Release);
                }
            });
        }
        tracing::debug!(step = step_id, slice_secs = slice, "suspended prefill resumed");
    }

    /// Step `step_id` completed (or failed): forgets its watch. True when it had been suspended.
    pub(super) fn end_yield_watch(&mut self, step_id: u64) -> bool {
        match self.yield_watch.take() {
            Some(w) if w.step_id == step_id => w.resumed,
            other => {
                self.yield_watch = other;
                false
            }
        }
    }
}
