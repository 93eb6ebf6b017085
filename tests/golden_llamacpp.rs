//! Our CPU backend against llama.cpp (llama-cpp-python 0.3.36, AVX2 + FMA + F16C build) on the
//! same SmolLM2 Q4_1 GGUF: per-position logits for every prompt in `tests/fixtures/llamacpp/`,
//! and 40-token greedy continuations. Fixtures come from `scripts/gen_llamacpp_golden.py`.
//!
//! Logits: exact. For GGUF models the backend follows GGML's CPU arithmetic rounding for rounding
//! (Q8 activation blocks and GGML's AVX2 dot products, f16 KV cache, tinyBLAS f16 attention,
//! GGML's exp in softmax and SiLU, GGML's RoPE angle recurrence), so every prompt position's
//! logits, rounded to f16 as the fixture stores them, must equal the fixture bit for bit. The
//! looser summary criteria (mean KL < 2e-3 nats, max |Δlogit| < 0.5, top-1 agreement ≥ 0.95) are
//! still checked and printed, as a readable scale for any failure.
//!
//! Greedy: identical up to a near-tie, and why not all 40 tokens. The fixture's logits come from
//! llama.cpp's prefill (all prompt rows in one step), its continuations from its decode path (one
//! row per step). For a one-row step GGML swaps the attention matmuls from tinyBLAS (one 8-lane
//! accumulator) to `ggml_vec_dot_f16` (four), which rounds differently; on the same tokens the
//! two paths' logits differ by std ≈ 0.2 (max 1.6), and 8-bit re-quantization in every matmul
//! keeps such differences alive. Our exactness rules forbid a sequence's numbers from depending
//! on how it is batched, so we keep the batched arithmetic for every step. Measured on the six
//! prompts: llama.cpp itself, run with its batched kernel for every step (a second one-token
//! sequence in each decode step), produces exactly our 40 tokens for all six, but its decode-path
//! fixture differs from them at token 30 (english), 12 (non_ascii), 14 (numbers) and 9 (chat),
//! each time where our top two logits are within 0.03 of each other. So we require:
//! - strict: all 40 tokens identical to llama.cpp's continuation made on its batched kernel for
//!   every step (`generated_ids_batched_kernel`, from `scripts/gen_llamacpp_batched_greedy.py`);
//! - free-running: our tokens equal the fixture's up to the first difference, and at that
//!   difference the fixture's token is our runner-up, less than [`NEAR_TIE`] logits below our
//!   choice — a near-tie, 4× below the noise between llama.cpp's own two kernels;
//! - teacher-forced on the fixture's 40 tokens (so positions past a divergence are checked too):
//!   the fixture's token is our argmax at ≥ 90% of positions (measured 232 of 240: 37–40 per
//!   prompt) and everywhere within [`WITHIN_NOISE`] logits of our max (measured ≤ 0.47).

mod common;

use shelfserve::fidelity::compare;
use shelfserve::generate::{cpu_backend, single_sequence_geometry, Runner};
use shelfserve::model::default_model::CacheDir;
use shelfserve::model::{quant::dequantize_into, DType};

/// Largest top-2 logit margin at which a free-running greedy divergence is accepted.
const NEAR_TIE: f32 = 0.05;
/// Largest amount by which the fixture's teacher-forced token may trail our best logit.
const WITHIN_NOISE: f32 = 0.5;

fn load_logits(st: &safetensors::SafeTensors<'_>, i: usize) -> (Vec<u32>, Vec<u16>, Vec<f32>, usize) {
    let ids = st.tensor(&format!("ids_{i}")).unwrap();
    let ids: Vec<u32> = ids.data().chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32).collect();
    let l = st.tensor(&format!("logits_{i}")).unwrap();
    assert_eq!(l.dtype(), safetensors::Dtype::F16);
    let vocab = l.shape()[1];
    let bits: Vec<u16> = l.data().chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
    let mut logits = vec![0f32; l.shape()[0] * vocab];
    dequantize_into(DType::F16, l.data(), &mut logits);
    (ids, bits, logits, vocab)
}

/// Rank of `token` in `row` (0 = argmax) and how far its logit is below the max.
fn rank_and_gap(row: &[f32], token: u32) -> (usize, f32) {
    let v = row[token as usize];
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    (row.iter().filter(|&&x| x > v).count(), max - v)
}

