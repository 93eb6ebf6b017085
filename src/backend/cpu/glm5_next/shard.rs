//! One rank's share of `glm5_next` on the CPU: the full weights sliced as
//! [`Glm5Shard`](crate::model::glm5_next::shard::Glm5Shard) says, and [`RankGroup`], the rank's
//! handle to its group that the forward uses where the slices meet (the all-reduce after every
//! row-parallel mixer and FFN output, the indexer's query rows gathered across ranks, the
//! vocabulary-parallel logits gathered).

use std::ops::Range;
use std::sync::Arc;

use super::weights::{Ffn, Glm5Weights, HyperConnection, IndexerWeights, KdaWeights, Mixer, MlaWeights, Mlp, Moe};
use crate::backend::cpu::linear::CpuLinear;
use crate::backend::BackendError;
use crate::model::glm5_next::shard::Glm5Shard;
use crate::model::glm5_next::weights::Layer;
use crate::model::glm5_next::Glm5Config;
use crate::parallel::Collective;

/// A rank's handle to its tensor-parallel group, as the forward pass needs it.
pub struct RankGroup {
    pub comm: Arc<dyn Collective>,
    /// Routed experts this rank computes.
    pub experts: Range<usize>,
    /// `lm_head` rows this rank holds.
    pub vocab: Range<usize>,
}

fn collective_error(e: crate::parallel::CollectiveError) -> BackendError {
    BackendError::Device(format!("tensor parallel: {e}"))
}

impl RankGroup {
    /// Sum the ranks' partial results in place (same bits on every rank).
    pub fn all_reduce(&self, buf: &mut [f32]) -> Result<(), BackendError> {
        self.comm.all_reduce_sum(buf).map_err(collective_error)
    }

    /// Join the ranks' column slices of `rows` rows (`local` is `[rows, width]`, this rank's
    /// columns) into `[rows, width · world]`, rank 0's columns first.
    pub fn gather_columns(&self, local: &[f32], rows: usize) -> Result<Vec<f32>, BackendError> {
        let world = self.comm.world_size();
        if world == 1 || rows == 0 {
            return Ok(local.to_vec());
        }
        let width = local.len() / rows;
        let mut by_rank = vec![0f32; local.len() * world];
        self.comm.all_gather(local, &mut by_rank).map_err(collective_error)?;
        let mut out = vec![0f32; local.len() * world];
        for (r, part) in by_rank.chunks_exact(local.len()).enumerate() {
            for (row, src) in part.chunks_exact(width).enumerate() {
                let at = row * width * world + r * width;
                out[at..at + width].copy_from_slice(src);
            }
        }
        Ok(out)
    }

    /// Join the ranks' logits slices (`local` is `[m, this rank's vocabulary rows]`) into
    /// `[m, vocab]`. Every slice but the last has `ceil(vocab / world)` columns; the last is
    /// zero-padded to that width for the gather and the padding dropped after.
    pub fn gather_vocab(&self, local: &[f32], m: usize, vocab: usize) -> Result<Vec<f32>, BackendError> {
        crate::backend::cpu::gather_vocab_slices(self.comm.as_ref(), &self.vocab, local, m, vocab)
    }
}

fn rows(l: &CpuLinear, ranges: &[Range<usize>]) -> CpuLinear {
    let parts: Vec<CpuLinear> = ranges.iter().map(|r| l.clone().take_rows(r.clone())).collect();
    match CpuLinear::stack_mixed(parts) {
        Ok(l) => l,
        // Slices of one projection have its columns, so they always stack.
        Err(mut parts) => parts.remove(0),
    }
}

fn cols(l: &CpuLinear, range: Range<usize>, first: bool) -> CpuLinear {
    l.clone().take_cols(range, first)
}

/// `range` of items of `width` each (heads to channels).
fn scaled(range: &Range<usize>, width: usize) -> Range<usize> {
    range.start * width..range.end * width
}

fn hc(h: &HyperConnection) -> HyperConnection {
    HyperConnection { proj: h.proj.clone(), base: h.base.clone(), scale: h.scale }
}

fn mlp(m: &Mlp, keep: &Range<usize>, first: bool) -> Mlp {
    let inter = m.gate_up.rows / 2;
    Mlp {
        gate_up: rows(&m.gate_up, &[keep.clone(), inter + keep.start..inter + keep.end]),
        down: cols(&m.down, keep.clone(), first),
    }
}

