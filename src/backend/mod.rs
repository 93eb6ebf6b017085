//! The executor-facing compute interface. A backend owns one device's weights and KV memory and
//! runs exactly the batch it is given: a ragged mix of prefill chunks, single-token decodes and
//! multi-token verification steps, each sequence with a block table into the paged KV store.
//! Backends make no policy decisions (which blocks, which sequences, when): that is the
//! scheduler's and the KV pool's job.

pub mod cpu;
pub mod cuda;
pub mod glm5_steps;
pub mod tp;

use std::sync::atomic::AtomicBool;

use crate::model::ModelError;
use crate::sampling::{PenaltyState, Sampled, SamplingParams};

/// Shape of the paged KV store a backend allocates at construction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvGeometry {
    /// Tokens per allocation block.
    pub block_size: usize,
    /// Number of blocks in the store.
    pub num_blocks: usize,
    /// Recurrent-state slots (0 for attention-only models).
    pub state_slots: usize,
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
    /// This sequence's recurrent-state slot (hybrid models: KDA conv and recurrent state). The
    /// KV pool gives every live sequence a distinct slot below `KvGeometry::state_slots`; the state
    /// is reset when `start_pos == 0` and continued otherwise. Attention-only backends ignore it.
    pub state_slot: u32,
}

/// A run of consecutive query rows of one sequence in a step whose input embeddings are given
/// (an image's placeholder tokens) instead of looked up from their token ids.
#[derive(Clone, Copy, Debug)]
pub struct EmbeddedRows<'a> {
    /// Index into the sequence's `tokens` of the run's first row.
    pub first_row: usize,
    /// Width of one embedding (the text model's hidden size).
    pub hidden: usize,
    /// `rows × hidden` values.
    pub data: &'a [f32],
}

/// One image's placeholder embeddings from the vision tower: `rows × hidden` values.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageEmbedding {
    pub rows: usize,
    pub hidden: usize,
    pub data: Vec<f32>,
}

/// One image to encode: `pixel_values` `[t·h·w, C·T·P·P]` from `media::ImageProcessor` (or one
/// frame pair of `media::VideoProcessor`), grid `(t, h, w)`.
#[derive(Clone, Copy, Debug)]
pub struct ImageInput<'a> {
    pub pixel_values: &'a [f32],
    pub grid: [usize; 3],
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

/// Hidden states of chosen target layers for every token row of a step: what a drafter that reads
/// the target (DFlash, MTP) is fed. Layer `l`'s state is the residual stream after decoder layer
/// `l` (HF's `hidden_states[l + 1]`); for models with several residual streams (mHC) their mean,
/// the collapse the final head uses. Each row holds the tapped layers' states side by side, in
/// the order of [`HiddenTaps::layers`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HiddenTaps {
    pub layers: Vec<usize>,
    /// Width of one layer's state.
    pub hidden: usize,
    /// `[rows, layers.len() * hidden]`, rows in batch order (every token of every sequence).
    pub data: Vec<f32>,
    /// Row offset of each sequence's first row (`offsets[i]..offsets[i + 1]`).
    pub offsets: Vec<usize>,
}

impl HiddenTaps {
    /// Floats in one row (every tapped layer).
    pub fn row_width(&self) -> usize {
        self.layers.len() * self.hidden
    }

    /// Rows `from..to` of sequence `i` (relative to its first row), as one slice.
    pub fn seq_rows(&self, i: usize, from: usize, to: usize) -> &[f32] {
        let (a, b) = (self.offsets[i], self.offsets[i + 1]);
        let (from, to) = ((a + from).min(b), (a + to).min(b));
        &self.data[from * self.row_width()..to * self.row_width()]
    }
}

/// Collects [`HiddenTaps`] while a forward pass runs: the pass offers each layer's output and the
/// recorder copies it only for the layers asked for.
#[derive(Debug)]
pub struct TapRecorder {
    taps: HiddenTaps,
}

