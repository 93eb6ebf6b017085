//! Speculative decoding exactness (CPU backend): with greedy sampling a drafted reply must equal
//! the un-drafted one token for token, for every draft length k in 1..=7, alone and with many
//! drafted streams running concurrently; and drafting must really happen (drafts proposed, some
//! accepted, some rejected) or the test proves nothing. On the real default model (attention only)
//! and on the tiny `glm5_next` fixture, whose KDA conv windows and recurrent states must be rolled
//! back to the last accepted token after every verification step.

mod common;

use common::argmax;

use std::time::Duration;

use shelfserve::actors::{
    start_engine, Engine, EngineOptions, FinishReason, GenerationRequest, InferenceEngine, StreamEvent,
};
use shelfserve::backend::cpu::glm5_next::Glm5Backend;
use shelfserve::backend::{Backend, KvGeometry, SeqStep};
use shelfserve::config::engine::EngineConfig;
use shelfserve::generate::{any_cpu_backend, single_sequence_geometry, DeviceSelection, Runner};
use shelfserve::model::default_model::CacheDir;
use shelfserve::model::glm5_next::read_config;
use shelfserve::model::ModelBundle;
use shelfserve::sampling::SamplingParams;
use shelfserve::spec::ngram::{NgramConfig, NgramDrafter};
use shelfserve::spec::{DraftSource, SpeculativeMethod};

const MAX_TOKENS: usize = 32;

/// Prompts whose continuations repeat parts of the prompt (lists, code, a recited text), where an
/// n-gram drafter has something to propose, plus one where it has little.
const PROMPTS: &[&str] = &[
    "Copy the list exactly.\nList: apples, pears, plums, cherries, grapes, lemons, limes.\nCopy: apples, pears,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "Write one sentence about the sea.",
];

/// One lane per draft length (k1..k7) plus an un-drafted lane.
fn config(method: SpeculativeMethod) -> EngineConfig {
    let mut cfg = EngineConfig::builtin();
    cfg.lanes = common::engine::draft_length_lanes(&cfg, 0..=7, &method);
    cfg.scheduler.max_num_seqs = 64;
    cfg.scheduler.max_num_batched_tokens = 1024;
    cfg
}

async fn start(cfg: EngineConfig) -> Option<(std::sync::Arc<Engine>, Vec<Vec<u32>>)> {
    let path = common::default_gguf()?;
    let bundle =
        shelfserve::model::open(path.to_str().unwrap(), &CacheDir::from_env()).expect("open the default model");
    let tok = bundle.tokenizer.clone().expect("tokenizer");
    let prompts = PROMPTS.iter().map(|p| tok.encode(p, true).expect("tokenize")).collect();
    let engine =
        start_engine(bundle, cfg, EngineOptions { device: Default::default(), served_model_name: "default".into() })
            .await
            .expect("start the engine");
    common::engine::wait_ready(&engine, Duration::from_secs(300)).await;
    Some((engine, prompts))
}

async fn generate(engine: &Engine, lane: &str, prompt: &[u32]) -> (Vec<u32>, FinishReason) {
    generate_n(engine, lane, prompt, MAX_TOKENS, false).await
}