fn kda(c: &Glm5Config, w: &KdaWeights, s: &Glm5Shard, first: bool) -> KdaWeights {
    let (q, hd, k) = (c.linear_qkv_dim(), c.linear_head_dim, c.linear_conv_kernel_dim);
    let ch = scaled(&s.kda_heads, hd);
    let qkv_rows = [ch.clone(), q + ch.start..q + ch.end, 2 * q + ch.start..2 * q + ch.end];
    KdaWeights {
        qkv: rows(&w.qkv, &qkv_rows),
        conv: qkv_rows.iter().flat_map(|r| w.conv[r.start * k..r.end * k].iter().copied()).collect(),
        f_a: w.f_a.clone(),
        f_b: rows(&w.f_b, std::slice::from_ref(&ch)),
        dt_bias: w.dt_bias[ch.clone()].to_vec(),
        a_log: w.a_log[s.kda_heads.clone()].to_vec(),
        b_proj: rows(&w.b_proj, std::slice::from_ref(&s.kda_heads)),
        g_a: w.g_a.clone(),
        g_b: rows(&w.g_b, std::slice::from_ref(&ch)),
        o_norm: w.o_norm.clone(),
        o_proj: cols(&w.o_proj, ch, first),
    }
}

fn mla(c: &Glm5Config, w: &MlaWeights, s: &Glm5Shard, first: bool) -> MlaWeights {
    let (dn, dv, r) = (c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank);
    let kv_b = scaled(&scaled(&s.mla_heads, dn + dv), r);
    MlaWeights {
        q_a: w.q_a.clone(),
        q_a_norm: w.q_a_norm.clone(),
        q_b: rows(&w.q_b, &[scaled(&s.mla_heads, dn)]),
        kv_a: w.kv_a.clone(),
        kv_a_norm: w.kv_a_norm.clone(),
        kv_b: w.kv_b[kv_b].to_vec(),
        o_proj: cols(&w.o_proj, scaled(&s.mla_heads, dv), first),
        indexer: w.indexer.as_ref().map(|ix| IndexerWeights {
            wq_b: rows(&ix.wq_b, &[scaled(&s.index_heads, c.index_head_dim)]),
            k_gate_w: ix.k_gate_w.clone(),
            k_norm_w: ix.k_norm_w.clone(),
            k_norm_b: ix.k_norm_b.clone(),
            ape: ix.ape.clone(),
        }),
    }
}

fn moe(w: &Moe, s: &Glm5Shard, first: bool) -> Moe {
    let experts = if s.expert_parallel {
        // Whole experts: only the owner computes them, so their rows are not split.
        w.experts[s.experts.clone()].iter().map(|e| mlp(e, &(0..e.gate_up.rows / 2), true)).collect()
    } else {
        w.experts.iter().map(|e| mlp(e, &s.expert_rows, first)).collect()
    };
    Moe {
        router: w.router.clone(),
        correction_bias: w.correction_bias.clone(),
        experts,
        shared: mlp(&w.shared, &s.shared_rows, first),
    }
}

/// This rank's slice of the full weights `w` of model `c`.
pub fn shard_weights(c: &Glm5Config, w: &Glm5Weights, s: &Glm5Shard) -> Glm5Weights {
    let first = s.tp.rank == 0;
    let layers = w
        .layers
        .iter()
        .map(|l| Layer {
            attn_hc: hc(&l.attn_hc),
            ffn_hc: hc(&l.ffn_hc),
            input_norm: l.input_norm.clone(),
            post_norm: l.post_norm.clone(),
            mixer: match &l.mixer {
                Mixer::Kda(k) => Mixer::Kda(kda(c, k, s, first)),
                Mixer::Dsa(m) => Mixer::Dsa(mla(c, m, s, first)),
            },
            ffn: match &l.ffn {
                Ffn::Dense(m) => Ffn::Dense(mlp(m, &s.dense_rows, first)),
                Ffn::Moe(m) => Ffn::Moe(moe(m, s, first)),
            },
        })
        .collect();
    let head = w.lm_head.as_ref().unwrap_or(&w.embed);
    Glm5Weights {
        embed: w.embed.clone(),
        layers,
        norm: w.norm.clone(),
        lm_head: Some(head.clone().take_rows(s.vocab.clone())),
    }
}
