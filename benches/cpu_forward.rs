//! CPU backend step costs on the default model (SmolLM2-135M Q4_1): one decode step at batch 1
//! and 8 (context 128), and a 256-token prefill. Uses the cached default model
//! (`SHELFSERVE_DEFAULT_GGUF` or the cache; fetched if needed). Throughput is printed in tokens/s
//! by criterion (`Throughput::Elements`).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use shelfserve::backend::{Backend, KvGeometry, SeqStep};
use shelfserve::generate::cpu_backend;
use shelfserve::model::default_model::{ensure_default, CacheDir};

fn bench(c: &mut Criterion) {
    let path = match std::env::var_os("SHELFSERVE_DEFAULT_GGUF") {
        Some(p) => p.into(),
        None => ensure_default(&CacheDir::from_env(), true).expect("default model"),
    };
    let bundle = shelfserve::model::open(path.to_str().unwrap(), &CacheDir::from_env()).unwrap();
    let block: usize = 16;
    let ctx: usize = 128;
    let blocks_per_seq = (ctx + 256 + 1).div_ceil(block);
    let mut be =
        cpu_backend(&bundle, 0, KvGeometry { block_size: block, num_blocks: 8 * blocks_per_seq, state_slots: 8 })
            .unwrap();
    let tables: Vec<Vec<u32>> =
        (0..8).map(|s| ((s * blocks_per_seq) as u32..((s + 1) * blocks_per_seq) as u32).collect()).collect();
    let prompt: Vec<u32> = (0..ctx as u32).map(|i| 100 + i * 7 % 5000).collect();
    for t in &tables {
        be.forward(&[SeqStep { tokens: &prompt, start_pos: 0, block_table: t, logits_rows: 1, state_slot: 0 }])
            .unwrap();
    }
    let mut g = c.benchmark_group("cpu_decode_step");
    for batch in [1usize, 8] {
        g.throughput(Throughput::Elements(batch as u64));
        g.bench_with_input(BenchmarkId::from_parameter(batch), &batch, |b, &batch| {
            b.iter(|| {
                // Re-decoding position `ctx` overwrites the same slot: the work is identical each time.
                let steps: Vec<SeqStep<'_>> = tables[..batch]
                    .iter()
                    .enumerate()
                    .map(|(i, t)| SeqStep {
                        tokens: &[42],
                        start_pos: ctx,
                        block_table: t,
                        logits_rows: 1,
                        state_slot: i as u32,
                    })
                    .collect();
                be.forward(&steps).unwrap()
            })
        });
    }
    g.finish();
    let mut g = c.benchmark_group("cpu_prefill");
    g.sample_size(10);
    let long: Vec<u32> = (0..256u32).map(|i| 200 + i * 13 % 9000).collect();
    g.throughput(Throughput::Elements(256));
    g.bench_function("256_tokens", |b| {
        b.iter(|| {
            be.forward(&[SeqStep {
                tokens: &long,
                start_pos: 0,
                block_table: &tables[0],
                logits_rows: 1,
                state_slot: 0,
            }])
            .unwrap()
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
