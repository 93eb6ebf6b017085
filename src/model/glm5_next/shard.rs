//! How `glm5_next` splits over a tensor-parallel group: which heads, rows, experts and vocabulary
//! rows a rank holds, and the config a rank's compute sees. Plain arithmetic over the config,
//! checked before any weight is read; the backends slice their weights by it.
//!
//! - **KDA**: by linear-attention heads. q/k/v (and their conv channels, `f_b`, `g_b`, `dt_bias`,
//!   `A_log`, `b_proj`) column-parallel, `o_proj` row-parallel (partial sums all-reduced). The
//!   low-rank `f_a`/`g_a` and the per-channel `o_norm` are small and replicated. Each rank's
//!   state slot holds its heads' conv window and delta-rule state only.
//! - **MLA**: by attention heads. `q_b` and `kv_b` by heads, `o_proj` row-parallel. The latent
//!   (`kv_a`, its norm, the cached `c` rows) is shared by every head, so it is computed and
//!   cached on every rank: the paged records are replicated, not split.
//! - **DSA indexer**: `wq_b` by indexer heads; the rows are all-gathered so every rank scores the
//!   pools over all heads in one order and selects exactly what one rank would (the selection is a
//!   discontinuous choice: a differently rounded score could flip it). `wk`, the pool gate and
//!   `weights_proj` are one small row each per token and replicated.
//! - **Dense MLP and shared expert**: gate/up column-parallel, down row-parallel (like llama).
//! - **Routed experts**: plain TP splits every expert's intermediate rows like the dense MLP;
//!   expert parallel gives each rank `E / N` whole experts. Either way the FFN's output is one
//!   partial sum per rank, all-reduced once per layer.
//! - **Router and mHC**: computed redundantly on every rank from the replicated residual streams
//!   (they are tiny: `E × D` and `(2+M)·M × M·D` rows per token), so no broadcast is needed.
//! - **lm_head**: vocabulary-parallel, logits slices all-gathered; the embedding is replicated
//!   (a row lookup reads one row per token).

use std::ops::Range;

use super::Glm5Config;
use crate::parallel::{PlanError, TpRank};

/// One rank's share of a `glm5_next` model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Glm5Shard {
    pub tp: TpRank,
    /// MLA attention heads.
    pub mla_heads: Range<usize>,
    /// KDA (linear-attention) heads.
    pub kda_heads: Range<usize>,
    /// DSA indexer heads whose `wq_b` rows this rank holds.
    pub index_heads: Range<usize>,
    /// Dense MLP intermediate rows.
    pub dense_rows: Range<usize>,
    /// Shared-expert intermediate rows.
    pub shared_rows: Range<usize>,
    /// Routed-expert intermediate rows (all of them under expert parallelism).
    pub expert_rows: Range<usize>,
    /// Routed experts held (all of them under plain tensor parallelism).
    pub experts: Range<usize>,
    pub expert_parallel: bool,
    /// `lm_head` rows (last rank may hold fewer).
    pub vocab: Range<usize>,
}

impl Glm5Shard {
    /// The plan for `tp`; a group size that does not divide a count it splits is refused with the
    /// count named.
    pub fn new(c: &Glm5Config, tp: TpRank, expert_parallel: bool) -> Result<Self, PlanError> {
        let (i, e) = (c.moe_intermediate_size, c.n_routed_experts);
        let (expert_rows, experts) = if expert_parallel {
            (0..i, tp.even("the routed experts (expert parallel)", e)?)
        } else {
            (tp.even("the routed experts' intermediate size", i)?, 0..e)
        };
        Ok(Glm5Shard {
            tp,
            mla_heads: tp.even("the MLA attention heads", c.num_attention_heads)?,
            kda_heads: tp.even("the KDA (linear attention) heads", c.linear_num_heads)?,
            index_heads: tp.even("the DSA indexer heads", c.index_n_heads)?,
            dense_rows: tp.even("the dense MLP intermediate size", c.intermediate_size)?,
            shared_rows: tp.even("the shared experts' intermediate size", i * c.n_shared_experts)?,
            expert_rows,
            experts,
            expert_parallel,
            vocab: tp.vocab(c.vocab_size),
        })
    }

