//! One `glm5_next` step on the GPU: embedding into the mHC streams, per layer the mHC site, the
//! mixer (KDA or MLA + DSA), the expand, again for the FFN (dense or MoE), then the final stream
//! mean + norm and the LM head over the rows that need logits. Dense projections are cuBLAS GEMMs
//! (activations cast to the storage type first in bf16); everything else is `cuda/glm5.cu`.
//!
//! MoE (`moe.rs`): steps of at most `MOE_GEMV_MAX_ROWS` token rows group their (token, slot) pairs by expert
//! on the device and run grouped GEMVs that read each used expert's rows once for all its pairs,
//! with no host round trip; larger steps read the routes back, sort the pairs by expert and run
//! one cuBLAS GEMM pair per expert that has tokens (a grouped GEMM done as a loop of GEMMs). Both
//! write each pair's output to its own row, and the combine sums a token's routed outputs in
//! ascending expert order.
//!
//! MLA attention (`mla.rs`): split over positions on the CUDA cores, or all heads of a row at once
//! on the tensor cores (bf16).
//!
//! The mHC kernels and the MoE combine split each row into fixed column chunks so that a batch-1
//! step fills the GPU; the pieces depend on a row's own sizes only, never on the batch.

use super::weights::{DevLinear, Ffn, HyperConnection, Kda, Mixer, Mla, Mlp};
use super::{DeviceCheckpoints, DeviceSnapshots, Glm5CudaBackend};
use crate::backend::cuda::gpu::{cfg, cfg3, grid_for, Precision};
use crate::backend::cuda::quant::{self, MatmulIo};
use crate::backend::glm5_steps::{logits_rows, plan_rows, SeqRows};
use crate::backend::{BackendError, EmbeddedRows, SeqStep, StepLogits};
use crate::launch;
use crate::model::glm5_next::config::{IndexerKind, MixerKind};
use crate::model::glm5_next::Glm5Config;

use std::collections::HashMap;
use std::sync::Arc;

/// Shapes the kernels require, checked once at load; `Err` says which and why.
pub fn check_shapes(c: &Glm5Config) -> Result<(), String> {
    let bad = |msg: String| format!("glm5_next on CUDA: {msg}");
    if c.hc_mult == 0 || c.hc_mult > HC_MAX {
        return Err(bad(format!("hc_mult {} is outside the kernels' 1..=8", c.hc_mult)));
    }
    let kda = c.layer_types.contains(&MixerKind::Kda);
    if kda && (c.linear_head_dim == 0 || c.linear_head_dim > 1024) {
        return Err(bad(format!("the KDA head dim {} is outside the kernel's 1..=1024", c.linear_head_dim)));
    }
    // `dsa_score` keeps a row's indexer query in shared memory (48 KiB without an opt-in).
    let dsa = c.layer_types.contains(&MixerKind::Dsa);
    if dsa && 4 * c.index_n_heads * c.index_head_dim > 48 * 1024 {
        return Err(bad(format!(
            "the indexer query ({} heads of {}) is larger than the selection kernel's 48 KiB",
            c.index_n_heads, c.index_head_dim
        )));
    }
    if c.n_group == 0 || !c.n_routed_experts.is_multiple_of(c.n_group) {
        return Err(bad(format!("{} experts do not split into {} groups", c.n_routed_experts, c.n_group)));
    }
    Ok(())
}

/// Device buffers reused from step to step, grown on demand (by name).
#[derive(Default)]
pub struct Scratch {
    bufs: HashMap<&'static str, crate::backend::cuda::gpu::DevBuf>,
    /// Bumped whenever a buffer is (re)allocated or freed: captured graphs hold the old addresses.
    pub(super) generation: u64,
}

impl Scratch {
    /// A buffer of at least `bytes` (contents undefined). Growing waits for queued work first,
    /// since the old buffer may still be read by it.
    pub(super) fn get(
        &mut self,
        gpu: &crate::backend::cuda::gpu::Gpu,
        name: &'static str,
        bytes: usize,
    ) -> Result<u64, BackendError> {
        let bytes = bytes.max(4);
        if self.bufs.get(name).is_none_or(|b| b.bytes() < bytes) {
            gpu.sync()?;
            self.generation += 1;
            self.bufs.remove(name);
            self.bufs.insert(name, gpu.alloc(bytes.next_power_of_two())?);
        }
        Ok(self.bufs[name].ptr())
    }

    /// Free every buffer, after the queued work that may use them.
    pub(super) fn clear(&mut self, gpu: &crate::backend::cuda::gpu::Gpu) -> Result<(), BackendError> {
        gpu.sync()?;
        self.generation += 1;
        self.bufs.clear();
        Ok(())
    }

    /// Upload `data` into the named buffer, in stream order.
    pub(super) fn put<T: Copy>(
        &mut self,
        gpu: &crate::backend::cuda::gpu::Gpu,
        name: &'static str,
        data: &[T],
    ) -> Result<u64, BackendError> {
        let p = self.get(gpu, name, std::mem::size_of_val(data))?;
        gpu.copy_htod_in_order(p, data)?;
        Ok(p)
    }
}

