//! The CPU reference backend: llama-family forward passes over ragged batches with a paged KV
//! store, multi-threaded with a rayon pool the backend owns, and `glm5_next` (`glm5_next/`). It is
//! the numerical reference the CUDA backend is validated against, and what CI runs. It makes no
//! scheduling decisions.

mod attention;
pub mod glm5_next;
pub mod linear;
mod tp;
#[cfg(test)]
mod yield_tests;

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rayon::prelude::*;

pub use self::attention::KvPrecision;
use self::attention::{paged_attention, AttnShape, PagedKv, TokenRef};
use self::linear::{load_vector, CpuLinear, LinearScratch};
pub use self::tp::{TpCpuBackend, COLLECTIVE_TIMEOUT};
use super::{
    check_tap_layers, check_token_ids, validate_batch, validate_kv_image, Backend, BackendError, HiddenTaps,
    KvGeometry, SeqStep, StepLogits, StepRun, TapRecorder,
};
use crate::config::{LlamaConfig, RopeScaling};
use crate::model::llama::{LinearSpec, LlamaSpec};
use crate::model::quant::{expf_ggml, simd_available};
use crate::model::{ModelError, WeightSource};
use crate::parallel::{Collective, LlamaShard, TpRank};

/// One rank's place in a tensor-parallel group and its handle to the group's communicator.
#[derive(Clone)]
pub struct TpShard {
    pub rank: TpRank,
    pub comm: Arc<dyn Collective>,
}

/// What a sharded backend needs at run time: the communicator and its vocabulary slice.
struct TpRuntime {
    comm: Arc<dyn Collective>,
    vocab: Range<usize>,
}

#[derive(Clone, Copy, Debug)]
pub struct CpuOptions {
    /// Worker threads; 0 = one per available core.
    pub threads: usize,
    pub kv: KvGeometry,
    /// `None` = f16 when the weights are block-quantized (llama.cpp's default), else f32.
    pub kv_precision: Option<KvPrecision>,
}

/// Several projections sharing one input, computed as one stacked matmul when their formats
/// allow (q/k/v, gate/up), else one after another.
enum Proj {
    Fused(CpuLinear),
    Split(Vec<CpuLinear>),
}

impl Proj {
    /// Load each projection and keep its output rows `rows[i]` (this rank's column-parallel slice).
    fn load(w: &dyn WeightSource, specs: &[&LinearSpec], rows: &[Range<usize>]) -> Result<Self, ModelError> {
        let parts = specs
            .iter()
            .zip(rows)
            .map(|(s, r)| Ok(CpuLinear::load(w, &s.name, s.out, s.inp, s.bias)?.take_rows(r.clone())))
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(match CpuLinear::concat(parts) {
            Ok(f) => Proj::Fused(f),
            Err(parts) => Proj::Split(parts),
        })
    }

    fn rows(&self) -> usize {
        match self {
            Proj::Fused(l) => l.rows,
            Proj::Split(p) => p.iter().map(|l| l.rows).sum(),
        }
    }

    /// `y[m, Σrows]` with the parts side by side in each row.
    fn forward(&self, x: &[f32], m: usize, scratch: &mut LinearScratch, simd: bool) -> Result<Vec<f32>, BackendError> {
        let total = self.rows();
        let mut y = vec![0f32; m * total];
        match self {
            Proj::Fused(l) => l.forward(x, m, &mut y, scratch, simd)?,
            Proj::Split(parts) => {
                let mut col = 0;
                for p in parts {
                    let mut part = vec![0f32; m * p.rows];
                    p.forward(x, m, &mut part, scratch, simd)?;
                    for i in 0..m {
                        y[i * total + col..i * total + col + p.rows]
                            .copy_from_slice(&part[i * p.rows..(i + 1) * p.rows]);
                    }
                    col += p.rows;
                }
            }
        }
        Ok(y)
    }
}

struct Layer {
    input_norm: Vec<f32>,
    qkv: Proj,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    o: CpuLinear,
    post_norm: Vec<f32>,
    gate_up: Proj,
    down: CpuLinear,
}

