//! Model weights in device memory: matrices in the backend's storage precision (f16/f32/bf16
//! converted and GGUF blocks dequantized at load, through the `WeightSource`), q/k/v and
//! gate/up stacked into one matrix each so one GEMM computes them; norms and biases in f32.
//! A quantized safetensors checkpoint's projections (FP8 blocks, int4, NVFP4) stay packed as
//! stored ([`LinearWeight::Packed`], `quant`); stacking keeps each row's scales (NVFP4's global
//! is per row for this), and projections of different formats are stacked as parts.
//! Or seeded random weights generated on the device, for benchmarks of any size. A tensor-parallel
//! rank keeps its share of each tensor (`shard::RankSlices`).

use super::gpu::{cfg, grid_for, DevBuf, Gpu, Precision};
use super::quant::{DevPacked, LinearWeight};
use super::shard::{cut_device, Cut, RankSlices};
use super::staging::{MatrixRuns, StagingUploader};
use crate::backend::BackendError;
use crate::config::LlamaConfig;
use crate::launch;
use crate::model::llama::{LinearSpec, LlamaSpec};
use crate::model::quant::packed::PackedRows;
use crate::model::tensor::to_f32;
use crate::model::{quantized, TensorView, WeightSource};

pub struct LayerWeights {
    pub input_norm: DevBuf,
    /// `[q_dim + 2·kv_dim, hidden]`.
    pub qkv: LinearWeight,
    pub qkv_bias: Option<DevBuf>,
    pub q_norm: Option<DevBuf>,
    pub k_norm: Option<DevBuf>,
    pub o: LinearWeight,
    pub o_bias: Option<DevBuf>,
    pub post_norm: DevBuf,
    /// `[2·intermediate, hidden]`: gate rows, then up rows.
    pub gate_up: LinearWeight,
    pub gate_up_bias: Option<DevBuf>,
    pub down: LinearWeight,
    pub down_bias: Option<DevBuf>,
}

pub struct DeviceWeights {
    pub embed: DevBuf,
    pub layers: Vec<LayerWeights>,
    pub final_norm: DevBuf,
    /// `None` when tied to the embedding.
    pub lm_head: Option<DevBuf>,
}

impl DeviceWeights {
    /// Whether any projection is stored packed (the step then runs the unfused path).
    pub fn has_packed(&self) -> bool {
        self.max_packed_elems() > 0
    }

