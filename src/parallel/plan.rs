//! The tensor-parallel sharding plan: which slice of each weight a rank holds and where the
//! partial results meet. Kept out of model code, so a model file reads the same at any rank count:
//! it asks the plan for its slice of a tensor and calls the collective the plan names.
//!
//! Llama family (Megatron-style):
//! - q/k/v projections: column-parallel by heads (each rank holds whole query heads and the kv
//!   heads they share, so attention runs locally with no communication; with fewer kv heads than
//!   ranks, each kv head is replicated on the ranks whose query heads use it);
//! - o_proj: row-parallel (input split by the same heads), partial sums all-reduced;
//! - gate/up: column-parallel by intermediate rows; down: row-parallel, all-reduced;
//! - embedding and lm_head: vocabulary-parallel; the embedding's rows outside a rank's range
//!   are zeros summed by an all-reduce, the lm_head's logits slices are all-gathered.
//!
//! glm5_next follows the same rules: KDA and MLA heads column/row-parallel like attention heads,
//! MLA's kv_b by heads and o_proj by rows, routed experts split by expert (each rank owns
//! `experts / world` whole experts, outputs all-reduced), the shared expert like a dense MLP.

use std::ops::Range;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("tensor parallel size {world} does not divide {what} ({count}); choose a size that divides it")]
    Indivisible { what: &'static str, count: usize, world: usize },
    #[error(
        "tensor parallel size {world} neither divides the key/value heads ({kv_heads}) nor is a multiple of them; \
         choose a size that does one or the other"
    )]
    KvHeads { kv_heads: usize, world: usize },
    #[error("invalid tensor parallel setting: {0}")]
    Invalid(String),
}

/// How a weight is laid out across ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds all of it (norms, small vectors).
    Replicated,
    /// Output rows split: each rank computes a slice of the outputs from the full input.
    Columns,
    /// Input columns split: each rank computes a partial sum of every output; all-reduce after.
    Rows,
    /// Vocabulary rows split unevenly (last rank may hold fewer); see the module doc.
    Vocab,
}

/// One rank's place in a tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TpRank {
    pub rank: usize,
    pub world: usize,
}

impl TpRank {
    pub fn new(rank: usize, world: usize) -> Result<Self, PlanError> {
        if world == 0 || rank >= world {
            return Err(PlanError::Invalid(format!("rank {rank} of a group of {world}")));
        }
        Ok(Self { rank, world })
    }

    pub fn single() -> Self {
        Self { rank: 0, world: 1 }
    }

    /// This rank's equal share of `count` items (heads, rows, experts); `count` must divide.
    pub fn even(&self, what: &'static str, count: usize) -> Result<Range<usize>, PlanError> {
        if !count.is_multiple_of(self.world) {
            return Err(PlanError::Indivisible { what, count, world: self.world });
        }
        let per = count / self.world;
        Ok(self.rank * per..(self.rank + 1) * per)
    }

    /// This rank's share of a vocabulary of `vocab` rows: `ceil(vocab / world)` per rank, the last
    /// rank taking the remainder (possibly empty), so every rank's logits slice but the last has
    /// the same length and an all-gather needs only padding on the last.
    pub fn vocab(&self, vocab: usize) -> Range<usize> {
        let per = vocab.div_ceil(self.world);
        let start = (self.rank * per).min(vocab);
        start..((self.rank + 1) * per).min(vocab)
    }
}

/// A rank's slice of a llama-family layer, in units the model code uses directly.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LlamaShard {
    pub q_heads: Range<usize>,
    pub kv_heads: Range<usize>,
    pub intermediate: Range<usize>,
    pub vocab: Range<usize>,
}

impl LlamaShard {
    /// Rank `tp`'s slice of a model of `cfg`'s widths (see [`LlamaShard::new`]).
    pub fn of_model(tp: TpRank, cfg: &crate::config::LlamaConfig) -> Result<Self, PlanError> {
        Self::new(tp, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size)
    }

    /// The plan for `heads` query heads, `kv_heads` key/value heads, an MLP of `intermediate`
    /// rows and `vocab` tokens. Query heads stay with the kv head they share (GQA): with at least
    /// as many kv heads as ranks they are split evenly; with fewer (a group size that is a
    /// multiple of the kv heads) each kv head is replicated on the ranks whose query heads use
    /// it, so every rank holds exactly one kv head and attention stays local.
    pub fn new(
        tp: TpRank,
        heads: usize,
        kv_heads: usize,
        intermediate: usize,
        vocab: usize,
    ) -> Result<Self, PlanError> {
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(PlanError::Invalid(format!("{heads} query heads do not group over {kv_heads} kv heads")));
        }
        let q_heads = tp.even("the attention heads", heads)?;
        let kv_heads = if kv_heads.is_multiple_of(tp.world) {
            tp.even("the key/value heads", kv_heads)?
        } else if tp.world.is_multiple_of(kv_heads) {
            // `heads / world` query heads per rank divide the `heads / kv_heads` of one group
            // (world is a multiple of kv_heads), so a rank's heads all use the same kv head.
            let kv = q_heads.start / (heads / kv_heads);
            kv..kv + 1
        } else {
            return Err(PlanError::KvHeads { kv_heads, world: tp.world });
        };
        Ok(Self {
            q_heads,
            kv_heads,
            intermediate: tp.even("the MLP intermediate size", intermediate)?,
            vocab: tp.vocab(vocab),
        })
    }

    /// How each llama tensor (by its name suffix) is split.
    pub fn split_of(tensor: &str) -> Split {
        let name = tensor.trim_end_matches(".weight").trim_end_matches(".bias");
        match name.rsplit('.').next().unwrap_or(name) {
            "q_proj" | "k_proj" | "v_proj" | "gate_proj" | "up_proj" => Split::Columns,
            "o_proj" | "down_proj" => Split::Rows,
            "embed_tokens" | "lm_head" => Split::Vocab,
            _ => Split::Replicated,
        }
    }
}

