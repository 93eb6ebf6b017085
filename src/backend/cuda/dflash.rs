//! The DFlash drafter's forward pass on the device (`--speculative dflash:DIR` with a CUDA
//! target): the compute of `spec::dflash::model` — which stays the reference and owns nothing
//! here — as cuBLAS GEMMs (weights in the target's precision, f32 accumulation, f32 residual) and
//! the kernels of `cuda/dflash.cu` plus llama.cu's embedding, RMSNorm and SwiGLU. The policy
//! (which rows are context, anchors, truncation) stays in `spec::dflash`, which calls this.
//!
//! Per sequence a context cache lives on the device: every layer's normed, rotated keys and
//! values of the context rows, then the rows' positions. The block pass runs all requesting
//! sequences at once (`block_size` rows each) and takes each draft row's argmax on the device, so
//! only token ids come back. DFlash2 (its dynamic convolutions and candidate selector) is not
//! implemented here; the caller keeps that drafter on the CPU.
//!
//! Owns: the drafter's device weights (and its copy of the target's embedding and output head),
//! the context caches, its own stream on the target's device. Must not touch the target backend.

use std::collections::HashMap;

use super::forward::Scratch;
use super::gpu::{cfg, grid_for, DevBuf, Gpu, Precision};
use super::shard::Cut;
use super::staging::{MatrixRuns, StagingUploader};
use crate::backend::BackendError;
use crate::launch;
use crate::model::llama::LlamaSpec;
use crate::model::tensor::to_f32;
use crate::model::{ModelBundle, WeightSource};
use crate::spec::dflash::config::DFlashConfig;

/// Where the drafter runs: the target's device and precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DFlashCudaOptions {
    pub ordinal: usize,
    pub precision: Precision,
}

struct Layer {
    input_norm: DevBuf,
    post_norm: DevBuf,
    /// `[q_dim + 2·kv_dim, hidden]`: q, k, v rows (the context projects through the k, v part).
    qkv: DevBuf,
    o: DevBuf,
    q_norm: Option<DevBuf>,
    k_norm: Option<DevBuf>,
    /// `[2·intermediate, hidden]`: gate rows, then up rows.
    gate_up: DevBuf,
    down: DevBuf,
}

/// One sequence's context on the device: `[layer][K|V][cap][kv_dim]` f32, then `cap` positions.
struct SeqCache {
    buf: DevBuf,
    cap: usize,
    rows: usize,
}

/// One sequence's share of a block pass.
#[derive(Clone, Copy, Debug)]
pub struct BlockRequest {
    pub seq: u64,
    /// The block's first token (the last known one) and its position.
    pub anchor: u32,
    pub anchor_pos: usize,
    /// Draft rows wanted (1..block_size).
    pub rows: usize,
}

pub struct CudaDFlash {
    gpu: Gpu,
    prec: Precision,
    cfg: DFlashConfig,
    layers: Vec<Layer>,
    fc: DevBuf,
    hidden_norm: DevBuf,
    norm: DevBuf,
    embed: DevBuf,
    lm_head: Option<DevBuf>,
    /// RoPE inverse frequencies as the CPU drafter computes them.
    inv_freq: DevBuf,
    vocab: usize,
    caches: HashMap<u64, SeqCache>,
    scratch: Scratch,
}

/// Threads of the row kernels (RMSNorm, q/k RoPE): a multiple of 32.
const ROW_THREADS: u32 = 256;

