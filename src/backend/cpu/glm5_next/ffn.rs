//! Feed-forward blocks on the CPU (spec §5): the clamped SwiGLU MLP (dense layers, shared and
//! routed experts) and the MoE router — sigmoid scores, correction bias for selection only,
//! group-limited top-k (groups scored by their two best experts), normalisation and routed
//! scaling. Tokens are grouped by expert so each expert's weights are read once per step; each
//! token's routed outputs are summed in ascending expert order, so its result never depends on
//! which other tokens share the batch.

use std::ops::Range;

use crate::backend::cpu::linear::LinearScratch;
use rayon::prelude::*;

use super::ops::{sigmoid, swiglu_clamped};
use super::weights::{Mlp, Moe};
use crate::backend::BackendError;
use crate::model::glm5_next::Glm5Config;

/// SwiGLU MLP over `m` rows of `x`.
pub fn mlp(w: &Mlp, x: &[f32], m: usize, limit: f32, simd: bool) -> Result<Vec<f32>, BackendError> {
    let inter = w.gate_up.rows / 2;
    let mut gu = vec![0f32; m * 2 * inter];
    w.gate_up.forward(x, m, &mut gu, &mut LinearScratch::default(), simd)?;
    let mut act = vec![0f32; m * inter];
    for (a, g) in act.chunks_mut(inter).zip(gu.chunks(2 * inter)) {
        swiglu_clamped(g, limit, a);
    }
    let mut y = vec![0f32; m * w.down.rows];
    w.down.forward(&act, m, &mut y, &mut LinearScratch::default(), simd)?;
    Ok(y)
}

/// Indices of the `k` largest values (ties to the lower index), in descending order of value.
fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// The router's choice for one token from its router logits: `(expert, weight)` sorted by expert.
pub fn route(c: &Glm5Config, logits: &[f32], bias: &[f32]) -> Vec<(usize, f32)> {
    let e = logits.len();
    let scores: Vec<f32> = logits.iter().map(|&l| sigmoid(l)).collect();
    let choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
    let per_group = e / c.n_group;
    let group_scores: Vec<f32> = choice
        .chunks(per_group)
        .map(|g| {
            let best = top_k(g, 2);
            best.iter().map(|&i| g[i]).sum()
        })
        .collect();
    let kept = top_k(&group_scores, c.topk_group);
    let masked: Vec<f32> = choice
        .iter()
        .enumerate()
        .map(|(i, &v)| if kept.contains(&(i / per_group)) { v } else { f32::NEG_INFINITY })
        .collect();
    let mut chosen = top_k(&masked, c.num_experts_per_tok);
    chosen.sort_unstable();
    let denom = if c.norm_topk_prob { chosen.iter().map(|&i| scores[i]).sum::<f32>() + 1e-20 } else { 1.0 };
    chosen.into_iter().map(|i| (i, scores[i] / denom * c.routed_scaling_factor)).collect()
}

/// MoE block over `m` rows of `x`. `held` are the routed experts `w.experts` holds (all of them
/// but under expert parallelism): tokens routed elsewhere get nothing from this rank for that
/// route, the owner's partial sum supplies it.
pub fn moe(
    c: &Glm5Config,
    w: &Moe,
    x: &[f32],
    m: usize,
    held: Range<usize>,
    simd: bool,
) -> Result<Vec<f32>, BackendError> {
    let d = c.hidden_size;
    let e = c.n_routed_experts;
    let mut logits = vec![0f32; m * e];
    w.router.forward(x, m, &mut logits, &mut LinearScratch::default(), simd)?;
    let routes: Vec<Vec<(usize, f32)>> = logits.chunks(e).map(|l| route(c, l, &w.correction_bias)).collect();
    // (row, slot in the row's route) per expert.
    let mut assigned: Vec<Vec<(usize, usize)>> = vec![Vec::new(); e];
    for (row, r) in routes.iter().enumerate() {
        for (k, &(ex, _)) in r.iter().enumerate().filter(|(_, (ex, _))| held.contains(ex)) {
            assigned[ex].push((row, k));
        }
    }
    let outputs: Vec<Result<Vec<f32>, BackendError>> = assigned
        .par_iter()
        .enumerate()
        .map(|(ex, rows)| {
            if rows.is_empty() {
                return Ok(Vec::new());
            }
            let xs: Vec<f32> = rows.iter().flat_map(|&(row, _)| x[row * d..(row + 1) * d].iter().copied()).collect();
            mlp(&w.experts[ex - held.start], &xs, rows.len(), c.swiglu_limit, simd)
        })
        .collect();
    // Per row and route slot, the expert's output row.
    let k = c.num_experts_per_tok;
    let mut slot_out: Vec<Option<&[f32]>> = vec![None; m * k];
    let outputs = outputs.into_iter().collect::<Result<Vec<_>, _>>()?;
    for (ex, rows) in assigned.iter().enumerate() {
        for (i, &(row, slot)) in rows.iter().enumerate() {
            slot_out[row * k + slot] = Some(&outputs[ex][i * d..(i + 1) * d]);
        }
    }
    let mut y = mlp(&w.shared, x, m, c.swiglu_limit, simd)?;
    for (row, r) in routes.iter().enumerate() {
        let mut acc = vec![0f32; d];
        for (slot, &(_, weight)) in r.iter().enumerate() {
            if let Some(o) = slot_out[row * k + slot] {
                for (a, &v) in acc.iter_mut().zip(o) {
                    *a += weight * v;
                }
            }
        }
        for (yv, a) in y[row * d..(row + 1) * d].iter_mut().zip(acc) {
            *yv += a;
        }
    }
    Ok(y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn cfg(experts: usize, k: usize, groups: usize, topk_group: usize) -> Glm5Config {
        let json = format!(
            r#"{{"model_type": "glm5_next", "num_hidden_layers": 4, "n_routed_experts": {experts},
            "num_experts_per_tok": {k}, "n_group": {groups}, "topk_group": {topk_group}, "routed_scaling_factor": 2.0}}"#
        );
        Glm5Config::from_hf_json(&json, Path::new("config.json")).unwrap()
    }

    #[test]
    fn group_limited_routing_keeps_the_best_group() {
        let c = cfg(8, 2, 2, 1);
        // Group 0 (experts 0..4) has the single best expert, group 1 the best pair.
        let logits = [3.0f32, -3.0, -3.0, -3.0, 2.0, 2.0, -3.0, -3.0];
        let r = route(&c, &logits, &[0.0; 8]);
        let experts: Vec<usize> = r.iter().map(|x| x.0).collect();
        assert_eq!(experts, vec![4, 5]);
        let total: f32 = r.iter().map(|x| x.1).sum();
        assert!((total - 2.0).abs() < 1e-6, "normalised then scaled by 2: {total}");
    }

    #[test]
    fn correction_bias_changes_selection_not_weights() {
        let c = cfg(4, 1, 1, 1);
        let logits = [1.0f32, 0.0, 0.0, 0.0];
        let r = route(&c, &logits, &[0.0, 0.9, 0.0, 0.0]);
        assert_eq!(r[0].0, 1);
        assert!((r[0].1 - 2.0).abs() < 1e-6);
        let c2 = Glm5Config { norm_topk_prob: false, ..c };
        let r = route(&c2, &logits, &[0.0, 0.9, 0.0, 0.0]);
        assert!((r[0].1 - 2.0 * sigmoid(0.0)).abs() < 1e-6);
    }
}
