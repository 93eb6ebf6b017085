//! The llama forward pass as a sequence of launches on the backend's stream (decode-sized steps
//! captured once as CUDA graphs and replayed), the step's scratch buffers (grown on demand,
//! reused across steps), greedy picking on the device, KV images, and the ceiling measurements
//! the benchmark divides by.

use std::collections::HashMap;

use super::decode::{
    allow_dynamic_smem, fused_decode_fits, launch_gemv, mma_attention_smem, AttnDims, AttnLaunch, GemvArgs, GemvKind,
    RopeParams,
};
use super::gpu::{cfg, grid_for, DevBuf, Gpu, Precision};
use super::plan::{AttnKernels, StepLayout, ROWS_PER_ITEM};
use super::quant::{self, LinearWeight};
use super::shard;
use super::CudaBackend;
use crate::backend::{BackendError, SeqStep};
use crate::launch;

/// Named device buffers that only ever grow.
#[derive(Default)]
pub struct Scratch {
    bufs: HashMap<&'static str, DevBuf>,
    /// Bumped whenever a buffer moves (captured graphs hold its old address).
    pub generation: u64,
}

impl Scratch {
    pub(super) fn get(&mut self, gpu: &Gpu, name: &'static str, bytes: usize) -> Result<u64, BackendError> {
        let grow = self.bufs.get(name).is_none_or(|b| b.bytes() < bytes);
        if grow {
            // Drop the old one first so peak memory is one copy; 1/8 headroom limits regrowth.
            self.bufs.remove(name);
            self.bufs.insert(name, gpu.alloc(bytes + bytes / 8)?);
            self.generation += 1;
        }
        Ok(self.bufs[name].ptr())
    }

    /// Like `get`, but a newly allocated buffer is zeroed (the attention tiles' counters,
    /// which the kernel leaves at zero after every use).
    pub(super) fn get_zeroed(&mut self, gpu: &Gpu, name: &'static str, bytes: usize) -> Result<u64, BackendError> {
        let before = self.generation;
        let ptr = self.get(gpu, name, bytes)?;
        if self.generation != before {
            let len = self.bufs[name].bytes();
            // SAFETY: `ptr` is a live allocation of `len` bytes owned by this scratch.
            unsafe { cudarc::driver::result::memset_d8_async(ptr, 0, len, gpu.stream.cu_stream()) }
                .map_err(|e| super::gpu::dev_err("clearing the attention counters", e))?;
        }
        Ok(ptr)
    }
}

/// Threads per row for RMSNorm and the q/k/v RoPE kernel: one block per token row, so at decode
/// sizes the whole launch is one or a few blocks and its loads must all be in flight at once.
const NORM_THREADS: u32 = 1024;

/// Captured decode graphs kept at once (a decode batch needs a new one every 256 tokens of
/// context, when its key splits change, or when a scratch buffer grows).
const MAX_GRAPHS: usize = 32;

/// Everything a captured step's launches depend on besides values in device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphKey {
    tokens: usize,
    logit_rows: usize,
    seqs: usize,
    items: usize,
    decode_items: usize,
    max_splits: usize,
    generation: u64,
    /// Tapped layers (their copies are part of the captured launches).
    taps: usize,
}

/// A captured graph owned by the backend.
pub struct StepGraph(cudarc::driver::CudaGraph);

// SAFETY: graph and executable-graph handles are plain driver handles, valid from any thread
// once the context is current; the backend binds its context before every use and is used by
// one thread at a time (`&mut self`).
unsafe impl Send for StepGraph {}

/// Streaming multiprocessors of the backend's device (the decode split policy aims at them).
fn sm_count(gpu: &Gpu) -> Result<usize, BackendError> {
    let attr = cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
    let n = gpu.ctx.attribute(attr).map_err(|e| super::gpu::dev_err("reading the SM count", e))?;
    Ok(n.max(1) as usize)
}