impl CudaDFlash {
    /// Load the drafter (`cfg`, its weights `w`) and the target's embedding and output head onto
    /// device `opts.ordinal`, stored in `opts.precision`.
    pub fn open(
        cfg: &DFlashConfig,
        w: &dyn WeightSource,
        target: &ModelBundle,
        opts: DFlashCudaOptions,
    ) -> Result<Self, BackendError> {
        if cfg.dflash2.is_some() {
            return Err(BackendError::Unavailable {
                device: format!("cuda:{}", opts.ordinal),
                reason: "DFlash2's convolutions and candidate selector have no CUDA kernels".into(),
            });
        }
        if cfg.head_dim > 256 {
            return Err(BackendError::Unavailable {
                device: format!("cuda:{}", opts.ordinal),
                reason: format!("drafter head_dim {} is above the kernel's 256", cfg.head_dim),
            });
        }
        let mut gpu = Gpu::open(opts.ordinal)?;
        gpu.bind()?;
        gpu.load_dflash()?;
        let prec = opts.precision;
        let c = cfg;
        let h = c.hidden_size;
        let (qd, kvd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let t = &target.config;
        let spec = LlamaSpec::new(t);
        let tw = target.weights.as_ref();
        let mut up = StagingUploader::new(&gpu, 0)?;
        let vector = |w: &dyn WeightSource, name: &str, len: usize| -> Result<DevBuf, BackendError> {
            gpu.upload(&to_f32(&w.expect(name, &[len])?))
        };
        let mut matrix = |gpu: &Gpu, w: &dyn WeightSource, parts: &[(&str, usize, usize)]| {
            let views = parts
                .iter()
                .map(|&(name, rows, cols)| Ok((w.expect(name, &[rows, cols])?, Cut::Rows(0..rows))))
                .collect::<Result<Vec<_>, BackendError>>()?;
            up.matrix(gpu, &MatrixRuns::new(&views), prec)
        };
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let p = format!("layers.{l}");
            let n = |s: &str| format!("{p}.{s}.weight");
            let opt_norm = |s: &str| -> Result<Option<DevBuf>, BackendError> {
                match w.tensor(&n(s)) {
                    Some(_) => Ok(Some(vector(w, &n(s), c.head_dim)?)),
                    None => Ok(None),
                }
            };
            let (q, k, v) = (n("self_attn.q_proj"), n("self_attn.k_proj"), n("self_attn.v_proj"));
            let (gate, upn) = (n("mlp.gate_proj"), n("mlp.up_proj"));
            layers.push(Layer {
                input_norm: vector(w, &n("input_layernorm"), h)?,
                post_norm: vector(w, &n("post_attention_layernorm"), h)?,
                qkv: matrix(&gpu, w, &[(&q, qd, h), (&k, kvd, h), (&v, kvd, h)])?,
                o: matrix(&gpu, w, &[(&n("self_attn.o_proj"), h, qd)])?,
                q_norm: opt_norm("self_attn.q_norm")?,
                k_norm: opt_norm("self_attn.k_norm")?,
                gate_up: matrix(&gpu, w, &[(&gate, c.intermediate_size, h), (&upn, c.intermediate_size, h)])?,
                down: matrix(&gpu, w, &[(&n("mlp.down_proj"), h, c.intermediate_size)])?,
            });
        }
        let fc = matrix(&gpu, w, &[("fc.weight", h, c.target_layer_ids.len() * h)])?;
        let embed = matrix(&gpu, tw, &[(&spec.embed, t.vocab_size, h)])?;
        let lm_head = if t.tie_word_embeddings {
            None
        } else {
            Some(matrix(&gpu, tw, &[(&spec.lm_head.weight(), t.vocab_size, h)])?)
        };
        up.finish()?;
        let inv: Vec<f32> =
            (0..c.head_dim / 2).map(|i| 1.0 / c.rope_theta.powf((2 * i) as f32 / c.head_dim as f32)).collect();
        let me = CudaDFlash {
            hidden_norm: vector(w, "hidden_norm.weight", h)?,
            norm: vector(w, "norm.weight", h)?,
            inv_freq: gpu.upload(&inv)?,
            gpu,
            prec,
            cfg: cfg.clone(),
            layers,
            fc,
            embed,
            lm_head,
            vocab: t.vocab_size,
            caches: HashMap::new(),
            scratch: Scratch::default(),
        };
        tracing::info!(device = me.gpu.ordinal, precision = ?prec, "DFlash drafter loaded on the GPU");
        Ok(me)
    }

    /// Bytes of one context row in a sequence's cache (every layer's K and V, and its position).
    fn row_bytes(&self) -> usize {
        (self.cfg.num_layers * 2 * self.cfg.num_kv_heads * self.cfg.head_dim + 1) * 4
    }

    /// Context rows of `seq` on the device.
    pub fn context_rows(&self, seq: u64) -> usize {
        self.caches.get(&seq).map_or(0, |c| c.rows)
    }

    /// Keep the first `rows` context rows of `seq`.
    pub fn truncate(&mut self, seq: u64, rows: usize) {
        if let Some(c) = self.caches.get_mut(&seq) {
            c.rows = c.rows.min(rows);
        }
    }

    pub fn forget(&mut self, seq: u64) {
        self.caches.remove(&seq);
    }