pub struct CpuBackend {
    /// The model's config with head counts and intermediate size reduced to this rank's share
    /// (the full model when not sharded); the vocabulary stays whole.
    cfg: LlamaConfig,
    /// `None` when this backend holds the whole model.
    tp: Option<TpRuntime>,
    embed: CpuLinear,
    layers: Vec<Layer>,
    final_norm: Vec<f32>,
    /// `None` when tied: the embedding matrix doubles as the output projection.
    lm_head: Option<CpuLinear>,
    rope: RopeAngles,
    kv: PagedKv,
    pool: std::sync::Arc<rayon::ThreadPool>,
    simd: bool,
    weight_bytes: usize,
    scratch: LinearScratch,
    /// Layers whose hidden states each step records (`Backend::set_hidden_taps`).
    tap_layers: Vec<usize>,
    last_taps: Option<HiddenTaps>,
    /// The step `forward_yielding` stopped between layers, until resumed or dropped.
    suspended: Option<SuspendedStep>,
}

/// RMSNorm of each `dim`-sized row of `x` in place: `x · w / sqrt(mean(x²) + eps)`, with GGML's
/// rounding (squares in f32, their sum in f64).
fn rms_norm_rows(x: &mut [f32], w: &[f32], eps: f32) {
    let dim = w.len();
    let norm = |row: &mut [f32]| {
        let ss: f64 = row.iter().map(|&v| (v * v) as f64).sum();
        let r = 1.0 / ((ss / dim as f64) as f32 + eps).sqrt();
        for (v, &g) in row.iter_mut().zip(w) {
            *v = g * (*v * r);
        }
    };
    if x.len() / dim >= 4 {
        x.par_chunks_mut(dim).for_each(norm);
    } else {
        x.chunks_mut(dim).for_each(norm);
    }
}

/// How RoPE angles and rotations are computed.
enum RopeAngles {
    /// HF's formula: angle `pos · inv_freq[j]` (f32), plain multiplies in the rotation.
    InvFreq(Vec<f32>),
    /// GGML's rope cache (`ggml_rope_cache_init`, `rope_yarn` without YaRN): θ₀ = pos and
    /// θⱼ₊₁ = θⱼ · base^(−2/d), all in f32, divided by a per-pair frequency factor (Llama 3
    /// scaling, llama.cpp's `rope_freqs`) and multiplied by `freq_scale` (linear scaling); the
    /// rotation fused as GGML's compiled kernel fuses it. Bit-exact with llama.cpp for unscaled
    /// RoPE; with scaling the factors are recomputed here, so only close.
    Ggml { theta_scale: f32, freq_scale: f32, factors: Option<Vec<f32>> },
}

impl RopeAngles {
    fn new(cfg: &LlamaConfig) -> Self {
        if !cfg.rope_ggml_style {
            return RopeAngles::InvFreq(cfg.rope_inv_freq());
        }
        let theta_scale = cfg.rope_theta.powf(-2.0 / cfg.head_dim as f32);
        match &cfg.rope_scaling {
            None => RopeAngles::Ggml { theta_scale, freq_scale: 1.0, factors: None },
            Some(RopeScaling::Linear { factor }) => {
                RopeAngles::Ggml { theta_scale, freq_scale: 1.0 / factor, factors: None }
            }
            Some(RopeScaling::Llama3 { .. }) => {
                let plain = LlamaConfig { rope_scaling: None, ..cfg.clone() }.rope_inv_freq();
                let factors = plain.iter().zip(cfg.rope_inv_freq()).map(|(p, s)| p / s).collect();
                RopeAngles::Ggml { theta_scale, freq_scale: 1.0, factors: Some(factors) }
            }
        }
    }

    fn ggml(&self) -> bool {
        matches!(self, RopeAngles::Ggml { .. })
    }

    /// cos and sin of every pair's angle at `pos`.
    fn fill(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        match self {
            RopeAngles::InvFreq(inv_freq) => {
                for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(inv_freq) {
                    let a = pos as f32 * f;
                    (*c, *s) = (a.cos(), a.sin());
                }
            }
            RopeAngles::Ggml { theta_scale, freq_scale, factors } => {
                let mut theta = pos as f32;
                for (j, (c, s)) in cos.iter_mut().zip(sin.iter_mut()).enumerate() {
                    let extrap = factors.as_ref().map_or(theta, |f| theta / f[j]);
                    let a = freq_scale * extrap;
                    (*c, *s) = (a.cos(), a.sin());
                    theta *= theta_scale;
                }
            }
        }
    }
}

/// Rotate-half RoPE of one head vector at angle table (`cos`, `sin`) of length `head_dim / 2`.
#[inline]
fn rope(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for i in 0..half {
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i] + a * sin[i];
    }
}

