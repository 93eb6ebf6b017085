//! Verification of drafted tokens against the target model's distributions, as pure functions.
//!
//! Greedy: keep the longest prefix of the draft that equals the target's argmax at each position,
//! then the target's own token at the first disagreement (or after the last draft). Because the
//! target's logits at a position do not depend on how many tokens the step carried (the backends'
//! exactness rule), the result equals un-drafted greedy decoding token for token.
//!
//! Sampled: speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023). At position
//! `i` the draft token `d` is accepted with probability `min(1, p(d) / q(d))`; on rejection the
//! token is drawn from the residual `max(p - q, 0)` renormalised, and the run ends. When every
//! draft is accepted, one bonus token is drawn from the target's next distribution. The emitted
//! tokens are distributed exactly as the target's own samples. Model-free drafters propose one
//! token with certainty (`q` one-hot), so acceptance is `p(d)` and the residual is `p` without `d`.
//!
//! Randomness is derived from `(seed, token index)` as everywhere in sampling (acceptance draws
//! use a salted seed), so verification does not depend on batching either.

use crate::sampling::uniform;

/// Salt for the acceptance draws, keeping them independent of the token draws at the same index.
const ACCEPT_SALT: u64 = 0x5bd1_e995_9e37_79b9;

/// The outcome of verifying one sequence's drafts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Leading draft tokens accepted.
    pub accepted: usize,
    /// Tokens to append: the accepted drafts, then the target's correction or bonus token.
    pub tokens: Vec<u32>,
}

/// Greedy verification. `target[i]` is the target's greedy token after the sequence extended by
/// `draft[..i]`; `target.len()` must be `draft.len() + 1`.
pub fn verify_greedy(draft: &[u32], target: &[u32]) -> Verdict {
    debug_assert_eq!(target.len(), draft.len() + 1);
    let accepted = draft.iter().zip(target).take_while(|(d, t)| d == t).count();
    let mut tokens = draft[..accepted].to_vec();
    tokens.push(target[accepted]);
    Verdict { accepted, tokens }
}

/// Rejection-sampling verification. `target[i]` is the target's processed distribution (after
/// penalties, temperature and truncation) after the sequence extended by `draft[..i]`, for
/// `i in 0..=draft.len()`; `proposal[i]`, when given, is the drafter's distribution that `draft[i]`
/// was sampled from (`None` = deterministic drafts). `first_index` is the generation index of the
/// token at position 0, the counter of the seeded draws.
pub fn verify_sampled(
    draft: &[u32],
    target: &[Vec<f32>],
    proposal: Option<&[Vec<f32>]>,
    seed: u64,
    first_index: u64,
) -> Verdict {
    debug_assert_eq!(target.len(), draft.len() + 1);
    let mut tokens = Vec::with_capacity(draft.len() + 1);
    for (i, &d) in draft.iter().enumerate() {
        let p = &target[i];
        let index = first_index + i as u64;
        let p_d = p.get(d as usize).copied().unwrap_or(0.0);
        let q_d = proposal.map_or(1.0, |q| q[i].get(d as usize).copied().unwrap_or(0.0));
        let accept = q_d > 0.0 && uniform(seed ^ ACCEPT_SALT, index) < (p_d / q_d).min(1.0);
        if accept {
            tokens.push(d);
            continue;
        }
        let u = uniform(seed, index);
        let residual: Vec<f32> = match proposal {
            Some(q) => p.iter().zip(&q[i]).map(|(&a, &b)| (a - b).max(0.0)).collect(),
            None => p.iter().enumerate().map(|(t, &a)| if t == d as usize { 0.0 } else { a }).collect(),
        };
        // A residual with no mass means p ≤ q everywhere, i.e. p == q: then acceptance was certain
        // for any d in the support and we only get here for d outside it; draw from p itself.
        let token = draw(&residual, u).or_else(|| draw(p, u)).unwrap_or(d);
        tokens.push(token);
        return Verdict { accepted: i, tokens };
    }
    let bonus_index = first_index + draft.len() as u64;
    let bonus = draw(&target[draft.len()], uniform(seed, bonus_index)).unwrap_or(0);
    tokens.push(bonus);
    Verdict { accepted: draft.len(), tokens }
}