    /// Make room for `need` rows in `seq`'s cache, keeping its rows (capacity doubles).
    fn reserve(&mut self, seq: u64, need: usize) -> Result<(), BackendError> {
        let (layers, kvd) = (self.cfg.num_layers, self.cfg.num_kv_heads * self.cfg.head_dim);
        let (old_cap, rows) = self.caches.get(&seq).map_or((0, 0), |c| (c.cap, c.rows));
        if need <= old_cap {
            return Ok(());
        }
        let cap = need.max(2 * old_cap).max(64);
        let buf = self.gpu.alloc(cap * self.row_bytes())?;
        if let Some(old) = self.caches.get(&seq) {
            // Each plane and the positions move to their offsets at the new capacity.
            for plane in 0..=2 * layers {
                let width = if plane == 2 * layers { 4 } else { kvd * 4 };
                let (from, to) = (old.buf.ptr() + (plane * old_cap * kvd * 4) as u64, plane * cap * kvd * 4);
                if rows > 0 {
                    self.gpu.copy_dtod(buf.ptr() + to as u64, from, rows * width)?;
                }
            }
        }
        self.caches.insert(seq, SeqCache { buf, cap, rows });
        Ok(())
    }

    /// Project new context rows into the caches: `features[i]` (`[rows, taps·hidden]`, the
    /// target's tapped states as `spec::dflash` prepares them) at `positions[i]` for `seqs[i]`,
    /// appended after the rows each already has.
    pub fn add_context(
        &mut self,
        seqs: &[u64],
        features: &[Vec<f32>],
        positions: &[Vec<usize>],
    ) -> Result<(), BackendError> {
        let c = self.cfg.clone();
        let (h, hd, nkv) = (c.hidden_size, c.head_dim, c.num_kv_heads);
        let (qd, kvd) = (c.num_heads * hd, nkv * hd);
        let width = c.target_layer_ids.len() * h;
        let m: usize = positions.iter().map(Vec::len).sum();
        if m == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        let mut dst: Vec<i64> = Vec::with_capacity(4 * m);
        for (&seq, p) in seqs.iter().zip(positions) {
            let rows = self.context_rows(seq);
            self.reserve(seq, rows + p.len())?;
            let cache = &self.caches[&seq];
            for (i, &pos) in p.iter().enumerate() {
                dst.extend([cache.buf.ptr() as i64, cache.cap as i64, (rows + i) as i64, pos as i64]);
            }
        }
        let all: Vec<f32> = features.concat();
        let (prec, sfx, eb) = (self.prec, self.prec.suffix(), self.prec.bytes());
        let (gpu, s) = (&mut self.gpu, &mut self.scratch);
        let feat = s.get(gpu, "df_feat", m * width * 4)?;
        gpu.copy_htod_in_order(feat, &all)?;
        let dst_d = s.get(gpu, "df_dst", dst.len() * 8)?;
        gpu.copy_htod_in_order(dst_d, &dst)?;
        let feat_p = if prec == Precision::F32 {
            feat
        } else {
            let out = s.get(gpu, "df_feat_p", m * width * eb)?;
            let f = gpu.func("dflash", &format!("df_cast_{sfx}"))?;
            let n = (m * width) as i64;
            launch!(gpu, f, cfg((grid_for(m * width, 256).min(4096), 1), 256, 0), &feat, &out, &n)?;
            out
        };
        let ctx = s.get(gpu, "df_ctx", m * h * 4)?;
        let ctxn = s.get(gpu, "df_ctxn", m * h * eb)?;
        let kv = s.get(gpu, "df_kv", m * 2 * kvd * 4)?;
        gpu.gemm(prec, m, h, width, feat_p, self.fc.ptr(), ctx, false)?;
        let norm_f = gpu.func("llama", &format!("rmsnorm_{sfx}"))?;
        let (h32, eps, null) = (h as i32, c.rms_norm_eps, 0u64);
        let hn = self.hidden_norm.ptr();
        launch!(gpu, norm_f, cfg((m as u32, 1), ROW_THREADS, 0), &ctx, &null, &hn, &ctxn, &h32, &eps)?;
        let store_f = gpu.func("dflash", "df_ctx_store")?;
        let (nkv32, hd32, freqs) = (nkv as i32, hd as i32, self.inv_freq.ptr());
        let threads = (32 * nkv).clamp(32, 1024) as u32;
        for (l, layer) in self.layers.iter().enumerate() {
            let kv_w = layer.qkv.ptr() + (qd * h * eb) as u64;
            gpu.gemm(prec, m, 2 * kvd, h, ctxn, kv_w, kv, false)?;
            let (kn, l32) = (layer.k_norm.as_ref().map_or(0, DevBuf::ptr), l as i32);
            launch!(
                gpu,
                store_f.clone(),
                cfg((m as u32, 1), threads, 0),
                &kv,
                &dst_d,
                &kn,
                &freqs,
                &eps,
                &nkv32,
                &hd32,
                &l32
            )?;
        }
        let pos_f = gpu.func("dflash", "df_ctx_positions")?;
        let (layers32, kvd32, m32) = (c.num_layers as i32, kvd as i32, m as i32);
        launch!(gpu, pos_f, cfg((grid_for(m, 128), 1), 128, 0), &dst_d, &layers32, &kvd32, &m32)?;
        for (&seq, p) in seqs.iter().zip(positions) {
            if let Some(cache) = self.caches.get_mut(&seq) {
                cache.rows += p.len();
            }
        }
        Ok(())
    }