async fn generate_n(
    engine: &Engine,
    lane: &str,
    prompt: &[u32],
    max_tokens: usize,
    ignore_eos: bool,
) -> (Vec<u32>, FinishReason) {
    let req = GenerationRequest {
        lane: lane.into(),
        prompt: prompt.to_vec(),
        sampling: SamplingParams::default(),
        max_tokens,
        stop_strings: Vec::new(),
        stop_token_ids: Vec::new(),
        ignore_eos,
        skip_special_tokens: true,
        loop_guard: shelfserve::sampling::loop_guard::LoopGuardConfig::off(),
        grammar: None,
        images: Vec::new(),
    };
    let mut events = engine.submit(req).expect("admitted");
    let mut ids = Vec::new();
    while let Some(ev) = events.recv().await {
        match ev {
            StreamEvent::Delta { tokens, .. } => ids.extend(tokens.iter().map(|t| t.id)),
            StreamEvent::Finished { reason, .. } => return (ids, reason),
            StreamEvent::Error(e) => panic!("request failed: {e}"),
        }
    }
    panic!("stream ended without a finish event");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drafted_greedy_equals_undrafted_for_every_k_alone_and_concurrently() {
    let Some((engine, prompts)) = start(config(SpeculativeMethod::Ngram)).await else { return };
    // Reference: the un-drafted lane, one request at a time.
    let mut reference = Vec::new();
    for p in &prompts {
        reference.push(generate(&engine, "k0", p).await);
    }
    // Alone, the longest drafts.
    for k in [7] {
        for (i, p) in prompts.iter().enumerate() {
            let got = generate(&engine, &format!("k{k}"), p).await;
            assert_eq!(got, reference[i], "prompt {i}, k {k}, alone");
        }
    }
    let alone = engine.stats().await.unwrap();
    assert!(alone.drafted_tokens > 0 && alone.accepted_tokens > 0, "drafting never happened: {alone:?}");
    // Every k, every prompt, all at once (plus un-drafted company).
    let mut tasks = Vec::new();
    for k in 0..=7 {
        for (i, p) in prompts.iter().enumerate() {
            let (engine, p) = (engine.clone(), p.clone());
            tasks.push(tokio::spawn(async move { (k, i, generate(&engine, &format!("k{k}"), &p).await) }));
        }
    }
    for t in tasks {
        let (k, i, got) = t.await.unwrap();
        assert_eq!(got, reference[i], "prompt {i}, k {k}, concurrent");
    }
    let s = engine.stats().await.unwrap();
    assert!(s.accepted_tokens > alone.accepted_tokens, "no drafts accepted under concurrency: {s:?}");
    assert!(s.drafted_tokens > s.accepted_tokens, "no draft was ever rejected, so rejection went untested: {s:?}");
    eprintln!(
        "drafted {} accepted {} ({:.0}%) over {} steps",
        s.drafted_tokens,
        s.accepted_tokens,
        100.0 * s.accepted_tokens as f64 / s.drafted_tokens as f64,
        s.steps
    );
    assert_eq!((s.running, s.waiting, s.blocks_used), (0, 0, 0), "pages back to idle: {s:?}");
    engine.shutdown();
}

// ---- glm5_next: recurrent state rolled back after verification ----

fn open_tiny_glm5() -> ModelBundle {
    let dir = common::fixture("glm5/tiny");
    shelfserve::model::open(dir.to_str().unwrap(), &CacheDir::from_env()).expect("open the tiny glm5 fixture")
}

fn glm5_backend(bundle: &ModelBundle) -> Glm5Backend {
    let cfg = read_config(bundle.weights.origin()).unwrap();
    let geom = KvGeometry { block_size: 4, num_blocks: 64, state_slots: 3 };
    Glm5Backend::new(cfg, bundle.weights.as_ref(), 2, geom).unwrap()
}

fn bits(rows: &[f32]) -> Vec<u32> {
    rows.iter().map(|v| v.to_bits()).collect()
}

/// The un-drafted reference: prefill, then one greedy token per step; returns the generated
/// tokens and, per generated token, the logits row it was chosen from.
fn undrafted(be: &mut Glm5Backend, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let table: Vec<u32> = (0..32).collect();
    let out = be
        .forward(&[SeqStep { tokens: prompt, start_pos: 0, block_table: &table, logits_rows: 1, state_slot: 0 }])
        .unwrap();
    let mut rows = vec![out.last_row(0).unwrap().to_vec()];
    let mut toks = vec![argmax(&rows[0])];
    while toks.len() < n {
        let pos = prompt.len() + toks.len() - 1;
        let step = SeqStep {
            tokens: &toks[toks.len() - 1..],
            start_pos: pos,
            block_table: &table,
            logits_rows: 1,
            state_slot: 0,
        };
        let out = be.forward(&[step]).unwrap();
        let row = out.last_row(0).unwrap().to_vec();
        toks.push(argmax(&row));
        rows.push(row);
    }
    (toks, rows)
}

/// How a drafted stream drafts at its `n`-th verification step: `(k, wrong)` proposes the next `k`
/// true tokens with the one at index `wrong` replaced (so exactly `wrong` are accepted); k = 0 is
/// a plain decode step.
type Schedule = fn(usize) -> (usize, Option<usize>);

/// One greedy stream on a shared backend, checked against its un-drafted reference.
struct Stream {
    prompt: Vec<u32>,
    truth: Vec<u32>,
    reference_rows: Vec<Vec<f32>>,
    table: Vec<u32>,
    slot: u32,
    schedule: Schedule,
    generated: Vec<u32>,
    /// Tokens of the step in flight (last token + drafts) and the drafts' count.
    input: Vec<u32>,
    num_draft: usize,
    verify_steps: usize,
    drafted: usize,
    accepted: usize,
    rejected_steps: usize,
}

impl Stream {
    fn new(bundle: &ModelBundle, prompt: Vec<u32>, n: usize, slot: u32, schedule: Schedule) -> Self {
        let mut reference = glm5_backend(bundle);
        let (truth, reference_rows) = undrafted(&mut reference, &prompt, n);
        let table = (slot * 20..slot * 20 + 20).collect();
        Stream {
            prompt,
            truth,
            reference_rows,
            table,
            slot,
            schedule,
            generated: Vec::new(),
            input: Vec::new(),
            num_draft: 0,
            verify_steps: 0,
            drafted: 0,
            accepted: 0,
            rejected_steps: 0,
        }
    }

    fn done(&self) -> bool {
        self.generated.len() >= self.truth.len()
    }

    /// Plans this stream's next step: the prompt first, then last token + drafts.
    fn plan(&mut self, vocab: u32) -> usize {
        if self.generated.is_empty() {
            self.input = self.prompt.clone();
            self.num_draft = 0;
            return 0;
        }
        let i = self.generated.len();
        let (k, wrong) = (self.schedule)(self.verify_steps);
        let k = k.min(self.truth.len() - i - 1);
        let mut draft = self.truth[i..i + k].to_vec();
        if let Some(w) = wrong.filter(|&w| w < k) {
            draft[w] = (draft[w] + 1) % vocab;
        }
        self.input = vec![self.generated[i - 1]];
        self.input.extend(&draft);
        self.num_draft = draft.len();
        self.start_pos()
    }

    fn start_pos(&self) -> usize {
        if self.generated.is_empty() {
            0
        } else {
            self.prompt.len() + self.generated.len() - 1
        }
    }

    fn seq_step(&self) -> SeqStep<'_> {
        let rows = if self.generated.is_empty() { 1 } else { self.num_draft + 1 };
        SeqStep {
            tokens: &self.input,
            start_pos: self.start_pos(),
            block_table: &self.table,
            logits_rows: rows,
            state_slot: self.slot,
        }
    }

    /// Greedy verification of the step's rows against the reference; returns tokens kept.
    fn finish(&mut self, rows: Vec<&[f32]>) -> usize {
        let i = self.generated.len();
        let draft = &self.input[self.input.len() - self.num_draft..];
        let targets: Vec<u32> = rows.iter().map(|r| argmax(r)).collect();
        let accepted = draft.iter().zip(&targets).take_while(|(d, t)| d == t).count();
        for (j, row) in rows.iter().enumerate().take(accepted + 1) {
            assert!(
                bits(row) == bits(&self.reference_rows[i + j]),
                "slot {}: logits for generated token {} differ from the un-drafted run",
                self.slot,
                i + j
            );
        }
        self.generated.extend(&draft[..accepted]);
        self.generated.push(targets[accepted]);
        if self.num_draft > 0 {
            self.verify_steps += 1;
            self.drafted += self.num_draft;
            self.accepted += accepted;
            self.rejected_steps += usize::from(accepted < self.num_draft);
        } else if i > 0 {
            self.verify_steps += 1;
        }
        accepted + 1
    }
}

