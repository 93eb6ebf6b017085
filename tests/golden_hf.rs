//! Our CPU backend against HF transformers (versions in `tests/fixtures/hf/VERSIONS.txt`) on tiny
//! random-init checkpoints that transformers saved (`scripts/gen_hf_tiny.py`): Llama 3 with llama3
//! RoPE scaling and tied embeddings, Qwen2 (qkv bias), Qwen3 (q/k norm, explicit head_dim,
//! sharded bf16), Mistral (sliding window shorter than the longest prompt), and a llama with a
//! real tokenizer. Per position, relative logit error < 1e-4 in f32 (max |Δ| / max(|ref|, 1));
//! 24-token greedy continuations identical to `generate(do_sample=False)`; and incremental
//! decoding equals teacher-forced scoring bitwise.

mod common;

use common::{tensor_f32s as floats, tensor_ids as ints};
use shelfserve::backend::cpu::{CpuBackend, CpuOptions, KvPrecision};
use shelfserve::generate::{single_sequence_geometry, Runner};
use shelfserve::model::default_model::CacheDir;

#[test]
fn tiny_checkpoints_match_transformers() {
    let mut failures = Vec::new();
    println!("{:<14} {:>6} {:>12} {:>8}", "model", "prompt", "max rel err", "greedy");
    for name in ["llama3-tiny", "qwen2-tiny", "qwen3-tiny", "mistral-tiny", "llama-tok"] {
        let dir = common::fixture(&format!("hf/{name}"));
        let bundle = shelfserve::model::open(dir.to_str().unwrap(), &CacheDir::from_env()).unwrap();
        let bytes = std::fs::read(dir.join("golden.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let opts =
            CpuOptions { threads: 2, kv: single_sequence_geometry(128, 4), kv_precision: Some(KvPrecision::F32) };
        let mut runner = Runner::new(CpuBackend::new(&bundle.config, bundle.weights.as_ref(), opts).unwrap());
        let vocab = bundle.config.vocab_size;
        for i in 0..3 {
            let ids = ints(&st, &format!("ids_{i}"));
            // Chunks of 7 exercise chunked prefill across block boundaries (block size 4).
            let ours = runner.score(&ids, 7).unwrap();
            // The 49152-vocab checkpoint stores logits for its first prompt only (size).
            let rel_err = if st.tensor(&format!("logits_{i}")).is_ok() {
                let reference = floats(&st, &format!("logits_{i}"));
                shelfserve::fidelity::compare(&reference, &ours, vocab).max_rel_logit_err
            } else {
                0.0
            };
            let expected = ints(&st, &format!("greedy_{i}"));
            let opts = common::greedy_options(expected.len(), 3);
            let got = runner.generate(&ids, &opts, |_| true).unwrap().ids();
            println!("{:<14} {:>6} {:>12.3e} {:>8}", name, ids.len(), rel_err, got == expected);
            if rel_err >= 1e-4 {
                failures.push(format!("{name} prompt {i}: max relative logit error {rel_err:.3e}"));
            }
            if got != expected {
                failures.push(format!("{name} prompt {i}: greedy ours {got:?} transformers {expected:?}"));
            }
            // Incremental decode of the greedy continuation must reproduce teacher-forced scoring
            // of prompt + continuation exactly (one canonical computation).
            let mut full = ids.clone();
            full.extend(&got);
            let forced = runner.score(&full, 512).unwrap();
            let mut stepwise = Vec::new();
            for n in 1..=full.len() {
                let logits = runner.score(&full[..n], 1).unwrap();
                stepwise.extend_from_slice(&logits[(n - 1) * vocab..]);
                if n > 6 {
                    break;
                }
            }
            let same = stepwise.iter().zip(&forced).all(|(a, b)| a.to_bits() == b.to_bits());
            if !same {
                failures.push(format!("{name} prompt {i}: token-by-token logits differ from one-chunk scoring"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
