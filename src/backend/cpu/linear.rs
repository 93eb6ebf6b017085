//! Dense projections on the CPU: weights kept in their stored block format (quantized GGML
//! blocks and the group-scaled formats of quantized safetensors checkpoints — FP8 blocks, int4,
//! NVFP4 — stay quantized; 16-bit floats are widened to f32 at load) and multiplied with rayon.
//! Every output element is the same `dot_*` operation sequence over one weight row and one
//! activation row whether it is computed alone or in a tile with other rows, so the result for a
//! row never depends on the other rows in the batch (exactness rule 3).

use std::ops::Range;

use rayon::prelude::*;

use crate::backend::BackendError;
use crate::model::quant::packed::{dot_packed_block, PackedRows};
use crate::model::quant::{dot_f32_rows, dot_q_block, quantize_row_q8, BlockQ8, DOT_TILE, QK};
use crate::model::{DType, ModelError, TensorView, WeightSource};

/// Weight rows in one of the supported storage formats.
#[derive(Clone)]
pub enum WeightRows {
    F32(Vec<f32>),
    Quant {
        dtype: DType,
        data: Vec<u8>,
    },
    /// A quantized safetensors checkpoint's codes and scales, multiplied with f32 activations.
    Packed(PackedRows),
    /// Projections with one input stacked by rows whose formats differ (a quantized projection
    /// beside a plain one), each computed in its own format.
    Parts(Vec<CpuLinear>),
}

impl WeightRows {
    /// Bytes held in memory.
    pub fn bytes(&self) -> usize {
        match self {
            WeightRows::F32(v) => v.len() * 4,
            WeightRows::Quant { data, .. } => data.len(),
            WeightRows::Packed(p) => p.bytes(),
            WeightRows::Parts(parts) => parts.iter().map(|p| p.weight.bytes()).sum(),
        }
    }
}

#[derive(Clone)]
pub struct CpuLinear {
    pub rows: usize,
    pub cols: usize,
    pub weight: WeightRows,
    pub bias: Option<Vec<f32>>,
}

/// Whether weights stored as `dtype` stay in that format in memory (the GGML blocks the dot
/// kernels read); every other format is widened to f32 at load.
pub fn stays_quantized(dtype: DType) -> bool {
    matches!(dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q4_K | DType::Q5_K | DType::Q6_K)
}

fn to_rows(view: &TensorView<'_>) -> WeightRows {
    if stays_quantized(view.dtype) {
        WeightRows::Quant { dtype: view.dtype, data: view.data.to_vec() }
    } else {
        WeightRows::F32(crate::model::tensor::to_f32(view))
    }
}

/// Load a vector (norm weight, bias) as f32, checking its length.
pub fn load_vector(w: &dyn WeightSource, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    let t = w.expect(name, &[len])?;
    Ok(crate::model::tensor::to_f32(&t))
}

impl CpuLinear {
    /// Load `name.weight` (`[out, inp]`) and, when `bias`, `name.bias`.
    pub fn load(w: &dyn WeightSource, name: &str, out: usize, inp: usize, bias: bool) -> Result<Self, ModelError> {
        let load_bias = || if bias { load_vector(w, &format!("{name}.bias"), out).map(Some) } else { Ok(None) };
        if let Some(p) = crate::model::quantized::load_linear(w, name, out, inp)? {
            return Ok(CpuLinear { rows: out, cols: inp, weight: WeightRows::Packed(p), bias: load_bias()? });
        }
        let view = w.expect(&format!("{name}.weight"), &[out, inp])?;
        let block = view.dtype.block_elems();
        if view.dtype.is_quantized() && !inp.is_multiple_of(block) {
            return Err(ModelError::Format {
                file: w.file_of(name),
                msg: format!(
                    "{} tensor `{name}.weight` has {inp} columns, not a multiple of its block ({block})",
                    view.dtype
                ),
            });
        }
        Ok(CpuLinear { rows: out, cols: inp, weight: to_rows(&view), bias: load_bias()? })
    }

