//! Cost of one scheduling step (`plan_step` + `on_step_done`) in steady state: sequences that
//! reach `max_tokens` are replaced by new requests, so every measured step looks alike.
//! `decode_256`: 256 running decodes. `mixed`: about 192 decodes plus prefill chunks of
//! 1000-token prompts sharing a 2048-token budget. `pool_start`: creating a policy over a pool of
//! 2^31 tokens and planning its first admission (host bookkeeping that must not scale with the
//! pool).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use shelfserve::sched::{NewSeq, Policy, PolicyConfig, SeqId, StepPlanOut};

struct Workload {
    policy: Policy,
    next_id: SeqId,
    prompt_len: usize,
    max_tokens: usize,
    sampled: Vec<(SeqId, Vec<u32>)>,
}

impl Workload {
    fn new(cfg: PolicyConfig, seqs: usize, prompt_len: usize, max_tokens: usize) -> Self {
        let policy = Policy::new(cfg).expect("bench config is valid");
        let mut w = Self { policy, next_id: 0, prompt_len, max_tokens, sampled: Vec::new() };
        for _ in 0..seqs {
            w.add();
        }
        // Run until the population is in steady state (staggered lengths, everything admitted).
        for _ in 0..4 * max_tokens {
            w.step();
        }
        w.describe();
        w
    }

    /// Prints what a typical step of this workload carries, so the timing can be read.
    fn describe(&mut self) {
        let (mut decodes, mut prefill_tokens, mut steps) = (0, 0, 0);
        for _ in 0..100 {
            let Some(plan) = self.policy.plan_step() else { break };
            decodes += plan.seqs.iter().filter(|s| s.is_decode()).count();
            prefill_tokens += plan.seqs.iter().filter(|s| !s.is_decode()).map(|s| s.tokens.len()).sum::<usize>();
            steps += 1;
            self.complete(&plan);
        }
        let steps = steps.max(1);
        eprintln!(
            "workload: {} running, {} waiting; per step {} decodes + {} prefill tokens",
            self.policy.num_running(),
            self.policy.num_waiting(),
            decodes / steps,
            prefill_tokens / steps
        );
    }

    fn complete(&mut self, plan: &StepPlanOut) {
        self.sampled.clear();
        for s in plan.seqs.iter().filter(|s| s.wants_logits) {
            self.sampled.push((s.id, vec![(s.start_pos as u32).wrapping_mul(17)]));
        }
        let ended = self.policy.on_step_done(&self.sampled, &[]);
        for _ in &ended {
            self.add();
        }
    }

    fn add(&mut self) {
        self.next_id += 1;
        let id = self.next_id;
        let prompt = (0..self.prompt_len as u32).map(|t| t.wrapping_mul(31).wrapping_add(id as u32)).collect();
        // Varying max_tokens staggers when sequences end, so turnover is spread over steps.
        let max_tokens = self.max_tokens / 2 + (id as usize * 7919) % self.max_tokens;
        self.policy.add(NewSeq { id, priority: (id % 2) as i32, prompt, max_tokens }).expect("fits");
    }

    fn step(&mut self) -> usize {
        let Some(plan) = self.policy.plan_step() else { return 0 };
        self.complete(&plan);
        plan.seqs.len()
    }
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("step_planning");

    let decode_cfg = PolicyConfig {
        max_num_batched_tokens: 2048,
        max_num_seqs: 256,
        block_size: 16,
        num_blocks: 256 * 80,
        page_tokens: 0,
        recurrent_state: false,
        page_aligned_chunks: false,
    };
    // One-token prompts: a new sequence decodes from its first step.
    let mut w = Workload::new(decode_cfg, 256, 1, 1024);
    assert!(w.policy.num_running() == 256 && w.policy.num_waiting() == 0);
    group.bench_function(BenchmarkId::new("decode", 256), |b| b.iter(|| w.step()));

    let mixed_cfg = PolicyConfig {
        max_num_batched_tokens: 2048,
        max_num_seqs: 256,
        block_size: 16,
        num_blocks: 256 * 80,
        page_tokens: 0,
        recurrent_state: false,
        page_aligned_chunks: false,
    };
    let mut w = Workload::new(mixed_cfg, 256, 1000, 128);
    group.bench_function(BenchmarkId::new("mixed", 256), |b| b.iter(|| w.step()));
    group.finish();

    // Host cost of creating a pool sized from a large device budget (2^31 tokens in blocks of
    // 16) and admitting a first prompt: the bookkeeping grows with the blocks handed out, not
    // with the pool, so this stays far below a second.
    let mut start = c.benchmark_group("pool_start");
    start.sample_size(10);
    let huge = PolicyConfig {
        max_num_batched_tokens: 8192,
        max_num_seqs: 256,
        block_size: 16,
        num_blocks: (1usize << 31) / 16,
        page_tokens: 256,
        recurrent_state: false,
        page_aligned_chunks: false,
    };
    start.bench_function(BenchmarkId::new("create_and_admit", "2G_tokens"), |b| {
        b.iter(|| {
            let mut p = Policy::new(huge.clone()).expect("valid");
            p.add(NewSeq { id: 1, priority: 0, prompt: vec![7; 4096], max_tokens: 16 }).expect("add");
            p.plan_step().map(|plan| plan.seqs.len())
        })
    });
    start.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
