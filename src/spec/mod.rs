//! Speculative decoding: draft sources that propose up to `k` next tokens per sequence, the
//! verification rules that keep a drafted reply equal to (greedy) or distributed as (sampled) the
//! un-drafted one, and acceptance statistics.
//!
//! Owns: drafter state per sequence (an n-gram index, a draft model's KV cache) and the pure
//! verification functions. Must not touch: the scheduler's queues or KV blocks (the scheduler
//! decides whether a sequence gets drafts and how many fit; a preempted or cancelled sequence's
//! drafts are dropped by the scheduler, and `forget` tells the drafter), the target model or its
//! logits beyond what it is handed.
//!
//! Draft sources are pluggable behind [`DraftSource`]: the model-free n-gram drafter, the
//! draft-model drafter (`draft_model`, a smaller checkpoint with the target's tokenizer) and the
//! DFlash / DFlash2 block drafter (`dflash`, which reads the target's hidden states) live here.
//! `extend` feeds a source the accepted tokens, `propose` asks for up to k more for one sequence,
//! and `propose_batch` for many sequences at once: a model-backed source overrides it to run one
//! batched forward per draft position instead of one per sequence.
//!
//! Drafters that read the target (`dflash`, the DFlash/DFlash2 block drafter: one forward proposes
//! a block from the target's hidden states; `mtp`, glm5_next's own MTP layer, which reads the last
//! layer's state) say which target layers they read
//! (`DraftSource::hidden_taps`); the engine asks the backend to tap those layers, the executor
//! returns the states of the tokens each step kept ([`HiddenChunk`], in its `StepResult`), and
//! the scheduler forwards them in `DraftUpdate`, where `extend_hidden` hands them to the source
//! beside `extend`'s tokens. Their per-sequence state follows the same rules: fed only accepted
//! tokens, dropped on `forget`.

pub mod adaptive;
pub mod dflash;
pub mod draft_model;
pub mod mtp;
pub mod ngram;
pub mod stats;
pub mod step;
pub mod verify;

use std::str::FromStr;

pub use crate::sched::SeqId;

/// The draft tokens a step can carry at most: the target verifies last token + k drafts in one
/// pass, and the seeds' engine uses seven.
pub const MAX_SPECULATIVE_TOKENS: usize = 7;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DraftError {
    #[error("invalid speculative decoding setting: {0}")]
    InvalidConfig(String),
    #[error("draft model `{path}`: {msg}")]
    DraftModel { path: String, msg: String },
    #[error("--speculative mtp: {0}")]
    Mtp(String),
}

/// The target's tapped hidden states (see `backend::HiddenTaps`) for consecutive positions of one
/// sequence, from `start_pos` on: one row per token the target ran and kept, each row the states
/// of `layers` side by side.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HiddenChunk {
    pub start_pos: usize,
    pub layers: std::sync::Arc<[usize]>,
    pub data: Vec<f32>,
}

impl HiddenChunk {
    /// Rows `0..rows` of sequence `i` of a step's taps (its tokens from `start_pos` on).
    pub fn from_taps(taps: &crate::backend::HiddenTaps, i: usize, start_pos: usize, rows: usize) -> Self {
        HiddenChunk { start_pos, layers: taps.layers.clone().into(), data: taps.seq_rows(i, 0, rows).to_vec() }
    }
}

/// One sequence's share of a batched proposal: up to `k` drafts for `seq`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DraftRequest {
    pub seq: SeqId,
    pub k: usize,
}

/// A source of draft tokens. Implementations keep whatever per-sequence state they need, fed
/// only with tokens the target has accepted.
pub trait DraftSource: Send {
    /// Short name for logs and metrics (`ngram`, `draft-model`).
    fn name(&self) -> &'static str;
    /// Append accepted tokens (prompt first, then output) to `seq`'s context.
    fn extend(&mut self, seq: SeqId, tokens: &[u32]);
    /// Target layers whose hidden states this source reads (none for most sources).
    fn hidden_taps(&self) -> Vec<usize> {
        Vec::new()
    }
    /// The target's hidden states for tokens `seq` already holds (sources that read none drop them).
    fn extend_hidden(&mut self, seq: SeqId, chunks: Vec<HiddenChunk>) {
        let _ = (seq, chunks);
    }
    /// Up to `k` proposed next tokens for `seq` (possibly none).
    fn propose(&mut self, seq: SeqId, k: usize) -> Vec<u32>;
    /// Drop `seq`'s state (finished, cancelled, preempted).
    fn forget(&mut self, seq: SeqId);
    /// Cut `seq`'s context back to its first `len` tokens.
    fn truncate(&mut self, seq: SeqId, len: usize);
    /// Tokens of context held for `seq`.
    fn len(&self, seq: SeqId) -> usize;
    /// Sequences this source holds state for (0 once every sequence was forgotten).
    fn sequences(&self) -> usize;
    /// Drafts for many sequences at once, in request order. The default asks `propose` one
    /// sequence at a time; a model-backed source batches its forwards across the requests.
    fn propose_batch(&mut self, requests: &[DraftRequest]) -> Vec<Vec<u32>> {
        requests.iter().map(|r| self.propose(r.seq, r.k)).collect()
    }
}

