//! The card's prices against what the CPU backends really allocate, and the CUDA sizing on
//! stated device numbers (no GPU here).

use super::*;
use crate::backend::KvGeometry;
use crate::config::engine::EngineConfig;
use crate::generate::any_cpu_backend_tp;
use crate::model::synthetic::{tiny_llama_config, SyntheticWeights};
use crate::model::DType;

fn llama(dtype: DType) -> ModelBundle {
    let config = tiny_llama_config();
    let weights = SyntheticWeights::new(&config, dtype, 7);
    ModelBundle {
        name: "tiny".into(),
        config,
        weights: Box::new(weights),
        tokenizer: None,
        generation: Default::default(),
    }
}

fn tiny_glm5() -> ModelBundle {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/glm5/tiny");
    crate::model::open(dir.to_str().unwrap(), &crate::model::default_model::CacheDir::from_env()).unwrap()
}

fn scheduler(block_size: usize, pool: usize) -> SchedulerConfig {
    let mut s = EngineConfig::builtin().scheduler;
    s.block_size = block_size;
    s.kv_pool_tokens = pool;
    s.max_num_seqs = 4;
    s.max_num_batched_tokens = 64;
    s
}

/// Build the backend the card describes and compare every number the card prices. The backend
/// counts matrices only; the card adds norms, biases and small f32 tensors, at most
/// `weight_slack` of the whole.
fn assert_card_matches_allocation(
    bundle: &ModelBundle,
    tp: usize,
    s: &SchedulerConfig,
    weight_slack: f64,
) -> CapacityCard {
    let device = ResolvedDevice { tensor_parallel: tp, ..ResolvedDevice::cpu(1) };
    let card = plan(bundle, &device, s, 0, Memory::Host { available: None }).unwrap();
    let geom = KvGeometry {
        block_size: s.block_size,
        num_blocks: card.pool_tokens / s.block_size,
        state_slots: card.state_slots,
    };
    assert_eq!(geom.capacity_tokens(), card.pool_tokens, "the pool is whole blocks");
    let (_, info) = any_cpu_backend_tp(bundle, 1, tp, geom).unwrap();
    assert_eq!(
        card.kv_pool_bytes() + card.state_bytes(),
        info.kv_bytes as u64,
        "{}: card {:?} x {} tokens",
        bundle.name,
        card.kv,
        card.pool_tokens
    );
    let (card_w, real_w) = (card.weight_bytes as f64, info.weight_bytes as f64);
    assert!(card_w >= real_w && card_w <= real_w * (1.0 + weight_slack), "weights: card {card_w} vs loaded {real_w}");
    card
}

#[test]
fn llama_f32_weights_get_an_f32_cache_and_the_card_says_so() {
    let card = assert_card_matches_allocation(&llama(DType::F32), 1, &scheduler(16, 1000), 0.03);
    assert_eq!(card.kv.dtype, KvDtype::F32);
    // 2 (K, V) x 2 layers x 2 kv heads x 16 dims x 4 bytes.
    assert_eq!(card.kv.bytes_per_token, 512);
    assert_eq!(card.pool_tokens, 1008, "1000 rounded up to whole 16-token blocks");
    assert_eq!(card.pool_sized_by, PoolSizedBy::Configured);
}

#[test]
fn quantized_llama_gets_an_f16_cache_half_the_bytes() {
    // Issue 21: the card priced the default (Q4_1/Q8_0 GGUF) model's f16 cache as f32, twice
    // what the pool loads.
    let card = assert_card_matches_allocation(&llama(DType::Q8_0), 1, &scheduler(16, 0), 0.03);
    assert_eq!(card.kv.dtype, KvDtype::F16);
    assert_eq!(card.kv.bytes_per_token, 256);
    assert_eq!(card.pool_sized_by, PoolSizedBy::ContextRule);
    assert_eq!(card.pool_tokens, context_rule_pool(2048));
}

/// K-quant matrices stay in their super-blocks on the CPU, so the card prices them at their
/// stored bytes (Q4_K: 144 per 256 weights, 18% of f32) and the backend loads exactly that.
#[test]
fn k_quant_weights_are_priced_at_their_stored_bytes() {
    let mut config = tiny_llama_config();
    (config.hidden_size, config.intermediate_size, config.head_dim) = (256, 256, 64);
    // embed + untied lm_head, and per layer q, o, gate, up, down (256x256) plus k, v (128x256).
    let matrix_elems = 2 * 256 * 256 + 2 * (5 * 256 * 256 + 2 * 128 * 256);
    let norm_bytes = (2 * 2 * 256 + 256) * 4;
    for dtype in [DType::Q4_K, DType::Q5_K, DType::Q6_K] {
        let bundle = ModelBundle {
            name: format!("tiny-{dtype}"),
            config: config.clone(),
            weights: Box::new(SyntheticWeights::new(&config, dtype, 7)),
            tokenizer: None,
            generation: Default::default(),
        };
        let card = assert_card_matches_allocation(&bundle, 1, &scheduler(16, 0), 0.03);
        let stored = matrix_elems / 256 * dtype.block_bytes() + norm_bytes;
        assert_eq!(card.weight_bytes, stored as u64, "{dtype}");
        assert_eq!(card.kv.dtype, KvDtype::F16, "{dtype}: a quantized GGUF-style model gets the f16 cache");
    }
}

