//! The `glm5_next` vision tower on the GPU (spec §7): weights loaded through the model's
//! description (`model::glm5_next::vision`, the same names and shapes the CPU reads; Conv3d and
//! Conv2d as projections) in the backend's storage precision, and [`Glm5CudaBackend::encode_image_batch`]:
//! patch embedding, 24 blocks, post-norm, 2×2 downsample and merger as cuBLAS GEMMs plus the
//! kernels of `cuda/vision.cu`. The patch positions, RoPE tables and attention segments come from
//! the shared description, so both devices read one definition; the attention is one varlen
//! kernel over every frame of every image in the call (a frame never attends to another).
//!
//! Also the placement of image embeddings into a text step's rows (`forward_embedded`).
//!
//! Precision: activations between kernels are f32; in bf16 the GEMM inputs are written as bf16
//! by the kernel that produces them (the weights are bf16, accumulation f32), in f32 everything
//! is f32 (pedantic cuBLAS), the mode validated against the CPU tower.

use super::weights::{upload_matrix, DevLinear, HostLinear};
use super::Glm5CudaBackend;
use crate::backend::cuda::gpu::{cfg, grid_for, DevBuf, Gpu, Precision};
use crate::backend::glm5_steps::SeqRows;
use crate::backend::{BackendError, EmbeddedRows, ImageEmbedding, SeqStep};
use crate::launch;
use crate::model::glm5_next::vision::{self as layout, Affine, MultimodalIds, VisionConfig};
use crate::model::glm5_next::weights::LinearWeight;
use crate::model::{ModelError, WeightSource};

const BLOCK: u32 = 256;
/// `VIS_QT`, `VIS_KT`, `VIS_WARPS` and `VIS_HD_CHUNKS` in cuda/vision.cu.
const ATT_QT: usize = 32;
const ATT_KT: usize = 32;
const ATT_THREADS: u32 = 128;
const ATT_MAX_HD: usize = 128;

/// A projection with its optional f32 bias.
struct DevAffine {
    w: DevLinear,
    bias: Option<DevBuf>,
}

impl DevAffine {
    fn bias_ptr(&self) -> u64 {
        self.bias.as_ref().map_or(0, DevBuf::ptr)
    }
}

struct Block {
    norm1: DevBuf,
    norm2: DevBuf,
    qkv: DevAffine,
    q_norm: DevBuf,
    k_norm: DevBuf,
    proj: DevAffine,
    /// gate rows then up rows, biases likewise: one GEMM.
    gate_up: DevAffine,
    down: DevAffine,
}

/// The tower in device memory.
pub struct DeviceTower {
    pub cfg: VisionConfig,
    pub ids: MultimodalIds,
    patch_embed: DevAffine,
    blocks: Vec<Block>,
    post_norm: DevBuf,
    downsample: DevAffine,
    merger_proj: DevLinear,
    merger_norm_w: DevBuf,
    merger_norm_b: DevBuf,
    /// gate rows then up rows (no biases).
    merger_gate_up: DevLinear,
    merger_down: DevLinear,
    pub bytes: usize,
}

/// Shapes the kernels require; `Err` says which.
fn check_shapes(c: &VisionConfig) -> Result<(), String> {
    let hd = c.head_dim();
    if hd == 0 || hd > ATT_MAX_HD || !hd.is_multiple_of(2) {
        return Err(format!("vision head_dim {hd} is outside the attention kernel's even 2..={ATT_MAX_HD}"));
    }
    if attention_smem(hd) > 48 * 1024 {
        return Err(format!("vision head_dim {hd} needs more than 48 KiB of shared memory"));
    }
    Ok(())
}

fn attention_smem(hd: usize) -> usize {
    4 * (ATT_KT * (hd + 1) + ATT_KT * hd + ATT_QT * hd)
}

