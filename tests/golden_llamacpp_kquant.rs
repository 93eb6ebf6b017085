//! GGUF K-quants against llama.cpp: a tiny llama (hidden 256, 2 layers, vocab 512) quantized by
//! llama.cpp's own quantizer to Q4_K_M (Q4_K + Q6_K tensors) and Q5_K_M (Q5_K + Q6_K), with
//! llama.cpp's logits for every prompt position and its 24-token greedy continuations
//! (`scripts/gen_llamacpp_kquant_golden.py`, llama-cpp-python 0.3.36 built for this x86 CPU:
//! AVX2 and AVX-512).
//!
//! Why a tolerance and not bit-exactness as for Q4_1: llama.cpp computes K-quant matmuls with
//! activations quantized to Q8_K (one f32 scale per 256 values) and, on x86, through its
//! repacked multi-row Q4_K kernels, whose summation order has no single-row equivalent. We keep
//! one activation format for every quantized matrix (Q8 blocks of 32, a finer scale than Q8_K).
//! The two engines therefore differ by llama.cpp's activation rounding, whose size was measured
//! before choosing the bounds: a numpy forward on the same dequantized weights (f16 K/V, exact
//! f32 activations) is at mean KL 1.0e-3–2.6e-3 and max |Δlogit| ≤ 0.49 from llama.cpp's logits,
//! and with our Q8 activations at 1.8e-3–3.5e-3 and ≤ 0.60, its top-1 differing only where the
//! top two are within 0.03 (logits have std ≈ 4 here). The engine itself, first run: Q4_K_M at
//! mean KL 2.4e-3–3.1e-3 and max |Δlogit| 0.39–0.57, Q5_K_M inside both; Q4_K_M's top-1 differs
//! at two positions where llama.cpp's token is 0.17 and 0.26 below ours (inside that per-logit
//! noise), hence [`NEAR_TIE`] 0.3. Required, per prompt:
//! - mean KL(llama.cpp ‖ ours) < [`MAX_MEAN_KL`] nats, max |Δlogit| < [`MAX_ABS_DIFF`];
//! - where the top-1 token differs, llama.cpp's token is within [`NEAR_TIE`] of our best logit;
//! - greedy: our 24 tokens equal llama.cpp's up to the first difference, and there llama.cpp's
//!   token is within [`NEAR_TIE`] of our choice.
//!
//! The files' tensor types are checked too, so the test cannot pass on a fallback format, and
//! one row per quantized type is decoded and compared with gguf-py's dequantizer (bit-exact when
//! measured: every K-quant tensor of both files).

mod common;

use shelfserve::fidelity::compare;
use shelfserve::generate::{cpu_backend, single_sequence_geometry, Runner};
use shelfserve::model::default_model::CacheDir;
use shelfserve::model::gguf::GgufFile;
use shelfserve::model::quant::dequantize_into;

const MAX_MEAN_KL: f64 = 1e-2;
const MAX_ABS_DIFF: f32 = 1.0;
const NEAR_TIE: f32 = 0.3;

/// How far `token`'s logit is below the best one in `row`, and its rank (0 = argmax).
fn gap_and_rank(row: &[f32], token: usize) -> (f32, usize) {
    let best = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let theirs = row[token];
    (best - theirs, row.iter().filter(|&&x| x > theirs).count())
}

fn ids_i32(st: &safetensors::SafeTensors<'_>, name: &str) -> Vec<u32> {
    let t = st.tensor(name).unwrap();
    t.data().chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32).collect()
}

