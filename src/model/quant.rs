//! GGML block formats (Q8_0, Q4_0, Q4_1) and 16-bit floats: decoding to f32, quantizing
//! activation rows to 8-bit blocks, and block dot products. The dot products follow llama.cpp's
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
pub fn quantize_row_q8(x: &[f32], out: &mut [BlockQ8]) {
    debug_assert_eq!(x.len(), out.len() * QK);
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
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only true when AVX2 and FMA were detected at runtime.
        return unsafe {
            match dtype {
                DType::Q8_0 => avx2::dot_q8_0(w, x),
                DType::Q4_0 => avx2::dot_q4_0(w, x),
                DType::Q4_1 => avx2::dot_q4_1(w, x),
                _ => unreachable!("dot_q on a float dtype"),
            }
        };
    }
    let _ = simd;
    match dtype {
        DType::Q8_0 => scalar::dot_q8_0(w, x),
        DType::Q4_0 => scalar::dot_q4_0(w, x),
        DType::Q4_1 => scalar::dot_q4_1(w, x),
        _ => unreachable!("dot_q on a float dtype"),
    }
}

/// f32 dot product with 8 independent partial sums combined in a fixed order.
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32], simd: bool) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only true when AVX2 and FMA were detected at runtime.
        return unsafe { avx2::dot_f32(a, b) };
    }
    let _ = simd;
    scalar::dot_f32(a, b)
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
    debug_assert!(a.len() == b.len() && a.len() % 8 == 0);
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only true when AVX2 and FMA were detected at runtime.
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
            // SAFETY: `simd` is only true when AVX2 and FMA were detected at runtime; `c` has 8
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