    /// Stack several projections with the same input into one (`[Σout, inp]`) so one parallel
    /// pass computes them all. Falls back to `None` when their storage formats differ.
    pub fn concat(parts: Vec<CpuLinear>) -> Result<CpuLinear, Vec<CpuLinear>> {
        let same_format =
            parts.windows(2).all(|p| match (&p[0].weight, &p[1].weight) {
                (WeightRows::F32(_), WeightRows::F32(_)) => true,
                (WeightRows::Quant { dtype: a, .. }, WeightRows::Quant { dtype: b, .. }) => a == b,
                (WeightRows::Packed(a), WeightRows::Packed(b)) => a.format == b.format,
                _ => false,
            }) && parts.windows(2).all(|p| p[0].cols == p[1].cols && p[0].bias.is_some() == p[1].bias.is_some());
        if !same_format || parts.is_empty() {
            return Err(parts);
        }
        let cols = parts[0].cols;
        let rows = parts.iter().map(|p| p.rows).sum();
        let bias =
            parts[0].bias.is_some().then(|| parts.iter().flat_map(|p| p.bias.clone().unwrap_or_default()).collect());
        if matches!(parts[0].weight, WeightRows::Packed(_)) {
            let packed = parts
                .into_iter()
                .map(|p| match p.weight {
                    WeightRows::Packed(p) => p,
                    _ => unreachable!("checked: every part is packed"),
                })
                .collect();
            let weight = WeightRows::Packed(PackedRows::concat(packed).unwrap_or_else(|_| unreachable!("same format")));
            return Ok(CpuLinear { rows, cols, weight, bias });
        }
        // Move each part's rows into the stack instead of cloning them: no transient second copy
        // of the weights at load.
        let dtype = match &parts[0].weight {
            WeightRows::Quant { dtype, .. } => Some(*dtype),
            _ => None,
        };
        let mut f32_rows = Vec::new();
        let mut bytes = Vec::new();
        for p in parts {
            match p.weight {
                WeightRows::F32(v) => f32_rows.extend(v),
                WeightRows::Quant { data, .. } => bytes.extend(data),
                WeightRows::Packed(_) | WeightRows::Parts(_) => unreachable!("checked: plain or GGML rows"),
            }
        }
        let weight = match dtype {
            None => WeightRows::F32(f32_rows),
            Some(dtype) => WeightRows::Quant { dtype, data: bytes },
        };
        Ok(CpuLinear { rows, cols, weight, bias })
    }

    /// Stack projections with one input whatever their formats: one stacked matrix when
    /// [`concat`](Self::concat) can make one, else the parts side by side ([`WeightRows::Parts`]).
    pub fn stack_mixed(parts: Vec<CpuLinear>) -> Result<CpuLinear, Vec<CpuLinear>> {
        match CpuLinear::concat(parts) {
            Ok(l) => Ok(l),
            Err(parts) if parts.is_empty() || parts.windows(2).any(|p| p[0].cols != p[1].cols) => Err(parts),
            Err(parts) => {
                let (rows, cols) = (parts.iter().map(|p| p.rows).sum(), parts[0].cols);
                Ok(CpuLinear { rows, cols, weight: WeightRows::Parts(parts), bias: None })
            }
        }
    }

    /// Keep only output rows `range` (a column-parallel shard). Quantized rows are whole rows, so
    /// they stay in their stored format.
    pub fn take_rows(self, range: Range<usize>) -> CpuLinear {
        if range == (0..self.rows) {
            return self;
        }
        let weight = match self.weight {
            WeightRows::F32(v) => WeightRows::F32(v[range.start * self.cols..range.end * self.cols].to_vec()),
            WeightRows::Quant { dtype, data } => {
                let rb = dtype.storage_bytes(self.cols).unwrap_or(0);
                WeightRows::Quant { dtype, data: data[range.start * rb..range.end * rb].to_vec() }
            }
            WeightRows::Packed(p) => WeightRows::Packed(p.take_rows(range.clone())),
            WeightRows::Parts(parts) => {
                let mut start = 0;
                let mut kept = Vec::new();
                for p in parts {
                    let (a, b) = (range.start.max(start), range.end.min(start + p.rows));
                    let offset = start;
                    start += p.rows;
                    if a < b {
                        kept.push(p.take_rows(a - offset..b - offset));
                    }
                }
                WeightRows::Parts(kept)
            }
        };
        let bias = self.bias.map(|b| b[range.clone()].to_vec());
        CpuLinear { rows: range.len(), cols: self.cols, weight, bias }
    }

