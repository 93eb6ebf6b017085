//! Turning one sequence's logits rows into emitted tokens, with or without drafts. This is what
//! the executor calls per sequence; it keeps the un-drafted path exactly the plain sampler's, so
//! enabling speculation never changes a greedy reply and never changes the distribution of a
//! sampled one.

use super::verify::{verify_greedy, verify_sampled};
use crate::sampling::{processed_probs, sample, sampled_as, PenaltyState, Sampled, SamplingParams};

/// Emitted tokens of one sequence for one step.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepTokens {
    /// Accepted drafts, then the target's own next token.
    pub tokens: Vec<Sampled>,
    /// Draft tokens the step verified.
    pub drafted: usize,
    /// Of those, how many were accepted.
    pub accepted: usize,
}

/// `rows[i]` are the target's logits after the sequence extended by `draft[..i]`
/// (`rows.len() == draft.len() + 1`); `first_index` is the generation index of the token at row 0;
/// `penalties` the history before this step (None when the params use no penalties).
pub fn sample_with_drafts(
    rows: &[&[f32]],
    draft: &[u32],
    params: &SamplingParams,
    penalties: Option<&PenaltyState>,
    first_index: u64,
) -> StepTokens {
    debug_assert_eq!(rows.len(), draft.len() + 1);
    let empty = PenaltyState::default();
    let base = penalties.unwrap_or(&empty);
    if draft.is_empty() {
        let s = sample(rows[0], params, base, first_index);
        return StepTokens { tokens: vec![s], drafted: 0, accepted: 0 };
    }
    // Row i sees the history extended by the drafts before it (only materialised with penalties).
    let history = |i: usize| -> Option<PenaltyState> {
        penalties.map(|p| {
            let mut h = p.clone();
            draft[..i].iter().for_each(|&t| h.push_output(t));
            h
        })
    };
    let states: Vec<Option<PenaltyState>> = (0..rows.len()).map(history).collect();
    let at = |i: usize| states[i].as_ref().unwrap_or(base);

    if params.is_greedy() {
        let mut tokens = Vec::with_capacity(rows.len());
        let mut targets = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter().enumerate() {
            let s = sample(row, params, at(i), first_index + i as u64);
            targets.push(s.token);
            tokens.push(s);
        }
        let v = verify_greedy(draft, &targets);
        tokens.truncate(v.tokens.len());
        return StepTokens { tokens, drafted: draft.len(), accepted: v.accepted };
    }

    let probs: Vec<Vec<f32>> = rows.iter().enumerate().map(|(i, row)| processed_probs(row, params, at(i))).collect();
    let v = verify_sampled(draft, &probs, None, params.seed, first_index);
    let mut tokens: Vec<Sampled> = v.tokens.iter().enumerate().map(|(i, &t)| sampled_as(rows[i], t, params)).collect();
    if v.accepted == draft.len() {
        // The bonus token: drawn exactly as the plain sampler draws it at that index.
        let k = draft.len();
        tokens[k] = sample(rows[k], params, at(k), first_index + k as u64);
    }
    StepTokens { tokens, drafted: draft.len(), accepted: v.accepted }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(best: usize, vocab: usize) -> Vec<f32> {
        (0..vocab).map(|t| if t == best { 5.0 } else { (t % 3) as f32 * 0.1 }).collect()
    }

    #[test]
    fn greedy_equals_stepwise_greedy() {
        let params = SamplingParams::default();
        let rows = [row(4, 10), row(7, 10), row(1, 10), row(2, 10)];
        let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
        let out = sample_with_drafts(&refs, &[4, 7, 9], &params, None, 0);
        assert_eq!(out.tokens.iter().map(|s| s.token).collect::<Vec<_>>(), vec![4, 7, 1]);
        assert_eq!((out.drafted, out.accepted), (3, 2));
        let out = sample_with_drafts(&refs[..1], &[], &params, None, 0);
        assert_eq!(out.tokens[0].token, 4);
    }

    #[test]
    fn penalties_see_the_drafts_before_each_row() {
        // Row 1's best token is the draft at row 0; a strong repetition penalty on it makes the
        // second-best win, but only if the history includes the draft.
        let params = SamplingParams { repetition_penalty: 100.0, ..Default::default() };
        let mut r1 = row(3, 10);
        r1[5] = 4.0;
        let rows = [row(3, 10), r1];
        let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
        let out = sample_with_drafts(&refs, &[3], &params, Some(&PenaltyState::new(&[])), 0);
        assert_eq!(out.tokens.iter().map(|s| s.token).collect::<Vec<_>>(), vec![3, 5]);
    }

    #[test]
    fn sampled_without_drafts_is_the_plain_sampler() {
        let params = SamplingParams { temperature: 0.8, seed: 42, logprobs: Some(2), ..Default::default() };
        let r = row(2, 16);
        for index in 0..50 {
            let out = sample_with_drafts(&[&r], &[], &params, None, index);
            assert_eq!(out.tokens, vec![sample(&r, &params, &PenaltyState::default(), index)]);
        }
    }
}
