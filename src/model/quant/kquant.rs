//! GGML's K-quant super-block formats (Q4_K, Q5_K, Q6_K): 256 weights per block with 6- or
//! 8-bit sub-block scales under one f16 scale. This file owns the byte layouts (decoding a
//! super-block into integer codes and integer scales), dequantization, the portable dot kernels
//! and a round-to-nearest quantizer for synthetic weights and tests; `avx2_k` has the vector twins.
//!
//! The dots pair each 32-weight sub-block with one 32-activation [`BlockQ8`] (the activation
//! format every other quantized dot uses, so a K-quant matrix needs no separate activation
//! pass), with this exact arithmetic, which both kernels share:
//! - integer lanes of 4 consecutive products, each multiplied by its (16- or 32-element) group's
//!   integer scale — exact, so the order of the integer work is free;
//! - per sub-block, `acc[lane] = fma(d · dx, lane as f32, acc[lane])`, the block's f16 scale `d`
//!   times the activation block's scale;
//! - Q4_K/Q5_K only: `mins = fma(dmin · m, Σx, mins)` per sub-block (`dmin · m` is exact in f32);
//! - the result is [`hsum8`]`(acc) − mins`.

use super::{f16_at, hsum8, BlockQ8, QK};
use crate::model::DType;
use half::f16;

/// Weights per K-quant super-block.
pub const QK_K: usize = 256;
/// 32-weight sub-blocks per super-block.
pub const SUB: usize = QK_K / QK;

/// One super-block decoded to integers: `value[i] = d · scale[i / 16] · q[i] − dmin · min[i / 32]`.
pub(super) struct KBlock {
    pub d: f32,
    pub dmin: f32,
    /// Q4_K/Q5_K: the unsigned codes (0..15 / 0..31). Q6_K: the centred codes (−32..31).
    pub q: [i8; QK_K],
    /// Integer scale of each 16-weight group (Q4_K/Q5_K: their sub-block's, twice).
    pub scale: [i32; 16],
    /// Integer min of each 32-weight sub-block (always 0 for Q6_K).
    pub min: [i32; SUB],
}

/// Q4_K/Q5_K's twelve bytes of packed 6-bit scales and mins (`get_scale_min_k4` in GGML):
/// sub-blocks 0..4 keep theirs in the low 6 bits of bytes 0..4 (scales) and 4..8 (mins);
/// sub-blocks 4..8 in the nibbles of bytes 8..12 plus the top two bits of bytes 0..8.
#[inline]
pub(super) fn scale_min_k4(sc: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (sc[j] & 63, sc[j + 4] & 63)
    } else {
        ((sc[j + 4] & 0x0F) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4))
    }
}

/// Decode one super-block of `dtype` (one of the K formats) from its bytes.
pub(super) fn unpack(dtype: DType, b: &[u8]) -> KBlock {
    let mut k = KBlock { d: 0.0, dmin: 0.0, q: [0; QK_K], scale: [0; 16], min: [0; SUB] };
    match dtype {
        DType::Q4_K | DType::Q5_K => {
            k.d = f16_at(b, 0);
            k.dmin = f16_at(b, 2);
            let sc = &b[4..16];
            let (qh, qs) = if dtype == DType::Q5_K { (Some(&b[16..48]), &b[48..176]) } else { (None, &b[16..144]) };
            for s in 0..SUB {
                let (scale, min) = scale_min_k4(sc, s);
                k.scale[2 * s] = scale as i32;
                k.scale[2 * s + 1] = scale as i32;
                k.min[s] = min as i32;
                // Sub-blocks 2c and 2c+1 share the 32 bytes qs[32c..]: low nibbles, then high.
                let bytes = &qs[32 * (s / 2)..32 * (s / 2) + 32];
                for (l, &byte) in bytes.iter().enumerate() {
                    let low = if s % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                    let high = qh.map_or(0, |h| ((h[l] >> s) & 1) << 4);
                    k.q[32 * s + l] = (low | high) as i8;
                }
            }
        }
        DType::Q6_K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            k.d = f16_at(b, 208);
            for (g, s) in k.scale.iter_mut().zip(sc) {
                *g = *s as i8 as i32;
            }
            // Each 128-weight half: 64 bytes of low nibbles and 32 bytes of 2-bit pairs; its
            // four 32-weight runs take (low nibble of ql[l], bits 0-1), (low of ql[l+32], bits
            // 2-3), (high of ql[l], bits 4-5), (high of ql[l+32], bits 6-7).
            for s in 0..SUB {
                let (n, r) = (s / 4, s % 4);
                let low = &ql[64 * n + 32 * (r % 2)..];
                let high = &qh[32 * n..];
                for l in 0..32 {
                    let lo = if r < 2 { low[l] & 0x0F } else { low[l] >> 4 };
                    let hi = (high[l] >> (2 * r)) & 3;
                    k.q[32 * s + l] = (lo | (hi << 4)) as i8 - 32;
                }
            }
        }
        _ => unreachable!("unpack on a non-K format"),
    }
    k
}

