//! Direct, single-sequence use of a backend, without the serving engine: teacher-forced scoring
//! and a generation loop for the `generate`, `score` and `kld` commands, benches and golden
//! tests. It lays one sequence out over the whole KV store (blocks in order); the serving path
//! gets its block tables from the KV pool instead.

use crate::backend::cpu::{CpuBackend, CpuOptions, TpCpuBackend};
use crate::backend::cuda::{CudaOptions, Precision, TpCudaBackend};
use crate::backend::{Backend, BackendError, EmbeddedRows, ImageEmbedding, KvGeometry, SeqStep, StepLogits};
use crate::media::ProcessedImage;
use crate::model::glm5_next::vision::{image_spans, MultimodalIds};
use crate::model::{ModelBundle, ModelError};
use crate::sampling::{sample, PenaltyState, Sampled, SamplingParams};
use crate::spec::step::sample_with_drafts;
use crate::spec::{DraftSource, HiddenChunk};

/// Prefill chunk used when nothing else is said: large enough to amortise weight reads, small
/// enough to bound scratch memory.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("{needed} tokens (prompt {prompt} + max_tokens {max_tokens}) exceed the context of {limit} tokens")]
    TooLong { needed: usize, prompt: usize, max_tokens: usize, limit: usize },
}

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Ids that end generation (not included in the output).
    pub eos_token_ids: Vec<u32>,
    pub prefill_chunk: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    /// The callback asked to stop (e.g. a stop string matched).
    Callback,
}

#[derive(Clone, Debug)]
pub struct GenerateOutput {
    pub tokens: Vec<Sampled>,
    pub finish: FinishReason,
}

impl GenerateOutput {
    pub fn ids(&self) -> Vec<u32> {
        self.tokens.iter().map(|s| s.token).collect()
    }
}

/// KV geometry for one sequence of up to `max_tokens` positions.
pub fn single_sequence_geometry(max_tokens: usize, block_size: usize) -> KvGeometry {
    KvGeometry { block_size, num_blocks: max_tokens.max(1).div_ceil(block_size), state_slots: 1 }
}

/// Build the CPU backend for a model.
pub fn cpu_backend(bundle: &ModelBundle, threads: usize, kv: KvGeometry) -> Result<CpuBackend, ModelError> {
    CpuBackend::new(&bundle.config, bundle.weights.as_ref(), CpuOptions { threads, kv, kv_precision: None })
}

/// What a loaded CPU backend reports for the startup log.
#[derive(Clone, Copy, Debug)]
pub struct LoadedBackendInfo {
    pub weight_bytes: usize,
    pub kv_bytes: usize,
    pub threads: usize,
}

/// Build the CPU backend for whichever architecture the bundle holds (`glm5_next` or the llama
/// family).
pub fn any_cpu_backend(
    bundle: &ModelBundle,
    threads: usize,
    kv: KvGeometry,
) -> Result<(Box<dyn Backend>, LoadedBackendInfo), ModelError> {
    any_cpu_backend_tp(bundle, threads, 1, kv)
}

/// [`any_cpu_backend`] split over `tensor_parallel` ranks on CPU threads (`expert_parallel`:
/// `glm5_next`'s routed experts split whole, one set per rank).
pub fn any_cpu_backend_tp(
    bundle: &ModelBundle,
    threads: usize,
    tensor_parallel: usize,
    kv: KvGeometry,
) -> Result<(Box<dyn Backend>, LoadedBackendInfo), ModelError> {
    any_cpu_backend_group(bundle, threads, tensor_parallel, false, kv)
}

/// [`any_cpu_backend_tp`] with the expert-parallel choice.
pub fn any_cpu_backend_group(
    bundle: &ModelBundle,
    threads: usize,
    tensor_parallel: usize,
    expert_parallel: bool,
    kv: KvGeometry,
) -> Result<(Box<dyn Backend>, LoadedBackendInfo), ModelError> {
    let is_glm5 = crate::model::glm5_next::MODEL_TYPES.contains(&bundle.config.model_type.as_str());
    if tensor_parallel > 1 {
        if is_glm5 {
            let cfg = crate::model::glm5_next::read_config(bundle.weights.origin())?;
            let b = crate::backend::cpu::glm5_next::Glm5TpBackend::new(
                cfg,
                bundle.weights.as_ref(),
                threads,
                kv,
                tensor_parallel,
                expert_parallel,
            )?;
            let info =
                LoadedBackendInfo { weight_bytes: b.weight_bytes(), kv_bytes: b.kv_bytes(), threads: b.threads() };
            return Ok((Box::new(b), info));
        }
        let opts = CpuOptions { threads, kv, kv_precision: None };
        let b = TpCpuBackend::new(&bundle.config, bundle.weights.as_ref(), opts, tensor_parallel)?;
        let info = LoadedBackendInfo { weight_bytes: b.weight_bytes(), kv_bytes: b.kv_bytes(), threads: b.threads() };
        return Ok((Box::new(b), info));
    }
    if crate::model::glm5_next::MODEL_TYPES.contains(&bundle.config.model_type.as_str()) {
        let cfg = crate::model::glm5_next::read_config(bundle.weights.origin())?;
        let b = crate::backend::cpu::glm5_next::Glm5Backend::new(cfg, bundle.weights.as_ref(), threads, kv)?;
        let info = LoadedBackendInfo { weight_bytes: b.weight_bytes(), kv_bytes: b.kv_bytes(), threads: b.threads() };
        return Ok((Box::new(b), info));
    }
    let b = cpu_backend(bundle, threads, kv)?;
    let info = LoadedBackendInfo { weight_bytes: b.weight_bytes(), kv_bytes: b.kv_bytes(), threads: b.threads() };
    Ok((Box::new(b), info))
}