/// Load the tower of the checkpoint in `w`'s directory (text model width `text_hidden`) in
/// `prec`, `None` when its config has no vision tower or its tensors are absent.
pub fn load(
    gpu: &mut Gpu,
    text_hidden: usize,
    w: &dyn WeightSource,
    prec: Precision,
) -> Result<Option<DeviceTower>, BackendError> {
    let Some((c, ids)) = layout::config_for_text(w.origin(), text_hidden)? else { return Ok(None) };
    let Some(host) = layout::load::<HostLinear>(&c, w)? else { return Ok(None) };
    check_shapes(&c).map_err(|e| {
        BackendError::Model(ModelError::Config {
            file: w.origin().join("config.json"),
            msg: format!("glm5_next vision on CUDA: {e}"),
        })
    })?;
    gpu.load_vision()?;
    let mut bytes = 0usize;
    let mut up = |v: &[f32]| -> Result<DevBuf, BackendError> {
        bytes += 4 * v.len();
        gpu.upload(v)
    };
    let lin = |l: &HostLinear| -> Result<DevLinear, BackendError> {
        Ok(DevLinear::dense(l.rows(), l.cols(), prec, upload_matrix(gpu, l.dense("the vision tower")?, prec)?))
    };
    let stack = |a: HostLinear, b: HostLinear| -> Result<HostLinear, BackendError> {
        HostLinear::stack(vec![a, b]).map_err(|_| BackendError::InvalidStep("gate and up widths differ".into()))
    };
    let affine = |a: &Affine<HostLinear>, up: &mut dyn FnMut(&[f32]) -> Result<DevBuf, BackendError>| {
        Ok::<_, BackendError>(DevAffine { w: lin(&a.w)?, bias: a.bias.as_deref().map(&mut *up).transpose()? })
    };
    let patch_embed = affine(&host.patch_embed, &mut up)?;
    let downsample = affine(&host.downsample, &mut up)?;
    let mut blocks = Vec::with_capacity(host.blocks.len());
    for b in host.blocks {
        let gate_bias = match (&b.gate.bias, &b.up.bias) {
            (Some(g), Some(u)) => Some(up(&[g.as_slice(), u.as_slice()].concat())?),
            _ => None,
        };
        let gate_up = DevAffine { w: lin(&stack(b.gate.w, b.up.w)?)?, bias: gate_bias };
        blocks.push(Block {
            norm1: up(&b.norm1)?,
            norm2: up(&b.norm2)?,
            qkv: affine(&b.qkv, &mut up)?,
            q_norm: up(&b.q_norm)?,
            k_norm: up(&b.k_norm)?,
            proj: affine(&b.proj, &mut up)?,
            gate_up,
            down: affine(&b.down, &mut up)?,
        });
    }
    let mut t = DeviceTower {
        post_norm: up(&host.post_norm)?,
        merger_norm_w: up(&host.merger_norm_w)?,
        merger_norm_b: up(&host.merger_norm_b)?,
        merger_proj: lin(&host.merger_proj)?,
        merger_gate_up: lin(&stack(host.merger_gate, host.merger_up)?)?,
        merger_down: lin(&host.merger_down)?,
        cfg: c,
        ids,
        patch_embed,
        blocks,
        downsample,
        bytes: 0,
    };
    let l = DevLinear::bytes;
    let mut linear = l(&t.patch_embed.w) + l(&t.downsample.w) + l(&t.merger_proj);
    linear += l(&t.merger_gate_up) + l(&t.merger_down);
    linear += t.blocks.iter().map(|b| l(&b.qkv.w) + l(&b.proj.w) + l(&b.gate_up.w) + l(&b.down.w)).sum::<usize>();
    t.bytes = bytes + linear;
    Ok(Some(t))
}

/// Check the embedded runs of a step against its sequences (the CPU's rules): each run has the
/// model's width and lies inside its sequence's tokens.
pub fn check_embedded(batch: &[SeqStep<'_>], embeds: &[Vec<EmbeddedRows<'_>>], d: usize) -> Result<(), BackendError> {
    if embeds.len() > batch.len() {
        return Err(BackendError::InvalidStep(format!(
            "embeddings for {} sequences in a step of {}",
            embeds.len(),
            batch.len()
        )));
    }
    for (s, runs) in batch.iter().zip(embeds) {
        for run in runs {
            let rows = run.data.len() / d.max(1);
            if run.hidden != d || run.data.len() % d != 0 || run.first_row + rows > s.tokens.len() {
                return Err(BackendError::InvalidStep(format!(
                    "embedded rows {}..{} of width {} do not fit a step of {} tokens of width {d}",
                    run.first_row,
                    run.first_row + rows,
                    run.hidden,
                    s.tokens.len()
                )));
            }
        }
    }
    Ok(())
}

