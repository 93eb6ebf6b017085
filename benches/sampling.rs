//! `sampling::sample` on a SmolLM2-sized vocabulary (49152): greedy, and the common truncations.
//! Logits are a fixed pseudo-random row with a peaked head, like a language model's.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use shelfserve::sampling::{sample, PenaltyState, SamplingParams};
use std::hint::black_box;

const VOCAB: usize = 49_152;

fn logits() -> Vec<f32> {
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    (0..VOCAB)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let base = (x >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0;
            // A few dozen strong candidates, as after a real forward pass.
            if i % 1024 == 7 {
                base + 10.0
            } else {
                base
            }
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let row = logits();
    let prompt: Vec<u32> = (0..512).map(|i| (i * 97 % VOCAB) as u32).collect();
    let mut state = PenaltyState::new(&prompt);
    for i in 0..128u32 {
        state.push_output(i * 13);
    }
    let cases = [
        ("greedy", SamplingParams::default()),
        ("greedy_logprobs5", SamplingParams { logprobs: Some(5), ..Default::default() }),
        ("temperature", SamplingParams { temperature: 0.8, seed: 1, ..Default::default() }),
        ("top_p_0.9", SamplingParams { temperature: 0.8, top_p: 0.9, seed: 1, ..Default::default() }),
        (
            "top_k_50_top_p_0.95",
            SamplingParams { temperature: 1.0, top_k: 50, top_p: 0.95, seed: 1, ..Default::default() },
        ),
        ("min_p_0.05", SamplingParams { temperature: 1.0, min_p: 0.05, seed: 1, ..Default::default() }),
        (
            "penalties_top_p",
            SamplingParams {
                temperature: 0.7,
                top_p: 0.9,
                repetition_penalty: 1.1,
                presence_penalty: 0.5,
                frequency_penalty: 0.5,
                seed: 1,
                ..Default::default()
            },
        ),
    ];
    let mut group = c.benchmark_group("sample_vocab_49152");
    for (name, p) in &cases {
        group.bench_with_input(BenchmarkId::from_parameter(name), p, |b, p| {
            let mut step = 0u64;
            b.iter(|| {
                step += 1;
                black_box(sample(black_box(&row), p, &state, step))
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
