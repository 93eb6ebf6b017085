//! The draft-model drafter (`--speculative draft:PATH`) on the CPU backend: a drafted greedy reply
//! equals the un-drafted one bitwise, whatever the draft model proposes; a draft that is the target
//! itself is accepted (nearly) always and drafts near the lane's cap, a different draft model is
//! partly rejected and drafts short (the adaptive draft length), an unpriced target-sized draft
//! does not draft at all; drafted streams running together equal their solo runs; a draft whose
//! vocabulary differs, a missing path and a hybrid draft are refused at startup with a clear
//! message; a cancelled stream leaves no draft state behind.
//!
//! Targets and drafts are the tiny HF llama-family fixtures (`tests/fixtures/hf`), which share a
//! 512-id vocabulary with BOS 1 and EOS 2 and have no tokenizer (`llama3-tiny-draft` is
//! `llama3-tiny` with noisy weights, from `scripts/gen_hf_draft.py`), plus the default SmolLM2 GGUF
//! drafting for itself.

mod common;

use std::sync::Arc;
use std::time::Duration;

use shelfserve::actors::{start_engine, Engine, EngineOptions, GenerationRequest, InferenceEngine, StreamEvent};
use shelfserve::config::engine::EngineConfig;
use shelfserve::generate::{any_cpu_backend, single_sequence_geometry, GenerateOptions, Runner};
use shelfserve::model::default_model::CacheDir;
use shelfserve::sampling::SamplingParams;
use shelfserve::spec::draft_model::{DraftModel, DraftModelOptions, VocabIdentity};
use shelfserve::spec::{DraftRequest, DraftSource, SpeculativeMethod};

const MAX_TOKENS: usize = 32;
const KS: [usize; 3] = [1, 3, 7];

fn hf(name: &str) -> String {
    common::fixture(&format!("hf/{name}")).to_str().unwrap().to_string()
}

/// Lane `k0` does not draft; lanes `k1`, `k3`, `k7` draft with `method`, up to k tokens as the
/// adaptive policy sees fit. The fixtures' drafts are as large as their targets, so the price by
/// weight bytes (a whole decode step per draft token) would turn drafting off: these lanes price
/// verification only, so that drafting happens and its exactness is tested.
fn config(method: SpeculativeMethod) -> EngineConfig {
    config_priced(method, Some(0.0))
}

/// [`config`] with the drafting lanes' `speculative_draft_cost` (`None`: the weight-byte price).
fn config_priced(method: SpeculativeMethod, draft_cost: Option<f64>) -> EngineConfig {
    let mut cfg = EngineConfig::builtin();
    cfg.lanes = common::engine::draft_length_lanes(&cfg, [0].into_iter().chain(KS), &method);
    for l in &mut cfg.lanes {
        l.speculative_draft_cost = draft_cost;
    }
    cfg.scheduler.max_num_seqs = 32;
    cfg.scheduler.max_num_batched_tokens = 1024;
    cfg.scheduler.kv_pool_tokens = 16_384;
    cfg
}

async fn start(target: &str, cfg: EngineConfig) -> Result<Arc<Engine>, String> {
    let bundle = shelfserve::model::open(target, &CacheDir::from_env()).expect("open the target");
    let engine = start_engine(bundle, cfg, EngineOptions { device: Default::default(), served_model_name: "t".into() })
        .await
        .map_err(|e| e.to_string())?;
    common::engine::wait_ready(&engine, Duration::from_secs(120)).await;
    Ok(engine)
}

/// Prompts of ids below the fixtures' 512-id vocabulary; some repeat themselves.
fn prompts() -> Vec<Vec<u32>> {
    vec![
        (0..24).map(|i| 3 + (i * 37) % 500).collect(),
        [10, 11, 12, 13, 14].repeat(5),
        (0..40).map(|i| 100 + (i * i) % 300).collect(),
        vec![1, 200, 7, 45, 300, 2, 9],
    ]
}

fn request(lane: &str, prompt: &[u32], max_tokens: usize) -> GenerationRequest {
    GenerationRequest::greedy_fixed_length(lane, prompt.to_vec(), max_tokens)
}

async fn generate(engine: &Engine, lane: &str, prompt: &[u32]) -> Vec<u32> {
    common::engine::greedy_ids(engine, lane, prompt, MAX_TOKENS).await
}