/// Rows `range` of a row-major `[rows, cols]` matrix.
pub fn take_rows(m: &[f32], cols: usize, range: Range<usize>) -> Vec<f32> {
    m[range.start * cols..range.end * cols].to_vec()
}

/// Columns `range` of a row-major `[rows, cols]` matrix.
pub fn take_cols(m: &[f32], cols: usize, range: Range<usize>) -> Vec<f32> {
    m.chunks_exact(cols).flat_map(|row| row[range.clone()].iter().copied()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_everything_exactly_once() {
        for world in [1, 2, 3, 4] {
            let mut heads = [0; 12];
            let mut vocab = vec![0; 49_153];
            for rank in 0..world {
                let tp = TpRank::new(rank, world).unwrap();
                let s = LlamaShard::new(tp, 12, if world == 3 { 3 } else { 4 }, 1536, 49_153).unwrap();
                s.q_heads.clone().for_each(|h| heads[h] += 1);
                s.vocab.clone().for_each(|v| vocab[v] += 1);
                assert_eq!(s.q_heads.len() * world, 12);
            }
            assert!(heads.iter().all(|&c| c == 1), "world {world}");
            assert!(vocab.iter().all(|&c| c == 1), "world {world}");
        }
    }

    #[test]
    fn fewer_kv_heads_than_ranks_are_replicated_where_their_query_heads_go() {
        // 8 query heads over 2 kv heads (groups of 4) at 4 ranks: ranks 0-1 use kv head 0,
        // ranks 2-3 kv head 1; at 8 ranks, one query head each, same pairing by fours.
        for (world, expect) in [(4, vec![0, 0, 1, 1]), (8, vec![0, 0, 0, 0, 1, 1, 1, 1])] {
            for (rank, &kv) in expect.iter().enumerate() {
                let s = LlamaShard::new(TpRank::new(rank, world).unwrap(), 8, 2, 64, 100).unwrap();
                assert_eq!(s.kv_heads, kv..kv + 1, "world {world} rank {rank}");
                // Every query head of the rank belongs to that kv head's group.
                assert!(s.q_heads.clone().all(|h| h / 4 == kv));
            }
        }
        // Multi-query attention (one kv head) at any size that divides the query heads.
        let s = LlamaShard::new(TpRank::new(2, 3).unwrap(), 9, 1, 30, 100).unwrap();
        assert_eq!((s.q_heads, s.kv_heads), (6..9, 0..1));
        let e = LlamaShard::new(TpRank::new(0, 6).unwrap(), 12, 4, 60, 100).unwrap_err().to_string();
        assert!(e.contains("neither divides the key/value heads (4)"), "{e}");
    }

    #[test]
    fn indivisible_sizes_name_the_number() {
        let tp = TpRank::new(0, 4).unwrap();
        let e = LlamaShard::new(tp, 9, 3, 1536, 100).unwrap_err().to_string();
        assert!(e.contains("attention heads (9)"), "{e}");
        let e = LlamaShard::new(TpRank::new(1, 2).unwrap(), 4, 4, 1535, 100).unwrap_err().to_string();
        assert!(e.contains("intermediate size (1535)"), "{e}");
        assert!(TpRank::new(2, 2).is_err() && TpRank::new(0, 0).is_err());
    }

    #[test]
    fn tensor_splits_and_slicing() {
        assert_eq!(LlamaShard::split_of("model.layers.3.self_attn.q_proj.weight"), Split::Columns);
        assert_eq!(LlamaShard::split_of("model.layers.3.mlp.down_proj.weight"), Split::Rows);
        assert_eq!(LlamaShard::split_of("model.embed_tokens.weight"), Split::Vocab);
        assert_eq!(LlamaShard::split_of("model.layers.0.input_layernorm.weight"), Split::Replicated);
        let m: Vec<f32> = (0..12).map(|x| x as f32).collect(); // 3 x 4
        assert_eq!(take_rows(&m, 4, 1..3), (4..12).map(|x| x as f32).collect::<Vec<_>>());
        assert_eq!(take_cols(&m, 4, 2..4), vec![2.0, 3.0, 6.0, 7.0, 10.0, 11.0]);
    }
}