/// Quantize a float row (length a multiple of 32) to a GGML weight block format, round-to-nearest
/// (no importance weighting): used for synthetic weights and tests.
pub fn quantize_weight(dtype: DType, x: &[f32]) -> Vec<u8> {
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
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Portable versions of the AVX2 kernels with the same arithmetic, so results do not depend on
/// the CPU: a block's 32 products are summed as integers in 8 lanes of 4 consecutive elements,
/// each lane is multiply-added in f32 into its own accumulator, and the lanes are combined with
/// [`hsum8`](super::hsum8).
mod scalar {
    use super::{f16_at, hsum8, BlockQ8};

    pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0f32; 8];
        let n8 = a.len() / 8 * 8;
        for (ca, cb) in a[..n8].chunks_exact(8).zip(b[..n8].chunks_exact(8)) {
            for l in 0..8 {
                acc[l] = ca[l].mul_add(cb[l], acc[l]);
            }
        }
        let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        for i in n8..a.len() {
            s = a[i].mul_add(b[i], s);
        }
        s
    }

    /// `acc[l] += d · Σ w(4l..4l+4)·x(4l..4l+4)`, with `w(i)` the block's i-th weight value.
    #[inline]
    fn block(acc: &mut [f32; 8], d: f32, w: impl Fn(usize) -> i32, x: &[i8; 32]) {
        for (l, a) in acc.iter_mut().enumerate() {
            let lane: i32 = (4 * l..4 * l + 4).map(|i| w(i) * x[i] as i32).sum();
            *a = d.mul_add(lane as f32, *a);
        }
    }

    /// Element `i` of a 4-bit block: low nibbles hold elements 0..16, high nibbles 16..32.
    #[inline]
    fn nibble(qs: &[u8], i: usize) -> i32 {
        if i < 16 {
            (qs[i] & 0x0F) as i32
        } else {
            (qs[i - 16] >> 4) as i32
        }
    }

    pub fn dot_q8_0(w: &[u8], x: &[BlockQ8]) -> f32 {
        let mut acc = [0f32; 8];
        for (b, xb) in w.chunks_exact(34).zip(x) {
            block(&mut acc, f16_at(b, 0) * xb.d, |i| (b[2 + i] as i8) as i32, &xb.qs);
        }
        hsum8(&acc)
    }

    pub fn dot_q4_0(w: &[u8], x: &[BlockQ8]) -> f32 {
        let mut acc = [0f32; 8];
        for (b, xb) in w.chunks_exact(18).zip(x) {
            block(&mut acc, f16_at(b, 0) * xb.d, |i| nibble(&b[2..18], i) - 8, &xb.qs);
        }
        hsum8(&acc)
    }

    pub fn dot_q4_1(w: &[u8], x: &[BlockQ8]) -> f32 {
        let mut acc = [0f32; 8];
        let mut mins = 0f32;
        for (b, xb) in w.chunks_exact(20).zip(x) {
            block(&mut acc, f16_at(b, 0) * xb.d, |i| nibble(&b[4..20], i), &xb.qs);
            mins = f16_at(b, 2).mul_add(xb.sum, mins);
        }
        hsum8(&acc) + mins
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{f16_at, BlockQ8};
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Σ over 32 byte pairs of unsigned `a` × signed `b`, as 8 i32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn madd_us(a: __m256i, b: __m256i) -> __m256i {
        let p = _mm256_maddubs_epi16(a, b);
        _mm256_madd_epi16(p, _mm256_set1_epi16(1))
    }

    /// Σ over 32 byte pairs of signed × signed, as 8 i32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn madd_ss(a: __m256i, b: __m256i) -> __m256i {
        let ax = _mm256_sign_epi8(a, a);
        let sb = _mm256_sign_epi8(b, a);
        madd_us(ax, sb)
    }

    /// 16 bytes of packed nibbles → 32 bytes 0..15: low nibbles first, then high nibbles
    /// (GGML's element order within a block).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn nibbles(p: *const u8) -> __m256i {
        let v = _mm_loadu_si128(p as *const __m128i);
        let hi = _mm_srli_epi16(v, 4);
        let m = _mm256_set_m128i(hi, v);
        _mm256_and_si256(m, _mm256_set1_epi8(0x0F))
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let n8 = a.len() / 8 * 8;
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i < n8 {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i)), _mm256_loadu_ps(b.as_ptr().add(i)), acc);
            i += 8;
        }
        // Same combination order as the scalar fallback: (0+4)+(1+5) + (2+6)+(3+7).
        let lo = _mm256_castps256_ps128(acc);
        let hi = _mm256_extractf128_ps(acc, 1);
        let s4 = _mm_add_ps(lo, hi);
        let mut l = [0f32; 4];
        _mm_storeu_ps(l.as_mut_ptr(), s4);
        let mut s = (l[0] + l[1]) + (l[2] + l[3]);
        for j in n8..a.len() {
            s = a[j].mul_add(b[j], s);
        }
        s
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_lanes8(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= a.len() {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i)), _mm256_loadu_ps(b.as_ptr().add(i)), acc);
            i += 8;
        }
        hsum(acc)
    }

    /// `ggml_v_expf` (AVX2 + FMA variant), instruction for instruction, on 8 values in place.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn expf8(v: &mut [f32]) {
        use super::expc::*;
        let c = |b: u32| _mm256_set1_ps(f32::from_bits(b));
        let x = _mm256_loadu_ps(v.as_ptr());
        let r = c(SHIFTER);
        let z = _mm256_fmadd_ps(x, c(LOG2E), r);
        let n = _mm256_sub_ps(z, r);
        let b = _mm256_fnmadd_ps(n, c(LN2_LO), _mm256_fnmadd_ps(n, c(LN2_HI), x));
        let e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
        let k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1.0))));
        let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
        let cm = _mm256_castps_si256(_mm256_cmp_ps(abs_n, _mm256_set1_ps(126.0), _CMP_GT_OQ));
        let u = _mm256_mul_ps(b, b);
        let j = _mm256_fmadd_ps(
            _mm256_fmadd_ps(_mm256_fmadd_ps(c(P5), b, c(P4)), u, _mm256_fmadd_ps(c(P3), b, c(P2))),
            u,
            _mm256_mul_ps(c(P1), b),
        );
        let out = if _mm256_movemask_ps(_mm256_castsi256_ps(cm)) == 0 {
            _mm256_fmadd_ps(j, k, k)
        } else {
            let g = _mm256_and_si256(
                _mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
                _mm256_set1_epi32(0x8200_0000u32 as i32),
            );
            let s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f00_0000)));
            let s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
            let d = _mm256_castps_si256(_mm256_cmp_ps(abs_n, _mm256_set1_ps(192.0), _CMP_GT_OQ));
            _mm256_or_ps(
                _mm256_and_ps(_mm256_castsi256_ps(d), _mm256_mul_ps(s1, s1)),
                _mm256_andnot_ps(
                    _mm256_castsi256_ps(d),
                    _mm256_or_ps(
                        _mm256_and_ps(_mm256_castsi256_ps(cm), _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                        _mm256_andnot_ps(_mm256_castsi256_ps(cm), _mm256_fmadd_ps(k, j, k)),
                    ),
                ),
            )
        };
        _mm256_storeu_ps(v.as_mut_ptr(), out);
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_q8_0(w: &[u8], x: &[BlockQ8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (b, xb) in w.chunks_exact(34).zip(x) {
            let qw = _mm256_loadu_si256(b.as_ptr().add(2) as *const __m256i);
            let qx = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
            let s = _mm256_cvtepi32_ps(madd_ss(qw, qx));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b, 0) * xb.d), s, acc);
        }
        hsum(acc)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_q4_0(w: &[u8], x: &[BlockQ8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let eight = _mm256_set1_epi8(8);
        for (b, xb) in w.chunks_exact(18).zip(x) {
            let qw = _mm256_sub_epi8(nibbles(b.as_ptr().add(2)), eight);
            let qx = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
            let s = _mm256_cvtepi32_ps(madd_ss(qw, qx));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b, 0) * xb.d), s, acc);
        }
        hsum(acc)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_q4_1(w: &[u8], x: &[BlockQ8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut mins = 0f32;
        for (b, xb) in w.chunks_exact(20).zip(x) {
            let qw = nibbles(b.as_ptr().add(4));
            let qx = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
            let s = _mm256_cvtepi32_ps(madd_us(qw, qx));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b, 0) * xb.d), s, acc);
            // GGML's compiled kernel fuses this multiply-add (`summs += m * s` under FMA
            // contraction); an unfused one rounds differently.
            mins = f16_at(b, 2).mul_add(xb.sum, mins);
        }
        hsum(acc) + mins
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }

    #[test]
    fn quantized_dots_match_dequantized_reference_and_simd_matches_scalar() {
        let mut seed = 7;
        let n = 256;
        let w: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
        let x: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
        let mut xq = vec![BlockQ8::default(); n / QK];
        quantize_row_q8(&x, &mut xq);
        let xd: Vec<f32> = xq.iter().flat_map(|b| b.qs.iter().map(move |&q| q as f32 * b.d)).collect();
        for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
            let wq = quantize_weight(dtype, &w);
            let mut wd = vec![0f32; n];
            dequantize_into(dtype, &wq, &mut wd);
            // The dequantized weights are close to the originals…
            let werr = w.iter().zip(&wd).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(werr < 0.15, "{dtype}: weight error {werr}");
            // …and the block dot equals the float dot of what was actually stored.
            let reference: f64 = wd.iter().zip(&xd).map(|(&a, &b)| a as f64 * b as f64).sum();
            let s = dot_q(dtype, &wq, &xq, false);
            assert!((s as f64 - reference).abs() < 1e-3, "{dtype}: scalar {s} vs {reference}");
            if simd_available() {
                let v = dot_q(dtype, &wq, &xq, true);
                assert_eq!(v.to_bits(), s.to_bits(), "{dtype}: simd {v} vs scalar {s}");
            }
        }
    }

    #[test]
    fn f32_dot_simd_and_scalar_agree_bitwise() {
        let mut seed = 3;
        for n in [1usize, 7, 8, 9, 64, 577] {
            let a: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
            let b: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
            let s = dot_f32(&a, &b, false);
            let reference: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            assert!((s as f64 - reference).abs() < 1e-4);
            if simd_available() {
                assert_eq!(dot_f32(&a, &b, true).to_bits(), s.to_bits(), "n={n}");
            }
        }
    }

    #[test]
    fn ggml_expf_is_accurate_and_identical_on_every_path() {
        // Dense around softmax/SiLU inputs, plus the overflow/underflow branches and ±inf.
        let mut xs: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.01).collect();
        xs.extend([
            -200.0,
            -150.0,
            -104.0,
            -88.0,
            88.0,
            89.0,
            100.0,
            200.0,
            f32::NEG_INFINITY,
            f32::INFINITY,
            0.0,
            -0.0,
        ]);
        let mut scalar = xs.clone();
        expf_ggml(&mut scalar, false);
        for (&x, &y) in xs.iter().zip(&scalar) {
            let want = (x as f64).exp();
            if want > f32::MAX as f64 {
                assert_eq!(y, f32::INFINITY, "exp({x})");
            } else if want < 1e-38 {
                assert!(y.abs() < 1e-37, "exp({x}) = {y}");
            } else {
                assert!(((y as f64 - want) / want).abs() < 4e-7, "exp({x}) = {y}, want {want}");
            }
        }
        if simd_available() {
            let mut v = xs.clone();
            expf_ggml(&mut v, true);
            for ((x, a), b) in xs.iter().zip(&v).zip(&scalar) {
                assert_eq!(a.to_bits(), b.to_bits(), "exp({x})");
            }
        }
    }

    #[test]
    fn lanes8_dot_is_lane_ordered_and_identical_on_every_path() {
        let mut seed = 5;
        let a: Vec<f32> = (0..64).map(|_| lcg(&mut seed)).collect();
        let b: Vec<f32> = (0..64).map(|_| lcg(&mut seed)).collect();
        let s = dot_lanes8(&a, &b, false);
        let mut lanes = [0f32; 8];
        for i in 0..64 {
            lanes[i % 8] = a[i].mul_add(b[i], lanes[i % 8]);
        }
        assert_eq!(s.to_bits(), hsum8(&lanes).to_bits());
        let reference: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
        assert!((s as f64 - reference).abs() < 1e-5);
        if simd_available() {
            assert_eq!(dot_lanes8(&a, &b, true).to_bits(), s.to_bits());
        }
    }

    #[test]
    fn q8_row_quantization_keeps_sum_and_zero_rows() {
        let x = [0f32; 32];
        let mut q = [BlockQ8::default()];
        quantize_row_q8(&x, &mut q);
        assert_eq!(q[0].d, 0.0);
        assert!(q[0].qs.iter().all(|&v| v == 0));
        let x: Vec<f32> = (0..32).map(|i| i as f32 - 16.0).collect();
        quantize_row_q8(&x, &mut q);
        let back: f32 = q[0].qs.iter().map(|&v| v as f32 * q[0].d).sum();
        assert!((back - q[0].sum).abs() < 1e-2 * back.abs().max(1.0));
    }
}