/// Which drafter a lane uses: `none`, `ngram`, `mtp` (a glm5_next checkpoint's own MTP layer, on
/// the CPU backend), `draft:PATH` (a smaller checkpoint with the same tokenizer: a GGUF file, an HF
/// directory or `default`) or `dflash:PATH` (a DFlash/DFlash2 drafter directory that reads the
/// target's hidden states).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum SpeculativeMethod {
    #[default]
    None,
    Ngram,
    Mtp,
    DraftModel(String),
    DFlash(String),
}

impl SpeculativeMethod {
    /// The source name metrics label acceptance with (`None` when the lane does not draft).
    pub fn source_name(&self) -> Option<&'static str> {
        match self {
            Self::None => None,
            Self::Ngram => Some("ngram"),
            Self::Mtp => Some("mtp"),
            Self::DraftModel(_) => Some("draft-model"),
            Self::DFlash(_) => Some("dflash"),
        }
    }

    /// Whether the lane's drafter reads the target's hidden states.
    pub fn reads_hidden_states(&self) -> bool {
        matches!(self, Self::DFlash(_) | Self::Mtp)
    }
}

impl FromStr for SpeculativeMethod {
    type Err = DraftError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "" | "none" | "off" => Ok(Self::None),
            "ngram" => Ok(Self::Ngram),
            "mtp" => Ok(Self::Mtp),
            other => match (other.strip_prefix("draft:"), other.strip_prefix("dflash:")) {
                (Some(path), _) if !path.is_empty() => Ok(Self::DraftModel(path.to_string())),
                (_, Some(path)) if !path.is_empty() => Ok(Self::DFlash(path.to_string())),
                _ => Err(DraftError::InvalidConfig(format!(
                    "`{other}` is not a speculative method; use none, ngram, mtp, draft:PATH or dflash:PATH"
                ))),
            },
        }
    }
}

impl TryFrom<String> for SpeculativeMethod {
    type Error = DraftError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<SpeculativeMethod> for String {
    fn from(m: SpeculativeMethod) -> String {
        match m {
            SpeculativeMethod::None => "none".into(),
            SpeculativeMethod::Ngram => "ngram".into(),
            SpeculativeMethod::Mtp => "mtp".into(),
            SpeculativeMethod::DraftModel(p) => format!("draft:{p}"),
            SpeculativeMethod::DFlash(p) => format!("dflash:{p}"),
        }
    }
}

/// Check a requested draft length.
pub fn validate_num_tokens(k: usize) -> Result<usize, DraftError> {
    if (1..=MAX_SPECULATIVE_TOKENS).contains(&k) {
        Ok(k)
    } else {
        Err(DraftError::InvalidConfig(format!(
            "num_speculative_tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, got {k}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn methods_parse_and_print() {
        assert_eq!("none".parse::<SpeculativeMethod>().unwrap(), SpeculativeMethod::None);
        assert_eq!("ngram".parse::<SpeculativeMethod>().unwrap(), SpeculativeMethod::Ngram);
        assert_eq!("mtp".parse::<SpeculativeMethod>().unwrap(), SpeculativeMethod::Mtp);
        assert_eq!(String::from(SpeculativeMethod::Mtp), "mtp");
        assert!(SpeculativeMethod::Mtp.reads_hidden_states());
        assert_eq!(SpeculativeMethod::Mtp.source_name(), Some("mtp"));
        assert_eq!(
            "draft:/m/small".parse::<SpeculativeMethod>().unwrap(),
            SpeculativeMethod::DraftModel("/m/small".into())
        );
        assert_eq!(
            "dflash:/m/drafter".parse::<SpeculativeMethod>().unwrap(),
            SpeculativeMethod::DFlash("/m/drafter".into())
        );
        for bad in ["draft:", "dflash:", "eagle", "ngram2", "mtp2"] {
            let e = bad.parse::<SpeculativeMethod>().unwrap_err().to_string();
            assert!(e.contains("none, ngram, mtp, draft:PATH or dflash:PATH"), "{e}");
        }
        assert_eq!(String::from(SpeculativeMethod::DFlash("d".into())), "dflash:d");
        assert_eq!(String::from(SpeculativeMethod::DraftModel("x".into())), "draft:x");
        assert!(validate_num_tokens(0).is_err() && validate_num_tokens(8).is_err());
        assert_eq!(validate_num_tokens(7).unwrap(), 7);
    }
}
