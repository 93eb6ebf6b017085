//! `glm5_next` CPU step costs on a small synthetic config (hidden 256, KDA ×3 + DSA, 16 experts
//! top-4, seeded random weights): one decode step at context 512 and a 512-token prefill.
//! Throughput is printed in tokens/s by criterion (`Throughput::Elements`).

use std::path::Path;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use shelfserve::backend::{Backend, KvGeometry, SeqStep};
use shelfserve::model::glm5_next::layout::SyntheticGlm5Weights;
use shelfserve::model::glm5_next::{Glm5Backend, Glm5Config};

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
}

criterion_group!(benches, bench);
criterion_main!(benches);
