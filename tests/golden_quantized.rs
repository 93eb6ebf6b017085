//! Quantized safetensors checkpoints (FP8 128×128 blocks, compressed-tensors int4 and NVFP4) on
//! the CPU backend against transformers, on tiny random llama and glm5_next models that the real
//! tools quantized (`scripts/gen_quant_fixtures.py`; versions and per-fixture notes in
//! `tests/fixtures/quant/VERSIONS.txt`).
//!
//! The references (`golden.safetensors`, its `reference` metadata says which): transformers'
//! logits for the quantized checkpoint loaded on CPU (llama FP8 and int4: transformers
//! dequantizes at load with its own FineGrainedFP8 / compressed-tensors code) or, where
//! transformers cannot run or mis-loads the checkpoint on CPU (NVFP4; glm5 FP8), transformers'
//! forward of the weights the tool's own decompression computes, in f32.
//!
//! * logits: max |Δ| / max(|ref|, 1) < 1e-4 per position, as for the unquantized checkpoints:
//!   our kernels multiply exactly the weights the tools dequantize to (codes × scales are exact
//!   in f32 and equal to the tools' f32 products), so what remains is f32 summation order;
//! * greedy 24-token continuations identical to transformers' `generate(do_sample=False)`;
//! * token-by-token decoding reproduces one-chunk scoring bitwise (a row's result does not depend
//!   on how many rows are computed with it), and two tensor-parallel ranks stay within the bound;
//! * refusals: a scheme that is not served, and a module the config leaves unquantized but that is
//!   stored quantized, fail at load naming scheme and tensor.

mod common;

use common::{tensor_f32s as floats, tensor_ids as ints};
use shelfserve::backend::KvGeometry;
use shelfserve::generate::{any_cpu_backend_tp, Runner};
use shelfserve::model::default_model::CacheDir;
use shelfserve::model::{ModelBundle, ModelError};

const FIXTURES: [&str; 6] = ["llama-fp8", "llama-int4", "llama-nvfp4", "glm5-fp8", "glm5-int4", "glm5-nvfp4"];
const MAX_REL_ERR: f32 = 1e-4;

/// KV blocks of 4 so the prompts cross block boundaries.
const GEOM: KvGeometry = KvGeometry { block_size: 4, num_blocks: 32, state_slots: 1 };

fn open(dir: &std::path::Path) -> Result<ModelBundle, ModelError> {
    shelfserve::model::open(dir.to_str().unwrap(), &CacheDir::from_env())
}

