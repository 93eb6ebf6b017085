//! The CUDA backend: llama-family forward passes on one NVIDIA GPU over ragged batches with a
//! paged KV store, validated against the CPU reference (`scripts/gpu_validate.sh`). cudarc loads
//! the CUDA libraries at run time, so this module builds and its host-side parts test on
//! machines without CUDA; kernels (`cuda/*.cu`) are compiled by NVRTC when a backend opens.
//! Owns the device, its weights and KV memory; makes no scheduling decisions and never touches
//! the CPU backend. Sampling can run on the device too (`sample`, `Backend::forward_sampled`).
//! Tensor parallelism: a backend can be one rank of a group (`shard`, `nccl`),
//! driven in lockstep with the others by [`TpCudaBackend`]. `glm5_next` has its own backend
//! (`glm5_next`) on the same device layer (`gpu`).

mod decode;
pub mod dflash;
mod forward;
pub mod glm5_next;
pub mod gpu;
mod kernel_cache;
pub mod nccl;
mod page_mover;
pub mod plan;
pub mod quant;
pub mod sample;
pub mod shard;
mod staging;
mod tp;
mod weights;

pub use gpu::{device_count, device_memory, Precision};
pub use sample::RowSampler;
pub use tp::{group_devices, load_rank, nccl_group, TpCudaBackend};

use self::gpu::{DevBuf, Gpu};
use self::plan::KvLayout;
use self::weights::DeviceWeights;
use super::{
    check_tap_layers, validate_batch, Backend, BackendError, DeviceSampleSpec, HiddenTaps, KvGeometry, SeqStep,
    StepLogits,
};
use crate::config::{LlamaConfig, RopeScaling};
use crate::model::WeightSource;
use crate::sampling::Sampled;

#[derive(Clone, Copy, Debug)]
pub struct CudaOptions {
    pub ordinal: usize,
    pub kv: KvGeometry,
    pub precision: Precision,
}

/// How RoPE angles are computed on the device (mirrors the CPU backend's `RopeAngles`).
struct Rope {
    /// 0: `pos · inv_freq[j]` (HF); 1: GGML's iterated θ with optional per-pair factors.
    mode: i32,
    theta_scale: f32,
    freq_scale: f32,
    /// HF: inverse frequencies; GGML: Llama 3 factors (or none).
    table: Option<DevBuf>,
}

impl Rope {
    fn new(gpu: &Gpu, c: &LlamaConfig) -> Result<Self, BackendError> {
        if !c.rope_ggml_style {
            return Ok(Rope {
                mode: 0,
                theta_scale: 0.0,
                freq_scale: 1.0,
                table: Some(gpu.upload(&c.rope_inv_freq())?),
            });
        }
        let theta_scale = c.rope_theta.powf(-2.0 / c.head_dim as f32);
        Ok(match &c.rope_scaling {
            None => Rope { mode: 1, theta_scale, freq_scale: 1.0, table: None },
            Some(RopeScaling::Linear { factor }) => {
                Rope { mode: 1, theta_scale, freq_scale: 1.0 / factor, table: None }
            }
            Some(RopeScaling::Llama3 { .. }) => {
                let plain = LlamaConfig { rope_scaling: None, ..c.clone() }.rope_inv_freq();
                let factors: Vec<f32> = plain.iter().zip(c.rope_inv_freq()).map(|(p, s)| p / s).collect();
                Rope { mode: 1, theta_scale, freq_scale: 1.0, table: Some(gpu.upload(&factors)?) }
            }
        })
    }
}

