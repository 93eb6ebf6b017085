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

mod packed_formats {
    use super::super::packed::*;
    use super::lcg;

    const FORMATS: [PackedFormat; 5] = [
        PackedFormat::Fp8Block,
        PackedFormat::Int4 { group: 128 },
        PackedFormat::Int4 { group: 64 },
        PackedFormat::Int4 { group: 32 },
        PackedFormat::Nvfp4,
    ];

    /// Arbitrary codes and scales (every code value, extreme scales included), not just what
    /// a quantizer would pick.
    fn random_rows(format: PackedFormat, rows: usize, cols: usize, seed: &mut u64) -> PackedRows {
        let groups = cols / format.group();
        let byte = |s: &mut u64| ((lcg(s) + 1.0) * 127.99) as u8;
        let mut codes: Vec<u8> = (0..rows * format.code_bytes(cols)).map(|_| byte(seed)).collect();
        if format == PackedFormat::Fp8Block {
            codes.iter_mut().filter(|b| e4m3_is_nan(**b)).for_each(|b| *b &= 0xFE);
        }
        let scales = if format == PackedFormat::Nvfp4 {
            Vec::new()
        } else {
            (0..rows * groups).map(|_| (lcg(seed) * 4.0).exp2() * 0.01).collect()
        };
        let (scale_codes, row_global) = if format == PackedFormat::Nvfp4 {
            let sc = (0..rows * groups).map(|_| byte(seed) & 0x7E).collect();
            (sc, (0..rows).map(|_| 448.0 * 6.0 / (1.0 + lcg(seed).abs())).collect())
        } else {
            (Vec::new(), Vec::new())
        };
        PackedRows { format, rows, cols, codes, scales, scale_codes, row_global }
    }

    #[test]
    fn decode_tables_match_the_formats() {
        // e4m3fn: bias 7, 3 mantissa bits, subnormals, max 448.
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0xFE), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x3C), 1.5);
        assert!(e4m3_is_nan(0x7F) && e4m3_is_nan(0xFF) && !e4m3_is_nan(0x7E));
        // int4 q + 8 nibbles, low first; NVFP4 E2M1 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives.
        let int4 = PackedRows {
            format: PackedFormat::Int4 { group: 32 },
            rows: 1,
            cols: 32,
            codes: (0..16u8).map(|i| i | ((15 - i) << 4)).collect(),
            scales: vec![0.5],
            scale_codes: Vec::new(),
            row_global: Vec::new(),
        };
        let mut out = vec![0f32; 32];
        int4.dequantize_row(0, &mut out);
        assert_eq!(&out[..4], &[-4.0, 3.5, -3.5, 3.0]);
        let fp4 = PackedRows {
            format: PackedFormat::Nvfp4,
            rows: 1,
            cols: 16,
            codes: vec![0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE],
            scales: Vec::new(),
            scale_codes: vec![0x38],
            row_global: vec![4.0],
        };
        let mut out = vec![0f32; 16];
        fp4.dequantize_row(0, &mut out);
        let want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];
        assert_eq!(out, want.map(|v| v / 4.0));
    }

    /// Every format: the dot equals the f64 dot of the dequantized row closely, the AVX2 path
    /// equals the portable one bit for bit, and a row's result is the same computed alone or in
    /// a batch of any size (tiles of 1..4 and their remainders).
    #[test]
    fn packed_dots_match_dequantized_rows_on_every_path_and_batch_shape() {
        let mut seed = 11;
        let (rows, cols) = (5, 256);
        for format in FORMATS {
            let w = random_rows(format, rows, cols, &mut seed);
            let xs: Vec<f32> = (0..9 * cols).map(|_| lcg(&mut seed)).collect();
            let mut alone = vec![0f32; rows * 9];
            for j in 0..9 {
                let mut o = vec![0f32; rows];
                dot_packed_block(&w, 0..rows, &xs[j * cols..(j + 1) * cols], &mut o, 1, false);
                for r in 0..rows {
                    alone[r * 9 + j] = o[r];
                }
            }
            let dense = w.dequantize();
            for r in 0..rows {
                for j in 0..9 {
                    let x = &xs[j * cols..(j + 1) * cols];
                    let reference: f64 =
                        dense[r * cols..(r + 1) * cols].iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let magnitude: f64 =
                        dense[r * cols..(r + 1) * cols].iter().zip(x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                    let got = alone[r * 9 + j] as f64;
                    assert!((got - reference).abs() <= 1e-4 * magnitude.max(1e-30), "{format:?}: {got} vs {reference}");
                }
            }
            let paths = if crate::model::quant::simd_available() { vec![false, true] } else { vec![false] };
            for simd in paths {
                for n in 1..=9 {
                    let mut out = vec![0f32; rows * 9];
                    dot_packed_block(&w, 0..rows, &xs[..n * cols], &mut out, 9, simd);
                    for r in 0..rows {
                        for j in 0..n {
                            assert_eq!(
                                out[r * 9 + j].to_bits(),
                                alone[r * 9 + j].to_bits(),
                                "{format:?} simd {simd} batch {n}"
                            );
                        }
                    }
                }
                // A slice of rows computes the same values as the whole matrix.
                let mut part = vec![0f32; 2 * 9];
                dot_packed_block(&w, 2..4, &xs, &mut part, 9, simd);
                assert_eq!(part, alone[2 * 9..4 * 9], "{format:?} rows 2..4");
            }
        }
    }

    /// Cutting and stacking rows and group-aligned columns keeps codes and scales together.
    #[test]
    fn packed_row_and_column_cuts_equal_cuts_of_the_dense_matrix() {
        let mut seed = 5;
        let (rows, cols) = (6, 256);
        for format in FORMATS {
            let w = random_rows(format, rows, cols, &mut seed);
            let dense = w.dequantize();
            assert_eq!(w.take_rows(2..5).dequantize(), dense[2 * cols..5 * cols], "{format:?}");
            let g = format.group();
            let c = w.take_cols(g..2 * g).unwrap();
            let want: Vec<f32> = dense.chunks_exact(cols).flat_map(|r| r[g..2 * g].iter().copied()).collect();
            assert_eq!(c.dequantize(), want, "{format:?}");
            assert!(w.take_cols(8..8 + g).is_none());
            let stacked = PackedRows::concat(vec![w.take_rows(0..2), w.take_rows(2..6)]).unwrap();
            assert_eq!(stacked.dequantize(), dense, "{format:?}");
        }
        let a = random_rows(PackedFormat::Fp8Block, 1, 128, &mut seed);
        let b = random_rows(PackedFormat::Nvfp4, 1, 128, &mut seed);
        assert!(PackedRows::concat(vec![a, b]).is_err());
    }

    /// The test quantizer round-trips within each format's step.
    #[test]
    fn round_to_nearest_packing_is_close() {
        let mut seed = 9;
        let (rows, cols) = (3, 256);
        let x: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
        for (format, tol) in
            [(PackedFormat::Fp8Block, 0.04), (PackedFormat::Int4 { group: 128 }, 0.08), (PackedFormat::Nvfp4, 0.2)]
        {
            let p = quantize_rows(format, rows, cols, &x);
            let err = p.dequantize().iter().zip(&x).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < tol, "{format:?}: {err}");
        }
    }
}
