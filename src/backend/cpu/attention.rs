//! Paged KV memory and causal attention on the CPU. The store is a fixed set of blocks of
//! `block_size` positions per layer; sequences address it through block tables chosen by the KV
//! pool. Each (query position, head) is computed by one task with a fixed reduction order, which
//! makes prefill and decode of the same position bitwise identical.
//!
//! Under [`KvPrecision::F16`] the arithmetic is GGML's non-flash CPU attention as llama.cpp runs
//! it for a batch of two or more query rows on an AVX2 machine, rounding for rounding: f16 K/V/q,
//! q·k and weights·V as llamafile tinyBLAS dot products (one 8-lane accumulator: lane = head
//! dimension mod 8 for q·k, key position mod 8 for weights·V), and `soft_max_ext` with GGML's
//! vectorised exp, per-8-position partial sums added in double, and f16 weights. The q·k order
//! is the order of the head dimensions as stored, so GGUF models hand us q and k in GGML's
//! adjacent-pair layout (the backend's GGML-style RoPE writes them so). llama.cpp switches to a different kernel (`ggml_vec_dot_f16`)
//! when a step has a single query row; we cannot follow it there without making a sequence's
//! numbers depend on how it was batched, which the exactness rules forbid.
use rayon::prelude::*;

use crate::backend::KvGeometry;
use crate::model::quant::{dot_f32, dot_lanes8, expf_ggml, hsum8};

/// Precision of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvPrecision {
    /// Exact f32 (golden tests against f32 references).
    F32,
    /// K and V rounded to f16, and — as GGML's non-flash CPU attention does — the query rounded
    /// to f16 for q·k and the softmax weights rounded to f16 for the V sum. This is llama.cpp's
    /// default cache type; with a head size that is a multiple of 8 the whole attention follows
    /// GGML's rounding (module docs), which keeps quantized GGUF models on llama.cpp's numbers.
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

    /// Bytes of one block in a KV image: every layer's K rows then V rows, f32 little-endian.
    pub fn block_image_bytes(&self) -> usize {
        self.k.len() * 2 * self.geom.block_size * self.kv_dim * 4
    }

    /// The contents of `blocks`, block after block (layout in `block_image_bytes`).
    pub fn read_blocks(&self, blocks: &[u32]) -> Vec<u8> {
        let span = self.geom.block_size * self.kv_dim;
        let mut image = Vec::with_capacity(blocks.len() * self.block_image_bytes());
        for &b in blocks {
            let at = b as usize * span;
            for layer in self.k.iter().zip(&self.v) {
                for x in layer.0[at..at + span].iter().chain(&layer.1[at..at + span]) {
                    image.extend_from_slice(&x.to_le_bytes());
                }
            }
        }
        image
    }

    /// Fill `blocks` from an image made by `read_blocks`; the caller checked its length.
    pub fn write_blocks(&mut self, blocks: &[u32], image: &[u8]) {
        let span = self.geom.block_size * self.kv_dim;
        let mut words = image.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
        for &b in blocks {
            let at = b as usize * span;
            for (k, v) in self.k.iter_mut().zip(self.v.iter_mut()) {
                for x in k[at..at + span].iter_mut().chain(v[at..at + span].iter_mut()) {
                    *x = words.next().unwrap_or(0.0);
                }
            }
        }
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
    // tinyBLAS needs the reduction length to be a multiple of its 8 lanes.
    let ggml = f16 && hd % 8 == 0;
    out.par_chunks_mut(hd).enumerate().for_each(|(task, o)| {
        let (t, h) = (task / nh, task % nh);
        let tok = tokens[t];
        let mut qh = q[t * nh * hd + h * hd..t * nh * hd + (h + 1) * hd].to_vec();
        if f16 {
            qh.iter_mut().for_each(|x| *x = round_f16(*x));
        }
        let koff = (h / group) * hd;
        let lo = shape.sliding_window.map_or(0, |w| (tok.pos + 1).saturating_sub(w));
        let key = |p: usize| kv.offset(tok.table, p) + koff;
        if ggml {
            ggml_head(&qh, kc, vc, &key, lo, tok.pos, scale, simd, o);
            return;
        }
        let mut scores = Vec::with_capacity(tok.pos + 1 - lo);
        let mut max = f32::NEG_INFINITY;
        for p in lo..=tok.pos {
            let base = key(p);
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
            let base = key(p);
            let w = if f16 { round_f16(scores[i] * inv) } else { scores[i] * inv };
            for (acc, &vv) in o.iter_mut().zip(&vc[base..base + hd]) {
                *acc = w.mul_add(vv, *acc);
            }
        }
    });
}

