//! Roofline accounting for `glm5_next` decode, from the config alone (spec §8): active
//! parameters and weight bytes per decoded token, linear FLOPs, the context-dependent MLA and
//! indexer work and cache reads, the fixed per-sequence KDA state and its traffic, and the cache
//! bytes each token adds (the capacity card's "KV bytes per token"); and what a serving
//! configuration (`configs/glm5-next.toml`) makes of them: pool, state slots and page images.

use super::config::{FfnKind, Glm5Config, MixerKind};
use crate::config::engine::SchedulerConfig;

/// Per-token decode cost of one sequence at a given context length (batch 1).
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeCost {
    /// Parameters a decode step reads: every non-expert weight, `num_experts_per_tok` routed
    /// experts per MoE layer, all of `lm_head`, one embedding row, norms and fp32 islands.
    pub active_params: u64,
    /// `active_params` at the given bytes per weight.
    pub weight_bytes: f64,
    /// 2 FLOPs per weight of every matrix the token multiplies (projections, experts, router,
    /// mHC maps, `lm_head`).
    pub linear_flops: u64,
    /// MLA in absorbed form over the selected latents (absorb, scores, context, value-up).
    pub mla_flops: u64,
    /// Indexer scoring against every complete pool.
    pub indexer_flops: u64,
    /// KDA state update and readout.
    pub kda_flops: u64,
    /// Latents and pooled indexer keys read at this context.
    pub cache_read_bytes: u64,
    /// Fixed recurrent state of one sequence (KDA f32 states + conv windows).
    pub recurrent_state_bytes: u64,
    /// Recurrent state read and written back per token.
    pub recurrent_traffic_bytes: u64,
    /// Cache growth per token: MLA latents plus pooled indexer keys (amortised over a pool).
    pub kv_bytes_per_token: f64,
}

impl DecodeCost {
    pub fn total_flops(&self) -> u64 {
        self.linear_flops + self.mla_flops + self.indexer_flops + self.kda_flops
    }

    /// Bytes read per token: weights, cache and recurrent state traffic.
    pub fn total_bytes(&self) -> f64 {
        self.weight_bytes + (self.cache_read_bytes + self.recurrent_traffic_bytes) as f64
    }
}

/// Decode cost at `context` tokens, with weights of `weight_bytes_per_param` bytes (fp32 islands
/// counted at the same width) and cache/conv elements of `cache_elem_bytes` (KDA states are
/// always f32).
pub fn decode_cost(c: &Glm5Config, context: usize, weight_bytes_per_param: f64, cache_elem_bytes: usize) -> DecodeCost {
    let u = |x: usize| x as u64;
    let d = u(c.hidden_size);
    let (m, heads) = (u(c.hc_mult), u(c.num_attention_heads));
    let (q, hd, lh, kw) =
        (u(c.linear_qkv_dim()), u(c.linear_head_dim), u(c.linear_num_heads), u(c.linear_conv_kernel_dim));
    let (rq, rkv, dn, dv) = (u(c.q_lora_rank), u(c.kv_lora_rank), u(c.qk_nope_head_dim), u(c.v_head_dim));
    let (hi, di, pool) = (u(c.index_n_heads), u(c.index_head_dim), u(c.index_kpool));
    let (e, k, ie) = (u(c.n_routed_experts), u(c.num_experts_per_tok), u(c.moe_intermediate_size));
    let pools = u(context) / pool;
    let n_sel = u(context).min(u(c.index_topk) + pool - 1);
    let elem = u(cache_elem_bytes);

    let (mut matmul, mut other) = (0u64, 0u64);
    let (mut mla_flops, mut indexer_flops, mut kda_flops) = (0u64, 0u64, 0u64);
    let (mut cache_read, mut state, mut kv_per_token) = (0u64, 0u64, 0f64);
    for l in 0..c.num_hidden_layers {
        // mHC maps (two sites) and the two RMSNorms.
        let hc_rows = (2 + m) * m;
        matmul += 2 * hc_rows * m * d;
        other += 2 * (hc_rows + 3) + 2 * d;
        match c.layer_types[l] {
            MixerKind::Kda => {
                matmul += 3 * q * d + d * q + 2 * (hd * d + q * hd) + lh * d;
                other += 3 * q * kw + q + lh + hd;
                kda_flops += 7 * lh * hd * hd + 2 * 3 * q * kw;
                state += lh * hd * hd * 4 + (kw - 1) * 3 * q * elem;
            }
            MixerKind::Dsa => {
                matmul += rq * d + heads * dn * rq + rkv * d + heads * (dn + dv) * rkv + d * heads * dv;
                other += rq + rkv;
                mla_flops += 2 * heads * dn * rkv + 4 * heads * rkv * n_sel + 2 * heads * dv * rkv;
                cache_read += n_sel * rkv * elem;
                kv_per_token += (rkv * elem) as f64;
                if c.has_indexer(l) {
                    matmul += hi * di * rq + di * d + hi * d + di * d;
                    other += pool * di + 2 * di;
                    indexer_flops += (2 * hi * di + 2 * hi) * pools;
                    cache_read += pools * di * elem;
                    kv_per_token += (di * elem) as f64 / pool as f64;
                }
            }
        }
        match c.mlp_layer_types[l] {
            FfnKind::Dense => matmul += 3 * u(c.intermediate_size) * d,
            FfnKind::Moe => {
                matmul += e * d + k * 3 * ie * d + 3 * ie * u(c.n_shared_experts) * d;
                other += e;
            }
        }
    }
    let vocab = u(c.vocab_size);
    matmul += vocab * d;
    other += d + d; // final norm, one embedding row
    let active = matmul + other;
    DecodeCost {
        active_params: active,
        weight_bytes: active as f64 * weight_bytes_per_param,
        linear_flops: 2 * matmul,
        mla_flops,
        indexer_flops,
        kda_flops,
        cache_read_bytes: cache_read,
        recurrent_state_bytes: state,
        recurrent_traffic_bytes: 2 * state,
        kv_bytes_per_token: kv_per_token,
    }
}

