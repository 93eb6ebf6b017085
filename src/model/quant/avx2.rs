//! AVX2 + FMA + F16C kernels. Each computes exactly what its portable twin in `scalar` computes
//! (same products, same accumulation order, same roundings), only faster; the tests compare the
//! two bit for bit. Every function here requires those CPU features (callers check
//! [`simd_available`](super::simd_available)).
//!
//! The quantized dots come in tiles of `N` activation rows: a weight block is loaded and its
//! nibbles unpacked once and used for all `N` rows, each with its own accumulator, so a row's
//! result is the same operation sequence as a tile of one.

use super::BlockQ8;
use std::arch::x86_64::*;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// `acc + d · v` with one rounding: how every quantized kernel's epilogue folds a block's (or
/// group's) scale into its 8 lanes — `avx2`, `avx2_k` and `avx2_packed` alike, matching the
/// scalar `d.mul_add(lane, acc)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn fma_scaled(acc: __m256, d: f32, v: __m256) -> __m256 {
    _mm256_fmadd_ps(_mm256_set1_ps(d), v, acc)
}

/// Σ over 32 byte pairs of unsigned `a` × signed `b`, as 8 i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn madd_us(a: __m256i, b: __m256i) -> __m256i {
    let p = _mm256_maddubs_epi16(a, b);
    _mm256_madd_epi16(p, _mm256_set1_epi16(1))
}

/// Σ over 32 byte pairs of signed × signed, as 8 i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn madd_ss(a: __m256i, b: __m256i) -> __m256i {
    let ax = _mm256_sign_epi8(a, a);
    let sb = _mm256_sign_epi8(b, a);
    madd_us(ax, sb)
}

/// 16 bytes of packed nibbles → 32 bytes 0..15: low nibbles first, then high nibbles
/// (GGML's element order within a block).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(p: *const u8) -> __m256i {
    let v = _mm_loadu_si128(p as *const __m128i);
    let hi = _mm_srli_epi16(v, 4);
    let m = _mm256_set_m128i(hi, v);
    _mm256_and_si256(m, _mm256_set1_epi8(0x0F))
}

/// The f16 at `p` as f32 (exact), without leaving the vector unit.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16_at(p: *const u8) -> f32 {
    let bits = (p as *const u16).read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// The two consecutive f16 at `p` (Q4_1's scale and minimum) as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_pair_at(p: *const u8) -> (f32, f32) {
    let bits = (p as *const i32).read_unaligned();
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
}

/// `x` rounded to the nearest f16 (ties to even) and widened back.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn round_f16(x: f32) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(x))))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn qs(xb: &BlockQ8) -> __m256i {
    _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n8 = a.len() / 8 * 8;
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i < n8 {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i)), _mm256_loadu_ps(b.as_ptr().add(i)), acc);
        i += 8;
    }
    finish_f32(acc, a, b, n8)
}

/// [`dot_f32`] of one weight row `w` with 4 activation rows (`xs`, one after another, each
/// `w.len()` long): each 8-element piece of `w` is loaded once for all 4 rows, and each row keeps
/// its own accumulator, reduction and tail ([`finish_f32`]), so `out[t]` is bit for bit
/// `dot_f32(w, x_t)`. Besides the shared loads, the 4 independent FMA chains hide the FMA latency
/// that bounds a single dot.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f32_x4(w: &[f32], xs: &[f32], out: &mut [f32]) {
    let n = w.len();
    debug_assert!(xs.len() == 4 * n && out.len() >= 4);
    let n8 = n / 8 * 8;
    let wp = w.as_ptr();
    let (x0, x1, x2, x3) = (xs.as_ptr(), xs.as_ptr().add(n), xs.as_ptr().add(2 * n), xs.as_ptr().add(3 * n));
    let (mut a0, mut a1, mut a2, mut a3) =
        (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i < n8 {
        let wv = _mm256_loadu_ps(wp.add(i));
        a0 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x0.add(i)), a0);
        a1 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x1.add(i)), a1);
        a2 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x2.add(i)), a2);
        a3 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x3.add(i)), a3);
        i += 8;
    }
    for (t, a) in [a0, a1, a2, a3].into_iter().enumerate() {
        out[t] = finish_f32(a, w, &xs[t * n..(t + 1) * n], n8);
    }
}

/// The end of [`dot_f32`]: lanes combined `(0+4)+(1+5) + (2+6)+(3+7)`, as the scalar fallback,
/// then the elements from `n8` on, one FMA each.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn finish_f32(acc: __m256, a: &[f32], b: &[f32], n8: usize) -> f32 {
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

#[target_feature(enable = "avx2,fma,f16c")]
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
#[target_feature(enable = "avx2,fma,f16c")]
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

