//! `glm5_next` split over CPU tensor-parallel ranks against the unsharded backend.
//!
//! - The transformers fixtures (`glm5/tiny`, `glm5/tiny-flat`: 2 MLA heads, 2 KDA heads, 8
//!   indexer heads, 8 experts) at TP=2, with and without expert parallelism: the same greedy
//!   continuation as TP=1 (and as transformers' golden) and logits within max relative error
//!   1e-5 (max |Δ| / max(|ref|, 1) per position): the shards add the same products in another
//!   order (the row-parallel o_proj and FFN sums), nothing else differs.
//! - A synthetic `glm5_next` with 4 heads of each kind, an uneven vocabulary (301: the last rank's
//!   logits slice is padded) and 40 positions (past the point where the DSA selection turns
//!   sparse) at TP=2 and TP=4, with and without expert parallelism, to the same bounds.
//! - The three exactness rules inside one group (TP=2, expert parallel), bitwise: a sequence's
//!   logits do not depend on its batch company, a prefix restored from the group's block and
//!   state images equals the fresh run, and a drafted greedy run equals the undrafted one.
//! - Indivisible splits are refused with the count named; the serving engine runs a group.

mod common;

use shelfserve::backend::cpu::glm5_next::{Glm5Backend, Glm5TpBackend};
use shelfserve::backend::{Backend, KvGeometry, SeqStep};
use shelfserve::generate::{GenerateOptions, Runner};
use shelfserve::model::default_model::CacheDir;
use shelfserve::model::glm5_next::layout::SyntheticGlm5Weights;
use shelfserve::model::glm5_next::{read_config, Glm5Config};
use shelfserve::model::{ModelBundle, WeightSource};
use shelfserve::spec::DraftSource;

const MAX_REL_ERR: f32 = 1e-5;

fn geom() -> KvGeometry {
    KvGeometry { block_size: 4, num_blocks: 24, state_slots: 2 }
}

fn open(dir: &str) -> ModelBundle {
    shelfserve::model::open(common::fixture(dir).to_str().unwrap(), &CacheDir::from_env()).unwrap()
}

fn greedy(max_tokens: usize) -> GenerateOptions {
    common::greedy_options(max_tokens, 5)
}

/// Teacher-forced logits of `ids` (chunks of 7: across block and pool boundaries) and a greedy
/// continuation of `new` tokens.
fn run<B: Backend>(backend: B, ids: &[u32], new: usize) -> (Vec<f32>, Vec<u32>) {
    let mut runner = Runner::new(backend);
    let logits = runner.score(ids, 7).unwrap();
    let out = runner.generate(ids, &greedy(new), |_| true).unwrap().ids();
    (logits, out)
}

fn compare(
    what: &str,
    cfg: &Glm5Config,
    w: &dyn WeightSource,
    worlds: &[usize],
    ids: &[u32],
    failures: &mut Vec<String>,
) {
    let (ref_logits, ref_greedy) = run(Glm5Backend::new(cfg.clone(), w, 2, geom()).unwrap(), ids, 12);
    let whole = Glm5Backend::new(cfg.clone(), w, 2, geom()).unwrap().weight_bytes();
    for &world in worlds {
        for ep in [false, true] {
            let tp = Glm5TpBackend::new(cfg.clone(), w, 2, geom(), world, ep).unwrap();
            assert_eq!(tp.world_size(), world);
            // Expert parallel: every rank holds 1/world of the experts' bytes, so the ranks
            // together hold the routed experts once; the replicated parts (embedding, router, mHC,
            // latent and indexer-key projections) once per rank.
            assert!(tp.weight_bytes() > whole && tp.rank_weight_bytes().iter().all(|&b| b < whole), "{what}");
            let (logits, out) = run(tp, ids, 12);
            let err = shelfserve::fidelity::compare(&ref_logits, &logits, cfg.vocab_size).max_rel_logit_err;
            println!("{what:<22} tp={world} ep={ep:<5} max rel err {err:.3e} greedy same: {}", out == ref_greedy);
            if err > MAX_REL_ERR {
                failures.push(format!("{what} tp={world} ep={ep}: max relative logit error {err:.3e}"));
            }
            if out != ref_greedy {
                failures.push(format!("{what} tp={world} ep={ep}: greedy {out:?} != tp=1 {ref_greedy:?}"));
            }
        }
    }
}