/// Which device to run on, as given by `--device`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Cuda,
    /// CUDA when a device is present, else the CPU.
    Auto,
}

impl std::str::FromStr for DeviceKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(DeviceKind::Cpu),
            "cuda" => Ok(DeviceKind::Cuda),
            "auto" => Ok(DeviceKind::Auto),
            other => Err(format!("--device must be cpu, cuda or auto, not `{other}`")),
        }
    }
}

/// Device choice plus what each backend needs to be built.
#[derive(Clone, Copy, Debug)]
pub struct DeviceSelection {
    pub kind: DeviceKind,
    /// CPU worker threads (0 = one per core).
    pub threads: usize,
    pub cuda_ordinal: usize,
    pub cuda_precision: Precision,
    /// Tensor-parallel ranks (1 = unsharded).
    pub tensor_parallel: usize,
    /// MoE models: each rank holds whole experts (`E / N`) instead of a slice of every expert.
    pub expert_parallel: bool,
}

impl Default for DeviceSelection {
    fn default() -> Self {
        DeviceSelection {
            kind: DeviceKind::Cpu,
            threads: 0,
            cuda_ordinal: 0,
            cuda_precision: Precision::Bf16,
            tensor_parallel: 1,
            expert_parallel: false,
        }
    }
}

impl DeviceSelection {
    /// Settle `auto` by asking the CUDA driver: CUDA when it sees the device, else the CPU,
    /// logging which and why. Call once where the engine or backend is built and hand the
    /// [`ResolvedDevice`] to everything that depends on the device.
    pub fn resolve(&self) -> ResolvedDevice {
        self.resolve_with(crate::backend::cuda::device_count)
    }

    /// [`DeviceSelection::resolve`] with the device count from `probe` (called for `auto` only,
    /// at most once): the seam tests count through.
    pub fn resolve_with(&self, probe: impl FnOnce() -> Result<usize, String>) -> ResolvedDevice {
        let kind = match self.kind {
            DeviceKind::Cpu => ResolvedKind::Cpu,
            DeviceKind::Cuda => ResolvedKind::Cuda,
            DeviceKind::Auto => match probe() {
                Ok(n) if n > self.cuda_ordinal => {
                    tracing::info!(devices = n, "device auto: using cuda:{} (CUDA device found)", self.cuda_ordinal);
                    ResolvedKind::Cuda
                }
                Ok(n) => {
                    tracing::info!("device auto: using the CPU (the CUDA driver sees {n} device(s))");
                    ResolvedKind::Cpu
                }
                Err(reason) => {
                    tracing::info!("device auto: using the CPU ({reason})");
                    ResolvedKind::Cpu
                }
            },
        };
        ResolvedDevice {
            kind,
            threads: self.threads,
            cuda_ordinal: self.cuda_ordinal,
            cuda_precision: self.cuda_precision,
            tensor_parallel: self.tensor_parallel,
            expert_parallel: self.expert_parallel,
        }
    }
}

/// The device a backend really runs on (`auto` settled).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResolvedKind {
    Cpu,
    Cuda,
}

/// A [`DeviceSelection`] with `auto` settled: backends are built from it and prices that depend on
/// the device read it, so the driver is probed (and "device auto" logged) once per engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResolvedDevice {
    pub kind: ResolvedKind,
    /// CPU worker threads (0 = one per core).
    pub threads: usize,
    pub cuda_ordinal: usize,
    /// Weights and KV precision on CUDA (ignored on the CPU).
    pub cuda_precision: Precision,
    /// Tensor-parallel ranks (1 = unsharded).
    pub tensor_parallel: usize,
    /// MoE experts split whole over the ranks (see [`DeviceSelection::expert_parallel`]).
    pub expert_parallel: bool,
}

impl ResolvedDevice {
    /// The CPU backend with `threads` workers, unsharded.
    pub fn cpu(threads: usize) -> Self {
        ResolvedDevice {
            kind: ResolvedKind::Cpu,
            threads,
            cuda_ordinal: 0,
            cuda_precision: Precision::Bf16,
            tensor_parallel: 1,
            expert_parallel: false,
        }
    }

