//! The CPU llama backend against itself: taps, batch and chunking invariance, SIMD vs portable,
//! GGML RoPE order, bad steps, KV images moved between blocks.

use super::*;
use crate::model::synthetic::{tiny_llama_config, SyntheticWeights};
use crate::model::DType;

fn backend(cfg: &LlamaConfig, dtype: DType, blocks: usize) -> CpuBackend {
    let w = SyntheticWeights::new(cfg, dtype, 11);
    CpuBackend::new(
        cfg,
        &w,
        CpuOptions {
            threads: 2,
            kv: KvGeometry { block_size: 4, num_blocks: blocks, state_slots: 1 },
            kv_precision: None,
        },
    )
    .unwrap()
}

fn seq_ids(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + salt * 101 + 5) % 256).collect()
}

/// Score `ids` alone in one chunk, using blocks `table`.
fn alone(b: &mut CpuBackend, ids: &[u32], table: &[u32]) -> Vec<f32> {
    b.forward(&[SeqStep { tokens: ids, start_pos: 0, block_table: table, logits_rows: ids.len(), state_slot: 0 }])
        .unwrap()
        .data
}

/// The final norm and output head of `b` applied to hidden rows `x`.
fn head_of(b: &mut CpuBackend, x: &[f32]) -> Vec<f32> {
    let h = b.cfg.hidden_size;
    let m = x.len() / h;
    let mut xs = x.to_vec();
    rms_norm_rows(&mut xs, &b.final_norm, b.cfg.rms_norm_eps);
    let head = b.lm_head.as_ref().unwrap_or(&b.embed);
    let mut out = vec![0f32; m * head.rows];
    head.forward(&xs, m, &mut out, &mut b.scratch, b.simd).unwrap();
    out
}

#[test]
fn tapped_states_are_the_layer_outputs_a_separate_run_computes() {
    let cfg = tiny_llama_config();
    let w = SyntheticWeights::new(&cfg, DType::F32, 11);
    let opts =
        CpuOptions { threads: 2, kv: KvGeometry { block_size: 4, num_blocks: 16, state_slots: 1 }, kv_precision: None };
    let mut full = CpuBackend::new(&cfg, &w, opts).unwrap();
    // The same weights cut after layer 0: its last hidden state is layer 0's output.
    let cut_cfg = LlamaConfig { num_hidden_layers: 1, ..cfg.clone() };
    let mut cut = CpuBackend::new(&cut_cfg, &w, opts).unwrap();
    assert!(full.set_hidden_taps(&[2]).unwrap_err().to_string().contains("has 2 layers"));
    full.set_hidden_taps(&[1, 0]).unwrap();
    let (a, b) = (seq_ids(7, 1), seq_ids(3, 2));
    let batch = [
        SeqStep { tokens: &a, start_pos: 0, block_table: &[0, 1], logits_rows: 7, state_slot: 0 },
        SeqStep { tokens: &b, start_pos: 0, block_table: &[4], logits_rows: 3, state_slot: 0 },
    ];
    let logits = full.forward(&batch).unwrap();
    let taps = full.take_hidden_taps().expect("taps were asked for");
    assert!(full.take_hidden_taps().is_none(), "taking them leaves nothing");
    assert_eq!((taps.layers.clone(), taps.hidden, taps.offsets.clone()), (vec![1, 0], 64, vec![0, 7, 10]));
    let h = cfg.hidden_size;
    let column = |rows: &[f32], col: usize| -> Vec<f32> {
        rows.chunks_exact(2 * h).flat_map(|r| r[col * h..(col + 1) * h].to_vec()).collect()
    };
    // Layer 1 is the last: the model's own logits are its head over that tap.
    assert_eq!(head_of(&mut full, &column(&taps.data, 0)), logits.data);
    // Layer 0: the one-layer model's logits (each sequence run alone) are its head over that tap.
    for (i, (ids, table)) in [(&a, &[8u32, 9][..]), (&b, &[12][..])].into_iter().enumerate() {
        let alone = alone(&mut cut, ids, table);
        assert_eq!(head_of(&mut cut, &column(taps.seq_rows(i, 0, ids.len()), 1)), alone, "sequence {i}");
    }
    // Without taps nothing is recorded.
    full.set_hidden_taps(&[]).unwrap();
    full.forward(&batch[1..]).unwrap();
    assert!(full.take_hidden_taps().is_none());
}