    /// Elements of the largest packed matrix (the prefill dequantize scratch), 0 if none.
    pub fn max_packed_elems(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| [&l.qkv, &l.o, &l.gate_up, &l.down])
            .map(LinearWeight::max_packed_elems)
            .max()
            .unwrap_or(0)
    }

    /// Bytes of matrices and vectors on the device (packed projections at their packed size).
    pub fn bytes(&self) -> usize {
        let opt = |b: &Option<DevBuf>| b.as_ref().map_or(0, DevBuf::bytes);
        self.embed.bytes()
            + self.final_norm.bytes()
            + opt(&self.lm_head)
            + self
                .layers
                .iter()
                .map(|l| {
                    l.input_norm.bytes()
                        + l.qkv.bytes()
                        + opt(&l.qkv_bias)
                        + opt(&l.q_norm)
                        + opt(&l.k_norm)
                        + l.o.bytes()
                        + opt(&l.o_bias)
                        + l.post_norm.bytes()
                        + l.gate_up.bytes()
                        + opt(&l.gate_up_bias)
                        + l.down.bytes()
                        + opt(&l.down_bias)
                })
                .sum::<usize>()
    }

    /// Load this rank's share (`slices`; the whole model at one rank) of every tensor of `w`,
    /// converting matrices to `prec`. Matrices stream from the map through the pinned staging
    /// ring ([`StagingUploader`]), read and converted on every core while earlier ones copy.
    pub fn load(
        gpu: &mut Gpu,
        c: &LlamaConfig,
        w: &dyn WeightSource,
        prec: Precision,
        slices: &RankSlices,
    ) -> Result<Self, BackendError> {
        // The packed kernels, and the dequantize kernel a packed LM head is widened with.
        let dequant = match w.quantization() {
            Some(q) => {
                gpu.load_quant()?;
                Some(gpu.func("quant", &super::quant::dequant_kernel_name(q.format(), prec))?)
            }
            None => None,
        };
        let gpu = &*gpu;
        let spec = LlamaSpec::new(c);
        let h = c.hidden_size;
        let cuts = LayerCuts::new(slices);
        let embed_cut = Cut::PaddedRows { rows: 0..c.vocab_size, to: slices.embed_rows(c) };
        let head_cut = (!c.tie_word_embeddings).then(|| slices.lm_head_cut(c.vocab_size));
        // Bytes this rank will hold, for the progress bar.
        let expected = {
            let m = |p: &LinearSpec, cut: &Cut| (cut.out_rows(p.out) * cut.out_cols(p.inp) * prec.bytes()) as u64;
            let layers: u64 = spec
                .layers
                .iter()
                .map(|l| {
                    m(&l.q, &cuts.q)
                        + 2 * m(&l.k, &cuts.kv)
                        + m(&l.o, &cuts.o)
                        + 2 * m(&l.gate, &cuts.inter)
                        + m(&l.down, &cuts.down)
                })
                .sum();
            let embed = (embed_cut.out_rows(c.vocab_size) * h * prec.bytes()) as u64;
            let head = head_cut.as_ref().map_or(0, |cut| (cut.out_rows(c.vocab_size) * h * prec.bytes()) as u64);
            layers + embed + head
        };
        let mut up = StagingUploader::new(gpu, expected)?;
        let bias = |parts: &[(&LinearSpec, Cut)]| -> Result<Option<DevBuf>, BackendError> {
            let Some(cuts) = bias_cuts(parts, slices) else { return Ok(None) };
            let mut all = Vec::new();
            for ((p, _), cut) in parts.iter().zip(cuts) {
                all.extend(cut.apply(&to_f32(&w.expect(&p.bias_name(), &[p.out])?), 1));
            }
            Ok(Some(gpu.upload(&all)?))
        };
        let vector =
            |name: &str, len: usize| -> Result<DevBuf, BackendError> { gpu.upload(&to_f32(&w.expect(name, &[len])?)) };
        let mut layers = Vec::with_capacity(spec.layers.len());
        for l in &spec.layers {
            let qkv = [(&l.q, cuts.q.clone()), (&l.k, cuts.kv.clone()), (&l.v, cuts.kv.clone())];
            let gate_up = [(&l.gate, cuts.inter.clone()), (&l.up, cuts.inter.clone())];
            let mut linear = |parts: &[(&LinearSpec, Cut)]| load_stack(gpu, &mut up, w, prec, parts);
            layers.push(LayerWeights {
                input_norm: vector(&l.input_norm, h)?,
                qkv: linear(&qkv)?,
                qkv_bias: bias(&qkv)?,
                q_norm: l.q_norm.as_ref().map(|n| vector(n, c.head_dim)).transpose()?,
                k_norm: l.k_norm.as_ref().map(|n| vector(n, c.head_dim)).transpose()?,
                o: linear(&[(&l.o, cuts.o.clone())])?,
                o_bias: bias(&[(&l.o, cuts.o.clone())])?,
                post_norm: vector(&l.post_attention_norm, h)?,
                gate_up: linear(&gate_up)?,
                gate_up_bias: bias(&gate_up)?,
                down: linear(&[(&l.down, cuts.down.clone())])?,
                down_bias: bias(&[(&l.down, cuts.down.clone())])?,
            });
        }
        // Whole on every rank (see `shard`), padded with zero rows for a tied, cut lm_head.
        let embed_view = w.expect(&spec.embed, &[c.vocab_size, h])?;
        let embed = up.matrix(gpu, &MatrixRuns::new(&[(embed_view, embed_cut)]), prec)?;
        let untied_head = match head_cut {
            Some(cut) => {
                let head = load_stack(gpu, &mut up, w, prec, &[(&spec.lm_head, cut)])?;
                Some(dense_head(gpu, head, prec, dequant.as_ref())?)
            }
            None => None,
        };
        // The tied head is copied out of the embedding on the compute stream: the uploads first.
        up.finish()?;
        let lm_head = match untied_head {
            Some(head) => Some(head),
            None => tied_head_slice(gpu, &embed, h, prec, slices)?,
        };
        Ok(DeviceWeights { embed, layers, final_norm: vector(&spec.final_norm, h)?, lm_head })
    }

    /// Seeded uniform weights made on the device with the distributions of
    /// `model::synthetic::SyntheticWeights` (matrices ±1/√fan_in, embedding ±1, norms 1 ± 0.1,
    /// biases ±0.1); not the same values, which are drawn on the host there. Every tensor is
    /// generated whole and then cut to this rank's share, so all rank counts see one model.
    pub fn synthetic(
        gpu: &mut Gpu,
        c: &LlamaConfig,
        prec: Precision,
        seed: u64,
        slices: &RankSlices,
    ) -> Result<Self, BackendError> {
        let spec = LlamaSpec::new(c);
        let h = c.hidden_size;
        let mut f = Filler::new(seed);
        let lin = |gpu: &mut Gpu,
                   f: &mut Filler,
                   parts: &[(&LinearSpec, Cut)]|
         -> Result<(LinearWeight, Option<DevBuf>), BackendError> {
            let n: usize = parts.iter().map(|(p, _)| p.out * p.inp).sum();
            let rows = parts.iter().map(|(p, cut)| cut.out_rows(p.out)).sum();
            let whole = f.fill(gpu, n, prec, 0.0, 1.0 / (parts[0].0.inp as f32).sqrt())?;
            let mut at = 0;
            let blocks: Vec<(usize, usize, Cut)> = parts
                .iter()
                .map(|(p, cut)| {
                    at += p.out;
                    (at - p.out, p.out, cut.clone())
                })
                .collect();
            let w = cut_device(gpu, whole, parts[0].0.inp, prec.bytes(), &blocks)?;
            let b = if parts[0].0.bias {
                let whole = f.fill(gpu, parts.iter().map(|(p, _)| p.out).sum(), Precision::F32, 0.0, 0.1)?;
                match bias_cuts(parts, slices) {
                    Some(cuts) => {
                        let blocks: Vec<_> = blocks.iter().zip(cuts).map(|(&(at, rows, _), c)| (at, rows, c)).collect();
                        Some(cut_device(gpu, whole, 1, 4, &blocks)?)
                    }
                    None => None,
                }
            } else {
                None
            };
            Ok((LinearWeight::Dense { buf: w, rows }, b))
        };
        let cuts = LayerCuts::new(slices);
        let mut layers = Vec::with_capacity(spec.layers.len());
        for l in &spec.layers {
            let qkv_parts = [(&l.q, cuts.q.clone()), (&l.k, cuts.kv.clone()), (&l.v, cuts.kv.clone())];
            let (qkv, qkv_bias) = lin(gpu, &mut f, &qkv_parts)?;
            let (o, o_bias) = lin(gpu, &mut f, &[(&l.o, cuts.o.clone())])?;
            let gate_up_parts = [(&l.gate, cuts.inter.clone()), (&l.up, cuts.inter.clone())];
            let (gate_up, gate_up_bias) = lin(gpu, &mut f, &gate_up_parts)?;
            let (down, down_bias) = lin(gpu, &mut f, &[(&l.down, cuts.down.clone())])?;
            let q_norm = if c.qk_norm { Some(f.fill(gpu, c.head_dim, Precision::F32, 1.0, 0.1)?) } else { None };
            let k_norm = if c.qk_norm { Some(f.fill(gpu, c.head_dim, Precision::F32, 1.0, 0.1)?) } else { None };
            layers.push(LayerWeights {
                input_norm: f.fill(gpu, h, Precision::F32, 1.0, 0.1)?,
                qkv,
                qkv_bias,
                q_norm,
                k_norm,
                o,
                o_bias,
                post_norm: f.fill(gpu, h, Precision::F32, 1.0, 0.1)?,
                gate_up,
                gate_up_bias,
                down,
                down_bias,
            });
        }
        let embed = f.fill(gpu, c.vocab_size * h, prec, 0.0, 1.0)?;
        let embed_cut = Cut::PaddedRows { rows: 0..c.vocab_size, to: slices.embed_rows(c) };
        let embed = cut_device(gpu, embed, h, prec.bytes(), &[(0, c.vocab_size, embed_cut)])?;
        let lm_head = if c.tie_word_embeddings {
            tied_head_slice(gpu, &embed, h, prec, slices)?
        } else {
            let whole = f.fill(gpu, c.vocab_size * h, prec, 0.0, 1.0 / (h as f32).sqrt())?;
            Some(cut_device(gpu, whole, h, prec.bytes(), &[(0, c.vocab_size, slices.lm_head_cut(c.vocab_size))])?)
        };
        let final_norm = f.fill(gpu, h, Precision::F32, 1.0, 0.1)?;
        gpu.sync()?;
        Ok(DeviceWeights { embed, layers, final_norm, lm_head })
    }
}