/// Every prompt on the un-drafted lane, one at a time.
async fn reference(engine: &Engine) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    for p in prompts() {
        out.push(generate(engine, "k0", &p).await);
    }
    out
}

/// Every prompt on every drafting lane, alone and then all at once (with un-drafted company);
/// each reply must equal the un-drafted solo one.
async fn check_drafted_equals_undrafted(engine: &Arc<Engine>, want: &[Vec<u32>]) {
    for k in KS {
        for (i, p) in prompts().iter().enumerate() {
            assert_eq!(generate(engine, &format!("k{k}"), p).await, want[i], "prompt {i}, k {k}, alone");
        }
    }
    let mut tasks = Vec::new();
    for k in [0].into_iter().chain(KS) {
        for (i, p) in prompts().into_iter().enumerate() {
            let engine = engine.clone();
            tasks.push(tokio::spawn(async move { (k, i, generate(&engine, &format!("k{k}"), &p).await) }));
        }
    }
    assert!(tasks.len() >= 8);
    for t in tasks {
        let (k, i, got) = t.await.unwrap();
        assert_eq!(got, want[i], "prompt {i}, k {k}, concurrent");
    }
}

/// Draft tokens per decode step on `lane`, over every prompt run alone, each reply checked
/// against the un-drafted one in `want`. A fixed draft length gives about k; the adaptive one
/// follows the draft's acceptance.
async fn mean_draft_length(engine: &Engine, lane: &str, want: &[Vec<u32>]) -> f64 {
    let (mut drafted, mut steps) = (0, 0);
    for (i, p) in prompts().iter().enumerate() {
        let before = engine.stats().await.unwrap();
        assert_eq!(generate(engine, lane, p).await, want[i], "prompt {i} on {lane}");
        let after = engine.stats().await.unwrap();
        drafted += after.drafted_tokens - before.drafted_tokens;
        // The first token comes from the prefill; each decode step emits its accepted drafts
        // plus one.
        steps += want[i].len() as u64 - 1 - (after.accepted_tokens - before.accepted_tokens);
    }
    drafted as f64 / steps as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draft_equal_to_target_is_accepted_and_exact() {
    let target = hf("llama3-tiny");
    let engine = start(&target, config(SpeculativeMethod::DraftModel(target.clone()))).await.expect("start");
    let want = reference(&engine).await;
    check_drafted_equals_undrafted(&engine, &want).await;
    let s = engine.stats().await.unwrap();
    let rate = s.accepted_tokens as f64 / s.drafted_tokens as f64;
    eprintln!("draft = target: drafted {} accepted {} ({:.1} %)", s.drafted_tokens, s.accepted_tokens, 100.0 * rate);
    assert!(s.drafted_tokens > 200, "drafting hardly happened: {s:?}");
    assert!(rate >= 0.95, "a draft equal to the target must be accepted: {s:?}");
    // Drafts that are always accepted grow to the lane's cap within a few steps.
    let mean = mean_draft_length(&engine, "k7", &want).await;
    eprintln!("draft = target: {mean:.2} draft tokens per step on k7");
    assert!(mean > 4.5, "{mean}");
    assert_eq!(engine.drafter_sequences().await, Some(vec![0, 0, 0, 0]), "finished sequences leave no draft state");
    assert_eq!((s.running, s.waiting, s.blocks_used), (0, 0, 0), "pages back to idle: {s:?}");
    engine.shutdown();
}

/// `llama3-tiny-draft` is the target with 2 % noise on every weight (`scripts/gen_hf_draft.py`):
/// it agrees with the target's greedy token about 80 % of the time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_different_draft_model_is_partly_rejected_and_output_stays_exact() {
    let engine =
        start(&hf("llama3-tiny"), config(SpeculativeMethod::DraftModel(hf("llama3-tiny-draft")))).await.expect("start");
    let want = reference(&engine).await;
    check_drafted_equals_undrafted(&engine, &want).await;
    let s = engine.stats().await.unwrap();
    let rate = s.accepted_tokens as f64 / s.drafted_tokens as f64;
    eprintln!("noisy draft: drafted {} accepted {} ({:.1} %)", s.drafted_tokens, s.accepted_tokens, 100.0 * rate);
    assert!(s.drafted_tokens > 200, "drafting hardly happened: {s:?}");
    assert!(rate > 0.2 && rate < 0.95, "expected partial acceptance: {s:?}");
    // Partly rejected drafts are kept short: far below the lane's 7, yet drafting goes on.
    let mean = mean_draft_length(&engine, "k7", &want).await;
    eprintln!("noisy draft: {mean:.2} draft tokens per step on k7");
    assert!(mean > 0.3 && mean < 3.5, "{mean}");
    assert_eq!(engine.drafter_sequences().await, Some(vec![0, 0, 0, 0]));
    engine.shutdown();
}

