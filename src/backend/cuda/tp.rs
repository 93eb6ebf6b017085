//! Tensor parallelism over the GPUs of one host: N [`CudaBackend`] ranks on devices
//! `ordinal..ordinal + N`, each holding its shard of the weights and its kv heads' part of the KV
//! store, joined by NCCL communicators. Every step runs on all ranks in lockstep (one thread per
//! GPU) and rank 0's logits or greedy ids are returned. At one rank it is a plain [`CudaBackend`]
//! with no NCCL at all.

use super::gpu::Gpu;
use super::nccl::NcclComm;
use super::weights::DeviceWeights;
use super::{CudaBackend, CudaOptions};
use crate::backend::tp::{group_block_bytes, lockstep, read_group_kv, write_group_kv};
use crate::backend::{
    check_token_ids, validate_batch, validate_kv_image, Backend, BackendError, DeviceSampleSpec, KvGeometry, SeqStep,
    StepLogits,
};
use crate::config::LlamaConfig;
use crate::model::WeightSource;
use crate::sampling::Sampled;

/// Devices `first..first + world`, checked against what the driver sees.
pub fn group_devices(first: usize, world: usize) -> Result<Vec<usize>, BackendError> {
    let count = super::device_count().map_err(|reason| BackendError::Unavailable { device: "cuda".into(), reason })?;
    if first + world > count {
        return Err(BackendError::Unavailable {
            device: format!("cuda:{first}..{}", first + world - 1),
            reason: format!(
                "tensor parallel size {world} from device {first} needs more than the {count} device(s) the driver sees"
            ),
        });
    }
    Ok((first..first + world).collect())
}

/// One NCCL communicator per device of `ordinals`, rank `i` on `ordinals[i]`.
pub fn nccl_group(ordinals: &[usize]) -> Result<Vec<NcclComm>, BackendError> {
    NcclComm::group(ordinals).map_err(|e| BackendError::Unavailable { device: "cuda".into(), reason: e.to_string() })
}

/// One rank of a group whose communicators were made by [`nccl_group`]: opens the rank's device
/// and loads its shard of `w`. Call on the rank's own thread (its executor's).
pub fn load_rank(
    cfg: &LlamaConfig,
    w: &dyn WeightSource,
    opts: CudaOptions,
    comm: NcclComm,
) -> Result<CudaBackend, BackendError> {
    let started = std::time::Instant::now();
    let ordinal = comm.ordinal();
    let gpu = Gpu::open(ordinal)?;
    let b = CudaBackend::rank(cfg, gpu, CudaOptions { ordinal, ..opts }, Some(comm), |gpu, s| {
        DeviceWeights::load(gpu, cfg, w, opts.precision, s)
    })?;
    tracing::info!(
        ordinal,
        weights_mib = b.weight_bytes() / (1 << 20),
        secs = format!("{:.2}", started.elapsed().as_secs_f64()),
        "tensor-parallel rank loaded on cuda:{ordinal}"
    );
    Ok(b)
}

pub struct TpCudaBackend {
    ranks: Vec<CudaBackend>,
}

impl TpCudaBackend {
    /// Load `world` shards of `w` onto devices `opts.ordinal..opts.ordinal + world`.
    pub fn new(cfg: &LlamaConfig, w: &dyn WeightSource, opts: CudaOptions, world: usize) -> Result<Self, BackendError> {
        Self::build(cfg, opts, world, |gpu, s| DeviceWeights::load(gpu, cfg, w, opts.precision, s))
    }

    /// Seeded synthetic weights (the same model at every `world`), generated on each device.
    pub fn synthetic(cfg: &LlamaConfig, seed: u64, opts: CudaOptions, world: usize) -> Result<Self, BackendError> {
        Self::build(cfg, opts, world, |gpu, s| DeviceWeights::synthetic(gpu, cfg, opts.precision, seed, s))
    }

    /// [`synthetic`](Self::synthetic) with the projections packed in `format` (one device).
    pub fn synthetic_packed(
        cfg: &LlamaConfig,
        seed: u64,
        opts: CudaOptions,
        format: crate::model::quant::packed::PackedFormat,
    ) -> Result<Self, BackendError> {
        Self::build(cfg, opts, 1, |gpu, s| DeviceWeights::synthetic_packed(gpu, cfg, opts.precision, seed, s, format))
    }

