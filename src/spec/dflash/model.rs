//! The DFlash drafter's weights and its CPU forward pass. One pass per step proposes a whole block
//! for every requesting sequence: the block is the anchor (the sequence's last known token) and
//! `block_size - 1` mask tokens, embedded with the target's embedding; every layer's queries come
//! from the block, its keys and values from the sequence's context features (the target's tapped
//! hidden states, projected by `fc` + `hidden_norm`, then by the layer's own `k_proj`/`v_proj`)
//! followed by the block itself. Inside the block attention is non-causal (as configured), with a
//! sliding window on `sliding_attention` layers. The output rows after the anchor go through the
//! target's output head; DFlash takes each row's argmax, DFlash2 picks a path through the top
//! candidates of every row with its candidate selector.
//!
//! Context keys and values are cached per sequence (they depend only on the target's states, not on
//! the block), so each step only projects the rows the target added since the last one.

use rayon::prelude::*;

use super::config::DFlashConfig;
use crate::backend::cpu::linear::{load_vector, CpuLinear, LinearScratch};
use crate::backend::BackendError;
use crate::model::{ModelError, WeightSource};

/// GroupedDynamicCausalConv: a causal convolution over the block's rows whose per-channel kernel is
/// a learned base plus a per-row, per-group part projected from the input (`prepare` uses the first
/// half of the projection around the sublayer's input, `finish` the second around its output).
pub struct DynamicConv {
    /// `[2, kernel, hidden]`.
    base: Vec<f32>,
    /// `[2 * kernel * groups, hidden]`.
    projection: CpuLinear,
    kernel: usize,
    group: usize,
}

pub struct DraftLayer {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    q: CpuLinear,
    k: CpuLinear,
    v: CpuLinear,
    o: CpuLinear,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    gate: CpuLinear,
    up: CpuLinear,
    down: CpuLinear,
    attention_conv: Option<DynamicConv>,
    mlp_conv: Option<DynamicConv>,
}

/// DFlash2's candidate selector: a low-rank pairwise score between consecutive tokens, modulated by
/// the position's hidden state, added to each candidate's logit.
pub struct CandidateSelector {
    hidden_projection: CpuLinear,
    /// `[vocab, rank]` each.
    predecessor: Vec<f32>,
    successor: Vec<f32>,
    rank: usize,
    top_k: usize,
}

/// The target's embedding and output head, which the drafter shares.
pub struct SharedHead {
    pub embed: CpuLinear,
    /// `None` when tied to the embedding.
    pub lm_head: Option<CpuLinear>,
}

pub struct DFlashWeights {
    fc: CpuLinear,
    hidden_norm: Vec<f32>,
    layers: Vec<DraftLayer>,
    norm: Vec<f32>,
    selector: Option<CandidateSelector>,
}

/// Stored bytes a forward reads (for pricing proposals against the target).
fn linear_bytes(l: &CpuLinear) -> usize {
    l.weight.bytes()
}

