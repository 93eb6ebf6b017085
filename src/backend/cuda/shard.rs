//! Tensor parallelism inside the CUDA backend: which rows and columns of each weight a rank keeps
//! (from [`crate::parallel::LlamaShard`]), cutting them on the host (loaded checkpoints) or on the
//! device (seeded synthetic weights, generated whole and then cut, so every rank count sees the
//! same model), and the two joins the forward pass makes: the all-reduce of the row-parallel
//! o_proj/down outputs and the all-gather of the vocabulary-parallel logits.
//!
//! The embedding stays whole on every rank: a lookup reads only the step's rows, so replicating
//! it costs memory, not bandwidth, and saves the all-reduce a vocabulary-parallel embedding needs.
//! The lm_head is cut by vocabulary into equal slices of `ceil(vocab / world)` rows, the last rank
//! padded with zero rows, so every rank's logits slice has the same width for the all-gather.

use std::ops::Range;
use std::sync::Arc;

use super::gpu::{dev_err, DevBuf, Gpu};
use crate::backend::BackendError;
use crate::config::LlamaConfig;
use crate::parallel::{DeviceCollective, LlamaShard, TpRank};

/// The part of a `[rows, cols]` matrix (or a vector, `cols = 1`) a rank keeps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cut {
    /// Output rows (column-parallel layers).
    Rows(Range<usize>),
    /// Input columns (row-parallel layers).
    Cols(Range<usize>),
    /// Output rows, then zero rows up to `to` rows (the vocabulary slices).
    PaddedRows { rows: Range<usize>, to: usize },
}

impl Cut {
    /// Rows of the result, for a source of `rows` rows.
    pub fn out_rows(&self, rows: usize) -> usize {
        match self {
            Cut::Rows(r) => r.len(),
            Cut::Cols(_) => rows,
            Cut::PaddedRows { to, .. } => *to,
        }
    }

    pub fn out_cols(&self, cols: usize) -> usize {
        match self {
            Cut::Cols(c) => c.len(),
            _ => cols,
        }
    }

    /// Whether the cut keeps all of a `[rows, cols]` matrix as it is.
    pub fn is_whole(&self, rows: usize, cols: usize) -> bool {
        match self {
            Cut::Rows(r) => *r == (0..rows),
            Cut::Cols(c) => *c == (0..cols),
            Cut::PaddedRows { rows: r, to } => *r == (0..rows) && *to == rows,
        }
    }

    /// Apply to a row-major host matrix of `cols` columns.
    pub fn apply<T: Copy + Default>(&self, m: &[T], cols: usize) -> Vec<T> {
        match self {
            Cut::Rows(r) => m[r.start * cols..r.end * cols].to_vec(),
            Cut::Cols(c) => m.chunks_exact(cols).flat_map(|row| row[c.clone()].iter().copied()).collect(),
            Cut::PaddedRows { rows, to } => {
                let mut out = m[rows.start * cols..rows.end * cols].to_vec();
                out.resize(to * cols, T::default());
                out
            }
        }
    }
}

/// What one CUDA rank holds of a llama-family model.
#[derive(Clone, Debug)]
pub struct RankSlices {
    pub tp: TpRank,
    /// Rows of q_proj (this rank's query heads × head_dim).
    pub q_rows: Range<usize>,
    /// Rows of k_proj and v_proj.
    pub kv_rows: Range<usize>,
    /// Rows of gate/up, columns of down.
    pub inter: Range<usize>,
    pub vocab: Range<usize>,
    /// Logits columns every rank computes (its lm_head rows, zero-padded on the last rank).
    pub vocab_per_rank: usize,
}

impl RankSlices {
    pub fn new(cfg: &LlamaConfig, tp: TpRank) -> Result<Self, BackendError> {
        let plan = LlamaShard::of_model(tp, cfg)
            .map_err(|e| BackendError::Unavailable { device: "cuda".into(), reason: e.to_string() })?;
        let hd = cfg.head_dim;
        Ok(RankSlices {
            tp,
            q_rows: plan.q_heads.start * hd..plan.q_heads.end * hd,
            kv_rows: plan.kv_heads.start * hd..plan.kv_heads.end * hd,
            inter: plan.intermediate,
            vocab: plan.vocab,
            vocab_per_rank: cfg.vocab_size.div_ceil(tp.world),
        })
    }