#[test]
fn logits_do_not_depend_on_batch_company_or_chunking() {
    let mut cfgs = vec![tiny_llama_config()];
    let mut qwen3 = tiny_llama_config();
    qwen3.qk_norm = true;
    qwen3.attention_qkv_bias = true;
    qwen3.sliding_window = Some(5);
    cfgs.push(qwen3);
    // GGUF models: GGML-style RoPE and q/k in GGML's pair order.
    let mut ggml = tiny_llama_config();
    ggml.rope_ggml_style = true;
    cfgs.push(ggml);
    cfgs.push(k_quant_config());
    for cfg in &cfgs {
        for dtype in dtypes_for(cfg) {
            let mut b = backend(cfg, dtype, 32);
            let a_ids = seq_ids(11, 1);
            let b_ids = seq_ids(7, 2);
            let (ta, tb): (Vec<u32>, Vec<u32>) = ((0..4).collect(), (10..14).rev().collect());
            let solo = alone(&mut b, &a_ids, &ta);
            // Same sequence, different blocks, prefilled in chunks of 3 while another sequence
            // decodes token by token in the same steps.
            let ta2: Vec<u32> = (20..24).collect();
            let mut mixed = Vec::new();
            for (ci, chunk) in a_ids.chunks(3).enumerate() {
                // The other sequence decodes its token `ci` in step `ci`.
                let other = &b_ids[ci..ci + 1];
                let out = b
                    .forward(&[
                        SeqStep { tokens: other, start_pos: ci, block_table: &tb, logits_rows: 1, state_slot: 1 },
                        SeqStep {
                            tokens: chunk,
                            start_pos: ci * 3,
                            block_table: &ta2,
                            logits_rows: chunk.len(),
                            state_slot: 0,
                        },
                    ])
                    .unwrap();
                for r in out.rows(1) {
                    mixed.extend_from_slice(r);
                }
            }
            assert_eq!(solo.len(), mixed.len());
            let same = solo.iter().zip(&mixed).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{} {dtype}: batched/chunked logits differ from solo", cfg.model_type);
            // Decoding the last token alone after a prefill of the rest matches too.
            let ta3: Vec<u32> = (24..28).collect();
            alone(&mut b, &a_ids[..10], &ta3);
            let last = b
                .forward(&[SeqStep {
                    tokens: &a_ids[10..],
                    start_pos: 10,
                    block_table: &ta3,
                    logits_rows: 1,
                    state_slot: 0,
                }])
                .unwrap();
            let v = cfg.vocab_size;
            assert!(last.data.iter().zip(&solo[10 * v..]).all(|(x, y)| x.to_bits() == y.to_bits()));
        }
    }
}

#[test]
fn portable_and_simd_paths_give_identical_logits() {
    if !simd_available() {
        return;
    }
    let mut cfg = tiny_llama_config();
    cfg.rope_ggml_style = true;
    for cfg in [cfg, k_quant_config()] {
        for dtype in dtypes_for(&cfg) {
            let (mut a, mut b) = (backend(&cfg, dtype, 4), backend(&cfg, dtype, 4));
            b.simd = false;
            let ids = seq_ids(13, 3);
            let table: Vec<u32> = (0..4).collect();
            let (x, y) = (alone(&mut a, &ids, &table), alone(&mut b, &ids, &table));
            assert!(x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()), "{dtype}");
        }
    }
}

/// A GGUF-style model whose every matrix width is a multiple of 256, as K-quants need.
fn k_quant_config() -> LlamaConfig {
    let mut cfg = tiny_llama_config();
    (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.rope_ggml_style) = (256, 256, 64, true);
    cfg
}

/// The weight formats a test config can be stored in.
fn dtypes_for(cfg: &LlamaConfig) -> Vec<DType> {
    if cfg.hidden_size.is_multiple_of(256) {
        vec![DType::Q4_K, DType::Q5_K, DType::Q6_K]
    } else {
        vec![DType::F32, DType::Q8_0, DType::Q4_1, DType::Q4_0]
    }
}