/// Consecutive projections of one storage kind, on their way into one stacked matrix.
enum Run<'a> {
    Dense(Vec<(TensorView<'a>, Cut)>, usize),
    Packed(Vec<PackedRows>),
}

/// Projections sharing one input (`parts`, each cut to this rank's share), stacked by rows: in
/// the storage precision through the staging ring when stored as floats or GGML blocks, packed
/// as stored when the checkpoint quantized them; consecutive parts of one kind form one matrix,
/// parts of different kinds stay side by side ([`LinearWeight::Parts`]).
fn load_stack<'a>(
    gpu: &Gpu,
    up: &mut StagingUploader,
    w: &'a dyn WeightSource,
    prec: Precision,
    parts: &[(&LinearSpec, Cut)],
) -> Result<LinearWeight, BackendError> {
    let mut runs: Vec<Run<'a>> = Vec::new();
    for (p, cut) in parts {
        match quantized::load_linear(w, &p.name, p.out, p.inp)? {
            Some(packed) => {
                let packed = cut_packed(packed, cut, &p.name)?;
                match runs.last_mut() {
                    Some(Run::Packed(v)) if v[0].format == packed.format => v.push(packed),
                    _ => runs.push(Run::Packed(vec![packed])),
                }
            }
            None => {
                let view = w.expect(&p.weight(), &[p.out, p.inp])?;
                let rows = cut.out_rows(p.out);
                match runs.last_mut() {
                    Some(Run::Dense(v, n)) => {
                        v.push((view, cut.clone()));
                        *n += rows;
                    }
                    _ => runs.push(Run::Dense(vec![(view, cut.clone())], rows)),
                }
            }
        }
    }
    let mut out = Vec::with_capacity(runs.len());
    for run in runs {
        out.push(match run {
            Run::Dense(views, rows) => {
                LinearWeight::Dense { buf: up.matrix(gpu, &MatrixRuns::new(&views), prec)?, rows }
            }
            Run::Packed(v) => {
                let stacked = PackedRows::concat(v).unwrap_or_else(|_| unreachable!("one format, one input width"));
                LinearWeight::Packed(DevPacked::upload(gpu, &stacked)?)
            }
        });
    }
    Ok(LinearWeight::stack(out))
}

