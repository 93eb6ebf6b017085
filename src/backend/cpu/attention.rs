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
use half::f16;
use rayon::prelude::*;

use crate::backend::KvGeometry;
use crate::model::quant::{dot_f32, expf_ggml, hsum8};

/// Precision of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvPrecision {
    /// Exact f32 (golden tests against f32 references).
    F32,
    /// K and V stored as f16 (2 bytes per value), and — as GGML's non-flash CPU attention does —
    /// the query rounded to f16 for q·k and the softmax weights rounded to f16 for the V sum.
    /// This is llama.cpp's default cache type; with a head size that is a multiple of 8 the
    /// whole attention follows GGML's rounding (module docs), which keeps quantized GGUF models
    /// on llama.cpp's numbers.
    F16,
}

#[inline]
fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// One layer's K or V values in the cache's precision.
pub enum KvValues {
    F32(Vec<f32>),
    F16(Vec<f16>),
}

impl KvValues {
    fn new(precision: KvPrecision, n: usize) -> Self {
        match precision {
            KvPrecision::F32 => KvValues::F32(vec![0.0; n]),
            KvPrecision::F16 => KvValues::F16(vec![f16::ZERO; n]),
        }
    }

    fn store(&mut self, off: usize, x: &[f32]) {
        match self {
            KvValues::F32(v) => v[off..off + x.len()].copy_from_slice(x),
            KvValues::F16(v) => v[off..off + x.len()].iter_mut().zip(x).for_each(|(d, &s)| *d = f16::from_f32(s)),
        }
    }

    /// The `out.len()` values at `off` as f32 (exact: f16 widens without rounding).
    fn load(&self, off: usize, out: &mut [f32]) {
        let n = out.len();
        match self {
            KvValues::F32(v) => out.copy_from_slice(&v[off..off + n]),
            KvValues::F16(v) => out.iter_mut().zip(&v[off..off + n]).for_each(|(d, s)| *d = s.to_f32()),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            KvValues::F32(v) => v.len() * 4,
            KvValues::F16(v) => v.len() * 2,
        }
    }
}

/// K and V for every layer, each layer one contiguous array laid out block-major:
/// `[block][slot][kv_dim]`, values as f32 or f16 by [`KvPrecision`]. A block of one layer is
/// the contiguous range `block · block_size · kv_dim ..` of that layer's array.
pub struct PagedKv {
    pub geom: KvGeometry,
    pub kv_dim: usize,
    pub precision: KvPrecision,
    pub k: Vec<KvValues>,
    pub v: Vec<KvValues>,
}

impl PagedKv {
    pub fn new(geom: KvGeometry, layers: usize, kv_dim: usize, precision: KvPrecision) -> Self {
        let n = geom.num_blocks * geom.block_size * kv_dim;
        let mk = || (0..layers).map(|_| KvValues::new(precision, n)).collect();
        PagedKv { geom, kv_dim, precision, k: mk(), v: mk() }
    }

    /// Store one position's K and V rows (rounded to f16 under `KvPrecision::F16`).
    pub fn write(&mut self, layer: usize, table: &[u32], pos: usize, k: &[f32], v: &[f32]) {
        let off = self.offset(table, pos);
        self.k[layer].store(off, k);
        self.v[layer].store(off, v);
    }

    /// Offset of `pos` for a sequence with `table`.
    #[inline]
    pub fn offset(&self, table: &[u32], pos: usize) -> usize {
        let bs = self.geom.block_size;
        (table[pos / bs] as usize * bs + pos % bs) * self.kv_dim
    }

    /// Append to `out` the offsets of positions `lo..=hi` (plus `add`) for a sequence with
    /// `table`, walking block by block: one table lookup per block instead of a division per
    /// position (this runs for every query position and head).
    pub fn offsets(&self, table: &[u32], lo: usize, hi: usize, add: usize, out: &mut Vec<usize>) {
        let bs = self.geom.block_size;
        let mut p = lo;
        while p <= hi {
            let (blk, slot) = (table[p / bs] as usize, p % bs);
            let n = (bs - slot).min(hi + 1 - p);
            let base = (blk * bs + slot) * self.kv_dim + add;
            out.extend((0..n).map(|i| base + i * self.kv_dim));
            p += n;
        }
    }