/// One (query, head) of GGML's attention: `kq = mul_mat(K, q)` (tinyBLAS), `soft_max_ext(kq ·
/// scale)`, `kqv = mul_mat(Vᵀ, softmax)` (tinyBLAS). llama.cpp lays one sequence's keys out at
/// cache cells equal to their positions, so "cell" below is the position. `qh` is already
/// rounded to f16; `key(p)` is the offset of position `p`'s K/V head row.
#[allow(clippy::too_many_arguments)]
fn ggml_head(
    qh: &[f32],
    kc: &[f32],
    vc: &[f32],
    key: &dyn Fn(usize) -> usize,
    lo: usize,
    pos: usize,
    scale: f32,
    simd: bool,
    o: &mut [f32],
) {
    let hd = qh.len();
    let mut e = Vec::with_capacity(pos + 1 - lo);
    let mut max = f32::NEG_INFINITY;
    for p in lo..=pos {
        let base = key(p);
        let s = dot_lanes8(qh, &kc[base..base + hd], simd) * scale;
        max = max.max(s);
        e.push(s);
    }
    // `ggml_vec_soft_max_f32`: exp(x - max) (the subtraction in f32), summed per group of 8
    // cells with `hsum8` and the group sums added in double; masked cells are exact zeros.
    e.iter_mut().for_each(|v| *v -= max);
    expf_ggml(&mut e, simd);
    let mut sum = 0f64;
    let mut g = lo / 8 * 8;
    while g <= pos {
        let lanes: [f32; 8] = std::array::from_fn(|l| if g + l >= lo && g + l <= pos { e[g + l - lo] } else { 0.0 });
        sum += hsum8(&lanes) as f64;
        g += 8;
    }
    let inv = (1.0 / sum) as f32;
    // `kqv`: the f16 weights times V, one FMA accumulator per (lane = cell mod 8, dimension),
    // lanes combined with `hsum8`.
    let mut acc = vec![0f32; 8 * hd];
    for (i, p) in (lo..=pos).enumerate() {
        let w = round_f16(e[i] * inv);
        let base = key(p);
        axpy(&mut acc[(p % 8) * hd..(p % 8 + 1) * hd], w, &vc[base..base + hd], simd);
    }
    for (d, out) in o.iter_mut().enumerate() {
        let lanes: [f32; 8] = std::array::from_fn(|l| acc[l * hd + d]);
        *out = hsum8(&lanes);
    }
}

/// `acc[i] = fma(w, v[i], acc[i])`; `acc.len()` is a multiple of 8.
#[inline]
fn axpy(acc: &mut [f32], w: f32, v: &[f32], simd: bool) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only true when AVX2 and FMA were detected at runtime.
        unsafe { avx2::axpy(acc, w, v) };
        return;
    }
    let _ = simd;
    for (a, &x) in acc.iter_mut().zip(v) {
        *a = w.mul_add(x, *a);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy(acc: &mut [f32], w: f32, v: &[f32]) {
        debug_assert!(acc.len() == v.len() && acc.len() % 8 == 0);
        let wv = _mm256_set1_ps(w);
        let mut i = 0;
        while i + 8 <= acc.len() {
            let a = _mm256_loadu_ps(acc.as_ptr().add(i));
            _mm256_storeu_ps(acc.as_mut_ptr().add(i), _mm256_fmadd_ps(wv, _mm256_loadu_ps(v.as_ptr().add(i)), a));
            i += 8;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::quant::simd_available;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }

    /// Both precisions against exact softmax attention in f64 over the values actually stored,
    /// through a scrambled block table, for every query position; GGML's path on the SIMD and
    /// portable kernels is bit-identical.
    #[test]
    fn attention_matches_exact_softmax_and_paths_agree() {
        let (hd, nh, len) = (16, 2, 11);
        let table = [2u32, 0, 3];
        let shape = AttnShape { n_heads: nh, n_kv_heads: 1, head_dim: hd, sliding_window: None };
        let mut seed = 9;
        let keys: Vec<Vec<f32>> = (0..len).map(|_| (0..hd).map(|_| 3.0 * lcg(&mut seed)).collect()).collect();
        let vals: Vec<Vec<f32>> = (0..len).map(|_| (0..hd).map(|_| lcg(&mut seed)).collect()).collect();
        let q: Vec<f32> = (0..len * nh * hd).map(|_| lcg(&mut seed)).collect();
        for (precision, tol) in [(KvPrecision::F32, 1e-5), (KvPrecision::F16, 2e-3)] {
            let mut kv = PagedKv::new(KvGeometry { block_size: 4, num_blocks: 4, state_slots: 0 }, 1, hd, precision);
            for p in 0..len {
                kv.write(0, &table, p, &keys[p], &vals[p]);
            }
            let tokens: Vec<TokenRef<'_>> = (0..len).map(|pos| TokenRef { pos, table: &table }).collect();
            let mut out = vec![0f32; len * nh * hd];
            paged_attention(&kv, 0, &shape, &tokens, &q, &mut out, false);
            let stored = |c: &[f32]| -> Vec<f64> {
                c.iter().map(|&x| if precision == KvPrecision::F16 { round_f16(x) as f64 } else { x as f64 }).collect()
            };
            for t in 0..len {
                for h in 0..nh {
                    let qh = stored(&q[(t * nh + h) * hd..(t * nh + h + 1) * hd]);
                    let s: Vec<f64> = (0..=t)
                        .map(|p| stored(&keys[p]).iter().zip(&qh).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt())
                        .collect();
                    let m = s.iter().cloned().fold(f64::MIN, f64::max);
                    let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                    for d in 0..hd {
                        let want: f64 = (0..=t).map(|p| (s[p] - m).exp() / z * stored(&vals[p])[d]).sum();
                        let got = out[(t * nh + h) * hd + d] as f64;
                        assert!((got - want).abs() < tol, "{precision:?} t{t} h{h} d{d}: {got} vs {want}");
                    }
                }
            }
            if simd_available() {
                let mut fast = vec![0f32; len * nh * hd];
                paged_attention(&kv, 0, &shape, &tokens, &q, &mut fast, true);
                if precision == KvPrecision::F16 {
                    assert!(fast.iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits()));
                }
            }
        }
    }
}