    /// Keep only input columns `range` (a row-parallel shard whose partial outputs are summed
    /// across ranks); the bias is kept only where `keep_bias` (one rank adds it, or the sum would
    /// count it once per rank). Quantized rows stay quantized when the range falls on block
    /// boundaries; otherwise this tensor is dequantized to f32, because a block cannot be split.
    pub fn take_cols(self, range: Range<usize>, keep_bias: bool) -> CpuLinear {
        let bias = if keep_bias { self.bias } else { None };
        if range == (0..self.cols) {
            return CpuLinear { bias, ..self };
        }
        let (rows, cols) = (self.rows, self.cols);
        let weight = match self.weight {
            WeightRows::F32(v) => WeightRows::F32(crate::parallel::plan::take_cols(&v, cols, range.clone())),
            WeightRows::Quant { dtype, data }
                if range.start.is_multiple_of(dtype.block_elems()) && range.end.is_multiple_of(dtype.block_elems()) =>
            {
                let (rb, bb, be) = (dtype.storage_bytes(cols).unwrap_or(0), dtype.block_bytes(), dtype.block_elems());
                let (a, b) = (range.start / be * bb, range.end / be * bb);
                WeightRows::Quant {
                    dtype,
                    data: data.chunks_exact(rb).flat_map(|row| row[a..b].iter().copied()).collect(),
                }
            }
            WeightRows::Quant { dtype, data } => {
                let rb = dtype.storage_bytes(cols).unwrap_or(0);
                let mut full = vec![0f32; rows * cols];
                for (src, dst) in data.chunks_exact(rb).zip(full.chunks_exact_mut(cols)) {
                    crate::model::quant::dequantize_into(dtype, src, dst);
                }
                WeightRows::F32(crate::parallel::plan::take_cols(&full, cols, range.clone()))
            }
            WeightRows::Parts(parts) => {
                WeightRows::Parts(parts.into_iter().map(|p| p.take_cols(range.clone(), keep_bias)).collect())
            }
            WeightRows::Packed(p) => match p.take_cols(range.clone()) {
                Some(cut) => WeightRows::Packed(cut),
                // As for GGML blocks: a group's shared scale cannot be split.
                None => WeightRows::F32(crate::parallel::plan::take_cols(&p.dequantize(), cols, range.clone())),
            },
        };
        CpuLinear { rows, cols: range.len(), weight, bias }
    }

