//! `Backend` for `glm5_next` on one NVIDIA GPU: the weights (`weights`), the paged per-token
//! cache and the recurrent-state slots in device memory, laid out exactly as
//! `model::glm5_next::cache_layout` says (f32 records), so block and slot images are the same
//! bytes the CPU backend reads and writes, and a forward pass (`forward`) of the kernels in
//! `cuda/glm5.cu` plus cuBLAS GEMMs. Validated against the CPU backend (`tests/gpu_validate_glm5.rs`).
//!
//! Owns the device memory of this model; makes no scheduling decisions and never touches the CPU
//! backend. Step planning (rows, slot checks) is shared with the CPU through
//! `backend::glm5_steps`.
//!
//! Draft verification keeps, as on the CPU, the whole slot image after every token but the last
//! of a verified sequence (in device memory, one buffer per step), and `commit_verified` copies
//! the accepted one back on the device.

mod forward;
mod graph;
mod mla;
mod moe;
mod synthetic;
pub mod vision;
pub mod weights;

use std::sync::Arc;

use super::gpu::{DevBuf, Gpu, Precision};
use crate::backend::{
    validate_batch, validate_kv_image, Backend, BackendError, DeviceSampleSpec, EmbeddedRows, ImageEmbedding,
    KvGeometry, SeqStep, StepLogits,
};
use crate::model::glm5_next::cache_layout::CacheLayout;
use crate::model::glm5_next::Glm5Config;
use crate::model::{ModelError, WeightSource};
use crate::sampling::Sampled;

/// A slot's states after each token of a verification step but the last: `tokens − 1` slot
/// images starting `offset` f32 into `images` (shared by the step's verified sequences).
struct DeviceCheckpoints {
    images: Arc<DevBuf>,
    offset: usize,
    start_pos: usize,
    tokens: usize,
}

/// A slot's page-end snapshots of the last step: images `index[i]` (each `slot_stride` f32) of
/// the buffer at `offset`, in the order they were marked.
struct DeviceSnapshots {
    images: Arc<DevBuf>,
    offset: usize,
    index: Vec<usize>,
}

pub struct Glm5CudaBackend {
    cfg: Glm5Config,
    gpu: Gpu,
    prec: Precision,
    weights: weights::Glm5DeviceWeights,
    /// What a packed matrix is dequantized into for prefill-sized products (`quant::matmul`):
    /// the largest one's size, allocated at load; `None` when nothing is packed.
    dequant: Option<super::gpu::DevBuf>,
    /// The vision tower, when the checkpoint has one (`vision.rs`).
    vision: Option<vision::DeviceTower>,
    layout: CacheLayout,
    geom: KvGeometry,
    /// Paged per-token records, `num_blocks · block_size · token_stride` f32.
    kv: DevBuf,
    /// Recurrent-state slots, `state_slots · slot_stride` f32.
    state: DevBuf,
    /// Per slot, the position its state has reached (`None` after a snapshot was written).
    slot_pos: Vec<Option<usize>>,
    checkpoints: Vec<Option<DeviceCheckpoints>>,
    /// Per slot, the token counts after which the next step keeps the state (`mark_state_snapshots`).
    marks: Vec<Vec<usize>>,
    /// Per slot, the snapshots its last step kept, until `take_state_snapshots`.
    snapshots: Vec<Option<DeviceSnapshots>>,
    scratch: forward::Scratch,
    /// Per-layer timings and expert counts of the steps run while profiling (`bench`).
    profile: Option<StepProfile>,
    /// Host seconds spent queueing steps' launches (`step_device` up to its return, no waiting),
    /// summed until `take_enqueue_secs`: next to a step's wall time it says whether decode is
    /// bound by the launches or by the device.
    enqueue_secs: f64,
    /// Sample on the device (`forward_sampled`) so only token ids cross to the host; off with
    /// `SHELFSERVE_CUDA_SAMPLING=0`, as for llama.
    device_sampling: bool,
    sampler: super::sample::DeviceSampler,
    /// bf16 steps with at least this many rows run the MLA attention on the tensor cores (`mla.rs`;
    /// 0: never), from `SHELFSERVE_GLM5_MLA_MMA_MIN_ROWS`.
    mla_mma_min_rows: usize,
    /// Largest step whose packed experts run grouped on the device (`moe.rs`).
    packed_moe_max_rows: usize,
    /// Streams a large step's dense expert GEMMs are spread over, from `SHELFSERVE_GLM5_MOE_STREAMS`.
    moe_lanes: usize,
    /// How a large step's dense bf16 experts run (`moe.rs`), from `SHELFSERVE_GLM5_MOE_GEMM`.
    moe_gemm: moe::MoeGemm,
    /// Decode steps captured as CUDA graphs (`graph.rs`).
    graphs: graph::GraphCache,
}