impl DFlashWeights {
    pub fn load(c: &DFlashConfig, w: &dyn WeightSource) -> Result<Self, ModelError> {
        let h = c.hidden_size;
        let (qd, kvd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let lin = |name: &str, out: usize, inp: usize| CpuLinear::load(w, name, out, inp, false);
        let conv = |name: &str| -> Result<Option<DynamicConv>, ModelError> {
            let Some(v2) = &c.dflash2 else { return Ok(None) };
            let (kernel, group) = (v2.conv_kernel_size, v2.conv_group_size);
            let base = crate::model::tensor::to_f32(&w.expect(&format!("{name}.base_kernel"), &[2, kernel, h])?);
            let projection = lin(&format!("{name}.kernel_projection"), 2 * kernel * (h / group), h)?;
            Ok(Some(DynamicConv { base, projection, kernel, group }))
        };
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let p = format!("layers.{l}");
            let norm = |n: &str| w.tensor(&format!("{p}.self_attn.{n}.weight")).is_some();
            layers.push(DraftLayer {
                input_norm: load_vector(w, &format!("{p}.input_layernorm.weight"), h)?,
                post_norm: load_vector(w, &format!("{p}.post_attention_layernorm.weight"), h)?,
                q: lin(&format!("{p}.self_attn.q_proj"), qd, h)?,
                k: lin(&format!("{p}.self_attn.k_proj"), kvd, h)?,
                v: lin(&format!("{p}.self_attn.v_proj"), kvd, h)?,
                o: lin(&format!("{p}.self_attn.o_proj"), h, qd)?,
                q_norm: norm("q_norm")
                    .then(|| load_vector(w, &format!("{p}.self_attn.q_norm.weight"), c.head_dim))
                    .transpose()?,
                k_norm: norm("k_norm")
                    .then(|| load_vector(w, &format!("{p}.self_attn.k_norm.weight"), c.head_dim))
                    .transpose()?,
                gate: lin(&format!("{p}.mlp.gate_proj"), c.intermediate_size, h)?,
                up: lin(&format!("{p}.mlp.up_proj"), c.intermediate_size, h)?,
                down: lin(&format!("{p}.mlp.down_proj"), h, c.intermediate_size)?,
                attention_conv: conv(&format!("{p}.attention_conv"))?,
                mlp_conv: conv(&format!("{p}.mlp_conv"))?,
            });
        }
        let selector = match &c.dflash2 {
            None => None,
            Some(v2) => {
                let r = v2.selector_rank;
                // Published checkpoints store the codebooks without `.weight`; `save_pretrained` adds it.
                let codebook = |name: &str| -> Result<Vec<f32>, ModelError> {
                    let bare = format!("candidate_selector.{name}");
                    let full = format!("{bare}.weight");
                    let n = if w.tensor(&bare).is_some() { bare } else { full };
                    Ok(crate::model::tensor::to_f32(&w.expect(&n, &[c.vocab_size, r])?))
                };
                Some(CandidateSelector {
                    hidden_projection: lin("candidate_selector.hidden_projection", r, h)?,
                    predecessor: codebook("predecessor_codebook")?,
                    successor: codebook("successor_codebook")?,
                    rank: r,
                    top_k: v2.selector_top_k,
                })
            }
        };
        Ok(DFlashWeights {
            fc: lin("fc", h, c.target_layer_ids.len() * h)?,
            hidden_norm: load_vector(w, "hidden_norm.weight", h)?,
            layers,
            norm: load_vector(w, "norm.weight", h)?,
            selector,
        })
    }

    pub fn bytes(&self) -> usize {
        let layer = |l: &DraftLayer| {
            [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down].into_iter().map(linear_bytes).sum::<usize>()
                + l.attention_conv.iter().chain(&l.mlp_conv).map(|c| linear_bytes(&c.projection)).sum::<usize>()
        };
        linear_bytes(&self.fc) + self.layers.iter().map(layer).sum::<usize>()
    }
}

/// A sequence's cached context: per layer, keys (normed, rotated) and values of every context row.
#[derive(Debug, Default, Clone)]
pub struct ContextCache {
    /// Position of each cached row.
    pub positions: Vec<usize>,
    /// Per layer `[rows, kv_dim]`.
    pub keys: Vec<Vec<f32>>,
    pub values: Vec<Vec<f32>>,
}

impl ContextCache {
    /// Drop rows at positions `len..`.
    pub fn truncate(&mut self, len: usize, kv_dim: usize) {
        let keep = self.positions.iter().take_while(|&&p| p < len).count();
        self.positions.truncate(keep);
        self.keys.iter_mut().chain(self.values.iter_mut()).for_each(|v| v.truncate(keep * kv_dim));
    }

    /// The next position a context row may have (rows arrive in order).
    pub fn next_position(&self) -> usize {
        self.positions.last().map_or(0, |p| p + 1)
    }
}

/// RMSNorm of each row in place (f32 throughout, as the reference's f32 path).
fn rms_norm_rows(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    x.par_chunks_mut(d).for_each(|row| {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let r = 1.0 / (ms + eps).sqrt();
        row.iter_mut().zip(w).for_each(|(v, g)| *v = *v * r * g);
    });
}