/// Decode whole super-blocks of `dtype` to f32, rounding as GGML's `dequantize_row_q*_K` does:
/// `(d · sc) · q − (dmin · m)`.
pub fn dequantize(dtype: DType, src: &[u8], dst: &mut [f32]) {
    for (out, b) in dst.chunks_exact_mut(QK_K).zip(src.chunks_exact(dtype.block_bytes())) {
        let k = unpack(dtype, b);
        for (i, o) in out.iter_mut().enumerate() {
            let scaled = k.d * k.scale[i / 16] as f32;
            *o = scaled * k.q[i] as f32 - k.dmin * k.min[i / 32] as f32;
        }
    }
}

/// The dot of one K-quant weight row with one activation row (see the module doc for the
/// arithmetic).
pub fn dot(dtype: DType, w: &[u8], x: &[BlockQ8]) -> f32 {
    let mut acc = [0f32; 8];
    let mut mins = 0f32;
    for (b, xs) in w.chunks_exact(dtype.block_bytes()).zip(x.chunks_exact(SUB)) {
        let k = unpack(dtype, b);
        for (s, xb) in xs.iter().enumerate() {
            let q = &k.q[32 * s..32 * s + 32];
            let dd = k.d * xb.d;
            for (l, a) in acc.iter_mut().enumerate() {
                let sum: i32 = (4 * l..4 * l + 4).map(|i| q[i] as i32 * xb.qs[i] as i32).sum();
                let lane = sum * k.scale[2 * s + l / 4];
                *a = dd.mul_add(lane as f32, *a);
            }
            if dtype != DType::Q6_K {
                mins = (k.dmin * k.min[s] as f32).mul_add(xb.sum, mins);
            }
        }
    }
    hsum8(&acc) - mins
}

/// Round-to-nearest quantization of whole super-blocks (no importance weighting, unlike
/// llama.cpp's quantizer): for synthetic weights and tests, not for producing model files.
pub fn quantize(dtype: DType, x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK_K * dtype.block_bytes());
    for xs in x.chunks_exact(QK_K) {
        match dtype {
            DType::Q4_K => quantize_q45k(xs, 15, &mut out),
            DType::Q5_K => quantize_q45k(xs, 31, &mut out),
            DType::Q6_K => quantize_q6k(xs, &mut out),
            _ => unreachable!("kquant::quantize on a non-K format"),
        }
    }
    out
}