    /// What decides the bytes of a KV block image on this device, for the pool identity that
    /// salts page hashes (and so names spill files): a page written under one layout is never
    /// read under another. CUDA stores K and V in its precision (bf16 or f32); the CPU backend's
    /// KV follows the weights (f16 or f32), which the model fingerprint already covers, so the
    /// CUDA precision knob does not enter a CPU identity. Each tensor-parallel rank's blocks hold
    /// its own KV heads.
    pub fn kv_layout(&self, block_size: usize) -> String {
        let device = match self.kind {
            ResolvedKind::Cpu => "cpu".to_string(),
            ResolvedKind::Cuda => format!("cuda/{:?}", self.cuda_precision).to_lowercase(),
        };
        // Expert parallelism sums the FFN's partial results in another order than a split of
        // every expert: the same state, rounded differently, so a different identity.
        match (self.tensor_parallel, self.expert_parallel) {
            (0 | 1, _) => format!("{device}/block{block_size}"),
            (tp, false) => format!("{device}/block{block_size}/tp{tp}"),
            (tp, true) => format!("{device}/block{block_size}/tp{tp}/ep"),
        }
    }
}

/// Build the backend on the resolved device, for a model, with KV geometry `kv`. Call on the
/// thread that will use it (device contexts belong to their thread).
pub fn make_backend(
    bundle: &ModelBundle,
    sel: &ResolvedDevice,
    kv: KvGeometry,
) -> Result<Box<dyn Backend>, BackendError> {
    let started = std::time::Instant::now();
    let b: Box<dyn Backend> = match sel.kind {
        ResolvedKind::Cuda => {
            if crate::model::glm5_next::MODEL_TYPES.contains(&bundle.config.model_type.as_str()) {
                if sel.tensor_parallel > 1 {
                    return Err(BackendError::Unavailable {
                        device: format!("cuda:{}", sel.cuda_ordinal),
                        reason: format!(
                            "tensor parallelism is implemented for the llama family only, not `{}` yet; use --tp 1",
                            bundle.config.model_type
                        ),
                    });
                }
                let cfg = crate::model::glm5_next::read_config(bundle.weights.origin())?;
                let b = crate::backend::cuda::glm5_next::Glm5CudaBackend::new(
                    cfg,
                    bundle.weights.as_ref(),
                    sel.cuda_ordinal,
                    kv,
                    sel.cuda_precision,
                )?;
                tracing::info!(
                    weights_mib = b.weight_bytes() / (1 << 20),
                    kv_mib = b.kv_bytes() / (1 << 20),
                    kv_tokens = kv.capacity_tokens(),
                    secs = format!("{:.2}", started.elapsed().as_secs_f64()),
                    "model loaded on {}",
                    b.device_name()
                );
                return Ok(Box::new(b));
            }
            let opts = CudaOptions { ordinal: sel.cuda_ordinal, kv, precision: sel.cuda_precision };
            let b = TpCudaBackend::new(&bundle.config, bundle.weights.as_ref(), opts, sel.tensor_parallel.max(1))?;
            tracing::info!(
                tensor_parallel = b.world_size(),
                weights_mib = b.weight_bytes() / (1 << 20),
                kv_mib = b.kv_bytes() / (1 << 20),
                kv_tokens = kv.capacity_tokens(),
                secs = format!("{:.2}", started.elapsed().as_secs_f64()),
                "model loaded on {}",
                b.device_name()
            );
            Box::new(b)
        }
        ResolvedKind::Cpu => {
            let (b, info) = any_cpu_backend_group(bundle, sel.threads, sel.tensor_parallel, sel.expert_parallel, kv)?;
            tracing::info!(
                weights_mib = info.weight_bytes / (1 << 20),
                kv_mib = info.kv_bytes / (1 << 20),
                kv_tokens = kv.capacity_tokens(),
                threads = info.threads,
                tensor_parallel = sel.tensor_parallel,
                secs = format!("{:.2}", started.elapsed().as_secs_f64()),
                "model loaded on cpu"
            );
            b
        }
    };
    Ok(b)
}

/// Builds one rank's backend on the thread that will use it (its executor's).
pub type BackendMaker = Box<dyn FnOnce() -> Result<Box<dyn Backend>, BackendError> + Send>;

