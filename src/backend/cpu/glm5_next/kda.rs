//! The KDA (Kimi delta attention) mixer on the CPU (spec §3): q/k/v projections, the depthwise
//! causal conv over a `K−1` window of raw projections with SiLU, the lower-bounded forget gate,
//! β, l2-normalised q/k, the per-token delta-rule recurrence on the f32 state, the gated output
//! RMSNorm and `o_proj`. Prefill and decode run the same per-token recurrence (transformers' decode
//! kernel), so a token's output is bitwise the same however its sequence was chunked.

use crate::backend::cpu::linear::LinearScratch;
use rayon::prelude::*;

use super::cache::{Glm5Cache, KdaSlots};
use super::forward::SeqRows;
use super::ops::{gated_rms_norm, l2_normalize, sigmoid, silu};
use super::weights::KdaWeights;
use crate::backend::BackendError;
use crate::model::glm5_next::Glm5Config;

fn project(
    l: &crate::backend::cpu::linear::CpuLinear,
    x: &[f32],
    m: usize,
    simd: bool,
) -> Result<Vec<f32>, BackendError> {
    let mut y = vec![0f32; m * l.rows];
    l.forward(x, m, &mut y, &mut LinearScratch::default(), simd)?;
    Ok(y)
}

/// Log-decay of one channel: `lb·σ(e^{A}·f)` with a lower bound, else `−e^{A}·softplus(f)`.
pub fn forget_gate(f: f32, a_log: f32, lower_bound: Option<f32>) -> f32 {
    let rate = a_log.exp();
    match lower_bound {
        Some(lb) => lb * sigmoid(rate * f),
        None => {
            let sp = if f > 20.0 { f } else { (1.0 + f.exp()).ln() };
            -rate * sp
        }
    }
}

/// One head's delta-rule step on its `[d_k, d_v]` state; writes `Sᵀq` to `out`.
pub fn delta_rule_step(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: f32, out: &mut [f32]) {
    let dv = v.len();
    for (row, &gi) in s.chunks_exact_mut(dv).zip(g) {
        let decay = gi.exp();
        for x in row.iter_mut() {
            *x *= decay;
        }
    }
    let mut err = v.to_vec();
    for (row, &ki) in s.chunks_exact(dv).zip(k) {
        for (e, &x) in err.iter_mut().zip(row) {
            *e -= x * ki;
        }
    }
    for e in err.iter_mut() {
        *e *= beta;
    }
    for (row, &ki) in s.chunks_exact_mut(dv).zip(k) {
        for (x, &e) in row.iter_mut().zip(&err) {
            *x += ki * e;
        }
    }
    out.fill(0.0);
    for (row, &qi) in s.chunks_exact(dv).zip(q) {
        for (o, &x) in out.iter_mut().zip(row) {
            *o += x * qi;
        }
    }
}