/// What profiled steps measured, summed over the steps since `start_profile`: each layer's
/// mixer and FFN time (each with its mHC site and expand), the rest (embedding, final norm,
/// LM head and the logits' copy to the host), and per MoE layer the distinct experts routed to.
/// Profiled steps synchronise after every part, so their total exceeds an unprofiled step's.
#[derive(Clone, Debug, Default)]
pub struct StepProfile {
    pub steps: usize,
    pub mixer_secs: Vec<f64>,
    pub ffn_secs: Vec<f64>,
    pub rest_secs: f64,
    /// Per layer (0 for dense FFN layers), summed over steps.
    pub distinct_experts: Vec<usize>,
}

impl Glm5CudaBackend {
    /// Open device `ordinal`, compile the kernels and load `w` in `prec`.
    pub fn new(
        cfg: Glm5Config,
        w: &dyn WeightSource,
        ordinal: usize,
        kv: KvGeometry,
        prec: Precision,
    ) -> Result<Self, BackendError> {
        let bad = |msg: String| BackendError::Model(ModelError::Config { file: w.origin().to_path_buf(), msg });
        if kv.block_size == 0 || kv.num_blocks == 0 {
            return Err(bad("the KV store needs at least one block of at least one token".into()));
        }
        if kv.state_slots == 0 {
            return Err(bad("glm5_next needs at least one recurrent-state slot per live sequence".into()));
        }
        forward::check_shapes(&cfg).map_err(bad)?;
        let mut gpu = Gpu::open(ordinal)?;
        gpu.load_glm5()?;
        let weights = weights::load(&gpu, &cfg, w, prec)?;
        let tower = vision::load(&mut gpu, cfg.hidden_size, w, prec)?;
        Self::assemble(cfg, gpu, weights, tower, kv, prec)
    }

    /// Seeded random weights of `cfg`'s shapes, generated on device `ordinal` (for `bench`: a
    /// full-width layer does not fit the host in f32, which the loader passes through).
    pub fn synthetic(
        cfg: Glm5Config,
        seed: u64,
        ordinal: usize,
        kv: KvGeometry,
        prec: Precision,
        format: Option<crate::model::quant::packed::PackedFormat>,
    ) -> Result<Self, BackendError> {
        let bad = |msg: String| BackendError::InvalidStep(format!("glm5_next bench config: {msg}"));
        if kv.block_size == 0 || kv.num_blocks == 0 || kv.state_slots == 0 {
            return Err(bad("the KV store needs blocks and recurrent-state slots".into()));
        }
        forward::check_shapes(&cfg).map_err(bad)?;
        let mut gpu = Gpu::open(ordinal)?;
        gpu.load_glm5()?;
        let weights = synthetic::synthetic(&mut gpu, &cfg, prec, seed, format)?;
        Self::assemble(cfg, gpu, weights, None, kv, prec)
    }

