//! The DFlash / DFlash2 block drafter (`--speculative dflash:PATH`): a small model that reads the
//! target's hidden states at a few layers and proposes a whole block of tokens in one non-causal
//! pass (the architecture of z-lab's DFlash; `model` says what it computes). PATH is a directory
//! with the drafter's `config.json` and `model.safetensors`; the target's embedding and output head
//! are shared, loaded from the target's own weights.
//!
//! Per sequence it keeps the accepted tokens and a cache of context keys/values built from the
//! target's tapped states (`HiddenChunk`s, which arrive with the accepted tokens: the target ran
//! every token but the newest). The newest token is the block's anchor. Positions whose states
//! never arrived (a prefix-cache hit skips the target's forward there) are simply missing from the
//! context: drafts get worse, never wrong, since verification is exact.
//!
//! Owns: the drafter's weights, its per-sequence context caches. Must not touch: the target's
//! memory or the scheduler's decisions.

pub mod config;
pub mod model;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use self::config::DFlashConfig;
use self::model::{BlockSeq, ContextCache, DFlashModel, DFlashWeights, SharedHead};
use super::{DraftError, DraftRequest, DraftSource, HiddenChunk, SeqId};
use crate::backend::cpu::linear::{CpuLinear, LinearScratch};
pub use crate::backend::cuda::dflash::DFlashCudaOptions;
use crate::backend::cuda::dflash::{BlockRequest, CudaDFlash};
use crate::model::llama::LlamaSpec;
use crate::model::quant::simd_available;
use crate::model::{ModelBundle, WeightSource};

/// Where a DFlash drafter for a target on `device` runs its forward pass: on the target's GPU
/// when the target runs on one CUDA device (a tensor-parallel target keeps it on the CPU), unless
/// `SHELFSERVE_DFLASH_DEVICE=cpu` asks for the CPU (comparisons).
pub fn device_for(device: &crate::generate::ResolvedDevice) -> Option<DFlashCudaOptions> {
    let cpu_asked = std::env::var("SHELFSERVE_DFLASH_DEVICE").is_ok_and(|v| v == "cpu");
    device_choice(device, cpu_asked)
}

fn device_choice(device: &crate::generate::ResolvedDevice, cpu_asked: bool) -> Option<DFlashCudaOptions> {
    (device.kind == crate::generate::ResolvedKind::Cuda && device.tensor_parallel == 1 && !cpu_asked)
        .then_some(DFlashCudaOptions { ordinal: device.cuda_ordinal, precision: device.cuda_precision })
}

#[derive(Debug, Default)]
struct DFlashSeq {
    tokens: Vec<u32>,
    /// Target states not yet projected into `cache`.
    pending: Vec<HiddenChunk>,
    cache: ContextCache,
}

pub struct DFlashDrafter {
    model: DFlashModel,
    seqs: HashMap<SeqId, DFlashSeq>,
    pool: Arc<rayon::ThreadPool>,
    scratch: LinearScratch,
    name: &'static str,
    /// The target's final norm and its last layer: HF's `hidden_states` (what DFlash drafters are
    /// trained on) holds the last layer's state after the final norm, unlike the others.
    target_norm: Vec<f32>,
    target_eps: f32,
    target_last_layer: usize,
    /// The forward pass on the target's GPU (`backend::cuda::dflash`), when the target runs
    /// there; the CPU `model` then only supplies the config (its context caches keep positions).
    cuda: Option<CudaDFlash>,
}

impl DFlashDrafter {
    /// Open the drafter at `path` for `target` (a llama-family bundle: its embedding and output
    /// head are shared), on `threads` CPU threads (0 = every core).
    pub fn open(path: &str, target: &ModelBundle, threads: usize) -> Result<Self, DraftError> {
        Self::open_on(path, target, threads, None)
    }

    /// [`DFlashDrafter::open`], with the forward pass on the target's GPU when `cuda` is given
    /// (DFlash; a DFlash2 drafter stays on the CPU, whose selector has no CUDA kernels).
    pub fn open_on(
        path: &str,
        target: &ModelBundle,
        threads: usize,
        cuda: Option<DFlashCudaOptions>,
    ) -> Result<Self, DraftError> {
        let fail = |msg: String| DraftError::DraftModel { path: path.to_string(), msg };
        let dir = Path::new(path);
        if !dir.is_dir() {
            return Err(fail(
                "not a directory (a DFlash drafter is a directory with config.json and model.safetensors)".into(),
            ));
        }
        let cfg = DFlashConfig::read(dir)?;
        let weights = crate::model::hf::SafetensorsWeights::open_dir(dir).map_err(|e| fail(e.to_string()))?;
        Self::from_parts_on(path, cfg, &weights, target, threads, cuda)
    }

