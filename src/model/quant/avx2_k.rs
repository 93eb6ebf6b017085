//! AVX2 twins of the K-quant dots in `kquant`: the same integer lanes, the same per-sub-block
//! FMA into 8 lanes, the same scalar min chain and final reduction, so results are bit-identical
//! (the tests compare them). Like `avx2::dot_rows`, a weight super-block's scales are decoded
//! once and each 32-weight sub-block is unpacked once for a tile of `N` activation rows, each
//! (weight row, activation row) pair keeping its own accumulators.

use super::avx2::{f16_at, fma_scaled, hsum, qs};
use super::kquant::{scale_min_k4, SUB};
use super::BlockQ8;
use std::arch::x86_64::*;

/// Weight formats of [`dot_rows`], as const parameters.
pub const Q4_K: u8 = 0;
pub const Q5_K: u8 = 1;
pub const Q6_K: u8 = 2;

const fn block_bytes(fmt: u8) -> usize {
    match fmt {
        Q4_K => 144,
        Q5_K => 176,
        _ => 210,
    }
}

/// A super-block's scales: `d`, and per sub-block the integer scales as i16 lanes (one value
/// for Q4_K/Q5_K; Q6_K's two 16-weight groups in the low and high halves) and `dmin · m`.
struct Meta {
    d: f32,
    scales: [__m256i; SUB],
    mins: [f32; SUB],
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn meta<const FMT: u8>(p: *const u8) -> Meta {
    let mut m = Meta { d: 0.0, scales: [_mm256_setzero_si256(); SUB], mins: [0.0; SUB] };
    if FMT == Q6_K {
        m.d = f16_at(p.add(208));
        let sc = std::slice::from_raw_parts(p.add(192) as *const i8, 16);
        for s in 0..SUB {
            m.scales[s] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * s + 1] as i16), _mm_set1_epi16(sc[2 * s] as i16));
        }
    } else {
        m.d = f16_at(p);
        let dmin = f16_at(p.add(2));
        let sc = std::slice::from_raw_parts(p.add(4), 12);
        for s in 0..SUB {
            let (scale, min) = scale_min_k4(sc, s);
            m.scales[s] = _mm256_set1_epi16(scale as i16);
            m.mins[s] = dmin * min as f32;
        }
    }
    m
}

/// 32 bytes of packed nibbles → the low (`high` false) or high nibbles, as bytes 0..15.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(bytes: __m256i, high: bool) -> __m256i {
    let v = if high { _mm256_srli_epi16(bytes, 4) } else { bytes };
    _mm256_and_si256(v, _mm256_set1_epi8(0x0F))
}

/// Sub-block `s` of the super-block at `p` as 32 bytes: codes 0..15 / 0..31 (Q4_K/Q5_K) or
/// centred codes −32..31 (Q6_K), in element order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn codes<const FMT: u8>(p: *const u8, s: usize) -> __m256i {
    match FMT {
        Q4_K => nibbles(_mm256_loadu_si256(p.add(16 + 32 * (s / 2)) as *const __m256i), s % 2 == 1),
        Q5_K => {
            let low = nibbles(_mm256_loadu_si256(p.add(48 + 32 * (s / 2)) as *const __m256i), s % 2 == 1);
            let bit = _mm256_set1_epi8((1u8 << s) as i8);
            let qh = _mm256_loadu_si256(p.add(16) as *const __m256i);
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
            _mm256_or_si256(low, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
        }
        _ => {
            let (n, r) = (s / 4, s % 4);
            let low = nibbles(_mm256_loadu_si256(p.add(64 * n + 32 * (r % 2)) as *const __m256i), r >= 2);
            let qh = _mm256_loadu_si256(p.add(128 + 32 * n) as *const __m256i);
            let two = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * r as i32)), _mm256_set1_epi8(3));
            let q = _mm256_or_si256(low, _mm256_slli_epi16(two, 4));
            _mm256_sub_epi8(q, _mm256_set1_epi8(32))
        }
    }
}

/// `R` weight rows × `N` activation rows; see `avx2::tile` for the layout of the arguments.
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
    for sb in 0..nb / SUB {
        let metas: [Meta; R] = std::array::from_fn(|i| meta::<FMT>(w.add(i * rb + sb * block_bytes(FMT))));
        for s in 0..SUB {
            let ws: [__m256i; R] = std::array::from_fn(|i| codes::<FMT>(w.add(i * rb + sb * block_bytes(FMT)), s));
            for j in 0..N {
                let xb = xs.get_unchecked(j * nb + sb * SUB + s);
                let qx = qs(xb);
                for i in 0..R {
                    let products = if FMT == Q6_K {
                        _mm256_maddubs_epi16(_mm256_sign_epi8(ws[i], ws[i]), _mm256_sign_epi8(qx, ws[i]))
                    } else {
                        _mm256_maddubs_epi16(ws[i], qx)
                    };
                    let lanes = _mm256_madd_epi16(products, metas[i].scales[s]);
                    acc[i][j] = fma_scaled(acc[i][j], metas[i].d * xb.d, _mm256_cvtepi32_ps(lanes));
                    if FMT != Q6_K {
                        mins[i][j] = metas[i].mins[s].mul_add(xb.sum, mins[i][j]);
                    }
                }
            }
        }
    }
    for i in 0..R {
        for j in 0..N {
            *out.add(i * stride + j) = hsum(acc[i][j]) - mins[i][j];
        }
    }
}

/// `out[r * stride + j]` = weight row `r` · activation row `j` for every row in `w` (`rb` bytes
/// each, whole super-blocks) and the `N` activation rows in `xs` (`nb` blocks each, a multiple
/// of 8). Rows go in pairs, as in `avx2::dot_rows`.
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
    debug_assert!(nb.is_multiple_of(SUB) && rb == nb / SUB * block_bytes(FMT) && xs.len() >= N * nb);
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