    fn assemble(
        cfg: Glm5Config,
        mut gpu: Gpu,
        weights: weights::Glm5DeviceWeights,
        tower: Option<vision::DeviceTower>,
        kv: KvGeometry,
        prec: Precision,
    ) -> Result<Self, BackendError> {
        let dequant_elems = weights.max_packed_elems();
        let dequant = if dequant_elems > 0 {
            gpu.load_quant()?;
            Some(gpu.alloc(dequant_elems * prec.bytes())?)
        } else {
            None
        };
        let layout = CacheLayout::new(&cfg);
        let kv_buf = gpu.alloc(4 * kv.num_blocks * kv.block_size * layout.token_stride)?;
        gpu.zero(kv_buf.ptr(), kv_buf.bytes())?;
        let state = gpu.alloc(4 * kv.state_slots * layout.slot_stride)?;
        gpu.zero(state.ptr(), state.bytes())?;
        gpu.sync()?;
        tracing::info!(
            device = %format!("cuda:{} ({})", gpu.ordinal, gpu.name),
            precision = ?prec,
            weights_mib = weights.bytes / (1 << 20),
            vision_mib = tower.as_ref().map_or(0, |t| t.bytes) / (1 << 20),
            kv_mib = (kv_buf.bytes() + state.bytes()) / (1 << 20),
            "glm5_next CUDA backend ready"
        );
        Ok(Glm5CudaBackend {
            cfg,
            gpu,
            prec,
            dequant,
            weights,
            vision: tower,
            layout,
            geom: kv,
            kv: kv_buf,
            state,
            slot_pos: vec![Some(0); kv.state_slots],
            checkpoints: (0..kv.state_slots).map(|_| None).collect(),
            marks: vec![Vec::new(); kv.state_slots],
            snapshots: (0..kv.state_slots).map(|_| None).collect(),
            scratch: forward::Scratch::default(),
            profile: None,
            enqueue_secs: 0.0,
            device_sampling: std::env::var("SHELFSERVE_CUDA_SAMPLING").map_or(true, |v| v != "0"),
            sampler: super::sample::DeviceSampler::default(),
            mla_mma_min_rows: mla::mma_min_rows_from_env()?,
            packed_moe_max_rows: moe::packed_moe_max_rows_from_env()?,
            moe_lanes: moe::moe_lanes_from_env()?,
            moe_gemm: moe::MoeGemm::from_env()?,
            graphs: graph::GraphCache::from_env(),
        })
    }

    /// Fill every cache record with seeded values in ±1 and mark every state slot as written
    /// (`bench` decodes at a context it did not prefill).
    pub fn fill_cache_random(&mut self, seed: u64) -> Result<(), BackendError> {
        self.gpu.bind()?;
        let f = self.gpu.func("llama", "fill_uniform_f32")?;
        let (p, n, center, scale) = (self.kv.ptr(), (self.kv.bytes() / 4) as i64, 0f32, 1f32);
        crate::launch!(self.gpu, f, super::gpu::cfg((8192, 1), 256, 0), &p, &n, &seed, &center, &scale)?;
        self.gpu.sync()?;
        self.slot_pos.iter_mut().for_each(|p| *p = None);
        self.checkpoints.iter_mut().for_each(|c| *c = None);
        Ok(())
    }

    /// Device-to-device copy bandwidth and the bf16 GEMM rate of this device (bytes/s, FLOP/s).
    pub fn measure_ceilings(&mut self, bytes: usize, n: usize, reps: usize) -> Result<(f64, f64), BackendError> {
        super::forward::measure_ceilings(&mut self.gpu, bytes, n, reps)
    }

    pub fn gpu_name(&self) -> &str {
        &self.gpu.name
    }

    /// Replay decode steps from captured CUDA graphs (on unless `SHELFSERVE_CUDA_GRAPHS=0`).
    pub fn set_cuda_graphs(&mut self, on: bool) {
        self.graphs.set_enabled(on);
    }

    /// Steps replayed from a CUDA graph so far.
    pub fn graph_replays(&self) -> u64 {
        self.graphs.replays()
    }

    /// Give the step scratch back to the device (it grows again on demand): `bench` calls it
    /// between its decode and prefill points, whose largest buffers differ.
    pub fn release_scratch(&mut self) -> Result<(), BackendError> {
        self.scratch.clear(&self.gpu)
    }

    /// Profile the next steps (`take_profile` ends it and returns what they measured).
    pub fn start_profile(&mut self) {
        let l = self.cfg.num_hidden_layers;
        self.profile = Some(StepProfile {
            mixer_secs: vec![0.0; l],
            ffn_secs: vec![0.0; l],
            distinct_experts: vec![0; l],
            ..Default::default()
        });
    }

    pub fn take_profile(&mut self) -> Option<StepProfile> {
        self.profile.take()
    }

    /// Host seconds spent queueing step launches since the last call.
    pub fn take_enqueue_secs(&mut self) -> f64 {
        std::mem::take(&mut self.enqueue_secs)
    }

    /// Bytes of the routed experts' weights of one MoE layer, per expert.
    pub fn expert_bytes(&self) -> usize {
        let moe = self.weights.layers.iter().find_map(|l| match &l.ffn {
            weights::Ffn::Moe(m) => Some(m),
            weights::Ffn::Dense(_) => None,
        });
        match moe.map(|m| &m.experts) {
            Some(weights::Experts::PerExpert { pairs, .. }) => {
                pairs.first().map_or(0, |(gu, d)| gu.bytes() + d.bytes())
            }
            _ => 3 * self.cfg.hidden_size * self.cfg.moe_intermediate_size * self.prec.bytes(),
        }
    }