/// RoPE as GGML's `rotate_pairs` computes it once compiled (FMA-contracted: `x0·c − x1·s` is
/// `fma(x0, c, −(x1·s))`, `x0·s + x1·c` is `fma(x0, s, x1·c)`), on our rotate-half layout where
/// GGML's pair `(2i, 2i+1)` sits at `(i, i + d/2)`. The result is written back in GGML's
/// adjacent-pair order, llama.cpp's q/k layout, because that order fixes how its f16 attention
/// sums q·k (`tmp` is scratch of the head's size).
#[inline]
fn rope_ggml_interleaved(x: &mut [f32], cos: &[f32], sin: &[f32], tmp: &mut [f32], simd: bool) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only true when AVX2 and FMA were detected at runtime.
        unsafe { rope_ggml_fma(x, cos, sin, tmp) };
        return;
    }
    let _ = simd;
    rope_ggml_body(x, cos, sin, tmp);
}

/// The same code compiled with hardware FMA, so `mul_add` is one instruction, not a libm call.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn rope_ggml_fma(x: &mut [f32], cos: &[f32], sin: &[f32], tmp: &mut [f32]) {
    rope_ggml_body(x, cos, sin, tmp);
}

#[inline(always)]
fn rope_ggml_body(x: &mut [f32], cos: &[f32], sin: &[f32], tmp: &mut [f32]) {
    let half = cos.len();
    for i in 0..half {
        let (a, b) = (x[i], x[i + half]);
        tmp[2 * i] = a.mul_add(cos[i], -(b * sin[i]));
        tmp[2 * i + 1] = a.mul_add(sin[i], b * cos[i]);
    }
    x.copy_from_slice(tmp);
}

/// `out = silu(gate) · up` with GGML's rounding (`ggml_vec_swiglu_f32`): `g / (1 + exp(0 − g))`
/// with GGML's vectorised exp for whole groups of 8, libm's for the rest.
fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32], simd: bool) {
    let n8 = gate.len() / 8 * 8;
    for (o, &g) in out[..n8].iter_mut().zip(gate) {
        *o = 0.0 - g;
    }
    expf_ggml(&mut out[..n8], simd);
    for ((o, &g), &u) in out[..n8].iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + *o) * u;
    }
    for ((o, &g), &u) in out[n8..].iter_mut().zip(&gate[n8..]).zip(&up[n8..]) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

fn weight_bytes(l: &CpuLinear) -> usize {
    l.weight.bytes()
}

fn proj_bytes(p: &Proj) -> usize {
    match p {
        Proj::Fused(l) => weight_bytes(l),
        Proj::Split(v) => v.iter().map(weight_bytes).sum(),
    }
}

/// The KV precision the CPU backend gives a model unless told otherwise: f16 when its embedding
/// stays quantized in memory (GGUF Q8_0/Q4_0/Q4_1 and the K-quants, whose reference, llama.cpp, keeps an f16
/// cache), f32 otherwise. The capacity card prices the pool with this before anything loads.
pub fn default_kv_precision(cfg: &LlamaConfig, w: &dyn WeightSource) -> KvPrecision {
    let embed = LlamaSpec::new(cfg).embed;
    match w.tensor(&embed) {
        Some(t) if linear::stays_quantized(t.dtype) => KvPrecision::F16,
        _ => KvPrecision::F32,
    }
}

impl CpuBackend {
    pub fn new(cfg: &LlamaConfig, w: &dyn WeightSource, opts: CpuOptions) -> Result<Self, ModelError> {
        Self::new_shard(cfg, w, opts, None)
    }

