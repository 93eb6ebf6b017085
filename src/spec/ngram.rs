//! Model-free drafting by suffix match: when the last few tokens of a sequence occurred before in
//! its own prompt or output, propose what followed them then. Agent loops and code edits repeat
//! long spans of their context, which is where this drafter earns its keep; on fresh prose it
//! proposes nothing and costs nothing.
//!
//! Each sequence keeps an index from n-gram to the most recent position where it ended, for every
//! n in `min_ngram..=max_ngram`, updated incrementally as tokens arrive (O(max_ngram) per token), so
//! a proposal costs O(max_ngram + k) however long the context is. The longest matching n-gram wins;
//! among its occurrences the most recent one (recent context predicts best in agent loops).

use std::collections::HashMap;

use super::{DraftError, DraftSource, SeqId};

/// Suffix-match parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NgramConfig {
    /// Shortest suffix that may trigger a draft. 1 drafts on any repeated token (noisy); 2–3 is
    /// the usual choice.
    pub min_ngram: usize,
    /// Longest suffix looked up; longer matches are more reliable predictors.
    pub max_ngram: usize,
}

impl Default for NgramConfig {
    fn default() -> Self {
        Self { min_ngram: 2, max_ngram: 5 }
    }
}

/// One sequence's tokens and n-gram index.
#[derive(Debug, Default)]
struct SeqIndex {
    tokens: Vec<u32>,
    /// (n, n-gram) → end position (exclusive) of its latest occurrence *before* the current end.
    latest: HashMap<(u8, Box<[u32]>), usize>,
    /// The n-grams ending at the current end, not yet in `latest`: they are inserted when the next
    /// token arrives, so a lookup never finds the suffix itself.
    pending: Vec<(u8, Box<[u32]>)>,
}

impl SeqIndex {
    fn push(&mut self, token: u32, cfg: NgramConfig) {
        let end = self.tokens.len();
        for key in self.pending.drain(..) {
            self.latest.insert(key, end);
        }
        self.tokens.push(token);
        let end = self.tokens.len();
        for n in cfg.min_ngram..=cfg.max_ngram.min(end) {
            self.pending.push((n as u8, self.tokens[end - n..].into()));
        }
    }

    fn propose(&self, k: usize, cfg: NgramConfig) -> Vec<u32> {
        let end = self.tokens.len();
        for n in (cfg.min_ngram..=cfg.max_ngram.min(end)).rev() {
            let key = (n as u8, Box::<[u32]>::from(&self.tokens[end - n..]));
            if let Some(&at) = self.latest.get(&key) {
                return self.tokens[at..(at + k).min(end)].to_vec();
            }
        }
        Vec::new()
    }
}

/// The suffix-match draft source; holds one index per live sequence.
#[derive(Debug, Default)]
pub struct NgramDrafter {
    cfg: NgramConfig,
    seqs: HashMap<SeqId, SeqIndex>,
}

impl NgramDrafter {
    pub fn new(cfg: NgramConfig) -> Result<Self, DraftError> {
        if cfg.min_ngram == 0 || cfg.min_ngram > cfg.max_ngram || cfg.max_ngram > 64 {
            return Err(DraftError::InvalidConfig(format!(
                "n-gram sizes must satisfy 1 <= min ({}) <= max ({}) <= 64",
                cfg.min_ngram, cfg.max_ngram
            )));
        }
        Ok(Self { cfg, seqs: HashMap::new() })
    }
}