    pub fn bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(KvValues::bytes).sum()
    }

    /// Bytes of one block in a KV image: every layer's K rows then V rows, little-endian, 4 bytes
    /// per value for f32 and 2 for f16 (the stored bits, so a round trip is exact).
    pub fn block_image_bytes(&self) -> usize {
        let width = match self.precision {
            KvPrecision::F32 => 4,
            KvPrecision::F16 => 2,
        };
        self.k.len() * 2 * self.geom.block_size * self.kv_dim * width
    }

    /// The contents of `blocks`, block after block (layout in `block_image_bytes`).
    pub fn read_blocks(&self, blocks: &[u32]) -> Vec<u8> {
        let span = self.geom.block_size * self.kv_dim;
        let mut image = Vec::with_capacity(blocks.len() * self.block_image_bytes());
        for &b in blocks {
            let at = b as usize * span;
            for values in self.k.iter().zip(&self.v).flat_map(|(k, v)| [k, v]) {
                match values {
                    KvValues::F32(x) => x[at..at + span].iter().for_each(|x| image.extend_from_slice(&x.to_le_bytes())),
                    KvValues::F16(x) => x[at..at + span].iter().for_each(|x| image.extend_from_slice(&x.to_le_bytes())),
                }
            }
        }
        image
    }

    /// Fill `blocks` from an image made by `read_blocks`; the caller checked its length.
    pub fn write_blocks(&mut self, blocks: &[u32], image: &[u8]) {
        let span = self.geom.block_size * self.kv_dim;
        let mut bytes = image;
        for &b in blocks {
            let at = b as usize * span;
            for values in self.k.iter_mut().zip(self.v.iter_mut()).flat_map(|(k, v)| [k, v]) {
                match values {
                    KvValues::F32(x) => {
                        let (head, rest) = bytes.split_at(span * 4);
                        for (d, c) in x[at..at + span].iter_mut().zip(head.chunks_exact(4)) {
                            *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                        }
                        bytes = rest;
                    }
                    KvValues::F16(x) => {
                        let (head, rest) = bytes.split_at(span * 2);
                        for (d, c) in x[at..at + span].iter_mut().zip(head.chunks_exact(2)) {
                            *d = f16::from_le_bytes([c[0], c[1]]);
                        }
                        bytes = rest;
                    }
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

/// Per-task buffers, reused across the (query, head) pairs one rayon job runs.
#[derive(Default)]
struct HeadScratch {
    q: Vec<f32>,
    offs: Vec<usize>,
    e: Vec<f32>,
    row: Vec<f32>,
    acc: Vec<f32>,
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
    out.par_chunks_mut(hd).enumerate().for_each_init(HeadScratch::default, |sc, (task, o)| {
        let (t, h) = (task / nh, task % nh);
        let tok = tokens[t];
        sc.q.clear();
        sc.q.extend_from_slice(&q[t * nh * hd + h * hd..t * nh * hd + (h + 1) * hd]);
        if f16 {
            sc.q.iter_mut().for_each(|x| *x = round_f16(*x));
        }
        let koff = (h / group) * hd;
        let lo = shape.sliding_window.map_or(0, |w| (tok.pos + 1).saturating_sub(w));
        sc.offs.clear();
        kv.offsets(tok.table, lo, tok.pos, koff, &mut sc.offs);
        if ggml {
            ggml_head(sc, kc, vc, lo, scale, simd, o);
            return;
        }
        let HeadScratch { q: qh, offs, e: scores, row, .. } = sc;
        row.resize(hd, 0.0);
        scores.clear();
        let mut max = f32::NEG_INFINITY;
        for &base in offs.iter() {
            kc.load(base, row);
            let s = dot_f32(qh, row, simd) * scale;
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
        for (&base, &s) in offs.iter().zip(scores.iter()) {
            let w = if f16 { round_f16(s * inv) } else { s * inv };
            vc.load(base, row);
            for (acc, &vv) in o.iter_mut().zip(row.iter()) {
                *acc = w.mul_add(vv, *acc);
            }
        }
    });
}

/// One (query, head) of GGML's attention: `kq = mul_mat(K, q)` (tinyBLAS), `soft_max_ext(kq ·
/// scale)`, `kqv = mul_mat(Vᵀ, softmax)` (tinyBLAS). llama.cpp lays one sequence's keys out at
/// cache cells equal to their positions, so "cell" below is the position. `sc.q` is already
/// rounded to f16; `sc.offs[i]` is the offset of position `lo + i`'s K/V head row.
fn ggml_head(sc: &mut HeadScratch, kc: &KvValues, vc: &KvValues, lo: usize, scale: f32, simd: bool, o: &mut [f32]) {
    let hd = sc.q.len();
    let n = sc.offs.len();
    sc.e.resize(n, 0.0);
    #[cfg(target_arch = "x86_64")]
    if let (true, KvValues::F16(k), KvValues::F16(v)) = (simd, kc, vc) {
        // SAFETY: `simd` is only true when AVX2, FMA and F16C were detected at runtime; every
        // offset addresses a whole head row inside the layer's arrays (`PagedKv::offset` of a
        // validated block table).
        unsafe { avx2::scores(&sc.q, k, &sc.offs, scale, &mut sc.e) };
        let inv = softmax_weights(&mut sc.e, lo, simd);
        // SAFETY: as above.
        unsafe { avx2::weighted_values(&mut sc.e, inv, v, &sc.offs, lo, o) };
        return;
    }
    // Portable path, the same arithmetic: one 8-lane accumulator per q·k (lane = dimension mod
    // 8), then one per (lane = cell mod 8, dimension) for the V sum, lanes combined by `hsum8`.
    sc.row.resize(hd, 0.0);
    for (s, &base) in sc.e.iter_mut().zip(&sc.offs) {
        kc.load(base, &mut sc.row);
        let mut lanes = [0f32; 8];
        for (i, (&a, &b)) in sc.q.iter().zip(&sc.row).enumerate() {
            lanes[i % 8] = a.mul_add(b, lanes[i % 8]);
        }
        *s = hsum8(&lanes) * scale;
    }
    let inv = softmax_weights(&mut sc.e, lo, simd);
    sc.acc.clear();
    sc.acc.resize(8 * hd, 0.0);
    for (i, &base) in sc.offs.iter().enumerate() {
        let p = lo + i;
        let w = round_f16(sc.e[i] * inv);
        vc.load(base, &mut sc.row);
        for (a, &x) in sc.acc[(p % 8) * hd..(p % 8 + 1) * hd].iter_mut().zip(&sc.row) {
            *a = w.mul_add(x, *a);
        }
    }
    for (d, out) in o.iter_mut().enumerate() {
        let lanes: [f32; 8] = std::array::from_fn(|l| sc.acc[l * hd + d]);
        *out = hsum8(&lanes);
    }
}

/// `ggml_vec_soft_max_f32` on scores `e` of cells `lo..`: `e[i] = exp(e[i] − max)` (the
/// subtraction in f32), summed per group of 8 cells with `hsum8` and the group sums added in
/// double; masked cells are exact zeros. Returns `1 / sum` (as f32).
fn softmax_weights(e: &mut [f32], lo: usize, simd: bool) -> f32 {
    let max = e.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    e.iter_mut().for_each(|v| *v -= max);
    expf_ggml(e, simd);
    let pos = lo + e.len() - 1;
    let mut sum = 0f64;
    let mut g = lo / 8 * 8;
    while g <= pos {
        let lanes: [f32; 8] = std::array::from_fn(|l| if g + l >= lo && g + l <= pos { e[g + l - lo] } else { 0.0 });
        sum += hsum8(&lanes) as f64;
        g += 8;
    }
    (1.0 / sum) as f32
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use half::f16;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_f16x8(p: *const f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }

    /// `e[i] = hsum(Σ q·k_i lane by lane) · scale` for the K head rows at `offs` (f16, widened
    /// exactly), the lane order of `dot_lanes8`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn scores(q: &[f32], k: &[f16], offs: &[usize], scale: f32, e: &mut [f32]) {
        let hd = q.len();
        for (s, &base) in e.iter_mut().zip(offs) {
            debug_assert!(base + hd <= k.len());
            let kp = k.as_ptr().add(base);
            let mut acc = _mm256_setzero_ps();
            let mut i = 0;
            while i + 8 <= hd {
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(i)), load_f16x8(kp.add(i)), acc);
                i += 8;
            }
            let lo = _mm256_castps256_ps128(acc);
            let hi = _mm256_extractf128_ps(acc, 1);
            let s4 = _mm_add_ps(lo, hi);
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            *s = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2))) * scale;
        }
    }

    /// `o[d] = hsum8(acc[0][d] … acc[7][d])` where `acc[p mod 8][d]` accumulates
    /// `fma(round_f16(e_p · inv), v_p[d], ·)` over cells `p` in order — GGML's tinyBLAS V sum.
    /// Eight dimensions at a time, the eight lane accumulators in registers. `e` is overwritten
    /// with the rounded weights.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn weighted_values(e: &mut [f32], inv: f32, v: &[f16], offs: &[usize], lo: usize, o: &mut [f32]) {
        let hd = o.len();
        let n = offs.len();
        for x in e.iter_mut() {
            *x = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(*x * inv))));
        }
        let w = &*e;
        let mut d = 0;
        while d + 8 <= hd {
            let mut acc = [_mm256_setzero_ps(); 8];
            let mut i = 0;
            // Leading cells up to the next multiple of 8, then whole groups (lane = cell mod 8
            // is then the unrolled index), then the tail.
            while i < n && !(lo + i).is_multiple_of(8) {
                let l = (lo + i) % 8;
                acc[l] = _mm256_fmadd_ps(_mm256_set1_ps(w[i]), load_f16x8(v.as_ptr().add(offs[i] + d)), acc[l]);
                i += 1;
            }
            while i + 8 <= n {
                for (l, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(_mm256_set1_ps(w[i + l]), load_f16x8(v.as_ptr().add(offs[i + l] + d)), *a);
                }
                i += 8;
            }
            while i < n {
                let l = (lo + i) % 8;
                acc[l] = _mm256_fmadd_ps(_mm256_set1_ps(w[i]), load_f16x8(v.as_ptr().add(offs[i] + d)), acc[l]);
                i += 1;
            }
            // hsum8 of each dimension: ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7)).
            let s = _mm256_add_ps(
                _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6])),
                _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7])),
            );
            _mm256_storeu_ps(o.as_mut_ptr().add(d), s);
            d += 8;
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

    /// GGML's path with a sliding window (first cell not a multiple of 8, so the V sum starts
    /// mid-group) and several blocks: the SIMD kernels equal the portable code bit for bit.
    #[test]
    fn f16_simd_attention_matches_portable_with_window() {
        if !simd_available() {
            return;
        }
        let (hd, nh, len) = (16, 4, 29);
        let table = [3u32, 1, 4, 0, 2];
        let mut seed = 4;
        let mut kv =
            PagedKv::new(KvGeometry { block_size: 8, num_blocks: 5, state_slots: 0 }, 1, 2 * hd, KvPrecision::F16);
        for p in 0..len {
            let k: Vec<f32> = (0..2 * hd).map(|_| 3.0 * lcg(&mut seed)).collect();
            let v: Vec<f32> = (0..2 * hd).map(|_| lcg(&mut seed)).collect();
            kv.write(0, &table, p, &k, &v);
        }
        let q: Vec<f32> = (0..len * nh * hd).map(|_| lcg(&mut seed)).collect();
        let tokens: Vec<TokenRef<'_>> = (0..len).map(|pos| TokenRef { pos, table: &table }).collect();
        for window in [None, Some(5), Some(13)] {
            let shape = AttnShape { n_heads: nh, n_kv_heads: 2, head_dim: hd, sliding_window: window };
            let (mut a, mut b) = (vec![0f32; len * nh * hd], vec![0f32; len * nh * hd]);
            paged_attention(&kv, 0, &shape, &tokens, &q, &mut a, false);
            paged_attention(&kv, 0, &shape, &tokens, &q, &mut b, true);
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "window {window:?}");
        }
    }

    #[test]
    fn block_walk_offsets_equal_per_position_offsets() {
        let kv = PagedKv::new(KvGeometry { block_size: 4, num_blocks: 6, state_slots: 0 }, 1, 3, KvPrecision::F16);
        let table = [5u32, 0, 3, 1, 4];
        for lo in 0..20 {
            for hi in lo..20 {
                let mut got = Vec::new();
                kv.offsets(&table, lo, hi, 7, &mut got);
                let want: Vec<usize> = (lo..=hi).map(|p| kv.offset(&table, p) + 7).collect();
                assert_eq!(got, want, "{lo}..={hi}");
            }
        }
    }
}
