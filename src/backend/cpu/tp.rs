//! Tensor parallelism on CPU threads: N rank backends, each holding its shard of the weights and
//! its kv heads' part of the KV store, joined by an in-process [`LocalComm`] group. Every step runs
//! on all ranks in lockstep (same batch, one thread per rank) and rank 0's logits are returned.
//! This is what the engine's executor holds until one executor actor per rank exists; it makes no
//! policy decisions and adds none of its own numerics (the ranks' collectives do the joining).

use std::sync::Arc;
use std::time::Duration;

use super::{CpuBackend, CpuOptions, TpShard};
use crate::backend::tp::{group_block_bytes, lockstep, read_group_kv, write_group_kv};
use crate::backend::{
    check_token_ids, validate_batch, validate_kv_image, Backend, BackendError, HiddenTaps, KvGeometry, SeqStep,
    StepLogits,
};
use crate::config::LlamaConfig;
use crate::model::{ModelError, WeightSource};
use crate::parallel::{Collective, LlamaShard, LocalComm, TpRank};

/// How long a rank waits for the others in a collective before the group is declared failed.
/// Generous: a long prefill chunk on a loaded machine must not be mistaken for a dead rank.
pub const COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(600);

pub struct TpCpuBackend {
    ranks: Vec<CpuBackend>,
}

impl TpCpuBackend {
    /// Load `world` shards of the model. `opts.threads` (0 = one per core) is shared out between
    /// the ranks, at least one each. A world size that does not divide the model's heads, kv heads
    /// or MLP is refused with the number that does not divide.
    pub fn new(cfg: &LlamaConfig, w: &dyn WeightSource, opts: CpuOptions, world: usize) -> Result<Self, ModelError> {
        let config_error = |msg: String| ModelError::Config { file: w.origin().to_path_buf(), msg };
        if world == 0 {
            return Err(config_error("tensor parallel size must be at least 1".into()));
        }
        // Check the plan once up front so an indivisible size fails before any weight is read.
        LlamaShard::of_model(TpRank::new(0, world).map_err(|e| config_error(e.to_string()))?, cfg)
            .map_err(|e| config_error(e.to_string()))?;
        let total =
            if opts.threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { opts.threads };
        let rank_opts = CpuOptions { threads: (total / world).max(1), ..opts };
        let comms = LocalComm::group(world, COLLECTIVE_TIMEOUT).map_err(|e| config_error(e.to_string()))?;
        let mut ranks = Vec::with_capacity(world);
        for (rank, comm) in comms.into_iter().enumerate() {
            let rank = TpRank::new(rank, world).map_err(|e| config_error(e.to_string()))?;
            let comm: Arc<dyn Collective> = Arc::new(comm);
            ranks.push(CpuBackend::new_shard(cfg, w, rank_opts, Some(TpShard { rank, comm }))?);
        }
        Ok(TpCpuBackend { ranks })
    }

    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }

    /// Bytes of weights held by all ranks together.
    pub fn weight_bytes(&self) -> usize {
        self.ranks.iter().map(CpuBackend::weight_bytes).sum()
    }

    /// Bytes of the KV stores of all ranks together.
    pub fn kv_bytes(&self) -> usize {
        self.ranks.iter().map(CpuBackend::kv_bytes).sum()
    }

    /// Worker threads over all ranks.
    pub fn threads(&self) -> usize {
        self.ranks.iter().map(CpuBackend::threads).sum()
    }
}

impl Backend for TpCpuBackend {
    fn device_name(&self) -> String {
        "cpu".into()
    }

    fn kv_geometry(&self) -> KvGeometry {
        self.ranks[0].kv_geometry()
    }

    fn vocab_size(&self) -> usize {
        self.ranks[0].vocab_size()
    }

    fn forward(&mut self, batch: &[SeqStep<'_>]) -> Result<StepLogits, BackendError> {
        // Checked once here so a bad step fails on every rank alike, before any collective.
        validate_batch(batch, self.kv_geometry())?;
        check_token_ids(batch, self.vocab_size())?;
        lockstep(&mut self.ranks, |r| r.forward(batch), |r| r.forward(batch).map(|_| ()))
    }

    /// Rank 0 records the taps: after each layer's all-reduce every rank holds the whole residual
    /// stream, so one rank's copy is the group's.
    fn set_hidden_taps(&mut self, layers: &[usize]) -> Result<(), BackendError> {
        self.ranks[0].set_hidden_taps(layers)
    }

    fn take_hidden_taps(&mut self) -> Option<HiddenTaps> {
        self.ranks[0].take_hidden_taps()
    }

    /// One block of the image is every rank's image of that block, in rank order, so the image
    /// stays block after block (the spill tier may cut it at block boundaries).
    fn kv_block_bytes(&self) -> usize {
        group_block_bytes(&self.ranks)
    }

    fn read_kv_blocks(&mut self, blocks: &[u32]) -> Result<Vec<u8>, BackendError> {
        validate_kv_image(blocks, blocks.len() * self.kv_block_bytes(), self.kv_block_bytes(), self.kv_geometry())?;
        read_group_kv(&mut self.ranks, blocks)
    }

    fn write_kv_blocks(&mut self, blocks: &[u32], image: &[u8]) -> Result<(), BackendError> {
        validate_kv_image(blocks, image.len(), self.kv_block_bytes(), self.kv_geometry())?;
        write_group_kv(&mut self.ranks, blocks, image)
    }
}