/// Runs the streams together on one backend, each step batching every unfinished stream, and
/// commits each verified stream to its accepted length.
fn run_together(bundle: &ModelBundle, streams: &mut [Stream]) {
    let mut be = glm5_backend(bundle);
    let vocab = be.vocab_size() as u32;
    while streams.iter().any(|s| !s.done()) {
        let live: Vec<usize> = (0..streams.len()).filter(|&i| !streams[i].done()).collect();
        for &i in &live {
            streams[i].plan(vocab);
        }
        let steps: Vec<SeqStep<'_>> = live.iter().map(|&i| streams[i].seq_step()).collect();
        let verify: Vec<bool> = live.iter().map(|&i| streams[i].num_draft > 0).collect();
        let out = be.forward_verify(&steps, &verify).expect("verification step");
        drop(steps);
        for (b, &i) in live.iter().enumerate() {
            let rows: Vec<&[f32]> = out.rows(b).collect();
            let kept = streams[i].finish(rows);
            if verify[b] {
                be.commit_verified(streams[i].slot, kept).expect("commit");
            }
        }
    }
    for s in streams.iter() {
        assert_eq!(s.generated, s.truth, "slot {}: drafted greedy output differs", s.slot);
    }
}

fn prompt_of(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (seed * 31 + i * i * 7 + i * 13) % 256).collect()
}

