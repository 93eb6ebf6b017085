//! Per-row primitives of the `glm5_next` forward in f32, each following transformers' definition
//! (spec §0, §2.6): weighted and gated RMSNorm, LayerNorm, l2 normalisation, the clamped SwiGLU,
//! and the mHC hyper-connection (projection, Sinkhorn, collapse, expand). Every function works on
//! one token's row, so results never depend on the rest of the batch.

use super::weights::HyperConnection;

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `1 / sqrt(mean(x²) + eps)`, the sum of squares accumulated in f64.
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt()
}

/// Weighted RMSNorm in place: `w ⊙ x / sqrt(mean(x²) + eps)`.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let r = inv_rms(x, eps);
    for (v, &g) in x.iter_mut().zip(w) {
        *v = g * (*v * r);
    }
}

/// KDA's output norm: `w ⊙ o / sqrt(mean(o²) + eps) ⊙ σ(z)`.
pub fn gated_rms_norm(o: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    let r = inv_rms(o, eps);
    for ((v, &g), &zz) in o.iter_mut().zip(w).zip(z) {
        *v = g * (*v * r) * sigmoid(zz);
    }
}

/// `nn.LayerNorm` (biased variance) in place.
pub fn layer_norm(x: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
    let r = 1.0 / (var as f32 + eps).sqrt();
    let mean = mean as f32;
    for ((v, &g), &bb) in x.iter_mut().zip(w).zip(b) {
        *v = (*v - mean) * r * g + bb;
    }
}

/// FLA's l2norm: `x / sqrt(Σx² + 1e-6)`, times `scale`.
pub fn l2_normalize(x: &mut [f32], scale: f32) {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let r = 1.0 / ((ss as f32) + 1e-6).sqrt();
    for v in x.iter_mut() {
        *v = *v * r * scale;
    }
}

/// `silu(min(g, λ)) · clip(u, −λ, λ)` over a `[gate | up]` row, written to `out`.
pub fn swiglu_clamped(gate_up: &[f32], limit: f32, out: &mut [f32]) {
    let (g, u) = gate_up.split_at(out.len());
    for ((o, &gv), &uv) in out.iter_mut().zip(g).zip(u) {
        *o = silu(gv.min(limit)) * uv.clamp(-limit, limit);
    }
}

/// The mixing weights one mHC site computes from a token's streams.
pub struct HcWeights {
    /// Post (expand) weights `β`, length M.
    pub post: Vec<f32>,
    /// Doubly-stochastic comb `C[i·M + j]`: weight from old stream i into new stream j.
    pub comb: Vec<f32>,
}

/// The mHC map's input for one token: all M·D stream values divided by their RMS (eps is
/// `rms_norm_eps`, not `hc_eps`).
pub fn hc_normalize(x: &[f32], eps: f32, out: &mut [f32]) {
    let r = inv_rms(x, eps);
    for (o, &v) in out.iter_mut().zip(x) {
        *o = v * r;
    }
}

/// One mHC site for one token (spec §2.6): from the projected map `mix` (`(2+M)·M` values, the
/// `fn` matrix times [`hc_normalize`]d streams) and the streams `x` (`[M, D]`, stream-major),
/// write the collapsed input `Σ a_s X_s` to `collapsed` and return the post/comb weights.
pub fn hyper_connection(
    hc: &HyperConnection,
    mix: &[f32],
    x: &[f32],
    m: usize,
    hc_eps: f32,
    sinkhorn_iters: usize,
    collapsed: &mut [f32],
) -> HcWeights {
    let d = collapsed.len();
    let [s_pre, s_post, s_comb] = hc.scale;
    let pre: Vec<f32> = (0..m).map(|i| sigmoid(mix[i] * s_pre + hc.base[i]) + hc_eps).collect();
    let post: Vec<f32> = (0..m).map(|i| 2.0 * sigmoid(mix[m + i] * s_post + hc.base[m + i])).collect();
    let mut comb: Vec<f32> = (0..m * m).map(|k| mix[2 * m + k] * s_comb + hc.base[2 * m + k]).collect();
    for row in comb.chunks_mut(m) {
        let mx = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for v in row.iter_mut() {
            *v = (*v - mx).exp();
            sum += *v;
        }
        for v in row.iter_mut() {
            *v = *v / sum + hc_eps;
        }
    }
    let normalize_columns = |c: &mut [f32]| {
        for j in 0..m {
            let s: f32 = (0..m).map(|i| c[i * m + j]).sum::<f32>() + hc_eps;
            for i in 0..m {
                c[i * m + j] /= s;
            }
        }
    };
    normalize_columns(&mut comb);
    for _ in 1..sinkhorn_iters {
        for row in comb.chunks_mut(m) {
            let s: f32 = row.iter().sum::<f32>() + hc_eps;
            for v in row.iter_mut() {
                *v /= s;
            }
        }
        normalize_columns(&mut comb);
    }
    for (c, o) in collapsed.iter_mut().enumerate() {
        *o = (0..m).map(|s| pre[s] * x[s * d + c]).sum();
    }
    HcWeights { post, comb }
}