    /// Whether this rank holds the whole model.
    pub fn is_whole(&self) -> bool {
        self.tp.world == 1
    }

    /// Row-parallel layers' biases are added once, by rank 0, before the sum over ranks.
    pub fn keeps_row_parallel_bias(&self) -> bool {
        self.tp.rank == 0
    }

    /// The model as this rank computes it: its heads and MLP rows (the vocabulary stays whole:
    /// the logits are whole after the all-gather).
    pub fn local_config(&self, cfg: &LlamaConfig) -> LlamaConfig {
        let hd = cfg.head_dim;
        LlamaConfig {
            num_attention_heads: self.q_rows.len() / hd,
            num_key_value_heads: self.kv_rows.len() / hd,
            intermediate_size: self.inter.len(),
            ..cfg.clone()
        }
    }

    /// Rows the embedding buffer needs: the vocabulary, padded so that a tied lm_head's slice of
    /// `vocab_per_rank` rows from `vocab.start` stays inside it on the last rank.
    pub fn embed_rows(&self, cfg: &LlamaConfig) -> usize {
        if self.is_whole() {
            cfg.vocab_size
        } else {
            self.vocab_per_rank * self.tp.world
        }
    }

    pub fn lm_head_cut(&self, vocab: usize) -> Cut {
        if self.is_whole() {
            Cut::Rows(0..vocab)
        } else {
            Cut::PaddedRows { rows: self.vocab.clone(), to: self.vocab_per_rank }
        }
    }
}

/// A rank's runtime share of the group: its communicator and slices.
pub struct CudaTp {
    pub comm: Arc<dyn DeviceCollective>,
    pub slices: RankSlices,
}

impl CudaTp {
    fn err(e: crate::parallel::CollectiveError) -> BackendError {
        BackendError::Device(format!("tensor parallel: {e}"))
    }
}

/// Whether a row-parallel GEMM adds into the residual stream `x`: rank 0 does, the other ranks
/// overwrite their copy with their partial sum, so the all-reduce that follows yields
/// `x + Σ partials` on every rank (no extra buffer or kernel).
pub fn residual_accumulates(tp: &Option<CudaTp>) -> bool {
    tp.as_ref().is_none_or(|t| t.slices.tp.rank == 0)
}

/// A row-parallel projection by the fused decode GEMV, which can only add into the residual
/// `a.y` (`count` f32): the ranks other than 0 zero their copy first, so after the kernel it holds
/// their partial sum and the all-reduce yields `x + Σ partials`, as with [`residual_accumulates`].
pub fn gemv_add_row_parallel(
    gpu: &mut Gpu,
    tp: &Option<CudaTp>,
    prec: super::Precision,
    a: &super::decode::GemvArgs,
    count: usize,
) -> Result<(), BackendError> {
    if !residual_accumulates(tp) {
        // SAFETY: `a.y` is the step's residual buffer of at least `count` f32, on this stream.
        unsafe { cudarc::driver::result::memset_d8_async(a.y, 0, count * 4, gpu.stream.cu_stream()) }
            .map_err(|e| dev_err("clearing a rank's partial residual", e))?;
    }
    super::decode::launch_gemv(gpu, super::decode::GemvKind::Add, prec, a)?;
    all_reduce(tp, a.y, count)
}

/// Sum `count` f32 at `buf` over the ranks (nothing to do unsharded).
pub fn all_reduce(tp: &Option<CudaTp>, buf: u64, count: usize) -> Result<(), BackendError> {
    match tp {
        // SAFETY: `buf` is a scratch buffer of at least `count` f32 that outlives the step.
        Some(t) => unsafe { t.comm.all_reduce_sum_f32(buf, count) }.map_err(CudaTp::err),
        None => Ok(()),
    }
}

