//! The loop guard: notices a generation that keeps repeating itself (the same span of at least
//! `min_span` tokens written `repeats` times back to back, e.g. a model stuck re-emitting one
//! paragraph) so the request can be stopped instead of burning its whole `max_tokens`.
//! Plain data and a pure check per token; the request actor owns one per request.

use serde::{Deserialize, Serialize};

/// Per-lane setting (`[lane.loop_guard]` in the config).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoopGuardConfig {
    pub enabled: bool,
    /// Shortest repeated span that counts, in tokens.
    pub min_span: usize,
    /// Longest span looked for, in tokens (bounds the memory and the work per token).
    pub max_span: usize,
    /// Copies of the span, back to back, that stop the generation.
    pub repeats: usize,
}

impl Default for LoopGuardConfig {
    fn default() -> Self {
        Self { enabled: true, min_span: 32, max_span: 256, repeats: 3 }
    }
}

impl LoopGuardConfig {
    /// The guard switched off (engine tests and benchmarks that must run to `max_tokens`).
    pub fn off() -> Self {
        Self { enabled: false, ..Self::default() }
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.enabled && (self.min_span == 0 || self.max_span < self.min_span || self.repeats < 2) {
            return Err(format!(
                "loop_guard: need 1 <= min_span ({}) <= max_span ({}) and repeats ({}) >= 2",
                self.min_span, self.max_span, self.repeats
            ));
        }
        Ok(())
    }
}

/// The recent tokens of one generation.
#[derive(Clone, Debug)]
pub struct LoopGuard {
    cfg: LoopGuardConfig,
    tail: Vec<u32>,
}

impl LoopGuard {
    /// `None` when the guard is off.
    pub fn new(cfg: LoopGuardConfig) -> Option<Self> {
        cfg.enabled.then(|| Self { cfg, tail: Vec::with_capacity(2 * cfg.max_span * cfg.repeats) })
    }

    /// Add a generated token; `true` when the output now ends in `repeats` copies of one span.
    pub fn push(&mut self, id: u32) -> bool {
        let window = self.cfg.max_span * self.cfg.repeats;
        if self.tail.len() == 2 * window {
            self.tail.drain(..window);
        }
        self.tail.push(id);
        let t = &self.tail;
        let n = t.len();
        (self.cfg.min_span..=self.cfg.max_span)
            .take_while(|&p| p * self.cfg.repeats <= n)
            // Periodic with period p over the last `repeats * p` tokens; checked from the end, so
            // a period that does not fit usually fails on its first comparison.
            .any(|p| (n - p * (self.cfg.repeats - 1)..n).rev().all(|i| t[i] == t[i - p]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(min_span: usize, repeats: usize) -> LoopGuardConfig {
        LoopGuardConfig { enabled: true, min_span, max_span: 64, repeats }
    }

    /// Index of the token at which the guard fires, if it does.
    fn fires_at(cfg: LoopGuardConfig, tokens: &[u32]) -> Option<usize> {
        let mut g = LoopGuard::new(cfg).unwrap();
        tokens.iter().position(|&t| g.push(t))
    }

    #[test]
    fn a_span_written_three_times_stops_on_its_last_token() {
        let span: Vec<u32> = (100..132).collect();
        let mut out: Vec<u32> = vec![1, 2, 3];
        for _ in 0..4 {
            out.extend(&span);
        }
        assert_eq!(fires_at(cfg(32, 3), &out), Some(3 + 3 * 32 - 1));
        // Two copies are not enough.
        assert_eq!(fires_at(cfg(32, 3), &out[..3 + 2 * 32 + 31]), None);
    }

    #[test]
    fn short_cycles_count_once_they_cover_the_minimum_span() {
        // "ha ha ha …": period 2, caught once 3 × 32 tokens repeat.
        let out: Vec<u32> = (0..200).map(|i| i % 2).collect();
        assert_eq!(fires_at(cfg(32, 3), &out), Some(95));
    }

    #[test]
    fn varied_text_and_disabled_guards_never_fire() {
        let out: Vec<u32> = (0..5000u32).map(|i| i.wrapping_mul(2654435761) % 1000).collect();
        assert_eq!(fires_at(cfg(8, 3), &out), None);
        assert!(LoopGuard::new(LoopGuardConfig { enabled: false, ..cfg(32, 3) }).is_none());
        // Spans longer than max_span are not looked for.
        let span: Vec<u32> = (0..100).collect();
        let out: Vec<u32> = span.iter().cycle().take(400).copied().collect();
        assert_eq!(fires_at(cfg(32, 3), &out), None);
    }

    #[test]
    fn the_window_slides_without_losing_a_loop() {
        let mut out: Vec<u32> = (0..3000u32).map(|i| i.wrapping_mul(2654435761) % 1000 + 10).collect();
        let span: Vec<u32> = (1..=40).collect();
        for _ in 0..3 {
            out.extend(&span);
        }
        assert_eq!(fires_at(cfg(32, 3), &out), Some(out.len() - 1));
    }

    #[test]
    fn validation() {
        assert!(LoopGuardConfig::default().validate().is_ok());
        assert!(LoopGuardConfig { repeats: 1, ..Default::default() }.validate().is_err());
        assert!(LoopGuardConfig { min_span: 300, ..Default::default() }.validate().is_err());
        assert!(LoopGuardConfig { enabled: false, repeats: 0, ..Default::default() }.validate().is_ok());
    }
}
