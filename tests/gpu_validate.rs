//! The CUDA backend against references on a real GPU (run by `scripts/gpu_validate.sh` on the
//! device machine; in CI these are ignored with the reason, never passed). References: the CPU
//! backend in f32 (itself golden-tested against transformers) and the transformers logits and
//! greedy continuations stored with the tiny HF fixtures. Tolerances: in the f32 mode the max
//! elementwise relative logit error (|Δ| / max(|a|, |b|, 1)) under 1e-4 and greedy continuations
//! identical; in bf16 the per-position relative L2 error ‖Δ‖ / ‖ref‖ under 1e-2 (the elementwise
//! maximum is printed too), and on the tiny fixtures, which bf16 storage alone moves 5-20 %,
//! within 1.25× of transformers' own bf16 error (`TRANSFORMERS_BF16_ERR`). Also reports, without
//! asserting, which exactness rules hold bitwise.

mod common;

use common::{tensor_f32s as floats, tensor_ids as ints};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use shelfserve::backend::cpu::{CpuBackend, CpuOptions, KvPrecision};
use shelfserve::backend::cuda::{CudaBackend, CudaOptions, Precision};
use shelfserve::backend::{Backend, KvGeometry, SeqStep};
use shelfserve::config::{LlamaConfig, RopeScaling};
use shelfserve::fidelity::{compare, max_rel_l2_err};
use shelfserve::generate::{single_sequence_geometry, Runner};
use shelfserve::model::default_model::CacheDir;
use shelfserve::model::synthetic::{tiny_llama_config, SyntheticWeights};
use shelfserve::model::{DType, WeightSource};

const NEEDS_GPU: &str = "needs a CUDA device; run scripts/gpu_validate.sh";

/// transformers' own bf16 error against its f32 goldens on each tiny fixture, by
/// `scripts/bf16_peer_error.py` (torch 2.x, transformers 5.x, CPU). These random-init models are
/// ill-conditioned: bf16 storage alone moves their logits 5-20 %, so there the bf16 mode must stay
/// within 1.25× of what transformers itself gets in bf16; the 1e-2 bound applies to the mid-size
/// config.
const TRANSFORMERS_BF16_ERR: &[(&str, f32)] = &[
    ("llama3-tiny", 0.2246),
    ("qwen2-tiny", 0.2095),
    ("qwen3-tiny", 0.09285),
    ("mistral-tiny", 0.2221),
    ("llama-tok", 0.05726),
];

/// The error a precision is held to: elementwise max relative error in f32, per-position
/// relative L2 error in bf16 (both reported).
fn held_error(p: Precision, reference: &[f32], ours: &[f32], vocab: usize) -> f32 {
    match p {
        Precision::F32 => compare(reference, ours, vocab).max_rel_logit_err,
        Precision::Bf16 => max_rel_l2_err(reference, ours, vocab),
    }
}

fn tiny_tol(name: &str, p: Precision) -> f32 {
    match p {
        Precision::F32 => tol(p),
        Precision::Bf16 => TRANSFORMERS_BF16_ERR.iter().find(|(n, _)| *n == name).map_or(tol(p), |&(_, e)| 1.25 * e),
    }
}

fn tol(p: Precision) -> f32 {
    match p {
        Precision::F32 => 1e-4,
        Precision::Bf16 => 1e-2,
    }
}

fn cpu(cfg: &LlamaConfig, w: &dyn WeightSource, kv: KvGeometry) -> CpuBackend {
    CpuBackend::new(cfg, w, CpuOptions { threads: 0, kv, kv_precision: Some(KvPrecision::F32) }).unwrap()
}

fn cuda(cfg: &LlamaConfig, w: &dyn WeightSource, kv: KvGeometry, precision: Precision) -> CudaBackend {
    CudaBackend::new(cfg, w, CudaOptions { ordinal: 0, kv, precision }).unwrap()
}