/// Inverse-CDF draw over ids in ascending order from unnormalised non-negative weights; `None`
/// when they carry no mass.
fn draw(weights: &[f32], u: f32) -> Option<u32> {
    let total: f64 = weights.iter().map(|&w| f64::from(w.max(0.0))).sum();
    if total <= 0.0 || !total.is_finite() {
        return None;
    }
    let target = f64::from(u) * total;
    let mut acc = 0.0f64;
    let mut last = None;
    for (t, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            acc += f64::from(w);
            last = Some(t as u32);
            if acc > target {
                return last;
            }
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_keeps_the_agreeing_prefix_plus_one() {
        assert_eq!(verify_greedy(&[1, 2, 3], &[1, 2, 3, 4]), Verdict { accepted: 3, tokens: vec![1, 2, 3, 4] });
        assert_eq!(verify_greedy(&[1, 2, 3], &[1, 9, 3, 4]), Verdict { accepted: 1, tokens: vec![1, 9] });
        assert_eq!(verify_greedy(&[5], &[6, 7]), Verdict { accepted: 0, tokens: vec![6] });
        assert_eq!(verify_greedy(&[], &[8]), Verdict { accepted: 0, tokens: vec![8] });
    }

    fn random_dist(seed: &mut u64, n: usize, zeros: usize) -> Vec<f32> {
        let mut v: Vec<f32> = (0..n)
            .map(|_| {
                *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((*seed >> 40) as f32 / (1u64 << 24) as f32) + 0.05
            })
            .collect();
        for z in v.iter_mut().take(zeros) {
            *z = 0.0;
        }
        let s: f32 = v.iter().sum();
        v.iter_mut().for_each(|x| *x /= s);
        v
    }

    /// Pearson chi-square of observed counts against expected probabilities (cells with p > 0).
    fn chi_square(counts: &[u64], p: &[f32], n: u64) -> f64 {
        counts
            .iter()
            .zip(p)
            .filter(|(_, &p)| p > 0.0)
            .map(|(&c, &p)| {
                let e = f64::from(p) * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    /// The tokens emitted by verification must be distributed as the target's own samples, for
    /// deterministic drafts and for drafts sampled from a different model. The draws are seeded,
    /// so this test is deterministic; the bound is the chi-square 0.999 quantile (7 degrees of
    /// freedom: 18.5), which a biased verifier (e.g. always accepting) exceeds by orders of
    /// magnitude.
    #[test]
    fn rejection_sampling_preserves_the_target_distribution() {
        const V: usize = 8;
        const N: u64 = 40_000;
        let mut s = 99u64;
        let p0 = random_dist(&mut s, V, 0);
        let p1 = random_dist(&mut s, V, 2);
        let q0 = random_dist(&mut s, V, 3);
        let q1 = random_dist(&mut s, V, 0);
        for model_drafter in [false, true] {
            let mut first = [0u64; V];
            let mut second_given_first = vec![[0u64; V]; V];
            for trial in 0..N {
                let seed = trial.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 17;
                // The drafter's own sampled proposal (model) or a fixed guess (n-gram).
                let (d0, d1) = if model_drafter {
                    (draw(&q0, uniform(seed ^ 1, 0)).unwrap(), draw(&q1, uniform(seed ^ 2, 1)).unwrap())
                } else {
                    (3, 5)
                };
                let proposal = [q0.clone(), q1.clone()];
                let v = verify_sampled(
                    &[d0, d1],
                    &[p0.clone(), p1.clone(), p0.clone()],
                    model_drafter.then_some(&proposal[..]),
                    seed,
                    0,
                );
                first[v.tokens[0] as usize] += 1;
                if v.tokens.len() > 1 {
                    second_given_first[v.tokens[0] as usize][v.tokens[1] as usize] += 1;
                }
            }
            let chi = chi_square(&first, &p0, N);
            assert!(chi < 18.5, "first token: chi² {chi:.1} (model drafter: {model_drafter}) counts {first:?}");
            // The second token, given the first was an accepted draft, must follow p1 (the target
            // after that draft): check it for the most frequent first token.
            let best = (0..V).max_by_key(|&t| second_given_first[t].iter().sum::<u64>()).unwrap();
            let row = second_given_first[best];
            let n: u64 = row.iter().sum();
            assert!(n > 2000, "too few samples to test the second position: {n}");
            let chi = chi_square(&row, &p1, n);
            assert!(chi < 18.5, "second token: chi² {chi:.1} (model drafter: {model_drafter}) counts {row:?}");
        }
    }

    #[test]
    fn always_accepting_would_fail_the_same_check() {
        // Guard that the statistical test has teeth: emitting the fixed draft token whenever it
        // has any probability gives a distribution far from the target.
        let mut s = 5u64;
        let p = random_dist(&mut s, 8, 0);
        let mut counts = [0u64; 8];
        counts[3] = 40_000;
        assert!(chi_square(&counts, &p, 40_000) > 1000.0);
    }

    #[test]
    fn certain_target_and_zero_mass_edges() {
        // A one-hot target (greedy through the sampled path) accepts exactly its own token.
        let one_hot = vec![0.0, 0.0, 1.0, 0.0];
        let v = verify_sampled(&[2, 1], &[one_hot.clone(), one_hot.clone(), one_hot.clone()], None, 3, 0);
        assert_eq!(v, Verdict { accepted: 1, tokens: vec![2, 2] });
        // A draft outside the vocabulary is rejected, never emitted.
        let v = verify_sampled(&[77], &[one_hot.clone(), one_hot.clone()], None, 3, 0);
        assert_eq!(v.tokens, vec![2]);
        // Proposal equal to target: the residual is empty; the draw falls back to the target.
        let p = vec![0.25f32; 4];
        let v = verify_sampled(&[1], &[p.clone(), p.clone()], Some(std::slice::from_ref(&p)), 11, 4);
        assert!(v.tokens.iter().all(|&t| t < 4));
    }
}
