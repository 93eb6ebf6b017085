//! GGML block formats (Q8_0, Q4_0, Q4_1, and the K-quants Q4_K, Q5_K, Q6_K in `kquant`) and
//! 16-bit floats: decoding to f32, quantizing activation rows to 8-bit blocks, and block dot
//! products. The dot products follow llama.cpp's
//! scheme (weights × activations quantized to Q8, integer sums per 32-element block, one scale
//! multiply per block), which is both what makes quantized matmul fast and what keeps our
//! numbers close to llama.cpp's. Every routine reduces in a fixed order, so a row's result never
//! depends on how many other rows are computed with it.
//!
//! It also owns the float kernels whose exact rounding GGML's x86 CPU backend fixes and which a
//! quantized model amplifies (every matmul re-quantizes its input to 8 bits, so one flipped
//! rounding moves logits by ~0.1): GGML's vectorised `expf` ([`expf_ggml`]) and the 8-lane dot
//! product of llamafile's tinyBLAS ([`dot_lanes8`]). Each has an AVX2 path and a scalar path that
//! give bit-identical results.
//!
//! Files: this one (formats, dispatch), `avx2` (AVX2 + FMA + F16C kernels, including the tiled
//! weight-rows × activation-rows dot of [`dot_q_block`]), `scalar` (the portable twins),
//! `kquant` (K-quant super-block layouts, dequantization, portable dots) and `avx2_k` (their
//! AVX2 twins), `packed` (the group-scaled formats of quantized safetensors checkpoints — FP8
//! blocks, int4, NVFP4 — with f32 activations) and `avx2_packed` (their AVX2 twins). Every AVX2
//! epilogue folds a block's scale in with `avx2::fma_scaled` and reduces with `avx2::hsum`.
//! It must not know about models, backends or threads: callers split the work.

use super::DType;
use half::{bf16, f16};

pub const QK: usize = 32;

/// One block of 32 activations quantized to i8 with a scale; `sum` is `d · Σq`, which Q4_1's
/// min term needs. Both hold f16-representable values, as in GGML's Q8_0/Q8_1.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ8 {
    pub d: f32,
    pub sum: f32,
    pub qs: [i8; QK],
}

impl Default for BlockQ8 {
    fn default() -> Self {
        BlockQ8 { d: 0.0, sum: 0.0, qs: [0; QK] }
    }
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Decode `dst.len()` elements of `dtype` from `src` (which must hold exactly that many).
pub fn dequantize_into(dtype: DType, src: &[u8], dst: &mut [f32]) {
    debug_assert_eq!(dtype.storage_bytes(dst.len()), Some(src.len()));
    match dtype {
        DType::F32 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::Q8_0 => {
            for (out, b) in dst.chunks_exact_mut(QK).zip(src.chunks_exact(34)) {
                let d = f16_at(b, 0);
                for (o, &q) in out.iter_mut().zip(&b[2..34]) {
                    *o = d * (q as i8) as f32;
                }
            }
        }
        DType::Q4_0 => {
            for (out, b) in dst.chunks_exact_mut(QK).zip(src.chunks_exact(18)) {
                let d = f16_at(b, 0);
                for j in 0..16 {
                    let q = b[2 + j];
                    out[j] = d * ((q & 0x0F) as i32 - 8) as f32;
                    out[j + 16] = d * ((q >> 4) as i32 - 8) as f32;
                }
            }
        }
        DType::Q4_K | DType::Q5_K | DType::Q6_K => kquant::dequantize(dtype, src, dst),
        DType::Q4_1 => {
            for (out, b) in dst.chunks_exact_mut(QK).zip(src.chunks_exact(20)) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                for j in 0..16 {
                    let q = b[4 + j];
                    out[j] = d * (q & 0x0F) as f32 + m;
                    out[j + 16] = d * (q >> 4) as f32 + m;
                }
            }
        }
    }
}

/// Quantize one activation row (length a multiple of 32) into `out` (length / 32 blocks).
pub fn quantize_row_q8(x: &[f32], out: &mut [BlockQ8], simd: bool) {
    debug_assert_eq!(x.len(), out.len() * QK);
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only true when AVX2, FMA and F16C were detected at runtime.
        unsafe { avx2::quantize_row_q8(x, out) };
        return;
    }
    let _ = simd;
    for (blk, xs) in out.iter_mut().zip(x.chunks_exact(QK)) {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        // As GGML: multiplier 127/amax (not 1/d) and round-half-to-even (`_MM_ROUND_NEAREST`).
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut isum = 0i32;
        for (q, &v) in blk.qs.iter_mut().zip(xs) {
            let r = (v * id).round_ties_even() as i32;
            *q = r as i8;
            isum += r;
        }
        // GGML stores both in f16; rounding them the same way keeps us numerically next to
        // llama.cpp (the quantization above still uses the unrounded 1/d, as GGML does).
        blk.d = f16::from_f32(d).to_f32();
        blk.sum = f16::from_f32(d * isum as f32).to_f32();
    }
}

