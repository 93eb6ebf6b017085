//! GLM-5.3-Flash (`glm5_next`) on the CPU backend against HF transformers (versions in
//! `tests/fixtures/glm5/VERSIONS.txt`), on a tiny random checkpoint that transformers saved
//! (`scripts/gen_glm5_tiny.py`): KDA layers, full- and shared-indexer DSA layers with a selection
//! that really drops pools (80-token prompt, 2-pool budget), dense and group-limited MoE layers.
//!
//! * logits: per row, max |Δ| / max |ref| < 1e-4 in f32 (also the `fidelity` metric,
//!   max |Δ| / max(|ref|, 1));
//! * greedy 24-token continuations identical to `generate(do_sample=False)` with HF's cache;
//! * exactness: chunked prefill, one-shot prefill and token-by-token decode give bitwise the
//!   same logits; a sequence's logits do not depend on its batch company; moving its KV blocks
//!   and recurrent-state slot elsewhere and continuing gives bitwise the same logits.

mod common;

use common::{tensor_f32s as floats, tensor_ids as ints};
use shelfserve::backend::cpu::glm5_next::Glm5Backend;
use shelfserve::backend::{Backend, KvGeometry, SeqStep};
use shelfserve::generate::{any_cpu_backend, DeviceSelection, Runner};
use shelfserve::model::default_model::CacheDir;
use shelfserve::model::glm5_next::read_config;
use shelfserve::model::ModelBundle;

fn open_tiny() -> ModelBundle {
    let dir = common::fixture("glm5/tiny");
    shelfserve::model::open(dir.to_str().unwrap(), &CacheDir::from_env()).unwrap()
}

fn backend(bundle: &ModelBundle, geom: KvGeometry) -> Glm5Backend {
    let cfg = read_config(bundle.weights.origin()).unwrap();
    Glm5Backend::new(cfg, bundle.weights.as_ref(), 2, geom).unwrap()
}

/// Largest per-row `max |Δ| / max |ref|`.
fn row_rel_err(reference: &[f32], ours: &[f32], vocab: usize) -> f32 {
    reference
        .chunks(vocab)
        .zip(ours.chunks(vocab))
        .map(|(a, b)| {
            let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
            a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
        })
        .fold(0f32, f32::max)
}

fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Checkpoints and their goldens: the `save_pretrained` on-disk format with a nested config, and a
/// flat text-only config in transformers' in-memory names (packed experts and conv), n_group 1,
/// the unbounded softplus forget gate.
const FIXTURES: [(&str, &str); 2] =
    [("glm5/tiny", "glm5/golden.safetensors"), ("glm5/tiny-flat", "glm5/golden-flat.safetensors")];