    /// The config this rank's compute runs with: its own MLA and KDA head counts (so its cache
    /// layout holds only its heads' state); everything else as the model's, the indexer scoring
    /// over all heads after the gather.
    pub fn local_config(&self, c: &Glm5Config) -> Glm5Config {
        Glm5Config { num_attention_heads: self.mla_heads.len(), linear_num_heads: self.kda_heads.len(), ..c.clone() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn cfg() -> Glm5Config {
        let json = r#"{"model_type": "glm5_next", "vocab_size": 301, "hidden_size": 32, "intermediate_size": 64,
          "moe_intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 4, "linear_num_heads": 4,
          "n_routed_experts": 8, "num_experts_per_tok": 2, "index_n_heads": 4, "n_group": 1, "topk_group": 1}"#;
        Glm5Config::from_hf_json(json, Path::new("config.json")).unwrap()
    }

    #[test]
    fn every_head_row_and_expert_is_held_exactly_once() {
        let c = cfg();
        for world in [1, 2, 4] {
            for ep in [false, true] {
                let (mut heads, mut experts, mut rows, mut vocab) = (vec![0; 4], vec![0; 8], vec![0; 16], vec![0; 301]);
                for rank in 0..world {
                    let s = Glm5Shard::new(&c, TpRank::new(rank, world).unwrap(), ep).unwrap();
                    s.mla_heads.clone().for_each(|h| heads[h] += 1);
                    s.experts.clone().for_each(|x| experts[x] += 1);
                    s.expert_rows.clone().for_each(|x| rows[x] += 1);
                    s.vocab.clone().for_each(|x| vocab[x] += 1);
                    let local = s.local_config(&c);
                    assert_eq!((local.num_attention_heads, local.linear_num_heads), (4 / world, 4 / world));
                    assert_eq!(local.index_n_heads, 4, "the indexer scores over every head");
                }
                assert!(heads.iter().all(|&n| n == 1) && vocab.iter().all(|&n| n == 1));
                // Expert parallel: each expert on one rank, whole; plain TP: every expert on every
                // rank, its rows split.
                let (e_count, r_count) = if ep { (1, world) } else { (world, 1) };
                assert!(experts.iter().all(|&n| n == e_count), "world {world} ep {ep}: {experts:?}");
                assert!(rows.iter().all(|&n| n == r_count), "world {world} ep {ep}: {rows:?}");
            }
        }
    }

    #[test]
    fn indivisible_splits_name_the_count() {
        let c = cfg();
        let e =
            |c: &Glm5Config, world, ep| Glm5Shard::new(c, TpRank::new(0, world).unwrap(), ep).unwrap_err().to_string();
        // Every MLP size divides by 3 here, so the heads are what is named.
        let c3 = Glm5Config { moe_intermediate_size: 24, intermediate_size: 60, ..cfg() };
        assert!(e(&c3, 3, false).contains("MLA attention heads (4)"), "{}", e(&c3, 3, false));
        assert!(e(&c, 3, false).contains("intermediate size (16)"), "{}", e(&c, 3, false));
        let c6 = Glm5Config {
            num_attention_heads: 6,
            linear_num_heads: 6,
            index_n_heads: 6,
            intermediate_size: 60,
            ..cfg()
        };
        assert!(e(&c6, 3, true).contains("routed experts (expert parallel) (8)"), "{}", e(&c6, 3, true));
        let c12 = Glm5Config { n_routed_experts: 12, ..c6.clone() };
        assert!(e(&c12, 3, false).contains("intermediate size (16)"), "{}", e(&c12, 3, false));
        assert!(Glm5Shard::new(&c12, TpRank::new(2, 3).unwrap(), true).is_err(), "the shared expert's 16 rows");
    }
}
