//! Lane pacing: how long a step that carries lower-priority prefill may last, so that a higher
//! lane meets its latency targets (`target_ttft_ms`, `target_itl_ms`). Plain data; the planner asks
//! it for a time cap per priority level and turns the cap into chunk sizes with the step cost
//! model (`sched::cost`).
//!
//! For prefill of priority `p`, every lane of higher priority with targets bounds the step:
//! - while that lane has work (a request waiting, prefilling or decoding), the step lasts at most
//!   its `target_itl`: its decodes are never held up by lower prefill, and a request of it that
//!   waits gets the next step with lower prefill shrunk to what the budget leaves (nothing, when
//!   its own prefill already fills it);
//! - while it is idle it may still receive work at any moment, and that work waits for the step
//!   in flight: the step then lasts at most `target_ttft` minus the predicted cost of the lane's
//!   typical first step (its recent prompt lengths), so wait + own prefill stays within the TTFT
//!   target. Lower work always progresses by at least `min_chunk` tokens per step then.
//!
//! Lower lanes get their full chunks back as soon as no lane above them has targets.

use super::cost::{StepCost, StepCostModel, StepShape};

/// A lane's latency targets, keyed by its priority.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LaneTarget {
    pub priority: i32,
    /// Arrival to first token, seconds.
    pub ttft: f64,
    /// Between tokens, seconds.
    pub itl: f64,
}

/// How much lower prefill one step may carry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCap {
    /// Seconds the whole step may last.
    pub secs: f64,
    /// Tokens a step may carry whatever the cap says, when it has no prefill yet: every lane above
    /// is idle, so progress costs no one a target.
    pub floor: usize,
}

/// Where pacing starts on a device: lane targets for lanes that set none, and the step cost
/// before the first measured step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceDefaults {
    pub ttft: f64,
    pub itl: f64,
    pub cost: StepCost,
}

impl DeviceDefaults {
    /// Two CPU cores serve the default model's short voice turns in 120–150 ms when idle.
    pub const CPU: DeviceDefaults = DeviceDefaults { ttft: 0.300, itl: 0.150, cost: StepCost::CPU };
    /// One GPU serves an 8B model's short turns in under 10 ms when idle; a 30 ms target keeps
    /// voice TTFT p99 under 50 ms beside 32 agents on an H200 (50 ms gave 59–67 ms, session 9).
    pub const CUDA: DeviceDefaults = DeviceDefaults { ttft: 0.030, itl: 0.020, cost: StepCost::CUDA };
}

/// Memory of the step cost fit: about the last 30 steps.
pub const COST_DECAY: f64 = 0.97;

/// Weight of a new arrival in a lane's typical prompt length.
const PROMPT_EWMA: f64 = 0.2;

#[derive(Debug, Clone)]
pub struct Pacing {
    /// Sorted by priority, highest first.
    targets: Vec<LaneTarget>,
    /// Per entry of `targets`: its recent prompt lengths (exponentially weighted); 0 before any.
    typical_prompt: Vec<f64>,
    model: StepCostModel,
    min_chunk: usize,
}

impl Pacing {
    pub fn new(mut targets: Vec<LaneTarget>, model: StepCostModel, min_chunk: usize) -> Self {
        targets.sort_by_key(|t| std::cmp::Reverse(t.priority));
        Pacing { typical_prompt: vec![0.0; targets.len()], targets, model, min_chunk: min_chunk.max(1) }
    }

    pub fn model(&self) -> &StepCostModel {
        &self.model
    }

    pub fn targets(&self) -> &[LaneTarget] {
        &self.targets
    }

    /// A step of this shape took `secs`.
    pub fn observe(&mut self, shape: &StepShape, secs: f64) {
        self.model.observe(shape, secs);
    }

    /// A request of `priority` with a `prompt_len`-token prompt arrived.
    pub fn note_arrival(&mut self, priority: i32, prompt_len: usize) {
        if let Some(i) = self.targets.iter().position(|t| t.priority == priority) {
            let t = &mut self.typical_prompt[i];
            *t = if *t == 0.0 { prompt_len as f64 } else { *t + PROMPT_EWMA * (prompt_len as f64 - *t) };
        }
    }

    /// The cap on a step that carries prefill of priority `level`; `None` when no lane above it has
    /// targets. `active(p)` says whether priority `p` has work waiting or running.
    pub fn step_cap(&self, level: i32, active: impl Fn(i32) -> bool) -> Option<StepCap> {
        let mut cap: Option<StepCap> = None;
        for (t, &typical) in self.targets.iter().zip(&self.typical_prompt).take_while(|(t, _)| t.priority > level) {
            let this = if active(t.priority) {
                StepCap { secs: t.itl, floor: 0 }
            } else {
                let mut first = StepShape::default();
                first.add(0, typical.round() as usize, false);
                let own = if first.is_empty() { 0.0 } else { self.model.predict(&first) };
                StepCap { secs: t.ttft - own, floor: self.min_chunk }
            };
            cap = Some(match cap {
                None => this,
                Some(c) => StepCap { secs: c.secs.min(this.secs), floor: c.floor.min(this.floor) },
            });
        }
        cap
    }