    /// The f32 values of row `r` (used for embedding lookups).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        match &self.weight {
            WeightRows::F32(v) => out.copy_from_slice(&v[r * self.cols..(r + 1) * self.cols]),
            WeightRows::Quant { dtype, data } => {
                let rb = dtype.storage_bytes(self.cols).unwrap_or(0);
                crate::model::quant::dequantize_into(*dtype, &data[r * rb..(r + 1) * rb], out);
            }
            WeightRows::Packed(p) => p.dequantize_row(r, out),
            WeightRows::Parts(parts) => {
                let mut r = r;
                for p in parts {
                    if r < p.rows {
                        return p.row_f32(r, out);
                    }
                    r -= p.rows;
                }
            }
        }
    }

    /// `y[m, rows] = x[m, cols] · Wᵀ (+ bias)`, using `scratch`'s buffers (grown as needed, kept
    /// for the next call).
    pub fn forward(
        &self,
        x: &[f32],
        m: usize,
        y: &mut [f32],
        scratch: &mut LinearScratch,
        simd: bool,
    ) -> Result<(), BackendError> {
        if x.len() != m * self.cols || y.len() != m * self.rows {
            return Err(BackendError::InvalidStep(format!(
                "linear {}x{}: input {} / output {} elements for {m} rows",
                self.rows,
                self.cols,
                x.len(),
                y.len()
            )));
        }
        if m == 0 {
            return Ok(());
        }
        if let WeightRows::Parts(parts) = &self.weight {
            let mut col = 0;
            for p in parts {
                let mut part = vec![0f32; m * p.rows];
                p.forward(x, m, &mut part, scratch, simd)?;
                for (yr, pr) in y.chunks_exact_mut(self.rows).zip(part.chunks_exact(p.rows)) {
                    yr[col..col + p.rows].copy_from_slice(pr);
                }
                col += p.rows;
            }
            return Ok(());
        }
        // Work is split over weight rows so each weight row is read once for all m inputs;
        // results land transposed (one contiguous run of m values per weight row). Chunks are
        // large enough that a step issues few tasks, small enough that both threads finish
        // together.
        let chunk = (self.rows / (rayon::current_num_threads() * 4)).clamp(8, 256);
        let yt = grow(&mut scratch.yt, m * self.rows);
        match &self.weight {
            WeightRows::F32(w) => {
                let cols = self.cols;
                // As for quantized weights: activation rows in L1-sized groups (~16 KiB) while
                // the chunk's weight rows pass over them; within a group each weight row is
                // loaded once per tile of rows (`dot_f32_rows`, bitwise equal to `dot_f32`).
                let group = (16384 / (cols * 4)).max(1).div_ceil(DOT_TILE) * DOT_TILE;
                yt.par_chunks_mut(chunk * m).enumerate().for_each(|(ci, out)| {
                    for t0 in (0..m).step_by(group) {
                        let t1 = (t0 + group).min(m);
                        for (j, o) in out.chunks_exact_mut(m).enumerate() {
                            let r = ci * chunk + j;
                            dot_f32_rows(&w[r * cols..(r + 1) * cols], &x[t0 * cols..t1 * cols], &mut o[t0..t1], simd);
                        }
                    }
                });
            }
            WeightRows::Quant { dtype, data } => {
                let nb = self.cols / QK;
                let xq = grow(&mut scratch.xq, m * nb);
                if m >= 4 {
                    xq.par_chunks_mut(nb).zip(x.par_chunks(self.cols)).for_each(|(q, xr)| quantize_row_q8(xr, q, simd));
                } else {
                    xq.chunks_mut(nb).zip(x.chunks(self.cols)).for_each(|(q, xr)| quantize_row_q8(xr, q, simd));
                }
                let xq = &*xq;
                let rb = dtype.storage_bytes(self.cols).unwrap_or(0);
                // Activation rows are taken in groups that stay in L1 (~16 KiB of Q8 blocks)
                // while the chunk's weight rows pass over them; within a group the dot kernel
                // decodes each weight block once per tile of rows.
                let group = (16384 / (nb * std::mem::size_of::<BlockQ8>())).max(1).div_ceil(DOT_TILE) * DOT_TILE;
                yt.par_chunks_mut(chunk * m).enumerate().for_each(|(ci, out)| {
                    let w = &data[ci * chunk * rb..(ci * chunk + out.len() / m) * rb];
                    for t0 in (0..m).step_by(group) {
                        let t1 = (t0 + group).min(m);
                        dot_q_block(*dtype, w, &xq[t0 * nb..t1 * nb], nb, &mut out[t0..], m, simd);
                    }
                });
            }
            WeightRows::Packed(p) => {
                let cols = self.cols;
                // As for f32 rows: activation rows in L1-sized groups, each weight group decoded
                // once per tile of rows.
                let group = (16384 / (cols * 4)).max(1).div_ceil(DOT_TILE) * DOT_TILE;
                yt.par_chunks_mut(chunk * m).enumerate().for_each(|(ci, out)| {
                    let r0 = ci * chunk;
                    let rows = r0..r0 + out.len() / m;
                    for t0 in (0..m).step_by(group) {
                        let t1 = (t0 + group).min(m);
                        dot_packed_block(p, rows.clone(), &x[t0 * cols..t1 * cols], &mut out[t0..], m, simd);
                    }
                });
            }
            WeightRows::Parts(_) => unreachable!("computed part by part above"),
        }
        let yt = &*yt;
        let rows = self.rows;
        let add_bias = |yr: &mut [f32]| {
            if let Some(b) = &self.bias {
                for (v, bb) in yr.iter_mut().zip(b) {
                    *v += bb;
                }
            }
        };
        if m == 1 {
            y.copy_from_slice(yt);
            add_bias(y);
        } else {
            // Back to one row per input, 8 inputs per task: each weight row's 8 results are one
            // contiguous read.
            y.par_chunks_mut(rows * 8).enumerate().for_each(|(bi, yb)| {
                let (i0, n) = (bi * 8, yb.len() / rows);
                for (r, src) in yt.chunks_exact(m).enumerate() {
                    for (k, &v) in src[i0..i0 + n].iter().enumerate() {
                        yb[k * rows + r] = v;
                    }
                }
                yb.chunks_exact_mut(rows).for_each(add_bias);
            });
        }
        Ok(())
    }
}

