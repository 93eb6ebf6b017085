//! `glm5_next` over a tensor-parallel group of CPU ranks in one process: one [`Glm5Backend`] per
//! rank (its shard and its cache), every step run on all of them in lockstep, rank 0's logits
//! returned. The group is one `Backend` to the executor, so a verification commit, a state
//! snapshot or a restored page reaches every rank at once.
//!
//! Images the KV pool and the spill tier see:
//! - a KV block is one rank's block: the paged records (MLA latents, indexer keys) are computed
//!   identically on every rank (replicated weights, replicated inputs), so one copy is the
//!   group's image; writing it puts it into every rank;
//! - a state slot is every rank's slot in rank order (each holds its own KDA heads' conv windows
//!   and delta-rule states), so a page snapshot and a spill file carry every rank's part.

use std::sync::Arc;

use super::shard::{shard_weights, RankGroup};
use super::{weights, Glm5Backend};
use crate::backend::cpu::COLLECTIVE_TIMEOUT;
use crate::backend::tp::lockstep;
use crate::backend::{
    check_token_ids, validate_batch, validate_kv_image, Backend, BackendError, HiddenTaps, KvGeometry, SeqStep,
    StepLogits,
};
use crate::model::glm5_next::shard::Glm5Shard;
use crate::model::glm5_next::Glm5Config;
use crate::model::{ModelError, WeightSource};
use crate::parallel::{Collective, LocalComm, TpRank};

pub struct Glm5TpBackend {
    ranks: Vec<Glm5Backend>,
    vocab: usize,
    expert_parallel: bool,
}

impl Glm5TpBackend {
    /// Check that `world` ranks (with `expert_parallel`, whole experts per rank) divide every
    /// split of `c`, before any weight is read: the error names the count that does not divide.
    pub fn check(c: &Glm5Config, world: usize, expert_parallel: bool) -> Result<(), String> {
        let tp = TpRank::new(0, world).map_err(|e| e.to_string())?;
        Glm5Shard::new(c, tp, expert_parallel).map(|_| ()).map_err(|e| e.to_string())
    }

    /// Load the model once and give each of `world` ranks its shard; `threads` (0 = every core)
    /// are shared out between the ranks, at least one each.
    pub fn new(
        cfg: Glm5Config,
        w: &dyn WeightSource,
        threads: usize,
        kv: KvGeometry,
        world: usize,
        expert_parallel: bool,
    ) -> Result<Self, ModelError> {
        let bad = |msg: String| ModelError::Config { file: w.origin().to_path_buf(), msg };
        Self::check(&cfg, world, expert_parallel).map_err(bad)?;
        if kv.block_size == 0 || kv.num_blocks == 0 || kv.state_slots == 0 {
            return Err(bad("glm5_next needs at least one KV block and one recurrent-state slot".into()));
        }
        let total = if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads };
        let full = weights::load(&cfg, w)?;
        let comms = LocalComm::group(world, COLLECTIVE_TIMEOUT).map_err(|e| bad(e.to_string()))?;
        let mut ranks = Vec::with_capacity(world);
        for (rank, comm) in comms.into_iter().enumerate() {
            let tp = TpRank::new(rank, world).map_err(|e| bad(e.to_string()))?;
            let plan = Glm5Shard::new(&cfg, tp, expert_parallel).map_err(|e| bad(e.to_string()))?;
            let shard = shard_weights(&cfg, &full, &plan);
            let comm: Arc<dyn Collective> = Arc::new(comm);
            let group = RankGroup { comm, experts: plan.experts.clone(), vocab: plan.vocab.clone() };
            let local = plan.local_config(&cfg);
            ranks.push(Glm5Backend::new_rank(local, shard, group, (total / world).max(1), kv).map_err(bad)?);
        }
        tracing::info!(
            world,
            expert_parallel,
            weights_mib = ranks.iter().map(Glm5Backend::weight_bytes).sum::<usize>() >> 20,
            "glm5_next split over CPU ranks"
        );
        Ok(Glm5TpBackend { ranks, vocab: cfg.vocab_size, expert_parallel })
    }

    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }

    pub fn expert_parallel(&self) -> bool {
        self.expert_parallel
    }

    /// Bytes of weights held by each rank, rank 0 first.
    pub fn rank_weight_bytes(&self) -> Vec<usize> {
        self.ranks.iter().map(Glm5Backend::weight_bytes).collect()
    }

    /// Bytes of weights held by all ranks together.
    pub fn weight_bytes(&self) -> usize {
        self.ranks.iter().map(Glm5Backend::weight_bytes).sum()
    }

    /// Bytes of the caches of all ranks together.
    pub fn kv_bytes(&self) -> usize {
        self.ranks.iter().map(Glm5Backend::kv_bytes).sum()
    }

    pub fn threads(&self) -> usize {
        self.ranks.iter().map(Glm5Backend::threads).sum()
    }

    fn slot_widths(&self) -> Vec<usize> {
        self.ranks.iter().map(Backend::state_slot_bytes).collect()
    }
}