#[test]
fn quantized_checkpoints_match_transformers() {
    let mut failures = Vec::new();
    println!("{:<12} {:>3} {:>6} {:>12} {:>12} {:>7}", "fixture", "tp", "prompt", "max rel err", "mean kld", "greedy");
    for name in FIXTURES {
        let dir = common::fixture(&format!("quant/{name}"));
        let bundle = open(&dir).unwrap();
        let format = bundle.weights.quantization().expect("a quantized checkpoint").format();
        let bytes = std::fs::read(dir.join("golden.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let vocab = bundle.config.vocab_size;
        for tp in [1, 2] {
            let (backend, _) = any_cpu_backend_tp(&bundle, 2, tp, GEOM).unwrap();
            let mut runner = Runner::new(backend);
            for i in 0..2 {
                let ids = ints(&st, &format!("ids_{i}"));
                let reference = floats(&st, &format!("logits_{i}"));
                // Chunks of 7 cross KV blocks (4) at different offsets.
                let ours = runner.score(&ids, 7).unwrap();
                let report = shelfserve::fidelity::compare(&reference, &ours, vocab);
                let expected = ints(&st, &format!("greedy_{i}"));
                let opts = common::greedy_options(expected.len(), 3);
                let got = runner.generate(&ids, &opts, |_| true).unwrap().ids();
                println!(
                    "{name:<12} {tp:>3} {i:>6} {:>12.3e} {:>12.3e} {:>7}",
                    report.max_rel_logit_err,
                    report.mean_kld,
                    got == expected
                );
                if report.max_rel_logit_err >= MAX_REL_ERR {
                    failures.push(format!(
                        "{name} ({}) tp {tp} prompt {i}: max relative logit error {:.3e}",
                        format.name(),
                        report.max_rel_logit_err
                    ));
                }
                if got != expected {
                    failures.push(format!("{name} tp {tp} prompt {i}: greedy ours {got:?} transformers {expected:?}"));
                }
                if tp > 1 {
                    continue;
                }
                // Decoding one token at a time reproduces scoring the whole sequence at once.
                let mut full = ids.clone();
                full.extend(&got);
                let forced = runner.score(&full, 512).unwrap();
                for n in ids.len() - 2..=ids.len() + 3 {
                    let logits = runner.score(&full[..n], 1).unwrap();
                    let (a, b) = (&logits[(n - 1) * vocab..], &forced[(n - 1) * vocab..n * vocab]);
                    if !a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()) {
                        failures.push(format!(
                            "{name} prompt {i}: position {n} differs between 1-token and batched scoring"
                        ));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A copy of fixture `name` with its config rewritten by `edit`.
fn edited_fixture(name: &str, edit: impl Fn(&mut serde_json::Value)) -> tempfile::TempDir {
    let src = common::fixture(&format!("quant/{name}"));
    let dir = tempfile::tempdir().unwrap();
    for f in ["model.safetensors", "config.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let path = dir.path().join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
    dir
}

/// Opens `dir` and builds a CPU backend on it; the first error as text.
fn load(dir: &std::path::Path) -> Result<(), String> {
    let bundle = open(dir).map_err(|e| e.to_string())?;
    any_cpu_backend_tp(&bundle, 1, 1, GEOM).map(drop).map_err(|e| e.to_string())
}

fn load_error(dir: &std::path::Path) -> String {
    match load(dir) {
        Err(e) => e,
        Ok(()) => panic!("{} loaded", dir.display()),
    }
}

#[test]
fn unserved_or_contradicting_quantization_is_refused_at_load() {
    // Activation quantization declared on the int4 checkpoint (a W4A8 scheme).
    let dir = edited_fixture("llama-int4", |c| {
        c["quantization_config"]["config_groups"]["group_0"]["input_activations"] =
            serde_json::json!({"num_bits": 8, "type": "int", "strategy": "token", "dynamic": true, "symmetric": true});
    });
    let e = load_error(dir.path());
    // The first tensor (by name) of a type the refused scheme would have explained.
    assert!(e.contains("compressed-tensors") && e.contains("input_activations"), "{e}");
    assert!(e.contains("`model.layers.0.mlp.down_proj.weight_packed` (I32"), "{e}");
    // Asymmetric int4 (it would need zero points the checkpoint does not have).
    let dir = edited_fixture("glm5-int4", |c| {
        c["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = false.into();
    });
    let e = load_error(dir.path());
    assert!(e.contains("symmetric false") && e.contains("asymmetric"), "{e}");
    // Another FP8 block size.
    let dir =
        edited_fixture("glm5-fp8", |c| c["quantization_config"]["weight_block_size"] = serde_json::json!([64, 64]));
    let e = load_error(dir.path());
    assert!(e.contains("weight_block_size [64,64]") && e.contains("model.safetensors"), "{e}");
    // The config says a module stays in full precision, but it is stored quantized.
    let dir = edited_fixture("llama-fp8", |c| {
        c["quantization_config"]["modules_to_not_convert"] =
            serde_json::json!(["lm_head", "model.layers.0.mlp.gate_proj"]);
    });
    let e = load_error(dir.path());
    assert!(e.contains("model.layers.0.mlp.gate_proj.weight") && e.contains("unquantized") && e.contains("FP8"), "{e}");
    let dir = edited_fixture("glm5-nvfp4", |c| {
        c["quantization_config"]["ignore"] =
            serde_json::json!(["lm_head", "model.language_model.layers.1.mlp.experts.2.up_proj"]);
    });
    let e = load_error(dir.path());
    assert!(e.contains("experts.2.up_proj") && e.contains("NVFP4"), "{e}");
}

#[test]
fn empty_sparsity_and_transform_configs_mean_none() {
    // compressed-tensors 0.19 writes both keys, empty, into every checkpoint it saves.
    let dir = edited_fixture("llama-int4", |c| {
        c["quantization_config"]["sparsity_config"] = serde_json::json!({});
        c["quantization_config"]["transform_config"] = serde_json::json!({});
    });
    load(dir.path()).unwrap();
    // A real sparsity scheme is still refused.
    let dir = edited_fixture("llama-int4", |c| {
        c["quantization_config"]["sparsity_config"] =
            serde_json::json!({"format": "sparse-24-bitmask", "sparsity_structure": "2:4", "targets": ["Linear"]});
    });
    let e = load_error(dir.path());
    assert!(e.contains("sparsity_config is not served"), "{e}");
}