impl DraftSource for NgramDrafter {
    fn name(&self) -> &'static str {
        "ngram"
    }

    fn extend(&mut self, seq: SeqId, tokens: &[u32]) {
        let cfg = self.cfg;
        let index = self.seqs.entry(seq).or_default();
        for &t in tokens {
            index.push(t, cfg);
        }
    }

    fn propose(&mut self, seq: SeqId, k: usize) -> Vec<u32> {
        self.seqs.get(&seq).map(|s| s.propose(k, self.cfg)).unwrap_or_default()
    }

    fn forget(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
    }

    fn truncate(&mut self, seq: SeqId, len: usize) {
        let Some(index) = self.seqs.get_mut(&seq) else { return };
        if len >= index.tokens.len() {
            return;
        }
        // Rare (the scheduler only extends with accepted tokens); rebuilding keeps the index exact.
        let kept = index.tokens[..len].to_vec();
        *index = SeqIndex::default();
        for t in kept {
            index.push(t, self.cfg);
        }
    }

    fn len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.tokens.len())
    }

    fn sequences(&self) -> usize {
        self.seqs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drafter() -> NgramDrafter {
        NgramDrafter::new(NgramConfig { min_ngram: 2, max_ngram: 4 }).unwrap()
    }

    /// The reference: scan every earlier position, longest n first, most recent occurrence.
    fn brute_force(tokens: &[u32], k: usize, cfg: NgramConfig) -> Vec<u32> {
        let end = tokens.len();
        for n in (cfg.min_ngram..=cfg.max_ngram.min(end)).rev() {
            let suffix = &tokens[end - n..];
            for at in (n..end).rev() {
                if &tokens[at - n..at] == suffix {
                    return tokens[at..(at + k).min(end)].to_vec();
                }
            }
        }
        Vec::new()
    }

    #[test]
    fn proposes_what_followed_the_suffix_last_time() {
        let mut d = drafter();
        // "a b c d e ... a b c" → "d e" follows.
        d.extend(1, &[10, 11, 12, 13, 14, 99, 10, 11, 12]);
        assert_eq!(d.propose(1, 2), vec![13, 14]);
        assert_eq!(d.propose(1, 7), vec![13, 14, 99, 10, 11, 12]);
        // The suffix itself is never its own match.
        d.extend(2, &[5, 6]);
        assert!(d.propose(2, 3).is_empty());
        assert!(d.propose(3, 3).is_empty(), "unknown sequence proposes nothing");
    }

    #[test]
    fn longest_then_most_recent_match_wins() {
        let mut d = drafter();
        // "7 8" occurs twice with different continuations; "6 7 8" only once (→ 1).
        d.extend(1, &[6, 7, 8, 1, 0, 7, 8, 2, 0, 6, 7, 8]);
        assert_eq!(d.propose(1, 1), vec![1]);
        let mut d = drafter();
        d.extend(1, &[7, 8, 1, 0, 7, 8, 2, 0, 7, 8]);
        assert_eq!(d.propose(1, 1), vec![2], "most recent occurrence of the 2-gram");
    }

    #[test]
    fn incremental_index_equals_brute_force_on_random_streams() {
        let cfg = NgramConfig { min_ngram: 1, max_ngram: 4 };
        let mut seed = 12345u64;
        for case in 0..40 {
            let mut d = NgramDrafter::new(cfg).unwrap();
            let mut tokens = Vec::new();
            let alphabet = 2 + case % 6;
            for _ in 0..200 {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let t = ((seed >> 33) % alphabet) as u32;
                tokens.push(t);
                d.extend(7, &[t]);
                let k = 1 + (seed >> 20) as usize % 7;
                assert_eq!(d.propose(7, k), brute_force(&tokens, k, cfg), "case {case} len {}", tokens.len());
            }
            d.truncate(7, 50);
            tokens.truncate(50);
            assert_eq!(d.len(7), 50);
            assert_eq!(d.propose(7, 5), brute_force(&tokens, 5, cfg));
            d.forget(7);
            assert_eq!(d.len(7), 0);
        }
    }

    #[test]
    fn bad_sizes_are_refused() {
        for (min_ngram, max_ngram) in [(0, 3), (4, 3), (1, 65)] {
            assert!(NgramDrafter::new(NgramConfig { min_ngram, max_ngram }).is_err());
        }
    }
}
