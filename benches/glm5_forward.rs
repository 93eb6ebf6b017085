//! `glm5_next` CPU step costs on a small synthetic config (hidden 256, KDA ×3 + DSA, 16 experts
//! top-4, seeded random weights): one decode step at context 512 and a 512-token prefill.
//! Throughput is printed in tokens/s by criterion (`Throughput::Elements`).
//!
//! `f32_linear_512rows` times one f32 projection of the same model (256 → 512, the dense MLP's
//! gate/up shape) over 512 rows two ways in the same run: `CpuLinear::forward` (weight rows
//! shared by tiles of activation rows) and the one-dot-per-element loop it replaced, with the
//! same split over threads (without the final transpose, so the old loop is timed slightly in its
//! favour). Both give bitwise the same values (checked before timing).

use std::path::Path;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rayon::prelude::*;
use shelfserve::backend::cpu::glm5_next::Glm5Backend;
use shelfserve::backend::cpu::linear::{CpuLinear, LinearScratch, WeightRows};
use shelfserve::backend::{Backend, KvGeometry, SeqStep};
use shelfserve::model::glm5_next::layout::SyntheticGlm5Weights;
use shelfserve::model::glm5_next::Glm5Config;
use shelfserve::model::quant::{dot_f32, simd_available};

const CONFIG: &str = r#"{"model_type": "glm5_next", "vocab_size": 4096, "hidden_size": 256,
  "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 4,
  "layer_types": ["linear_attention", "linear_attention", "linear_attention", "deepseek_sparse_attention"],
  "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "num_attention_heads": 4,
  "num_key_value_heads": 4, "q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
  "v_head_dim": 32, "linear_num_heads": 4, "linear_head_dim": 32, "n_routed_experts": 16,
  "num_experts_per_tok": 4, "index_n_heads": 8, "index_head_dim": 32, "index_kpool": 16,
  "index_topk": 128}"#;

fn bench(c: &mut Criterion) {
    let cfg = Glm5Config::from_hf_json(CONFIG, Path::new("bench config")).unwrap();
    let w = SyntheticGlm5Weights::new(&cfg, 7);
    let block = 16;
    let geom = KvGeometry { block_size: block, num_blocks: 1040 / block + 1, state_slots: 2 };
    let mut be = Glm5Backend::new(cfg, &w, 0, geom).unwrap();
    let table: Vec<u32> = (0..geom.num_blocks as u32).collect();
    let prompt: Vec<u32> = (0..512u32).map(|i| (i * 7919) % 4096).collect();
    let step = |tokens, start_pos| SeqStep { tokens, start_pos, block_table: &table, logits_rows: 1, state_slot: 0 };
    be.forward(&[step(&prompt, 0)]).unwrap();
    let snapshot = be.read_state_slot(0).unwrap();
    let mut g = c.benchmark_group("glm5_cpu");
    g.throughput(Throughput::Elements(1));
    // Each iteration decodes position 512 from the same restored state (restore not timed).
    g.bench_function("decode_step_ctx512", |b| {
        b.iter_custom(|iters| {
            let mut total = std::time::Duration::ZERO;
            for _ in 0..iters {
                be.write_state_slot(0, &snapshot).unwrap();
                let t = std::time::Instant::now();
                be.forward(&[step(&[42], 512)]).unwrap();
                total += t.elapsed();
            }
            total
        })
    });
    g.throughput(Throughput::Elements(512));
    g.sample_size(10);
    g.bench_function("prefill_512", |b| b.iter(|| be.forward(&[step(&prompt, 0)]).unwrap()));
    g.finish();
    linear(c);
}

/// The per-element loop `CpuLinear::forward` used for f32 weights before row tiles.
fn untiled(w: &[f32], rows: usize, cols: usize, x: &[f32], m: usize, yt: &mut [f32], simd: bool) {
    let chunk = (rows / (rayon::current_num_threads() * 4)).clamp(8, 256);
    yt.par_chunks_mut(chunk * m).enumerate().for_each(|(ci, out)| {
        for (j, o) in out.chunks_exact_mut(m).enumerate() {
            let wr = &w[(ci * chunk + j) * cols..(ci * chunk + j + 1) * cols];
            for (i, v) in o.iter_mut().enumerate() {
                *v = dot_f32(wr, &x[i * cols..(i + 1) * cols], simd);
            }
        }
    });
}

fn linear(c: &mut Criterion) {
    let (rows, cols, m) = (512usize, 256usize, 512usize);
    let simd = simd_available();
    let vals = |n: usize, seed: usize| {
        (0..n).map(|i| (((i + seed) * 7919) % 2003) as f32 / 1001.0 - 1.0).collect::<Vec<f32>>()
    };
    let w = vals(rows * cols, 1);
    let x = vals(m * cols, 2);
    let lin = CpuLinear { rows, cols, weight: WeightRows::F32(w.clone()), bias: None };
    let (mut y, mut yt, mut scratch) = (vec![0f32; m * rows], vec![0f32; m * rows], LinearScratch::default());
    lin.forward(&x, m, &mut y, &mut scratch, simd).unwrap();
    untiled(&w, rows, cols, &x, m, &mut yt, simd);
    for (i, yr) in y.chunks(rows).enumerate() {
        for (r, v) in yr.iter().enumerate() {
            assert_eq!(v.to_bits(), yt[r * m + i].to_bits(), "row {i}, output {r}");
        }
    }
    let mut g = c.benchmark_group("f32_linear_512rows");
    g.throughput(Throughput::Elements(m as u64));
    g.bench_function("tiled", |b| b.iter(|| lin.forward(&x, m, &mut y, &mut scratch, simd).unwrap()));
    g.bench_function("untiled", |b| b.iter(|| untiled(&w, rows, cols, &x, m, &mut yt, simd)));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
