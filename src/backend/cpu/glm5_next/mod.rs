//! `Backend` for `glm5_next` on the CPU: the model plus its paged per-token cache (MLA latents,
//! indexer keys and pooled keys) and recurrent-state slots (KDA conv windows and states), run on
//! a rayon pool the backend owns. Images of blocks and slots are raw little-endian f32.
//!
//! Owns the CPU compute of `glm5_next` (forward, kernels in plain Rust, the host cache). The
//! architecture — config, weight names and shapes, cache layout — comes from `model::glm5_next`
//! and is never redefined here, so the CPU and CUDA backends read the same description.
//!
//! # Rolling recurrent state back after draft verification
//! A verification step runs the last known token plus k drafts through every KDA layer, so the
//! conv windows and delta-rule states advance past drafts that may be rejected. Attention caches
//! need no undo (rejected positions are overwritten by the next step), but recurrent state has no
//! positions to overwrite. We keep per-position checkpoints: during a `forward_verify` step each
//! verified sequence's slot is copied after every token but the last (k slot images, freed at the
//! commit), and `commit_verified` copies back the one at the accepted length. The alternative,
//! snapshot-and-recompute, saves one image but must replay the accepted tokens' recurrence (or the
//! whole forward) after verification — more arithmetic on the critical path, and on CPU a memcpy
//! of the state per token is far cheaper than a delta-rule step over it. The memory is bounded by
//! k slot images per drafted sequence in the step, and only between forward and commit. Because
//! the recurrence runs token by token in both paths, a checkpoint is bitwise the state an
//! undrafted run reaches at that position.
//!
//! # Tensor parallelism
//! [`Glm5TpBackend`] (`tp.rs`) holds one [`Glm5Backend`] per rank, each with its shard of the
//! weights (`shard.rs`, following `model::glm5_next::shard`) and its own cache: the paged records
//! (MLA latents, indexer keys) replicated, the state slots holding that rank's KDA heads.

use std::sync::Arc;

pub mod cache;
mod ffn;
pub mod forward;
mod kda;
mod mla;
pub mod mtp;
pub mod ops;
pub mod shard;
#[cfg(test)]
mod tap_tests;
pub mod tp;
pub mod vision;
pub mod weights;

pub use self::tp::Glm5TpBackend;

use self::cache::Glm5Cache;
use self::forward::Glm5Model;
use self::vision::VisionTower;
use crate::backend::{
    check_tap_layers, validate_batch, validate_kv_image, Backend, BackendError, EmbeddedRows, HiddenTaps,
    ImageEmbedding, KvGeometry, SeqStep, StepLogits, TapRecorder,
};
use crate::model::glm5_next::vision::{config_for_text, MultimodalIds};
use crate::model::glm5_next::Glm5Config;
use crate::model::quant::simd_available;
use crate::model::{ModelError, WeightSource};

pub struct Glm5Backend {
    model: Glm5Model,
    /// The vision tower and its placeholder id, when the checkpoint has one.
    vision: Option<(VisionTower, MultimodalIds)>,
    cache: Glm5Cache,
    pool: Arc<rayon::ThreadPool>,
    simd: bool,
    weight_bytes: usize,
    /// Layers whose hidden states each step records (`Backend::set_hidden_taps`).
    tap_layers: Vec<usize>,
    last_taps: Option<HiddenTaps>,
}

/// The vision tower of the checkpoint in `w`'s directory, when its config has one and its
/// tensors are there (its width checked against the text model's by the shared description).
fn load_vision(cfg: &Glm5Config, w: &dyn WeightSource) -> Result<Option<(VisionTower, MultimodalIds)>, ModelError> {
    let Some((vc, ids)) = config_for_text(w.origin(), cfg.hidden_size)? else { return Ok(None) };
    Ok(VisionTower::load(vc, w)?.map(|t| (t, ids)))
}

impl Glm5Backend {
    /// Load the weights and allocate the cache. `threads == 0` uses every core.
    pub fn new(cfg: Glm5Config, w: &dyn WeightSource, threads: usize, kv: KvGeometry) -> Result<Self, ModelError> {
        let bad = |msg: String| ModelError::Config { file: w.origin().to_path_buf(), msg };
        if kv.block_size == 0 || kv.num_blocks == 0 {
            return Err(bad("the KV store needs at least one block of at least one token".into()));
        }
        if kv.state_slots == 0 {
            return Err(bad("glm5_next needs at least one recurrent-state slot per live sequence".into()));
        }
        let pool = cpu_pool(threads).map_err(bad)?;
        let weights = pool.install(|| weights::load(&cfg, w))?;
        let vision = pool.install(|| load_vision(&cfg, w))?;
        Ok(Self::assemble(Glm5Model { cfg, weights, group: None }, pool, kv, vision))
    }