impl TapRecorder {
    /// `None` when no layer is tapped (the forward pass then copies nothing).
    pub fn new(layers: &[usize], hidden: usize, batch: &[SeqStep<'_>]) -> Option<Self> {
        if layers.is_empty() {
            return None;
        }
        let mut offsets = Vec::with_capacity(batch.len() + 1);
        offsets.push(0);
        for s in batch {
            offsets.push(offsets.last().copied().unwrap_or(0) + s.tokens.len());
        }
        let rows = offsets.last().copied().unwrap_or(0);
        let data = vec![0f32; rows * layers.len() * hidden];
        Some(TapRecorder { taps: HiddenTaps { layers: layers.to_vec(), hidden, data, offsets } })
    }

    /// Offer layer `layer`'s output: `state(row, out)` writes row `row`'s state into `out`.
    pub fn offer(&mut self, layer: usize, state: impl Fn(usize, &mut [f32]) + Sync) {
        use rayon::prelude::*;
        let (h, width) = (self.taps.hidden, self.taps.row_width());
        for (col, _) in self.taps.layers.iter().enumerate().filter(|(_, &l)| l == layer) {
            self.taps
                .data
                .par_chunks_mut(width)
                .enumerate()
                .for_each(|(r, row)| state(r, &mut row[col * h..(col + 1) * h]));
        }
    }

    pub fn finish(self) -> HiddenTaps {
        self.taps
    }
}

/// Refuse tap layers the model does not have.
pub fn check_tap_layers(layers: &[usize], num_layers: usize) -> Result<(), BackendError> {
    match layers.iter().find(|&&l| l >= num_layers) {
        Some(l) => Err(BackendError::InvalidStep(format!(
            "hidden-state tap at layer {l}, but the model has {num_layers} layers (0..{num_layers})"
        ))),
        None => Ok(()),
    }
}

/// How a step run by [`Backend::forward_yielding`] or [`Backend::resume_suspended`] ended.
#[derive(Clone, Debug)]
pub enum StepRun {
    /// It ran to the end.
    Done(StepLogits),
    /// It stopped between two decoder layers because the yield signal was raised: the KV of
    /// layers `0..=after_layer` is written for every row of the step, and the backend keeps the
    /// rows' residual stream until [`Backend::resume_suspended`] (or [`Backend::drop_suspended`]).
    Suspended { after_layer: usize },
}

/// What to sample on the device for one sequence of a step: its last logits row, drawn exactly as
/// [`crate::sampling::sample`] draws it on the host (same order of operations, same tie rules,
/// the same `uniform(seed, step)`).
#[derive(Clone, Copy, Debug)]
pub struct DeviceSampleSpec<'a> {
    pub params: &'a SamplingParams,
    /// Penalty history before this token; `None` when the params use no penalties.
    pub penalties: Option<&'a PenaltyState>,
    /// Index of the token being generated (the counter of the seeded draw).
    pub step: u64,
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
/// Where `Backend::read_kv_blocks_then` hands a page image.
pub type PageImageDone = Box<dyn FnOnce(Result<Vec<u8>, BackendError>) + Send>;

pub trait Backend: Send {
    /// Short device name for logs and metrics (`cpu`, `cuda:0`).
    fn device_name(&self) -> String;
    fn kv_geometry(&self) -> KvGeometry;
    fn vocab_size(&self) -> usize;
    /// Run one step: append every sequence's `tokens` to its KV blocks and return the
    /// requested logits rows.
    fn forward(&mut self, batch: &[SeqStep<'_>]) -> Result<StepLogits, BackendError>;

    /// Run a step and sample on the device, so only token ids (and logprobs when asked) cross to
    /// the host: `specs[i]` for `batch[i]` (`None`: nothing sampled; `Some`: its last logits row,
    /// which needs `logits_rows >= 1`). Returns `Ok(None)` without running anything when the
    /// backend samples on the host (the default, and what the CPU backend does): the caller then
    /// runs [`Backend::forward`] and samples the rows itself. Draft verification always takes the
    /// host path (rejection sampling needs each row's whole processed distribution).
    fn forward_sampled(
        &mut self,
        batch: &[SeqStep<'_>],
        specs: &[Option<DeviceSampleSpec<'_>>],
    ) -> Result<Option<Vec<Option<Sampled>>>, BackendError> {
        let _ = (batch, specs);
        Ok(None)
    }

    /// Run a step in which some sequences verify draft tokens (`verify[i]` for `batch[i]`; a
    /// shorter slice means `false` for the rest). For those, a backend with recurrent state keeps
    /// that state after each of the step's tokens until [`Backend::commit_verified`] says how many
    /// tokens were kept, so the state can be rolled back past rejected drafts. Attention-only
    /// backends need nothing extra: a rejected draft's KV positions are simply overwritten by the
    /// next step. That is the default, which refuses checkpoints it cannot keep.
    fn forward_verify(&mut self, batch: &[SeqStep<'_>], verify: &[bool]) -> Result<StepLogits, BackendError> {
        if self.state_slot_bytes() > 0 && verify.iter().any(|&v| v) {
            return Err(BackendError::InvalidStep(
                "this backend keeps recurrent state but cannot checkpoint it for draft verification".into(),
            ));
        }
        self.forward(batch)
    }
    /// After a `forward_verify` step: keep the effect of the first `kept` tokens (the last known
    /// token plus the accepted drafts) of the verified sequence in `slot` and roll its recurrent
    /// state back to there. A no-op for attention-only backends.
    fn commit_verified(&mut self, slot: u32, kept: usize) -> Result<(), BackendError> {
        let _ = (slot, kept);
        if self.state_slot_bytes() > 0 {
            return Err(BackendError::InvalidStep(
                "this backend keeps recurrent state but cannot roll it back after draft verification".into(),
            ));
        }
        Ok(())
    }

    /// From now on, record the hidden states of `layers` (see [`HiddenTaps`]) in every step, for
    /// [`Backend::take_hidden_taps`]; an empty list stops recording. The states come out of the
    /// same pass that computes the logits. Backends that cannot tap refuse a non-empty list.
    fn set_hidden_taps(&mut self, layers: &[usize]) -> Result<(), BackendError> {
        if layers.is_empty() {
            return Ok(());
        }
        Err(BackendError::Unavailable {
            device: self.device_name(),
            reason: "this backend cannot return hidden states of the target's layers (needed by dflash/mtp drafters)"
                .into(),
        })
    }
    /// The tapped hidden states of the last step (`None` when nothing is tapped or the step
    /// failed). Taking them leaves nothing behind.
    fn take_hidden_taps(&mut self) -> Option<HiddenTaps> {
        None
    }
    /// The token id whose rows an image's embeddings replace, `None` for a model without a
    /// vision tower (every multimodal method below then refuses).
    fn image_token_id(&self) -> Option<u32> {
        None
    }
    /// Encode one image (`pixel_values` `[t·h·w, C·T·P·P]` from `media::ImageProcessor`, grid
    /// `(t, h, w)`) with the vision tower into its placeholder rows' embeddings.
    fn encode_image(&mut self, pixel_values: &[f32], grid: [usize; 3]) -> Result<ImageEmbedding, BackendError> {
        let _ = (pixel_values, grid);
        Err(BackendError::InvalidStep("this model has no vision tower".into()))
    }
    /// Encode the images of a step (across requests) in one call: one result per image, in
    /// order, so that an image that fails fails alone. Backends that can batch the tower
    /// override this; the default encodes one image after the other.
    fn encode_images(&mut self, images: &[ImageInput<'_>]) -> Vec<Result<ImageEmbedding, BackendError>> {
        images.iter().map(|i| self.encode_image(i.pixel_values, i.grid)).collect()
    }
    /// [`Backend::forward_verify`] where `embeds[i]` gives input embeddings for runs of sequence
    /// `i`'s rows (their token ids are then not looked up and may lie outside the vocabulary).
    fn forward_embedded(
        &mut self,
        batch: &[SeqStep<'_>],
        verify: &[bool],
        embeds: &[Vec<EmbeddedRows<'_>>],
    ) -> Result<StepLogits, BackendError> {
        if embeds.iter().any(|e| !e.is_empty()) {
            return Err(BackendError::InvalidStep("this backend takes no image embeddings".into()));
        }
        self.forward_verify(batch, verify)
    }

    /// Whether [`Backend::forward_yielding`] can stop a step between layers and resume it later
    /// (the CPU llama backend, unsharded and without hidden-state taps). Others run steps whole.
    fn can_yield(&self) -> bool {
        false
    }
    /// [`Backend::forward`] for a step that gives way to more urgent work: between two decoder
    /// layers, if `yield_now` is set, the step stops and the backend keeps its partial state (one
    /// suspended step at a time; other steps may run meanwhile, on other sequences' blocks).
    /// Resuming it gives bitwise the logits an uninterrupted run gives. The default runs whole.
    fn forward_yielding(&mut self, batch: &[SeqStep<'_>], yield_now: &AtomicBool) -> Result<StepRun, BackendError> {
        let _ = yield_now;
        self.forward(batch).map(StepRun::Done)
    }
    /// Continue the suspended step from the layer after the one it stopped at; `batch` must be
    /// the batch it was started with. It may suspend again when `yield_now` is set.
    fn resume_suspended(&mut self, batch: &[SeqStep<'_>], yield_now: &AtomicBool) -> Result<StepRun, BackendError> {
        let _ = (batch, yield_now);
        Err(BackendError::InvalidStep("this backend has no suspended step to resume".into()))
    }
    /// Forget the suspended step, if any (its sequences were cancelled or failed).
    fn drop_suspended(&mut self) {}

    /// Bytes one block takes in a [`Backend::read_kv_blocks`] image (every layer's K and V).
    fn kv_block_bytes(&self) -> usize;
    /// Copy the KV contents of `blocks` out of device memory as one byte image, block after block,
    /// for the spill tier. The image is only meaningful to a backend with the same model, KV
    /// precision and layout (the spill index keys it by model fingerprint).
    fn read_kv_blocks(&mut self, blocks: &[u32]) -> Result<Vec<u8>, BackendError>;
    /// Write an image made by `read_kv_blocks` back into `blocks` (which may differ from the
    /// blocks it was read from).
    fn write_kv_blocks(&mut self, blocks: &[u32], image: &[u8]) -> Result<(), BackendError>;

    /// `read_kv_blocks` for evictions: `done` gets the image, possibly later and on another
    /// thread. The blocks' contents are taken in order with the backend's work, so later steps
    /// may overwrite them as soon as this returns. A device backend returns without waiting for
    /// the copy; the default reads synchronously.
    fn read_kv_blocks_then(&mut self, blocks: &[u32], done: PageImageDone) {
        done(self.read_kv_blocks(blocks));
    }

    /// Returns once every `read_kv_blocks_then` started so far has called its `done`.
    fn finish_kv_reads(&mut self) -> Result<(), BackendError> {
        Ok(())
    }

    /// Bytes of one recurrent-state slot image; 0 for attention-only models, which is why the
    /// two methods below have stateless defaults. Hybrid backends override all three.
    fn state_slot_bytes(&self) -> usize {
        0
    }
    /// Snapshot of a sequence's recurrent state (for prefix-cache pages and spill).
    fn read_state_slot(&mut self, _slot: u32) -> Result<Vec<u8>, BackendError> {
        Ok(Vec::new())
    }
    /// Whether [`Backend::mark_state_snapshots`] works, i.e. the recurrent state can be read at
    /// offsets inside a step (so prefill chunks may cross page boundaries of a hybrid model).
    /// Attention-only backends have no state to read: trivially yes.
    fn snapshots_inside_step(&self) -> bool {
        self.state_slot_bytes() == 0
    }
    /// For the next forward only: keep the recurrent-state image of `slot` after each of the first
    /// `after_tokens[i]` tokens of its step (ascending, each below the step's token count; the
    /// state at the step's end is the slot itself). Take them with `take_state_snapshots`.
    fn mark_state_snapshots(&mut self, _slot: u32, after_tokens: &[usize]) -> Result<(), BackendError> {
        if after_tokens.is_empty() || self.state_slot_bytes() == 0 {
            Ok(())
        } else {
            Err(BackendError::InvalidStep("this backend cannot read its recurrent state inside a step".into()))
        }
    }
    /// The images `mark_state_snapshots` asked for, in its order (empty when none were marked or
    /// the step failed); clears the marks either way.
    fn take_state_snapshots(&mut self, _slot: u32) -> Vec<Vec<u8>> {
        Vec::new()
    }
    /// Restore a snapshot made by `read_state_slot` into `slot`.
    fn write_state_slot(&mut self, _slot: u32, image: &[u8]) -> Result<(), BackendError> {
        if image.is_empty() {
            Ok(())
        } else {
            Err(BackendError::InvalidStep(format!(
                "a {}-byte recurrent-state image was given to a backend without recurrent state",
                image.len()
            )))
        }
    }

    /// Release the other ranks of this backend's tensor-parallel group from any collective they
    /// wait in (this rank failed outside `forward`'s own error handling, e.g. it panicked).
    /// Nothing to do for a backend that is not one rank of a group.
    fn abort_collectives(&self, _reason: &str) {}

    /// Free bytes of the device memory this backend allocates from, the least over its ranks;
    /// `None` on the CPU (the capacity card sizes against host memory there). Read before and
    /// after a profiling step to measure the step workspace.
    fn device_free_memory(&self) -> Option<u64> {
        None
    }

    /// Re-make the KV store with `num_blocks` blocks (contents not kept), so the pool can take
    /// what a measured step workspace left of the budget. Only before the first real step.
    /// `Ok(false)`: this backend keeps its size.
    fn resize_kv(&mut self, _num_blocks: usize) -> Result<bool, BackendError> {
        Ok(false)
    }
}

/// Check the token counts given to [`Backend::mark_state_snapshots`]: positive and ascending.
pub fn check_snapshot_offsets(after_tokens: &[usize]) -> Result<(), BackendError> {
    if after_tokens.windows(2).any(|w| w[0] >= w[1]) || after_tokens.first() == Some(&0) {
        return Err(BackendError::InvalidStep(format!(
            "state snapshot offsets {after_tokens:?} must be positive and ascending"
        )));
    }
    Ok(())
}

/// Check a KV image against the blocks it is meant for: the block ids in range and the image
/// exactly `blocks.len()` blocks long.
pub fn validate_kv_image(
    blocks: &[u32],
    image_len: usize,
    block_bytes: usize,
    geom: KvGeometry,
) -> Result<(), BackendError> {
    if let Some(b) = blocks.iter().find(|&&b| b as usize >= geom.num_blocks) {
        return Err(BackendError::InvalidStep(format!("block {b} is out of range, store has {}", geom.num_blocks)));
    }
    if image_len != blocks.len() * block_bytes {
        return Err(BackendError::InvalidStep(format!(
            "KV image is {image_len} bytes, {} blocks of {block_bytes} bytes need {}",
            blocks.len(),
            blocks.len() * block_bytes
        )));
    }
    Ok(())
}

/// Reject token ids outside the vocabulary. A tensor-parallel group calls this once, before any
/// rank starts a collective, so a bad step fails on every rank alike.
pub fn check_token_ids(batch: &[SeqStep<'_>], vocab: usize) -> Result<(), BackendError> {
    match batch.iter().flat_map(|s| s.tokens.iter()).find(|&&id| id as usize >= vocab) {
        Some(bad) => Err(BackendError::InvalidStep(format!("token id {bad} is outside the vocabulary ({vocab})"))),
        None => Ok(()),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn step(tokens: &[u32]) -> SeqStep<'_> {
        SeqStep { tokens, start_pos: 0, block_table: &[0], logits_rows: 1, state_slot: 0 }
    }

    #[test]
    fn token_ids_must_lie_below_the_vocabulary_in_every_sequence() {
        assert!(check_token_ids(&[step(&[0, 9]), step(&[3])], 10).is_ok());
        let err = check_token_ids(&[step(&[0, 9]), step(&[3, 10, 11])], 10).expect_err("10 is outside");
        assert_eq!(err.to_string(), "invalid step: token id 10 is outside the vocabulary (10)");
        assert!(check_token_ids(&[], 0).is_ok(), "an empty batch has nothing to reject");
    }
}