/// `KdaSeq` in cuda/glm5.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct KdaSeq {
    row0: i32,
    n: i32,
    slot: i32,
    _pad: i32,
    checkpoints: i64,
}

/// `DsaRow` in cuda/glm5.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct DsaRow {
    pos: i32,
    table: i32,
}

/// A step's logits rows left on the device: `rows` rows of the vocabulary at `ptr`, sequence `i`'s
/// rows `offsets[i]..offsets[i + 1]`, and the profiling lap still running.
pub(super) struct DeviceLogits {
    pub ptr: u64,
    pub rows: usize,
    pub offsets: Vec<usize>,
    pub lap: std::time::Instant,
}

/// Per-step inputs every layer reads.
pub(super) struct StepInputs {
    pub(super) n_rows: usize,
    kda_seqs: u64,
    n_seqs: usize,
    pub(super) dsa_rows: u64,
    pub(super) tables: u64,
    /// Record offsets (f32 elements) of the tokens of every pool this step completes, `pool` per
    /// pool in position order (a graph step: one pool per sequence, those it does not complete
    /// marked by a first offset of -1).
    pool_recs: Option<(u64, usize)>,
    max_pools: usize,
    max_sel: usize,
    ckpt: u64,
    /// Per batch row, which of its sequence's slot images the state after the row goes to.
    ckpt_map: u64,
}

pub(super) const BLOCK: u32 = 256;
/// Tokens per block of `kda_conv` (`KDA_CONV_TOKENS` in cuda/glm5.cu).
const KDA_CONV_TOKENS: usize = 32;
/// Pools per block of `dsa_score` (`DSA_SCORE_POOLS` in cuda/glm5.cu).
const DSA_SCORE_POOLS: usize = 128;
/// Lanes per state column in `kda_scan_*` (`KDA_R` in cuda/glm5.cu).
const KDA_LANES_PER_COLUMN: usize = 4;
/// Columns per block of the row-chunked kernels (`HC_CHUNK` in cuda/glm5.cu).
pub(super) const HC_CHUNK: usize = 256;
/// Most mHC streams the kernels take (`HC_MAX` in cuda/glm5.cu).
const HC_MAX: usize = 8;

impl Glm5CudaBackend {
    fn i32_of(v: usize) -> Result<i32, BackendError> {
        i32::try_from(v).map_err(|_| BackendError::InvalidStep(format!("{v} does not fit the kernels' 32-bit indices")))
    }

    /// Where a packed matrix is dequantized for prefill-sized products (`quant::matmul`); 0 when
    /// no weight is packed.
    pub(super) fn dequant_ptr(&self) -> u64 {
        self.dequant.as_ref().map_or(0, |b| b.ptr())
    }

    /// `y[rows, l.rows] = x[rows, l.cols] · lᵀ`, `x` f32 (cast to the weight's precision first
    /// when that is bf16), `l` dense or packed as stored.
    pub(super) fn linear(&mut self, x: u64, rows: usize, l: &DevLinear, y: u64) -> Result<(), BackendError> {
        let input = match l.prec {
            Precision::F32 => x,
            Precision::Bf16 => {
                let n = rows * l.cols;
                let xb = self.scratch.get(&self.gpu, "cast", 2 * n)?;
                let f = self.gpu.func("glm5", "cast_bf16")?;
                let n64 = n as i64;
                launch!(self.gpu, f, cfg((grid_for(n, BLOCK), 1), BLOCK, 0), &x, &xb, &n64)?;
                xb
            }
        };
        let dequant = self.dequant_ptr();
        let io = MatmulIo { x: input, y, ldy: l.rows, dequant };
        quant::matmul(&mut self.gpu, l.prec, &l.w, rows, l.cols, io, false)
    }