    /// One rank of a tensor-parallel group: `cfg` is the rank's local config
    /// ([`Glm5Shard::local_config`](crate::model::glm5_next::shard::Glm5Shard::local_config)),
    /// `weights` its shard, `group` its handle to the others. The geometry was checked by the
    /// group. Ranks carry no vision tower (images are refused under tensor parallelism).
    pub fn new_rank(
        cfg: Glm5Config,
        weights: weights::Glm5Weights,
        group: shard::RankGroup,
        threads: usize,
        kv: KvGeometry,
    ) -> Result<Self, String> {
        let pool = cpu_pool(threads)?;
        Ok(Self::assemble(Glm5Model { cfg, weights, group: Some(group) }, pool, kv, None))
    }

    fn assemble(
        model: Glm5Model,
        pool: rayon::ThreadPool,
        kv: KvGeometry,
        vision: Option<(VisionTower, MultimodalIds)>,
    ) -> Self {
        let weight_bytes = model.weights.bytes() + vision.as_ref().map_or(0, |(t, _)| t.weight_bytes());
        let cache = Glm5Cache::new(&model.cfg, kv);
        Glm5Backend {
            model,
            vision,
            cache,
            pool: Arc::new(pool),
            simd: simd_available(),
            weight_bytes,
            tap_layers: Vec::new(),
            last_taps: None,
        }
    }

    pub fn config(&self) -> &Glm5Config {
        &self.model.cfg
    }

    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// Bytes of the paged cache plus the recurrent-state slots.
    pub fn kv_bytes(&self) -> usize {
        self.cache.bytes()
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    fn check_slot(&self, slot: u32) -> Result<usize, BackendError> {
        let n = self.cache.geom.state_slots;
        if slot as usize >= n {
            return Err(BackendError::InvalidStep(format!(
                "recurrent-state slot {slot} is out of range, the backend has {n}"
            )));
        }
        Ok(slot as usize)
    }
}

fn cpu_pool(threads: usize) -> Result<rayon::ThreadPool, String> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("glm5-cpu-{i}"))
        .build()
        .map_err(|e| format!("could not start the CPU thread pool: {e}"))
}

impl Backend for Glm5Backend {
    fn device_name(&self) -> String {
        "cpu".into()
    }

    fn kv_geometry(&self) -> KvGeometry {
        self.cache.geom
    }

    fn vocab_size(&self) -> usize {
        self.model.cfg.vocab_size
    }