/// Dot product of one quantized weight row (`w`, raw GGML bytes) with one quantized activation
/// row. Dispatches once per call on the CPU features detected at startup.
#[inline]
pub fn dot_q(dtype: DType, w: &[u8], x: &[BlockQ8], simd: bool) -> f32 {
    let mut out = [0f32];
    dot_q_block(dtype, w, x, x.len(), &mut out, 1, simd);
    out[0]
}

/// Activation rows per tile of [`dot_q_block`]: each weight block is unpacked once per tile.
pub const DOT_TILE: usize = 4;

/// Dot products of several quantized weight rows (`w`, whole rows of `nb` blocks) with the
/// activation rows stored one after another in `xs` (`nb` blocks each):
/// `out[r * stride + j]` = weight row `r` · activation row `j`. Each result is bit-identical to
/// [`dot_q`] of that pair alone: every pair keeps its own accumulators and operation order; only
/// the decoding of weight blocks is shared, across tiles of [`DOT_TILE`] activation rows.
pub fn dot_q_block(dtype: DType, w: &[u8], xs: &[BlockQ8], nb: usize, out: &mut [f32], stride: usize, simd: bool) {
    if nb == 0 || xs.is_empty() || w.is_empty() {
        return;
    }
    let n = xs.len() / nb;
    let rb = dtype.storage_bytes(nb * QK).unwrap_or(0);
    let rows = w.len().checked_div(rb).unwrap_or(0);
    assert!(
        rb > 0 && nb * n == xs.len() && rows * rb == w.len() && n <= stride && out.len() >= (rows - 1) * stride + n,
        "dot_q_block: {} weight bytes, {} activation blocks, {} outputs (stride {stride})",
        w.len(),
        xs.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    if simd && matches!(dtype, DType::Q4_K | DType::Q5_K | DType::Q6_K) {
        use avx2_k::{dot_rows, Q4_K, Q5_K, Q6_K};
        for (t, xt) in xs.chunks(DOT_TILE * nb).enumerate() {
            let ot = &mut out[t * DOT_TILE..];
            // SAFETY: as below.
            unsafe {
                match (dtype, xt.len() / nb) {
                    (DType::Q4_K, 4) => dot_rows::<Q4_K, 4>(w, rb, xt, nb, ot, stride),
                    (DType::Q4_K, 3) => dot_rows::<Q4_K, 3>(w, rb, xt, nb, ot, stride),
                    (DType::Q4_K, 2) => dot_rows::<Q4_K, 2>(w, rb, xt, nb, ot, stride),
                    (DType::Q4_K, _) => dot_rows::<Q4_K, 1>(w, rb, xt, nb, ot, stride),
                    (DType::Q5_K, 4) => dot_rows::<Q5_K, 4>(w, rb, xt, nb, ot, stride),
                    (DType::Q5_K, 3) => dot_rows::<Q5_K, 3>(w, rb, xt, nb, ot, stride),
                    (DType::Q5_K, 2) => dot_rows::<Q5_K, 2>(w, rb, xt, nb, ot, stride),
                    (DType::Q5_K, _) => dot_rows::<Q5_K, 1>(w, rb, xt, nb, ot, stride),
                    (_, 4) => dot_rows::<Q6_K, 4>(w, rb, xt, nb, ot, stride),
                    (_, 3) => dot_rows::<Q6_K, 3>(w, rb, xt, nb, ot, stride),
                    (_, 2) => dot_rows::<Q6_K, 2>(w, rb, xt, nb, ot, stride),
                    (_, _) => dot_rows::<Q6_K, 1>(w, rb, xt, nb, ot, stride),
                }
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if simd {
        use avx2::{dot_rows, Q4_0, Q4_1, Q8_0};
        for (t, xt) in xs.chunks(DOT_TILE * nb).enumerate() {
            let ot = &mut out[t * DOT_TILE..];
            // SAFETY: `simd` is only true when AVX2, FMA and F16C were detected at runtime; the
            // sizes were checked above.
            unsafe {
                match (dtype, xt.len() / nb) {
                    (DType::Q8_0, 4) => dot_rows::<Q8_0, 4>(w, rb, xt, nb, ot, stride),
                    (DType::Q8_0, 3) => dot_rows::<Q8_0, 3>(w, rb, xt, nb, ot, stride),
                    (DType::Q8_0, 2) => dot_rows::<Q8_0, 2>(w, rb, xt, nb, ot, stride),
                    (DType::Q8_0, _) => dot_rows::<Q8_0, 1>(w, rb, xt, nb, ot, stride),
                    (DType::Q4_0, 4) => dot_rows::<Q4_0, 4>(w, rb, xt, nb, ot, stride),
                    (DType::Q4_0, 3) => dot_rows::<Q4_0, 3>(w, rb, xt, nb, ot, stride),
                    (DType::Q4_0, 2) => dot_rows::<Q4_0, 2>(w, rb, xt, nb, ot, stride),
                    (DType::Q4_0, _) => dot_rows::<Q4_0, 1>(w, rb, xt, nb, ot, stride),
                    (DType::Q4_1, 4) => dot_rows::<Q4_1, 4>(w, rb, xt, nb, ot, stride),
                    (DType::Q4_1, 3) => dot_rows::<Q4_1, 3>(w, rb, xt, nb, ot, stride),
                    (DType::Q4_1, 2) => dot_rows::<Q4_1, 2>(w, rb, xt, nb, ot, stride),
                    (DType::Q4_1, _) => dot_rows::<Q4_1, 1>(w, rb, xt, nb, ot, stride),
                    _ => unreachable!("dot_q on a float dtype"),
                }
            }
        }
        return;
    }
    let _ = simd;
    for (wr, orow) in w.chunks_exact(rb).zip(out.chunks_mut(stride)) {
        for (x, o) in xs.chunks_exact(nb).zip(orow.iter_mut()) {
            *o = match dtype {
                DType::Q8_0 => scalar::dot_q8_0(wr, x),
                DType::Q4_0 => scalar::dot_q4_0(wr, x),
                DType::Q4_1 => scalar::dot_q4_1(wr, x),
                DType::Q4_K | DType::Q5_K | DType::Q6_K => kquant::dot(dtype, wr, x),
                _ => unreachable!("dot_q on a float dtype"),
            };
        }
    }
}

/// f32 dot product with 8 independent partial sums combined in a fixed order.
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32], simd: bool) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only true when AVX2, FMA and F16C were detected at runtime.
        return unsafe { avx2::dot_f32(a, b) };
    }
    let _ = simd;
    scalar::dot_f32(a, b)
}