/// Unpriced, a draft as large as its target costs a whole decode step per token, so the adaptive
/// policy never drafts with it: the reply is the un-drafted one and no draft is verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_sized_draft_is_priced_out_by_its_weight_bytes() {
    let target = hf("llama3-tiny");
    let engine = start(&target, config_priced(SpeculativeMethod::DraftModel(hf("llama3-tiny-draft")), None))
        .await
        .expect("start");
    let want = reference(&engine).await;
    assert_eq!(mean_draft_length(&engine, "k7", &want).await, 0.0);
    let s = engine.stats().await.unwrap();
    assert_eq!((s.drafted_tokens, s.accepted_tokens), (0, 0), "{s:?}");
    engine.shutdown();
}

/// A draft model's cache follows accepted tokens only: whatever was accepted or rejected before,
/// its batched proposals equal those of a fresh draft model given each sequence's whole context.
#[test]
fn cached_batched_drafts_equal_drafts_from_scratch() {
    let target = shelfserve::model::open(&hf("llama3-tiny"), &CacheDir::from_env()).unwrap();
    let vocab = VocabIdentity::of(&target);
    let opts = DraftModelOptions { threads: 2, pool_tokens: 4096, dflash_cuda: None };
    let mut draft = DraftModel::open(&hf("llama3-tiny-draft"), &vocab, opts).unwrap();
    let mut fresh = DraftModel::open(&hf("llama3-tiny-draft"), &vocab, opts).unwrap();
    let mut contexts: Vec<Vec<u32>> = prompts();
    for (seq, c) in contexts.iter().enumerate() {
        draft.extend(seq as u64, c);
    }
    let (mut partial, mut full, mut none) = (0, 0, 0);
    for round in 0..24usize {
        let requests: Vec<DraftRequest> = (0..contexts.len())
            .map(|seq| DraftRequest { seq: seq as u64, k: [1, 3, 5, 7][(seq + round) % 4] })
            .collect();
        let drafts = draft.propose_batch(&requests);
        for (seq, d) in drafts.iter().enumerate() {
            fresh.forget(0);
            fresh.extend(0, &contexts[seq]);
            assert_eq!(*d, fresh.propose(0, requests[seq].k), "round {round}, sequence {seq}");
            assert_eq!(d.len(), requests[seq].k);
            // Accept a varying prefix, then a token that differs from the next draft; every other
            // round two more tokens follow (steps the drafter was not asked about), so a position
            // after a rejected draft must be recomputed, not taken from the draft's KV.
            let accepted = (round * 3 + seq) % (d.len() + 1);
            let mut append = d[..accepted].to_vec();
            let next = d.get(accepted).map_or(7, |&t| (t + 1) % 512);
            append.push(next);
            if round % 2 == 1 {
                append.extend([(next * 7 + 3) % 512, (next * 13 + 5) % 512]);
            }
            match accepted {
                0 => none += 1,
                a if a == d.len() => full += 1,
                _ => partial += 1,
            }
            draft.extend(seq as u64, &append);
            contexts[seq].extend(&append);
        }
    }
    assert!(partial > 0 && full > 0 && none > 0);
    let used = draft.blocks_used();
    assert!(used > 0);
    (0..contexts.len()).for_each(|seq| draft.forget(seq as u64));
    assert_eq!((draft.sequences(), draft.blocks_used()), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatched_missing_and_hybrid_drafts_are_refused_at_startup() {
    let target = hf("llama3-tiny");
    // llama-tok has the SmolLM2 tokenizer: 49152 ids against the target's 512.
    let e = start(&target, config(SpeculativeMethod::DraftModel(hf("llama-tok")))).await.err().expect("refused");
    assert!(e.contains("llama-tok") && e.contains("llama3-tiny") && e.contains("49152 vs 512"), "{e}");
    let e = start(&target, config(SpeculativeMethod::DraftModel("/nonexistent/draft.gguf".into())))
        .await
        .err()
        .expect("refused");
    assert!(e.contains("/nonexistent/draft.gguf") && e.contains("no such file"), "{e}");
    let glm5 = common::fixture("glm5/tiny").to_str().unwrap().to_string();
    let e = start(&target, config(SpeculativeMethod::DraftModel(glm5))).await.err().expect("refused");
    assert!(e.contains("glm5/tiny") && e.contains("recurrent state"), "{e}");
}

/// On the default model (slow enough that a long request is surely still running when it is
/// cancelled) drafting with itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_drafted_stream_drops_its_draft_state() {
    let Some(path) = common::default_gguf() else { return };
    let path = path.to_str().unwrap().to_string();
    let engine = start(&path, config(SpeculativeMethod::DraftModel(path.clone()))).await.expect("start");
    let mut events = engine.submit(request("k7", &common::synthetic_prompt(3, 40), 2000)).expect("admitted");
    let mut got = 0;
    while got < 16 {
        match events.recv().await {
            Some(StreamEvent::Delta { tokens, .. }) => got += tokens.len(),
            other => panic!("unexpected event {other:?}"),
        }
    }
    assert_eq!(engine.drafter_sequences().await, Some(vec![0, 0, 0, 1]), "the running stream has draft state");
    drop(events);
    let t0 = std::time::Instant::now();
    loop {
        let s = engine.stats().await.unwrap();
        if s.running == 0 && s.waiting == 0 && engine.drafter_sequences().await == Some(vec![0, 0, 0, 0]) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "cancellation left state behind: {s:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let s = engine.stats().await.unwrap();
    assert!(s.accepted_tokens < 1000, "the request ran to its end instead of being cancelled: {s:?}");
    engine.shutdown();
}

/// The one-shot `generate` path with the real default model as its own draft.
#[test]
fn default_model_as_its_own_draft_on_the_generate_path() {
    let Some(path) = common::default_gguf() else { return };
    let path = path.to_str().unwrap().to_string();
    let bundle = shelfserve::model::open(&path, &CacheDir::from_env()).expect("open");
    let tok = bundle.tokenizer.clone().expect("tokenizer");
    let prompt = tok.encode("Write one sentence about the sea.", true).unwrap();
    let opts = GenerateOptions {
        max_tokens: 24,
        sampling: SamplingParams::default(),
        // Run to max_tokens, so every accepted draft is emitted and acceptance can be counted.
        eos_token_ids: Vec::new(),
        prefill_chunk: 64,
    };
    let geometry = single_sequence_geometry(prompt.len() + opts.max_tokens, 16);
    let mut runner = Runner::new(any_cpu_backend(&bundle, 2, geometry).unwrap().0);
    let plain = runner.generate(&prompt, &opts, |_| true).unwrap().ids();
    let draft_opts =
        DraftModelOptions { threads: 2, pool_tokens: prompt.len() + opts.max_tokens + 8, dflash_cuda: None };
    let draft = DraftModel::open(&path, &VocabIdentity::of(&bundle), draft_opts).expect("draft model");
    let mut counted = Counted { inner: draft, proposed: 0, steps: 0 };
    let drafted = runner.generate_drafted(&prompt, &opts, Some((&mut counted, 7)), |_| true).unwrap().ids();
    assert_eq!(drafted, plain);
    assert_eq!(plain.len(), opts.max_tokens);
    // The first token comes from the prefill; each verify step emits its accepted drafts plus one.
    let accepted = plain.len() - 1 - counted.steps;
    eprintln!("default model as its own draft: {accepted} of {} drafts accepted", counted.proposed);
    assert!(accepted as f64 >= 0.95 * counted.proposed as f64 && counted.proposed > 0, "{accepted}");
    // The draft held the prompt and every emitted token; forgetting frees its blocks.
    let mut draft = counted.inner;
    assert_eq!(draft.len(0), prompt.len() + plain.len());
    assert!(draft.blocks_used() > 0);
    draft.forget(0);
    assert_eq!((draft.sequences(), draft.blocks_used()), (0, 0));
}

/// Counts proposed tokens and verify steps.
struct Counted {
    inner: DraftModel,
    proposed: usize,
    steps: usize,
}

impl DraftSource for Counted {
    fn name(&self) -> &'static str {
        "counted"
    }
    fn extend(&mut self, seq: u64, tokens: &[u32]) {
        self.inner.extend(seq, tokens)
    }
    fn propose(&mut self, seq: u64, k: usize) -> Vec<u32> {
        let d = self.inner.propose(seq, k);
        self.proposed += d.len();
        self.steps += 1;
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