/// This rank's share of a packed projection. Rows cut anywhere; columns only on scale-group
/// boundaries (a group cannot be split; such a tensor-parallel degree is refused).
fn cut_packed(p: PackedRows, cut: &Cut, name: &str) -> Result<PackedRows, BackendError> {
    match cut {
        Cut::Rows(r) if *r == (0..p.rows) => Ok(p),
        Cut::Rows(r) => Ok(p.take_rows(r.clone())),
        Cut::Cols(c) if *c == (0..p.cols) => Ok(p),
        Cut::Cols(c) => p.take_cols(c.clone()).ok_or_else(|| {
            BackendError::Device(format!(
                "`{name}` ({}): this tensor-parallel cut of columns {c:?} splits a scale group",
                p.format.name()
            ))
        }),
        Cut::PaddedRows { .. } => {
            Err(BackendError::Device(format!("`{name}` ({}): padded row cuts are not served packed", p.format.name())))
        }
    }
}

/// The LM head as a dense matrix: a packed head is dequantized on the device (logged; the head
/// has no packed path yet).
fn dense_head(
    gpu: &Gpu,
    head: LinearWeight,
    prec: Precision,
    dequant: Option<&cudarc::driver::CudaFunction>,
) -> Result<DevBuf, BackendError> {
    match (head, dequant) {
        (LinearWeight::Dense { buf, .. }, _) => Ok(buf),
        (LinearWeight::Packed(p), Some(f)) => {
            tracing::info!(format = %p.format.name(), "lm_head dequantized to the storage precision on the device");
            let buf = gpu.alloc(p.rows * p.cols * prec.bytes())?;
            p.dequantize_with(gpu, f, buf.ptr())?;
            gpu.sync()?;
            Ok(buf)
        }
        _ => Err(BackendError::Device("a packed lm_head without a quantization scheme".into())),
    }
}