/// [`quantize_row_q8`](super::quantize_row_q8): the same multiplier, the same round-half-to-even
/// (`_mm256_round_ps` in nearest mode, as GGML's AVX2 quantizer), the same f16 roundings.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_row_q8(x: &[f32], out: &mut [BlockQ8]) {
    let abs_mask = _mm256_set1_ps(-0.0);
    for (blk, xs) in out.iter_mut().zip(x.chunks_exact(32)) {
        let p = xs.as_ptr();
        let v = [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)), _mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))];
        let mut m = _mm256_andnot_ps(abs_mask, v[0]);
        for vk in &v[1..] {
            m = _mm256_max_ps(m, _mm256_andnot_ps(abs_mask, *vk));
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
        let mut isum = _mm256_setzero_si256();
        let mut q = [0i32; 32];
        for (k, vk) in v.iter().enumerate() {
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(*vk, id));
            let i = _mm256_cvtps_epi32(r);
            isum = _mm256_add_epi32(isum, i);
            _mm256_storeu_si256(q.as_mut_ptr().add(8 * k) as *mut __m256i, i);
        }
        for (dst, &src) in blk.qs.iter_mut().zip(&q) {
            *dst = src as i8;
        }
        let s4 = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
        let s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0b01_00_11_10));
        let s1 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0b10_11_00_01));
        let isum = _mm_cvtsi128_si32(s1);
        blk.d = round_f16(d);
        blk.sum = round_f16(d * isum as f32);
    }
}

/// Weight formats of [`dot_rows`], as const parameters so each instantiation is one
/// straight-line kernel.
pub const Q8_0: u8 = 0;
pub const Q4_0: u8 = 1;
pub const Q4_1: u8 = 2;

/// Bytes of one 32-weight block of format `FMT`.
const fn block_bytes(fmt: u8) -> usize {
    match fmt {
        Q8_0 => 34,
        Q4_0 => 18,
        _ => 20,
    }
}

/// One weight block at `p`: scale, minimum (Q4_1 only, else 0) and the 32 weights as bytes —
/// signed for Q8_0/Q4_0, unsigned 0..15 for Q4_1.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weight_block<const FMT: u8>(p: *const u8) -> (f32, f32, __m256i) {
    match FMT {
        Q8_0 => (f16_at(p), 0.0, _mm256_loadu_si256(p.add(2) as *const __m256i)),
        Q4_0 => (f16_at(p), 0.0, _mm256_sub_epi8(nibbles(p.add(2)), _mm256_set1_epi8(8))),
        _ => {
            let (d, m) = f16_pair_at(p);
            (d, m, nibbles(p.add(4)))
        }
    }
}

/// `R` weight rows (starting at `w`, `rb` bytes apart) · `N` activation rows (`xs[j * nb..]`)
/// into `out[i * stride + j]`. Each (row, activation) pair has its own accumulators and sees
/// exactly the single-pair operation sequence: integer block sums, `acc = fma(dw·dx, sum, acc)`
/// per block, [`hsum`] at the end, plus Q4_1's fused `mins = fma(m, Σx, mins)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const FMT: u8, const R: usize, const N: usize>(
    w: *const u8,
    rb: usize,
    xs: &[BlockQ8],
    nb: usize,
    out: *mut f32,
    stride: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); N]; R];
    let mut mins = [[0f32; N]; R];
    for b in 0..nb {
        let wb: [(f32, f32, __m256i); R] =
            std::array::from_fn(|i| weight_block::<FMT>(w.add(i * rb + b * block_bytes(FMT))));
        for j in 0..N {
            let xb = xs.get_unchecked(j * nb + b);
            let qx = qs(xb);
            for i in 0..R {
                let (dw, mw, qw) = wb[i];
                let sum = if FMT == Q4_1 { madd_us(qw, qx) } else { madd_ss(qw, qx) };
                acc[i][j] = fma_scaled(acc[i][j], dw * xb.d, _mm256_cvtepi32_ps(sum));
                if FMT == Q4_1 {
                    // GGML's compiled kernel fuses this multiply-add (`summs += m * s` under FMA
                    // contraction); an unfused one rounds differently.
                    mins[i][j] = mw.mul_add(xb.sum, mins[i][j]);
                }
            }
        }
    }
    for i in 0..R {
        for j in 0..N {
            let v = hsum(acc[i][j]);
            *out.add(i * stride + j) = if FMT == Q4_1 { v + mins[i][j] } else { v };
        }
    }
}

/// `out[r * stride + j]` = weight row `r` · activation row `j`, for every row in `w` (`rb` bytes
/// each) and the `N` activation rows in `xs` (`nb` blocks each). Rows go in pairs (two
/// independent accumulator chains keep the FMA unit busy when `N` is 1).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_rows<const FMT: u8, const N: usize>(
    w: &[u8],
    rb: usize,
    xs: &[BlockQ8],
    nb: usize,
    out: &mut [f32],
    stride: usize,
) {
    let rows = w.len() / rb;
    debug_assert!(rb == nb * block_bytes(FMT) && xs.len() >= N * nb);
    debug_assert!(rows == 0 || out.len() >= (rows - 1) * stride + N);
    let (wp, op) = (w.as_ptr(), out.as_mut_ptr());
    let mut r = 0;
    while r + 2 <= rows {
        tile::<FMT, 2, N>(wp.add(r * rb), rb, xs, nb, op.add(r * stride), stride);
        r += 2;
    }
    if r < rows {
        tile::<FMT, 1, N>(wp.add(r * rb), rb, xs, nb, op.add(r * stride), stride);
    }
}