    fn build(
        cfg: &LlamaConfig,
        opts: CudaOptions,
        world: usize,
        weights: impl Fn(&mut Gpu, &super::shard::RankSlices) -> Result<DeviceWeights, BackendError>,
    ) -> Result<Self, BackendError> {
        if world == 0 {
            return Err(BackendError::InvalidStep("tensor parallel size must be at least 1".into()));
        }
        // The plan is checked before any device is opened, so a bad size fails fast.
        super::shard::RankSlices::new(
            cfg,
            crate::parallel::TpRank::new(0, world).map_err(|e| BackendError::InvalidStep(e.to_string()))?,
        )?;
        if world == 1 {
            let gpu = Gpu::open(opts.ordinal)?;
            return Ok(TpCudaBackend { ranks: vec![CudaBackend::rank(cfg, gpu, opts, None, weights)?] });
        }
        let ordinals = group_devices(opts.ordinal, world)?;
        let comms = nccl_group(&ordinals)?;
        let mut ranks = Vec::with_capacity(world);
        for (comm, &ordinal) in comms.into_iter().zip(&ordinals) {
            let gpu = Gpu::open(ordinal)?;
            ranks.push(CudaBackend::rank(cfg, gpu, CudaOptions { ordinal, ..opts }, Some(comm), &weights)?);
        }
        Ok(TpCudaBackend { ranks })
    }

    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }

    /// Rank 0, for what is the same on every rank (device name, ceilings).
    pub fn lead(&mut self) -> &mut CudaBackend {
        &mut self.ranks[0]
    }

    /// Bytes of weights on all devices together.
    pub fn weight_bytes(&self) -> usize {
        self.ranks.iter().map(CudaBackend::weight_bytes).sum()
    }

    /// Bytes of the KV stores of all devices together.
    pub fn kv_bytes(&self) -> usize {
        self.ranks.iter().map(CudaBackend::kv_bytes).sum()
    }

    /// Replay decode steps as CUDA graphs (or not) on every rank.
    pub fn set_cuda_graphs(&mut self, on: bool) {
        self.ranks.iter_mut().for_each(|r| r.set_cuda_graphs(on));
    }

    /// Sample on rank 0's device in `forward_sampled` (or leave sampling to the host).
    pub fn set_device_sampling(&mut self, on: bool) {
        self.ranks.iter_mut().for_each(|r| r.set_device_sampling(on));
    }

    /// Greedy ids of every logits row (argmax on rank 0's device).
    pub fn forward_greedy(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<u32>, BackendError> {
        validate_batch(batch, self.kv_geometry())?;
        lockstep(&mut self.ranks, |r| r.forward_greedy(batch), |r| r.forward_follow(batch))
    }

    /// Rank 0's mean all-reduce and all-gather seconds for `bytes` per rank (see
    /// [`CudaBackend::time_collectives`]), all ranks taking part; `None` at one rank.
    pub fn time_collectives(&mut self, bytes: usize, reps: usize) -> Result<Option<(f64, f64)>, BackendError> {
        lockstep(&mut self.ranks, |r| r.time_collectives(bytes, reps), |r| r.time_collectives(bytes, reps).map(|_| ()))
    }

    /// Fill every rank's KV store with seeded random values.
    pub fn fill_kv_random(&mut self, seed: u64) -> Result<(), BackendError> {
        self.ranks.iter_mut().enumerate().try_for_each(|(i, r)| r.fill_kv_random(seed.wrapping_add(i as u64)))
    }
}

impl Backend for TpCudaBackend {
    fn device_name(&self) -> String {
        match self.ranks.len() {
            1 => self.ranks[0].device_name(),
            n => format!("{} (+{} tensor-parallel ranks)", self.ranks[0].device_name(), n - 1),
        }
    }

    fn kv_geometry(&self) -> KvGeometry {
        self.ranks[0].kv_geometry()
    }

    fn vocab_size(&self) -> usize {
        self.ranks[0].vocab_size()
    }

    fn forward(&mut self, batch: &[SeqStep<'_>]) -> Result<StepLogits, BackendError> {
        validate_batch(batch, self.kv_geometry())?;
        check_token_ids(batch, self.vocab_size())?;
        lockstep(&mut self.ranks, |r| r.forward(batch), |r| r.forward_follow(batch))
    }

    /// Rank 0 samples after the lockstep forward; the other ranks only run their share of it.
    fn forward_sampled(
        &mut self,
        batch: &[SeqStep<'_>],
        specs: &[Option<DeviceSampleSpec<'_>>],
    ) -> Result<Option<Vec<Option<Sampled>>>, BackendError> {
        if !self.ranks[0].device_sampling() {
            return Ok(None);
        }
        validate_batch(batch, self.kv_geometry())?;
        check_token_ids(batch, self.vocab_size())?;
        lockstep(&mut self.ranks, |r| r.forward_and_sample(batch, specs), |r| r.forward_follow(batch)).map(Some)
    }

    /// Rank 0 taps: its residual stream is whole after every layer's all-reduce, and only rank 0's
    /// step results are read.
    fn set_hidden_taps(&mut self, layers: &[usize]) -> Result<(), BackendError> {
        self.ranks[0].set_hidden_taps(layers)
    }

    fn take_hidden_taps(&mut self) -> Option<crate::backend::HiddenTaps> {
        self.ranks[0].take_hidden_taps()
    }

    fn device_free_memory(&self) -> Option<u64> {
        self.ranks.iter().map(|r| r.device_free_memory()).min().flatten()
    }

    fn kv_block_bytes(&self) -> usize {
        group_block_bytes(&self.ranks)
    }

    /// A group of one resizes; ranks joined by collectives keep the size the card gave them.
    fn resize_kv(&mut self, num_blocks: usize) -> Result<bool, BackendError> {
        match self.ranks.as_mut_slice() {
            [only] => Backend::resize_kv(only, num_blocks),
            _ => Ok(false),
        }
    }

    fn read_kv_blocks(&mut self, blocks: &[u32]) -> Result<Vec<u8>, BackendError> {
        validate_kv_image(blocks, blocks.len() * self.kv_block_bytes(), self.kv_block_bytes(), self.kv_geometry())?;
        read_group_kv(&mut self.ranks, blocks)
    }

    /// A group of one copies pages out in the background; a larger group's image joins every
    /// rank's part, read in turn.
    fn read_kv_blocks_then(&mut self, blocks: &[u32], done: crate::backend::PageImageDone) {
        match self.ranks.as_mut_slice() {
            [only] => Backend::read_kv_blocks_then(only, blocks, done),
            _ => done(Backend::read_kv_blocks(self, blocks)),
        }
    }

    fn finish_kv_reads(&mut self) -> Result<(), BackendError> {
        self.ranks.iter_mut().try_for_each(Backend::finish_kv_reads)
    }

    fn write_kv_blocks(&mut self, blocks: &[u32], image: &[u8]) -> Result<(), BackendError> {
        validate_kv_image(blocks, image.len(), self.kv_block_bytes(), self.kv_geometry())?;
        write_group_kv(&mut self.ranks, blocks, image)
    }
}