fn linear(
    l: &CpuLinear,
    x: &[f32],
    m: usize,
    scratch: &mut LinearScratch,
    simd: bool,
) -> Result<Vec<f32>, BackendError> {
    let mut y = vec![0f32; m * l.rows];
    l.forward(x, m, &mut y, scratch, simd)?;
    Ok(y)
}

/// Rotate-half RoPE of one head at `pos`.
fn rope(x: &mut [f32], pos: usize, theta: f32) {
    let half = x.len() / 2;
    for i in 0..half {
        let inv = 1.0 / theta.powf((2 * i) as f32 / x.len() as f32);
        let (s, c) = (pos as f32 * inv).sin_cos();
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * c - b * s;
        x[i + half] = b * c + a * s;
    }
}

/// Per-head RMSNorm (optional) and RoPE of `rows` (each `heads * head_dim`) at `positions`.
fn norm_and_rotate(rows: &mut [f32], positions: &[usize], norm: Option<&[f32]>, c: &DFlashConfig) {
    let width = rows.len() / positions.len().max(1);
    rows.par_chunks_mut(width).zip(positions).for_each(|(row, &pos)| {
        for head in row.chunks_exact_mut(c.head_dim) {
            if let Some(w) = norm {
                rms_norm_rows(head, w, c.rms_norm_eps);
            }
            rope(head, pos, c.rope_theta);
        }
    });
}

impl DynamicConv {
    /// `out[t] = Σ_o (base[half][o] + dynamic[t][o][group]) · x[t - o]` over the block's rows.
    fn convolve(&self, x: &[f32], dynamic: &[f32], half: usize, rows: usize, h: usize) -> Vec<f32> {
        let (k, g) = (self.kernel, h / self.group);
        let mut out = vec![0f32; x.len()];
        let base = &self.base[half * k * h..(half + 1) * k * h];
        for t in 0..rows {
            let dy = &dynamic[t * 2 * k * g + half * k * g..t * 2 * k * g + (half + 1) * k * g];
            for o in 0..k.min(t + 1) {
                let src = &x[(t - o) * h..(t - o + 1) * h];
                let dst = &mut out[t * h..(t + 1) * h];
                for ch in 0..h {
                    dst[ch] += (base[o * h + ch] + dy[o * g + ch / self.group]) * src[ch];
                }
            }
        }
        out
    }
}

/// One sequence's draft rows out of a block pass: logits `[rows, vocab]` and the final hidden
/// rows `[rows, hidden]` (DFlash2's selector reads both).
pub struct DraftRows {
    pub logits: Vec<f32>,
    pub hidden: Vec<f32>,
}

/// One sequence's share of a block pass.
pub struct BlockSeq<'a> {
    pub cache: &'a ContextCache,
    pub anchor: u32,
    /// Position of the anchor.
    pub anchor_pos: usize,
    /// Draft rows wanted (1..block_size).
    pub rows: usize,
}

/// The drafter: its weights, config and the shared target head.
pub struct DFlashModel {
    pub cfg: DFlashConfig,
    pub weights: DFlashWeights,
    pub head: SharedHead,
    pub simd: bool,
}

impl DFlashModel {
    /// Project new context rows (target features `[rows, taps * hidden]` at `positions`) into every
    /// layer's keys and values, appended to `cache`.
    pub fn add_context(
        &self,
        caches: &mut [&mut ContextCache],
        features: &[Vec<f32>],
        positions: &[Vec<usize>],
        scratch: &mut LinearScratch,
    ) -> Result<(), BackendError> {
        let c = &self.cfg;
        let all: Vec<f32> = features.concat();
        let pos: Vec<usize> = positions.concat();
        let m = pos.len();
        if m == 0 {
            return Ok(());
        }
        let mut ctx = linear(&self.weights.fc, &all, m, scratch, self.simd)?;
        rms_norm_rows(&mut ctx, &self.weights.hidden_norm, c.rms_norm_eps);
        let kvd = c.num_kv_heads * c.head_dim;
        for cache in caches.iter_mut() {
            if cache.keys.len() != c.num_layers {
                cache.keys = vec![Vec::new(); c.num_layers];
                cache.values = vec![Vec::new(); c.num_layers];
            }
        }
        for (l, layer) in self.weights.layers.iter().enumerate() {
            let mut k = linear(&layer.k, &ctx, m, scratch, self.simd)?;
            let v = linear(&layer.v, &ctx, m, scratch, self.simd)?;
            norm_and_rotate(&mut k, &pos, layer.k_norm.as_deref(), c);
            let mut row = 0;
            for (cache, p) in caches.iter_mut().zip(positions) {
                cache.keys[l].extend_from_slice(&k[row * kvd..(row + p.len()) * kvd]);
                cache.values[l].extend_from_slice(&v[row * kvd..(row + p.len()) * kvd]);
                row += p.len();
            }
        }
        for (cache, p) in caches.iter_mut().zip(positions) {
            cache.positions.extend_from_slice(p);
        }
        Ok(())
    }