#[test]
fn tiny_glm5_matches_transformers() {
    let mut failures = Vec::new();
    println!(
        "{:<16} {:>6} {:>12} {:>12} {:>12} {:>8}",
        "fixture", "prompt", "row rel err", "fidelity", "decode err", "greedy"
    );
    for (dir, golden) in FIXTURES {
        let bundle = shelfserve::model::open(common::fixture(dir).to_str().unwrap(), &CacheDir::from_env()).unwrap();
        assert_eq!(bundle.config.model_type, "glm5_next");
        let bytes = std::fs::read(common::fixture(golden)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let vocab = bundle.config.vocab_size;
        // Through the same dispatch the CLI and the server use.
        let geom = KvGeometry { block_size: 4, num_blocks: 32, state_slots: 1 };
        let mut runner = Runner::new(any_cpu_backend(&bundle, 2, geom).unwrap().0);
        for i in 0.. {
            if st.tensor(&format!("ids_{i}")).is_err() {
                break;
            }
            let ids = ints(&st, &format!("ids_{i}"));
            let reference = floats(&st, &format!("logits_{i}"));
            // Chunks of 7 cross block (4) and pool (4) boundaries at different offsets.
            let ours = runner.score(&ids, 7).unwrap();
            let rel = row_rel_err(&reference, &ours, vocab);
            let fid = shelfserve::fidelity::compare(&reference, &ours, vocab).max_rel_logit_err;
            let expected = ints(&st, &format!("greedy_{i}"));
            let opts = common::greedy_options(expected.len(), 5);
            let got = runner.generate(&ids, &opts, |_| true).unwrap().ids();
            // The logits `generate` saw at each step (HF: chunked KDA prefill, then the recurrent
            // KDA and latent-cache decode path) against our teacher-forced scoring.
            let mut full = ids.clone();
            full.extend(&expected);
            let forced = runner.score(&full, 512).unwrap();
            let gen_ref = floats(&st, &format!("greedy_logits_{i}"));
            let gen_rel = row_rel_err(&gen_ref, &forced[(ids.len() - 1) * vocab..(full.len() - 1) * vocab], vocab);
            println!(
                "{:<16} {:>6} {:>12.3e} {:>12.3e} {:>12.3e} {:>8}",
                dir,
                ids.len(),
                rel,
                fid,
                gen_rel,
                got == expected
            );
            if rel >= 1e-4 {
                failures.push(format!("{dir} prompt {i}: max row-relative logit error {rel:.3e}"));
            }
            if gen_rel >= 1e-4 {
                failures.push(format!("{dir} prompt {i}: decode-step logits max row-relative error {gen_rel:.3e}"));
            }
            if got != expected {
                failures.push(format!("{dir} prompt {i}: greedy ours {got:?} transformers {expected:?}"));
            }
            // One canonical computation: one-shot, chunked and token-by-token agree bitwise.
            for chunk in [1, 3, 4, 64] {
                if !bits_equal(&runner.score(&full, chunk).unwrap(), &forced) {
                    failures.push(format!("{dir} prompt {i}: chunk {chunk} scoring differs bitwise from one-shot"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Run `steps` (sequence index, tokens) in order; each sequence's positions and block tables
/// are tracked; returns every step's logits per sequence.
struct Driver {
    tables: Vec<Vec<u32>>,
    pos: Vec<usize>,
    slots: Vec<u32>,
}

impl Driver {
    fn step(&mut self, b: &mut dyn Backend, parts: &[(usize, &[u32])]) -> Vec<Vec<f32>> {
        let steps: Vec<SeqStep<'_>> = parts
            .iter()
            .map(|&(s, toks)| SeqStep {
                tokens: toks,
                start_pos: self.pos[s],
                block_table: &self.tables[s],
                logits_rows: toks.len(),
                state_slot: self.slots[s],
            })
            .collect();
        let out = b.forward(&steps).unwrap();
        for &(s, toks) in parts {
            self.pos[s] += toks.len();
        }
        (0..parts.len()).map(|i| out.rows(i).flatten().copied().collect()).collect()
    }
}

#[test]
fn batch_company_and_moves_do_not_change_logits() {
    let bundle = open_tiny();
    let bytes = std::fs::read(common::fixture("glm5/golden.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let a = ints(&st, "ids_0");
    let bseq = ints(&st, "ids_1");
    let geom = KvGeometry { block_size: 4, num_blocks: 64, state_slots: 3 };

    // Alone: sequence A in one chunk, in slot 0, blocks 0..
    let mut solo = backend(&bundle, geom);
    let mut d = Driver { tables: vec![(0..32).collect()], pos: vec![0], slots: vec![0] };
    let alone = d.step(&mut solo, &[(0, &a[..])]).remove(0);

    // In company: A (slot 2, blocks from the top down) interleaved with B (slot 0, even blocks),
    // in ragged chunks of different sizes and orders.
    let mut both = backend(&bundle, geom);
    let table_a: Vec<u32> = (0..32).map(|i| 63 - 2 * i).collect();
    let table_b: Vec<u32> = (0..32).map(|i| 2 * i).collect();
    let mut d = Driver { tables: vec![table_a, table_b], pos: vec![0, 0], slots: vec![2, 0] };
    let mut got = Vec::new();
    d.step(&mut both, &[(1, &bseq[..10])]);
    got.extend(d.step(&mut both, &[(0, &a[..13]), (1, &bseq[10..11])]).remove(0));
    got.extend(d.step(&mut both, &[(1, &bseq[11..30]), (0, &a[13..14])]).remove(1));
    let r = d.step(&mut both, &[(0, &a[14..60]), (1, &bseq[30..])]);
    got.extend(&r[0]);
    got.extend(d.step(&mut both, &[(0, &a[60..])]).remove(0));
    assert!(bits_equal(&alone, &got), "sequence A's logits depend on its batch company or chunking");

    // Move A's blocks and recurrent state to new places mid-sequence and continue there.
    let mut src = backend(&bundle, geom);
    let mut d = Driver { tables: vec![(0..32).collect()], pos: vec![0], slots: vec![1] };
    let mut moved = d.step(&mut src, &[(0, &a[..37])]).remove(0);
    let used = 37usize.div_ceil(4);
    let image = src.read_kv_blocks(&d.tables[0][..used]).unwrap();
    assert_eq!(image.len(), used * src.kv_block_bytes());
    let state = src.read_state_slot(1).unwrap();
    assert_eq!(state.len(), src.state_slot_bytes());
    let mut dst = backend(&bundle, geom);
    let new_table: Vec<u32> = (0..32).map(|i| 40 + (i % 24)).collect();
    dst.write_kv_blocks(&new_table[..used], &image).unwrap();
    dst.write_state_slot(2, &state).unwrap();
    let mut d2 = Driver { tables: vec![new_table], pos: vec![37], slots: vec![2] };
    moved.extend(d2.step(&mut dst, &[(0, &a[37..])]).remove(0));
    assert!(bits_equal(&alone, &moved), "continuing from moved KV blocks and state slot changed the logits");
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let bundle = open_tiny();
    let mut b = backend(&bundle, KvGeometry { block_size: 4, num_blocks: 4, state_slots: 1 });
    let table = [0u32, 1, 2, 3];
    let step = |tokens: &'static [u32], slot| SeqStep {
        tokens,
        start_pos: 0,
        block_table: &table,
        logits_rows: 1,
        state_slot: slot,
    };
    assert!(b.forward(&[step(&[1, 2], 1)]).unwrap_err().to_string().contains("slot"));
    assert!(b.forward(&[step(&[9999], 0)]).unwrap_err().to_string().contains("vocabulary"));
    assert!(b.write_state_slot(0, &[0u8; 3]).is_err());
    assert!(b.read_state_slot(5).is_err());
    // A step that does not continue the slot's state (another sequence's, or a fresh one) is
    // refused before anything is touched; a restored snapshot may continue anywhere.
    let cont = |tokens: &'static [u32], start_pos| SeqStep {
        tokens,
        start_pos,
        block_table: &table,
        logits_rows: 1,
        state_slot: 0,
    };
    assert!(b.forward(&[cont(&[3], 5)]).unwrap_err().to_string().contains("position"));
    b.forward(&[cont(&[1, 2, 3], 0)]).unwrap();
    let snapshot = b.read_state_slot(0).unwrap();
    assert!(b.forward(&[cont(&[4], 2)]).is_err());
    b.forward(&[cont(&[4], 3)]).unwrap();
    b.write_state_slot(0, &snapshot).unwrap();
    b.forward(&[cont(&[4], 3)]).unwrap();
}

#[test]
fn unexpected_tensors_are_named_and_vision_is_set_aside() {
    use safetensors::tensor::{Dtype, TensorView};
    let src = common::fixture("glm5/tiny");
    let data = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&data).unwrap();
    let extra = vec![0u8; 16];
    let mut tensors: Vec<(String, TensorView<'_>)> =
        st.tensors().into_iter().filter(|(n, _)| !n.contains("layers.4.mlp.gate.weight")).collect();
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    // Missing router weight: the error names the tensor and the file.
    safetensors::serialize_to_file(tensors.clone(), None, &dir.path().join("model.safetensors")).unwrap();
    let bundle = shelfserve::model::open(dir.path().to_str().unwrap(), &CacheDir::from_env()).unwrap();
    let cfg = read_config(dir.path()).unwrap();
    let geom = KvGeometry { block_size: 4, num_blocks: 4, state_slots: 1 };
    let err = Glm5Backend::new(cfg.clone(), bundle.weights.as_ref(), 1, geom).err().unwrap().to_string();
    assert!(
        err.contains("model.language_model.layers.4.mlp.gate.weight") && err.contains("model.safetensors"),
        "{err}"
    );
    // An unknown tensor is an error naming it; vision and MTP tensors are not.
    let all: Vec<(String, TensorView<'_>)> = st.tensors();
    tensors = all.clone();
    tensors.push((
        "model.language_model.layers.5.eh_proj.weight".into(),
        TensorView::new(Dtype::F32, vec![4], &extra).unwrap(),
    ));
    safetensors::serialize_to_file(tensors.clone(), None, &dir.path().join("model.safetensors")).unwrap();
    let bundle = shelfserve::model::open(dir.path().to_str().unwrap(), &CacheDir::from_env()).unwrap();
    assert!(
        Glm5Backend::new(cfg.clone(), bundle.weights.as_ref(), 1, geom).is_ok(),
        "MTP layer tensors must be set aside"
    );
    tensors.push((
        "model.language_model.layers.0.mystery.weight".into(),
        TensorView::new(Dtype::F32, vec![4], &extra).unwrap(),
    ));
    safetensors::serialize_to_file(tensors, None, &dir.path().join("model.safetensors")).unwrap();
    let bundle = shelfserve::model::open(dir.path().to_str().unwrap(), &CacheDir::from_env()).unwrap();
    let err = Glm5Backend::new(cfg, bundle.weights.as_ref(), 1, geom).err().unwrap().to_string();
    assert!(err.contains("mystery"), "{err}");
}

/// The serving path: `model::open` → engine (scheduler + executor actors) → the glm5 backend,
/// one greedy request by token ids, against transformers' continuation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_serves_glm5_by_token_ids() {
    use shelfserve::actors::{EngineOptions, GenerationRequest, InferenceEngine, StreamEvent};
    use shelfserve::config::engine::EngineConfig;
    let bytes = std::fs::read(common::fixture("glm5/golden.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (prompt, expected) = (ints(&st, "ids_0"), ints(&st, "greedy_0"));
    let mut cfg = EngineConfig::builtin();
    cfg.scheduler.kv_pool_tokens = 512;
    let lane = cfg.lanes[0].name.clone();
    let opts = EngineOptions {
        device: DeviceSelection { threads: 2, ..Default::default() },
        served_model_name: "glm5-tiny".into(),
    };
    let engine = common::engine::start_ready(open_tiny(), cfg, opts, std::time::Duration::from_secs(60)).await;
    let req = GenerationRequest::greedy_fixed_length(lane, prompt, expected.len());
    let mut events = engine.submit(req).unwrap();
    let mut got = Vec::new();
    while let Some(ev) = events.recv().await {
        match ev {
            StreamEvent::Delta { tokens, .. } => got.extend(tokens.iter().map(|t| t.id)),
            StreamEvent::Finished { .. } => break,
            StreamEvent::Error(e) => panic!("engine error: {e}"),
        }
    }
    assert_eq!(got, expected);
    engine.shutdown();
}

/// Our list of text tensors (names, shapes) is exactly what `save_pretrained` wrote, apart from
/// the vision tower.
#[test]
fn tensor_layout_matches_save_pretrained() {
    use shelfserve::model::glm5_next::layout::text_tensors;
    let bundle = open_tiny();
    let cfg = read_config(bundle.weights.origin()).unwrap();
    let mut ours: Vec<(String, Vec<usize>)> = text_tensors(&cfg).into_iter().map(|(n, s, _)| (n, s)).collect();
    ours.sort();
    let theirs: Vec<(String, Vec<usize>)> = bundle
        .weights
        .tensor_names()
        .into_iter()
        .filter(|n| !n.starts_with("model.visual."))
        .map(|n| {
            let shape = bundle.weights.tensor(&n).unwrap().shape.to_vec();
            (n, shape)
        })
        .collect();
    assert_eq!(ours, theirs);
}

/// The default layer schedule (KDA ×3 then DSA, first 3 MLPs dense) with 16-token pools spanning
/// several 4-token blocks and seeded random weights: chunked, one-shot and batched runs agree
/// bitwise past the point where the selection turns sparse (t ≥ 47).
#[test]
fn default_schedule_with_pools_across_blocks_is_exact() {
    use shelfserve::model::glm5_next::layout::SyntheticGlm5Weights;
    use shelfserve::model::glm5_next::Glm5Config;
    let json = r#"{"model_type": "glm5_next", "vocab_size": 300, "hidden_size": 48, "intermediate_size": 64,
      "moe_intermediate_size": 16, "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 2,
      "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "v_head_dim": 8, "linear_num_heads": 2,
      "linear_head_dim": 8, "n_routed_experts": 8, "num_experts_per_tok": 2, "index_n_heads": 4,
      "index_head_dim": 8, "index_kpool": 16, "index_topk": 32}"#;
    let cfg = Glm5Config::from_hf_json(json, std::path::Path::new("test config")).unwrap();
    let w = SyntheticGlm5Weights::new(&cfg, 3);
    let geom = KvGeometry { block_size: 4, num_blocks: 80, state_slots: 2 };
    let ids: Vec<u32> = (0..110u32).map(|i| (i * 37 + 11) % 300).collect();
    let other: Vec<u32> = (0..90u32).map(|i| (i * 53 + 5) % 300).collect();
    let mut one = Glm5Backend::new(cfg.clone(), &w, 2, geom).unwrap();
    let mut d = Driver { tables: vec![(0..40).collect()], pos: vec![0], slots: vec![0] };
    let alone = d.step(&mut one, &[(0, &ids[..])]).remove(0);
    assert!(alone.iter().all(|v| v.is_finite()));
    let mut mixed = Glm5Backend::new(cfg, &w, 2, geom).unwrap();
    let mut d =
        Driver { tables: vec![(40..80).rev().collect(), (0..40).collect()], pos: vec![0, 0], slots: vec![1, 0] };
    let mut got = Vec::new();
    let mut at = 0;
    for (k, len) in [5usize, 16, 1, 1, 30, 9, 48].into_iter().enumerate() {
        let o = k * 13 % 90;
        let r = d.step(&mut mixed, &[(1, &other[o..o + 1]), (0, &ids[at..at + len])]);
        got.extend(&r[1]);
        at += len;
    }
    assert_eq!(at, ids.len());
    assert!(bits_equal(&alone, &got), "chunking or batch company changed the logits");
}