    /// Run the block pass for `blocks`; returns the device address of the draft rows' logits
    /// (`[rows, vocab]` f32, each block's wanted rows in order) and their count.
    fn block_pass(&mut self, blocks: &[BlockRequest]) -> Result<(u64, usize), BackendError> {
        let c = self.cfg.clone();
        let (h, hd, nh, nkv, bs, inter) =
            (c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads, c.block_size, c.intermediate_size);
        let (qd, kvd) = (nh * hd, nkv * hd);
        let m = blocks.len() * bs;
        let (mut ids, mut pos, mut meta, mut rows) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (bi, b) in blocks.iter().enumerate() {
            for i in 0..bs {
                ids.push(if i == 0 { b.anchor as i32 } else { c.mask_token_id as i32 });
                pos.push((b.anchor_pos + i) as i32);
            }
            let cache = self.caches.get(&b.seq);
            meta.extend([
                cache.map_or(0, |x| x.buf.ptr() as i64),
                cache.map_or(0, |x| x.cap as i64),
                cache.map_or(0, |x| x.rows as i64),
                b.anchor_pos as i64,
            ]);
            rows.extend((1..=b.rows.min(bs - 1)).map(|i| (bi * bs + i) as i32));
        }
        let n = rows.len();
        self.gpu.bind()?;
        let (prec, sfx, eb) = (self.prec, self.prec.suffix(), self.prec.bytes());
        let (gpu, s) = (&mut self.gpu, &mut self.scratch);
        let ids_d = s.get(gpu, "df_ids", m * 4)?;
        gpu.copy_htod_in_order(ids_d, &ids)?;
        let pos_d = s.get(gpu, "df_pos", m * 4)?;
        gpu.copy_htod_in_order(pos_d, &pos)?;
        let meta_d = s.get(gpu, "df_meta", meta.len() * 8)?;
        gpu.copy_htod_in_order(meta_d, &meta)?;
        let rows_d = s.get(gpu, "df_rows", n.max(1) * 4)?;
        gpu.copy_htod_in_order(rows_d, &rows)?;
        let x = s.get(gpu, "df_x", m * h * 4)?;
        let xn = s.get(gpu, "df_xn", m * h * eb)?;
        let qkv = s.get(gpu, "df_qkv", m * (qd + 2 * kvd) * 4)?;
        let attn = s.get(gpu, "df_attn", m * qd * eb)?;
        let gu = s.get(gpu, "df_gu", m * 2 * inter * 4)?;
        let act = s.get(gpu, "df_act", m * inter * eb)?;
        let xs = s.get(gpu, "df_xs", n.max(1) * h * eb)?;
        let logits = s.get(gpu, "df_logits", n.max(1) * self.vocab * 4)?;

        let (h32, eps, null) = (h as i32, c.rms_norm_eps, 0u64);
        let embed_f = gpu.func("llama", &format!("embed_{sfx}"))?;
        let embed = self.embed.ptr();
        launch!(gpu, embed_f, cfg((m as u32, 1), 256, 0), &ids_d, &embed, &x, &h32)?;
        if c.input_embedding_scale != 1.0 {
            let f = gpu.func("dflash", "df_scale")?;
            let (cnt, sc) = ((m * h) as i64, c.input_embedding_scale);
            launch!(gpu, f, cfg((grid_for(m * h, 256).min(4096), 1), 256, 0), &x, &cnt, &sc)?;
        }
        let norm_f = gpu.func("llama", &format!("rmsnorm_{sfx}"))?;
        let qk_f = gpu.func("dflash", "df_block_qk")?;
        let attn_f = gpu.func("dflash", &format!("df_attention_{sfx}"))?;
        let swiglu_f = gpu.func("llama", &format!("swiglu_{sfx}"))?;
        let (nh32, nkv32, hd32, bs32, inter32, m32) =
            (nh as i32, nkv as i32, hd as i32, bs as i32, inter as i32, m as i32);
        let (layers32, scale, freqs) = (c.num_layers as i32, 1.0 / (hd as f32).sqrt(), self.inv_freq.ptr());
        let qk_threads = (32 * (nh + nkv)).clamp(32, 1024) as u32;
        for (l, lw) in self.layers.iter().enumerate() {
            let w = lw.input_norm.ptr();
            launch!(gpu, norm_f.clone(), cfg((m as u32, 1), ROW_THREADS, 0), &x, &null, &w, &xn, &h32, &eps)?;
            gpu.gemm(prec, m, qd + 2 * kvd, h, xn, lw.qkv.ptr(), qkv, false)?;
            let (qn, kn) = (lw.q_norm.as_ref().map_or(0, DevBuf::ptr), lw.k_norm.as_ref().map_or(0, DevBuf::ptr));
            launch!(
                gpu,
                qk_f.clone(),
                cfg((m as u32, 1), qk_threads, 0),
                &qkv,
                &pos_d,
                &qn,
                &kn,
                &freqs,
                &eps,
                &nh32,
                &nkv32,
                &hd32
            )?;
            let (l32, window, causal) = (l as i32, c.sliding_window[l].unwrap_or(0) as i32, i32::from(c.causal[l]));
            launch!(
                gpu,
                attn_f.clone(),
                cfg((m as u32, nh as u32), 128, 0),
                &qkv,
                &meta_d,
                &attn,
                &bs32,
                &nh32,
                &nkv32,
                &hd32,
                &l32,
                &layers32,
                &window,
                &causal,
                &scale
            )?;
            // The residual adds fold into the GEMMs (y += x·wᵀ).
            gpu.gemm(prec, m, h, qd, attn, lw.o.ptr(), x, true)?;
            let w = lw.post_norm.ptr();
            launch!(gpu, norm_f.clone(), cfg((m as u32, 1), ROW_THREADS, 0), &x, &null, &w, &xn, &h32, &eps)?;
            gpu.gemm(prec, m, 2 * inter, h, xn, lw.gate_up.ptr(), gu, false)?;
            let grid = (inter.div_ceil(4 * 256) as u32, m.min(65_535) as u32);
            launch!(gpu, swiglu_f.clone(), cfg(grid, 256, 0), &gu, &act, &inter32, &m32)?;
            gpu.gemm(prec, m, h, inter, act, lw.down.ptr(), x, true)?;
        }
        if n == 0 {
            return Ok((logits, 0));
        }
        // Only the wanted draft rows (after each anchor) go through the vocabulary.
        let w = self.norm.ptr();
        launch!(gpu, norm_f, cfg((n as u32, 1), ROW_THREADS, 0), &x, &rows_d, &w, &xs, &h32, &eps)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed).ptr();
        gpu.gemm(prec, n, self.vocab, h, xs, head, logits, false)?;
        let cap = c.final_logit_softcapping.unwrap_or(0.0);
        if c.output_multiplier != 1.0 || cap > 0.0 {
            let f = gpu.func("dflash", "df_logit_post")?;
            let (cnt, mult) = ((n * self.vocab) as i64, c.output_multiplier);
            launch!(gpu, f, cfg((grid_for(n * self.vocab, 256).min(8192), 1), 256, 0), &logits, &cnt, &mult, &cap)?;
        }
        Ok((logits, n))
    }

    /// Greedy drafts of every block: each wanted row's argmax (lowest id among equal maxima),
    /// picked on the device.
    pub fn propose(&mut self, blocks: &[BlockRequest]) -> Result<Vec<Vec<u32>>, BackendError> {
        let (logits, n) = self.block_pass(blocks)?;
        let mut ids = vec![0i32; n];
        if n > 0 {
            let out = self.scratch.get(&self.gpu, "df_ids_out", n * 4)?;
            let f = self.gpu.func("sampling", "argmax_rows")?;
            let vocab = self.vocab as i32;
            launch!(self.gpu, f, cfg((n as u32, 1), 1024, 0), &logits, &vocab, &out)?;
            self.gpu.copy_dtoh(&mut ids, out)?;
        } else {
            self.gpu.sync()?;
        }
        let bs = self.cfg.block_size;
        let mut at = 0;
        Ok(blocks
            .iter()
            .map(|b| {
                let r = b.rows.min(bs - 1);
                at += r;
                ids[at - r..at].iter().map(|&i| i as u32).collect()
            })
            .collect())
    }

    /// The draft logits of every block's wanted rows, in order (tests compare them with the CPU).
    pub fn block_logits(&mut self, blocks: &[BlockRequest]) -> Result<Vec<f32>, BackendError> {
        let (logits, n) = self.block_pass(blocks)?;
        let mut out = vec![0f32; n * self.vocab];
        self.gpu.copy_dtoh(&mut out, logits)?;
        if n == 0 {
            self.gpu.sync()?;
        }
        Ok(out)
    }
}