/// Expand a block output `y` (`[D]`) back into M streams: `X'_j = β_j·y + Σ_i C_ij X_i`.
pub fn hyper_expand(w: &HcWeights, x: &[f32], y: &[f32], out: &mut [f32]) {
    let m = w.post.len();
    let d = y.len();
    for j in 0..m {
        let o = &mut out[j * d..(j + 1) * d];
        for (c, v) in o.iter_mut().enumerate() {
            let mixed: f32 = (0..m).map(|i| w.comb[i * m + j] * x[i * d + c]).sum();
            *v = w.post[j] * y[c] + mixed;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::linear::{CpuLinear, WeightRows};

    #[test]
    fn sinkhorn_comb_is_doubly_stochastic() {
        let (m, d) = (4, 3);
        let n = (2 + m) * m;
        let proj: Vec<f32> = (0..n * m * d).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.05).collect();
        let hc = HyperConnection {
            proj: CpuLinear { rows: n, cols: m * d, weight: WeightRows::F32(proj.clone()), bias: None },
            base: (0..n).map(|i| (i as f32 * 0.7).sin()).collect(),
            scale: [0.9, 1.1, 2.0],
        };
        let x: Vec<f32> = (0..m * d).map(|i| (i as f32 * 1.3).cos()).collect();
        let mut xn = vec![0f32; m * d];
        hc_normalize(&x, 1e-5, &mut xn);
        let mix: Vec<f32> = proj.chunks(m * d).map(|row| row.iter().zip(&xn).map(|(a, b)| a * b).sum()).collect();
        let mut col = vec![0f32; d];
        let w = hyper_connection(&hc, &mix, &x, m, 1e-6, 20, &mut col);
        for j in 0..m {
            let s: f32 = (0..m).map(|i| w.comb[i * m + j]).sum();
            assert!((s - 1.0).abs() < 1e-4, "column {j} sums to {s}");
        }
        for i in 0..m {
            let s: f32 = w.comb[i * m..(i + 1) * m].iter().sum();
            assert!((s - 1.0).abs() < 1e-2, "row {i} sums to {s}");
        }
        assert!(w.post.iter().all(|&p| p > 0.0 && p < 2.0));
        // Expanding a zero block output with the identity-like comb keeps the stream sums.
        let mut out = vec![0f32; m * d];
        hyper_expand(&w, &x, &[0.0; 3], &mut out);
        for c in 0..d {
            let before: f32 = (0..m).map(|s| x[s * d + c]).sum();
            let after: f32 = (0..m).map(|s| out[s * d + c]).sum();
            assert!((before - after).abs() < 1e-3);
        }
    }

    #[test]
    fn swiglu_clamps_gate_above_and_up_both_sides() {
        let mut out = [0f32; 3];
        swiglu_clamped(&[5.0, -5.0, 0.5, 5.0, -5.0, 0.25], 1.0, &mut out);
        assert!((out[0] - silu(1.0)).abs() < 1e-7);
        assert!((out[1] - -silu(-5.0)).abs() < 1e-7);
        assert!((out[2] - silu(0.5) * 0.25).abs() < 1e-7);
    }

    #[test]
    fn norms_match_their_definitions() {
        let mut x = [3.0f32, 4.0];
        l2_normalize(&mut x, 1.0);
        assert!((x[0] - 0.6).abs() < 1e-6 && (x[1] - 0.8).abs() < 1e-6);
        let mut y = [1.0f32, 3.0];
        layer_norm(&mut y, &[1.0, 1.0], &[0.5, 0.5], 0.0);
        assert!((y[0] + 0.5).abs() < 1e-6 && (y[1] - 1.5).abs() < 1e-6);
        let mut z = [2.0f32, 2.0];
        rms_norm(&mut z, &[1.0, 3.0], 0.0);
        assert_eq!(z, [1.0, 3.0]);
    }
}
