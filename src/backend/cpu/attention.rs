//! Paged KV memory and causal attention on the CPU. The store is a fixed set of blocks of
//! `block_size` positions per layer; sequences address it through block tables chosen by the KV
//! pool. Each (query position, head) is computed by one task with a fixed reduction order, which
//! makes prefill and decode of the same position bitwise identical.

use rayon::prelude::*;

use crate::backend::KvGeometry;
use crate::model::quant::dot_f32;

/// Precision of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvPrecision {
    /// Exact f32 (golden tests against f32 references).
    F32,
    /// K and V rounded to f16, and — as GGML's non-flash CPU attention does — the query rounded
    /// to f16 for q·k and the softmax weights rounded to f16 for the V sum. This is llama.cpp's
    /// default cache type; it keeps quantized GGUF models numerically next to llama.cpp.
    F16,
}

#[inline]
fn round_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// K and V for every layer: `[layer][block][slot][kv_dim]`, held as f32 (values rounded to f16
/// under `KvPrecision::F16`).
pub struct PagedKv {
    pub geom: KvGeometry,
    pub kv_dim: usize,
    pub precision: KvPrecision,
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
}

impl PagedKv {
    pub fn new(geom: KvGeometry, layers: usize, kv_dim: usize, precision: KvPrecision) -> Self {
        let n = geom.num_blocks * geom.block_size * kv_dim;
        PagedKv { geom, kv_dim, precision, k: vec![vec![0f32; n]; layers], v: vec![vec![0f32; n]; layers] }
    }

    /// Store one position's K and V rows.
    pub fn write(&mut self, layer: usize, table: &[u32], pos: usize, k: &[f32], v: &[f32]) {
        let off = self.offset(table, pos);
        let (kd, vd) = (&mut self.k[layer][off..off + self.kv_dim], &mut self.v[layer][off..off + self.kv_dim]);
        match self.precision {
            KvPrecision::F32 => {
                kd.copy_from_slice(k);
                vd.copy_from_slice(v);
            }
            KvPrecision::F16 => {
                kd.iter_mut().zip(k).for_each(|(d, &x)| *d = round_f16(x));
                vd.iter_mut().zip(v).for_each(|(d, &x)| *d = round_f16(x));
            }
        }
    }

    /// Offset of `pos` for a sequence with `table`.
    #[inline]
    pub fn offset(&self, table: &[u32], pos: usize) -> usize {
        let bs = self.geom.block_size;
        (table[pos / bs] as usize * bs + pos % bs) * self.kv_dim
    }

    pub fn bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|l| l.len() * 4).sum()
    }
}

/// Per-token facts attention needs.
#[derive(Clone, Copy)]
pub struct TokenRef<'a> {
    pub pos: usize,
    pub table: &'a [u32],
}

pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub sliding_window: Option<usize>,
}

/// `out[t, h·d]` = softmax(q·Kᵀ/√d) · V over positions `0..=pos` (or the sliding window) of
/// token `t`'s sequence, reading K/V of `layer` from the paged store.
pub fn paged_attention(
    kv: &PagedKv,
    layer: usize,
    shape: &AttnShape,
    tokens: &[TokenRef<'_>],
    q: &[f32],
    out: &mut [f32],
    simd: bool,
) {
    let (nh, hd) = (shape.n_heads, shape.head_dim);
    let group = nh / shape.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let (kc, vc) = (&kv.k[layer], &kv.v[layer]);
    let f16 = kv.precision == KvPrecision::F16;
    out.par_chunks_mut(hd).enumerate().for_each(|(task, o)| {
        let (t, h) = (task / nh, task % nh);
        let tok = tokens[t];
        let mut qh = q[t * nh * hd + h * hd..t * nh * hd + (h + 1) * hd].to_vec();
        if f16 {
            qh.iter_mut().for_each(|x| *x = round_f16(*x));
        }
        let koff = (h / group) * hd;
        let lo = shape.sliding_window.map_or(0, |w| (tok.pos + 1).saturating_sub(w));
        let mut scores = Vec::with_capacity(tok.pos + 1 - lo);
        let mut max = f32::NEG_INFINITY;
        for p in lo..=tok.pos {
            let base = kv.offset(tok.table, p) + koff;
            let s = dot_f32(&qh, &kc[base..base + hd], simd) * scale;
            max = max.max(s);
            scores.push(s);
        }
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let inv = 1.0 / sum;
        o.fill(0.0);
        for (i, p) in (lo..=tok.pos).enumerate() {
            let base = kv.offset(tok.table, p) + koff;
            let w = if f16 { round_f16(scores[i] * inv) } else { scores[i] * inv };
            for (acc, &vv) in o.iter_mut().zip(&vc[base..base + hd]) {
                *acc = w.mul_add(vv, *acc);
            }
        }
    });
}