pub struct CudaBackend {
    cfg: LlamaConfig,
    gpu: Gpu,
    prec: Precision,
    weights: DeviceWeights,
    rope: Rope,
    geom: KvGeometry,
    kv_layout: KvLayout,
    /// `[block][layer][K|V][slot][kv_dim]` in `prec`.
    kv: DevBuf,
    scratch: forward::Scratch,
    /// Prefill attention on the tensor cores (bf16, sm_80+); `false` keeps every step on the
    /// FMA kernel (`SHELFSERVE_CUDA_MMA_ATTENTION=0`).
    tensor_cores: bool,
    /// Block shape of the tensor-core prefill kernel (`SHELFSERVE_CUDA_PREFILL_TILES`).
    prefill_tiles: plan::MmaTiles,
    /// Decode attention on the streaming split-K kernel with the combine folded in; `false`
    /// keeps the split-and-combine pair (`SHELFSERVE_CUDA_STREAM_DECODE=0`, for comparison).
    streaming_decode: bool,
    /// Replay decode steps as CUDA graphs (`SHELFSERVE_CUDA_GRAPHS=0` turns it off).
    cuda_graphs: bool,
    graphs: std::collections::HashMap<forward::GraphKey, forward::StepGraph>,
    /// Copies evicted pages out beside the step stream (made at the first eviction).
    page_mover: Option<page_mover::PageMover>,
    /// This rank's communicator and slices; `None` when the backend holds the whole model.
    tp: Option<shard::CudaTp>,
    /// Sample on the device in `forward_sampled` (`SHELFSERVE_CUDA_SAMPLING=0` keeps sampling on
    /// the host, for comparisons).
    device_sampling: bool,
    sampler: sample::DeviceSampler,
    /// Layers whose residual each step copies out (`Backend::set_hidden_taps`).
    tap_layers: Vec<usize>,
    last_taps: Option<HiddenTaps>,
}

impl CudaBackend {
    /// Open device `opts.ordinal` and load `w` onto it.
    pub fn new(cfg: &LlamaConfig, w: &dyn WeightSource, opts: CudaOptions) -> Result<Self, BackendError> {
        let started = std::time::Instant::now();
        let gpu = Gpu::open(opts.ordinal)?;
        tracing::info!(ms = started.elapsed().as_millis() as u64, "device opened (context, cuBLAS, kernels)");
        Self::rank(cfg, gpu, opts, None, |gpu, s| DeviceWeights::load(gpu, cfg, w, opts.precision, s))
    }

    /// Seeded random weights generated on the device (benchmarks of any model size).
    pub fn synthetic(cfg: &LlamaConfig, seed: u64, opts: CudaOptions) -> Result<Self, BackendError> {
        let gpu = Gpu::open(opts.ordinal)?;
        Self::rank(cfg, gpu, opts, None, |gpu, s| DeviceWeights::synthetic(gpu, cfg, opts.precision, seed, s))
    }

    /// One rank of a tensor-parallel group (`comm` = `None`: the whole model) on an opened
    /// device, its weights made by `weights` for its slices. Call on the rank's own thread.
    pub fn rank(
        cfg: &LlamaConfig,
        mut gpu: Gpu,
        opts: CudaOptions,
        comm: Option<nccl::NcclComm>,
        weights: impl FnOnce(&mut Gpu, &shard::RankSlices) -> Result<DeviceWeights, BackendError>,
    ) -> Result<Self, BackendError> {
        use crate::parallel::DeviceCollective as _;
        let comm = comm.map(|mut c| {
            c.bind_stream(gpu.stream.cu_stream());
            c
        });
        let tp_rank = match &comm {
            Some(c) => crate::parallel::TpRank::new(c.rank(), c.world_size())
                .map_err(|e| BackendError::Device(format!("tensor parallel: {e}")))?,
            None => crate::parallel::TpRank::single(),
        };
        let slices = shard::RankSlices::new(cfg, tp_rank)?;
        check_shapes(cfg)?;
        let local = slices.local_config(cfg);
        gpu.bind()?;
        gpu.load_gemv(opts.precision)?;
        let weights = weights(&mut gpu, &slices)?;
        let tp = comm.map(|comm| shard::CudaTp { comm: std::sync::Arc::new(comm), slices });
        Self::assemble(&local, gpu, weights, opts, tp)
    }