/// Drafts partly rejected at every step, many steps in a row, for every k in 1..=7, with a second
/// drafted stream and an un-drafted one in the same batches: every kept logits row and every token
/// equals the un-drafted run bitwise. Without the rollback the recurrent state would have moved
/// past the rejected drafts and the next step would be refused (checked at the end).
#[test]
fn glm5_rejected_drafts_roll_recurrent_state_back_exactly() {
    let bundle = open_tiny_glm5();
    // Stream 0: k cycles 1..=7, the draft wrong from the middle on (about half accepted) — a
    // rejection at every step with k >= 2, and at index 0 every seventh step.
    let partly: Schedule = |n| {
        let k = 1 + n % 7;
        (k, Some(if n % 7 == 3 { 0 } else { k / 2 }))
    };
    // Stream 1: long drafts rejected at position 1..=3, step after step.
    let reject_often: Schedule = |n| (7, Some(1 + n % 3));
    // Stream 2: no drafts at all (company).
    let plain: Schedule = |_| (0, None);
    let mut streams = vec![
        Stream::new(&bundle, prompt_of(1, 23), 40, 0, partly),
        Stream::new(&bundle, prompt_of(2, 9), 40, 1, reject_often),
        Stream::new(&bundle, prompt_of(3, 30), 30, 2, plain),
    ];
    run_together(&bundle, &mut streams);
    for s in &streams[..2] {
        assert!(
            s.accepted > 0 && s.drafted > s.accepted,
            "slot {}: {} drafted {} accepted",
            s.slot,
            s.drafted,
            s.accepted
        );
        assert!(s.rejected_steps >= 8, "slot {}: only {} steps rejected a draft", s.slot, s.rejected_steps);
    }
    // The guard the rollback satisfies: continuing from the accepted position without a commit is
    // refused, not silently computed on a state that ran past the rejected drafts.
    let mut be = glm5_backend(&bundle);
    let table: Vec<u32> = (0..20).collect();
    let prompt = prompt_of(1, 23);
    be.forward(&[SeqStep { tokens: &prompt, start_pos: 0, block_table: &table, logits_rows: 1, state_slot: 0 }])
        .unwrap();
    let verify = SeqStep { tokens: &[5, 6, 7, 8], start_pos: 23, block_table: &table, logits_rows: 4, state_slot: 0 };
    be.forward_verify(&[verify], &[true]).unwrap();
    let next = SeqStep { tokens: &[9], start_pos: 25, block_table: &table, logits_rows: 1, state_slot: 0 };
    let err = be.forward(&[next]).expect_err("state ran past the rejected drafts").to_string();
    assert!(err.contains("position 27"), "{err}");
    be.commit_verified(0, 2).unwrap();
    be.forward(&[next]).expect("rolled back to position 25");
    assert!(be.commit_verified(0, 1).is_err(), "a commit without a verification step is an error");
}

/// A step without drafts right after a step that accepted every draft (and the reverse), and
/// drafts that are entirely right or entirely wrong.
#[test]
fn glm5_plain_steps_between_fully_accepted_and_fully_rejected_drafts() {
    let bundle = open_tiny_glm5();
    let alternate: Schedule = |n| match n % 4 {
        0 => (4, None),
        1 => (0, None),
        2 => (3, Some(0)),
        _ => (0, None),
    };
    let all_right: Schedule = |n| (1 + n % 7, None);
    let mut streams = vec![
        Stream::new(&bundle, prompt_of(4, 17), 36, 0, alternate),
        Stream::new(&bundle, prompt_of(5, 12), 36, 1, all_right),
    ];
    run_together(&bundle, &mut streams);
    assert!(streams[0].accepted > 0 && streams[0].rejected_steps > 0);
    assert_eq!(streams[1].accepted, streams[1].drafted, "correct drafts are always accepted");
}

/// One lane per draft length on the tiny glm5_next model with the n-gram drafter.
fn glm5_config() -> EngineConfig {
    let mut cfg = config(SpeculativeMethod::Ngram);
    cfg.scheduler.kv_pool_tokens = 4096;
    cfg.scheduler.max_num_seqs = 48;
    cfg
}

/// Prompts of token ids with repeated spans (the n-gram drafter has something to propose).
fn glm5_prompts() -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    for seed in 0..5u32 {
        let span: Vec<u32> = (0..6 + seed).map(|i| (seed * 53 + i * 29 + 7) % 256).collect();
        let mut p = Vec::new();
        for r in 0..3 {
            p.extend(&span);
            p.push((seed + r * 11) % 256);
        }
        p.extend(&span[..3]);
        out.push(p);
    }
    out
}