    pub fn config(&self) -> &Glm5Config {
        &self.cfg
    }

    pub fn precision(&self) -> Precision {
        self.prec
    }

    pub fn weight_bytes(&self) -> usize {
        self.weights.bytes + self.vision.as_ref().map_or(0, |t| t.bytes)
    }

    /// Bytes of the paged cache plus the recurrent-state slots.
    pub fn kv_bytes(&self) -> usize {
        self.kv.bytes() + self.state.bytes()
    }

    fn check_slot(&self, slot: u32) -> Result<usize, BackendError> {
        let n = self.geom.state_slots;
        if slot as usize >= n {
            return Err(BackendError::InvalidStep(format!(
                "recurrent-state slot {slot} is out of range, the backend has {n}"
            )));
        }
        Ok(slot as usize)
    }

    fn slot_addr(&self, slot: usize) -> u64 {
        self.state.at(4 * slot * self.layout.slot_stride)
    }
}

fn to_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn from_bytes(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|s| f32::from_le_bytes([s[0], s[1], s[2], s[3]])).collect()
}

impl Backend for Glm5CudaBackend {
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
        self.forward_verify(batch, &[])
    }

    fn forward_verify(&mut self, batch: &[SeqStep<'_>], verify: &[bool]) -> Result<StepLogits, BackendError> {
        validate_batch(batch, self.geom)?;
        self.gpu.bind()?;
        self.step(batch, verify, &[])
    }

    /// The step with its logits kept on the device and sampled there: a greedy step takes the
    /// one-pass argmax, anything else the full sampling pipeline (`backend::cuda::sample`).
    fn forward_sampled(
        &mut self,
        batch: &[SeqStep<'_>],
        specs: &[Option<DeviceSampleSpec<'_>>],
    ) -> Result<Option<Vec<Option<Sampled>>>, BackendError> {
        if !self.device_sampling {
            return Ok(None);
        }
        validate_batch(batch, self.geom)?;
        super::check_sample_specs(batch, specs)?;
        self.gpu.bind()?;
        let out = self.step_device(batch, &[], &[])?;
        let drawn = self.sampler.draw(&mut self.gpu, out.ptr, self.cfg.vocab_size, &out.offsets, specs)?;
        self.end_profile(out.lap)?;
        Ok(Some(drawn))
    }

    fn image_token_id(&self) -> Option<u32> {
        self.vision.as_ref().map(|t| t.ids.image_token_id)
    }

    fn encode_image(&mut self, pixel_values: &[f32], grid: [usize; 3]) -> Result<ImageEmbedding, BackendError> {
        let mut out = self.encode_image_batch(&[(pixel_values, grid)])?;
        out.pop().ok_or_else(|| BackendError::Device("the vision tower returned no embedding".into()))
    }

    /// The step's images through the tower in one batch; when the batch fails, each image
    /// again alone, so that only the bad one fails.
    fn encode_images(
        &mut self,
        images: &[crate::backend::ImageInput<'_>],
    ) -> Vec<Result<ImageEmbedding, BackendError>> {
        let batch: Vec<(&[f32], [usize; 3])> = images.iter().map(|i| (i.pixel_values, i.grid)).collect();
        match self.encode_image_batch(&batch) {
            Ok(all) if all.len() == images.len() => all.into_iter().map(Ok).collect(),
            _ => batch.iter().map(|&(p, g)| self.encode_image(p, g)).collect(),
        }
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
        vision::check_embedded(batch, embeds, self.cfg.hidden_size)?;
        // Rows that take an embedding are looked up as token 0 first (their ids, the image
        // placeholder, may lie outside the text vocabulary), then overwritten on the device.
        let mut tokens: Vec<Vec<u32>> = batch.iter().map(|s| s.tokens.to_vec()).collect();
        for (t, runs) in tokens.iter_mut().zip(embeds) {
            for run in runs {
                t[run.first_row..run.first_row + run.data.len() / run.hidden].fill(0);
            }
        }
        let steps: Vec<SeqStep<'_>> = batch.iter().zip(&tokens).map(|(s, t)| SeqStep { tokens: t, ..*s }).collect();
        validate_batch(&steps, self.geom)?;
        self.gpu.bind()?;
        self.step(&steps, verify, embeds)
    }

    fn commit_verified(&mut self, slot: u32, kept: usize) -> Result<(), BackendError> {
        let s = self.check_slot(slot)?;
        let ck = self.checkpoints[s].take().ok_or_else(|| {
            BackendError::InvalidStep(format!("recurrent-state slot {s} has no verification step to commit"))
        })?;
        if kept == 0 || kept > ck.tokens {
            return Err(BackendError::InvalidStep(format!(
                "cannot keep {kept} tokens of a {}-token verification step",
                ck.tokens
            )));
        }
        if kept < ck.tokens {
            let stride = self.layout.slot_stride;
            self.gpu.bind()?;
            let src = ck.images.at(4 * (ck.offset + (kept - 1) * stride));
            self.gpu.copy_dtod(self.slot_addr(s), src, 4 * stride)?;
            self.gpu.sync()?;
        }
        self.slot_pos[s] = Some(ck.start_pos + kept);
        Ok(())
    }

    fn kv_block_bytes(&self) -> usize {
        4 * self.geom.block_size * self.layout.token_stride
    }

    fn read_kv_blocks(&mut self, blocks: &[u32]) -> Result<Vec<u8>, BackendError> {
        let bb = self.kv_block_bytes();
        validate_kv_image(blocks, blocks.len() * bb, bb, self.geom)?;
        self.gpu.bind()?;
        let mut out = Vec::with_capacity(blocks.len() * bb);
        let mut block = vec![0f32; bb / 4];
        for &b in blocks {
            self.gpu.copy_dtoh(&mut block, self.kv.at(b as usize * bb))?;
            out.extend(to_bytes(&block));
        }
        Ok(out)
    }

    fn write_kv_blocks(&mut self, blocks: &[u32], image: &[u8]) -> Result<(), BackendError> {
        let bb = self.kv_block_bytes();
        validate_kv_image(blocks, image.len(), bb, self.geom)?;
        self.gpu.bind()?;
        for (&b, chunk) in blocks.iter().zip(image.chunks_exact(bb)) {
            self.gpu.copy_htod(self.kv.at(b as usize * bb), &from_bytes(chunk))?;
        }
        Ok(())
    }

    fn state_slot_bytes(&self) -> usize {
        4 * self.layout.slot_stride
    }

    /// The KDA kernels write the slot image after any token of a step (`ckpt_map`), so prefill
    /// chunks may cross prefix-cache page ends.
    fn snapshots_inside_step(&self) -> bool {
        true
    }

    fn mark_state_snapshots(&mut self, slot: u32, after_tokens: &[usize]) -> Result<(), BackendError> {
        let s = self.check_slot(slot)?;
        crate::backend::check_snapshot_offsets(after_tokens)?;
        self.marks[s] = after_tokens.to_vec();
        Ok(())
    }

    fn take_state_snapshots(&mut self, slot: u32) -> Vec<Vec<u8>> {
        let Ok(s) = self.check_slot(slot) else { return Vec::new() };
        self.marks[s].clear();
        let Some(snap) = self.snapshots[s].take() else { return Vec::new() };
        let stride = self.layout.slot_stride;
        if self.gpu.bind().is_err() {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(snap.index.len());
        for &i in &snap.index {
            let mut v = vec![0f32; stride];
            if let Err(e) = self.gpu.copy_dtoh(&mut v, snap.images.at(4 * (snap.offset + i * stride))) {
                tracing::warn!(slot, error = %e, "reading a state snapshot failed; the page is not cached");
                return Vec::new();
            }
            out.push(to_bytes(&v));
        }
        out
    }

    fn read_state_slot(&mut self, slot: u32) -> Result<Vec<u8>, BackendError> {
        let s = self.check_slot(slot)?;
        self.gpu.bind()?;
        let mut v = vec![0f32; self.layout.slot_stride];
        self.gpu.copy_dtoh(&mut v, self.slot_addr(s))?;
        Ok(to_bytes(&v))
    }

    fn write_state_slot(&mut self, slot: u32, image: &[u8]) -> Result<(), BackendError> {
        let s = self.check_slot(slot)?;
        if image.len() != self.state_slot_bytes() {
            return Err(BackendError::InvalidStep(format!(
                "recurrent-state image is {} bytes, a slot holds {}",
                image.len(),
                self.state_slot_bytes()
            )));
        }
        self.gpu.bind()?;
        self.gpu.copy_htod(self.slot_addr(s), &from_bytes(image))?;
        self.slot_pos[s] = None;
        self.checkpoints[s] = None;
        Ok(())
    }
}
