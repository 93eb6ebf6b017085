//! The executor's memory of the tokens its last step sampled, which a lookahead step takes as its
//! inputs (`PlanSeq::follows_previous`, see `sched::lookahead`): the scheduler planned that step
//! before those tokens existed, so only the executor can put them in, just before it runs it.

use std::collections::HashMap;

use super::executor::{StepPlan, StepResult};
use crate::sched::SeqId;

/// The last step's sampled token per sequence (the last of its emitted tokens).
#[derive(Debug, Default)]
pub struct PreviousSamples {
    last: HashMap<SeqId, u32>,
}

impl PreviousSamples {
    /// Puts each lookahead row's input in. An error when the step before did not sample that
    /// sequence (it failed, or left it out): the step must then fail as a whole, since its rows
    /// would compute from a placeholder.
    pub fn fill(&self, plan: &mut StepPlan) -> Result<(), String> {
        for s in plan.seqs.iter_mut().filter(|s| s.follows_previous) {
            let token = self
                .last
                .get(&s.seq)
                .copied()
                .ok_or_else(|| format!("sequence {} continues a step that sampled nothing for it", s.seq))?;
            match s.tokens.as_mut_slice() {
                [only] => *only = token,
                _ => return Err(format!("a lookahead row of sequence {} carries {} tokens", s.seq, s.tokens.len())),
            }
        }
        Ok(())
    }

    /// Remembers what `result` sampled, forgetting the step before it (a lookahead step only ever
    /// continues the step just before it); a failed step leaves nothing to continue.
    pub fn record(&mut self, result: &StepResult) {
        self.last.clear();
        if result.error.is_some() {
            return;
        }
        for (seq, step) in &result.sampled {
            if let Some(s) = step.tokens.last() {
                self.last.insert(*seq, s.token);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actors::executor::PlanSeq;
    use crate::sampling::Sampled;
    use crate::spec::step::StepTokens;

    fn row(seq: SeqId, tokens: Vec<u32>, follows_previous: bool) -> PlanSeq {
        PlanSeq {
            seq,
            tokens,
            start_pos: 5,
            block_table: vec![0],
            state_slot: 0,
            num_draft: 0,
            sample: None,
            snapshot_after: Vec::new(),
            images: Vec::new(),
            follows_previous,
        }
    }

    fn sampled(seq: SeqId, tokens: &[u32]) -> (SeqId, StepTokens) {
        let tokens = tokens.iter().map(|&token| Sampled { token, logprob: 0.0, top_logprobs: Vec::new() }).collect();
        (seq, StepTokens { tokens, drafted: 0, accepted: 0 })
    }

    fn result(sampled: Vec<(SeqId, StepTokens)>, error: Option<String>) -> StepResult {
        StepResult { sampled, error, ..StepResult::failed(1, 0, String::new()) }
    }

    #[test]
    fn lookahead_rows_take_the_last_token_the_step_before_sampled() {
        let mut prev = PreviousSamples::default();
        prev.record(&result(vec![sampled(1, &[7]), sampled(2, &[3, 4, 9])], None));
        let mut plan = StepPlan {
            step_id: 2,
            yield_signal: None,
            seqs: vec![row(1, vec![0], true), row(2, vec![0], true), row(3, vec![42], false)],
        };
        prev.fill(&mut plan).unwrap();
        let inputs: Vec<Vec<u32>> = plan.seqs.iter().map(|s| s.tokens.clone()).collect();
        assert_eq!(inputs, vec![vec![7], vec![9], vec![42]]);
    }

    #[test]
    fn a_row_without_a_previous_sample_fails_the_step() {
        let mut prev = PreviousSamples::default();
        prev.record(&result(vec![sampled(1, &[7])], None));
        let mut plan = StepPlan { step_id: 2, yield_signal: None, seqs: vec![row(2, vec![0], true)] };
        assert!(prev.fill(&mut plan).unwrap_err().contains("sequence 2"));
        // A failed step leaves nothing to continue, and only the last step counts.
        prev.record(&result(vec![sampled(2, &[5])], Some("device lost".into())));
        assert!(prev.fill(&mut plan).is_err());
        prev.record(&result(vec![sampled(2, &[5])], None));
        prev.record(&result(vec![sampled(1, &[6])], None));
        assert!(prev.fill(&mut plan).is_err());
    }
}