#[test]
fn tensor_parallel_ranks_split_the_cache_and_the_card_sums_them() {
    let card = assert_card_matches_allocation(&llama(DType::F32), 2, &scheduler(16, 512), 0.03);
    assert_eq!(card.kv.bytes_per_token, 512);
    assert_eq!(card.kv.rank_bytes_per_token, 256, "one kv head per rank");
}

#[test]
fn glm5_next_prices_latents_per_token_and_state_per_sequence() {
    let bundle = tiny_glm5();
    let card = assert_card_matches_allocation(&bundle, 1, &scheduler(8, 256), 0.25);
    assert_eq!(card.kv.dtype, KvDtype::F32);
    assert!(card.kv.state_slot_bytes > 0 && card.state_bytes() == 4 * card.kv.state_slot_bytes);
    let g = crate::model::glm5_next::read_config(bundle.weights.origin()).unwrap();
    let accounting = crate::model::glm5_next::accounting::decode_cost(&g, 1, 4.0, 4);
    assert_eq!(card.kv.state_slot_bytes, accounting.recurrent_state_bytes, "the accounting's state is the slot");
}

#[test]
fn a_host_that_cannot_hold_the_pool_is_refused_with_the_numbers() {
    let bundle = llama(DType::F32);
    let s = scheduler(16, 4096);
    let device = ResolvedDevice::cpu(1);
    let fits = plan(&bundle, &device, &s, 0, Memory::Host { available: None }).unwrap();
    let need = fits.weight_bytes + fits.kv_pool_bytes();
    assert!(plan(&bundle, &device, &s, 0, Memory::Host { available: Some(need) }).is_ok());
    let e = plan(&bundle, &device, &s, 0, Memory::Host { available: Some(need - 1) }).unwrap_err();
    assert!(e.contains("4096 tokens x 512 bytes f32") && e.contains("at most 4095"), "{e}");
}

/// The snapshot rule of hybrid models: one state image per cached page, refused with the knobs.
#[test]
fn hybrid_snapshots_are_counted_and_refused_by_name() {
    let bundle = tiny_glm5();
    let s = scheduler(8, 512);
    let device = ResolvedDevice::cpu(1);
    let card = plan(&bundle, &device, &s, 16, Memory::Host { available: None }).unwrap();
    assert_eq!(card.max_snapshot_bytes(), 32 * card.kv.state_slot_bytes);
    let base = card.weight_bytes + card.kv_pool_bytes() + card.state_bytes();
    assert!(card.check_host_fits(Some(base + card.max_snapshot_bytes())).is_ok());
    let e = card.check_host_fits(Some(base + card.max_snapshot_bytes() - 1)).unwrap_err();
    assert!(e.contains("--kv-pool-tokens") && e.contains("--page-tokens"), "{e}");
    let no_pages = plan(&bundle, &device, &s, 0, Memory::Host { available: None }).unwrap();
    assert_eq!(no_pages.max_snapshot_bytes(), 0, "no pages, no snapshots");
}

#[test]
fn on_cuda_the_pool_fills_the_device_budget_in_bf16() {
    let bundle = llama(DType::F32);
    let cuda = ResolvedDevice { kind: ResolvedKind::Cuda, ..ResolvedDevice::cpu(1) };
    let kv = kv_cost(&bundle, &cuda).unwrap();
    assert_eq!((kv.dtype, kv.bytes_per_token), (KvDtype::Bf16, 256), "bf16: half the f32 price");
    let gib = 1u64 << 30;
    let memory = Memory::Device { total: 4 * gib, free: 4 * gib };
    // Four sequences of 2048 tokens can never use more than 8192 tokens of the ~14 M that fit.
    let few = plan(&bundle, &cuda, &scheduler(16, 0), 0, memory).unwrap();
    assert_eq!((few.pool_tokens, few.pool_sized_by), (4 * 2048, PoolSizedBy::SchedulerLimit));
    let mut s = scheduler(16, 0);
    s.max_num_seqs = 10_000;
    let card = plan(&bundle, &cuda, &s, 0, memory).unwrap();
    let g = card.gpu.expect("sized against the device");
    assert_eq!(card.pool_sized_by, PoolSizedBy::DeviceMemory);
    assert_eq!(card.weight_bytes, resident_weight_bytes(&bundle, &cuda));
    assert_eq!(g.weights, card.weight_bytes, "one rank holds all the weights");
    let room = (4.0 * gib as f64 * 0.9) as u64 - g.weights - g.workspace;
    assert_eq!(card.pool_tokens, (room / (256 * 16)) as usize * 16);
    assert_eq!(card.max_context, 2048, "the model's context, not the pool, limits a sequence");
    // An explicit pool beyond the budget is refused before anything loads.
    let mut big = s.clone();
    big.kv_pool_tokens = card.pool_tokens + 64;
    let e = plan(&bundle, &cuda, &big, 0, memory).unwrap_err();
    assert!(e.contains("--kv-pool-tokens") && e.contains("--gpu-memory-utilization 0.90"), "{e}");
    // Two ranks: each holds half the KV per token.
    let tp2 = ResolvedDevice { tensor_parallel: 2, ..cuda };
    let card2 = plan(&bundle, &tp2, &s, 0, memory).unwrap();
    assert_eq!(card2.kv.rank_bytes_per_token, 128);
    assert!(card2.pool_tokens > card.pool_tokens);
}