    /// This rank's shard of the model (`None` = the whole model), following the plan in
    /// [`crate::parallel::plan`]: full tensors are loaded, then sliced.
    pub fn new_shard(
        cfg: &LlamaConfig,
        w: &dyn WeightSource,
        opts: CpuOptions,
        shard: Option<TpShard>,
    ) -> Result<Self, ModelError> {
        let config_error = |msg: String| ModelError::Config { file: w.origin().to_path_buf(), msg };
        let rank = shard.as_ref().map_or(TpRank::single(), |s| s.rank);
        if let Some(s) = &shard {
            if s.comm.world_size() != rank.world || s.comm.rank() != rank.rank {
                return Err(config_error(format!(
                    "rank {} of {} was given the communicator of rank {} of {}",
                    rank.rank,
                    rank.world,
                    s.comm.rank(),
                    s.comm.world_size()
                )));
            }
        }
        let plan = LlamaShard::of_model(rank, cfg).map_err(|e| config_error(e.to_string()))?;
        let spec = LlamaSpec::new(cfg);
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let heads = |r: &Range<usize>| r.start * hd..r.end * hd;
        let (q_rows, kv_rows) = (heads(&plan.q_heads), heads(&plan.kv_heads));
        // Row-parallel outputs are summed over ranks: only rank 0 adds their bias.
        let first = rank.rank == 0;
        let embed = CpuLinear::load(w, &spec.embed.replace(".weight", ""), cfg.vocab_size, h, false)?
            .take_rows(plan.vocab.clone());
        let mut layers = Vec::with_capacity(spec.layers.len());
        for l in &spec.layers {
            layers.push(Layer {
                input_norm: load_vector(w, &l.input_norm, h)?,
                qkv: Proj::load(w, &[&l.q, &l.k, &l.v], &[q_rows.clone(), kv_rows.clone(), kv_rows.clone()])?,
                q_norm: l.q_norm.as_ref().map(|n| load_vector(w, n, hd)).transpose()?,
                k_norm: l.k_norm.as_ref().map(|n| load_vector(w, n, hd)).transpose()?,
                o: CpuLinear::load(w, &l.o.name, l.o.out, l.o.inp, l.o.bias)?.take_cols(q_rows.clone(), first),
                post_norm: load_vector(w, &l.post_attention_norm, h)?,
                gate_up: Proj::load(w, &[&l.gate, &l.up], &[plan.intermediate.clone(), plan.intermediate.clone()])?,
                down: CpuLinear::load(w, &l.down.name, l.down.out, l.down.inp, l.down.bias)?
                    .take_cols(plan.intermediate.clone(), first),
            });
        }
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(CpuLinear::load(w, &spec.lm_head.name, cfg.vocab_size, h, false)?.take_rows(plan.vocab.clone()))
        };
        let local_cfg = LlamaConfig {
            num_attention_heads: plan.q_heads.len(),
            num_key_value_heads: plan.kv_heads.len(),
            intermediate_size: plan.intermediate.len(),
            ..cfg.clone()
        };
        let tp = shard.map(|s| TpRuntime { comm: s.comm, vocab: plan.vocab.clone() });
        let cfg = &local_cfg;
        let threads =
            if opts.threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { opts.threads };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("shelfserve-cpu-{i}"))
            .build()
            .map_err(|e| ModelError::Format { file: w.origin().to_path_buf(), msg: format!("thread pool: {e}") })?;
        let weight_bytes = weight_bytes(&embed)
            + lm_head.as_ref().map_or(0, weight_bytes)
            + layers
                .iter()
                .map(|l| proj_bytes(&l.qkv) + weight_bytes(&l.o) + proj_bytes(&l.gate_up) + weight_bytes(&l.down))
                .sum::<usize>();
        let pool = std::sync::Arc::new(pool);
        let kv_precision = opts.kv_precision.unwrap_or_else(|| default_kv_precision(cfg, w));
        Ok(CpuBackend {
            cfg: cfg.clone(),
            tp,
            embed,
            layers,
            final_norm: load_vector(w, &spec.final_norm, h)?,
            lm_head,
            rope: RopeAngles::new(cfg),
            kv: PagedKv::new(opts.kv, cfg.num_hidden_layers, cfg.kv_dim(), kv_precision),
            pool,
            simd: simd_available(),
            weight_bytes,
            scratch: LinearScratch::default(),
            tap_layers: Vec::new(),
            last_taps: None,
            suspended: None,
        })
    }

    /// Bytes of weights held in memory.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// Bytes of the KV store.
    pub fn kv_bytes(&self) -> usize {
        self.kv.bytes()
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Runs `batch` from its embeddings, or from a suspended step's residual stream (`resume`),
    /// through the layers and the head; between two layers it stops when `yield_now` is set and
    /// keeps the residual stream in `self.suspended`.
    fn forward_inner(
        &mut self,
        batch: &[SeqStep<'_>],
        resume: Option<SuspendedStep>,
        yield_now: Option<&AtomicBool>,
    ) -> Result<StepRun, BackendError> {
        let c = &self.cfg;
        let (h, hd, nh, nkv) = (c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads);
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let simd = self.simd;
        let tokens: Vec<TokenRef<'_>> = batch
            .iter()
            .flat_map(|s| (0..s.tokens.len()).map(move |i| TokenRef { pos: s.start_pos + i, table: s.block_table }))
            .collect();
        let ids: Vec<u32> = batch.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let t = ids.len();

        let (mut x, first_layer) = match resume {
            Some(r) => (r.x, r.next_layer),
            None => (self.embed_rows(&ids)?, 0),
        };
        // cos/sin per token, shared by all heads and layers.
        let half = hd / 2;
        let mut cos = vec![0f32; t * half];
        let mut sin = vec![0f32; t * half];
        for (i, tok) in tokens.iter().enumerate() {
            self.rope.fill(tok.pos, &mut cos[i * half..(i + 1) * half], &mut sin[i * half..(i + 1) * half]);
        }
        let ggml_rope = self.rope.ggml();
        let shape = AttnShape { n_heads: nh, n_kv_heads: nkv, head_dim: hd, sliding_window: c.sliding_window };
        let qkv_w = qd + 2 * kvd;
        let mut taps = TapRecorder::new(&self.tap_layers, h, batch);
        let last_layer = self.layers.len().saturating_sub(1);
        for (li, layer) in self.layers.iter().enumerate().skip(first_layer) {
            let mut xn = x.clone();
            rms_norm_rows(&mut xn, &layer.input_norm, c.rms_norm_eps);
            let mut qkv = layer.qkv.forward(&xn, t, &mut self.scratch, simd)?;
            let mut q = vec![0f32; t * qd];
            let rope_tmp = || vec![0f32; if ggml_rope { hd } else { 0 }];
            qkv.par_chunks_mut(qkv_w).zip(q.par_chunks_mut(qd)).enumerate().for_each_init(
                rope_tmp,
                |tmp, (i, (row, qrow))| {
                    let (cs, sn) = (&cos[i * half..(i + 1) * half], &sin[i * half..(i + 1) * half]);
                    let (qpart, rest) = row.split_at_mut(qd);
                    let heads = qpart.chunks_exact_mut(hd).map(|h| (h, &layer.q_norm));
                    for (head, norm) in heads.chain(rest[..kvd].chunks_exact_mut(hd).map(|h| (h, &layer.k_norm))) {
                        if let Some(w) = norm {
                            rms_norm_rows(head, w, c.rms_norm_eps);
                        }
                        if ggml_rope {
                            rope_ggml_interleaved(head, cs, sn, tmp, simd);
                        } else {
                            rope(head, cs, sn);
                        }
                    }
                    qrow.copy_from_slice(qpart);
                },
            );
            for (i, tok) in tokens.iter().enumerate() {
                let row = &qkv[i * qkv_w..(i + 1) * qkv_w];
                self.kv.write(li, tok.table, tok.pos, &row[qd..qd + kvd], &row[qd + kvd..]);
            }
            let mut attn = vec![0f32; t * qd];
            paged_attention(&self.kv, li, &shape, &tokens, &q, &mut attn, simd);
            let mut o = vec![0f32; t * h];
            layer.o.forward(&attn, t, &mut o, &mut self.scratch, simd)?;
            all_reduce(&self.tp, &mut o)?;
            for (a, b) in x.iter_mut().zip(&o) {
                *a += b;
            }
            let mut xn = x.clone();
            rms_norm_rows(&mut xn, &layer.post_norm, c.rms_norm_eps);
            let gu = layer.gate_up.forward(&xn, t, &mut self.scratch, simd)?;
            let inter = c.intermediate_size;
            let mut act = vec![0f32; t * inter];
            act.par_chunks_mut(inter).zip(gu.par_chunks(2 * inter)).for_each(|(a, g)| {
                let (gate, up) = g.split_at(inter);
                swiglu(gate, up, a, simd);
            });
            let mut d = vec![0f32; t * h];
            layer.down.forward(&act, t, &mut d, &mut self.scratch, simd)?;
            all_reduce(&self.tp, &mut d)?;
            for (a, b) in x.iter_mut().zip(&d) {
                *a += b;
            }
            if let Some(taps) = taps.as_mut() {
                taps.offer(li, |r, out| out.copy_from_slice(&x[r * h..(r + 1) * h]));
            }
            if li < last_layer && yield_now.is_some_and(|y| y.load(Ordering::Acquire)) {
                let rows = batch.iter().map(|s| (s.start_pos, s.tokens.len())).collect();
                self.suspended = Some(SuspendedStep { x, next_layer: li + 1, rows });
                return Ok(StepRun::Suspended { after_layer: li });
            }
        }
        self.last_taps = taps.map(TapRecorder::finish);

        // Only the rows that asked for logits go through the final norm and the vocabulary.
        let mut offsets = Vec::with_capacity(batch.len() + 1);
        let mut rows = Vec::new();
        let mut start = 0;
        offsets.push(0);
        for s in batch {
            let end = start + s.tokens.len();
            rows.extend(end - s.logits_rows..end);
            offsets.push(rows.len());
            start = end;
        }
        let m = rows.len();
        let mut xs = Vec::with_capacity(m * h);
        for &r in &rows {
            xs.extend_from_slice(&x[r * h..(r + 1) * h]);
        }
        rms_norm_rows(&mut xs, &self.final_norm, c.rms_norm_eps);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let mut local = vec![0f32; m * head.rows];
        head.forward(&xs, m, &mut local, &mut self.scratch, simd)?;
        let data = match &self.tp {
            None => local,
            Some(tp) => gather_vocab(tp, &local, m, c.vocab_size)?,
        };
        Ok(StepRun::Done(StepLogits { vocab: c.vocab_size, data, offsets }))
    }

    /// Vocabulary-parallel embedding: a rank fills the rows it holds, the rest stay zero, and
    /// the all-reduce assembles every row (exactly: one rank contributes each value).
    fn embed_rows(&self, ids: &[u32]) -> Result<Vec<f32>, BackendError> {
        let h = self.cfg.hidden_size;
        let vocab_start = self.tp.as_ref().map_or(0, |tp| tp.vocab.start);
        let mut x = vec![0f32; ids.len() * h];
        for (row, &id) in x.chunks_exact_mut(h).zip(ids) {
            let local = (id as usize).wrapping_sub(vocab_start);
            if local < self.embed.rows {
                self.embed.row_f32(local, row);
            }
        }
        self.all_reduce(&mut x)?;
        Ok(x)
    }

    /// Checks, runs and (under tensor parallelism) fails the group together: every forward entry.
    fn run_checked(
        &mut self,
        batch: &[SeqStep<'_>],
        resume: Option<SuspendedStep>,
        yield_now: Option<&AtomicBool>,
    ) -> Result<StepRun, BackendError> {
        self.last_taps = None;
        validate_batch(batch, self.kv.geom)?;
        check_token_ids(batch, self.cfg.vocab_size)?;
        let pool = std::sync::Arc::clone(&self.pool);
        let out = pool.install(|| self.forward_inner(batch, resume, yield_now));
        // A rank that fails mid-step releases the others from the collective they wait in.
        if let (Err(e), Some(tp)) = (&out, &self.tp) {
            tp.comm.abort(&e.to_string());
        }
        out
    }

    fn all_reduce(&self, buf: &mut [f32]) -> Result<(), BackendError> {
        all_reduce(&self.tp, buf)
    }
}

/// Sum a row-parallel partial result over the ranks (nothing to do unsharded).
fn all_reduce(tp: &Option<TpRuntime>, buf: &mut [f32]) -> Result<(), BackendError> {
    match tp {
        Some(tp) => tp.comm.all_reduce_sum(buf).map_err(|e| BackendError::Device(format!("tensor parallel: {e}"))),
        None => Ok(()),
    }
}

/// Join the ranks' logits slices (`local` is `[m, this rank's vocab slice]`) into `[m, vocab]`.
fn gather_vocab(tp: &TpRuntime, local: &[f32], m: usize, vocab: usize) -> Result<Vec<f32>, BackendError> {
    gather_vocab_slices(tp.comm.as_ref(), &tp.vocab, local, m, vocab)
}

/// Join vocabulary-parallel logits slices (`local` is `[m, mine.len()]`, this rank's rows `mine`
/// of [`TpRank::vocab`]) into `[m, vocab]`. Every slice but the last has `ceil(vocab / world)`
/// columns; the last is zero-padded to that width for the all-gather and the padding dropped after.
pub(crate) fn gather_vocab_slices(
    comm: &dyn Collective,
    mine: &Range<usize>,
    local: &[f32],
    m: usize,
    vocab: usize,
) -> Result<Vec<f32>, BackendError> {
    if m == 0 {
        return Ok(Vec::new());
    }
    let world = comm.world_size();
    let per = vocab.div_ceil(world);
    let mine = mine.len();
    let mut padded = vec![0f32; m * per];
    for (dst, src) in padded.chunks_exact_mut(per).zip(local.chunks_exact(mine.max(1))) {
        dst[..mine].copy_from_slice(&src[..mine]);
    }
    let mut all = vec![0f32; world * m * per];
    comm.all_gather(&padded, &mut all).map_err(|e| BackendError::Device(format!("tensor parallel: {e}")))?;
    let mut data = vec![0f32; m * vocab];
    for (r, part) in all.chunks_exact(m * per).enumerate() {
        let (start, end) = ((r * per).min(vocab), ((r + 1) * per).min(vocab));
        for (i, row) in part.chunks_exact(per).enumerate() {
            data[i * vocab + start..i * vocab + end].copy_from_slice(&row[..end - start]);
        }
    }
    Ok(data)
}

impl Backend for CpuBackend {
    fn device_name(&self) -> String {
        "cpu".into()
    }

    fn kv_geometry(&self) -> KvGeometry {
        self.kv.geom
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }

    fn kv_block_bytes(&self) -> usize {
        self.kv.block_image_bytes()
    }

    fn read_kv_blocks(&mut self, blocks: &[u32]) -> Result<Vec<u8>, BackendError> {
        validate_kv_image(blocks, blocks.len() * self.kv_block_bytes(), self.kv_block_bytes(), self.kv.geom)?;
        Ok(self.kv.read_blocks(blocks))
    }

    fn write_kv_blocks(&mut self, blocks: &[u32], image: &[u8]) -> Result<(), BackendError> {
        validate_kv_image(blocks, image.len(), self.kv_block_bytes(), self.kv.geom)?;
        self.kv.write_blocks(blocks, image);
        Ok(())
    }

    fn abort_collectives(&self, reason: &str) {
        if let Some(tp) = &self.tp {
            tp.comm.abort(reason);
        }
    }

    fn set_hidden_taps(&mut self, layers: &[usize]) -> Result<(), BackendError> {
        check_tap_layers(layers, self.layers.len())?;
        self.tap_layers = layers.to_vec();
        Ok(())
    }

    fn take_hidden_taps(&mut self) -> Option<HiddenTaps> {
        self.last_taps.take()
    }

    fn forward(&mut self, batch: &[SeqStep<'_>]) -> Result<StepLogits, BackendError> {
        match self.run_checked(batch, None, None)? {
            StepRun::Done(logits) => Ok(logits),
            StepRun::Suspended { .. } => {
                Err(BackendError::InvalidStep("a step without a yield signal suspended".into()))
            }
        }
    }

    /// Only unsharded (every rank would have to stop at the same layer) and without hidden-state
    /// taps (a drafter reads every layer's rows of one step).
    fn can_yield(&self) -> bool {
        self.tp.is_none() && self.tap_layers.is_empty()
    }

    fn forward_yielding(&mut self, batch: &[SeqStep<'_>], yield_now: &AtomicBool) -> Result<StepRun, BackendError> {
        if !self.can_yield() {
            return self.forward(batch).map(StepRun::Done);
        }
        if self.suspended.is_some() {
            return Err(BackendError::InvalidStep("a step is suspended already; resume or drop it first".into()));
        }
        self.run_checked(batch, None, Some(yield_now))
    }

    fn resume_suspended(&mut self, batch: &[SeqStep<'_>], yield_now: &AtomicBool) -> Result<StepRun, BackendError> {
        let Some(s) = self.suspended.take() else {
            return Err(BackendError::InvalidStep("no suspended step to resume".into()));
        };
        let rows: Vec<(usize, usize)> = batch.iter().map(|s| (s.start_pos, s.tokens.len())).collect();
        if rows != s.rows {
            return Err(BackendError::InvalidStep(format!(
                "resuming a suspended step of rows {:?} with a batch of rows {rows:?}",
                s.rows
            )));
        }
        self.run_checked(batch, Some(s), Some(yield_now))
    }

    fn drop_suspended(&mut self) {
        self.suspended = None;
    }
}

/// A step stopped between layers (`Backend::forward_yielding`): what resuming it needs besides
/// its batch, which the caller keeps.
struct SuspendedStep {
    /// The residual stream of every row after the last layer run.
    x: Vec<f32>,
    next_layer: usize,
    /// `(start_pos, tokens)` per sequence: the batch a resume must bring back.
    rows: Vec<(usize, usize)>,
}

#[cfg(test)]
mod tests;