    fn forward(&mut self, batch: &[SeqStep<'_>]) -> Result<StepLogits, BackendError> {
        self.forward_verify(batch, &[])
    }

    fn forward_verify(&mut self, batch: &[SeqStep<'_>], verify: &[bool]) -> Result<StepLogits, BackendError> {
        self.last_taps = None;
        validate_batch(batch, self.cache.geom)?;
        let pool = Arc::clone(&self.pool);
        let (model, cache, simd) = (&self.model, &mut self.cache, self.simd);
        let mut taps = TapRecorder::new(&self.tap_layers, model.cfg.hidden_size, batch);
        let out = pool.install(|| model.forward_tapped(cache, batch, verify, simd, taps.as_mut()));
        // A rank that fails mid-step releases the others from the collective they wait in.
        if let (Err(e), Some(g)) = (&out, &self.model.group) {
            g.comm.abort(&e.to_string());
        }
        let logits = out?;
        self.last_taps = taps.map(TapRecorder::finish);
        Ok(logits)
    }

    fn set_hidden_taps(&mut self, layers: &[usize]) -> Result<(), BackendError> {
        check_tap_layers(layers, self.model.weights.layers.len())?;
        self.tap_layers = layers.to_vec();
        Ok(())
    }

    fn take_hidden_taps(&mut self) -> Option<HiddenTaps> {
        self.last_taps.take()
    }

    fn image_token_id(&self) -> Option<u32> {
        self.vision.as_ref().map(|(_, ids)| ids.image_token_id)
    }

    fn encode_image(&mut self, pixel_values: &[f32], grid: [usize; 3]) -> Result<ImageEmbedding, BackendError> {
        let Some((tower, _)) = &self.vision else {
            return Err(BackendError::InvalidStep("this model has no vision tower".into()));
        };
        let simd = self.simd;
        let data = self.pool.install(|| tower.encode(pixel_values, grid, simd))?;
        let hidden = tower.cfg.out_hidden_size;
        Ok(ImageEmbedding { rows: data.len() / hidden, hidden, data })
    }

    fn forward_embedded(
        &mut self,
        batch: &[SeqStep<'_>],
        verify: &[bool],
        embeds: &[Vec<EmbeddedRows<'_>>],
    ) -> Result<StepLogits, BackendError> {
        if embeds.iter().all(Vec::is_empty) {
            return self.forward_verify(batch, verify);
        }
        // Rows that take an embedding are looked up as token 0 first (their ids, the image
        // placeholder, may lie outside the text vocabulary), then overwritten.
        let mut tokens: Vec<Vec<u32>> = batch.iter().map(|s| s.tokens.to_vec()).collect();
        for (t, runs) in tokens.iter_mut().zip(embeds) {
            for run in runs {
                let rows = run.data.len() / run.hidden.max(1);
                if let Some(span) = t.get_mut(run.first_row..run.first_row + rows) {
                    span.fill(0);
                }
            }
        }
        let steps: Vec<SeqStep<'_>> = batch.iter().zip(&tokens).map(|(s, t)| SeqStep { tokens: t, ..*s }).collect();
        validate_batch(&steps, self.cache.geom)?;
        let pool = Arc::clone(&self.pool);
        let (model, cache, simd) = (&self.model, &mut self.cache, self.simd);
        pool.install(|| model.forward_embedded(cache, &steps, verify, embeds, simd))
    }

    fn abort_collectives(&self, reason: &str) {
        if let Some(g) = &self.model.group {
            g.comm.abort(reason);
        }
    }

    fn commit_verified(&mut self, slot: u32, kept: usize) -> Result<(), BackendError> {
        let s = self.check_slot(slot)?;
        self.cache.commit_verified(s, kept).map_err(BackendError::InvalidStep)
    }

    fn kv_block_bytes(&self) -> usize {
        self.cache.block_bytes()
    }

    fn read_kv_blocks(&mut self, blocks: &[u32]) -> Result<Vec<u8>, BackendError> {
        validate_kv_image(blocks, blocks.len() * self.kv_block_bytes(), self.kv_block_bytes(), self.cache.geom)?;
        Ok(self.cache.read_blocks(blocks))
    }

    fn write_kv_blocks(&mut self, blocks: &[u32], image: &[u8]) -> Result<(), BackendError> {
        validate_kv_image(blocks, image.len(), self.kv_block_bytes(), self.cache.geom)?;
        self.cache.write_blocks(blocks, image);
        Ok(())
    }

    fn state_slot_bytes(&self) -> usize {
        self.cache.slot_bytes()
    }

    fn snapshots_inside_step(&self) -> bool {
        true
    }

    fn mark_state_snapshots(&mut self, slot: u32, after_tokens: &[usize]) -> Result<(), BackendError> {
        let s = self.check_slot(slot)?;
        crate::backend::check_snapshot_offsets(after_tokens)?;
        self.cache.mark(s, after_tokens);
        Ok(())
    }

    fn take_state_snapshots(&mut self, slot: u32) -> Vec<Vec<u8>> {
        match self.check_slot(slot) {
            Ok(s) => self.cache.take_marks(s),
            Err(_) => Vec::new(),
        }
    }

    fn read_state_slot(&mut self, slot: u32) -> Result<Vec<u8>, BackendError> {
        let s = self.check_slot(slot)?;
        Ok(self.cache.read_slot(s))
    }

    fn write_state_slot(&mut self, slot: u32, image: &[u8]) -> Result<(), BackendError> {
        let s = self.check_slot(slot)?;
        if image.len() != self.cache.slot_bytes() {
            return Err(BackendError::InvalidStep(format!(
                "recurrent-state image is {} bytes, a slot holds {}",
                image.len(),
                self.cache.slot_bytes()
            )));
        }
        self.cache.write_slot(s, image);
        Ok(())
    }
}