impl DeviceWeights {
    /// [`synthetic`](Self::synthetic) with every projection packed in `format` (random codes and
    /// scales made on the device, of the magnitudes of the dense synthetic weights): benchmarks
    /// of quantized decode. The whole model on one device only.
    pub fn synthetic_packed(
        gpu: &mut Gpu,
        c: &LlamaConfig,
        prec: Precision,
        seed: u64,
        slices: &RankSlices,
        format: crate::model::quant::packed::PackedFormat,
    ) -> Result<Self, BackendError> {
        if !slices.is_whole() {
            return Err(BackendError::Device("packed synthetic weights are made for one device only".into()));
        }
        gpu.load_quant()?;
        let mut dw = Self::synthetic(gpu, c, prec, seed, slices)?;
        let mut f = Filler::new(seed ^ 0x5eed);
        let (h, qd, kvd, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        for l in &mut dw.layers {
            // Replace one at a time: at most one dense projection and its packed twin at once.
            l.qkv = LinearWeight::Packed(random_packed(gpu, &mut f, format, qd + 2 * kvd, h)?);
            l.o = LinearWeight::Packed(random_packed(gpu, &mut f, format, h, qd)?);
            l.gate_up = LinearWeight::Packed(random_packed(gpu, &mut f, format, 2 * inter, h)?);
            l.down = LinearWeight::Packed(random_packed(gpu, &mut f, format, h, inter)?);
        }
        gpu.sync()?;
        Ok(dw)
    }
}

/// A `[rows, cols]` packed matrix of seeded random codes; scales put its weights near
/// ±1/√cols, like the dense synthetic matrices.
pub(crate) fn random_packed(
    gpu: &mut Gpu,
    f: &mut Filler,
    format: crate::model::quant::packed::PackedFormat,
    rows: usize,
    cols: usize,
) -> Result<DevPacked, BackendError> {
    use crate::model::quant::packed::PackedFormat;
    super::quant::check_shape(format, cols).map_err(BackendError::Device)?;
    let fill = gpu.func("quant", "quant_fill_bytes")?;
    let bytes = |gpu: &mut Gpu, f: &mut Filler, n: usize, and_mask: u32, or_mask: u32| {
        f.counter = f.counter.wrapping_add(1);
        let b = gpu.alloc(n)?;
        let (p, n64, seed) = (b.ptr(), n as i64, f.counter);
        launch!(gpu, fill.clone(), cfg((grid_for(n, 256).min(8192), 1), 256, 0), &p, &n64, &seed, &and_mask, &or_mask)?;
        Ok::<DevBuf, BackendError>(b)
    };
    let groups = rows * (cols / format.group());
    let inv = 1.0 / (cols as f32).sqrt();
    let (codes, scales, scale_codes, row_global) = match format {
        PackedFormat::Fp8Block => (
            bytes(gpu, f, rows * cols, 0xBF, 0)?,
            Some(f.fill(gpu, groups, Precision::F32, inv, 0.1 * inv)?),
            None,
            None,
        ),
        // Uniform nibbles are biased (q − 8 averages −0.5): scales of either sign take the bias
        // out, which a MoE needs (a router fed biased activations sends every token to the same
        // experts, and the step reads fewer of them than a real model's).
        PackedFormat::Int4 { .. } => (
            bytes(gpu, f, rows * cols / 2, 0xFF, 0)?,
            Some(f.fill(gpu, groups, Precision::F32, 0.0, 0.3 * inv)?),
            None,
            None,
        ),
        PackedFormat::Nvfp4 => (
            bytes(gpu, f, rows * cols / 2, 0xFF, 0)?,
            None,
            Some(bytes(gpu, f, groups, 0x07, 0x30)?),
            Some(f.fill(gpu, rows, Precision::F32, 3.0 / inv, 0.0)?),
        ),
    };
    Ok(DevPacked { format, rows, cols, codes, scales, scale_codes, row_global })
}

/// A tied lm_head under tensor parallelism: this rank's vocabulary rows of the (zero-padded)
/// embedding, as their own matrix (`None` unsharded: the embedding itself is the head).
fn tied_head_slice(
    gpu: &Gpu,
    embed: &DevBuf,
    h: usize,
    prec: Precision,
    slices: &RankSlices,
) -> Result<Option<DevBuf>, BackendError> {
    if slices.is_whole() {
        return Ok(None);
    }
    let (row, per) = (h * prec.bytes(), slices.vocab_per_rank);
    let head = gpu.alloc(per * row)?;
    // The embedding has `vocab_per_rank · world` rows, so the last rank's slice is in range.
    gpu.copy_dtod(head.ptr(), embed.ptr() + (slices.tp.rank * per * row) as u64, per * row)?;
    gpu.sync()?;
    Ok(Some(head))
}

/// The cut of each kind of layer for a rank.
struct LayerCuts {
    q: Cut,
    kv: Cut,
    o: Cut,
    inter: Cut,
    down: Cut,
}

impl LayerCuts {
    fn new(s: &RankSlices) -> Self {
        LayerCuts {
            q: Cut::Rows(s.q_rows.clone()),
            kv: Cut::Rows(s.kv_rows.clone()),
            o: Cut::Cols(s.q_rows.clone()),
            inter: Cut::Rows(s.inter.clone()),
            down: Cut::Cols(s.inter.clone()),
        }
    }
}

/// How the biases of `parts` are cut (`None`: no bias on this rank). A column-parallel layer's
/// bias follows its rows; a row-parallel layer's bias is added once, by rank 0.
fn bias_cuts(parts: &[(&LinearSpec, Cut)], slices: &RankSlices) -> Option<Vec<Cut>> {
    if !parts[0].0.bias {
        return None;
    }
    parts
        .iter()
        .map(|(p, cut)| match cut {
            Cut::Cols(_) if !slices.keeps_row_parallel_bias() => None,
            Cut::Cols(_) => Some(Cut::Rows(0..p.out)),
            rows => Some(rows.clone()),
        })
        .collect()
}

/// Seeded device fills, each tensor with its own stream of the counter-based generator.
pub(crate) struct Filler {
    counter: u64,
}

impl Filler {
    pub(crate) fn new(seed: u64) -> Self {
        Filler { counter: seed.wrapping_mul(1_000_003) }
    }