    fn assemble(
        cfg: &LlamaConfig,
        gpu: Gpu,
        weights: DeviceWeights,
        opts: CudaOptions,
        tp: Option<shard::CudaTp>,
    ) -> Result<Self, BackendError> {
        check_shapes(cfg)?;
        let kv_layout =
            KvLayout { block_size: opts.kv.block_size, layers: cfg.num_hidden_layers, kv_dim: cfg.kv_dim() };
        let kv_bytes = opts.kv.num_blocks * kv_layout.block_elems() * opts.precision.bytes();
        let kv = gpu.alloc(kv_bytes)?;
        let rope = Rope::new(&gpu, cfg)?;
        let gpu_cc = gpu.compute_capability;
        tracing::info!(
            device = %format!("cuda:{} ({}, sm_{}{})", gpu.ordinal, gpu.name, gpu.compute_capability.0, gpu.compute_capability.1),
            precision = ?opts.precision,
            weights_mib = weights.bytes() / (1 << 20),
            kv_mib = kv_bytes / (1 << 20),
            "CUDA backend ready"
        );
        Ok(CudaBackend {
            cfg: cfg.clone(),
            gpu,
            prec: opts.precision,
            weights,
            rope,
            geom: opts.kv,
            kv_layout,
            kv,
            scratch: forward::Scratch::default(),
            tensor_cores: gpu_cc.0 >= 8 && std::env::var("SHELFSERVE_CUDA_MMA_ATTENTION").map_or(true, |v| v != "0"),
            prefill_tiles: plan::MmaTiles::parse(std::env::var("SHELFSERVE_CUDA_PREFILL_TILES").ok().as_deref())?,
            streaming_decode: std::env::var("SHELFSERVE_CUDA_STREAM_DECODE").map_or(true, |v| v != "0"),
            cuda_graphs: std::env::var("SHELFSERVE_CUDA_GRAPHS").map_or(true, |v| v != "0"),
            graphs: std::collections::HashMap::new(),
            page_mover: None,
            tp,
            device_sampling: std::env::var("SHELFSERVE_CUDA_SAMPLING").map_or(true, |v| v != "0"),
            sampler: sample::DeviceSampler::default(),
            tap_layers: Vec::new(),
            last_taps: None,
        })
    }

    pub fn weight_bytes(&self) -> usize {
        self.weights.bytes()
    }

    pub fn kv_bytes(&self) -> usize {
        self.kv.bytes()
    }

    /// Use (or not) the tensor-core prefill attention kernel where it applies.
    pub fn set_tensor_core_attention(&mut self, on: bool) {
        self.tensor_cores = on && self.gpu.compute_capability.0 >= 8;
    }

    /// Replay decode steps as CUDA graphs (or not).
    pub fn set_cuda_graphs(&mut self, on: bool) {
        self.cuda_graphs = on;
        self.graphs.clear();
    }

    /// Sample on the device in `forward_sampled` (or leave sampling to the host).
    pub fn set_device_sampling(&mut self, on: bool) {
        self.device_sampling = on;
    }

    pub fn device_sampling(&self) -> bool {
        self.device_sampling
    }