/// Scratch the vocabulary-parallel lm_head needs, reserved before a step (and before any graph
/// capture, which must not allocate): `(local, gathered)` addresses, or zeros unsharded.
pub struct LogitsScratch {
    pub local: u64,
    pub gathered: u64,
}

/// Reserve the sharded lm_head's scratch for `m` logits rows.
pub fn reserve_logits_scratch(
    gpu: &Gpu,
    s: &mut super::forward::Scratch,
    tp: &Option<CudaTp>,
    m: usize,
) -> Result<LogitsScratch, BackendError> {
    let Some(t) = tp else { return Ok(LogitsScratch { local: 0, gathered: 0 }) };
    let per = t.slices.vocab_per_rank;
    Ok(LogitsScratch {
        local: s.get(gpu, "tp_logits_local", m.max(1) * per * 4)?,
        gathered: s.get(gpu, "tp_logits_gathered", t.slices.tp.world * m.max(1) * per * 4)?,
    })
}

/// `logits[m, vocab] = xs[m, h] · headᵀ`, sharded: each rank computes its `vocab_per_rank`
/// columns into `scratch.local`, the all-gather stacks them rank after rank, and strided copies
/// place each rank's valid columns side by side in `logits`.
#[allow(clippy::too_many_arguments)]
pub fn lm_head(
    gpu: &mut Gpu,
    tp: &Option<CudaTp>,
    scratch: &LogitsScratch,
    prec: super::gpu::Precision,
    (m, vocab, h): (usize, usize, usize),
    xs: u64,
    head: u64,
    logits: u64,
) -> Result<(), BackendError> {
    let Some(t) = tp else {
        return gpu.gemm(prec, m, vocab, h, xs, head, logits, false);
    };
    let per = t.slices.vocab_per_rank;
    gpu.gemm(prec, m, per, h, xs, head, scratch.local, false)?;
    // SAFETY: `local` holds m·per f32 and `gathered` world·m·per (reserved by the caller).
    unsafe { t.comm.all_gather_f32(scratch.local, scratch.gathered, m * per) }.map_err(CudaTp::err)?;
    for r in 0..t.slices.tp.world {
        let start = (r * per).min(vocab);
        let cols = ((r + 1) * per).min(vocab) - start;
        if cols == 0 {
            continue;
        }
        let src = scratch.gathered + (r * m * per * 4) as u64;
        copy_2d(gpu, logits + (start * 4) as u64, vocab * 4, src, per * 4, cols * 4, m)?;
    }
    Ok(())
}

/// Strided device-to-device copy of `height` rows of `width` bytes, on the backend's stream.
pub fn copy_2d(
    gpu: &Gpu,
    dst: u64,
    dst_pitch: usize,
    src: u64,
    src_pitch: usize,
    width: usize,
    height: usize,
) -> Result<(), BackendError> {
    use cudarc::driver::sys;
    if width == 0 || height == 0 {
        return Ok(());
    }
    let copy = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: src,
        srcArray: std::ptr::null_mut(),
        srcPitch: src_pitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_pitch,
        WidthInBytes: width,
        Height: height,
    };
    // SAFETY: both regions lie inside live device allocations (callers size them); the struct
    // lives until the call returns, which is all the driver needs of it.
    unsafe { sys::cuMemcpy2DAsync_v2(&copy, gpu.stream.cu_stream()) }
        .result()
        .map_err(|e| dev_err("strided device copy", e))
}

