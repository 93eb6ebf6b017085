//! The MLA + DSA mixer on the CPU (spec §4): q LoRA with its norm, the normalised kv latent
//! (what the cache holds), attention in absorbed form over the latent (`q̃_h = W^Kᵀ q_h`, scores
//! `q̃_h·c_τ / sqrt(d_qk)`, `o_h = W^V ĉ_h`), and the DSA selection: the indexer's per-token key
//! and gate logits, pooled keys computed once when a pool of `index_kpool` tokens completes,
//! ReLU-weighted scores, the top `index_topk / index_kpool` pools, and the query's own incomplete
//! pool as a raw tail. Shared-indexer layers reuse the previous layer's selection.
//!
//! Each query reads only cache positions `≤` itself and sums over them in ascending order, so its
//! output does not depend on chunking or batch company.

use crate::backend::cpu::linear::LinearScratch;
use rayon::prelude::*;

use super::cache::{DsaSlots, Glm5Cache};
use super::forward::SeqRows;
use super::ops::{layer_norm, rms_norm};
use super::shard::RankGroup;
use super::weights::{IndexerWeights, MlaWeights};
use crate::backend::cpu::linear::CpuLinear;
use crate::backend::BackendError;
use crate::model::glm5_next::Glm5Config;

fn project(l: &CpuLinear, x: &[f32], m: usize, simd: bool) -> Result<Vec<f32>, BackendError> {
    let mut y = vec![0f32; m * l.rows];
    l.forward(x, m, &mut y, &mut LinearScratch::default(), simd)?;
    Ok(y)
}

/// Selected key positions (ascending) for each batch row of a DSA layer.
pub type Selection = Vec<Vec<u32>>;

/// The DSA choice for one query at absolute position `t`: the best `budget` of the
/// `(t+1) / pool` complete pools by `score(p)` (ties go to the earlier pool), expanded to token
/// positions, plus the raw tail of the query's own incomplete pool when `tail` is set.
pub fn select_positions(t: usize, pool: usize, budget: usize, tail: bool, score: impl Fn(usize) -> f32) -> Vec<u32> {
    let complete = (t + 1) / pool;
    let mut pools: Vec<usize> = (0..complete).collect();
    if complete > budget {
        let scores: Vec<f32> = pools.iter().map(|&p| score(p)).collect();
        pools.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
        pools.truncate(budget);
        pools.sort_unstable();
    }
    let mut out: Vec<u32> = pools.iter().flat_map(|&p| (p * pool) as u32..((p + 1) * pool) as u32).collect();
    if tail {
        out.extend((complete * pool) as u32..=t as u32);
    }
    out
}

/// The pooled indexer key of the `pool` tokens whose `(k, γ)` records are given, per channel
/// `Σ_j softmax_j(γ_j + ape_j) · k_j`.
pub fn pooled_key(keys: &[&[f32]], gates: &[&[f32]], ape: &[f32], out: &mut [f32]) {
    let d = out.len();
    for (c, o) in out.iter_mut().enumerate() {
        let logits: Vec<f32> = (0..keys.len()).map(|j| gates[j][c] + ape[j * d + c]).collect();
        let mx = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = logits.iter().map(|&l| (l - mx).exp()).collect();
        let sum: f32 = e.iter().sum();
        *o = (0..keys.len()).map(|j| e[j] / sum * keys[j][c]).sum();
    }
}

struct IndexerRows {
    /// `[N, H_I·d_I]`.
    q: Vec<f32>,
    /// `[N, H_I]`, already scaled by `H_I^-1/2`.
    weights: Vec<f32>,
    /// `[N, 2·d_I + H_I]`: raw `wk` output, gate logits, raw head weights.
    k_gate_w: Vec<f32>,
}