    /// Run the block pass for `seqs` and return, per sequence, the logits of its first `rows` draft
    /// positions (`[rows, vocab]`) and the draft hidden rows (`[rows, hidden]`).
    pub fn block_logits(
        &self,
        seqs: &[BlockSeq<'_>],
        scratch: &mut LinearScratch,
    ) -> Result<Vec<DraftRows>, BackendError> {
        let c = &self.cfg;
        let (h, bs, hd) = (c.hidden_size, c.block_size, c.head_dim);
        let (qd, kvd) = (c.num_heads * hd, c.num_kv_heads * hd);
        let m = seqs.len() * bs;
        let mut x = vec![0f32; m * h];
        let mut positions = Vec::with_capacity(m);
        for (s, rows) in seqs.iter().zip(x.chunks_mut(bs * h)) {
            for (i, row) in rows.chunks_mut(h).enumerate() {
                let token = if i == 0 { s.anchor } else { c.mask_token_id };
                self.head.embed.row_f32(token as usize, row);
                if c.input_embedding_scale != 1.0 {
                    row.iter_mut().for_each(|v| *v *= c.input_embedding_scale);
                }
                positions.push(s.anchor_pos + i);
            }
        }
        let group = c.num_heads / c.num_kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        for (l, layer) in self.weights.layers.iter().enumerate() {
            let mut xn = x.clone();
            rms_norm_rows(&mut xn, &layer.input_norm, c.rms_norm_eps);
            let (xn, finish) = self.conv_prepare(layer.attention_conv.as_ref(), xn, seqs.len(), scratch)?;
            let mut q = linear(&layer.q, &xn, m, scratch, self.simd)?;
            let mut k = linear(&layer.k, &xn, m, scratch, self.simd)?;
            let v = linear(&layer.v, &xn, m, scratch, self.simd)?;
            norm_and_rotate(&mut q, &positions, layer.q_norm.as_deref(), c);
            norm_and_rotate(&mut k, &positions, layer.k_norm.as_deref(), c);
            let (window, causal) = (c.sliding_window[l], c.causal[l]);
            let mut attn = vec![0f32; m * qd];
            attn.par_chunks_mut(bs * qd).enumerate().for_each(|(si, out)| {
                let s = &seqs[si];
                let (ck, cv) = match (s.cache.keys.get(l), s.cache.values.get(l)) {
                    (Some(k), Some(v)) => (k.as_slice(), v.as_slice()),
                    _ => (&[][..], &[][..]),
                };
                let (bk, bv) = (&k[si * bs * kvd..(si + 1) * bs * kvd], &v[si * bs * kvd..(si + 1) * bs * kvd]);
                let n_ctx = ck.len() / kvd;
                let key_pos = |j: usize| if j < n_ctx { s.cache.positions[j] } else { s.anchor_pos + j - n_ctx };
                let visible = |qp: usize, kp: usize| {
                    (!causal || kp <= qp)
                        && window.is_none_or(|w| qp.saturating_sub(kp) < w && (causal || kp.saturating_sub(qp) < w))
                };
                let mut scores = vec![0f32; n_ctx + bs];
                for (i, orow) in out.chunks_mut(qd).enumerate() {
                    let qp = s.anchor_pos + i;
                    let qrow = &q[(si * bs + i) * qd..(si * bs + i + 1) * qd];
                    for (hh, o) in orow.chunks_mut(hd).enumerate() {
                        let kh = hh / group;
                        let qh = &qrow[hh * hd..(hh + 1) * hd];
                        let key = |j: usize| {
                            if j < n_ctx {
                                &ck[j * kvd + kh * hd..j * kvd + (kh + 1) * hd]
                            } else {
                                &bk[(j - n_ctx) * kvd + kh * hd..(j - n_ctx) * kvd + (kh + 1) * hd]
                            }
                        };
                        let value = |j: usize| {
                            if j < n_ctx {
                                &cv[j * kvd + kh * hd..j * kvd + (kh + 1) * hd]
                            } else {
                                &bv[(j - n_ctx) * kvd + kh * hd..(j - n_ctx) * kvd + (kh + 1) * hd]
                            }
                        };
                        let mut max = f32::NEG_INFINITY;
                        for (j, sc) in scores.iter_mut().enumerate() {
                            *sc = if visible(qp, key_pos(j)) {
                                key(j).iter().zip(qh).map(|(a, b)| a * b).sum::<f32>() * scale
                            } else {
                                f32::NEG_INFINITY
                            };
                            max = max.max(*sc);
                        }
                        let mut sum = 0f32;
                        for sc in scores.iter_mut() {
                            *sc = if *sc == f32::NEG_INFINITY { 0.0 } else { (*sc - max).exp() };
                            sum += *sc;
                        }
                        o.fill(0.0);
                        for (j, &p) in scores.iter().enumerate() {
                            if p > 0.0 {
                                let w = p / sum;
                                o.iter_mut().zip(value(j)).for_each(|(a, b)| *a += w * b);
                            }
                        }
                    }
                }
            });
            let out = linear(&layer.o, &attn, m, scratch, self.simd)?;
            let out = self.conv_finish(layer.attention_conv.as_ref(), out, finish, seqs.len());
            x.iter_mut().zip(&out).for_each(|(a, b)| *a += b);

            let mut xn = x.clone();
            rms_norm_rows(&mut xn, &layer.post_norm, c.rms_norm_eps);
            let (xn, finish) = self.conv_prepare(layer.mlp_conv.as_ref(), xn, seqs.len(), scratch)?;
            let gate = linear(&layer.gate, &xn, m, scratch, self.simd)?;
            let up = linear(&layer.up, &xn, m, scratch, self.simd)?;
            let act: Vec<f32> = gate.iter().zip(&up).map(|(&g, &u)| g / (1.0 + (-g).exp()) * u).collect();
            let out = linear(&layer.down, &act, m, scratch, self.simd)?;
            let out = self.conv_finish(layer.mlp_conv.as_ref(), out, finish, seqs.len());
            x.iter_mut().zip(&out).for_each(|(a, b)| *a += b);
        }
        rms_norm_rows(&mut x, &self.weights.norm, c.rms_norm_eps);
        // Only the wanted draft rows (after the anchor) go through the vocabulary.
        let mut rows = Vec::new();
        for (si, s) in seqs.iter().enumerate() {
            for i in 1..=s.rows.min(bs - 1) {
                rows.extend_from_slice(&x[(si * bs + i) * h..(si * bs + i + 1) * h]);
            }
        }
        let n = rows.len() / h;
        let head = self.head.lm_head.as_ref().unwrap_or(&self.head.embed);
        let mut logits = linear(head, &rows, n, scratch, self.simd)?;
        let softcap = c.final_logit_softcapping;
        logits.par_iter_mut().for_each(|v| {
            *v *= c.output_multiplier;
            if let Some(cap) = softcap {
                *v = (*v / cap).tanh() * cap;
            }
        });
        let vocab = head.rows;
        let mut out = Vec::with_capacity(seqs.len());
        let mut at = 0;
        for s in seqs {
            let r = s.rows.min(bs - 1);
            out.push(DraftRows {
                logits: logits[at * vocab..(at + r) * vocab].to_vec(),
                hidden: rows[at * h..(at + r) * h].to_vec(),
            });
            at += r;
        }
        Ok(out)
    }

    /// DFlash2's `prepare`: convolve the sublayer input with the first half of its dynamic kernel;
    /// returns the input and the projection the `finish` half needs.
    fn conv_prepare(
        &self,
        conv: Option<&DynamicConv>,
        xn: Vec<f32>,
        n_seqs: usize,
        scratch: &mut LinearScratch,
    ) -> Result<(Vec<f32>, Vec<f32>), BackendError> {
        let Some(conv) = conv else { return Ok((xn, Vec::new())) };
        let (h, bs) = (self.cfg.hidden_size, self.cfg.block_size);
        let dynamic = linear(&conv.projection, &xn, n_seqs * bs, scratch, self.simd)?;
        let per = dynamic.len() / (n_seqs * bs).max(1) * bs;
        let mut out = Vec::with_capacity(xn.len());
        for (x, d) in xn.chunks(bs * h).zip(dynamic.chunks(per)) {
            out.extend(conv.convolve(x, d, 0, bs, h));
        }
        Ok((out, dynamic))
    }

    fn conv_finish(&self, conv: Option<&DynamicConv>, y: Vec<f32>, dynamic: Vec<f32>, n_seqs: usize) -> Vec<f32> {
        let Some(conv) = conv else { return y };
        let (h, bs) = (self.cfg.hidden_size, self.cfg.block_size);
        let per = dynamic.len() / (n_seqs * bs).max(1) * bs;
        let mut out = Vec::with_capacity(y.len());
        for (x, d) in y.chunks(bs * h).zip(dynamic.chunks(per)) {
            out.extend(conv.convolve(x, d, 1, bs, h));
        }
        out
    }

    /// Greedy drafts from one sequence's draft logits: each row's argmax (DFlash), or DFlash2's
    /// best path through every row's top candidates, starting from the anchor.
    pub fn choose(
        &self,
        anchor: u32,
        logits: &[f32],
        hidden: &[f32],
        scratch: &mut LinearScratch,
    ) -> Result<Vec<u32>, BackendError> {
        let vocab = self.head.lm_head.as_ref().unwrap_or(&self.head.embed).rows;
        let Some(sel) = &self.weights.selector else {
            return Ok(logits.chunks_exact(vocab).map(argmax).collect());
        };
        let n = logits.len() / vocab;
        let proj = linear(&sel.hidden_projection, hidden, n, scratch, self.simd)?;
        let r = sel.rank;
        let mut path = Vec::with_capacity(n);
        let mut prev = anchor as usize;
        for (p, row) in logits.chunks_exact(vocab).enumerate() {
            let candidates = top_k(row, sel.top_k);
            let modulated: Vec<f32> = (0..r).map(|i| sel.predecessor[prev * r + i] * proj[p * r + i]).collect();
            let mut best = (f32::NEG_INFINITY, candidates[0]);
            for &cand in &candidates {
                let succ = &sel.successor[cand as usize * r..(cand as usize + 1) * r];
                let score = row[cand as usize] + modulated.iter().zip(succ).map(|(a, b)| a * b).sum::<f32>();
                if score > best.0 {
                    best = (score, cand);
                }
            }
            path.push(best.1);
            prev = best.1 as usize;
        }
        Ok(path)
    }
}

/// Lowest index of the largest value.
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Indices of the `k` largest values, largest first (ties: lower index first).
fn top_k(row: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..row.len() as u32).collect();
    let k = k.min(idx.len());
    let by = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
    if k < idx.len() {
        idx.select_nth_unstable_by(k, by);
        idx.truncate(k);
    }
    idx.sort_by(by);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_orders_by_value_then_index() {
        assert_eq!(top_k(&[0.5, 2.0, 2.0, -1.0, 3.0], 3), vec![4, 1, 2]);
        assert_eq!(top_k(&[1.0], 4), vec![0]);
    }

    #[test]
    fn context_cache_truncates_rows_past_a_length() {
        let mut c = ContextCache {
            positions: vec![0, 1, 2, 5],
            keys: vec![vec![0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 5.0, 5.0]],
            values: vec![vec![0.0; 8]],
        };
        c.truncate(2, 2);
        assert_eq!(
            (c.positions.clone(), c.keys[0].clone(), c.values[0].len()),
            (vec![0, 1], vec![0.0, 0.0, 1.0, 1.0], 4)
        );
        assert_eq!(c.next_position(), 2);
    }
}