impl Glm5CudaBackend {
    /// Overwrite the embedded rows of the step's streams `x` ([n, m·d]) with their embeddings
    /// (runs already checked by [`check_embedded`]).
    pub(super) fn place_embedded(
        &mut self,
        seqs: &[SeqRows<'_>],
        embeds: &[Vec<EmbeddedRows<'_>>],
        x: u64,
    ) -> Result<(), BackendError> {
        let d = self.cfg.hidden_size;
        let mut data: Vec<f32> = Vec::new();
        let mut rows: Vec<i32> = Vec::new();
        for (s, runs) in seqs.iter().zip(embeds) {
            for run in runs {
                data.extend_from_slice(run.data);
                let first = s.row0 + run.first_row;
                rows.extend((first..first + run.data.len() / d).map(|r| r as i32));
            }
        }
        if rows.is_empty() {
            return Ok(());
        }
        self.gpu.load_vision()?;
        let src = self.scratch.put(&self.gpu, "emb_data", &data)?;
        let idx = self.scratch.put(&self.gpu, "emb_rows", &rows)?;
        let f = self.gpu.func("vision", "vis_place_rows")?;
        let (mi, di) = (self.cfg.hc_mult as i32, d as i32);
        launch!(self.gpu, f, cfg((rows.len() as u32, 1), BLOCK, 0), &src, &idx, &x, &mi, &di)
    }

    /// Encode `images` (each `pixel_values` `[t·h·w, C·T·P·P]` with its grid `(t, h, w)`) in one
    /// pass of the tower into their placeholder embeddings, in order. The result of an image does
    /// not depend on the others in the call (attention stays within each frame; every other
    /// operation is per row), up to the GEMMs' row-count-dependent summation order.
    pub fn encode_image_batch(&mut self, images: &[(&[f32], [usize; 3])]) -> Result<Vec<ImageEmbedding>, BackendError> {
        let Some(tower) = self.vision.take() else {
            return Err(BackendError::InvalidStep("this model has no vision tower".into()));
        };
        self.gpu.bind()?;
        let out = self.run_tower(&tower, images);
        self.vision = Some(tower);
        out
    }

    fn run_tower(
        &mut self,
        t: &DeviceTower,
        images: &[(&[f32], [usize; 3])],
    ) -> Result<Vec<ImageEmbedding>, BackendError> {
        let c = &t.cfg;
        for (px, grid) in images {
            layout::check_image(c, px.len(), *grid).map_err(BackendError::InvalidStep)?;
        }
        if images.is_empty() {
            return Ok(Vec::new());
        }
        let grids: Vec<[usize; 3]> = images.iter().map(|(_, g)| *g).collect();
        let (d, heads, hd, pd) = (c.hidden_size, c.num_heads, c.head_dim(), c.patch_dim());
        let (m, inter, out_w, q) =
            (c.spatial_merge_size, c.intermediate_size, c.out_hidden_size, c.projection_intermediate_size);
        let mm = m * m;
        let n: usize = grids.iter().map(|g| g.iter().product::<usize>()).sum();
        let groups = n / mm;
        let cu = layout::frame_seqlens(&grids);
        let max_len = cu.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
        let segs = cu.len() - 1;
        let to_i32 = |v: usize| {
            i32::try_from(v).map_err(|_| BackendError::InvalidStep(format!("{v} patches exceed 32-bit indices")))
        };
        to_i32(n * 3 * d)?;
        let pos: Vec<(usize, usize)> = grids.iter().flat_map(|&g| layout::patch_positions(g, m)).collect();
        let (cos, sin) = layout::rope_tables(c, &pos);
        let cu_i: Vec<i32> = cu.iter().map(|&v| v as i32).collect();
        let (prec, eb) = (self.prec, self.prec.bytes());
        let sfx = prec.suffix();
        // Inputs.
        let pix = self.scratch.get(&self.gpu, "vis_pix", 4 * n * pd)?;
        let mut at = 0u64;
        for (px, _) in images {
            self.gpu.copy_htod_in_order(pix + at, px)?;
            at += 4 * px.len() as u64;
        }
        let cos_p = self.scratch.put(&self.gpu, "vis_cos", &cos)?;
        let sin_p = self.scratch.put(&self.gpu, "vis_sin", &sin)?;
        let cu_p = self.scratch.put(&self.gpu, "vis_cu", &cu_i)?;
        let x = self.scratch.get(&self.gpu, "vis_x", 4 * n * d)?;
        // f32 GEMM outputs and the storage-type GEMM inputs, each sized for its widest use.
        let y_len = (n * (3 * d).max(2 * inter)).max(groups * out_w);
        let y = self.scratch.get(&self.gpu, "vis_y", 4 * y_len)?;
        let h_len = (n * pd.max(d).max(inter)).max(groups * out_w.max(q));
        let h = self.scratch.get(&self.gpu, "vis_h", eb * h_len)?;
        // Patch embedding.
        let add_bias = self.gpu.func("vision", &format!("vis_add_bias_{sfx}"))?;
        let add_bias_f32 = self.gpu.func("vision", "vis_add_bias_f32")?;
        let pix_t = match prec {
            Precision::F32 => pix,
            Precision::Bf16 => {
                let total = (n * pd) as i64;
                let (none, one) = (0u64, 1i32);
                launch!(
                    self.gpu,
                    add_bias.clone(),
                    cfg((grid_for(n * pd, BLOCK), 1), BLOCK, 0),
                    &pix,
                    &none,
                    &h,
                    &total,
                    &one
                )?;
                h
            }
        };
        self.gemm(&t.patch_embed.w, n, pix_t, x)?;
        let (total, di) = ((n * d) as i64, d as i32);
        let pb = t.patch_embed.bias_ptr();
        launch!(self.gpu, add_bias_f32.clone(), cfg((grid_for(n * d, BLOCK), 1), BLOCK, 0), &x, &pb, &x, &total, &di)?;
        let rms = self.gpu.func("vision", &format!("vis_rms_norm_{sfx}"))?;
        let residual = self.gpu.func("vision", "vis_residual")?;
        let prep = self.gpu.func("vision", "vis_qkv_prep")?;
        let attention = self.gpu.func("vision", &format!("vis_attention_{sfx}"))?;
        let swiglu = self.gpu.func("vision", &format!("vis_swiglu_{sfx}"))?;
        let eps = c.rms_norm_eps;
        let (hi, hdi, ii) = (heads as i32, hd as i32, inter as i32);
        let scale = (hd as f32).powf(-0.5);
        let rows = (n as u32, 1);
        for b in &t.blocks {
            let n1 = b.norm1.ptr();
            launch!(self.gpu, rms.clone(), cfg(rows, BLOCK, 0), &x, &n1, &h, &di, &eps)?;
            self.gemm(&b.qkv.w, n, h, y)?;
            let (qb, qn, kn) = (b.qkv.bias_ptr(), b.q_norm.ptr(), b.k_norm.ptr());
            let threads = hd.next_multiple_of(32) as u32;
            launch!(
                self.gpu,
                prep.clone(),
                cfg((n as u32, (3 * heads) as u32), threads, (4 * hd) as u32),
                &y,
                &qb,
                &qn,
                &kn,
                &cos_p,
                &sin_p,
                &hi,
                &hdi,
                &eps
            )?;
            let grid = ((segs * heads) as u32, max_len.div_ceil(ATT_QT) as u32);
            let smem = attention_smem(hd) as u32;
            launch!(self.gpu, attention.clone(), cfg(grid, ATT_THREADS, smem), &y, &cu_p, &h, &hi, &hdi, &scale)?;
            // qkv is dead once attention has run: the branch outputs reuse `y`.
            self.gemm(&b.proj.w, n, h, y)?;
            let pb = b.proj.bias_ptr();
            launch!(self.gpu, residual.clone(), cfg((grid_for(n * d, BLOCK), 1), BLOCK, 0), &x, &y, &pb, &total, &di)?;
            let n2 = b.norm2.ptr();
            launch!(self.gpu, rms.clone(), cfg(rows, BLOCK, 0), &x, &n2, &h, &di, &eps)?;
            self.gemm(&b.gate_up.w, n, h, y)?;
            let (gb, act_total, limit) = (b.gate_up.bias_ptr(), (n * inter) as i64, c.swiglu_limit);
            launch!(
                self.gpu,
                swiglu.clone(),
                cfg((grid_for(n * inter, BLOCK), 1), BLOCK, 0),
                &y,
                &gb,
                &h,
                &ii,
                &act_total,
                &limit
            )?;
            self.gemm(&b.down.w, n, h, y)?;
            let db = b.down.bias_ptr();
            launch!(self.gpu, residual.clone(), cfg((grid_for(n * d, BLOCK), 1), BLOCK, 0), &x, &y, &db, &total, &di)?;
        }
        // Post-norm (f32, into y), the merge windows (storage type, into h), the downsample.
        let rms_f32 = self.gpu.func("vision", "vis_rms_norm_f32")?;
        let pn = t.post_norm.ptr();
        launch!(self.gpu, rms_f32, cfg(rows, BLOCK, 0), &x, &pn, &y, &di, &eps)?;
        let windows = self.gpu.func("vision", &format!("vis_windows_{sfx}"))?;
        let mmi = mm as i32;
        launch!(self.gpu, windows, cfg((groups as u32, 1), BLOCK, 0), &y, &h, &di, &mmi)?;
        let down = self.scratch.get(&self.gpu, "vis_down", 4 * groups * out_w.max(2 * q))?;
        self.gemm(&t.downsample.w, groups, h, down)?;
        let (gt, oi, db) = ((groups * out_w) as i64, out_w as i32, t.downsample.bias_ptr());
        launch!(self.gpu, add_bias, cfg((grid_for(groups * out_w, BLOCK), 1), BLOCK, 0), &down, &db, &h, &gt, &oi)?;
        // Merger: projection, LayerNorm + GELU, clamped SwiGLU (no biases), down.
        self.gemm(&t.merger_proj, groups, h, y)?;
        let ln = self.gpu.func("vision", &format!("vis_ln_gelu_{sfx}"))?;
        let (lw, lb, ln_eps) = (t.merger_norm_w.ptr(), t.merger_norm_b.ptr(), 1e-5f32);
        launch!(self.gpu, ln, cfg((groups as u32, 1), BLOCK, 0), &y, &lw, &lb, &h, &oi, &ln_eps)?;
        self.gemm(&t.merger_gate_up, groups, h, down)?;
        let (none, qi, qt, limit) = (0u64, q as i32, (groups * q) as i64, c.swiglu_limit);
        launch!(self.gpu, swiglu, cfg((grid_for(groups * q, BLOCK), 1), BLOCK, 0), &down, &none, &h, &qi, &qt, &limit)?;
        self.gemm(&t.merger_down, groups, h, y)?;
        let mut all = vec![0f32; groups * out_w];
        self.gpu.copy_dtoh(&mut all, y)?;
        let mut out = Vec::with_capacity(images.len());
        let mut row = 0;
        for g in &grids {
            let r = c.tokens(*g);
            out.push(ImageEmbedding { rows: r, hidden: out_w, data: all[row * out_w..(row + r) * out_w].to_vec() });
            row += r;
        }
        Ok(out)
    }

    /// `y[rows, l.rows] = x[rows, l.cols] · lᵀ` with `x` already in the weight's precision.
    fn gemm(&self, l: &DevLinear, rows: usize, x: u64, y: u64) -> Result<(), BackendError> {
        self.gpu.gemm(l.prec, rows, l.rows, l.cols, x, l.dense_ptr()?, y, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_shapes_fit_the_kernel() {
        assert_eq!(attention_smem(64), 4 * (32 * 65 + 32 * 64 + 32 * 64));
        let mut c = VisionConfig {
            depth: 24,
            hidden_size: 1024,
            num_heads: 16,
            intermediate_size: 4096,
            patch_size: 14,
            temporal_patch_size: 2,
            in_channels: 3,
            spatial_merge_size: 2,
            out_hidden_size: 4096,
            projection_intermediate_size: 10240,
            rms_norm_eps: 1e-5,
            attention_bias: true,
            swiglu_limit: 10.0,
            rope_theta: 10000.0,
        };
        assert!(check_shapes(&c).is_ok());
        c.num_heads = 4; // head_dim 256
        assert!(check_shapes(&c).unwrap_err().contains("256"));
    }
}