#[test]
fn ggml_rope_is_the_same_rotation_in_pair_order() {
    let mut cfg = tiny_llama_config();
    let plain = RopeAngles::new(&cfg);
    cfg.rope_ggml_style = true;
    let ggml = RopeAngles::new(&cfg);
    let half = cfg.head_dim / 2;
    let (mut c1, mut s1, mut c2, mut s2) = (vec![0f32; half], vec![0f32; half], vec![0f32; half], vec![0f32; half]);
    let x: Vec<f32> = (0..cfg.head_dim).map(|i| (i as f32 * 0.37).sin()).collect();
    for pos in [0usize, 1, 7, 100, 1000] {
        plain.fill(pos, &mut c1, &mut s1);
        ggml.fill(pos, &mut c2, &mut s2);
        let (mut a, mut b) = (x.clone(), x.clone());
        rope(&mut a, &c1, &s1);
        let mut tmp = vec![0f32; cfg.head_dim];
        rope_ggml_interleaved(&mut b, &c2, &s2, &mut tmp, simd_available());
        for i in 0..half {
            // Angles agree to f32 rounding of θ (relative 1e-7 of pos · freq).
            let tol = 1e-6 * (1.0 + pos as f32);
            assert!((a[i] - b[2 * i]).abs() < tol && (a[i + half] - b[2 * i + 1]).abs() < tol, "pos {pos} pair {i}");
        }
    }
}

#[test]
fn bad_steps_are_rejected_with_reasons() {
    let cfg = tiny_llama_config();
    let mut b = backend(&cfg, DType::F32, 2);
    let e =
        b.forward(&[SeqStep { tokens: &[1; 9], start_pos: 0, block_table: &[0, 1], logits_rows: 1, state_slot: 0 }]);
    assert!(e.unwrap_err().to_string().contains("need 3"));
    let e = b.forward(&[SeqStep { tokens: &[300], start_pos: 0, block_table: &[0], logits_rows: 1, state_slot: 0 }]);
    assert!(e.unwrap_err().to_string().contains("outside the vocabulary"));
    let e = b.forward(&[SeqStep { tokens: &[1], start_pos: 0, block_table: &[7], logits_rows: 1, state_slot: 0 }]);
    assert!(e.unwrap_err().to_string().contains("block 7"));
}

#[test]
fn kv_image_moved_to_other_blocks_continues_bitwise() {
    for precision in [KvPrecision::F32, KvPrecision::F16] {
        let cfg = tiny_llama_config();
        let w = SyntheticWeights::new(&cfg, DType::Q8_0, 11);
        let kv = KvGeometry { block_size: 4, num_blocks: 16, state_slots: 1 };
        let mut b = CpuBackend::new(&cfg, &w, CpuOptions { threads: 2, kv, kv_precision: Some(precision) }).unwrap();
        let ids = seq_ids(12, 3);
        let (prefix, next) = (&ids[..8], &ids[8..]);
        let step = |b: &mut CpuBackend, toks: &[u32], start: usize, table: &[u32]| {
            let s =
                SeqStep { tokens: toks, start_pos: start, block_table: table, logits_rows: toks.len(), state_slot: 0 };
            b.forward(&[s]).unwrap().data
        };
        let (from, to): (Vec<u32>, Vec<u32>) = (vec![0, 1, 2], vec![9, 5, 11]);
        step(&mut b, prefix, 0, &from);
        let image = b.read_kv_blocks(&from[..2]).unwrap();
        assert_eq!(image.len(), 2 * b.kv_block_bytes());
        b.write_kv_blocks(&to[..2], &image).unwrap();
        let fresh = step(&mut b, next, 8, &from);
        let moved = step(&mut b, next, 8, &to);
        assert_eq!(fresh, moved, "{precision:?}");
        let e = b.write_kv_blocks(&to[..1], &image).unwrap_err().to_string();
        assert!(e.contains("need"), "{e}");
        assert!(b.read_kv_blocks(&[99]).unwrap_err().to_string().contains("block 99"));
    }
}