/// Q4_K (`levels` 15) or Q5_K (31): each sub-block gets `value ≈ scale · q − min` with
/// `min ≥ 0`, and the sub-block scales and mins are themselves 6-bit multiples of `d`, `dmin`.
fn quantize_q45k(xs: &[f32], levels: u8, out: &mut Vec<u8>) {
    let mut scales = [0f32; SUB];
    let mut mins = [0f32; SUB];
    for (s, sub) in xs.chunks_exact(QK).enumerate() {
        let lo = sub.iter().fold(0f32, |m, &v| m.min(v));
        let hi = sub.iter().fold(f32::MIN, |m, &v| m.max(v));
        scales[s] = (hi - lo) / levels as f32;
        mins[s] = -lo;
    }
    let d = scales.iter().fold(0f32, |m, &v| m.max(v)) / 63.0;
    let dmin = mins.iter().fold(0f32, |m, &v| m.max(v)) / 63.0;
    let (d, dmin) = (f16::from_f32(d), f16::from_f32(dmin));
    let code6 = |v: f32, unit: f32| if unit > 0.0 { (v / unit).round().clamp(0.0, 63.0) as u8 } else { 0 };
    let sc: Vec<u8> = scales.iter().map(|&v| code6(v, d.to_f32())).collect();
    let mn: Vec<u8> = mins.iter().map(|&v| code6(v, dmin.to_f32())).collect();
    let mut packed = [0u8; 12];
    for j in 0..4 {
        packed[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        packed[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
        packed[j + 8] = (sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4);
    }
    let mut q = [0u8; QK_K];
    for (s, sub) in xs.chunks_exact(QK).enumerate() {
        let step = d.to_f32() * sc[s] as f32;
        let m = dmin.to_f32() * mn[s] as f32;
        for (c, &v) in q[QK * s..QK * s + QK].iter_mut().zip(sub) {
            *c = if step > 0.0 { ((v + m) / step).round().clamp(0.0, levels as f32) as u8 } else { 0 };
        }
    }
    out.extend(d.to_le_bytes());
    out.extend(dmin.to_le_bytes());
    out.extend(packed);
    if levels == 31 {
        let mut qh = [0u8; 32];
        for (i, &c) in q.iter().enumerate() {
            qh[i % 32] |= (c >> 4) << (i / 32);
        }
        out.extend(qh);
    }
    for c in 0..4 {
        out.extend((0..32).map(|l| (q[64 * c + l] & 0x0F) | ((q[64 * c + 32 + l] & 0x0F) << 4)));
    }
}

/// Q6_K: symmetric 16-weight groups, `value ≈ d · sc · (q − 32)` with i8 group scales.
fn quantize_q6k(xs: &[f32], out: &mut Vec<u8>) {
    let mut group = [0f32; 16];
    for (g, sub) in group.iter_mut().zip(xs.chunks_exact(16)) {
        *g = sub.iter().fold(0f32, |m, &v| m.max(v.abs())) / 31.0;
    }
    let d = f16::from_f32(group.iter().fold(0f32, |m, &v| m.max(v)) / 127.0);
    let sc: Vec<i8> = group
        .iter()
        .map(|&g| if d.to_f32() > 0.0 { (g / d.to_f32()).round().clamp(-128.0, 127.0) as i8 } else { 0 })
        .collect();
    let mut q = [0u8; QK_K];
    for (i, (c, &v)) in q.iter_mut().zip(xs).enumerate() {
        let step = d.to_f32() * sc[i / 16] as f32;
        let centred = if step != 0.0 { (v / step).round().clamp(-32.0, 31.0) as i32 } else { 0 };
        *c = (centred + 32) as u8;
    }
    let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
    for n in 0..2 {
        for l in 0..32 {
            let at = |r: usize| q[128 * n + 32 * r + l];
            ql[64 * n + l] = (at(0) & 0x0F) | ((at(2) & 0x0F) << 4);
            ql[64 * n + 32 + l] = (at(1) & 0x0F) | ((at(3) & 0x0F) << 4);
            qh[32 * n + l] = (at(0) >> 4) | ((at(1) >> 4) << 2) | ((at(2) >> 4) << 4) | ((at(3) >> 4) << 6);
        }
    }
    out.extend(ql);
    out.extend(qh);
    out.extend(sc.iter().map(|&s| s as u8));
    out.extend(d.to_le_bytes());
}