/// [`dot_f32`] of one weight row `w` with every activation row in `xs` (rows of `w.len()`,
/// one after another): `out[t] = dot_f32(w, x_t)`, bit for bit, for any number of rows. With
/// `simd`, rows go in tiles of [`DOT_TILE`] (4) that share each load of `w`.
pub fn dot_f32_rows(w: &[f32], xs: &[f32], out: &mut [f32], simd: bool) {
    let n = w.len();
    if n == 0 {
        out.iter_mut().for_each(|o| *o = 0.0);
        return;
    }
    let rows = xs.len() / n;
    assert!(
        rows * n == xs.len() && out.len() >= rows,
        "dot_f32_rows: {} inputs of {n}, {} outputs",
        xs.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    if simd {
        for (xt, ot) in xs.chunks(DOT_TILE * n).zip(out.chunks_mut(DOT_TILE)) {
            // SAFETY: `simd` is only true when AVX2, FMA and F16C were detected at runtime; a
            // full tile holds 4 whole rows and has 4 outputs.
            unsafe {
                if xt.len() == 4 * n {
                    avx2::dot_f32_x4(w, xt, ot);
                } else {
                    for (x, o) in xt.chunks_exact(n).zip(ot.iter_mut()) {
                        *o = avx2::dot_f32(w, x);
                    }
                }
            }
        }
        return;
    }
    let _ = simd;
    for (x, o) in xs.chunks_exact(n).zip(out.iter_mut()) {
        *o = scalar::dot_f32(w, x);
    }
}

/// Horizontal sum of 8 lanes in the order of GGML's AVX2 reductions (llamafile's `hsum`, the
/// per-group sum of `ggml_vec_soft_max_f32`): `((v0+v4) + (v2+v6)) + ((v1+v5) + (v3+v7))`.
#[inline]
pub fn hsum8(v: &[f32; 8]) -> f32 {
    let s = [v[0] + v[4], v[1] + v[5], v[2] + v[6], v[3] + v[7]];
    (s[0] + s[2]) + (s[1] + s[3])
}

/// Dot product as llamafile's tinyBLAS computes it on AVX2 (what llama.cpp uses for f16
/// attention matmuls of two or more query rows): one 8-lane FMA accumulator over the whole row,
/// element `i` in lane `i % 8`, then [`hsum8`]. `a.len()` must be a multiple of 8.
#[inline]
pub fn dot_lanes8(a: &[f32], b: &[f32], simd: bool) -> f32 {
    debug_assert!(a.len() == b.len() && a.len().is_multiple_of(8));
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only true when AVX2, FMA and F16C were detected at runtime.
        return unsafe { avx2::dot_lanes8(a, b) };
    }
    let _ = simd;
    let mut acc = [0f32; 8];
    for (ca, cb) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] = ca[l].mul_add(cb[l], acc[l]);
        }
    }
    hsum8(&acc)
}

