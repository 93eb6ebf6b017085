//! The `glm5_next` vision tower on the CPU (spec §7), in f32 following transformers'
//! `Glm5NextVisionModel`: patch embedding (the Conv3d as a projection), per block RMSNorm →
//! attention with per-head q/k RMSNorm and 2-D axial RoPE, bidirectional within each frame →
//! residual → RMSNorm → clamped SwiGLU → residual; then RMSNorm, the 2×2 downsample and the
//! merger (projection, LayerNorm, exact GELU, clamped SwiGLU).
//!
//! One image is encoded at a time: frames never attend to each other, so the result does not
//! depend on which other images share a request or a step.

use rayon::prelude::*;

use super::ops::{layer_norm, rms_norm, silu};
use crate::backend::cpu::linear::{CpuLinear, LinearScratch};
use crate::backend::BackendError;
use crate::model::glm5_next::vision::{self as layout, Affine, VisionConfig};
use crate::model::{ModelError, WeightSource};

pub type VisionWeights = layout::VisionWeights<CpuLinear>;

pub struct VisionTower {
    pub cfg: VisionConfig,
    weights: VisionWeights,
}

fn linear(l: &CpuLinear, x: &[f32], rows: usize, simd: bool) -> Result<Vec<f32>, BackendError> {
    let mut y = vec![0f32; rows * l.rows];
    l.forward(x, rows, &mut y, &mut LinearScratch::default(), simd)?;
    Ok(y)
}

fn affine(a: &Affine<CpuLinear>, x: &[f32], rows: usize, simd: bool) -> Result<Vec<f32>, BackendError> {
    let mut y = linear(&a.w, x, rows, simd)?;
    if let Some(b) = &a.bias {
        y.par_chunks_mut(b.len()).for_each(|r| r.iter_mut().zip(b).for_each(|(v, bb)| *v += bb));
    }
    Ok(y)
}

/// `down(silu(min(gate, λ)) · clamp(up, ±λ))`.
fn clamped_swiglu(gate: &mut [f32], up: &[f32], limit: f32) {
    gate.par_iter_mut().zip(up.par_iter()).for_each(|(g, &u)| *g = silu(g.min(limit)) * u.clamp(-limit, limit));
}

fn gelu(x: f32) -> f32 {
    (0.5 * x as f64 * (1.0 + libm::erf(x as f64 / std::f64::consts::SQRT_2))) as f32
}

impl VisionTower {
    /// The tower of `cfg` from `w`, `None` when the checkpoint has no vision tensors.
    pub fn load(cfg: VisionConfig, w: &dyn WeightSource) -> Result<Option<Self>, ModelError> {
        Ok(layout::load::<CpuLinear>(&cfg, w)?.map(|weights| VisionTower { cfg, weights }))
    }

    /// Bytes of f32 weights held.
    pub fn weight_bytes(&self) -> usize {
        let w = &self.weights;
        let a = |x: &Affine<CpuLinear>| 4 * (x.w.rows * x.w.cols + x.bias.as_ref().map_or(0, Vec::len));
        let l = |x: &CpuLinear| 4 * x.rows * x.cols;
        a(&w.patch_embed)
            + a(&w.downsample)
            + l(&w.merger_proj)
            + l(&w.merger_gate)
            + l(&w.merger_up)
            + l(&w.merger_down)
            + w.blocks.iter().map(|b| a(&b.qkv) + a(&b.proj) + a(&b.gate) + a(&b.up) + a(&b.down)).sum::<usize>()
    }