    /// Run one step (the batch already validated) and copy its logits rows to the host; the rows
    /// `embeds[i]` of sequence `i` (checked by the caller) take the given embeddings instead of
    /// their token's.
    pub(super) fn step(
        &mut self,
        batch: &[SeqStep<'_>],
        verify: &[bool],
        embeds: &[Vec<EmbeddedRows<'_>>],
    ) -> Result<StepLogits, BackendError> {
        let out = self.step_device(batch, verify, embeds)?;
        let mut data = vec![0f32; out.rows * self.cfg.vocab_size];
        if out.rows > 0 {
            self.gpu.copy_dtoh(&mut data, out.ptr)?;
        } else {
            self.gpu.sync()?;
        }
        self.end_profile(out.lap)?;
        Ok(StepLogits { vocab: self.cfg.vocab_size, data, offsets: out.offsets })
    }

    /// While profiling, count the time since `lap` (the logits and their use) and the step.
    pub(super) fn end_profile(&mut self, mut lap: std::time::Instant) -> Result<(), BackendError> {
        let dt = self.profile_lap(&mut lap)?;
        if let Some(p) = self.profile.as_mut() {
            p.rest_secs += dt;
            p.steps += 1;
        }
        Ok(())
    }

    /// Run one step and leave its logits rows on the device (queued, not waited for).
    pub(super) fn step_device(
        &mut self,
        batch: &[SeqStep<'_>],
        verify: &[bool],
        embeds: &[Vec<EmbeddedRows<'_>>],
    ) -> Result<DeviceLogits, BackendError> {
        let queued = std::time::Instant::now();
        let out = self.queue_step(batch, verify, embeds);
        self.enqueue_secs += queued.elapsed().as_secs_f64();
        out
    }

    fn queue_step(
        &mut self,
        batch: &[SeqStep<'_>],
        verify: &[bool],
        embeds: &[Vec<EmbeddedRows<'_>>],
    ) -> Result<DeviceLogits, BackendError> {
        let seqs = plan_rows(batch, verify, &self.slot_pos, self.cfg.vocab_size)?;
        let graphable = self.graphable(&seqs, embeds);
        let inputs = self.prepare(batch, &seqs, graphable)?;
        let lap = std::time::Instant::now();
        // Every upload before the launches: a captured graph replays launches, not host copies.
        let ids: Vec<i32> = batch.iter().flat_map(|s| s.tokens.iter().map(|&t| t as i32)).collect();
        let ids = self.scratch.put(&self.gpu, "ids", &ids)?;
        let (rows, offsets) = logits_rows(batch, &seqs);
        let rows_i: Vec<i32> = rows.iter().map(|&x| x as i32).collect();
        let rows_p = if rows.is_empty() { 0 } else { self.scratch.put(&self.gpu, "logit_rows", &rows_i)? };
        let rows_n = rows.len();
        let key = graphable.then_some(super::graph::GraphKey {
            rows: inputs.n_rows,
            max_pools: inputs.max_pools,
            max_sel: inputs.max_sel,
            generation: self.scratch.generation,
        });
        let run = |b: &mut Self| b.launch_step(&seqs, embeds, &inputs, ids, (rows_p, rows_n), lap);
        let (ptr, lap) = match key.map(|k| (k, self.graphs.action(&k))) {
            None | Some((_, super::graph::GraphAction::Launch)) => run(self)?,
            Some((k, super::graph::GraphAction::Replay)) => (self.graphs.launch(&k)?, lap),
            Some((k, super::graph::GraphAction::Capture)) => self.capture_step(k, run)?,
        };
        Ok(DeviceLogits { ptr, rows: rows_n, offsets, lap })
    }

    /// Queue the step's launches; returns the logits' address and the profiling lap.
    fn launch_step(
        &mut self,
        seqs: &[SeqRows<'_>],
        embeds: &[Vec<EmbeddedRows<'_>>],
        inputs: &StepInputs,
        ids: u64,
        (rows_p, rows_n): (u64, usize),
        mut lap: std::time::Instant,
    ) -> Result<(u64, std::time::Instant), BackendError> {
        let c = self.cfg.clone();
        let (m, d, n) = (c.hc_mult, c.hidden_size, inputs.n_rows);
        let mut x = self.scratch.get(&self.gpu, "x", 4 * n * m * d)?;
        let mut x_alt = self.scratch.get(&self.gpu, "x_alt", 4 * n * m * d)?;
        let (mi, di) = (m as i32, d as i32);
        let f = self.gpu.func("glm5", &format!("glm5_embed_{}", self.prec.suffix()))?;
        let table = self.weights.embed.dense_ptr()?;
        launch!(self.gpu, f, cfg((n as u32, 1), BLOCK, 0), &ids, &table, &x, &mi, &di)?;
        if embeds.iter().any(|e| !e.is_empty()) {
            self.place_embedded(seqs, embeds, x)?;
        }
        let dt = self.profile_lap(&mut lap)?;
        if let Some(p) = self.profile.as_mut() {
            p.rest_secs += dt;
        }
        let layers = std::mem::take(&mut self.weights.layers);
        let out = (|| -> Result<(), BackendError> {
            let mut have_selection = false;
            for (l, layer) in layers.iter().enumerate() {
                let (u, hcw) = self.hc_site(&c, &layer.attn_hc, layer.input_norm.ptr(), x, n)?;
                let y = match &layer.mixer {
                    Mixer::Kda(w) => {
                        have_selection = false;
                        self.kda(&c, w, l, u, inputs)?
                    }
                    Mixer::Dsa(w) => {
                        let shared = c.layer_types[l] == MixerKind::Dsa && c.indexer_types[l] == IndexerKind::Shared;
                        if w.indexer.is_none() && !(shared && have_selection) {
                            return Err(BackendError::InvalidStep(
                                "shared DSA layer without a preceding full-indexer layer".into(),
                            ));
                        }
                        let y = self.mla(&c, w, l, u, inputs)?;
                        have_selection = have_selection || w.indexer.is_some();
                        y
                    }
                };
                self.expand(x, y, hcw, x_alt, m, d, n)?;
                std::mem::swap(&mut x, &mut x_alt);
                let dt = self.profile_lap(&mut lap)?;
                if let Some(p) = self.profile.as_mut() {
                    p.mixer_secs[l] += dt;
                }
                let (u, hcw) = self.hc_site(&c, &layer.ffn_hc, layer.post_norm.ptr(), x, n)?;
                let z = match &layer.ffn {
                    Ffn::Dense(w) => self.mlp(&c, w, u, n, "ffn_out")?,
                    Ffn::Moe(w) => self.moe(&c, w, u, n, l)?,
                };
                self.expand(x, z, hcw, x_alt, m, d, n)?;
                std::mem::swap(&mut x, &mut x_alt);
                let dt = self.profile_lap(&mut lap)?;
                if let Some(p) = self.profile.as_mut() {
                    p.ffn_secs[l] += dt;
                }
            }
            Ok(())
        })();
        self.weights.layers = layers;
        out?;
        let ptr = self.logits(&c, x, rows_p, rows_n)?;
        Ok((ptr, lap))
    }

    /// While profiling: wait for the queued work and return the seconds since `lap` (then reset
    /// it); otherwise 0 without waiting.
    fn profile_lap(&mut self, lap: &mut std::time::Instant) -> Result<f64, BackendError> {
        if self.profile.is_none() {
            return Ok(0.0);
        }
        self.gpu.sync()?;
        let dt = lap.elapsed().as_secs_f64();
        *lap = std::time::Instant::now();
        Ok(dt)
    }

    /// While profiling, add the number of distinct experts in `routes` to layer `l`'s count.
    pub(super) fn profile_experts(&mut self, l: usize, routes: &[i32]) {
        if let Some(p) = self.profile.as_mut() {
            let distinct: std::collections::BTreeSet<i32> = routes.iter().copied().collect();
            p.distinct_experts[l] += distinct.len();
        }
    }

    /// Upload the step's per-sequence and per-row tables, reset slots starting at position 0,
    /// advance the slots' positions and allocate the verification checkpoints.
    fn prepare(
        &mut self,
        batch: &[SeqStep<'_>],
        seqs: &[SeqRows<'_>],
        graphable: bool,
    ) -> Result<StepInputs, BackendError> {
        let c = &self.cfg;
        let stride = self.layout.slot_stride;
        // Page-end snapshots marked for this step (`mark_state_snapshots`), each inside its step.
        let mut marks: Vec<Vec<usize>> = seqs.iter().map(|s| std::mem::take(&mut self.marks[s.slot])).collect();
        if let Some((s, m)) = seqs.iter().zip(&marks).find(|(s, m)| m.last().is_some_and(|&a| a >= s.n)) {
            return Err(BackendError::InvalidStep(format!(
                "state snapshots after {m:?} tokens of slot {}, whose step has {} tokens",
                s.slot, s.n
            )));
        }
        // Slot images per sequence: after every token but the last of a verified one (which also
        // serve its snapshots), else one per snapshot.
        let images = |s: &SeqRows<'_>, m: &Vec<usize>| if s.checkpoint { s.n - 1 } else { m.len() };
        let total =
            |marks: &[Vec<usize>]| -> usize { seqs.iter().zip(marks).map(|(s, m)| images(s, m) * stride).sum() };
        let ckpt = match self.gpu.alloc(4 * total(&marks)) {
            Ok(buf) => buf,
            // The images are a courtesy to the prefix cache: without memory for them the step
            // still runs, and those pages are recomputed on a later hit instead of cached.
            Err(e) if marks.iter().any(|m| !m.is_empty()) => {
                tracing::warn!(error = %e, "no device memory for page-end state snapshots; those pages are not cached");
                marks.iter_mut().for_each(Vec::clear);
                self.gpu.alloc(4 * total(&marks))?
            }
            Err(e) => return Err(e),
        };
        let ckpt = Arc::new(ckpt);
        let mut ckpt_map = vec![-1i32; seqs.iter().map(|s| s.n).sum()];
        let mut ck_off = 0usize;
        let mut kda_seqs = Vec::with_capacity(seqs.len());
        let mut tables: Vec<i32> = Vec::new();
        let mut rows = Vec::new();
        let mut pool_recs: Vec<i64> = Vec::new();
        let (bs, ts, pool) = (self.geom.block_size, self.layout.token_stride, c.index_kpool.max(1));
        let mut max_pos = 0usize;
        for ((s, step), m) in seqs.iter().zip(batch).zip(&marks) {
            if s.start_pos == 0 {
                self.gpu.zero(self.slot_addr(s.slot), 4 * stride)?;
            }
            self.slot_pos[s.slot] = Some(s.start_pos + s.n);
            // A verified sequence keeps its slot image after each of its tokens but the last.
            let offset = ck_off;
            ck_off += images(s, m) * stride;
            let map = &mut ckpt_map[s.row0..s.row0 + s.n];
            if s.checkpoint {
                map[..s.n - 1].iter_mut().enumerate().for_each(|(t, k)| *k = t as i32);
            } else {
                m.iter().enumerate().for_each(|(i, &after)| map[after - 1] = i as i32);
            }
            self.snapshots[s.slot] = (!m.is_empty()).then(|| DeviceSnapshots {
                images: ckpt.clone(),
                offset,
                index: m.iter().enumerate().map(|(i, &after)| if s.checkpoint { after - 1 } else { i }).collect(),
            });
            self.checkpoints[s.slot] = s.checkpoint.then(|| DeviceCheckpoints {
                images: ckpt.clone(),
                offset,
                start_pos: s.start_pos,
                tokens: s.n,
            });
            let checkpoints = if images(s, m) > 0 { offset as i64 } else { -1 };
            kda_seqs.push(KdaSeq {
                row0: Self::i32_of(s.row0)?,
                n: Self::i32_of(s.n)?,
                slot: Self::i32_of(s.slot)?,
                _pad: 0,
                checkpoints,
            });
            let t0 = Self::i32_of(tables.len())?;
            tables.extend(step.block_table.iter().map(|&b| b as i32));
            let recs_before = pool_recs.len();
            for pos in s.start_pos..s.start_pos + s.n {
                rows.push(DsaRow { pos: Self::i32_of(pos)?, table: t0 });
                if (pos + 1) % pool == 0 {
                    for p in pos + 1 - pool..=pos {
                        let rec = (s.table[p / bs] as usize * bs + p % bs) * ts;
                        pool_recs.push(rec as i64);
                    }
                }
            }
            if graphable && pool_recs.len() == recs_before {
                // The graph's `dsa_pool` launch has one block per sequence: this one has nothing to do.
                pool_recs.extend(std::iter::repeat_n(-1i64, pool));
            }
            max_pos = max_pos.max(s.start_pos + s.n);
        }
        let n_rows = rows.len();
        let kda_seqs_p = self.scratch.put(&self.gpu, "kda_seqs", &kda_seqs)?;
        let ckpt_map = self.scratch.put(&self.gpu, "ckpt_map", &ckpt_map)?;
        let dsa_rows = self.scratch.put(&self.gpu, "dsa_rows", &rows)?;
        let tables_p = self.scratch.put(&self.gpu, "tables", &tables)?;
        let pool_recs = if pool_recs.is_empty() {
            None
        } else {
            let n = pool_recs.len() / pool;
            Some((self.scratch.put(&self.gpu, "pool_recs", &pool_recs)?, n))
        };
        let budget = c.pool_budget();
        let ckpt_ptr = ckpt.ptr();
        let sel_cap = budget * pool + pool;
        // A graph step takes sizes that stay fixed while the context grows (the kernels read each
        // row's own counts; the sizes are strides and grid bounds only).
        let (max_pools, max_sel) = if graphable {
            ((max_pos / pool).max(1).next_multiple_of(DSA_SCORE_POOLS), sel_cap)
        } else {
            ((max_pos / pool).max(1), sel_cap.min(max_pos.max(1)).max(1))
        };
        Ok(StepInputs {
            n_rows,
            kda_seqs: kda_seqs_p,
            n_seqs: seqs.len(),
            dsa_rows,
            tables: tables_p,
            pool_recs,
            max_pools,
            max_sel,
            ckpt: ckpt_ptr,
            ckpt_map,
        })
    }

    /// One mHC site: the block input `u` ([n, D], normalised) and the expand weights.
    fn hc_site(
        &mut self,
        c: &Glm5Config,
        hc: &HyperConnection,
        norm: u64,
        x: u64,
        n: usize,
    ) -> Result<(u64, u64), BackendError> {
        let (m, d) = (c.hc_mult, c.hidden_size);
        let (md, di) = ((m * d) as i32, d as i32);
        // RMS of the M·D stream values, chunk by chunk (`HC_CHUNK` in cuda/glm5.cu), one warp a
        // chunk. The norm has no weight, so it is a scalar per token: `hc_maps` applies it to the
        // projection of the raw streams instead of normalising all M·D values before it.
        let (md_chunks, d_chunks) = ((m * d).div_ceil(HC_CHUNK), d.div_ceil(HC_CHUNK) as u32);
        let partial = self.scratch.get(&self.gpu, "hc_partial", 4 * n * md_chunks)?;
        let f = self.gpu.func("glm5", "rms_partial")?;
        let warps = (BLOCK / 32) as usize;
        let chunks_i = md_chunks as i32;
        launch!(
            self.gpu,
            f,
            cfg((n as u32, md_chunks.div_ceil(warps) as u32), BLOCK, 0),
            &x,
            &partial,
            &md,
            &chunks_i
        )?;
        let apply = self.gpu.func("glm5", "rms_apply")?;
        let eps = c.rms_norm_eps;
        let width = (2 + m) * m;
        let mix = self.scratch.get(&self.gpu, "hc_mix", 4 * n * width)?;
        self.gpu.gemm(Precision::F32, n, width, m * d, x, hc.proj.dense_ptr()?, mix, false)?;
        let pre = self.scratch.get(&self.gpu, "hc_pre", 4 * n * m)?;
        let hcw = self.scratch.get(&self.gpu, "hc_w", 4 * n * (m + m * m))?;
        let f = self.gpu.func("glm5", "hc_maps")?;
        let (base, mi, iters) = (hc.base.ptr(), m as i32, c.hc_sinkhorn_iters as i32);
        let [s_pre, s_post, s_comb] = hc.scale;
        launch!(
            self.gpu,
            f,
            cfg((n as u32, 1), (HC_MAX * HC_MAX) as u32, 0),
            &mix,
            &partial,
            &chunks_i,
            &eps,
            &base,
            &s_pre,
            &s_post,
            &s_comb,
            &pre,
            &hcw,
            &mi,
            &di,
            &c.hc_eps,
            &iters
        )?;
        let u = self.scratch.get(&self.gpu, "hc_u", 4 * n * d)?;
        let f = self.gpu.func("glm5", "hc_collapse")?;
        launch!(self.gpu, f, cfg((n as u32, d_chunks), BLOCK, 0), &x, &pre, &u, &partial, &mi, &di)?;
        launch!(self.gpu, apply, cfg((n as u32, d_chunks), BLOCK, 0), &u, &partial, &norm, &u, &di, &eps)?;
        Ok((u, hcw))
    }

    #[allow(clippy::too_many_arguments)]
    fn expand(&mut self, x: u64, y: u64, hcw: u64, out: u64, m: usize, d: usize, n: usize) -> Result<(), BackendError> {
        let f = self.gpu.func("glm5", "hc_expand")?;
        let (mi, di) = (m as i32, d as i32);
        launch!(self.gpu, f, cfg((n as u32, d.div_ceil(HC_CHUNK) as u32), BLOCK, 0), &x, &y, &hcw, &out, &mi, &di)
    }

    fn kda(&mut self, c: &Glm5Config, w: &Kda, l: usize, u: u64, inp: &StepInputs) -> Result<u64, BackendError> {
        let slots = self.layout.kda[l].ok_or_else(|| BackendError::InvalidStep(format!("layer {l}: no KDA slots")))?;
        let n = inp.n_rows;
        let (q, hd, heads, kw) = (c.linear_qkv_dim(), c.linear_head_dim, c.linear_num_heads, c.linear_conv_kernel_dim);
        let q3 = 3 * q;
        let raw = self.scratch.get(&self.gpu, "kda_raw", 4 * n * q3)?;
        self.linear(u, n, &w.qkv, raw)?;
        let fa = self.scratch.get(&self.gpu, "kda_fa", 4 * n * hd)?;
        self.linear(u, n, &w.f_a, fa)?;
        let fg = self.scratch.get(&self.gpu, "kda_f", 4 * n * q)?;
        self.linear(fa, n, &w.f_b, fg)?;
        let b = self.scratch.get(&self.gpu, "kda_b", 4 * n * heads)?;
        self.linear(u, n, &w.b_proj, b)?;
        let ga = self.scratch.get(&self.gpu, "kda_ga", 4 * n * hd)?;
        self.linear(u, n, &w.g_a, ga)?;
        let z = self.scratch.get(&self.gpu, "kda_z", 4 * n * q)?;
        self.linear(ga, n, &w.g_b, z)?;
        let conv = self.scratch.get(&self.gpu, "kda_conv", 4 * n * q3)?;
        let state = self.state.ptr();
        let (stride, conv_off, state_off) = (self.layout.slot_stride as i64, slots.conv as i64, slots.state as i64);
        let (q3i, kwi, taps) = (q3 as i32, kw as i32, w.conv.ptr());
        let channel_blocks = q3.div_ceil(128) as u32;
        let f = self.gpu.func("glm5", "kda_conv")?;
        let token_chunks = n.div_ceil(KDA_CONV_TOKENS) as u32;
        launch!(
            self.gpu,
            f,
            cfg3((channel_blocks, inp.n_seqs as u32, token_chunks), 128, 0),
            &raw,
            &conv,
            &state,
            &inp.ckpt,
            &inp.ckpt_map,
            &inp.kda_seqs,
            &taps,
            &q3i,
            &kwi,
            &stride,
            &conv_off
        )?;
        let f = self.gpu.func("glm5", "kda_conv_window")?;
        let grid = cfg((channel_blocks, inp.n_seqs as u32), 128, 0);
        launch!(self.gpu, f, grid, &raw, &state, &inp.kda_seqs, &q3i, &kwi, &stride, &conv_off)?;
        let core = self.scratch.get(&self.gpu, "kda_core", 4 * n * q)?;
        let (qi, hi, hd_i) = (q as i32, heads as i32, hd as i32);
        let (has_lb, lb) = match c.linear_lower_bound {
            Some(lb) => (1i32, lb),
            None => (0i32, 0f32),
        };
        let (dt, alog, onorm) = (w.dt_bias.ptr(), w.a_log.ptr(), w.o_norm.ptr());
        let threads = hd.next_multiple_of(32) as u32;
        if matches!(hd, 16 | 32 | 64 | 128) {
            // The raw projections are dead after the window update: their buffer takes the
            // normalised q and k and the decays, in the same [q | k | decay] row layout.
            let qkd = raw;
            let beta = self.scratch.get(&self.gpu, "kda_beta", 4 * n * heads)?;
            let f = self.gpu.func("glm5", &format!("kda_prep_{hd}"))?;
            let grid = cfg((n as u32, heads as u32), threads, 0);
            launch!(self.gpu, f, grid, &conv, &qkd, &fg, &beta, &b, &dt, &alog, &qi, &hi, &has_lb, &lb)?;
            let f = self.gpu.func("glm5", &format!("kda_scan_{hd}"))?;
            let columns = hd.min(32);
            let lanes = columns * KDA_LANES_PER_COLUMN;
            let grid = cfg(((heads * hd / columns) as u32, inp.n_seqs as u32), lanes as u32, 0);
            launch!(
                self.gpu,
                f,
                grid,
                &conv,
                &qkd,
                &beta,
                &state,
                &inp.ckpt,
                &inp.ckpt_map,
                &inp.kda_seqs,
                &core,
                &qi,
                &hi,
                &stride,
                &state_off
            )?;
            let f = self.gpu.func("glm5", "kda_out_norm")?;
            let grid = cfg((n as u32, heads as u32), threads, 0);
            launch!(self.gpu, f, grid, &core, &z, &onorm, &qi, &hd_i, &c.rms_norm_eps)?;
        } else {
            let f = self.gpu.func("glm5", "kda_recurrent")?;
            launch!(
                self.gpu,
                f,
                cfg((heads as u32, inp.n_seqs as u32), threads, (3 * hd * 4) as u32),
                &conv,
                &fg,
                &b,
                &z,
                &dt,
                &alog,
                &onorm,
                &state,
                &inp.ckpt,
                &inp.ckpt_map,
                &inp.kda_seqs,
                &core,
                &qi,
                &hi,
                &stride,
                &state_off,
                &has_lb,
                &lb,
                &c.rms_norm_eps,
                &hd_i
            )?;
        }
        let y = self.scratch.get(&self.gpu, "mixer_out", 4 * n * c.hidden_size)?;
        self.linear(core, n, &w.o_proj, y)?;
        Ok(y)
    }

    fn mla(&mut self, c: &Glm5Config, w: &Mla, l: usize, u: u64, inp: &StepInputs) -> Result<u64, BackendError> {
        let slots = self.layout.dsa[l].ok_or_else(|| BackendError::InvalidStep(format!("layer {l}: no DSA slots")))?;
        let n = inp.n_rows;
        let (h, dn, dv, r, rq) =
            (c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank, c.q_lora_rank);
        let eps = c.rms_norm_eps;
        let rms = self.gpu.func("glm5", "rms_rows_f32")?;
        let none = 0u64;
        let q_r = self.scratch.get(&self.gpu, "mla_qr", 4 * n * rq)?;
        self.linear(u, n, &w.q_a, q_r)?;
        let (rqi, ri, qan, kvan) = (rq as i32, r as i32, w.q_a_norm.ptr(), w.kv_a_norm.ptr());
        launch!(self.gpu, rms.clone(), cfg((n as u32, 1), BLOCK, 0), &q_r, &qan, &none, &rqi, &eps)?;
        let q = self.scratch.get(&self.gpu, "mla_q", 4 * n * h * dn)?;
        self.linear(q_r, n, &w.q_b, q)?;
        let latent = self.scratch.get(&self.gpu, "mla_latent", 4 * n * r)?;
        self.linear(u, n, &w.kv_a, latent)?;
        launch!(self.gpu, rms, cfg((n as u32, 1), BLOCK, 0), &latent, &kvan, &none, &ri, &eps)?;
        let (di, hi) = (c.index_head_dim, c.index_n_heads);
        let kgw_width = 2 * di + hi;
        let (qi_buf, kgw) = match &w.indexer {
            Some(ix) => {
                let qi = self.scratch.get(&self.gpu, "ix_q", 4 * n * hi * di)?;
                self.linear(q_r, n, &ix.wq_b, qi)?;
                let kgw = self.scratch.get(&self.gpu, "ix_kgw", 4 * n * kgw_width)?;
                self.linear(u, n, &ix.k_gate_w, kgw)?;
                (qi, kgw)
            }
            None => (0, 0),
        };
        let ix_off = match (&w.indexer, slots.indexer) {
            (Some(_), Some(off)) => off as i32,
            (None, _) => -1,
            (Some(_), None) => {
                return Err(BackendError::InvalidStep("indexer layer without indexer cache slots".into()))
            }
        };
        let (kv, bs, ts) = (self.kv.ptr(), self.geom.block_size as i32, self.layout.token_stride as i32);
        let (lat_off, dii, kgwi) = (slots.latent as i32, di as i32, kgw_width as i32);
        let (knw, knb) = w.indexer.as_ref().map_or((0, 0), |ix| (ix.k_norm_w.ptr(), ix.k_norm_b.ptr()));
        let f = self.gpu.func("glm5", "dsa_store")?;
        launch!(
            self.gpu,
            f,
            cfg((n as u32, 1), BLOCK, 0),
            &latent,
            &kgw,
            &knw,
            &knb,
            &kv,
            &inp.dsa_rows,
            &inp.tables,
            &bs,
            &ts,
            &lat_off,
            &ix_off,
            &ri,
            &dii,
            &kgwi
        )?;
        let pool = c.index_kpool;
        if let (Some(ix), Some((recs, n_pools))) = (&w.indexer, inp.pool_recs) {
            let f = self.gpu.func("glm5", "dsa_pool")?;
            let (ape, pi) = (ix.ape.ptr(), pool as i32);
            launch!(self.gpu, f, cfg((n_pools as u32, 1), 128, 0), &kv, &recs, &ape, &ix_off, &dii, &pi)?;
        }
        let max_sel = inp.max_sel;
        let sel = self.scratch.get(&self.gpu, "dsa_sel", 4 * n * max_sel)?;
        let sel_count = self.scratch.get(&self.gpu, "dsa_sel_count", 4 * n)?;
        if w.indexer.is_some() {
            let scores = self.scratch.get(&self.gpu, "dsa_scores", 4 * n * inp.max_pools)?;
            let (hii, pi, budget, tail) =
                (hi as i32, pool as i32, c.pool_budget() as i32, c.index_kpool_always_select_tail as i32);
            let (mp, ms) = (inp.max_pools as i32, max_sel as i32);
            let f = self.gpu.func("glm5", "dsa_score")?;
            let chunks = inp.max_pools.div_ceil(DSA_SCORE_POOLS) as u32;
            launch!(
                self.gpu,
                f,
                cfg((n as u32, chunks), DSA_SCORE_POOLS as u32, (4 * hi * di) as u32),
                &qi_buf,
                &kgw,
                &kv,
                &inp.dsa_rows,
                &inp.tables,
                &scores,
                &bs,
                &ts,
                &ix_off,
                &hii,
                &dii,
                &kgwi,
                &pi,
                &budget,
                &mp
            )?;
            let f = self.gpu.func("glm5", "dsa_select")?;
            launch!(
                self.gpu,
                f,
                cfg((n as u32, 1), 1024, 0),
                &scores,
                &inp.dsa_rows,
                &sel,
                &sel_count,
                &pi,
                &budget,
                &tail,
                &mp,
                &ms
            )?;
        }
        let attn = self.scratch.get(&self.gpu, "mla_attn", 4 * n * h * dv)?;
        let att = super::mla::MlaAttend {
            q,
            kv_b: w.kv_b.ptr(),
            sel,
            sel_count,
            latent_off: slots.latent,
            max_sel,
            out: attn,
        };
        if self.mla_on_tensor_cores(c, n) {
            self.mla_attend_mma(c, inp, &att)?;
        } else {
            self.mla_attend_split(c, inp, &att)?;
        }
        let y = self.scratch.get(&self.gpu, "mixer_out", 4 * n * c.hidden_size)?;
        self.linear(attn, n, &w.o_proj, y)?;
        Ok(y)
    }

    /// Clamped SwiGLU MLP over `n` rows of `u`, into the named buffer.
    pub(super) fn mlp(
        &mut self,
        c: &Glm5Config,
        w: &Mlp,
        u: u64,
        n: usize,
        out: &'static str,
    ) -> Result<u64, BackendError> {
        let inter = w.gate_up.rows / 2;
        let gu = self.scratch.get(&self.gpu, "mlp_gu", 4 * n * 2 * inter)?;
        self.linear(u, n, &w.gate_up, gu)?;
        let act = self.scratch.get(&self.gpu, "mlp_act", self.prec.bytes() * n * inter)?;
        let f = self.gpu.func("glm5", &format!("swiglu_clamped_{}", self.prec.suffix()))?;
        let (ii, ni) = (inter as i32, n as i32);
        launch!(
            self.gpu,
            f,
            cfg((grid_for(inter, BLOCK).min(64), (n as u32).min(65_535)), BLOCK, 0),
            &gu,
            &act,
            &ii,
            &ni,
            &c.swiglu_limit
        )?;
        let y = self.scratch.get(&self.gpu, out, 4 * n * c.hidden_size)?;
        let dequant = self.dequant_ptr();
        let io = MatmulIo { x: act, y, ldy: w.down.rows, dequant };
        quant::matmul(&mut self.gpu, w.down.prec, &w.down.w, n, w.down.cols, io, false)?;
        Ok(y)
    }

    /// Final stream mean + norm and the LM head over the `r` rows listed at `rows_p`, into a device
    /// buffer ([r, vocab] f32; 0 when there are no rows).
    fn logits(&mut self, c: &Glm5Config, x: u64, rows_p: u64, r: usize) -> Result<u64, BackendError> {
        if r == 0 {
            return Ok(0);
        }
        let d = c.hidden_size;
        let h = self.scratch.get(&self.gpu, "final_h", self.prec.bytes() * r * d)?;
        let f = self.gpu.func("glm5", &format!("glm5_final_norm_{}", self.prec.suffix()))?;
        let (norm, mi, di) = (self.weights.norm.ptr(), c.hc_mult as i32, d as i32);
        launch!(
            self.gpu,
            f,
            cfg((r as u32, 1), BLOCK, (4 * d) as u32),
            &x,
            &rows_p,
            &norm,
            &h,
            &mi,
            &di,
            &c.rms_norm_eps
        )?;
        let logits = self.scratch.get(&self.gpu, "logits", 4 * r * c.vocab_size)?;
        let dequant = self.dequant_ptr();
        let head = self.weights.lm_head.as_ref().unwrap_or(&self.weights.embed);
        let io = MatmulIo { x: h, y: logits, ldy: head.rows, dequant };
        quant::matmul(&mut self.gpu, head.prec, &head.w, r, head.cols, io, false)?;
        Ok(logits)
    }
}