/// Pack several i32/i64 host arrays into one upload; returns each array's device address.
fn upload_layout(gpu: &Gpu, scratch: &mut Scratch, l: &StepLayout) -> Result<[u64; 10], BackendError> {
    // Block tables last: they grow every few tokens, and nothing after them moves when they do.
    let parts: [&[i32]; 9] = [
        &l.ids,
        &l.positions,
        &l.table_off,
        &l.items,
        &l.token_splits,
        &l.logit_rows,
        &l.mma_items,
        &l.decode_items,
        &l.tables,
    ];
    let mut words: Vec<i32> = Vec::new();
    // i64 row offsets first (8-byte aligned), as pairs of i32 words.
    for &o in &l.row_off {
        words.extend([(o & 0xffff_ffff) as u32 as i32, (o >> 32) as i32]);
    }
    let mut starts = [0usize; 10];
    for (i, p) in parts.iter().enumerate() {
        starts[i + 1] = words.len();
        words.extend_from_slice(p);
    }
    let base = scratch.get(gpu, "layout", words.len().max(1) * 4)?;
    gpu.copy_htod_in_order(base, &words)?;
    let mut ptrs = [0u64; 10];
    for (p, s) in ptrs.iter_mut().zip(starts) {
        *p = base + 4 * s as u64;
    }
    Ok(ptrs)
}

