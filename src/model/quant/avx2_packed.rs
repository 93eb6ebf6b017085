//! AVX2 twins of the group-scaled dots in `packed`: each group is decoded once per weight row
//! into an aligned buffer of exact f32 values and used for a tile of up to 4 activation rows,
//! each with its own accumulator and the scalar kernel's operation order (8-lane partial sums per
//! group, one scale FMA per group through [`fma_scaled`], [`hsum`] at the end), so results are
//! bit-identical to `packed::dot_scalar`.

use super::avx2::{fma_scaled, hsum};
use super::packed::{PackedFormat, E2M1_X2, MAX_GROUP};
use std::arch::x86_64::*;

#[repr(align(32))]
struct GroupBuf([f32; MAX_GROUP]);

/// `out[j]` = the row (`codes`, kernel `scales`) · activation row `j` of `xs` (rows of `cols`),
/// for `j < out.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_row(format: PackedFormat, codes: &[u8], scales: &[f32], xs: &[f32], cols: usize, out: &mut [f32]) {
    let n = out.len();
    debug_assert!(xs.len() >= n * cols && scales.len() * format.group() == cols);
    debug_assert!(codes.len() >= format.code_bytes(cols));
    let mut t = 0;
    while t < n {
        let (x, o) = (xs.as_ptr().add(t * cols), out.as_mut_ptr().add(t));
        match n - t {
            1 => tile::<1>(format, codes, scales, x, cols, o),
            2 => tile::<2>(format, codes, scales, x, cols, o),
            3 => tile::<3>(format, codes, scales, x, cols, o),
            _ => tile::<4>(format, codes, scales, x, cols, o),
        }
        t += 4;
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const N: usize>(
    format: PackedFormat,
    codes: &[u8],
    scales: &[f32],
    x: *const f32,
    cols: usize,
    out: *mut f32,
) {
    let group = format.group();
    let mut w = GroupBuf([0.0; MAX_GROUP]);
    let mut acc = [_mm256_setzero_ps(); N];
    for (g, &s) in scales.iter().enumerate() {
        decode_group(format, codes.as_ptr(), g, &mut w);
        let base = g * group;
        for (j, a) in acc.iter_mut().enumerate() {
            let xj = x.add(j * cols + base);
            let mut p = _mm256_setzero_ps();
            let mut k = 0;
            while k < group {
                p = _mm256_fmadd_ps(_mm256_load_ps(w.0.as_ptr().add(k)), _mm256_loadu_ps(xj.add(k)), p);
                k += 8;
            }
            *a = fma_scaled(*a, s, p);
        }
    }
    for (j, a) in acc.iter().enumerate() {
        *out.add(j) = hsum(*a);
    }
}

/// 16 bytes of packed nibbles → their 32 nibbles in element order (low nibble of byte 0, high
/// nibble of byte 0, low of byte 1, ...), as two 16-byte halves.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn interleave_nibbles(v: __m128i) -> (__m128i, __m128i) {
    let m = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(v, m);
    let hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
    (_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi))
}

/// 16 signed bytes → 16 f32 at `o` (32-byte aligned).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_i8x16(v: __m128i, o: *mut f32) {
    _mm256_store_ps(o, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
    _mm256_store_ps(o.add(8), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))));
}

/// Group `g` of the row at `codes`, decoded as `packed::decode_group` does.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_group(format: PackedFormat, codes: *const u8, g: usize, out: &mut GroupBuf) {
    let o = out.0.as_mut_ptr();
    match format {
        PackedFormat::Fp8Block => {
            let p = codes.add(g * 128);
            let (sign_mask, mag_mask) = (_mm_set1_epi16(0x80), _mm_set1_epi16(0x7F));
            let mut k = 0;
            while k < 128 {
                let b = _mm_cvtepu8_epi16(_mm_loadl_epi64(p.add(k) as *const __m128i));
                let sign = _mm_slli_epi16(_mm_and_si128(b, sign_mask), 8);
                let mag = _mm_slli_epi16(_mm_and_si128(b, mag_mask), 7);
                _mm256_store_ps(o.add(k), _mm256_cvtph_ps(_mm_or_si128(sign, mag)));
                k += 8;
            }
        }
        PackedFormat::Int4 { group } => {
            let p = codes.add(g * group / 2);
            let eight = _mm_set1_epi8(8);
            let mut k = 0;
            while k < group {
                let (e0, e1) = interleave_nibbles(_mm_loadu_si128(p.add(k / 2) as *const __m128i));
                store_i8x16(_mm_sub_epi8(e0, eight), o.add(k));
                store_i8x16(_mm_sub_epi8(e1, eight), o.add(k + 16));
                k += 32;
            }
        }
        PackedFormat::Nvfp4 => {
            let (e0, _) = interleave_nibbles(_mm_loadl_epi64(codes.add(g * 8) as *const __m128i));
            let lut = _mm_loadu_si128(E2M1_X2.as_ptr() as *const __m128i);
            store_i8x16(_mm_shuffle_epi8(lut, e0), o);
        }
    }
}