/// Run one KDA layer over the batch rows `u` (`[N, D]`), reading and advancing each sequence's
/// conv window and recurrent state in its cache slot.
pub fn forward(
    c: &Glm5Config,
    w: &KdaWeights,
    u: &[f32],
    seqs: &[SeqRows<'_>],
    cache: &mut Glm5Cache,
    slots: KdaSlots,
    simd: bool,
) -> Result<Vec<f32>, BackendError> {
    let n_rows = u.len() / c.hidden_size;
    let (q, hd, heads, kw) = (c.linear_qkv_dim(), c.linear_head_dim, c.linear_num_heads, c.linear_conv_kernel_dim);
    let q3 = 3 * q;
    let raw = project(&w.qkv, u, n_rows, simd)?;
    let f = project(&w.f_b, &project(&w.f_a, u, n_rows, simd)?, n_rows, simd)?;
    let b = project(&w.b_proj, u, n_rows, simd)?;
    let z = project(&w.g_b, &project(&w.g_a, u, n_rows, simd)?, n_rows, simd)?;
    let mut core = vec![0f32; n_rows * q];
    let stride = cache.slot_stride;
    for s in seqs {
        let slot = &mut cache.state[s.slot * stride..(s.slot + 1) * stride];
        // A verification step keeps this layer's part of the slot after every token but the last,
        // so the step can be rolled back to any accepted length (`Glm5Cache::commit_verified`).
        let mut checkpoints = cache.checkpoints[s.slot].as_mut().map(|c| c.images.as_mut_slice());
        // Page ends inside a prefill chunk: this layer's part of the slot after those tokens.
        let mut marks = cache.marks[s.slot].as_mut();
        if let Some(m) = marks.as_deref_mut() {
            m.step_tokens = s.n;
        }
        let (before_state, rest) = slot.split_at_mut(slots.state);
        let window = &mut before_state[slots.conv..slots.conv + (kw - 1) * q3];
        let rec = &mut rest[..heads * hd * hd];
        // Short causal conv + SiLU, token by token over the window of raw projections.
        let mut conv = vec![0f32; s.n * q3];
        for t in 0..s.n {
            let r = &raw[(s.row0 + t) * q3..(s.row0 + t + 1) * q3];
            let out = &mut conv[t * q3..(t + 1) * q3];
            for ch in 0..q3 {
                let taps = &w.conv[ch * kw..(ch + 1) * kw];
                let mut acc = 0f32;
                for j in 0..kw - 1 {
                    acc += taps[j] * window[j * q3 + ch];
                }
                acc += taps[kw - 1] * r[ch];
                out[ch] = silu(acc);
            }
            if kw > 1 {
                window.copy_within(q3.., 0);
                window[(kw - 2) * q3..].copy_from_slice(r);
            }
            if let Some(images) = checkpoints.as_deref_mut().filter(|_| t + 1 < s.n) {
                let at = t * stride + slots.conv;
                images[at..at + window.len()].copy_from_slice(window);
            }
            if let Some(m) = marks.as_deref_mut() {
                if let Some(i) = m.index_after_token(t) {
                    let at = i * stride + slots.conv;
                    m.images[at..at + window.len()].copy_from_slice(window);
                }
            }
        }
        let keep_states = checkpoints.is_some();
        let marked: Vec<usize> = marks.as_deref().map(|m| m.after.clone()).unwrap_or_default();
        // Per head: the recurrence over the sequence's tokens in order.
        let per_head: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = rec
            .par_chunks_mut(hd * hd)
            .enumerate()
            .map(|(h, st)| {
                let mut outs = vec![0f32; s.n * hd];
                let mut kept = Vec::with_capacity(if keep_states { (s.n - 1) * hd * hd } else { 0 });
                let mut at_marks = Vec::with_capacity(marked.len() * hd * hd);
                let scale = 1.0 / (hd as f32).sqrt();
                let (mut qh, mut kh, mut g) = (vec![0f32; hd], vec![0f32; hd], vec![0f32; hd]);
                for t in 0..s.n {
                    let row = s.row0 + t;
                    let cv = &conv[t * q3..(t + 1) * q3];
                    qh.copy_from_slice(&cv[h * hd..(h + 1) * hd]);
                    kh.copy_from_slice(&cv[q + h * hd..q + (h + 1) * hd]);
                    let vh = &cv[2 * q + h * hd..2 * q + (h + 1) * hd];
                    l2_normalize(&mut qh, scale);
                    l2_normalize(&mut kh, 1.0);
                    for (i, gi) in g.iter_mut().enumerate() {
                        let ch = h * hd + i;
                        *gi = forget_gate(f[row * q + ch] + w.dt_bias[ch], w.a_log[h], c.linear_lower_bound);
                    }
                    let beta = sigmoid(b[row * heads + h]);
                    let o = &mut outs[t * hd..(t + 1) * hd];
                    delta_rule_step(st, &qh, &kh, vh, &g, beta, o);
                    gated_rms_norm(o, &z[row * q + h * hd..row * q + (h + 1) * hd], &w.o_norm, c.rms_norm_eps);
                    if keep_states && t + 1 < s.n {
                        kept.extend_from_slice(st);
                    }
                    if marked.binary_search(&(t + 1)).is_ok() {
                        at_marks.extend_from_slice(st);
                    }
                }
                (outs, kept, at_marks)
            })
            .collect();
        if let Some(m) = marks {
            for (h, (_, _, at_marks)) in per_head.iter().enumerate() {
                for (i, state) in at_marks.chunks_exact(hd * hd).enumerate() {
                    let at = i * stride + slots.state + h * hd * hd;
                    m.images[at..at + hd * hd].copy_from_slice(state);
                }
            }
        }
        if let Some(images) = checkpoints {
            for (h, (_, kept, _)) in per_head.iter().enumerate() {
                for (t, state) in kept.chunks_exact(hd * hd).enumerate() {
                    let at = t * stride + slots.state + h * hd * hd;
                    images[at..at + hd * hd].copy_from_slice(state);
                }
            }
        }
        for (h, (outs, _, _)) in per_head.iter().enumerate() {
            for t in 0..s.n {
                let row = s.row0 + t;
                core[row * q + h * hd..row * q + (h + 1) * hd].copy_from_slice(&outs[t * hd..(t + 1) * hd]);
            }
        }
    }
    project(&w.o_proj, &core, n_rows, simd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delta_rule_matches_its_closed_form() {
        // S' = (I − β k kᵀ) Diag(e^g) S + β k vᵀ and o = S'ᵀ q, on a 2×2 example.
        let mut s = vec![0.5f32, -1.0, 2.0, 0.25];
        let (q, k, v, g, beta) = ([1.0f32, 2.0], [0.6f32, 0.8], [1.0f32, -1.0], [-0.5f32, -1.0], 0.5f32);
        let mut o = [0f32; 2];
        delta_rule_step(&mut s, &q, &k, &v, &g, beta, &mut o);
        let d = [(-0.5f32).exp(), (-1.0f32).exp()];
        let s0 = [[0.5 * d[0], -d[0]], [2.0 * d[1], 0.25 * d[1]]];
        let mut expect = [[0f32; 2]; 2];
        for i in 0..2 {
            for j in 0..2 {
                let proj: f32 = (0..2).map(|l| k[i] * k[l] * s0[l][j]).sum();
                expect[i][j] = s0[i][j] - beta * proj + beta * k[i] * v[j];
            }
        }
        for i in 0..2 {
            for j in 0..2 {
                assert!((s[i * 2 + j] - expect[i][j]).abs() < 1e-6);
            }
        }
        for j in 0..2 {
            let oj: f32 = (0..2).map(|i| expect[i][j] * q[i]).sum();
            assert!((o[j] - oj).abs() < 1e-5);
        }
    }

    #[test]
    fn forget_gate_is_bounded() {
        for f in [-30.0f32, -1.0, 0.0, 3.0, 40.0] {
            let g = forget_gate(f, 0.3, Some(-5.0));
            // Open interval in exact arithmetic; σ saturates to 0 or 1 in f32 at the extremes.
            assert!((-5.0..=0.0).contains(&g), "{f}: {g}");
            assert!(forget_gate(f, 0.3, None) <= 0.0);
        }
        assert_eq!(forget_gate(25.0, 0.0, None), -25.0);
    }
}