/// One backend builder per tensor-parallel rank of the resolved device (one executor per rank): the
/// group's communicators are made here (CPU: an in-process group; CUDA: NCCL over devices
/// `cuda_ordinal..cuda_ordinal + N`), each rank's weights are loaded by its own builder. At one
/// rank, the single builder is [`make_backend`].
pub fn rank_backend_makers(
    bundle: std::sync::Arc<ModelBundle>,
    sel: &ResolvedDevice,
    kv: KvGeometry,
) -> Result<Vec<BackendMaker>, BackendError> {
    let world = sel.tensor_parallel.max(1);
    if world == 1 {
        let sel = *sel;
        return Ok(vec![Box::new(move || make_backend(&bundle, &sel, kv))]);
    }
    let cfg = &bundle.config;
    let refuse =
        |reason: String| BackendError::Unavailable { device: format!("{:?}", sel.kind).to_lowercase(), reason };
    if crate::model::glm5_next::MODEL_TYPES.contains(&cfg.model_type.as_str()) {
        if sel.kind == ResolvedKind::Cuda {
            return Err(refuse(format!(
                "tensor parallelism for `{}` runs on CPU ranks only so far; use --tp 1 on cuda",
                cfg.model_type
            )));
        }
        // One executor holds the whole group: a verification commit, a state snapshot or a
        // restored page must reach every rank's KDA state at once, and only that executor's
        // rank 0 samples (see `backend::cpu::glm5_next::tp`). The split is checked before loading.
        let g = crate::model::glm5_next::read_config(bundle.weights.origin())?;
        crate::backend::cpu::glm5_next::Glm5TpBackend::check(&g, world, sel.expert_parallel).map_err(refuse)?;
        let sel = *sel;
        return Ok(vec![Box::new(move || make_backend(&bundle, &sel, kv))]);
    }
    if sel.expert_parallel {
        return Err(refuse(format!(
            "--enable-expert-parallel needs a mixture-of-experts model, not `{}`",
            cfg.model_type
        )));
    }
    // The plan is checked before anything is loaded, so a bad size fails at once with its number.
    let rank0 = crate::parallel::TpRank::new(0, world).map_err(|e| refuse(e.to_string()))?;
    crate::parallel::LlamaShard::of_model(rank0, cfg).map_err(|e| refuse(e.to_string()))?;
    let mut makers: Vec<BackendMaker> = Vec::with_capacity(world);
    match sel.kind {
        ResolvedKind::Cuda => {
            let ordinals = crate::backend::cuda::group_devices(sel.cuda_ordinal, world)?;
            for comm in crate::backend::cuda::nccl_group(&ordinals)? {
                let (bundle, opts) =
                    (bundle.clone(), CudaOptions { ordinal: comm.ordinal(), kv, precision: sel.cuda_precision });
                makers.push(Box::new(move || {
                    let b = crate::backend::cuda::load_rank(&bundle.config, bundle.weights.as_ref(), opts, comm)?;
                    Ok(Box::new(b) as Box<dyn Backend>)
                }));
            }
        }
        ResolvedKind::Cpu => {
            let total = if sel.threads == 0 {
                std::thread::available_parallelism().map_or(1, |n| n.get())
            } else {
                sel.threads
            };
            let opts = CpuOptions { threads: (total / world).max(1), kv, kv_precision: None };
            let comms = crate::parallel::LocalComm::group(world, crate::backend::cpu::COLLECTIVE_TIMEOUT)
                .map_err(|e| refuse(e.to_string()))?;
            for (rank, comm) in comms.into_iter().enumerate() {
                let bundle = bundle.clone();
                let rank = crate::parallel::TpRank::new(rank, world).map_err(|e| refuse(e.to_string()))?;
                makers.push(Box::new(move || {
                    let shard = crate::backend::cpu::TpShard { rank, comm: std::sync::Arc::new(comm) };
                    let b = CpuBackend::new_shard(&bundle.config, bundle.weights.as_ref(), opts, Some(shard))?;
                    tracing::info!(
                        rank = rank.rank,
                        world,
                        weights_mib = b.weight_bytes() / (1 << 20),
                        threads = b.threads(),
                        "tensor-parallel rank loaded on cpu"
                    );
                    Ok(Box::new(b) as Box<dyn Backend>)
                }));
            }
        }
    }
    Ok(makers)
}

/// A boxed backend is a backend (the CLI and executor pick the device at run time).
impl<B: Backend + ?Sized> Backend for Box<B> {
    fn device_name(&self) -> String {
        (**self).device_name()
    }

    fn kv_geometry(&self) -> KvGeometry {
        (**self).kv_geometry()
    }

    fn vocab_size(&self) -> usize {
        (**self).vocab_size()
    }