/// Keep `parts` of a row-major device matrix of `cols` columns and `elem` bytes per value: each
/// part is a block of `rows` rows starting at row `at`, cut by its [`Cut`]; the results are
/// stacked in order. Returns the input itself when there is one part that keeps everything.
pub fn cut_device(
    gpu: &Gpu,
    src: DevBuf,
    cols: usize,
    elem: usize,
    parts: &[(usize, usize, Cut)],
) -> Result<DevBuf, BackendError> {
    if let [(0, rows, cut)] = parts {
        if cut.is_whole(*rows, cols) {
            return Ok(src);
        }
    }
    let out_elems: usize = parts.iter().map(|(_, rows, c)| c.out_rows(*rows) * c.out_cols(cols)).sum();
    let out = gpu.alloc(out_elems * elem)?;
    let mut at_out = 0usize;
    for (at, rows, cut) in parts {
        let base = src.ptr() + (at * cols * elem) as u64;
        let dst = out.ptr() + at_out as u64;
        match cut {
            Cut::Rows(r) => {
                gpu.copy_dtod(dst, base + (r.start * cols * elem) as u64, r.len() * cols * elem)?;
            }
            Cut::Cols(c) => {
                copy_2d(gpu, dst, c.len() * elem, base + (c.start * elem) as u64, cols * elem, c.len() * elem, *rows)?;
            }
            Cut::PaddedRows { rows: r, to } => {
                // SAFETY: `dst` has `to · cols · elem` bytes reserved in `out`.
                unsafe { cudarc::driver::result::memset_d8_async(dst, 0, to * cols * elem, gpu.stream.cu_stream()) }
                    .map_err(|e| dev_err("zeroing padding rows", e))?;
                gpu.copy_dtod(dst, base + (r.start * cols * elem) as u64, r.len() * cols * elem)?;
            }
        }
        at_out += cut.out_rows(*rows) * cut.out_cols(cols) * elem;
    }
    // The source is freed on return: the copies must have read it.
    gpu.sync()?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::synthetic::tiny_llama_config;

    #[test]
    fn cuts_on_the_host() {
        let m: Vec<f32> = (0..12).map(|x| x as f32).collect(); // 3 x 4
        assert_eq!(Cut::Rows(1..3).apply(&m, 4), (4..12).map(|x| x as f32).collect::<Vec<_>>());
        assert_eq!(Cut::Cols(2..4).apply(&m, 4), vec![2.0, 3.0, 6.0, 7.0, 10.0, 11.0]);
        let p = Cut::PaddedRows { rows: 2..3, to: 2 }.apply(&m, 4);
        assert_eq!(p, vec![8.0, 9.0, 10.0, 11.0, 0.0, 0.0, 0.0, 0.0]);
        assert!(Cut::Rows(0..3).is_whole(3, 4) && !Cut::Cols(0..3).is_whole(3, 4));
        assert_eq!((Cut::Cols(1..3).out_rows(3), Cut::Cols(1..3).out_cols(4)), (3, 2));
    }

    #[test]
    fn rank_slices_cover_the_model_and_pad_the_vocabulary() {
        let cfg = LlamaConfig { vocab_size: 101, ..tiny_llama_config() };
        let world = 2;
        let mut q = 0;
        let mut vocab = 0;
        for rank in 0..world {
            let s = RankSlices::new(&cfg, TpRank::new(rank, world).unwrap()).unwrap();
            let local = s.local_config(&cfg);
            assert_eq!(local.num_attention_heads * world, cfg.num_attention_heads);
            assert_eq!(local.vocab_size, cfg.vocab_size);
            assert_eq!(s.vocab_per_rank, 51);
            assert_eq!(s.embed_rows(&cfg), 102);
            assert_eq!(s.lm_head_cut(101).out_rows(101), 51);
            assert_eq!(s.keeps_row_parallel_bias(), rank == 0);
            q += s.q_rows.len();
            vocab += s.vocab.len();
        }
        assert_eq!(q, cfg.q_dim());
        assert_eq!(vocab, 101);
        let whole = RankSlices::new(&cfg, TpRank::single()).unwrap();
        assert!(whole.is_whole() && whole.lm_head_cut(101).is_whole(101, 8));
        assert_eq!(whole.embed_rows(&cfg), 101);
        let e = RankSlices::new(&cfg, TpRank::new(0, 3).unwrap()).unwrap_err().to_string();
        assert!(e.contains("does not divide"), "{e}");
    }
}