/// Buffers a projection needs per call, owned by the backend and reused across calls and steps
/// so a decode step does not allocate them again for every projection.
#[derive(Default)]
pub struct LinearScratch {
    xq: Vec<BlockQ8>,
    yt: Vec<f32>,
}

/// The first `n` elements of `buf`, growing it when needed (contents are unspecified: every
/// caller overwrites them).
fn grow<T: Default + Clone>(buf: &mut Vec<T>, n: usize) -> &mut [T] {
    if buf.len() < n {
        buf.resize(n, T::default());
    }
    &mut buf[..n]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::quant::quantize_weight;

    /// Every row's f32 values.
    fn dense(l: &CpuLinear) -> Vec<f32> {
        let mut out = vec![0f32; l.rows * l.cols];
        out.chunks_exact_mut(l.cols).enumerate().for_each(|(r, row)| l.row_f32(r, row));
        out
    }

    fn linear(dtype: Option<DType>, rows: usize, cols: usize) -> CpuLinear {
        let vals: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919) % 201) as f32 / 100.0 - 1.0).collect();
        let weight = match dtype {
            None => WeightRows::F32(vals),
            Some(d) => WeightRows::Quant { dtype: d, data: quantize_weight(d, &vals) },
        };
        CpuLinear { rows, cols, weight, bias: Some((0..rows).map(|r| r as f32).collect()) }
    }

    #[test]
    fn shard_slices_equal_slices_of_the_dense_matrix() {
        let (rows, cols) = (6, 128);
        for dtype in [None, Some(DType::Q8_0), Some(DType::Q4_1)] {
            let full = dense(&linear(dtype, rows, cols));
            let r = linear(dtype, rows, cols).take_rows(2..5);
            assert_eq!(dense(&r), full[2 * cols..5 * cols], "{dtype:?}");
            assert_eq!(r.bias.as_deref(), Some(&[2.0, 3.0, 4.0][..]));
            // Block-aligned columns stay quantized; the bias goes only where asked.
            let c = linear(dtype, rows, cols).take_cols(32..96, false);
            assert_eq!(dense(&c), crate::parallel::plan::take_cols(&full, cols, 32..96), "{dtype:?}");
            assert!(c.bias.is_none());
            assert_eq!(matches!(c.weight, WeightRows::Quant { .. }), dtype.is_some());
            // Columns that split a block: widened to f32, values unchanged.
            let u = linear(dtype, rows, cols).take_cols(16..80, true);
            assert!(matches!(u.weight, WeightRows::F32(_)) && u.bias.is_some());
            assert_eq!(dense(&u), crate::parallel::plan::take_cols(&full, cols, 16..80), "{dtype:?}");
        }
    }

    /// K-quant rows are whole 256-weight super-blocks: a column shard stays quantized only on
    /// super-block boundaries (a 32-aligned range still splits a super-block's shared scales).
    #[test]
    fn k_quant_shards_split_only_on_super_blocks() {
        let (rows, cols) = (4, 512);
        for dtype in [DType::Q4_K, DType::Q5_K, DType::Q6_K] {
            let full = dense(&linear(Some(dtype), rows, cols));
            let r = linear(Some(dtype), rows, cols).take_rows(1..3);
            assert_eq!(dense(&r), full[cols..3 * cols], "{dtype:?}");
            let c = linear(Some(dtype), rows, cols).take_cols(256..512, true);
            assert!(matches!(c.weight, WeightRows::Quant { .. }), "{dtype:?}");
            assert_eq!(dense(&c), crate::parallel::plan::take_cols(&full, cols, 256..512), "{dtype:?}");
            let u = linear(Some(dtype), rows, cols).take_cols(32..288, true);
            assert!(matches!(u.weight, WeightRows::F32(_)), "{dtype:?}");
            assert_eq!(dense(&u), crate::parallel::plan::take_cols(&full, cols, 32..288), "{dtype:?}");
        }
    }
}