impl CudaBackend {
    /// Run the step; its logits rows (f32, row-major) are at the returned address until the next
    /// step (a larger step may re-allocate the buffer, so the address is only taken here). With
    /// hidden-state taps on, the tapped rows come to the host once, after the step.
    pub(super) fn forward_device(&mut self, batch: &[SeqStep<'_>]) -> Result<(StepLayout, u64), BackendError> {
        self.last_taps = None;
        let layout = self.enqueue_step(batch)?;
        if !self.tap_layers.is_empty() {
            let h = self.cfg.hidden_size;
            let mut offsets = Vec::with_capacity(batch.len() + 1);
            offsets.push(0);
            for s in batch {
                offsets.push(offsets.last().copied().unwrap_or(0) + s.tokens.len());
            }
            let rows = layout.tokens();
            let mut data = vec![0f32; rows * self.tap_layers.len() * h];
            let src = self.scratch.get(&self.gpu, "hidden_taps", data.len() * 4)?;
            self.gpu.copy_dtoh(&mut data, src)?;
            self.last_taps =
                Some(crate::backend::HiddenTaps { layers: self.tap_layers.clone(), hidden: h, data, offsets });
        }
        let logits = self.scratch.bufs.get("logits").map_or(0, DevBuf::ptr);
        Ok((layout, logits))
    }

    fn enqueue_step(&mut self, batch: &[SeqStep<'_>]) -> Result<StepLayout, BackendError> {
        let c = self.cfg.clone();
        let (h, hd, nh, nkv, inter) =
            (c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size);
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let group = nh / nkv;
        let mma = self.prec == Precision::Bf16 && (hd == 64 || hd == 128) && self.tensor_cores;
        // The streaming decode kernel is built for head sizes 64 and 128 and ≤ ROWS_PER_ITEM
        // query rows per tile (so at most that many q heads per kv head).
        let streaming_decode = self.streaming_decode && (hd == 64 || hd == 128) && group <= ROWS_PER_ITEM;
        let mma_tiles = self.prefill_tiles;
        let kernels = AttnKernels { mma, mma_tiles, streaming_decode, sm_count: sm_count(&self.gpu)? };
        let layout = StepLayout::new(batch, self.kv_layout, c.vocab_size, nkv, group, kernels)?;
        let t = layout.tokens();
        let (prec, sfx, eb) = (self.prec, self.prec.suffix(), self.prec.bytes());
        let gpu = &mut self.gpu;
        let s = &mut self.scratch;
        let [row_off, ids, positions, table_off, items, token_splits, logit_rows, mma_items, decode_items, tables] =
            upload_layout(gpu, s, &layout)?;
        let x = s.get(gpu, "x", t * h * 4)?;
        let xn = s.get(gpu, "xn", t * h.max(qd) * eb)?;
        let qkv = s.get(gpu, "qkv", t * (qd + 2 * kvd) * 4)?;
        let q = s.get(gpu, "q", t * qd * 4)?;
        let attn = s.get(gpu, "attn", t * qd * eb)?;
        let gu = s.get(gpu, "gate_up", t * 2 * inter * 4)?;
        let act = s.get(gpu, "act", t * inter * eb)?;
        let part_acc = s.get(gpu, "part_acc", layout.max_splits * t * nh * hd * 4)?;
        let part_ml = s.get(gpu, "part_ml", layout.max_splits * t * nh * 2 * 4)?;
        let counters = s.get_zeroed(gpu, "attn_counters", t * nkv * 4)?;
        let m = layout.logit_rows.len();
        let xs = s.get(gpu, "final_x", m.max(1) * h * eb)?;
        let logits = s.get(gpu, "logits", m.max(1) * c.vocab_size * 4)?;
        let tp_logits = shard::reserve_logits_scratch(gpu, s, &self.tp, m)?;
        // Hidden-state taps: every row's residual after each tapped layer, side by side.
        let ntaps = self.tap_layers.len();
        let taps = if ntaps > 0 { s.get(gpu, "hidden_taps", t * ntaps * h * 4)? } else { 0 };
        // Packed (quantized) projections run the unfused path, each matrix product dispatched on
        // its weight (`quant::matmul`); prefill-sized steps dequantize one matrix at a time here.
        let packed = self.weights.has_packed();
        let dequant = if packed && quant::PackedPolicy::current().may_dequantize(t) {
            s.get(gpu, "dequant", self.weights.max_packed_elems() * eb)?
        } else {
            0
        };

        // Decode-sized steps run on the fused GEMVs (no cuBLAS, no tensor-core items) and replay
        // a captured CUDA graph: same shapes and buffers, same launches, no launch gaps.
        let fused = fused_decode_fits(t, &[h, qd, inter]) && layout.mma_items.is_empty();
        let fused_layers = fused && !packed;
        // RoPE joins the q/k/v GEMV unless q/k are normed per head first (that needs the whole head).
        let rope_fused = fused_layers && self.weights.layers.iter().all(|l| l.q_norm.is_none() && l.k_norm.is_none());
        let graph_key = (self.cuda_graphs && fused).then_some(GraphKey {
            tokens: t,
            logit_rows: m,
            seqs: layout.table_off.len(),
            items: layout.items.len(),
            decode_items: layout.decode_items.len(),
            max_splits: layout.max_splits,
            generation: s.generation,
            taps: ntaps,
        });
        if let Some(g) = graph_key.as_ref().and_then(|k| self.graphs.get(k)) {
            g.0.launch().map_err(|e| super::gpu::dev_err("graph launch", e))?;
            return Ok(layout);
        }
        if graph_key.is_some() {
            gpu.stream
                .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| super::gpu::dev_err("begin graph capture", e))?;
        }
        let enqueued = (|| -> Result<(), BackendError> {
            let embed_f = gpu.func("llama", &format!("embed_{sfx}"))?;
            let norm_f = gpu.func("llama", &format!("rmsnorm_{sfx}"))?;
            let rope_f = gpu.func("llama", &format!("qkv_rope_store_{sfx}"))?;
            let swiglu_f = gpu.func("llama", &format!("swiglu_{sfx}"))?;
            let bias_f = gpu.func("llama", "add_bias")?;
            let chunks = hd.div_ceil(32).next_power_of_two();
            let partial_f = gpu.func("attention", &format!("attn_partial_c{chunks}_{sfx}"))?;
            let combine_f = gpu.func("attention", &format!("attn_combine_{sfx}"))?;
            let mma_f = if mma { Some(gpu.func("attention_mma", &mma_tiles.kernel(hd))?) } else { None };
            let decode_f =
                if streaming_decode { Some(gpu.func("attention", &format!("attn_decode_d{hd}_{sfx}"))?) } else { None };
            let attn_smem = ((2 * 32 * (hd + 1) + ROWS_PER_ITEM * hd) * 4) as u32;
            allow_dynamic_smem(&partial_f, attn_smem)?;
            let mma_smem = mma_attention_smem(hd);
            if let Some(f) = &mma_f {
                allow_dynamic_smem(f, mma_smem)?;
            }

            let (h32, eps) = (h as i32, c.rms_norm_eps);
            let null = 0u64;
            let embed_ptr = self.weights.embed.ptr();
            launch!(gpu, embed_f, cfg((t as u32, 1), 256, 0), &ids, &embed_ptr, &x, &h32)?;
            let rope_p = RopeParams {
                mode: self.rope.mode,
                theta_scale: self.rope.theta_scale,
                freq_scale: self.rope.freq_scale,
            };
            let freqs = self.rope.table.as_ref().map_or(0, DevBuf::ptr);
            let (nh32, nkv32, hd32, inter32) = (nh as i32, nkv as i32, hd as i32, inter as i32);
            let mut attn_args = AttnLaunch {
                q,
                k_base: 0,
                v_base: 0,
                tables,
                table_off,
                positions,
                dims: AttnDims {
                    block_stride: self.kv_layout.block_elems() as i64,
                    nh: nh32,
                    nkv: nkv32,
                    hd: hd32,
                    block_size: self.kv_layout.block_size as i32,
                    window: c.sliding_window.unwrap_or(0) as i32,
                    total_tokens: t as i32,
                    scale: 1.0 / (hd as f32).sqrt(),
                },
                part_acc,
                part_ml,
            };
            let add_bias = |gpu: &Gpu, y: u64, b: &Option<DevBuf>, cols: usize| -> Result<(), BackendError> {
                if let Some(b) = b {
                    let (bp, cols32, n) = (b.ptr(), cols as i32, (t * cols) as i64);
                    launch!(gpu, bias_f.clone(), cfg((grid_for(t * cols, 256), 1), 256, 0), &y, &bp, &cols32, &n)?;
                }
                Ok(())
            };
            let ptr = |b: &Option<DevBuf>| b.as_ref().map_or(0, DevBuf::ptr);
            // A fused GEMV over `t` token rows reading the residual stream `x` (or `input`).
            let gemv = |w: u64, bias: &Option<DevBuf>, n: usize, k: usize| GemvArgs {
                x,
                w,
                bias: ptr(bias),
                m: t as i32,
                n: n as i32,
                k: k as i32,
                eps,
                ..Default::default()
            };
            // The residual's RMSNorm with weights `w` into `xn`, the GEMM input of the cuBLAS path.
            let rmsnorm = |gpu: &Gpu, w: u64| -> Result<(), BackendError> {
                launch!(gpu, norm_f.clone(), cfg((t as u32, 1), NORM_THREADS, 0), &x, &null, &w, &xn, &h32, &eps)
            };
            // Copy the residual after layer `li` into the columns of the layers that tap it.
            let tap_layers = &self.tap_layers;
            let tap = |gpu: &Gpu, li: usize| -> Result<(), BackendError> {
                for (col, _) in tap_layers.iter().enumerate().filter(|(_, &l)| l == li) {
                    let dst = taps + (col * h * 4) as u64;
                    shard::copy_2d(gpu, dst, ntaps * h * 4, x, h * 4, h * 4, t)?;
                }
                Ok(())
            };
            let dense = |w: &LinearWeight| w.dense().map_or(0, DevBuf::ptr);
            // `y (+)= x · wᵀ` over the step's rows, whatever `w`'s format.
            let matmul = |gpu: &mut Gpu, w: &LinearWeight, k: usize, x: u64, y: u64, acc: bool| {
                let io = quant::MatmulIo { x, y, ldy: w.rows(), dequant };
                quant::matmul(gpu, prec, w, t, k, io, acc)
            };
            for (li, lw) in self.weights.layers.iter().enumerate() {
                let kbase = self.kv.at(self.kv_layout.layer_offset(li) * eb);
                let vbase = kbase + (self.kv_layout.plane_elems() * eb) as u64;
                let (qn, kn) = (ptr(&lw.q_norm), ptr(&lw.k_norm));
                let norm_in = lw.input_norm.ptr();
                let rope = |gpu: &Gpu| -> Result<(), BackendError> {
                    launch!(
                        gpu,
                        rope_f.clone(),
                        cfg((t as u32, 1), NORM_THREADS, 0),
                        &qkv,
                        &q,
                        &kbase,
                        &vbase,
                        &row_off,
                        &positions,
                        &qn,
                        &kn,
                        &freqs,
                        &rope_p,
                        &eps,
                        &nh32,
                        &nkv32,
                        &hd32
                    )
                };
                if rope_fused {
                    let a = GemvArgs {
                        norm_w: norm_in,
                        y: q,
                        k_cache: kbase,
                        v_cache: vbase,
                        row_off,
                        pos: positions,
                        freqs,
                        rp: rope_p,
                        nh: nh32,
                        nkv: nkv32,
                        hd: hd32,
                        ..gemv(dense(&lw.qkv), &lw.qkv_bias, qd + 2 * kvd, h)
                    };
                    launch_gemv(gpu, GemvKind::NormRope, prec, &a)?;
                } else if fused_layers {
                    let a = GemvArgs { norm_w: norm_in, y: qkv, ..gemv(dense(&lw.qkv), &lw.qkv_bias, qd + 2 * kvd, h) };
                    launch_gemv(gpu, GemvKind::Norm, prec, &a)?;
                    rope(gpu)?;
                } else {
                    rmsnorm(gpu, norm_in)?;
                    matmul(gpu, &lw.qkv, h, xn, qkv, false)?;
                    add_bias(gpu, qkv, &lw.qkv_bias, qd + 2 * kvd)?;
                    rope(gpu)?;
                }
                attn_args.k_base = kbase;
                attn_args.v_base = vbase;
                if let Some(f) = &decode_f {
                    attn_args.launch_streaming(gpu, f, decode_items, layout.num_decode_items(), counters, attn)?;
                }
                attn_args.launch(gpu, &partial_f, (items, layout.num_items()), 128, attn_smem)?;
                if let Some(f) = &mma_f {
                    let (n, shape) = (layout.num_mma_items(), (mma_tiles.threads(), mma_smem));
                    attn_args.launch_prefill_mma(gpu, f, (mma_items, n), shape, attn)?;
                }
                if layout.needs_combine() {
                    launch!(
                        gpu,
                        combine_f.clone(),
                        cfg((t as u32, nh as u32), hd.next_multiple_of(32) as u32, 0),
                        &part_acc,
                        &part_ml,
                        &token_splits,
                        &attn,
                        &attn_args.dims
                    )?;
                }
                let norm_post = lw.post_norm.ptr();
                let accumulate = shard::residual_accumulates(&self.tp);
                if fused_layers {
                    let o = GemvArgs { x: attn, y: x, ..gemv(dense(&lw.o), &lw.o_bias, h, qd) };
                    shard::gemv_add_row_parallel(gpu, &self.tp, prec, &o, t * h)?;
                    let a = GemvArgs {
                        norm_w: norm_post,
                        y: act,
                        ..gemv(dense(&lw.gate_up), &lw.gate_up_bias, 2 * inter, h)
                    };
                    launch_gemv(gpu, GemvKind::NormSwiglu, prec, &a)?;
                    let down = GemvArgs { x: act, y: x, ..gemv(dense(&lw.down), &lw.down_bias, h, inter) };
                    shard::gemv_add_row_parallel(gpu, &self.tp, prec, &down, t * h)?;
                    tap(gpu, li)?;
                    continue;
                }
                matmul(gpu, &lw.o, qd, attn, x, accumulate)?;
                add_bias(gpu, x, &lw.o_bias, h)?;
                shard::all_reduce(&self.tp, x, t * h)?;
                rmsnorm(gpu, norm_post)?;
                matmul(gpu, &lw.gate_up, h, xn, gu, false)?;
                add_bias(gpu, gu, &lw.gate_up_bias, 2 * inter)?;
                // One row per grid row (up to 65 535, then grid-stride), four columns per thread.
                let (rows, col_blocks) = (t as i32, inter.div_ceil(4 * 256) as u32);
                let grid = (col_blocks, t.min(65_535) as u32);
                launch!(gpu, swiglu_f.clone(), cfg(grid, 256, 0), &gu, &act, &inter32, &rows)?;
                matmul(gpu, &lw.down, inter, act, x, accumulate)?;
                add_bias(gpu, x, &lw.down_bias, h)?;
                shard::all_reduce(&self.tp, x, t * h)?;
                tap(gpu, li)?;
            }
            if m > 0 {
                let w = self.weights.final_norm.ptr();
                let head = self.weights.lm_head.as_ref().unwrap_or(&self.weights.embed);
                if self.tp.is_none() && fused_decode_fits(m, &[h]) {
                    // Final norm of the logits rows and the LM head in one pass.
                    let a = GemvArgs {
                        rows: logit_rows,
                        norm_w: w,
                        y: logits,
                        m: m as i32,
                        ..gemv(head.ptr(), &None, c.vocab_size, h)
                    };
                    launch_gemv(gpu, GemvKind::Norm, prec, &a)?;
                } else {
                    launch!(gpu, norm_f, cfg((m as u32, 1), NORM_THREADS, 0), &x, &logit_rows, &w, &xs, &h32, &eps)?;
                    shard::lm_head(gpu, &self.tp, &tp_logits, prec, (m, c.vocab_size, h), xs, head.ptr(), logits)?;
                }
            }
            Ok(())
        })();
        if let Some(key) = graph_key {
            let captured = gpu.stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
            enqueued?;
            let graph = captured
                .map_err(|e| super::gpu::dev_err("end graph capture", e))?
                .ok_or_else(|| BackendError::Device("graph capture produced no graph".into()))?;
            graph.launch().map_err(|e| super::gpu::dev_err("graph launch", e))?;
            if self.graphs.len() >= MAX_GRAPHS {
                self.graphs.clear();
            }
            self.graphs.insert(key, StepGraph(graph));
        } else {
            enqueued?;
        }
        Ok(layout)
    }

    /// Bytes of one block's KV image (every layer's K and V, in the storage precision).
    pub fn kv_block_bytes(&self) -> usize {
        self.kv_layout.block_elems() * self.prec.bytes()
    }

    /// The KV contents of `blocks`, block after block.
    pub fn read_kv_blocks(&mut self, blocks: &[u32]) -> Result<Vec<u8>, BackendError> {
        let bb = self.kv_block_bytes();
        crate::backend::validate_kv_image(blocks, blocks.len() * bb, bb, self.geom)?;
        self.gpu.bind()?;
        let staging = self.copy_blocks(blocks)?;
        let mut image = vec![0u8; blocks.len() * bb];
        self.gpu.copy_dtoh(&mut image, staging)?;
        Ok(image)
    }

    /// `read_kv_blocks` without waiting: the gather runs in stream order, the copy to the host
    /// beside later steps, and `done` gets the image on the page mover's thread.
    pub fn read_kv_blocks_then(
        &mut self,
        blocks: &[u32],
        done: crate::backend::PageImageDone,
    ) -> Result<(), BackendError> {
        let bb = self.kv_block_bytes();
        if let Err(e) = crate::backend::validate_kv_image(blocks, blocks.len() * bb, bb, self.geom) {
            done(Err(e));
            return Ok(());
        }
        let (f, copy) = self.page_mover_copy(blocks.len(), blocks.len() * bb)?;
        let mover = self.page_mover.as_ref().expect("made by page_mover_copy");
        mover.read(
            &self.gpu,
            blocks.len() * bb,
            |gpu, dst| launch_copy_blocks(gpu, &f, BlockCopy { staging: dst, ..copy }, blocks, false),
            done,
        )
    }

    /// Write an image from `read_kv_blocks` into `blocks`, through the page mover's pinned slots:
    /// ordered before every later step on the main stream, without waiting for the device here.
    pub fn write_kv_blocks(&mut self, blocks: &[u32], image: &[u8]) -> Result<(), BackendError> {
        let bb = self.kv_block_bytes();
        crate::backend::validate_kv_image(blocks, image.len(), bb, self.geom)?;
        if blocks.is_empty() {
            return Ok(());
        }
        let (f, copy) = self.page_mover_copy(blocks.len(), image.len())?;
        let mover = self.page_mover.as_ref().expect("made by page_mover_copy");
        mover.write(&self.gpu, image, |gpu, src| {
            launch_copy_blocks(gpu, &f, BlockCopy { staging: src, ..copy }, blocks, true)
        })
    }

    /// The page mover (made for pages of `page_bytes` on first use), the block copy kernel and
    /// its addresses but the staging one (the mover's slot).
    fn page_mover_copy(
        &mut self,
        blocks: usize,
        page_bytes: usize,
    ) -> Result<(cudarc::driver::CudaFunction, BlockCopy), BackendError> {
        self.gpu.bind()?;
        if self.page_mover.is_none() {
            self.page_mover = Some(super::page_mover::PageMover::new(&self.gpu, page_bytes)?);
        }
        let ids = self.scratch.get(&self.gpu, "kv_block_ids", blocks * 4)?;
        let f = self.gpu.func("llama", "copy_blocks")?;
        Ok((f, BlockCopy { cache: self.kv.ptr(), staging: 0, ids, block_bytes: self.kv_block_bytes() }))
    }

    /// Gather `blocks` into the staging buffer.
    fn copy_blocks(&mut self, blocks: &[u32]) -> Result<u64, BackendError> {
        let bb = self.kv_block_bytes();
        if blocks.is_empty() {
            return Ok(0);
        }
        let staging = self.scratch.get(&self.gpu, "kv_staging", blocks.len() * bb)?;
        let ids = self.scratch.get(&self.gpu, "kv_block_ids", blocks.len() * 4)?;
        let f = self.gpu.func("llama", "copy_blocks")?;
        let copy = BlockCopy { cache: self.kv.ptr(), staging, ids, block_bytes: bb };
        launch_copy_blocks(&self.gpu, &f, copy, blocks, false)?;
        Ok(staging)
    }
}

/// Device addresses of one block copy: the KV store, the packed image and the id buffer.
#[derive(Clone, Copy)]
struct BlockCopy {
    cache: u64,
    staging: u64,
    ids: u64,
    block_bytes: usize,
}

/// Uploads `blocks` into the id buffer (in stream order: the driver stages pageable memory at
/// once, so the next copy may reuse the buffer) and launches `copy_blocks`: the blocks gathered
/// from the store into the staging image, or with `scatter` the image written into them.
fn launch_copy_blocks(
    gpu: &Gpu,
    f: &cudarc::driver::CudaFunction,
    c: BlockCopy,
    blocks: &[u32],
    scatter: bool,
) -> Result<(), BackendError> {
    gpu.copy_htod_in_order(c.ids, blocks)?;
    let (bb64, dir) = (c.block_bytes as i64, i32::from(scatter));
    let grid = (grid_for(c.block_bytes, 256).min(1024), blocks.len() as u32);
    launch!(gpu, f.clone(), cfg(grid, 256, 0), &c.cache, &c.staging, &c.ids, &bb64, &dir)
}

/// Copy bandwidth (bytes read + written per second) and bf16 GEMM rate (FLOP/s), medians.
pub fn measure_ceilings(gpu: &mut Gpu, bytes: usize, n: usize, reps: usize) -> Result<(f64, f64), BackendError> {
    gpu.bind()?;
    let timed = |gpu: &Gpu, f: &mut dyn FnMut() -> Result<(), BackendError>| -> Result<f64, BackendError> {
        let mut times = Vec::with_capacity(reps);
        f()?;
        gpu.sync()?;
        for _ in 0..reps {
            let t0 = std::time::Instant::now();
            f()?;
            gpu.sync()?;
            times.push(t0.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    };
    let (src, dst) = (gpu.alloc(bytes)?, gpu.alloc(bytes)?);
    // Random bits, not zeros: zeros can run faster than real data.
    let fill = gpu.func("llama", "fill_uniform_f32")?;
    for (b, seed) in [(&src, 1u64), (&dst, 2)] {
        let (p, n, c, sc) = (b.ptr(), (bytes / 4) as i64, 0f32, 1f32);
        launch!(gpu, fill.clone(), cfg((8192, 1), 256, 0), &p, &n, &seed, &c, &sc)?;
    }
    let copy_s = timed(gpu, &mut || gpu.copy_dtod(dst.ptr(), src.ptr(), bytes))?;
    drop((src, dst));
    let (a, b, y) = (gpu.alloc(n * n * 2)?, gpu.alloc(n * n * 2)?, gpu.alloc(n * n * 4)?);
    let fill = gpu.func("llama", "fill_uniform_bf16")?;
    for (buf, seed) in [(&a, 3u64), (&b, 4)] {
        let (p, cnt, c, sc) = (buf.ptr(), (n * n) as i64, 0f32, 1f32);
        launch!(gpu, fill.clone(), cfg((8192, 1), 256, 0), &p, &cnt, &seed, &c, &sc)?;
    }
    let gemm_s = timed(gpu, &mut || gpu.gemm(Precision::Bf16, n, n, n, a.ptr(), b.ptr(), y.ptr(), false))?;
    Ok((2.0 * bytes as f64 / copy_s, 2.0 * (n as f64).powi(3) / gemm_s))
}
