//! Acceptance statistics for speculative decoding: how often the draft token at each position
//! (1..=k) is accepted, mean accepted tokens per verified step, drafted vs accepted totals. The
//! per-position table is the one the seeds plot; it is exported to `/metrics` as counters.

/// Counters for one engine (all lanes), plain data so tests and the bench can read them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AcceptanceStats {
    /// `proposed[i]`: steps whose draft had a token at position `i + 1`.
    pub proposed: Vec<u64>,
    /// `accepted[i]`: of those, how many accepted it (and so every earlier one).
    pub accepted: Vec<u64>,
    /// Verification steps that carried at least one draft token.
    pub steps: u64,
    /// Tokens emitted by those steps (accepted drafts plus the correction/bonus token).
    pub emitted: u64,
}

impl AcceptanceStats {
    /// Record one sequence's verification: `drafted` tokens proposed by `source` (`ngram`,
    /// `draft-model`; a label on the exported counters), `accepted` kept.
    pub fn record(&mut self, source: &'static str, drafted: usize, accepted: usize) {
        debug_assert!(accepted <= drafted);
        if drafted == 0 {
            return;
        }
        if self.proposed.len() < drafted {
            self.proposed.resize(drafted, 0);
            self.accepted.resize(drafted, 0);
        }
        for i in 0..drafted {
            self.proposed[i] += 1;
            if i < accepted {
                self.accepted[i] += 1;
            }
        }
        self.steps += 1;
        self.emitted += accepted as u64 + 1;
        for (i, position) in (1..=drafted).map(|p| (p - 1, p.to_string())) {
            metrics::counter!("shelfserve_spec_draft_tokens_total", "position" => position.clone(), "source" => source)
                .increment(1);
            if i < accepted {
                metrics::counter!("shelfserve_spec_accepted_tokens_total", "position" => position, "source" => source)
                    .increment(1);
            }
        }
        metrics::counter!("shelfserve_spec_verify_steps_total", "source" => source).increment(1);
        metrics::counter!("shelfserve_spec_emitted_tokens_total", "source" => source).increment(accepted as u64 + 1);
    }

    /// Acceptance rate at each draft position (1-based position = index + 1).
    pub fn rate_per_position(&self) -> Vec<f64> {
        self.proposed
            .iter()
            .zip(&self.accepted)
            .map(|(&p, &a)| if p == 0 { 0.0 } else { a as f64 / p as f64 })
            .collect()
    }

    /// Mean tokens emitted per drafted step (1.0 = drafting never helped).
    pub fn mean_tokens_per_step(&self) -> f64 {
        if self.steps == 0 {
            0.0
        } else {
            self.emitted as f64 / self.steps as f64
        }
    }

    pub fn drafted_total(&self) -> u64 {
        self.proposed.iter().sum()
    }

    pub fn accepted_total(&self) -> u64 {
        self.accepted.iter().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_rates_and_means() {
        let mut s = AcceptanceStats::default();
        s.record("ngram", 3, 3);
        s.record("ngram", 3, 1);
        s.record("ngram", 2, 0);
        s.record("ngram", 0, 0);
        assert_eq!(s.proposed, vec![3, 3, 2]);
        assert_eq!(s.accepted, vec![2, 1, 1]);
        assert_eq!(s.steps, 3);
        assert_eq!(s.emitted, 4 + 2 + 1);
        assert_eq!(s.rate_per_position(), vec![2.0 / 3.0, 1.0 / 3.0, 0.5]);
        assert!((s.mean_tokens_per_step() - 7.0 / 3.0).abs() < 1e-12);
        assert_eq!((s.drafted_total(), s.accepted_total()), (8, 4));
    }
}