fn ints(st: &safetensors::SafeTensors<'_>, name: &str) -> Vec<u32> {
    st.tensor(name).unwrap().data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32).collect()
}

#[test]
fn transformers_fixtures_at_tp2_match_tp1_and_the_golden() {
    let mut failures = Vec::new();
    for (dir, golden) in [("glm5/tiny", "glm5/golden.safetensors"), ("glm5/tiny-flat", "glm5/golden-flat.safetensors")]
    {
        let bundle = open(dir);
        let cfg = read_config(bundle.weights.origin()).unwrap();
        let ids: Vec<u32> = (0..23).map(|i| (i * 37 + 11) % cfg.vocab_size as u32).collect();
        compare(dir, &cfg, bundle.weights.as_ref(), &[2], &ids, &mut failures);
        let bytes = std::fs::read(common::fixture(golden)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let (prompt, expected) = (ints(&st, "ids_0"), ints(&st, "greedy_0"));
        for ep in [false, true] {
            // The golden prompt (80 tokens) and its 24-token reply need more room than `geom()`.
            let room = KvGeometry { num_blocks: 32, ..geom() };
            let tp = Glm5TpBackend::new(cfg.clone(), bundle.weights.as_ref(), 2, room, 2, ep).unwrap();
            let got = Runner::new(tp).generate(&prompt, &greedy(expected.len()), |_| true).unwrap().ids();
            if got != expected {
                failures.push(format!("{dir} tp=2 ep={ep}: greedy {got:?} != transformers {expected:?}"));
            }
        }
        // 2 heads do not split 4 ways: refused with the count, before any weight is read.
        let e = Glm5TpBackend::new(cfg.clone(), bundle.weights.as_ref(), 2, geom(), 4, false).err().unwrap();
        assert!(e.to_string().contains("does not divide the MLA attention heads (2)"), "{e}");
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// 4 MLA, KDA and indexer heads, 8 experts in 2 groups, an uneven vocabulary, small pools so the
/// DSA selection is sparse after position 12, and the default layer schedule's mix of KDA, full-
/// and shared-indexer DSA layers, dense and MoE FFNs.
fn four_head_config() -> Glm5Config {
    let json = r#"{"model_type": "glm5_next", "vocab_size": 301, "hidden_size": 48, "intermediate_size": 64,
      "moe_intermediate_size": 16, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 4,
      "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "v_head_dim": 8, "linear_num_heads": 4,
      "linear_head_dim": 8, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 2, "topk_group": 1,
      "index_n_heads": 4, "index_head_dim": 8, "index_kpool": 4, "index_topk": 8,
      "layer_types": ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                      "indexed_attention", "linear_attention"],
      "indexer_types": ["full", "full", "shared", "full", "full", "full"],
      "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "dense", "sparse"]}"#;
    Glm5Config::from_hf_json(json, std::path::Path::new("four-head test config")).unwrap()
}

#[test]
fn synthetic_glm5_at_tp2_and_tp4_matches_tp1() {
    let cfg = four_head_config();
    let w = SyntheticGlm5Weights::new(&cfg, 11);
    let ids: Vec<u32> = (0..40).map(|i| (i * 53 + 7) % 301).collect();
    let mut failures = Vec::new();
    compare("synthetic 4-head", &cfg, &w, &[2, 4], &ids, &mut failures);
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn indivisible_splits_are_refused_with_the_count() {
    let cfg = Glm5Config { n_routed_experts: 6, n_group: 1, ..four_head_config() };
    let w = SyntheticGlm5Weights::new(&cfg, 1);
    let e = Glm5TpBackend::new(cfg.clone(), &w, 2, geom(), 4, true).err().unwrap().to_string();
    assert!(e.contains("does not divide the routed experts (expert parallel) (6)"), "{e}");
    // Plain TP splits the experts' rows instead, which 4 divides.
    assert!(Glm5TpBackend::new(cfg.clone(), &w, 2, geom(), 4, false).is_ok());
    let e = Glm5TpBackend::new(cfg, &w, 2, geom(), 3, false).err().unwrap().to_string();
    assert!(e.contains("tensor parallel size 3 does not divide the routed experts' intermediate size (16)"), "{e}");
}

fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn step<'a>(tokens: &'a [u32], start_pos: usize, table: &'a [u32], slot: u32) -> SeqStep<'a> {
    SeqStep { tokens, start_pos, block_table: table, logits_rows: tokens.len(), state_slot: slot }
}

fn group(cfg: &Glm5Config, w: &dyn WeightSource) -> Glm5TpBackend {
    Glm5TpBackend::new(cfg.clone(), w, 2, geom(), 2, true).unwrap()
}

#[test]
fn a_concurrent_sequence_equals_its_solo_run_in_a_group() {
    let cfg = four_head_config();
    let w = SyntheticGlm5Weights::new(&cfg, 5);
    let a: Vec<u32> = (0..30).map(|i| (i * 53 + 7) % 301).collect();
    let b: Vec<u32> = (0..30).map(|i| (i * 31 + 3) % 301).collect();
    let (ta, tb): (Vec<u32>, Vec<u32>) = ((0..8).collect(), (16..24).rev().collect());
    let mut solo = group(&cfg, &w);
    let alone: Vec<f32> =
        a.chunks(6).enumerate().flat_map(|(i, c)| solo.forward(&[step(c, i * 6, &ta, 0)]).unwrap().data).collect();
    let mut mixed = group(&cfg, &w);
    let mut together = Vec::new();
    let mut at = 0;
    // Sequence `a` in chunks of its own sizes, `b` beside it in other slots, blocks and chunks.
    for (k, len) in [5usize, 1, 9, 4, 11].into_iter().enumerate() {
        let out =
            mixed.forward(&[step(&b[k * 3..k * 3 + 3], k * 3, &tb, 1), step(&a[at..at + len], at, &ta, 0)]).unwrap();
        together.extend(out.rows(1).flatten());
        at += len;
    }
    assert_eq!(at, a.len());
    assert!(bits_equal(&alone, &together), "batch company changed a sequence's logits under TP");
}

#[test]
fn a_prefix_restored_from_the_group_images_equals_the_fresh_run() {
    let cfg = four_head_config();
    let w = SyntheticGlm5Weights::new(&cfg, 6);
    let ids: Vec<u32> = (0..28).map(|i| (i * 71 + 2) % 301).collect();
    let mut tp = group(&cfg, &w);
    let fresh_table: Vec<u32> = (0..8).collect();
    tp.forward(&[step(&ids[..16], 0, &fresh_table, 0)]).unwrap();
    // The page's images, as the pool keeps them: 4 blocks, and the state slot at its end.
    let blocks = tp.read_kv_blocks(&[0, 1, 2, 3]).unwrap();
    let state = tp.read_state_slot(0).unwrap();
    let one_rank = Glm5Backend::new(cfg.clone(), &w, 2, geom()).unwrap();
    assert_eq!(tp.kv_block_bytes(), one_rank.kv_block_bytes(), "the records are replicated: one copy per page");
    assert_eq!(tp.state_slot_bytes(), one_rank.state_slot_bytes(), "the ranks' KDA heads add up to the model's");
    assert_eq!(state.len(), tp.state_slot_bytes());
    let fresh = tp.forward(&[step(&ids[16..], 16, &fresh_table, 0)]).unwrap().data;
    // Restored into other blocks and another slot: bitwise the fresh continuation.
    let moved_table: Vec<u32> = vec![12, 13, 14, 15, 16, 17, 18, 19];
    tp.write_kv_blocks(&[12, 13, 14, 15], &blocks).unwrap();
    tp.write_state_slot(1, &state).unwrap();
    let restored = tp.forward(&[step(&ids[16..], 16, &moved_table, 1)]).unwrap().data;
    assert!(bits_equal(&fresh, &restored), "a restored prefix differs from the fresh run");
    // Rank 1's half of the image is its own KDA heads' state: corrupting it changes the output.
    let mut wrong = state.clone();
    let half = wrong.len() / 2;
    wrong[half..].iter_mut().skip(3).step_by(4).for_each(|b| *b ^= 0x40);
    tp.write_kv_blocks(&[12, 13, 14, 15], &blocks).unwrap();
    tp.write_state_slot(1, &wrong).unwrap();
    let corrupted = tp.forward(&[step(&ids[16..], 16, &moved_table, 1)]).unwrap().data;
    assert!(!bits_equal(&fresh, &corrupted), "rank 1's part of the state image was not used");
    assert!(tp.write_state_slot(1, &state[..half]).unwrap_err().to_string().contains("2 ranks"));
}

/// Proposes the known greedy continuation with every third token wrong, so verification accepts
/// some drafts and rolls the KDA state back past others.
struct Noisy {
    truth: Vec<u32>,
    len: usize,
}

impl DraftSource for Noisy {
    fn name(&self) -> &'static str {
        "noisy"
    }
    fn extend(&mut self, _: u64, tokens: &[u32]) {
        self.len += tokens.len();
    }
    fn propose(&mut self, _: u64, k: usize) -> Vec<u32> {
        let end = (self.len + k).min(self.truth.len());
        (self.len..end).map(|i| if i % 3 == 0 { (self.truth[i] + 1) % 301 } else { self.truth[i] }).collect()
    }
    fn forget(&mut self, _: u64) {
        self.len = 0;
    }
    fn truncate(&mut self, _: u64, len: usize) {
        self.len = len;
    }
    fn len(&self, _: u64) -> usize {
        self.len
    }
    fn sequences(&self) -> usize {
        1
    }
}

#[test]
fn a_drafted_run_equals_the_undrafted_one_in_a_group() {
    let cfg = four_head_config();
    let w = SyntheticGlm5Weights::new(&cfg, 7);
    let prompt: Vec<u32> = (0..13).map(|i| (i * 29 + 5) % 301).collect();
    let mut plain = Runner::new(group(&cfg, &w));
    let undrafted = plain.generate(&prompt, &greedy(24), |_| true).unwrap().ids();
    let mut truth = prompt.clone();
    truth.extend(&undrafted);
    let mut drafter = Noisy { truth, len: 0 };
    let mut drafted_runner = Runner::new(group(&cfg, &w));
    let drafted = drafted_runner
        .generate_drafted(&prompt, &greedy(24), Some((&mut drafter as &mut dyn DraftSource, 4)), |_| true)
        .unwrap()
        .ids();
    assert_eq!(drafted, undrafted, "speculative decoding changed the greedy output under TP");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_serves_a_glm5_group_as_it_serves_one_rank() {
    // The serving path (scheduler, one executor holding the group, KV pool): concurrent greedy
    // requests of different lengths at TP=2 with expert parallelism get the TP=1 replies.
    use shelfserve::actors::{start_engine, EngineOptions, InferenceEngine};
    use shelfserve::generate::{DeviceKind, DeviceSelection};
    let prompts: Vec<Vec<u32>> =
        (0..3u32).map(|s| (0..7 + s * 6).map(|i| (i * 37 + s * 101 + 11) % 256).collect()).collect();
    let mut replies = Vec::new();
    for (tp, ep) in [(1, false), (2, true)] {
        let mut cfg = shelfserve::config::engine::EngineConfig::builtin();
        cfg.scheduler.kv_pool_tokens = 512;
        let device = DeviceSelection {
            kind: DeviceKind::Cpu,
            threads: 2,
            tensor_parallel: tp,
            expert_parallel: ep,
            ..Default::default()
        };
        let e = start_engine(open("glm5/tiny"), cfg, EngineOptions { device, served_model_name: "t".into() })
            .await
            .unwrap();
        let t0 = std::time::Instant::now();
        while !e.is_ready() {
            assert!(t0.elapsed() < std::time::Duration::from_secs(120), "tp={tp}: load timed out");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let outs = futures_util::future::join_all(prompts.iter().map(|p| common::run_greedy(&e, p.clone(), 10))).await;
        replies.push(outs.into_iter().map(|(ids, _)| ids).collect::<Vec<_>>());
        e.shutdown();
    }
    assert_eq!(replies[1], replies[0], "tp=2 ep engine");
    // A split the model cannot take is refused before loading, naming the count.
    let device = DeviceSelection {
        kind: DeviceKind::Cpu,
        threads: 2,
        tensor_parallel: 4,
        expert_parallel: true,
        ..Default::default()
    };
    let cfg = shelfserve::config::engine::EngineConfig::builtin();
    let e = start_engine(open("glm5/tiny"), cfg, EngineOptions { device, served_model_name: "t".into() }).await.err();
    let e = e.expect("tp=4 must be refused").to_string();
    assert!(e.contains("(2)"), "{e}");
}

/// An engine on the tiny fixture split over 2 ranks with expert parallelism: 4-token blocks,
/// 8-token pages, the given pool, spill directory and (with `drafted`) n-gram drafts of 7.
async fn group_engine(
    pool_tokens: usize,
    spill: Option<&std::path::Path>,
    drafted: bool,
) -> std::sync::Arc<shelfserve::actors::Engine> {
    use shelfserve::actors::EngineOptions;
    use shelfserve::generate::{DeviceKind, DeviceSelection};
    let mut cfg = shelfserve::config::engine::EngineConfig::builtin();
    for l in cfg.lanes.iter_mut().filter(|_| drafted) {
        l.speculative = shelfserve::spec::SpeculativeMethod::Ngram;
        l.num_speculative_tokens = 7;
    }
    cfg.scheduler.block_size = 4;
    cfg.scheduler.page_tokens = 8;
    cfg.scheduler.kv_pool_tokens = pool_tokens;
    common::engine::set_spill(&mut cfg, spill);
    let device = DeviceSelection {
        kind: DeviceKind::Cpu,
        threads: 2,
        tensor_parallel: 2,
        expert_parallel: true,
        ..Default::default()
    };
    let opts = EngineOptions { device, served_model_name: "t".into() };
    common::engine::start_ready(open("glm5/tiny"), cfg, opts, std::time::Duration::from_secs(120)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_pages_spill_with_every_ranks_state_and_resume_exactly() {
    // A first turn (drafted), evicted by other work onto disk; its follow-up restored from the
    // spilled pages — block images plus both ranks' KDA state — equals the same group's fresh run.
    let first: Vec<u32> = (0..30u32).map(|i| 1 + (i * 104_729 + 7919) % 255).collect();
    let other = |s: u32| (0..70u32).map(|i| 1 + (s * 7919 + i * 104_729) % 255).collect::<Vec<_>>();
    let dir = tempfile::tempdir().unwrap();
    let e = group_engine(96, Some(dir.path()), true).await;
    let (reply, _) = common::run_greedy(&e, first.clone(), 8).await;
    common::run_greedy(&e, other(60), 4).await;
    common::run_greedy(&e, other(61), 4).await;
    let follow = [first.clone(), reply, vec![5, 6, 7, 8, 9, 10]].concat();
    common::engine::wait_spilled(&e, 4).await;
    let (resumed, usage) = common::run_greedy(&e, follow.clone(), 10).await;
    assert_eq!(usage.cached_tokens, 32, "four pages restored from disk");
    e.shutdown();
    drop(e);
    let fresh_engine = group_engine(512, None, false).await;
    let (fresh, usage) = common::run_greedy(&fresh_engine, follow, 10).await;
    assert_eq!(usage.cached_tokens, 0);
    fresh_engine.shutdown();
    assert_eq!(resumed, fresh, "a reply restored from spill under TP equals a fresh undrafted run");
}