    /// Tokens a prefill chunk starting at `start` may take in a step already holding `so_far`.
    pub fn chunk_allowance(&self, cap: &StepCap, so_far: &StepShape, start: usize) -> usize {
        let left = cap.secs - self.model.predict(so_far);
        let fits = self.model.tokens_within(left, start);
        if so_far.prefill_tokens == 0 {
            fits.max(cap.floor)
        } else {
            fits
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COST: StepCost =
        StepCost { fixed: 0.010, per_prefill_token: 0.001, per_decode_seq: 0.002, per_million_attended: 0.0 };

    fn pacing() -> Pacing {
        let voice = LaneTarget { priority: 10, ttft: 0.200, itl: 0.050 };
        Pacing::new(vec![voice], StepCostModel::new(COST, 0.95), 16)
    }

    #[test]
    fn the_top_lane_and_lanes_without_targets_above_are_not_capped() {
        let p = pacing();
        assert_eq!(p.step_cap(10, |_| true), None);
        assert_eq!(p.step_cap(20, |_| false), None);
        assert!(p.step_cap(0, |_| false).is_some());
    }

    #[test]
    fn an_active_high_lane_caps_lower_steps_at_its_itl_with_no_floor() {
        let p = pacing();
        let cap = p.step_cap(0, |prio| prio == 10).unwrap();
        assert_eq!(cap, StepCap { secs: 0.050, floor: 0 });
        // A step with the voice decode (10 ms + 2 ms) leaves 38 ms: 38 prefill tokens.
        let mut so_far = StepShape::default();
        so_far.add(100, 1, true);
        assert_eq!(p.chunk_allowance(&cap, &so_far, 0), 38);
        // A voice prefill of 60 tokens already overruns the cap: agents pause this step.
        so_far.add(0, 60, false);
        assert_eq!(p.chunk_allowance(&cap, &so_far, 0), 0);
    }

    #[test]
    fn an_idle_high_lane_leaves_room_for_its_typical_first_step_and_lower_work_always_progresses() {
        let mut p = pacing();
        // No voice request seen yet: the whole TTFT target is the step's.
        assert_eq!(p.step_cap(0, |_| false), Some(StepCap { secs: 0.200, floor: 16 }));
        p.note_arrival(10, 40);
        let cap = p.step_cap(0, |_| false).unwrap();
        // A 40-token voice prefill costs 10 + 40 ms: 150 ms are left for the step in flight.
        assert!((cap.secs - 0.150).abs() < 1e-9, "{cap:?}");
        assert_eq!(p.chunk_allowance(&cap, &StepShape::default(), 0), 140);
        // With a TTFT target below the voice prefill itself, lower work still gets its floor.
        p.note_arrival(10, 1000);
        let cap = p.step_cap(0, |_| false).unwrap();
        assert!(cap.secs < 0.0);
        assert_eq!(p.chunk_allowance(&cap, &StepShape::default(), 0), 16);
        let mut so_far = StepShape::default();
        so_far.add(0, 16, false);
        assert_eq!(p.chunk_allowance(&cap, &so_far, 0), 0, "the floor is for the step's first chunk only");
    }

    #[test]
    fn the_strictest_lane_above_decides_and_arrivals_only_move_their_lane() {
        let voice = LaneTarget { priority: 10, ttft: 0.200, itl: 0.050 };
        let mid = LaneTarget { priority: 5, ttft: 1.0, itl: 0.030 };
        let mut p = Pacing::new(vec![mid, voice], StepCostModel::new(COST, 0.95), 16);
        assert_eq!(p.targets()[0].priority, 10, "sorted by priority");
        assert_eq!(p.step_cap(0, |prio| prio == 5), Some(StepCap { secs: 0.030, floor: 0 }));
        assert_eq!(p.step_cap(0, |_| false), Some(StepCap { secs: 0.200, floor: 16 }));
        // Priority 5's own prefill answers to voice only.
        assert_eq!(p.step_cap(5, |_| true), Some(StepCap { secs: 0.050, floor: 0 }));
        p.note_arrival(3, 5000);
        assert_eq!(p.step_cap(0, |_| false), Some(StepCap { secs: 0.200, floor: 16 }));
    }
}