    /// Encode one image (`pixel_values` `[t·h·w, C·T·P·P]`, grid `(t, h, w)`) into its
    /// placeholder embeddings `[t·h·w / m², out_hidden]`.
    pub fn encode(&self, pixel_values: &[f32], grid: [usize; 3], simd: bool) -> Result<Vec<f32>, BackendError> {
        let c = &self.cfg;
        let m = c.spatial_merge_size;
        layout::check_image(c, pixel_values.len(), grid).map_err(BackendError::InvalidStep)?;
        let n = grid.iter().product::<usize>();
        let (d, heads, hd) = (c.hidden_size, c.num_heads, c.head_dim());
        let (cos, sin) = layout::rope_tables(c, &layout::patch_positions(grid, m));
        // Attention segments (one per frame), as the CUDA kernel reads them.
        let cu = layout::frame_seqlens(&[grid]);
        let scale = (hd as f32).powf(-0.5);
        let eps = c.rms_norm_eps;
        let mut x = affine(&self.weights.patch_embed, pixel_values, n, simd)?;
        for b in &self.weights.blocks {
            let mut hn = x.clone();
            hn.par_chunks_mut(d).for_each(|r| rms_norm(r, &b.norm1, eps));
            let mut qkv = affine(&b.qkv, &hn, n, simd)?;
            qkv.par_chunks_mut(3 * d).enumerate().for_each(|(row, r)| {
                let (q, k) = r.split_at_mut(d);
                for (part, norm) in [(q, &b.q_norm), (&mut k[..d], &b.k_norm)] {
                    for head in part.chunks_mut(hd) {
                        rms_norm(head, norm, eps);
                        let (cs, sn) = (&cos[row * hd..(row + 1) * hd], &sin[row * hd..(row + 1) * hd]);
                        let half = hd / 2;
                        let rotated: Vec<f32> = (0..hd)
                            .map(|i| {
                                let rot = if i < half { -head[i + half] } else { head[i - half] };
                                head[i] * cs[i] + rot * sn[i]
                            })
                            .collect();
                        head.copy_from_slice(&rotated);
                    }
                }
            });
            // Attention within each frame, all heads; one output row per (patch, head).
            let mut att = vec![0f32; n * d];
            att.par_chunks_mut(hd).enumerate().for_each(|(i, out)| {
                let (row, head) = (i / heads, i % heads);
                let seg = cu.partition_point(|&b| b <= row) - 1;
                let (f0, f1) = (cu[seg], cu[seg + 1]);
                let q = &qkv[row * 3 * d + head * hd..][..hd];
                let scores: Vec<f32> = (f0..f1)
                    .map(|j| {
                        let k = &qkv[j * 3 * d + d + head * hd..][..hd];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale
                    })
                    .collect();
                let max = scores.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let e: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f32 = e.iter().sum();
                for (j, p) in (f0..f1).zip(&e) {
                    let v = &qkv[j * 3 * d + 2 * d + head * hd..][..hd];
                    out.iter_mut().zip(v).for_each(|(o, vv)| *o += p / total * vv);
                }
            });
            let y = affine(&b.proj, &att, n, simd)?;
            x.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
            let mut hn = x.clone();
            hn.par_chunks_mut(d).for_each(|r| rms_norm(r, &b.norm2, eps));
            let mut gate = affine(&b.gate, &hn, n, simd)?;
            let up = affine(&b.up, &hn, n, simd)?;
            clamped_swiglu(&mut gate, &up, c.swiglu_limit);
            let y = affine(&b.down, &gate, n, simd)?;
            x.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
        }
        x.par_chunks_mut(d).for_each(|r| rms_norm(r, &self.weights.post_norm, eps));
        // 2×2 downsample: each window of m² consecutive patches, laid out channel-major.
        let groups = n / (m * m);
        let mut windows = vec![0f32; n * d];
        windows.par_chunks_mut(d * m * m).enumerate().for_each(|(g, win)| {
            for k in 0..m * m {
                for ch in 0..d {
                    win[ch * m * m + k] = x[(g * m * m + k) * d + ch];
                }
            }
        });
        let down = affine(&self.weights.downsample, &windows, groups, simd)?;
        let out = c.out_hidden_size;
        let mut z = linear(&self.weights.merger_proj, &down, groups, simd)?;
        z.par_chunks_mut(out).for_each(|r| {
            layer_norm(r, &self.weights.merger_norm_w, &self.weights.merger_norm_b, 1e-5);
            r.iter_mut().for_each(|v| *v = gelu(*v));
        });
        let mut gate = linear(&self.weights.merger_gate, &z, groups, simd)?;
        let up = linear(&self.weights.merger_up, &z, groups, simd)?;
        clamped_swiglu(&mut gate, &up, c.swiglu_limit);
        linear(&self.weights.merger_down, &gate, groups, simd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_is_the_exact_erf_form() {
        assert!((gelu(1.0) - 0.841_344_7).abs() < 1e-6);
        assert_eq!(gelu(0.0), 0.0);
    }
}