/// Engine level: the tiny glm5_next served through scheduler, drafter and executor, greedy with
/// n-gram drafts for k = 1..=7, alone and all at once: every reply equals the un-drafted one, and
/// drafts were both accepted and rejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn glm5_drafted_greedy_equals_undrafted_through_the_engine() {
    const N: usize = 40;
    let opts = EngineOptions {
        device: DeviceSelection { threads: 2, ..Default::default() },
        served_model_name: "glm5-tiny".into(),
    };
    let engine = start_engine(open_tiny_glm5(), glm5_config(), opts).await.expect("start the engine");
    common::engine::wait_ready(&engine, Duration::from_secs(60)).await;
    let prompts = glm5_prompts();
    let mut reference = Vec::new();
    for p in &prompts {
        reference.push(generate_n(&engine, "k0", p, N, true).await);
    }
    for k in 1..=7 {
        for (i, p) in prompts.iter().enumerate() {
            let got = generate_n(&engine, &format!("k{k}"), p, N, true).await;
            assert_eq!(got, reference[i], "prompt {i}, k {k}, alone");
        }
    }
    let alone = engine.stats().await.unwrap();
    assert!(alone.accepted_tokens > 0, "no draft was accepted: {alone:?}");
    assert!(alone.drafted_tokens > alone.accepted_tokens, "no draft was rejected: {alone:?}");
    let mut tasks = Vec::new();
    for k in 0..=7 {
        for (i, p) in prompts.iter().enumerate() {
            let (engine, p) = (engine.clone(), p.clone());
            tasks.push(tokio::spawn(async move { (k, i, generate_n(&engine, &format!("k{k}"), &p, N, true).await) }));
        }
    }
    for t in tasks {
        let (k, i, got) = t.await.unwrap();
        assert_eq!(got, reference[i], "prompt {i}, k {k}, concurrent");
    }
    let s = engine.stats().await.unwrap();
    eprintln!(
        "glm5: drafted {} accepted {} ({:.0}%) over {} steps",
        s.drafted_tokens,
        s.accepted_tokens,
        100.0 * s.accepted_tokens as f64 / s.drafted_tokens.max(1) as f64,
        s.steps
    );
    assert!(s.accepted_tokens > alone.accepted_tokens && s.drafted_tokens > s.accepted_tokens, "{s:?}");
    assert_eq!((s.running, s.waiting, s.blocks_used), (0, 0, 0), "pages back to idle: {s:?}");
    engine.shutdown();
}

/// Counts what the wrapped drafter proposes.
struct Counting<D> {
    inner: D,
    proposed: usize,
}

impl<D: DraftSource> DraftSource for Counting<D> {
    fn name(&self) -> &'static str {
        "counting"
    }
    fn extend(&mut self, seq: u64, tokens: &[u32]) {
        self.inner.extend(seq, tokens)
    }
    fn propose(&mut self, seq: u64, k: usize) -> Vec<u32> {
        let d = self.inner.propose(seq, k);
        self.proposed += d.len();
        d
    }
    fn forget(&mut self, seq: u64) {
        self.inner.forget(seq)
    }
    fn truncate(&mut self, seq: u64, len: usize) {
        self.inner.truncate(seq, len)
    }
    fn len(&self, seq: u64) -> usize {
        self.inner.len(seq)
    }
    fn sequences(&self) -> usize {
        self.inner.sequences()
    }
}

/// The one-shot `generate` path (`--speculative ngram`): drafted output equals plain output on
/// the hybrid model, for every k, with EOS inside accepted runs honoured.
#[test]
fn generate_with_ngram_drafts_equals_plain_generate_on_glm5() {
    let bundle = open_tiny_glm5();
    let geom = single_sequence_geometry(256, 16);
    let mut runner = Runner::new(any_cpu_backend(&bundle, 2, geom).unwrap().0);
    let mut proposed = 0;
    for (i, p) in glm5_prompts().iter().enumerate() {
        let mut opts = common::greedy_options(40, 7);
        let want = runner.generate(p, &opts, |_| true).unwrap().ids();
        // A stop id that occurs mid-run ends both at the same place.
        opts.eos_token_ids = vec![want[want.len() / 2]];
        let want_eos = runner.generate(p, &opts, |_| true).unwrap().ids();
        for k in 1..=7 {
            let mut d = Counting { inner: NgramDrafter::new(NgramConfig::default()).unwrap(), proposed: 0 };
            opts.eos_token_ids.clear();
            let got = runner.generate_drafted(p, &opts, Some((&mut d, k)), |_| true).unwrap().ids();
            assert_eq!(got, want, "prompt {i}, k {k}");
            opts.eos_token_ids = vec![want[want.len() / 2]];
            let got = runner.generate_drafted(p, &opts, Some((&mut d, k)), |_| true).unwrap().ids();
            assert_eq!(got, want_eos, "prompt {i}, k {k}, with a stop id");
            proposed += d.proposed;
        }
    }
    assert!(proposed > 0, "the n-gram drafter never proposed anything");
}
