//! The executor-facing compute interface. A backend owns one device's weights and KV memory and
//! runs exactly the batch it is given: a ragged mix of prefill chunks, single-token decodes and
//! multi-token verification steps, each sequence with a block table into the paged KV store.
//! Backends make no policy decisions (which blocks, which sequences, when): that is the
//! scheduler's and the KV pool's job.

pub mod cpu;
pub mod cuda;

use crate::model::ModelError;

/// Shape of the paged KV store a backend allocates at construction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    /// Tokens per allocation block.
    pub block_size: usize,
    /// Number of blocks in the store.
    pub num_blocks: usize,
}

impl KvGeometry {
    pub fn capacity_tokens(&self) -> usize {
        self.block_size * self.num_blocks
    }

    /// Blocks needed to hold `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
}

/// One sequence's share of a step.
#[derive(Clone, Copy, Debug)]
pub struct SeqStep<'a> {
    /// Query tokens this step: a prefill chunk, one decode token, or last token + drafts.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; positions `0..start_pos` are already in the KV store.
    pub start_pos: usize,
    /// Physical block ids covering positions `0..start_pos + tokens.len()`, in order.
    pub block_table: &'a [u32],
    /// How many trailing positions of `tokens` need logits (0 = none, 1 = the next token,
    /// `tokens.len()` = every position, as for scoring or draft verification).
    pub logits_rows: usize,
}

/// Logits for a step: rows in batch order, each sequence contributing its `logits_rows` rows.
#[derive(Clone, Debug, Default)]
pub struct StepLogits {
    pub vocab: usize,
    pub data: Vec<f32>,
    /// Row offset of each sequence's first row (`offsets[i]..offsets[i + 1]`).
    pub offsets: Vec<usize>,
}

impl StepLogits {
    /// The logits rows of sequence `i` in the batch.
    pub fn rows(&self, i: usize) -> impl Iterator<Item = &[f32]> {
        let (a, b) = (self.offsets[i], self.offsets[i + 1]);
        self.data[a * self.vocab..b * self.vocab].chunks_exact(self.vocab)
    }

    /// The last logits row of sequence `i`, if it asked for any.
    pub fn last_row(&self, i: usize) -> Option<&[f32]> {
        let (a, b) = (self.offsets[i], self.offsets[i + 1]);
        (b > a).then(|| &self.data[(b - 1) * self.vocab..b * self.vocab])
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("invalid step: {0}")]
    InvalidStep(String),
    #[error("device `{device}` is not available: {reason}")]
    Unavailable { device: String, reason: String },
    #[error("device error: {0}")]
    Device(String),
}

/// A compute backend for one rank. Implemented by the CPU reference backend and the CUDA
/// backend. `forward` must be deterministic, and a sequence's logits must not depend on what
/// else is in the batch.
pub trait Backend: Send {
    /// Short device name for logs and metrics (`cpu`, `cuda:0`).
    fn device_name(&self) -> String;
    fn kv_geometry(&self) -> KvGeometry;
    fn vocab_size(&self) -> usize;
    /// Run one step: append every sequence's `tokens` to its KV blocks and return the
    /// requested logits rows.
    fn forward(&mut self, batch: &[SeqStep<'_>]) -> Result<StepLogits, BackendError>;
}

/// Check a batch against the KV geometry before touching memory: every position must map to a
/// block in range, and `logits_rows` must fit.
pub fn validate_batch(batch: &[SeqStep<'_>], geom: KvGeometry) -> Result<(), BackendError> {
    for (i, s) in batch.iter().enumerate() {
        if s.tokens.is_empty() {
            return Err(BackendError::InvalidStep(format!("sequence {i} has no tokens")));
        }
        if s.logits_rows > s.tokens.len() {
            return Err(BackendError::InvalidStep(format!(
                "sequence {i} asks for {} logits rows but has {} tokens",
                s.logits_rows,
                s.tokens.len()
            )));
        }
        let end = s.start_pos + s.tokens.len();
        let need = geom.blocks_for(end);
        if s.block_table.len() < need {
            return Err(BackendError::InvalidStep(format!(
                "sequence {i} covers {end} positions but its block table has {} blocks (need {need})",
                s.block_table.len()
            )));
        }
        if let Some(b) = s.block_table[..need].iter().find(|&&b| b as usize >= geom.num_blocks) {
            return Err(BackendError::InvalidStep(format!(
                "sequence {i} references block {b}, store has {}",
                geom.num_blocks
            )));
        }
    }
    Ok(())
}