    /// `Backend::forward_sampled` with device sampling on: run the step, then sample each spec'd
    /// sequence's last logits row on the device.
    fn forward_and_sample(
        &mut self,
        batch: &[SeqStep<'_>],
        specs: &[Option<DeviceSampleSpec<'_>>],
    ) -> Result<Vec<Option<Sampled>>, BackendError> {
        validate_batch(batch, self.geom)?;
        check_sample_specs(batch, specs)?;
        self.gpu.bind()?;
        let vocab = self.cfg.vocab_size;
        let out = self
            .forward_device(batch)
            .and_then(|(layout, logits)| self.sampler.draw(&mut self.gpu, logits, vocab, &layout.offsets, specs));
        self.abort_group_on(out)
    }

    pub fn precision(&self) -> Precision {
        self.prec
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Device name as the driver reports it.
    pub fn gpu_name(&self) -> &str {
        &self.gpu.name
    }

    /// Run a step and pick every logits row's greedy token on the device: only ids come back.
    pub fn forward_greedy(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<u32>, BackendError> {
        validate_batch(batch, self.geom)?;
        self.gpu.bind()?;
        let vocab = self.cfg.vocab_size;
        let out = self
            .forward_device(batch)
            .and_then(|(layout, logits)| self.sampler.argmax(&mut self.gpu, logits, vocab, layout.logit_rows.len()));
        self.abort_group_on(out)
    }

    /// Run a step and wait for it, keeping nothing (the other ranks of a tensor-parallel group:
    /// rank 0 reads the logits).
    pub fn forward_follow(&mut self, batch: &[SeqStep<'_>]) -> Result<(), BackendError> {
        validate_batch(batch, self.geom)?;
        self.gpu.bind()?;
        let out = self.forward_device(batch).and_then(|_| self.gpu.sync());
        self.abort_group_on(out)
    }

    /// A rank that fails mid-step releases the others from the collective they wait in.
    fn abort_group_on<T>(&self, out: Result<T, BackendError>) -> Result<T, BackendError> {
        if let (Err(e), Some(tp)) = (&out, &self.tp) {
            tp.comm.abort(&e.to_string());
        }
        out
    }

    /// Wait for queued device work (benchmarks time with this).
    pub fn synchronize(&self) -> Result<(), BackendError> {
        self.gpu.sync()
    }

    /// Fill the whole KV store with seeded random values (benchmarks decode at long contexts
    /// without prefilling them first; the values only need to be finite and not zero).
    pub fn fill_kv_random(&mut self, seed: u64) -> Result<(), BackendError> {
        self.gpu.bind()?;
        let f = self.gpu.func("llama", &format!("fill_uniform_{}", self.prec.suffix()))?;
        let (p, n, c, s) = (self.kv.ptr(), (self.kv.bytes() / self.prec.bytes()) as i64, 0f32, 1f32);
        crate::launch!(self.gpu, f, gpu::cfg((8192, 1), 256, 0), &p, &n, &seed, &c, &s)?;
        self.gpu.sync()
    }

    /// Measure the device's ceilings: device-to-device copy bandwidth (bytes read + written per
    /// second) over `bytes`, and a bf16 `n×n×n` GEMM rate (FLOP/s), each the median of `reps`.
    pub fn measure_ceilings(&mut self, bytes: usize, n: usize, reps: usize) -> Result<(f64, f64), BackendError> {
        forward::measure_ceilings(&mut self.gpu, bytes, n, reps)
    }

    /// Mean seconds of one all-reduce and one all-gather of `bytes` per rank (f32), over `reps`
    /// of each after a warm-up, timed on this rank's stream; every rank of the group must call
    /// this at once with the same arguments. `None` unsharded.
    pub fn time_collectives(&mut self, bytes: usize, reps: usize) -> Result<Option<(f64, f64)>, BackendError> {
        let Some(tp) = &self.tp else { return Ok(None) };
        self.gpu.bind()?;
        let count = (bytes / 4).max(1);
        let send = self.gpu.alloc(count * 4)?;
        let recv = self.gpu.alloc(count * 4 * tp.comm.world_size())?;
        let err = |e: crate::parallel::CollectiveError| BackendError::Device(format!("tensor parallel: {e}"));
        let time = |gather: bool| -> Result<f64, BackendError> {
            let run = |n: usize| -> Result<(), BackendError> {
                for _ in 0..n {
                    // SAFETY: `send` holds `count` f32 and `recv` `count · world` f32, both alive
                    // until the synchronize below.
                    unsafe {
                        if gather {
                            tp.comm.all_gather_f32(send.ptr(), recv.ptr(), count)
                        } else {
                            tp.comm.all_reduce_sum_f32(send.ptr(), count)
                        }
                    }
                    .map_err(err)?;
                }
                self.gpu.sync()
            };
            run(5)?;
            let t0 = std::time::Instant::now();
            run(reps)?;
            Ok(t0.elapsed().as_secs_f64() / reps.max(1) as f64)
        };
        let reduce = time(false)?;
        let gather = time(true)?;
        Ok(Some((reduce, gather)))
    }
}

/// One spec per sequence, and every sampled sequence has a logits row to sample.
fn check_sample_specs(batch: &[SeqStep<'_>], specs: &[Option<DeviceSampleSpec<'_>>]) -> Result<(), BackendError> {
    if specs.len() != batch.len() {
        return Err(BackendError::InvalidStep(format!(
            "{} sampling specs for a batch of {} sequences",
            specs.len(),
            batch.len()
        )));
    }
    if let Some(i) = (0..batch.len()).find(|&i| specs[i].is_some() && batch[i].logits_rows == 0) {
        return Err(BackendError::InvalidStep(format!("sequence {i} is to be sampled but asks for no logits rows")));
    }
    Ok(())
}

/// Shapes the kernels support, refused up front with a reason.
fn check_shapes(c: &LlamaConfig) -> Result<(), BackendError> {
    let bad = |msg: String| Err(BackendError::Unavailable { device: "cuda".into(), reason: msg });
    if c.head_dim > 256 || !c.head_dim.is_multiple_of(2) {
        return bad(format!("head_dim {} is not supported by the attention kernels (even, at most 256)", c.head_dim));
    }
    if c.num_key_value_heads == 0 || !c.num_attention_heads.is_multiple_of(c.num_key_value_heads) {
        return bad(format!(
            "{} attention heads are not a multiple of {} kv heads",
            c.num_attention_heads, c.num_key_value_heads
        ));
    }
    Ok(())
}

impl Backend for CudaBackend {
    fn device_name(&self) -> String {
        format!("cuda:{}", self.gpu.ordinal)
    }

    fn kv_geometry(&self) -> KvGeometry {
        self.geom
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }

    fn forward(&mut self, batch: &[SeqStep<'_>]) -> Result<StepLogits, BackendError> {
        validate_batch(batch, self.geom)?;
        self.gpu.bind()?;
        let out = self.forward_device(batch).and_then(|(layout, logits)| {
            let v = self.cfg.vocab_size;
            let mut data = vec![0f32; layout.logit_rows.len() * v];
            self.gpu.copy_dtoh(&mut data, logits)?;
            Ok(StepLogits { vocab: v, data, offsets: layout.offsets })
        });
        self.abort_group_on(out)
    }

    fn forward_sampled(
        &mut self,
        batch: &[SeqStep<'_>],
        specs: &[Option<DeviceSampleSpec<'_>>],
    ) -> Result<Option<Vec<Option<Sampled>>>, BackendError> {
        if !self.device_sampling {
            return Ok(None);
        }
        self.forward_and_sample(batch, specs).map(Some)
    }

    fn abort_collectives(&self, reason: &str) {
        if let Some(tp) = &self.tp {
            tp.comm.abort(reason);
        }
    }

    fn set_hidden_taps(&mut self, layers: &[usize]) -> Result<(), BackendError> {
        check_tap_layers(layers, self.cfg.num_hidden_layers)?;
        if layers != self.tap_layers.as_slice() {
            // Captured decode graphs copy the old layers' rows (or none).
            self.graphs.clear();
        }
        self.tap_layers = layers.to_vec();
        self.last_taps = None;
        Ok(())
    }

    fn take_hidden_taps(&mut self) -> Option<HiddenTaps> {
        self.last_taps.take()
    }

    // The inherent methods (forward.rs) do the device copies; these make them the trait's.
    fn device_free_memory(&self) -> Option<u64> {
        self.gpu.ctx.mem_get_info().ok().map(|(free, _)| free as u64)
    }

    fn kv_block_bytes(&self) -> usize {
        CudaBackend::kv_block_bytes(self)
    }

    fn resize_kv(&mut self, num_blocks: usize) -> Result<bool, BackendError> {
        if num_blocks == 0 || self.tp.is_some() {
            return Ok(false);
        }
        let bytes = num_blocks * self.kv_layout.block_elems() * self.prec.bytes();
        // Free first: the old and new stores need not fit side by side. Graphs captured so far
        // point into the old store.
        self.graphs.clear();
        self.kv = self.gpu.alloc(0)?;
        match self.gpu.alloc(bytes) {
            Ok(kv) => {
                self.kv = kv;
                self.geom.num_blocks = num_blocks;
                Ok(true)
            }
            Err(e) => {
                self.kv = self.gpu.alloc(self.geom.num_blocks * self.kv_layout.block_elems() * self.prec.bytes())?;
                Err(e)
            }
        }
    }

    fn read_kv_blocks(&mut self, blocks: &[u32]) -> Result<Vec<u8>, BackendError> {
        CudaBackend::read_kv_blocks(self, blocks)
    }

    fn read_kv_blocks_then(&mut self, blocks: &[u32], done: crate::backend::PageImageDone) {
        if let Err(e) = CudaBackend::read_kv_blocks_then(self, blocks, done) {
            // `done` went with the failed start; the page is then simply not spilled.
            tracing::warn!(error = %e, "could not start copying an evicted page out");
        }
    }

    fn finish_kv_reads(&mut self) -> Result<(), BackendError> {
        self.page_mover.as_ref().map_or(Ok(()), page_mover::PageMover::flush)
    }

    fn write_kv_blocks(&mut self, blocks: &[u32], image: &[u8]) -> Result<(), BackendError> {
        CudaBackend::write_kv_blocks(self, blocks, image)
    }
}

#[cfg(test)]
mod tests {
    use super::sample::is_plain_greedy;
    use super::*;
    use crate::sampling::SamplingParams;

    #[test]
    fn only_greedy_without_logit_changes_or_logprobs_takes_the_argmax_path() {
        let plain = SamplingParams::default();
        let spec = |p| is_plain_greedy(&DeviceSampleSpec { params: p, penalties: None, step: 0 });
        assert!(spec(&plain));
        let changed = [
            SamplingParams { temperature: 0.7, ..plain.clone() },
            SamplingParams { logit_bias: vec![(3, 5.0)], ..plain.clone() },
            SamplingParams { logprobs: Some(0), ..plain.clone() },
            SamplingParams { repetition_penalty: 1.1, ..plain.clone() },
            SamplingParams { presence_penalty: 0.5, ..plain.clone() },
            SamplingParams { frequency_penalty: -0.5, ..plain.clone() },
        ];
        for p in &changed {
            assert!(!spec(p), "{p:?}");
        }
    }

    #[test]
    fn sample_specs_must_match_the_batch_and_have_a_row() {
        let p = SamplingParams::default();
        let spec = DeviceSampleSpec { params: &p, penalties: None, step: 0 };
        let step =
            |rows| SeqStep { tokens: &[1, 2], start_pos: 0, block_table: &[0], logits_rows: rows, state_slot: 0 };
        let batch = [step(1), step(0)];
        assert!(check_sample_specs(&batch, &[Some(spec), None]).is_ok());
        let e = check_sample_specs(&batch, &[Some(spec)]).unwrap_err().to_string();
        assert!(e.contains("1 sampling specs for a batch of 2"), "{e}");
        let e = check_sample_specs(&batch, &[None, Some(spec)]).unwrap_err().to_string();
        assert!(e.contains("sequence 1 is to be sampled but asks for no logits rows"), "{e}");
    }
}