/// Run one DSA layer over the batch rows `u` (`[N, D]`). Returns the mixer output and, for a
/// full-indexer layer, the selection (for a following shared layer).
#[allow(clippy::too_many_arguments)]
pub fn forward(
    c: &Glm5Config,
    w: &MlaWeights,
    u: &[f32],
    seqs: &[SeqRows<'_>],
    cache: &mut Glm5Cache,
    slots: DsaSlots,
    shared_selection: Option<&Selection>,
    group: Option<&RankGroup>,
    simd: bool,
) -> Result<(Vec<f32>, Option<Selection>), BackendError> {
    let n_rows = u.len() / c.hidden_size;
    let (h, dn, dv, r) = (c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank);
    let eps = c.rms_norm_eps;
    let mut q_r = project(&w.q_a, u, n_rows, simd)?;
    q_r.chunks_mut(c.q_lora_rank).for_each(|x| rms_norm(x, &w.q_a_norm, eps));
    let q = project(&w.q_b, &q_r, n_rows, simd)?;
    let mut latent = project(&w.kv_a, u, n_rows, simd)?;
    latent.chunks_mut(r).for_each(|x| rms_norm(x, &w.kv_a_norm, eps));
    let di = c.index_head_dim;
    let indexer = match (&w.indexer, slots.indexer) {
        (Some(ix), Some(off)) => Some((ix, off, index_rows(c, ix, u, &q_r, n_rows, group, simd)?)),
        (None, _) => None,
        (Some(_), None) => return Err(BackendError::InvalidStep("indexer layer without indexer cache slots".into())),
    };
    if indexer.is_none() && shared_selection.is_none() {
        return Err(BackendError::InvalidStep("shared DSA layer without a preceding full-indexer layer".into()));
    }
    let kgw_w = 2 * di + c.index_n_heads;
    // Cache writes: latents, indexer (k, γ), then pooled keys of pools completed by this chunk.
    for s in seqs {
        for t in 0..s.n {
            let rec = cache.record(s.table, s.start_pos + t);
            let row = s.row0 + t;
            cache.kv[rec + slots.latent..rec + slots.latent + r].copy_from_slice(&latent[row * r..(row + 1) * r]);
            if let Some((ix, off, ir)) = &indexer {
                let dst = &mut cache.kv[rec + off..rec + off + 2 * di];
                dst.copy_from_slice(&ir.k_gate_w[row * kgw_w..row * kgw_w + 2 * di]);
                layer_norm(&mut dst[..di], &ix.k_norm_w, &ix.k_norm_b, 1e-6);
            }
        }
        if let Some((ix, off, _)) = &indexer {
            let p = c.index_kpool;
            for pos in s.start_pos..s.start_pos + s.n {
                if (pos + 1) % p != 0 {
                    continue;
                }
                let recs: Vec<usize> = (pos + 1 - p..=pos).map(|x| cache.record(s.table, x)).collect();
                let keys: Vec<&[f32]> = recs.iter().map(|&x| &cache.kv[x + off..x + off + di]).collect();
                let gates: Vec<&[f32]> = recs.iter().map(|&x| &cache.kv[x + off + di..x + off + 2 * di]).collect();
                let mut pooled = vec![0f32; di];
                pooled_key(&keys, &gates, &ix.ape, &mut pooled);
                let last = recs[p - 1] + off + 2 * di;
                cache.kv[last..last + di].copy_from_slice(&pooled);
            }
        }
    }
    let cache = &*cache;
    let mut selection: Selection = vec![Vec::new(); n_rows];
    let mut attn = vec![0f32; n_rows * h * dv];
    for s in seqs {
        let rows = s.row0..s.row0 + s.n;
        let sel_part = &mut selection[rows.clone()];
        sel_part.par_iter_mut().enumerate().for_each(|(t, sel)| {
            let pos = s.start_pos + t;
            let row = s.row0 + t;
            *sel = match (&indexer, shared_selection) {
                (Some((_, off, ir)), _) => {
                    let hi = c.index_n_heads;
                    let qi = &ir.q[row * hi * di..(row + 1) * hi * di];
                    let wi = &ir.weights[row * hi..(row + 1) * hi];
                    let scale = 1.0 / (di as f32).sqrt();
                    let score = |p: usize| {
                        let rec = cache.record(s.table, p * c.index_kpool + c.index_kpool - 1) + off + 2 * di;
                        let key = &cache.kv[rec..rec + di];
                        (0..hi)
                            .map(|hh| {
                                let dot: f32 = qi[hh * di..(hh + 1) * di].iter().zip(key).map(|(a, b)| a * b).sum();
                                wi[hh] * (dot * scale).max(0.0)
                            })
                            .sum::<f32>()
                    };
                    select_positions(pos, c.index_kpool, c.pool_budget(), c.index_kpool_always_select_tail, score)
                }
                (None, Some(prev)) => prev[row].clone(),
                (None, None) => Vec::new(),
            };
        });
        let out_part = &mut attn[rows.start * h * dv..rows.end * h * dv];
        out_part.par_chunks_mut(h * dv).enumerate().for_each(|(t, out)| {
            let row = s.row0 + t;
            let sel = &selection[row];
            if sel.is_empty() {
                return;
            }
            let lat: Vec<&[f32]> = sel
                .iter()
                .map(|&p| {
                    let rec = cache.record(s.table, p as usize) + slots.latent;
                    &cache.kv[rec..rec + r]
                })
                .collect();
            let scale = 1.0 / (dn as f32).sqrt();
            for hh in 0..h {
                let wk = &w.kv_b[hh * (dn + dv) * r..(hh * (dn + dv) + dn) * r];
                let wv = &w.kv_b[(hh * (dn + dv) + dn) * r..(hh + 1) * (dn + dv) * r];
                let qh = &q[row * h * dn + hh * dn..row * h * dn + (hh + 1) * dn];
                let mut qt = vec![0f32; r];
                for (i, &qv) in qh.iter().enumerate() {
                    for (a, &b) in qt.iter_mut().zip(&wk[i * r..(i + 1) * r]) {
                        *a += qv * b;
                    }
                }
                let scores: Vec<f32> =
                    lat.iter().map(|cl| cl.iter().zip(&qt).map(|(a, b)| a * b).sum::<f32>() * scale).collect();
                let mx = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = scores.iter().map(|&x| (x - mx).exp()).collect();
                let sum: f32 = e.iter().sum();
                let mut ctx = vec![0f32; r];
                for (cl, &ev) in lat.iter().zip(&e) {
                    let p = ev / sum;
                    for (a, &b) in ctx.iter_mut().zip(cl.iter()) {
                        *a += p * b;
                    }
                }
                let o = &mut out[hh * dv..(hh + 1) * dv];
                for (j, ov) in o.iter_mut().enumerate() {
                    *ov = wv[j * r..(j + 1) * r].iter().zip(&ctx).map(|(a, b)| a * b).sum();
                }
            }
        });
    }
    let y = project(&w.o_proj, &attn, n_rows, simd)?;
    Ok((y, indexer.map(|_| selection)))
}

fn index_rows(
    c: &Glm5Config,
    ix: &IndexerWeights,
    u: &[f32],
    q_r: &[f32],
    n_rows: usize,
    group: Option<&RankGroup>,
    simd: bool,
) -> Result<IndexerRows, BackendError> {
    let q = project(&ix.wq_b, q_r, n_rows, simd)?;
    // Each rank projects its indexer heads; all ranks score over every head, in one order.
    let q = match group {
        Some(g) => g.gather_columns(&q, n_rows)?,
        None => q,
    };
    let kgw = project(&ix.k_gate_w, u, n_rows, simd)?;
    let (di, hi) = (c.index_head_dim, c.index_n_heads);
    let scale = 1.0 / (hi as f32).sqrt();
    let weights = kgw.chunks(2 * di + hi).flat_map(|row| row[2 * di..].iter().map(move |&x| x * scale)).collect();
    Ok(IndexerRows { q, weights, k_gate_w: kgw })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selection_is_dense_until_the_budget_then_sparse_with_tail() {
        // Pool 4, budget 2: t = 6 has one complete pool and a 3-token tail.
        assert_eq!(select_positions(6, 4, 2, true, |_| 0.0), vec![0, 1, 2, 3, 4, 5, 6]);
        // t = 13: pools 0..3 complete; the best two by score are 2 and 0; tail 12, 13.
        let got = select_positions(13, 4, 2, true, |p| [3.0, 1.0, 5.0][p]);
        assert_eq!(got, vec![0, 1, 2, 3, 8, 9, 10, 11, 12, 13]);
        // At a pool boundary there is no tail, so the query's own pool must win to be seen.
        let got = select_positions(11, 4, 2, true, |p| [3.0, 1.0, 0.0][p]);
        assert_eq!(got, vec![0, 1, 2, 3, 4, 5, 6, 7]);
        // Ties go to the earlier pool; without the tail option nothing is appended.
        assert_eq!(select_positions(13, 4, 1, false, |_| 0.0), vec![0, 1, 2, 3]);
    }

    #[test]
    fn pooled_key_is_a_per_channel_softmax_average() {
        let k0 = [1.0f32, 10.0];
        let k1 = [3.0f32, 20.0];
        let g0 = [0.0f32, 100.0];
        let g1 = [0.0f32, 0.0];
        let mut out = [0f32; 2];
        pooled_key(&[&k0, &k1], &[&g0, &g1], &[0.0; 4], &mut out);
        assert!((out[0] - 2.0).abs() < 1e-6);
        assert!((out[1] - 10.0).abs() < 1e-4);
    }
}
