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
    quantize_row_q8(&x, &mut xq, false);
    let xd: Vec<f32> = xq.iter().flat_map(|b| b.qs.iter().map(move |&q| q as f32 * b.d)).collect();
    for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q4_K, DType::Q5_K, DType::Q6_K] {
        let wq = quantize_weight(dtype, &w);
        assert_eq!(Some(wq.len()), dtype.storage_bytes(n), "{dtype}");
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
    xs.extend([-200.0, -150.0, -104.0, -88.0, 88.0, 89.0, 100.0, 200.0, f32::NEG_INFINITY, f32::INFINITY, 0.0, -0.0]);
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
    quantize_row_q8(&x, &mut q, false);
    assert_eq!(q[0].d, 0.0);
    assert!(q[0].qs.iter().all(|&v| v == 0));
    let x: Vec<f32> = (0..32).map(|i| i as f32 - 16.0).collect();
    quantize_row_q8(&x, &mut q, false);
    let back: f32 = q[0].qs.iter().map(|&v| v as f32 * q[0].d).sum();
    assert!((back - q[0].sum).abs() < 1e-2 * back.abs().max(1.0));
}

/// The AVX2 quantizer equals the portable one bit for bit, including halfway cases (values whose
/// scaled form is exactly k + 0.5, where round-half-to-even matters) and all-zero blocks.
#[test]
fn q8_row_quantization_simd_matches_scalar() {
    if !simd_available() {
        return;
    }
    let mut seed = 11;
    let mut x: Vec<f32> = (0..32 * 40).map(|_| 4.0 * lcg(&mut seed)).collect();
    // Block 1: amax 127 makes the multiplier exactly 1, so k + 0.5 inputs are exact ties.
    for (i, v) in x[32..64].iter_mut().enumerate() {
        *v = if i == 0 { 127.0 } else { (i as f32 - 16.0) + 0.5 };
    }
    x[64..96].fill(0.0);
    let (mut a, mut b) = (vec![BlockQ8::default(); 40], vec![BlockQ8::default(); 40]);
    quantize_row_q8(&x, &mut a, false);
    quantize_row_q8(&x, &mut b, true);
    for (i, (p, q)) in a.iter().zip(&b).enumerate() {
        assert_eq!(p.d.to_bits(), q.d.to_bits(), "block {i} scale");
        assert_eq!(p.sum.to_bits(), q.sum.to_bits(), "block {i} sum");
        assert_eq!(p.qs, q.qs, "block {i} values");
    }
    // The tie block rounded halves to even: 0.5 → 0, 1.5 → 2, -0.5 → -0.
    assert_eq!(&a[1].qs[15..19], &[0, 0, 2, 2]);
}

/// Blocks of weight rows × activation rows give, pair for pair, exactly the single-row dot, for
/// every format, number of weight rows (odd and even: rows go in pairs), tile remainder (1..=9
/// activation rows), output stride and path.
#[test]
fn tiled_dots_equal_single_row_dots_bitwise() {
    let mut seed = 21;
    let (wrows, xrows) = (5usize, 9usize);
    for (dtype, n) in [(DType::Q8_0, 192), (DType::Q4_0, 192), (DType::Q4_1, 192)]
        .into_iter()
        .chain([DType::Q4_K, DType::Q5_K, DType::Q6_K].map(|d| (d, 512)))
    {
        let nb = n / QK;
        let w: Vec<f32> = (0..wrows * n).map(|_| lcg(&mut seed)).collect();
        let x: Vec<f32> = (0..xrows * n).map(|_| 2.0 * lcg(&mut seed)).collect();
        let mut xq = vec![BlockQ8::default(); xrows * nb];
        quantize_row_q8(&x, &mut xq, false);
        let wq = quantize_weight(dtype, &w);
        let rb = wq.len() / wrows;
        let single = |r: usize, j: usize| dot_q(dtype, &wq[r * rb..(r + 1) * rb], &xq[j * nb..(j + 1) * nb], false);
        for wr in 1..=wrows {
            for m in 1..=xrows {
                for simd in [false, true] {
                    if simd && !simd_available() {
                        continue;
                    }
                    let stride = m + 2;
                    let mut out = vec![f32::NAN; wr * stride];
                    dot_q_block(dtype, &wq[..wr * rb], &xq[..m * nb], nb, &mut out, stride, simd);
                    for r in 0..wr {
                        for j in 0..m {
                            let (a, b) = (out[r * stride + j], single(r, j));
                            assert_eq!(a.to_bits(), b.to_bits(), "{dtype} rows={wr} m={m} ({r},{j}) simd={simd}");
                        }
                        assert!(out[r * stride + m].is_nan(), "wrote past the tile");
                    }
                }
            }
        }
    }
}

#[test]
fn f32_row_tiles_equal_single_dots_bitwise() {
    let mut seed = 11;
    for n in [1usize, 7, 8, 9, 64, 100, 577] {
        for rows in 0..=9 {
            let w: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
            let xs: Vec<f32> = (0..rows * n).map(|_| lcg(&mut seed)).collect();
            let want: Vec<u32> = xs.chunks(n).map(|x| dot_f32(&w, x, false).to_bits()).collect();
            for simd in [false, simd_available()] {
                let mut out = vec![f32::NAN; rows];
                dot_f32_rows(&w, &xs, &mut out, simd);
                let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got, want, "n {n}, rows {rows}, simd {simd}");
            }
        }
    }
}

/// K-quant super-blocks of arbitrary bytes (every code, 6-bit scale and min pattern, negative
/// Q6_K group scales, which llama.cpp's quantizer produces and our round-to-nearest one does
/// not), with finite f16 super-scales: the dot equals the f64 dot of the dequantized values,
/// and the AVX2 kernel equals the portable one bit for bit.
#[test]
fn k_quant_dots_of_arbitrary_blocks_match_dequantized_reference_on_every_path() {
    let mut seed = 0x5eed_u64;
    let mut byte = move || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 56) as u8
    };
    let n = 1024;
    let x: Vec<f32> = (0..n).map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0).collect();
    let mut xq = vec![BlockQ8::default(); n / QK];
    quantize_row_q8(&x, &mut xq, false);
    let xd: Vec<f32> = xq.iter().flat_map(|b| b.qs.iter().map(move |&q| q as f32 * b.d)).collect();
    for dtype in [DType::Q4_K, DType::Q5_K, DType::Q6_K] {
        let mut wq: Vec<u8> = (0..dtype.storage_bytes(n).unwrap()).map(|_| byte()).collect();
        for b in wq.chunks_exact_mut(dtype.block_bytes()) {
            let scales_at = if dtype == DType::Q6_K { vec![208] } else { vec![0, 2] };
            for (k, at) in scales_at.into_iter().enumerate() {
                let v = half::f16::from_f32(0.001 * (1 + (b[at] % 16) as usize + k) as f32);
                b[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        let mut wd = vec![0f32; n];
        dequantize_into(dtype, &wq, &mut wd);
        let reference: f64 = wd.iter().zip(&xd).map(|(&a, &b)| a as f64 * b as f64).sum();
        let scale: f64 = wd.iter().zip(&xd).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
        let s = dot_q(dtype, &wq, &xq, false);
        assert!((s as f64 - reference).abs() < 1e-5 * scale.max(1.0), "{dtype}: scalar {s} vs {reference}");
        if simd_available() {
            let v = dot_q(dtype, &wq, &xq, true);
            assert_eq!(v.to_bits(), s.to_bits(), "{dtype}: simd {v} vs scalar {s}");
        }
    }
}