#[test]
fn logits_and_greedy_match_llama_cpp() {
    let Some(gguf) = common::default_gguf() else { return };
    let bundle = shelfserve::model::open(gguf.to_str().unwrap(), &CacheDir::from_env()).unwrap();
    let bytes = std::fs::read(common::fixture("llamacpp/smollm2_logits.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let greedy: serde_json::Value =
        serde_json::from_slice(&std::fs::read(common::fixture("llamacpp/smollm2_greedy.json")).unwrap()).unwrap();
    let prompts = greedy["prompts"].as_array().unwrap();
    assert!(prompts.len() >= 5);
    let mut runner = Runner::new(cpu_backend(&bundle, 2, single_sequence_geometry(128, 16)).unwrap());
    println!(
        "{:<10} {:>3} {:>10} {:>10} {:>8} {:>5} {:>8} | {:>9} {:>8} {:>8} {:>9}",
        "prompt", "n", "mean KL", "max KL", "max|Δ|", "top1", "f16-eq", "greedy=", "margin", "forced=", "max gap"
    );
    let mut failures = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let name = p["name"].as_str().unwrap();
        let (ids, ref_bits, reference, vocab) = load_logits(&st, i);
        let prompt_ids: Vec<u32> =
            p["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(ids, prompt_ids, "{name}: fixture files disagree");

        // Logits, exact up to the fixture's f16 storage.
        let ours = runner.score(&ids, 512).unwrap();
        let r = compare(&reference, &ours, vocab);
        let exact = ours.iter().zip(&ref_bits).filter(|(o, &b)| half::f16::from_f32(**o).to_bits() == b).count();
        if r.mean_kld >= 2e-3 || r.max_abs_logit_diff >= 0.5 || r.top1_agreement < 0.95 || exact != ours.len() {
            failures.push(format!(
                "{name}: {} of {} logits differ from llama.cpp's after f16 rounding; {r:?}",
                ours.len() - exact,
                ours.len()
            ));
        }

        // Free-running greedy.
        let expected: Vec<u32> =
            p["generated_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let opts = common::greedy_options(expected.len(), 512);
        let got = runner.generate(&ids, &opts, |_| true).unwrap().ids();
        assert_eq!(got.len(), expected.len(), "{name}: generation stopped early");
        let first = got.iter().zip(&expected).position(|(a, b)| a != b);
        let mut margin = None;
        if let Some(k) = first {
            let mut prefix = ids.clone();
            prefix.extend_from_slice(&expected[..k]);
            let logits = runner.score(&prefix, 512).unwrap();
            let row = &logits[(prefix.len() - 1) * vocab..];
            let (rank, gap) = rank_and_gap(row, expected[k]);
            margin = Some(gap);
            if rank != 1 || gap >= NEAR_TIE {
                failures.push(format!(
                    "{name}: greedy differs at token {k} (ours {}, llama.cpp {}) where llama.cpp's token is our rank {rank}, \
                     {gap:.4} below our choice (near-tie limit {NEAR_TIE}): ours {got:?} llama.cpp {expected:?}",
                    got[k], expected[k]
                ));
            }
        }

        // Strict: llama.cpp run on its batched attention kernel for every step (the one kernel we
        // use; `scripts/gen_llamacpp_batched_greedy.py`) must give exactly our continuation.
        let batched: Vec<u32> = p["generated_ids_batched_kernel"]
            .as_array()
            .expect("fixture lacks generated_ids_batched_kernel: run scripts/gen_llamacpp_batched_greedy.py")
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        if got != batched {
            let k = got.iter().zip(&batched).position(|(a, b)| a != b);
            failures.push(format!(
                "{name}: greedy differs from llama.cpp's batched-kernel continuation at token {k:?}: ours {got:?} llama.cpp {batched:?}"
            ));
        }

        // Teacher-forced on llama.cpp's continuation.
        let mut forced = ids.clone();
        forced.extend_from_slice(&expected[..expected.len() - 1]);
        let logits = runner.score(&forced, 512).unwrap();
        let (mut agree, mut worst) = (0, 0f32);
        for (j, &tok) in expected.iter().enumerate() {
            let row = &logits[(ids.len() - 1 + j) * vocab..(ids.len() + j) * vocab];
            let (rank, gap) = rank_and_gap(row, tok);
            agree += usize::from(rank == 0);
            worst = worst.max(gap);
        }
        if (agree as f64) < 0.9 * expected.len() as f64 || worst >= WITHIN_NOISE {
            failures.push(format!(
                "{name}: teacher-forced, llama.cpp's token is our argmax at {agree} of {} positions, at worst {worst:.4} below it",
                expected.len()
            ));
        }
        println!(
            "{:<10} {:>3} {:>10.3e} {:>10.3e} {:>8.4} {:>5.3} {:>8.6} | {:>9} {:>8} {:>8} {:>9.4}",
            name,
            r.positions,
            r.mean_kld,
            r.max_kld,
            r.max_abs_logit_diff,
            r.top1_agreement,
            exact as f64 / ours.len() as f64,
            format!("{}/{}", first.unwrap_or(expected.len()), expected.len()),
            margin.map_or("-".to_string(), |m| format!("{m:.4}")),
            format!("{agree}/{}", expected.len()),
            worst
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