/// `x[i] = exp(x[i])` exactly as GGML's `ggml_v_expf` (AVX2 build) computes it: a degree-5
/// polynomial after range reduction, within ~1.5 ulp of the true value, bit-identical on every
/// path here. llama.cpp uses it for softmax and SiLU, where the last bits matter downstream.
pub fn expf_ggml(x: &mut [f32], simd: bool) {
    let n8 = x.len() / 8 * 8;
    #[cfg(target_arch = "x86_64")]
    if simd {
        for c in x[..n8].chunks_exact_mut(8) {
            // SAFETY: `simd` is only true when AVX2, FMA and F16C were detected at runtime; `c` has 8
            // elements.
            unsafe { avx2::expf8(c) };
        }
        for v in &mut x[n8..] {
            *v = expf_ggml_scalar(*v);
        }
        return;
    }
    let _ = (simd, n8);
    for v in x.iter_mut() {
        *v = expf_ggml_scalar(*v);
    }
}

/// Constants of `ggml_v_expf`, as bit patterns of the hex-float literals in GGML's source.
mod expc {
    pub const SHIFTER: u32 = 0x4b40_0000; // 0x1.8p23
    pub const LOG2E: u32 = 0x3fb8_aa3b; // 0x1.715476p+0
    pub const LN2_HI: u32 = 0x3f31_7200; // 0x1.62e4p-1
    pub const LN2_LO: u32 = 0x35bf_be8e; // 0x1.7f7d1cp-20
    pub const P5: u32 = 0x3c07_2010; // 0x1.0e4020p-7
    pub const P4: u32 = 0x3d2b_9f17; // 0x1.573e2ep-5
    pub const P3: u32 = 0x3e2a_af33; // 0x1.555e66p-3
    pub const P2: u32 = 0x3eff_fedb; // 0x1.fffdb6p-2
    pub const P1: u32 = 0x3f7f_fff6; // 0x1.ffffecp-1
}

/// One lane of `ggml_v_expf`; every operation (FMA included) rounds as the vector code does.
fn expf_ggml_scalar(x: f32) -> f32 {
    use expc::*;
    let c = f32::from_bits;
    let r = c(SHIFTER);
    let z = x.mul_add(c(LOG2E), r);
    let n = z - r;
    let b = (-n).mul_add(c(LN2_LO), (-n).mul_add(c(LN2_HI), x));
    let e = z.to_bits().wrapping_shl(23);
    let k = f32::from_bits(e.wrapping_add(1f32.to_bits()));
    let u = b * b;
    let j = c(P5).mul_add(b, c(P4)).mul_add(u, c(P3).mul_add(b, c(P2))).mul_add(u, c(P1) * b);
    if n.abs() <= 126.0 || n.is_nan() {
        return j.mul_add(k, k);
    }
    // Far from 1: the result over- or underflows through two scale factors (or saturates).
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = f32::from_bits(g.wrapping_add(0x7f00_0000));
    let s2 = f32::from_bits(e.wrapping_sub(g));
    if n.abs() > 192.0 {
        s1 * s1
    } else {
        s2.mul_add(j, s2) * s1
    }
}

/// Quantize a float row (length a multiple of the format's block: 32, or 256 for the K formats)
/// to a GGML weight block format, round-to-nearest (no importance weighting): used for synthetic
/// weights and tests.
pub fn quantize_weight(dtype: DType, x: &[f32]) -> Vec<u8> {
    if matches!(dtype, DType::Q4_K | DType::Q5_K | DType::Q6_K) {
        return kquant::quantize(dtype, x);
    }
    let mut out = Vec::new();
    for xs in x.chunks_exact(QK) {
        match dtype {
            DType::Q8_0 => {
                let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(xs.iter().map(|v| ((v / d).round() as i8) as u8));
            }
            DType::Q4_0 => {
                let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 8.0;
                out.extend(f16::from_f32(d).to_le_bytes());
                let q = |v: f32| ((v / d + 8.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|j| q(xs[j]) | (q(xs[j + 16]) << 4)));
            }
            DType::Q4_1 => {
                let mn = xs.iter().fold(f32::MAX, |m, &v| m.min(v));
                let mx = xs.iter().fold(f32::MIN, |m, &v| m.max(v));
                let d = (mx - mn) / 15.0;
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(f16::from_f32(mn).to_le_bytes());
                let q = |v: f32| (((v - mn) / d + 0.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|j| q(xs[j]) | (q(xs[j + 16]) << 4)));
            }
            _ => unreachable!("quantize_weight on a float dtype"),
        }
    }
    out
}

/// Whether the SIMD kernels can run on this CPU.
pub fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_k;
#[cfg(target_arch = "x86_64")]
mod avx2_packed;
pub mod kquant;
pub mod packed;
mod scalar;
#[cfg(test)]
mod tests;