fn check_mix(mix: &str, expect_types: &[&str]) {
    let golden: serde_json::Value =
        serde_json::from_slice(&std::fs::read(common::fixture("llamacpp_kquant/golden.json")).unwrap()).unwrap();
    let file = &golden["files"][mix];
    let types: Vec<&str> = file["tensor_types"].as_object().unwrap().values().map(|v| v.as_str().unwrap()).collect();
    for t in expect_types {
        assert!(types.contains(t), "{mix}: the fixture has no {t} tensor: {types:?}");
    }
    let gguf = common::fixture(&format!("llamacpp_kquant/{}", file["gguf"].as_str().unwrap()));

    // Block decoding alone: row 0 of one tensor per quantized type against gguf-py's decoder.
    let raw = GgufFile::open(&gguf).unwrap();
    let rows = file["dequantized_rows"].as_object().unwrap();
    let decoded: Vec<&str> = rows.values().map(|r| r["type"].as_str().unwrap()).collect();
    for t in expect_types {
        assert!(decoded.contains(t), "{mix}: no dequantized reference row for {t}");
    }
    for (name, r) in rows {
        let want: Vec<f32> = r["row0"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        let view = raw.tensor(name).unwrap();
        let row_bytes = view.dtype.storage_bytes(want.len()).unwrap();
        let mut got = vec![0f32; want.len()];
        dequantize_into(view.dtype, &view.data[..row_bytes], &mut got);
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs() / b.abs().max(1e-3)).fold(0f32, f32::max);
        assert!(worst < 1e-5, "{mix}: `{name}` ({}) row 0 differs from gguf-py's by {worst:e} (relative)", view.dtype);
    }
    let bundle = shelfserve::model::open(gguf.to_str().unwrap(), &CacheDir::from_env()).unwrap();
    let bytes =
        std::fs::read(common::fixture(&format!("llamacpp_kquant/{}", file["logits"].as_str().unwrap()))).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut runner = Runner::new(cpu_backend(&bundle, 2, single_sequence_geometry(128, 16)).unwrap());
    let mut failures = Vec::new();
    for (i, p) in file["prompts"].as_array().unwrap().iter().enumerate() {
        let ids = ids_i32(&st, &format!("ids_{i}"));
        let reference = common::tensor_f32s(&st, &format!("logits_{i}"));
        let vocab = reference.len() / ids.len();
        let ours = runner.score(&ids, 512).unwrap();
        let r = compare(&reference, &ours, vocab);
        println!("{mix} prompt {i} ({} positions): {r:?}", ids.len());
        if r.mean_kld >= MAX_MEAN_KL || r.max_abs_logit_diff >= MAX_ABS_DIFF {
            failures.push(format!("{mix} prompt {i}: logits too far from llama.cpp's: {r:?}"));
        }
        for (pos, (theirs, row)) in reference.chunks_exact(vocab).zip(ours.chunks_exact(vocab)).enumerate() {
            let top = theirs.iter().enumerate().fold(0, |b, (j, &v)| if v > theirs[b] { j } else { b });
            let (gap, rank) = gap_and_rank(row, top);
            if gap >= NEAR_TIE {
                failures.push(format!(
                    "{mix} prompt {i} position {pos}: llama.cpp's top token {top} is our rank {rank}, {gap} below our best"
                ));
            }
        }

        let expected: Vec<u32> =
            p["generated_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let opts = common::greedy_options(expected.len(), 512);
        let got = runner.generate(&ids, &opts, |_| true).unwrap().ids();
        if let Some(k) = got.iter().zip(&expected).position(|(a, b)| a != b) {
            let mut prefix = ids.clone();
            prefix.extend_from_slice(&expected[..k]);
            let logits = runner.score(&prefix, 512).unwrap();
            let row = &logits[(prefix.len() - 1) * vocab..];
            let (gap, rank) = gap_and_rank(row, expected[k] as usize);
            println!("{mix} prompt {i}: greedy differs at token {k}; llama.cpp's is our rank {rank}, {gap} below");
            if gap >= NEAR_TIE {
                failures.push(format!(
                    "{mix} prompt {i}: greedy differs at token {k} (ours {got:?}, llama.cpp {expected:?}), \
                     llama.cpp's token is our rank {rank}, {gap} below our choice"
                ));
            }
        } else {
            assert_eq!(got.len(), expected.len(), "{mix} prompt {i}: generation stopped early");
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn q4_k_m_matches_llama_cpp() {
    check_mix("Q4_K_M", &["Q4_K", "Q6_K"]);
}

#[test]
fn q5_k_m_matches_llama_cpp() {
    check_mix("Q5_K_M", &["Q5_K", "Q6_K"]);
}