impl Backend for Glm5TpBackend {
    fn device_name(&self) -> String {
        "cpu".into()
    }

    fn kv_geometry(&self) -> KvGeometry {
        self.ranks[0].kv_geometry()
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn forward(&mut self, batch: &[SeqStep<'_>]) -> Result<StepLogits, BackendError> {
        self.forward_verify(batch, &[])
    }

    fn forward_verify(&mut self, batch: &[SeqStep<'_>], verify: &[bool]) -> Result<StepLogits, BackendError> {
        // Checked once here so a bad step fails on every rank alike, before any collective.
        validate_batch(batch, self.kv_geometry())?;
        check_token_ids(batch, self.vocab)?;
        lockstep(&mut self.ranks, |r| r.forward_verify(batch, verify), |r| r.forward_verify(batch, verify).map(|_| ()))
    }

    fn commit_verified(&mut self, slot: u32, kept: usize) -> Result<(), BackendError> {
        self.ranks.iter_mut().try_for_each(|r| r.commit_verified(slot, kept))
    }

    /// Rank 0 records the taps: after each layer's all-reduce every rank holds the whole residual
    /// stream, so one rank's copy is the group's.
    fn set_hidden_taps(&mut self, layers: &[usize]) -> Result<(), BackendError> {
        self.ranks[0].set_hidden_taps(layers)
    }

    fn take_hidden_taps(&mut self) -> Option<HiddenTaps> {
        self.ranks[0].take_hidden_taps()
    }

    fn kv_block_bytes(&self) -> usize {
        self.ranks[0].kv_block_bytes()
    }

    fn read_kv_blocks(&mut self, blocks: &[u32]) -> Result<Vec<u8>, BackendError> {
        self.ranks[0].read_kv_blocks(blocks)
    }

    fn write_kv_blocks(&mut self, blocks: &[u32], image: &[u8]) -> Result<(), BackendError> {
        validate_kv_image(blocks, image.len(), self.kv_block_bytes(), self.kv_geometry())?;
        self.ranks.iter_mut().try_for_each(|r| r.write_kv_blocks(blocks, image))
    }

    fn state_slot_bytes(&self) -> usize {
        self.slot_widths().iter().sum()
    }

    fn read_state_slot(&mut self, slot: u32) -> Result<Vec<u8>, BackendError> {
        let mut image = Vec::with_capacity(self.state_slot_bytes());
        for r in &mut self.ranks {
            image.extend(r.read_state_slot(slot)?);
        }
        Ok(image)
    }

    fn write_state_slot(&mut self, slot: u32, image: &[u8]) -> Result<(), BackendError> {
        let widths = self.slot_widths();
        if image.len() != widths.iter().sum::<usize>() {
            return Err(BackendError::InvalidStep(format!(
                "recurrent-state image is {} bytes, a slot of the group holds {} ({} ranks)",
                image.len(),
                widths.iter().sum::<usize>(),
                widths.len()
            )));
        }
        let mut at = 0;
        for (r, w) in self.ranks.iter_mut().zip(widths) {
            r.write_state_slot(slot, &image[at..at + w])?;
            at += w;
        }
        Ok(())
    }

    fn abort_collectives(&self, reason: &str) {
        self.ranks.iter().for_each(|r| r.abort_collectives(reason));
    }
}