/// Memory a serving configuration reserves for one model, from its config and the scheduler
/// section of the serving TOML.
#[derive(Clone, Debug, PartialEq)]
pub struct ServingMemory {
    /// Latents and pooled indexer keys of `kv_pool_tokens` tokens.
    pub kv_pool_bytes: f64,
    /// One recurrent-state slot per sequence a step may carry (`max_num_seqs`).
    pub state_slot_bytes: u64,
    /// A cached page: `page_tokens` tokens of cache plus the KDA state snapshot at its end.
    pub page_image_bytes: f64,
    /// Share of a page image that is the recurrent snapshot.
    pub snapshot_share: f64,
}

/// What `sched` reserves for model `c` with cache elements of `cache_elem_bytes` bytes.
pub fn serving_memory(c: &Glm5Config, sched: &SchedulerConfig, cache_elem_bytes: usize) -> ServingMemory {
    let cost = decode_cost(c, 1, 2.0, cache_elem_bytes);
    let state = cost.recurrent_state_bytes;
    let page_kv = cost.kv_bytes_per_token * sched.page_tokens as f64;
    ServingMemory {
        kv_pool_bytes: cost.kv_bytes_per_token * sched.kv_pool_tokens as f64,
        state_slot_bytes: state * sched.max_num_seqs as u64,
        page_image_bytes: page_kv + state as f64,
        snapshot_share: state as f64 / (page_kv + state as f64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn full() -> Glm5Config {
        Glm5Config::from_hf_json(r#"{"model_type": "glm5_next", "text_config": {}}"#, Path::new("config.json")).unwrap()
    }

    #[test]
    fn full_config_matches_the_spec_tables() {
        let c = full();
        let cost = decode_cost(&c, 1 << 20, 2.0, 2);
        // Spec §8.1: 16,742,354,238 active parameters per token.
        assert_eq!(cost.active_params, 16_742_354_238);
        // §8.3: 11 × 512 × 2 B latents + 11 × 128 × 2 B / 16 pooled keys per token.
        assert_eq!(cost.kv_bytes_per_token, 11_264.0 + 176.0);
        // 34 KDA layers × (64·128·128·4 B + 3·8192·3·2 B).
        assert_eq!(cost.recurrent_state_bytes, 34 * (64 * 128 * 128 * 4 + 3 * 8192 * 3 * 2));
        // Indexer at 1M context: 11 × 8,256 × 65,536 FLOPs.
        assert_eq!(cost.indexer_flops, 11 * 8256 * 65_536);
        // MLA over the full 2063-token selection: 11 × 131,072 × 2063 plus absorb/value-up.
        assert_eq!(cost.mla_flops, 11 * (131_072 * 2063 + 2 * 64 * 256 * 512 * 2));
        let gflop = cost.linear_flops as f64 / 1e9;
        assert!((gflop - 33.48).abs() < 0.01, "{gflop}");
    }

    #[test]
    fn short_contexts_read_only_what_exists() {
        let c = full();
        let cost = decode_cost(&c, 100, 2.0, 2);
        assert_eq!(cost.indexer_flops, 11 * 8256 * 6);
        assert_eq!(cost.cache_read_bytes, 11 * (100 * 512 * 2 + 6 * 128 * 2));
    }

    /// `configs/glm5-next.toml` is a valid serving config for the full model: page size 3584 in
    /// whole blocks, a step budget that needs no correction, speculative decoding off (refused
    /// for this model). Prints the memory it reserves (docs/glm5_next.md).
    #[test]
    fn glm5_next_serving_config_loads_and_fits_its_pages() {
        use crate::config::engine::EngineConfig;
        use crate::spec::SpeculativeMethod;
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/glm5-next.toml");
        let cfg = EngineConfig::load(&path).unwrap();
        let s = &cfg.scheduler;
        assert_eq!(s.page_tokens, 3584);
        assert_eq!(s.page_tokens % s.block_size, 0);
        assert_eq!(
            crate::sched::align_budget_to_pages(s.max_num_batched_tokens, s.page_tokens, s.max_num_seqs),
            Ok(s.max_num_batched_tokens)
        );
        assert!(cfg.lanes.iter().all(|l| l.speculative == SpeculativeMethod::None));
        let c = full();
        assert!(s.kv_pool_tokens >= c.max_position_embeddings, "one sequence of the full context fits the pool");
        let m = serving_memory(&c, s, 2);
        assert_eq!(m.kv_pool_bytes, 11_440.0 * 1_048_576.0);
        assert_eq!(m.state_slot_bytes, 32 * 147_619_840);
        assert_eq!(m.page_image_bytes, 11_440.0 * 3584.0 + 147_619_840.0);
        let snapshot = m.page_image_bytes * m.snapshot_share;
        println!(
            "configs/glm5-next.toml: pool {} tokens = {:.2} GB | {} state slots = {:.2} GB | page {} tokens: \
             image {:.1} MB ({:.1} MB cache + {:.1} MB KDA snapshot, {:.0} % snapshot) | step budget {} tokens",
            s.kv_pool_tokens,
            m.kv_pool_bytes / 1e9,
            s.max_num_seqs,
            m.state_slot_bytes as f64 / 1e9,
            s.page_tokens,
            m.page_image_bytes / 1e6,
            (m.page_image_bytes - snapshot) / 1e6,
            snapshot / 1e6,
            m.snapshot_share * 100.0,
            s.max_num_batched_tokens,
        );
    }

    /// The table in `docs/glm5_next.md` (`cargo test --lib accounting -- --nocapture`).
    #[test]
    fn print_full_config_table() {
        let c = full();
        println!("| context | GFLOP/token | weights GB | cache read MB | KDA state traffic MB | total GB/token |");
        for t in [4096usize, 32_768, 131_072, 1 << 20] {
            let x = decode_cost(&c, t, 2.0, 2);
            println!(
                "| {t} | {:.2} (linear {:.2}, MLA {:.3}, indexer {:.3}, KDA {:.3}) | {:.2} | {:.1} | {:.1} | {:.2} |",
                x.total_flops() as f64 / 1e9,
                x.linear_flops as f64 / 1e9,
                x.mla_flops as f64 / 1e9,
                x.indexer_flops as f64 / 1e9,
                x.kda_flops as f64 / 1e9,
                x.weight_bytes / 1e9,
                x.cache_read_bytes as f64 / 1e6,
                x.recurrent_traffic_bytes as f64 / 1e6,
                x.total_bytes() / 1e9
            );
        }
        let x = decode_cost(&c, 1, 2.0, 2);
        println!(
            "active params {} | KV bytes/token {} | recurrent state/seq {} B",
            x.active_params, x.kv_bytes_per_token, x.recurrent_state_bytes
        );
    }
}