#[test]
#[ignore = "needs a CUDA device; run scripts/gpu_validate.sh"]
fn tiny_checkpoints_match_cpu_and_transformers() {
    let _ = NEEDS_GPU;
    let mut failures = Vec::new();
    println!(
        "{:<14} {:<5} {:>6} {:>12} {:>12} {:>8}  (bf16 bound: 1.25 × transformers' own bf16 error)",
        "model", "prec", "prompt", "rel vs cpu", "rel vs hf", "greedy"
    );
    for name in ["llama3-tiny", "qwen2-tiny", "qwen3-tiny", "mistral-tiny", "llama-tok"] {
        let dir = common::fixture(&format!("hf/{name}"));
        let bundle = shelfserve::model::open(dir.to_str().unwrap(), &CacheDir::from_env()).unwrap();
        let bytes = std::fs::read(dir.join("golden.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let (cfg, w) = (&bundle.config, bundle.weights.as_ref());
        let geom = single_sequence_geometry(128, 4);
        let mut reference = Runner::new(cpu(cfg, w, geom));
        for prec in [Precision::F32, Precision::Bf16] {
            let mut ours = Runner::new(cuda(cfg, w, geom, prec));
            for i in 0..3 {
                let ids = ints(&st, &format!("ids_{i}"));
                let got = ours.score(&ids, 7).unwrap();
                let want = reference.score(&ids, 7).unwrap();
                let rel_cpu = compare(&want, &got, cfg.vocab_size).max_rel_logit_err;
                let rel_hf = st
                    .tensor(&format!("logits_{i}"))
                    .ok()
                    .map(|_| compare(&floats(&st, &format!("logits_{i}")), &got, cfg.vocab_size).max_rel_logit_err);
                let expected = ints(&st, &format!("greedy_{i}"));
                let cont = ours.generate(&ids, &common::greedy_options(expected.len(), 3), |_| true).unwrap().ids();
                let same = cont == expected;
                println!(
                    "{:<14} {:<5} {:>6} {:>12.3e} {:>12} {:>8}",
                    name,
                    prec.suffix(),
                    ids.len(),
                    rel_cpu,
                    rel_hf.map_or("-".into(), |e| format!("{e:.3e}")),
                    same
                );
                for (what, e) in [("cpu", Some(rel_cpu)), ("transformers", rel_hf)] {
                    if let Some(e) = e.filter(|&e| e >= tiny_tol(name, prec) || e.is_nan()) {
                        failures.push(format!("{name} {prec:?} prompt {i}: rel err vs {what} {e:.3e}"));
                    }
                }
                if prec == Precision::F32 && !same {
                    failures.push(format!("{name} prompt {i}: greedy {cont:?}, transformers {expected:?}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A mid-size config: several layers, GQA 4:1, head 64, long enough prompts to split decode keys.
fn midsize() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 4096,
        hidden_size: 1024,
        intermediate_size: 2816,
        num_hidden_layers: 4,
        num_attention_heads: 16,
        num_key_value_heads: 4,
        head_dim: 64,
        max_position_embeddings: 8192,
        ..tiny_llama_config()
    }
}

fn variants() -> Vec<(&'static str, LlamaConfig)> {
    let mut ggml = midsize();
    ggml.rope_ggml_style = true;
    ggml.rope_scaling = Some(RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 256,
    });
    let mut qwen3 = midsize();
    qwen3.qk_norm = true;
    qwen3.attention_qkv_bias = true;
    qwen3.head_dim = 128;
    qwen3.num_key_value_heads = 2;
    qwen3.sliding_window = Some(100);
    vec![("llama", midsize()), ("ggml-rope-llama3", ggml), ("qknorm-bias-window", qwen3)]
}

#[test]
#[ignore = "needs a CUDA device; run scripts/gpu_validate.sh"]
fn midsize_synthetic_matches_cpu() {
    let mut failures = Vec::new();
    println!("{:<20} {:<5} {:>12} {:>12} {:>8}", "config", "prec", "max rel err", "rel L2", "greedy");
    for (name, cfg) in variants() {
        let w = SyntheticWeights::new(&cfg, DType::F32, 7);
        let geom = single_sequence_geometry(700, 16);
        let mut reference = Runner::new(cpu(&cfg, &w, geom));
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let ids: Vec<u32> = (0..600).map(|_| rng.random_range(0..cfg.vocab_size as u32)).collect();
        let want = reference.score(&ids, 128).unwrap();
        let want_cont = reference.generate(&ids, &common::greedy_options(24, 256), |_| true).unwrap().ids();
        for prec in [Precision::F32, Precision::Bf16] {
            let mut ours = Runner::new(cuda(&cfg, &w, geom, prec));
            let got = ours.score(&ids, 128).unwrap();
            let max_rel = compare(&want, &got, cfg.vocab_size).max_rel_logit_err;
            let l2 = max_rel_l2_err(&want, &got, cfg.vocab_size);
            let rel = held_error(prec, &want, &got, cfg.vocab_size);
            let cont = ours.generate(&ids, &common::greedy_options(24, 256), |_| true).unwrap().ids();
            println!("{:<20} {:<5} {:>12.3e} {:>12.3e} {:>8}", name, prec.suffix(), max_rel, l2, cont == want_cont);
            if rel >= tol(prec) || rel.is_nan() {
                failures.push(format!("{name} {prec:?}: rel err {rel:.3e}"));
            }
            if prec == Precision::F32 && cont != want_cont {
                failures.push(format!("{name}: greedy {cont:?} vs cpu {want_cont:?}"));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// One sequence's plan in a ragged schedule: its ids, its (shuffled) blocks, and how far it got.
struct Seq {
    ids: Vec<u32>,
    table: Vec<u32>,
    done: usize,
}

/// Run the same random ragged schedule (prefill chunks, decodes, multi-token verification) on
/// two backends and collect each sequence's logits rows in order.
fn ragged_run(
    backends: &mut [&mut dyn Backend],
    seed: u64,
    vocab: usize,
    blocks: usize,
    bs: usize,
) -> Vec<Vec<Vec<f32>>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut free: Vec<u32> = (0..blocks as u32).collect();
    free.shuffle(&mut rng);
    let mut seqs: Vec<Seq> = (0..6)
        .map(|_| {
            let n: usize = rng.random_range(20..400);
            let table = free.split_off(free.len() - n.div_ceil(bs));
            Seq { ids: (0..n).map(|_| rng.random_range(0..vocab as u32)).collect(), table, done: 0 }
        })
        .collect();
    let mut out: Vec<Vec<Vec<f32>>> = vec![vec![Vec::new(); seqs.len()]; backends.len()];
    while seqs.iter().any(|s| s.done < s.ids.len()) {
        let mut steps = Vec::new();
        let mut who = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            if s.done == s.ids.len() || rng.random_bool(0.3) {
                continue;
            }
            let n = match rng.random_range(0..3) {
                0 => 1,
                1 => rng.random_range(2..9),
                _ => rng.random_range(9..150),
            }
            .min(s.ids.len() - s.done);
            who.push((i, n));
            let logits_rows = rng.random_range(0..=n);
            steps.push((i, s.done, n, logits_rows));
        }
        let batch: Vec<SeqStep<'_>> = steps
            .iter()
            .map(|&(i, start, n, lr)| SeqStep {
                tokens: &seqs[i].ids[start..start + n],
                start_pos: start,
                block_table: &seqs[i].table,
                logits_rows: lr,
                state_slot: 0,
            })
            .collect();
        if batch.is_empty() {
            continue;
        }
        for (b, sink) in backends.iter_mut().zip(out.iter_mut()) {
            let r = b.forward(&batch).unwrap();
            for (k, &(i, ..)) in steps.iter().enumerate() {
                for row in r.rows(k) {
                    sink[i].extend_from_slice(row);
                }
            }
        }
        for (i, n) in who {
            seqs[i].done += n;
        }
    }
    out
}

#[test]
#[ignore = "needs a CUDA device; run scripts/gpu_validate.sh"]
fn paged_attention_on_random_ragged_batches_matches_the_naive_cpu_reference() {
    let mut failures = Vec::new();
    println!("{:<20} {:<5} {:<4} {:>6} {:>12}", "config", "prec", "attn", "rows", "held error");
    for (name, mut cfg) in variants() {
        cfg.num_hidden_layers = 2;
        let w = SyntheticWeights::new(&cfg, DType::F32, 9);
        let geom = KvGeometry { block_size: 16, num_blocks: 200, state_slots: 0 };
        for (prec, tensor_cores) in [(Precision::F32, false), (Precision::Bf16, false), (Precision::Bf16, true)] {
            let mut a = cpu(&cfg, &w, geom);
            let mut b = cuda(&cfg, &w, geom, prec);
            b.set_tensor_core_attention(tensor_cores);
            let out = ragged_run(&mut [&mut a, &mut b], 5, cfg.vocab_size, geom.num_blocks, geom.block_size);
            let (mut rows, mut worst) = (0, 0f32);
            for (x, y) in out[0].iter().zip(&out[1]) {
                rows += x.len() / cfg.vocab_size;
                if !x.is_empty() {
                    worst = worst.max(held_error(prec, x, y, cfg.vocab_size));
                }
            }
            let kernel = if tensor_cores { "mma" } else { "fma" };
            println!("{:<20} {:<5} {:<4} {:>6} {:>12.3e}", name, prec.suffix(), kernel, rows, worst);
            if worst >= tol(prec) || worst.is_nan() {
                failures.push(format!("{name} {prec:?}: rel err {worst:.3e}"));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

fn bitwise(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Decode logits of `ids[split..]` one token at a time after a prefill of `ids[..split]`.
fn decode_rows(b: &mut CudaBackend, ids: &[u32], split: usize, table: &[u32]) -> Vec<f32> {
    b.forward(&[SeqStep { tokens: &ids[..split], start_pos: 0, block_table: table, logits_rows: 0, state_slot: 0 }])
        .unwrap();
    let mut out = Vec::new();
    for p in split..ids.len() {
        out.extend(
            b.forward(&[SeqStep {
                tokens: &ids[p..p + 1],
                start_pos: p,
                block_table: table,
                logits_rows: 1,
                state_slot: 0,
            }])
            .unwrap()
            .data,
        );
    }
    out
}

#[test]
#[ignore = "needs a CUDA device; run scripts/gpu_validate.sh"]
fn exactness_rules_on_cuda_are_reported() {
    let cfg = midsize();
    let w = SyntheticWeights::new(&cfg, DType::F32, 21);
    let geom = KvGeometry { block_size: 16, num_blocks: 256, state_slots: 0 };
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let ids: Vec<u32> = (0..320).map(|_| rng.random_range(0..cfg.vocab_size as u32)).collect();
    let other: Vec<u32> = (0..320).map(|_| rng.random_range(0..cfg.vocab_size as u32)).collect();
    let (ta, tb, tc): (Vec<u32>, Vec<u32>, Vec<u32>) = ((0..20).collect(), (40..60).collect(), (80..100).collect());
    println!("{:<5} {:<44} {:>8} {:>12}", "prec", "rule", "bitwise", "max rel err");
    for prec in [Precision::F32, Precision::Bf16] {
        let mut b = cuda(&cfg, &w, geom, prec);
        let v = cfg.vocab_size;
        // Reference: prefill 300, decode 20 tokens one by one, alone.
        let solo = decode_rows(&mut b, &ids, 300, &ta);
        // Rule 3: the same decodes while another sequence prefills and decodes in the same steps.
        b.forward(&[
            SeqStep { tokens: &ids[..300], start_pos: 0, block_table: &tb, logits_rows: 0, state_slot: 0 },
            SeqStep { tokens: &other[..37], start_pos: 0, block_table: &tc, logits_rows: 1, state_slot: 0 },
        ])
        .unwrap();
        let mut concurrent = Vec::new();
        for p in 300..320 {
            let r = b
                .forward(&[
                    SeqStep {
                        tokens: &other[37 + p - 300..38 + p - 300],
                        start_pos: 37 + p - 300,
                        block_table: &tc,
                        logits_rows: 1,
                        state_slot: 0,
                    },
                    SeqStep { tokens: &ids[p..p + 1], start_pos: p, block_table: &tb, logits_rows: 1, state_slot: 0 },
                ])
                .unwrap();
            concurrent.extend_from_slice(r.last_row(1).unwrap());
        }
        // Rule 2: a resumed request: the first 256 positions come from an earlier prefill (a
        // prefix hit), the rest is prefilled on top, then the same decodes.
        b.forward(&[SeqStep { tokens: &ids[..256], start_pos: 0, block_table: &tc, logits_rows: 0, state_slot: 0 }])
            .unwrap();
        b.forward(&[SeqStep {
            tokens: &ids[256..300],
            start_pos: 256,
            block_table: &tc,
            logits_rows: 0,
            state_slot: 0,
        }])
        .unwrap();
        let mut resumed = Vec::new();
        for p in 300..320 {
            resumed.extend(
                b.forward(&[SeqStep {
                    tokens: &ids[p..p + 1],
                    start_pos: p,
                    block_table: &tc,
                    logits_rows: 1,
                    state_slot: 0,
                }])
                .unwrap()
                .data,
            );
        }
        // Rule 1: the 20 tokens verified in one step (as after a draft), logits for each.
        b.forward(&[SeqStep { tokens: &ids[..300], start_pos: 0, block_table: &tb, logits_rows: 0, state_slot: 0 }])
            .unwrap();
        let verified = b
            .forward(&[SeqStep {
                tokens: &ids[300..320],
                start_pos: 300,
                block_table: &tb,
                logits_rows: 20,
                state_slot: 0,
            }])
            .unwrap()
            .data;
        // The KV image round trip: copy ta's blocks elsewhere and decode from the copy.
        let image = b.read_kv_blocks(&ta).unwrap();
        b.write_kv_blocks(&tb, &image).unwrap();
        let restored = b
            .forward(&[SeqStep {
                tokens: &ids[319..320],
                start_pos: 319,
                block_table: &tb,
                logits_rows: 1,
                state_slot: 0,
            }])
            .unwrap()
            .data;
        let after_image = b
            .forward(&[SeqStep {
                tokens: &ids[319..320],
                start_pos: 319,
                block_table: &ta,
                logits_rows: 1,
                state_slot: 0,
            }])
            .unwrap()
            .data;
        // Decode steps replayed from captured CUDA graphs equal direct launches bitwise.
        b.set_cuda_graphs(false);
        let direct = decode_rows(&mut b, &ids, 300, &tc);
        b.set_cuda_graphs(true);
        let graphs_ok = bitwise(&solo, &direct);
        println!("{:<5} {:<44} {:>8}", prec.suffix(), "CUDA graph replay = direct launches", graphs_ok);
        assert!(graphs_ok, "{prec:?}: decode from CUDA graphs differs from direct launches");
        // Greedy on the device agrees with the host argmax of the same logits.
        let verify =
            [SeqStep { tokens: &ids[300..304], start_pos: 300, block_table: &ta, logits_rows: 4, state_slot: 0 }];
        let ids_dev = b.forward_greedy(&verify).unwrap();
        let same_step = b.forward(&verify).unwrap().data;
        let host: Vec<u32> = same_step
            .chunks_exact(v)
            .map(|r| r.iter().enumerate().fold((0, f32::MIN), |m, (i, &x)| if x > m.1 { (i, x) } else { m }).0 as u32)
            .collect();
        for (rule, got) in [
            ("3 concurrent = solo (decode beside prefill)", &concurrent),
            ("2 resumed (prefix hit) = fresh", &resumed),
            ("1 verified in one step = decoded one by one", &verified),
        ] {
            let rel = compare(&solo, got, v).max_rel_logit_err;
            println!("{:<5} {:<44} {:>8} {:>12.3e}", prec.suffix(), rule, bitwise(&solo, got), rel);
            assert!(rel < tol(prec), "{prec:?} rule {rule}: rel err {rel:.3e}");
        }
        let image_ok = bitwise(&restored, &after_image);
        println!("{:<5} {:<44} {:>8}", prec.suffix(), "KV image copy decodes like the original", image_ok);
        assert!(image_ok, "{prec:?}: decoding from a copied KV image differs");
        println!("{:<5} {:<44} {:>8}", prec.suffix(), "device greedy = host argmax", ids_dev == host);
        assert_eq!(ids_dev, host, "{prec:?}: device argmax differs from the host's");
    }
}