    pub fn from_parts(
        path: &str,
        cfg: DFlashConfig,
        weights: &dyn WeightSource,
        target: &ModelBundle,
        threads: usize,
    ) -> Result<Self, DraftError> {
        Self::from_parts_on(path, cfg, weights, target, threads, None)
    }

    pub fn from_parts_on(
        path: &str,
        cfg: DFlashConfig,
        weights: &dyn WeightSource,
        target: &ModelBundle,
        threads: usize,
        cuda: Option<DFlashCudaOptions>,
    ) -> Result<Self, DraftError> {
        let fail = |msg: String| DraftError::DraftModel { path: path.to_string(), msg };
        let t = &target.config;
        if crate::model::glm5_next::MODEL_TYPES.contains(&t.model_type.as_str()) {
            return Err(fail(format!(
                "a DFlash drafter for a `{}` target is not supported yet (llama-family targets only)",
                t.model_type
            )));
        }
        if t.hidden_size != cfg.hidden_size || t.vocab_size != cfg.vocab_size {
            return Err(fail(format!(
                "drafter hidden size {} / vocabulary {} do not match the target's {} / {}",
                cfg.hidden_size, cfg.vocab_size, t.hidden_size, t.vocab_size
            )));
        }
        if let Some(l) = cfg.target_layer_ids.iter().find(|&&l| l >= t.num_hidden_layers) {
            return Err(fail(format!("it taps target layer {l}, but the target has {} layers", t.num_hidden_layers)));
        }
        let spec = LlamaSpec::new(t);
        let tw = target.weights.as_ref();
        let embed = CpuLinear::load(tw, &spec.embed.replace(".weight", ""), t.vocab_size, t.hidden_size, false)
            .map_err(|e| fail(format!("the target's embedding: {e}")))?;
        let lm_head = if t.tie_word_embeddings {
            None
        } else {
            Some(
                CpuLinear::load(tw, &spec.lm_head.name, t.vocab_size, t.hidden_size, false)
                    .map_err(|e| fail(format!("the target's output head: {e}")))?,
            )
        };
        let target_norm = crate::backend::cpu::linear::load_vector(tw, &spec.final_norm, t.hidden_size)
            .map_err(|e| fail(format!("the target's final norm: {e}")))?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("dflash-{i}"))
            .build()
            .map_err(|e| fail(format!("thread pool: {e}")))?;
        let cuda = match cuda {
            Some(_) if cfg.dflash2.is_some() => {
                tracing::info!(path, "DFlash2 drafter on the CPU (its candidate selector has no CUDA kernels)");
                None
            }
            Some(opts) => Some(CudaDFlash::open(&cfg, weights, target, opts).map_err(|e| fail(e.to_string()))?),
            None => None,
        };
        let weights = pool.install(|| DFlashWeights::load(&cfg, weights)).map_err(|e| fail(e.to_string()))?;
        let name = if cfg.dflash2.is_some() { "dflash2" } else { "dflash" };
        tracing::info!(
            path,
            kind = name,
            layers = cfg.num_layers,
            block = cfg.block_size,
            taps = ?cfg.target_layer_ids,
            device = if cuda.is_some() { "cuda" } else { "cpu" },
            "DFlash drafter loaded"
        );
        Ok(DFlashDrafter {
            model: DFlashModel { cfg, weights, head: SharedHead { embed, lm_head }, simd: simd_available() },
            seqs: HashMap::new(),
            pool: Arc::new(pool),
            scratch: LinearScratch::default(),
            name,
            target_norm,
            target_eps: t.rms_norm_eps,
            target_last_layer: t.num_hidden_layers - 1,
            cuda,
        })
    }

    pub fn config(&self) -> &DFlashConfig {
        &self.model.cfg
    }

    /// Bytes of the drafter's own weights (the shared head not counted).
    pub fn weight_bytes(&self) -> u64 {
        self.model.weights.bytes() as u64
    }

    /// Rows of `chunk` the drafter can use: its tapped layers picked out of the chunk's columns,
    /// positions from `from` on. `None` when the chunk lacks a layer the drafter reads.
    fn features(&self, chunk: &HiddenChunk, from: usize) -> Option<(Vec<f32>, Vec<usize>)> {
        let h = self.model.cfg.hidden_size;
        let cols: Option<Vec<usize>> =
            self.model.cfg.target_layer_ids.iter().map(|l| chunk.layers.iter().position(|x| x == l)).collect();
        let cols = cols?;
        let width = chunk.layers.len() * h;
        if width == 0 || !chunk.data.len().is_multiple_of(width) {
            return None;
        }
        let mut data = Vec::new();
        let mut positions = Vec::new();
        for (i, row) in chunk.data.chunks_exact(width).enumerate() {
            let pos = chunk.start_pos + i;
            if pos < from {
                continue;
            }
            positions.push(pos);
            for (&c, &layer) in cols.iter().zip(&self.model.cfg.target_layer_ids) {
                let at = data.len();
                data.extend_from_slice(&row[c * h..(c + 1) * h]);
                if layer == self.target_last_layer {
                    let x = &mut data[at..];
                    let ms = x.iter().map(|v| v * v).sum::<f32>() / h as f32;
                    let r = 1.0 / (ms + self.target_eps).sqrt();
                    x.iter_mut().zip(&self.target_norm).for_each(|(v, g)| *v = *v * r * g);
                }
            }
        }
        Some((data, positions))
    }

    /// Project every pending chunk of the requested sequences into their context caches, in one
    /// batched pass. Rows at or past a sequence's anchor are not context yet and are dropped.
    fn ingest(&mut self, seqs: &[SeqId]) -> Result<(), crate::backend::BackendError> {
        let mut feats = Vec::new();
        let mut positions = Vec::new();
        let mut owners = Vec::new();
        for &id in seqs {
            let (pending, anchor, mut from) = match self.seqs.get_mut(&id) {
                Some(s) => (std::mem::take(&mut s.pending), s.tokens.len().saturating_sub(1), s.cache.next_position()),
                None => continue,
            };
            let (mut f, mut p) = (Vec::new(), Vec::new());
            for chunk in &pending {
                let Some((data, pos)) = self.features(chunk, from) else {
                    tracing::warn!(seq = id, "hidden states without the layers the DFlash drafter reads; skipped");
                    continue;
                };
                let width = data.len() / pos.len().max(1);
                for (row, &q) in data.chunks_exact(width.max(1)).zip(&pos) {
                    if q < anchor && q >= from {
                        f.extend_from_slice(row);
                        p.push(q);
                        from = q + 1;
                    }
                }
            }
            if !p.is_empty() {
                feats.push(f);
                positions.push(p);
                owners.push(id);
            }
        }
        if owners.is_empty() {
            return Ok(());
        }
        if let Some(cuda) = self.cuda.as_mut() {
            cuda.add_context(&owners, &feats, &positions)?;
            for (id, p) in owners.iter().zip(positions) {
                if let Some(s) = self.seqs.get_mut(id) {
                    s.cache.positions.extend(p);
                }
            }
            return Ok(());
        }
        let mut caches: Vec<(SeqId, ContextCache)> =
            owners.iter().map(|id| (*id, std::mem::take(&mut self.seqs.get_mut(id).expect("owner").cache))).collect();
        let result = {
            let mut refs: Vec<&mut ContextCache> = caches.iter_mut().map(|(_, c)| c).collect();
            let (model, scratch) = (&self.model, &mut self.scratch);
            self.pool.install(|| model.add_context(&mut refs, &feats, &positions, scratch))
        };
        for (id, cache) in caches {
            if let Some(s) = self.seqs.get_mut(&id) {
                s.cache = cache;
            }
        }
        result
    }

    fn propose_inner(&mut self, requests: &[DraftRequest]) -> Result<Vec<Vec<u32>>, crate::backend::BackendError> {
        let bs = self.model.cfg.block_size;
        let wanted: Vec<usize> = requests
            .iter()
            .map(|r| match self.seqs.get(&r.seq) {
                Some(s) if !s.tokens.is_empty() => r.k.min(bs - 1),
                _ => 0,
            })
            .collect();
        let active: Vec<usize> = (0..requests.len()).filter(|&i| wanted[i] > 0).collect();
        let mut out = vec![Vec::new(); requests.len()];
        if active.is_empty() {
            return Ok(out);
        }
        let ids: Vec<SeqId> = active.iter().map(|&i| requests[i].seq).collect();
        self.ingest(&ids)?;
        if self.cuda.is_some() {
            let blocks: Vec<BlockRequest> =
                active.iter().map(|&i| self.block_request(requests[i].seq, wanted[i])).collect();
            if let Some(cuda) = self.cuda.as_mut() {
                for (&i, d) in active.iter().zip(cuda.propose(&blocks)?) {
                    out[i] = d;
                }
            }
            return Ok(out);
        }
        let blocks: Vec<BlockSeq<'_>> = active
            .iter()
            .map(|&i| {
                let s = &self.seqs[&requests[i].seq];
                BlockSeq {
                    cache: &s.cache,
                    anchor: *s.tokens.last().expect("non-empty"),
                    anchor_pos: s.tokens.len() - 1,
                    rows: wanted[i],
                }
            })
            .collect();
        let (model, scratch) = (&self.model, &mut self.scratch);
        let results = self.pool.install(|| -> Result<Vec<Vec<u32>>, crate::backend::BackendError> {
            let rows = model.block_logits(&blocks, scratch)?;
            blocks.iter().zip(rows).map(|(b, r)| model.choose(b.anchor, &r.logits, &r.hidden, scratch)).collect()
        })?;
        for (&i, drafts) in active.iter().zip(results) {
            out[i] = drafts;
        }
        Ok(out)
    }

    /// A sequence's next block for the CUDA pass (the sequence has tokens).
    fn block_request(&self, seq: SeqId, rows: usize) -> BlockRequest {
        let s = &self.seqs[&seq];
        BlockRequest { seq, anchor: *s.tokens.last().expect("non-empty"), anchor_pos: s.tokens.len() - 1, rows }
    }

    /// Whether the forward pass runs on the GPU.
    pub fn on_cuda(&self) -> bool {
        self.cuda.is_some()
    }

    /// The draft logits of one sequence's next block (tests compare them with the reference).
    pub fn block_logits(&mut self, seq: SeqId, rows: usize) -> Option<Vec<f32>> {
        self.ingest(&[seq]).ok()?;
        if self.cuda.is_some() {
            self.seqs.get(&seq).filter(|s| !s.tokens.is_empty())?;
            let b = self.block_request(seq, rows);
            return self.cuda.as_mut()?.block_logits(&[b]).ok();
        }
        let s = self.seqs.get(&seq).filter(|s| !s.tokens.is_empty())?;
        let b = BlockSeq { cache: &s.cache, anchor: *s.tokens.last()?, anchor_pos: s.tokens.len() - 1, rows };
        let (model, scratch) = (&self.model, &mut self.scratch);
        let mut out = self.pool.install(|| model.block_logits(&[b], scratch)).ok()?;
        Some(out.pop()?.logits)
    }
}