    fn forward(&mut self, batch: &[SeqStep<'_>]) -> Result<StepLogits, BackendError> {
        (**self).forward(batch)
    }

    fn forward_sampled(
        &mut self,
        batch: &[SeqStep<'_>],
        specs: &[Option<crate::backend::DeviceSampleSpec<'_>>],
    ) -> Result<Option<Vec<Option<crate::sampling::Sampled>>>, BackendError> {
        (**self).forward_sampled(batch, specs)
    }

    fn forward_verify(&mut self, batch: &[SeqStep<'_>], verify: &[bool]) -> Result<StepLogits, BackendError> {
        (**self).forward_verify(batch, verify)
    }

    fn commit_verified(&mut self, slot: u32, kept: usize) -> Result<(), BackendError> {
        (**self).commit_verified(slot, kept)
    }

    fn image_token_id(&self) -> Option<u32> {
        (**self).image_token_id()
    }

    fn encode_image(&mut self, pixel_values: &[f32], grid: [usize; 3]) -> Result<ImageEmbedding, BackendError> {
        (**self).encode_image(pixel_values, grid)
    }

    fn encode_images(
        &mut self,
        images: &[crate::backend::ImageInput<'_>],
    ) -> Vec<Result<ImageEmbedding, BackendError>> {
        (**self).encode_images(images)
    }

    fn forward_embedded(
        &mut self,
        batch: &[SeqStep<'_>],
        verify: &[bool],
        embeds: &[Vec<EmbeddedRows<'_>>],
    ) -> Result<StepLogits, BackendError> {
        (**self).forward_embedded(batch, verify, embeds)
    }

    fn kv_block_bytes(&self) -> usize {
        (**self).kv_block_bytes()
    }

    fn device_free_memory(&self) -> Option<u64> {
        (**self).device_free_memory()
    }

    fn read_kv_blocks_then(&mut self, blocks: &[u32], done: crate::backend::PageImageDone) {
        (**self).read_kv_blocks_then(blocks, done)
    }

    fn finish_kv_reads(&mut self) -> Result<(), BackendError> {
        (**self).finish_kv_reads()
    }

    fn resize_kv(&mut self, num_blocks: usize) -> Result<bool, BackendError> {
        (**self).resize_kv(num_blocks)
    }

    fn read_kv_blocks(&mut self, blocks: &[u32]) -> Result<Vec<u8>, BackendError> {
        (**self).read_kv_blocks(blocks)
    }

    fn write_kv_blocks(&mut self, blocks: &[u32], image: &[u8]) -> Result<(), BackendError> {
        (**self).write_kv_blocks(blocks, image)
    }

    fn state_slot_bytes(&self) -> usize {
        (**self).state_slot_bytes()
    }

    fn read_state_slot(&mut self, slot: u32) -> Result<Vec<u8>, BackendError> {
        (**self).read_state_slot(slot)
    }

    fn write_state_slot(&mut self, slot: u32, image: &[u8]) -> Result<(), BackendError> {
        (**self).write_state_slot(slot, image)
    }

    fn snapshots_inside_step(&self) -> bool {
        (**self).snapshots_inside_step()
    }

    fn mark_state_snapshots(&mut self, slot: u32, after_tokens: &[usize]) -> Result<(), BackendError> {
        (**self).mark_state_snapshots(slot, after_tokens)
    }

    fn take_state_snapshots(&mut self, slot: u32) -> Vec<Vec<u8>> {
        (**self).take_state_snapshots(slot)
    }

    fn abort_collectives(&self, reason: &str) {
        (**self).abort_collectives(reason)
    }

    fn set_hidden_taps(&mut self, layers: &[usize]) -> Result<(), BackendError> {
        (**self).set_hidden_taps(layers)
    }

    fn take_hidden_taps(&mut self) -> Option<crate::backend::HiddenTaps> {
        (**self).take_hidden_taps()
    }
}

/// The parts of `encoded` images (placeholder spans and embeddings) that a chunk of `len` rows
/// from position `lo` covers, as that chunk's embedded rows.
fn image_runs(encoded: &[(std::ops::Range<usize>, ImageEmbedding)], lo: usize, len: usize) -> Vec<EmbeddedRows<'_>> {
    let hi = lo + len;
    encoded
        .iter()
        .filter(|(s, _)| s.start < hi && s.end > lo)
        .map(|(s, e)| {
            let (a, b, d) = (s.start.max(lo), s.end.min(hi), e.hidden);
            EmbeddedRows { first_row: a - lo, hidden: d, data: &e.data[(a - s.start) * d..(b - s.start) * d] }
        })
        .collect()
}

/// One sequence at a time over a backend.
pub struct Runner<B: Backend> {
    pub backend: B,
    table: Vec<u32>,
}

impl<B: Backend> Runner<B> {
    pub fn new(backend: B) -> Self {
        let n = backend.kv_geometry().num_blocks as u32;
        Runner { backend, table: (0..n).collect() }
    }

    pub fn capacity(&self) -> usize {
        self.backend.kv_geometry().capacity_tokens()
    }

    /// Teacher-forced logits for every position of `ids`, `[ids.len(), vocab]` row-major,
    /// computed in prefill chunks of `chunk` tokens.
    pub fn score(&mut self, ids: &[u32], chunk: usize) -> Result<Vec<f32>, GenerateError> {
        if ids.is_empty() {
            return Err(GenerateError::EmptyPrompt);
        }
        self.check_fits(ids.len(), 0)?;
        let mut out = Vec::with_capacity(ids.len() * self.backend.vocab_size());
        for (ci, c) in ids.chunks(chunk.max(1)).enumerate() {
            let step = SeqStep {
                tokens: c,
                start_pos: ci * chunk.max(1),
                block_table: &self.table,
                logits_rows: c.len(),
                state_slot: 0,
            };
            out.extend(self.backend.forward(&[step])?.data);
        }
        Ok(out)
    }

    /// [`Self::score`] for ids that hold each image's placeholder tokens already expanded (one
    /// run per image, as transformers' processor writes them): the images go through the
    /// backend's vision tower and their embeddings replace the placeholder rows, a prefill
    /// chunk boundary may fall inside an image. Placeholder runs and images must match in
    /// number and length.
    pub fn score_with_images(
        &mut self,
        ids: &[u32],
        chunk: usize,
        images: &[ProcessedImage],
    ) -> Result<Vec<f32>, GenerateError> {
        if images.is_empty() {
            return self.score(ids, chunk);
        }
        if ids.is_empty() {
            return Err(GenerateError::EmptyPrompt);
        }
        self.check_fits(ids.len(), 0)?;
        let encoded = self.encode_images(ids, images)?;
        let chunk = chunk.max(1);
        let mut out = Vec::with_capacity(ids.len() * self.backend.vocab_size());
        for (ci, c) in ids.chunks(chunk).enumerate() {
            let lo = ci * chunk;
            let step =
                SeqStep { tokens: c, start_pos: lo, block_table: &self.table, logits_rows: c.len(), state_slot: 0 };
            let runs = image_runs(&encoded, lo, c.len());
            out.extend(self.backend.forward_embedded(&[step], &[], &[runs])?.data);
        }
        Ok(out)
    }

    /// Run the vision tower on `images`, one per run of image placeholders in `ids` (in order,
    /// already expanded), checking that runs and images match in number and length.
    fn encode_images(
        &mut self,
        ids: &[u32],
        images: &[ProcessedImage],
    ) -> Result<Vec<(std::ops::Range<usize>, ImageEmbedding)>, GenerateError> {
        let invalid = |m: String| GenerateError::Backend(BackendError::InvalidStep(m));
        let Some(image_token_id) = self.backend.image_token_id() else {
            return Err(invalid("this model has no vision tower, so it takes no images".into()));
        };
        let mm = MultimodalIds { image_token_id, video_start_token_id: None, video_end_token_id: None };
        let spans = image_spans(ids, &mm);
        if spans.len() != images.len() {
            return Err(invalid(format!(
                "the ids hold {} image placeholder runs for {} images",
                spans.len(),
                images.len()
            )));
        }
        let mut encoded = Vec::with_capacity(images.len());
        for (k, (img, span)) in images.iter().zip(spans).enumerate() {
            let e = self.backend.encode_image(&img.pixel_values, img.grid)?;
            if e.rows != span.len() {
                return Err(invalid(format!(
                    "image {k} has {} placeholder tokens in the ids, but its grid {:?} makes {} embeddings",
                    span.len(),
                    img.grid,
                    e.rows
                )));
            }
            encoded.push((span, e));
        }
        Ok(encoded)
    }

    fn check_fits(&self, prompt: usize, max_tokens: usize) -> Result<(), GenerateError> {
        let needed = prompt + max_tokens;
        if needed > self.capacity() {
            return Err(GenerateError::TooLong { needed, prompt, max_tokens, limit: self.capacity() });
        }
        Ok(())
    }

    /// Prefill `prompt`, then decode until EOS, `max_tokens`, or `on_token` returns false.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_token: impl FnMut(&Sampled) -> bool,
    ) -> Result<GenerateOutput, GenerateError> {
        self.generate_drafted(prompt, opts, None, on_token)
    }

    /// [`Runner::generate`] with speculative decoding: each step verifies the last token plus up
    /// to `k` tokens proposed by `drafter` in one forward, keeps the accepted ones (rolling any
    /// recurrent state back past the rest) and emits them in order, so EOS, `max_tokens` and the
    /// callback cut an accepted run exactly where the un-drafted loop would stop. The output is
    /// the un-drafted one: bitwise under greedy, in distribution when sampling.
    pub fn generate_drafted(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        drafter: Option<(&mut dyn DraftSource, usize)>,
        on_token: impl FnMut(&Sampled) -> bool,
    ) -> Result<GenerateOutput, GenerateError> {
        self.generate_with_images(prompt, &[], opts, drafter, on_token)
    }

    /// [`Runner::generate_drafted`] for a prompt whose ids hold each image's placeholder tokens
    /// already expanded (as [`Runner::score_with_images`] takes them): the images' embeddings
    /// replace those rows in the prefill.
    pub fn generate_with_images(
        &mut self,
        prompt: &[u32],
        images: &[ProcessedImage],
        opts: &GenerateOptions,
        mut drafter: Option<(&mut dyn DraftSource, usize)>,
        mut on_token: impl FnMut(&Sampled) -> bool,
    ) -> Result<GenerateOutput, GenerateError> {
        if prompt.is_empty() {
            return Err(GenerateError::EmptyPrompt);
        }
        self.check_fits(prompt.len(), opts.max_tokens)?;
        let encoded = if images.is_empty() { Vec::new() } else { self.encode_images(prompt, images)? };
        let chunk = opts.prefill_chunk.max(1);
        let mut logits = Vec::new();
        // A drafter that reads the target's hidden states gets those of every token kept.
        let taps = drafter.as_ref().map(|(d, _)| d.hidden_taps()).unwrap_or_default();
        self.backend.set_hidden_taps(&taps)?;
        let mut prompt_hidden = Vec::new();
        for (ci, c) in prompt.chunks(chunk).enumerate() {
            let last = (ci + 1) * chunk >= prompt.len();
            let step = SeqStep {
                tokens: c,
                start_pos: ci * chunk,
                block_table: &self.table,
                logits_rows: usize::from(last),
                state_slot: 0,
            };
            logits = if encoded.is_empty() {
                self.backend.forward(&[step])?.data
            } else {
                self.backend.forward_embedded(&[step], &[], &[image_runs(&encoded, ci * chunk, c.len())])?.data
            };
            if let Some(t) = self.backend.take_hidden_taps() {
                prompt_hidden.push(HiddenChunk::from_taps(&t, 0, ci * chunk, c.len()));
            }
        }
        let mut penalties = PenaltyState::new(prompt);
        let mut out = Vec::new();
        let mut pos = prompt.len();
        if let Some((d, k)) = drafter.as_mut() {
            const SEQ: u64 = 0;
            d.forget(SEQ);
            d.extend(SEQ, prompt);
            d.extend_hidden(SEQ, prompt_hidden);
            let mut emitted = sample_with_drafts(&[&logits], &[], &opts.sampling, Some(&penalties), 0);
            loop {
                let mut last = None;
                for s in emitted.tokens {
                    if out.len() >= opts.max_tokens {
                        return Ok(GenerateOutput { tokens: out, finish: FinishReason::Length });
                    }
                    if opts.eos_token_ids.contains(&s.token) {
                        return Ok(GenerateOutput { tokens: out, finish: FinishReason::Stop });
                    }
                    penalties.push_output(s.token);
                    d.extend(SEQ, &[s.token]);
                    let keep_going = on_token(&s);
                    last = Some(s.token);
                    out.push(s);
                    if !keep_going {
                        return Ok(GenerateOutput { tokens: out, finish: FinishReason::Callback });
                    }
                }
                if out.len() >= opts.max_tokens {
                    return Ok(GenerateOutput { tokens: out, finish: FinishReason::Length });
                }
                // Drafts never run past max_tokens (the step's last emitted token is the bonus).
                let draft = d.propose(SEQ, (*k).min(opts.max_tokens - out.len() - 1));
                let mut tokens = vec![last.expect("verification emits at least one token")];
                tokens.extend(&draft);
                let step = SeqStep {
                    tokens: &tokens,
                    start_pos: pos,
                    block_table: &self.table,
                    logits_rows: tokens.len(),
                    state_slot: 0,
                };
                let result = self.backend.forward_verify(&[step], &[!draft.is_empty()])?;
                let rows: Vec<&[f32]> = result.rows(0).collect();
                emitted = sample_with_drafts(&rows, &draft, &opts.sampling, Some(&penalties), out.len() as u64);
                if !draft.is_empty() {
                    self.backend.commit_verified(0, emitted.accepted + 1)?;
                }
                if let Some(t) = self.backend.take_hidden_taps() {
                    d.extend_hidden(SEQ, vec![HiddenChunk::from_taps(&t, 0, pos, emitted.accepted + 1)]);
                }
                pos += emitted.accepted + 1;
            }
        }
        loop {
            if out.len() >= opts.max_tokens {
                return Ok(GenerateOutput { tokens: out, finish: FinishReason::Length });
            }
            let s = sample(&logits, &opts.sampling, &penalties, out.len() as u64);
            if opts.eos_token_ids.contains(&s.token) {
                return Ok(GenerateOutput { tokens: out, finish: FinishReason::Stop });
            }
            penalties.push_output(s.token);
            let keep_going = on_token(&s);
            let token = s.token;
            out.push(s);
            if !keep_going {
                return Ok(GenerateOutput { tokens: out, finish: FinishReason::Callback });
            }
            if out.len() >= opts.max_tokens {
                return Ok(GenerateOutput { tokens: out, finish: FinishReason::Length });
            }
            let step =
                SeqStep { tokens: &[token], start_pos: pos, block_table: &self.table, logits_rows: 1, state_slot: 0 };
            logits = self.backend.forward(&[step])?.data;
            pos += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Resolves `sel` with a probe that counts its calls and reports `devices`.
    fn resolve_counted(sel: DeviceSelection, devices: Result<usize, String>) -> (ResolvedDevice, usize) {
        let mut calls = 0;
        let resolved = sel.resolve_with(|| {
            calls += 1;
            devices
        });
        (resolved, calls)
    }

    #[test]
    fn auto_probes_the_driver_exactly_once_and_explicit_kinds_never() {
        let auto = DeviceSelection { kind: DeviceKind::Auto, ..Default::default() };
        assert_eq!(resolve_counted(auto, Ok(2)), (ResolvedDevice { kind: ResolvedKind::Cuda, ..resolved_cpu() }, 1));
        assert_eq!(resolve_counted(auto, Ok(0)).0.kind, ResolvedKind::Cpu);
        assert_eq!(resolve_counted(auto, Err("no libcuda".into())), (resolved_cpu(), 1));
        // The device asked for must exist: cuda:1 on a one-device machine is the CPU.
        let second = DeviceSelection { cuda_ordinal: 1, ..auto };
        assert_eq!(resolve_counted(second, Ok(1)).0.kind, ResolvedKind::Cpu);
        assert_eq!(resolve_counted(second, Ok(2)).0.kind, ResolvedKind::Cuda);
        for (kind, want) in [(DeviceKind::Cpu, ResolvedKind::Cpu), (DeviceKind::Cuda, ResolvedKind::Cuda)] {
            let (r, calls) = resolve_counted(DeviceSelection { kind, ..Default::default() }, Ok(8));
            assert_eq!((r.kind, calls), (want, 0), "{kind:?} needs no probe");
        }
    }

    fn resolved_cpu() -> ResolvedDevice {
        ResolvedDevice::cpu(0)
    }

    #[test]
    fn the_resolution_carries_every_other_knob_unchanged() {
        let sel = DeviceSelection {
            kind: DeviceKind::Auto,
            threads: 3,
            cuda_ordinal: 0,
            cuda_precision: Precision::F32,
            tensor_parallel: 2,
            expert_parallel: true,
        };
        let (r, _) = resolve_counted(sel, Ok(1));
        assert_eq!(
            r,
            ResolvedDevice {
                kind: ResolvedKind::Cuda,
                threads: 3,
                cuda_ordinal: 0,
                cuda_precision: Precision::F32,
                tensor_parallel: 2,
                expert_parallel: true
            }
        );
        // The settled kind is what the drafter's verification price reads.
        use crate::spec::adaptive::{verify_row_cost_for, CPU_VERIFY_ROW_COST, CUDA_VERIFY_ROW_COST};
        assert_eq!(verify_row_cost_for(r.kind), CUDA_VERIFY_ROW_COST);
        assert_eq!(verify_row_cost_for(resolve_counted(sel, Ok(0)).0.kind), CPU_VERIFY_ROW_COST);
    }

    #[test]
    fn kv_layout_names_what_decides_the_block_bytes() {
        let cpu = ResolvedDevice::cpu(2);
        let cuda_bf16 = ResolvedDevice { kind: ResolvedKind::Cuda, ..cpu };
        let cuda_f32 = ResolvedDevice { cuda_precision: Precision::F32, ..cuda_bf16 };
        let layouts: Vec<String> = [cpu, cuda_bf16, cuda_f32].iter().map(|d| d.kv_layout(16)).collect();
        assert_eq!(layouts, ["cpu/block16", "cuda/bf16/block16", "cuda/f32/block16"]);
        // Same configuration, same identity; the CUDA precision knob does not change CPU bytes.
        assert_eq!(cpu.kv_layout(16), ResolvedDevice::cpu(8).kv_layout(16));
        assert_eq!(cpu.kv_layout(16), ResolvedDevice { cuda_precision: Precision::F32, ..cpu }.kv_layout(16));
        assert_ne!(cpu.kv_layout(16), cpu.kv_layout(32), "block size");
        assert_eq!(ResolvedDevice { tensor_parallel: 2, ..cuda_bf16 }.kv_layout(16), "cuda/bf16/block16/tp2");
        let ep = ResolvedDevice { tensor_parallel: 2, expert_parallel: true, ..cpu };
        assert_eq!(ep.kv_layout(16), "cpu/block16/tp2/ep", "expert parallel rounds the state differently");
        // `auto` gets the identity of the device it settled on, not one shared by both.
        let auto = DeviceSelection { kind: DeviceKind::Auto, ..Default::default() };
        assert_eq!(auto.resolve_with(|| Ok(0)).kv_layout(16), "cpu/block16");
        assert_eq!(auto.resolve_with(|| Ok(1)).kv_layout(16), "cuda/bf16/block16");
    }
}