    /// `n` values `center ± scale` (uniform) in precision `p`, in a new buffer.
    pub(crate) fn fill(
        &mut self,
        gpu: &mut Gpu,
        n: usize,
        p: Precision,
        center: f32,
        scale: f32,
    ) -> Result<DevBuf, BackendError> {
        self.counter = self.counter.wrapping_add(1);
        let b = gpu.alloc(n * p.bytes())?;
        let f = gpu.func("llama", &format!("fill_uniform_{}", p.suffix()))?;
        let (ptr, n64, seed) = (b.ptr(), n as i64, self.counter);
        launch!(gpu, f, cfg((grid_for(n, 256).min(8192), 1), 256, 0), &ptr, &n64, &seed, &center, &scale)?;
        Ok(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::quant::packed::{quantize_rows, PackedFormat};

    fn packed(format: PackedFormat, rows: usize, cols: usize) -> PackedRows {
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
        quantize_rows(format, rows, cols, &w)
    }

    #[test]
    fn a_rank_keeps_whole_rows_and_whole_groups_of_a_packed_projection() {
        for format in [PackedFormat::Fp8Block, PackedFormat::Int4 { group: 32 }, PackedFormat::Nvfp4] {
            let p = packed(format, 6, 256);
            let full = p.dequantize();
            // Rows: the same weights, each row with its own scales (and NVFP4 global).
            let r = cut_packed(p.clone(), &Cut::Rows(2..5), "m.q_proj").unwrap();
            assert_eq!(r.dequantize(), full[2 * 256..5 * 256].to_vec(), "{format:?}");
            // Columns on group boundaries (128 is one for every format here).
            let c = cut_packed(p.clone(), &Cut::Cols(128..256), "m.o_proj").unwrap();
            let want: Vec<f32> = full.chunks_exact(256).flat_map(|row| row[128..].to_vec()).collect();
            assert_eq!(c.dequantize(), want, "{format:?}");
            assert!(super::super::quant::check_shape(c.format, c.cols).is_ok());
            // The whole range is the projection itself.
            assert_eq!(cut_packed(p.clone(), &Cut::Rows(0..6), "x").unwrap().codes, p.codes);
        }
        // A column cut inside a 128-column FP8 block cannot keep its scale: refused, named.
        let e = cut_packed(packed(PackedFormat::Fp8Block, 4, 256), &Cut::Cols(64..192), "m.down_proj").unwrap_err();
        let e = e.to_string();
        assert!(e.contains("m.down_proj") && e.contains("splits a scale group"), "{e}");
        let e = cut_packed(packed(PackedFormat::Nvfp4, 4, 64), &Cut::PaddedRows { rows: 0..4, to: 8 }, "lm_head");
        assert!(e.is_err());
    }
}