impl DraftSource for DFlashDrafter {
    fn name(&self) -> &'static str {
        self.name
    }

    fn hidden_taps(&self) -> Vec<usize> {
        self.model.cfg.target_layer_ids.clone()
    }

    fn extend(&mut self, seq: SeqId, tokens: &[u32]) {
        self.seqs.entry(seq).or_default().tokens.extend_from_slice(tokens);
    }

    fn extend_hidden(&mut self, seq: SeqId, chunks: Vec<HiddenChunk>) {
        self.seqs.entry(seq).or_default().pending.extend(chunks);
    }

    fn propose(&mut self, seq: SeqId, k: usize) -> Vec<u32> {
        self.propose_batch(&[DraftRequest { seq, k }]).pop().unwrap_or_default()
    }

    fn propose_batch(&mut self, requests: &[DraftRequest]) -> Vec<Vec<u32>> {
        match self.propose_inner(requests) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "DFlash drafter failed; these sequences get no drafts this step");
                vec![Vec::new(); requests.len()]
            }
        }
    }

    fn forget(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
        if let Some(cuda) = self.cuda.as_mut() {
            cuda.forget(seq);
        }
    }

    fn truncate(&mut self, seq: SeqId, len: usize) {
        let kvd = self.model.cfg.num_kv_heads * self.model.cfg.head_dim;
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.tokens.truncate(len);
            s.cache.truncate(len, kvd);
            s.pending.retain(|c| c.start_pos < len);
            if let Some(cuda) = self.cuda.as_mut() {
                cuda.truncate(seq, s.cache.positions.len());
            }
        }
    }

    fn len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.tokens.len())
    }

    fn sequences(&self) -> usize {
        self.seqs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::Precision;
    use crate::generate::{ResolvedDevice, ResolvedKind};

    #[test]
    fn the_drafter_runs_on_the_gpu_of_a_single_gpu_cuda_target_only() {
        let gpu = ResolvedDevice {
            kind: ResolvedKind::Cuda,
            cuda_ordinal: 2,
            cuda_precision: Precision::F32,
            ..ResolvedDevice::cpu(4)
        };
        assert_eq!(device_choice(&gpu, false), Some(DFlashCudaOptions { ordinal: 2, precision: Precision::F32 }));
        assert_eq!(device_choice(&gpu, true), None, "SHELFSERVE_DFLASH_DEVICE=cpu");
        assert_eq!(device_choice(&ResolvedDevice { tensor_parallel: 2, ..gpu }, false), None, "tensor parallel");
        assert_eq!(device_choice(&ResolvedDevice::cpu(4), false), None);
    }
}
