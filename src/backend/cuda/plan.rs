//! Host-side layout of one CUDA step: flattened token ids and positions, where each new K/V row
//! goes in the paged cache, the attention work items (sequence × kv head × query tile × key
//! split) and which rows need logits. Plain data with unit tests; no device calls.
//!
//! Batch invariance: a sequence's tiles, split length and split boundaries depend only on that
//! sequence's own step (its token count and positions), never on the rest of the batch, so the
//! attention kernels compute every row the same way whoever shares the launch.

use crate::backend::{BackendError, SeqStep};

/// Query rows (token × q head of one kv head's group) one attention work item covers per pass.
pub const ROWS_PER_ITEM: usize = 16;
/// Block shape of the tensor-core prefill kernel (`cuda/attention_mma.cu`), chosen by
/// `SHELFSERVE_CUDA_PREFILL_TILES` for comparisons: `128` (the default: 8 warps of 16 query
/// rows share each K/V tile), `128x2` (the same capped at 128 registers so two blocks share an
/// SM) or `64` (4 warps, the previous shape).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MmaTiles {
    #[default]
    Rows128,
    Rows128TwoBlocks,
    Rows64,
}

impl MmaTiles {
    /// Parse the environment value (`None`: the default).
    pub fn parse(value: Option<&str>) -> Result<Self, BackendError> {
        match value {
            None | Some("128") => Ok(MmaTiles::Rows128),
            Some("128x2") => Ok(MmaTiles::Rows128TwoBlocks),
            Some("64") => Ok(MmaTiles::Rows64),
            Some(other) => {
                Err(BackendError::Device(format!("SHELFSERVE_CUDA_PREFILL_TILES={other:?}: expected 128, 128x2 or 64")))
            }
        }
    }

    /// Query rows (token × q head of one kv head's group) per work item.
    pub fn rows(self) -> usize {
        match self {
            MmaTiles::Rows128 | MmaTiles::Rows128TwoBlocks => 128,
            MmaTiles::Rows64 => 64,
        }
    }

    /// Threads per block: one warp per 16 rows.
    pub fn threads(self) -> u32 {
        (self.rows() / 16 * 32) as u32
    }

    /// The kernel's name for head size `hd`.
    pub fn kernel(self, hd: usize) -> String {
        let sfx = match self {
            MmaTiles::Rows128 => "",
            MmaTiles::Rows128TwoBlocks => "_b2",
            MmaTiles::Rows64 => "_r64",
        };
        format!("attn_prefill_mma_d{hd}{sfx}")
    }
}
/// Key split length for decode and short verification steps: long contexts are spread over
/// many blocks (two 32-key tiles each: a decode block is latency-bound, so short splits and
/// many blocks beat long loops) and merged by the combine kernel.
pub const DECODE_SPLIT: usize = 64;
/// Steps of at most this many tokens of one sequence count as decode/verify (split keys);
/// longer prefill chunks have enough query tiles to fill the device without splitting. The
/// streaming decode kernel relies on it (`DEC_MAX_TOKENS`): keys more than this far behind a
/// tile's first token are not written by the step, so it loads them before the q/k/v kernel ends.
pub const DECODE_MAX_TOKENS: usize = 16;
/// Ints per work item, as `cuda/attention.cu` reads them.
pub const ITEM_INTS: usize = 8;
/// Most key splits of one streamed decode tile (`DEC_MAX_SPLITS` in cuda/attention.cu: the
/// folded combine keeps every split's weight of a row in shared memory).
pub const STREAM_MAX_SPLITS: usize = 64;
/// Streamed decode split lengths are multiples of this many keys.
pub const STREAM_SPLIT_ALIGN: usize = 64;

/// Which attention kernels a step's work items are laid out for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnKernels {
    /// Prefill chunks go to the tensor-core kernel (`cuda/attention_mma.cu`).
    pub mma: bool,
    /// The tensor-core kernel's block shape (its rows per work item).
    pub mma_tiles: MmaTiles,
    /// Decode tiles go to the streaming kernel (`attn_decode_*`), which folds the split
    /// combine in and sizes its splits by `streaming_split_len`.
    pub streaming_decode: bool,
    /// Streaming multiprocessors on the device.
    pub sm_count: usize,
}

/// Key split length of a streamed decode tile over `keys` keys: aims at about two blocks per
/// SM for one sequence (the batch-1 case, where the device would otherwise idle), never fewer
/// than `STREAM_SPLIT_ALIGN` keys per block (a block's fixed cost) nor more than
/// `STREAM_MAX_SPLITS` splits. Depends only on the sequence's own context and the device, so a
/// row is computed the same way whatever shares the step.
pub fn streaming_split_len(keys: usize, n_kv_heads: usize, sm_count: usize) -> usize {
    let target = (2 * sm_count / n_kv_heads.max(1)).clamp(1, STREAM_MAX_SPLITS);
    keys.div_ceil(target).next_multiple_of(STREAM_SPLIT_ALIGN).max(STREAM_SPLIT_ALIGN)
}

/// Where the KV cache keeps rows: `[block][layer][K|V][slot][kv_dim]`, so one block of every
/// layer is contiguous (KV images are plain copies).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub block_size: usize,
    pub layers: usize,
    pub kv_dim: usize,
}

impl KvLayout {
    /// Elements in one block (every layer's K and V).
    pub fn block_elems(&self) -> usize {
        self.layers * 2 * self.block_size * self.kv_dim
    }

    /// Element offset of layer `layer`'s K plane inside a block (V follows at + `plane_elems`).
    pub fn layer_offset(&self, layer: usize) -> usize {
        layer * 2 * self.plane_elems()
    }

    pub fn plane_elems(&self) -> usize {
        self.block_size * self.kv_dim
    }

    /// Element offset of position `pos`'s row (relative to a layer's K or V base).
    pub fn row_offset(&self, table: &[u32], pos: usize) -> i64 {
        let bs = self.block_size;
        (table[pos / bs] as usize * self.block_elems() + (pos % bs) * self.kv_dim) as i64
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepLayout {
    pub ids: Vec<i32>,
    pub positions: Vec<i32>,
    /// Per token: element offset of its K/V row from a layer's K/V base.
    pub row_off: Vec<i64>,
    /// Every sequence's block table, concatenated, and where each starts.
    pub tables: Vec<i32>,
    pub table_off: Vec<i32>,
    /// `ITEM_INTS` per work item: seq, first token, tokens, kv head, key begin, key end, split, 0.
    pub items: Vec<i32>,
    /// Prefill work items for the tensor-core kernel (same format, `MmaTiles::rows` rows; the
    /// last int is 1 where the tile has one split and the kernel writes its output rows itself).
    pub mma_items: Vec<i32>,
    /// Decode work items for the streaming kernel (same format; the last int is the tile's
    /// split count, which its blocks need to fold the combine in).
    pub decode_items: Vec<i32>,
    /// Per token: how many key splits its tile has for the combine kernel (0: its own kernel
    /// writes the output rows: a streamed decode tile, or a single-split tensor-core tile).
    pub token_splits: Vec<i32>,
    pub max_splits: usize,
    /// Token rows that need logits, in batch order, and each sequence's first logits row.
    pub logit_rows: Vec<i32>,
    pub offsets: Vec<usize>,
}

impl StepLayout {
    pub fn tokens(&self) -> usize {
        self.ids.len()
    }

    pub fn num_items(&self) -> usize {
        self.items.len() / ITEM_INTS
    }

    pub fn num_mma_items(&self) -> usize {
        self.mma_items.len() / ITEM_INTS
    }

    pub fn num_decode_items(&self) -> usize {
        self.decode_items.len() / ITEM_INTS
    }

    /// Whether any row goes through the separate combine kernel.
    pub fn needs_combine(&self) -> bool {
        self.token_splits.iter().any(|&s| s > 0)
    }

    /// Lay out `batch` (already checked by `validate_batch`). `group` = q heads per kv head.
    pub fn new(
        batch: &[SeqStep<'_>],
        kv: KvLayout,
        vocab: usize,
        n_kv_heads: usize,
        group: usize,
        kernels: AttnKernels,
    ) -> Result<Self, BackendError> {
        let mut l = StepLayout { offsets: vec![0], max_splits: 1, ..Default::default() };
        for (si, s) in batch.iter().enumerate() {
            let tok_base = l.ids.len();
            l.table_off.push(l.tables.len() as i32);
            let need = kv.block_size.max(1);
            let used = (s.start_pos + s.tokens.len()).div_ceil(need);
            l.tables.extend(s.block_table[..used].iter().map(|&b| b as i32));
            for (i, &id) in s.tokens.iter().enumerate() {
                if id as usize >= vocab {
                    return Err(BackendError::InvalidStep(format!(
                        "token id {id} is outside the vocabulary ({vocab})"
                    )));
                }
                let pos = s.start_pos + i;
                l.ids.push(id as i32);
                l.positions.push(pos as i32);
                l.row_off.push(kv.row_offset(s.block_table, pos));
            }
            let decode = s.tokens.len() <= DECODE_MAX_TOKENS;
            let streamed = decode && kernels.streaming_decode;
            let to_mma = kernels.mma && !decode;
            let rows = if to_mma { kernels.mma_tiles.rows() } else { ROWS_PER_ITEM };
            let tile_tokens = (rows / group.max(1)).max(1);
            for t0 in (0..s.tokens.len()).step_by(tile_tokens) {
                let nt = tile_tokens.min(s.tokens.len() - t0);
                let keys = s.start_pos + t0 + nt; // keys 0..=last position of the tile
                let split = match (decode, streamed) {
                    (true, true) => streaming_split_len(keys, n_kv_heads, kernels.sm_count),
                    (true, false) => DECODE_SPLIT,
                    (false, _) => usize::MAX,
                };
                let splits = keys.div_ceil(split.min(keys));
                l.max_splits = l.max_splits.max(splits);
                // Rows their own kernel finishes: streamed decode tiles and one-split prefill tiles.
                let direct = to_mma && splits == 1;
                let combined = if streamed || direct { 0 } else { splits as i32 };
                l.token_splits.extend(std::iter::repeat_n(combined, nt));
                let list = if streamed {
                    &mut l.decode_items
                } else if to_mma {
                    &mut l.mma_items
                } else {
                    &mut l.items
                };
                for kvh in 0..n_kv_heads {
                    for sp in 0..splits {
                        let k0 = sp.saturating_mul(split);
                        let k1 = (k0.saturating_add(split)).min(keys);
                        let last = if streamed { splits as i32 } else { i32::from(direct) };
                        list.extend([
                            si as i32,
                            (tok_base + t0) as i32,
                            nt as i32,
                            kvh as i32,
                            k0 as i32,
                            k1 as i32,
                            sp as i32,
                            last,
                        ]);
                    }
                }
            }
            let end = l.ids.len();
            l.logit_rows.extend((end - s.logits_rows..end).map(|r| r as i32));
            l.offsets.push(l.logit_rows.len());
        }
        l.mma_items = longest_first(&l.mma_items);
        Ok(l)
    }
}

/// Causal prefill tiles grow with their position: the last tile of an 8k prompt reads 8k keys,
/// the first 64. The device starts blocks in list order, so the longest go first and the short
/// ones fill the gaps at the end instead of one long block running alone (each item writes only
/// its own rows, so the order changes no result). Stable: equal lengths keep their order.
fn longest_first(items: &[i32]) -> Vec<i32> {
    let mut chunks: Vec<&[i32]> = items.chunks_exact(ITEM_INTS).collect();
    chunks.sort_by_key(|c| std::cmp::Reverse(c[5] - c[4]));
    chunks.concat()
}

#[cfg(test)]
mod tests {
    use super::*;

    const KV: KvLayout = KvLayout { block_size: 4, layers: 2, kv_dim: 8 };

    /// The split-and-combine kernels only (`mma`: prefill on the tensor cores).
    fn classic(mma: bool) -> AttnKernels {
        AttnKernels { mma, mma_tiles: MmaTiles::Rows128, streaming_decode: false, sm_count: 132 }
    }

    const STREAMED: AttnKernels =
        AttnKernels { mma: true, mma_tiles: MmaTiles::Rows128, streaming_decode: true, sm_count: 132 };

    fn items(l: &StepLayout) -> Vec<[i32; ITEM_INTS]> {
        l.items.chunks_exact(ITEM_INTS).map(|c| c.try_into().unwrap()).collect()
    }

    #[test]
    fn rows_land_in_their_blocks() {
        let table = [5u32, 2, 9];
        let s = SeqStep { tokens: &[1, 2, 3], start_pos: 3, block_table: &table, logits_rows: 1, state_slot: 0 };
        let l = StepLayout::new(&[s], KV, 10, 2, 2, classic(false)).unwrap();
        assert_eq!(l.positions, vec![3, 4, 5]);
        let be = KV.block_elems() as i64;
        assert_eq!(l.row_off, vec![5 * be + 3 * 8, 2 * be, 2 * be + 8]);
        assert_eq!(l.tables, vec![5, 2]);
        assert_eq!(l.logit_rows, vec![2]);
        assert_eq!(l.offsets, vec![0, 1]);
    }

    #[test]
    fn decode_splits_long_contexts_at_fixed_boundaries() {
        let table: Vec<u32> = (0..200).collect();
        let s = SeqStep { tokens: &[1], start_pos: 600, block_table: &table, logits_rows: 1, state_slot: 0 };
        let l = StepLayout::new(&[s], KV, 10, 2, 4, classic(true)).unwrap();
        let it = items(&l);
        let splits = 601usize.div_ceil(DECODE_SPLIT);
        assert_eq!(it.len(), 2 * splits, "2 kv heads × splits over 601 keys");
        let last = &it[splits - 1];
        assert_eq!((it[0][4], it[0][5]), (0, DECODE_SPLIT as i32));
        assert_eq!((last[4], last[5]), (((splits - 1) * DECODE_SPLIT) as i32, 601));
        assert_eq!(l.token_splits, vec![splits as i32]);
        assert_eq!(l.max_splits, splits);
    }

    #[test]
    fn prefill_tiles_tokens_by_group_and_does_not_split() {
        let table: Vec<u32> = (0..200).collect();
        let toks: Vec<u32> = vec![1; 40];
        let s = SeqStep { tokens: &toks, start_pos: 500, block_table: &table, logits_rows: 40, state_slot: 0 };
        let l = StepLayout::new(&[s], KV, 10, 1, 4, classic(false)).unwrap();
        let it = items(&l);
        assert_eq!(it.len(), 10, "40 tokens in tiles of 16/4 = 4");
        let m = StepLayout::new(&[s], KV, 10, 1, 4, classic(true)).unwrap();
        assert!(m.items.is_empty());
        assert_eq!(m.num_mma_items(), 2, "40 tokens in tensor-core tiles of 128/4 = 32");
        assert!(it.iter().all(|i| i[4] == 0 && i[6] == 0));
        assert_eq!(it[9][5], 540);
        assert_eq!(l.max_splits, 1);
        assert_eq!(l.logit_rows.len(), 40);
    }

    #[test]
    fn a_sequence_gets_the_same_items_whatever_its_company() {
        let ta: Vec<u32> = (0..100).collect();
        let tb: Vec<u32> = (100..200).collect();
        let a = SeqStep { tokens: &[7], start_pos: 300, block_table: &ta, logits_rows: 1, state_slot: 0 };
        let b = SeqStep { tokens: &[1, 2, 3, 4, 5], start_pos: 10, block_table: &tb, logits_rows: 2, state_slot: 0 };
        let solo = StepLayout::new(&[a], KV, 10, 2, 3, classic(true)).unwrap();
        let both = StepLayout::new(&[b, a], KV, 10, 2, 3, classic(true)).unwrap();
        let strip = |v: Vec<[i32; ITEM_INTS]>, seq: i32, tok: i32| -> Vec<[i32; 6]> {
            v.into_iter().filter(|i| i[0] == seq).map(|i| [i[1] - tok, i[2], i[3], i[4], i[5], i[6]]).collect()
        };
        assert_eq!(strip(items(&solo), 0, 0), strip(items(&both), 1, 5));
        assert_eq!(both.offsets, vec![0, 2, 3]);
    }

    #[test]
    fn tensor_core_tile_shapes_set_rows_threads_and_kernel() {
        assert_eq!(MmaTiles::parse(None).unwrap(), MmaTiles::Rows128);
        assert_eq!(MmaTiles::parse(Some("128x2")).unwrap(), MmaTiles::Rows128TwoBlocks);
        assert_eq!(MmaTiles::parse(Some("64")).unwrap(), MmaTiles::Rows64);
        assert!(MmaTiles::parse(Some("96")).unwrap_err().to_string().contains("expected 128, 128x2 or 64"));
        assert_eq!((MmaTiles::Rows128.rows(), MmaTiles::Rows128.threads()), (128, 256));
        assert_eq!((MmaTiles::Rows64.rows(), MmaTiles::Rows64.threads()), (64, 128));
        assert_eq!(MmaTiles::Rows128TwoBlocks.kernel(128), "attn_prefill_mma_d128_b2");
        assert_eq!(MmaTiles::Rows64.kernel(64), "attn_prefill_mma_d64_r64");
        // The 64-row shape tiles 40 tokens of a 4-head group in 16-token items.
        let table: Vec<u32> = (0..200).collect();
        let toks: Vec<u32> = vec![1; 40];
        let s = SeqStep { tokens: &toks, start_pos: 500, block_table: &table, logits_rows: 40, state_slot: 0 };
        let k = AttnKernels { mma_tiles: MmaTiles::Rows64, ..classic(true) };
        assert_eq!(StepLayout::new(&[s], KV, 10, 1, 4, k).unwrap().num_mma_items(), 3);
    }

    #[test]
    fn tensor_core_items_come_longest_first() {
        let table: Vec<u32> = (0..200).collect();
        let toks: Vec<u32> = vec![1; 200];
        let s = SeqStep { tokens: &toks, start_pos: 0, block_table: &table, logits_rows: 1, state_slot: 0 };
        let l = StepLayout::new(&[s], KV, 10, 2, 4, classic(true)).unwrap();
        let it: Vec<[i32; ITEM_INTS]> = l.mma_items.chunks_exact(ITEM_INTS).map(|c| c.try_into().unwrap()).collect();
        assert_eq!(it.len(), 2 * 200usize.div_ceil(32), "2 kv heads × tiles of 32 tokens");
        assert!(it.windows(2).all(|w| w[0][5] - w[0][4] >= w[1][5] - w[1][4]), "not longest first");
        assert_eq!((it[0][1], it[0][5], it[0][3]), (192, 200, 0), "last tile of kv head 0 first");
        assert_eq!((it[1][1], it[1][3]), (192, 1), "then the same tile of kv head 1");
        assert_eq!(*it.last().unwrap(), [0, 0, 32, 1, 0, 32, 0, 1], "one split: the kernel writes its rows");
    }

    #[test]
    fn the_attention_kernels_limits_match_the_planner() {
        let src = super::super::gpu::MODULES.iter().find(|(m, _)| *m == "attention").unwrap().1;
        let define = |name: &str| -> usize {
            let line = src.lines().find(|l| l.starts_with(&format!("#define {name} "))).unwrap();
            line.split_whitespace().nth(2).unwrap().parse().unwrap()
        };
        assert_eq!(define("DEC_MAX_TOKENS"), DECODE_MAX_TOKENS);
        assert_eq!(define("DEC_MAX_ROWS"), ROWS_PER_ITEM);
        assert_eq!(define("DEC_MAX_SPLITS"), STREAM_MAX_SPLITS);
    }

    #[test]
    fn streaming_split_length_follows_context_and_device() {
        // 8B shapes on 132 SMs: 33 splits per kv head at most, 64-key multiples.
        assert_eq!(streaming_split_len(1, 8, 132), 64);
        assert_eq!(streaming_split_len(1025, 8, 132), 64);
        assert_eq!(streaming_split_len(2112, 8, 132), 64);
        assert_eq!(streaming_split_len(2113, 8, 132), 128);
        assert_eq!(streaming_split_len(8193, 8, 132), 256);
        // One kv head on a big device: capped at STREAM_MAX_SPLITS splits.
        assert_eq!(streaming_split_len(64 * 64 + 1, 1, 132), 128);
        for keys in 1..5000 {
            for (nkv, sms) in [(8, 132), (1, 132), (2, 8), (32, 1), (0, 0)] {
                let len = streaming_split_len(keys, nkv, sms);
                assert_eq!(len % STREAM_SPLIT_ALIGN, 0);
                assert!(keys.div_ceil(len) <= STREAM_MAX_SPLITS, "keys {keys} nkv {nkv} sms {sms}");
            }
        }
    }

    #[test]
    fn streamed_decode_tiles_get_their_own_list_and_skip_the_combine() {
        let table: Vec<u32> = (0..300).collect();
        let s = SeqStep { tokens: &[1], start_pos: 1000, block_table: &table, logits_rows: 1, state_slot: 0 };
        let l = StepLayout::new(&[s], KV, 10, 8, 4, STREAMED).unwrap();
        let splits = 1001usize.div_ceil(64);
        assert!(l.items.is_empty() && l.mma_items.is_empty());
        assert!(!l.needs_combine());
        assert_eq!(l.num_decode_items(), 8 * splits);
        assert_eq!(l.token_splits, vec![0], "the combine kernel skips streamed rows");
        assert_eq!(l.max_splits, splits, "partial buffers still sized for the splits");
        let it: Vec<[i32; ITEM_INTS]> = l.decode_items.chunks_exact(ITEM_INTS).map(|c| c.try_into().unwrap()).collect();
        assert!(it.iter().all(|i| i[7] == splits as i32), "every block knows the tile's split count");
        assert_eq!(it[0], [0, 0, 1, 0, 0, 64, 0, splits as i32]);
        assert_eq!((it[splits - 1][4], it[splits - 1][5]), (((splits - 1) * 64) as i32, 1001));
        // A prefill chunk in the same step keeps the tensor-core list; its one-split tiles
        // write their own rows, so nothing goes through the combine.
        let toks: Vec<u32> = vec![1; 40];
        let p = SeqStep { tokens: &toks, start_pos: 0, block_table: &table[200..], logits_rows: 1, state_slot: 0 };
        let both = StepLayout::new(&[p, s], KV, 10, 8, 4, STREAMED).unwrap();
        assert!(!both.needs_combine());
        assert_eq!(both.decode_items.len(), l.decode_items.len());
        assert_eq!(both.token_splits, [0; 41]);
        assert!(both.mma_items.chunks_exact(ITEM_INTS).all(|i| i[6] == 0 && i[7] == 1), "single split, direct");
        // Without the streaming kernel the decode row still needs the combine.
        let classic_both = StepLayout::new(&[p, s], KV, 10, 8, 4, classic(true)).unwrap();
        assert!(classic_both.needs_combine());
        assert_eq!(classic_both.token_splits[..40], [0; 40]);
        assert_eq!(classic_both.token_splits[40], splits as i32);
    }

    #[test]
    fn streamed_items_of_a_sequence_do_not_depend_on_its_company() {
        let ta: Vec<u32> = (0..600).collect();
        let tb: Vec<u32> = (600..1200).collect();
        let strip = |l: &StepLayout, seq: i32, tok: i32| -> Vec<[i32; 7]> {
            l.decode_items
                .chunks_exact(ITEM_INTS)
                .filter(|i| i[0] == seq)
                .map(|i| [i[1] - tok, i[2], i[3], i[4], i[5], i[6], i[7]])
                .collect()
        };
        for ctx in [5, 63, 64, 700, 2200] {
            let a = SeqStep { tokens: &[7], start_pos: ctx, block_table: &ta, logits_rows: 1, state_slot: 0 };
            let b = SeqStep { tokens: &[1, 2, 3], start_pos: 2000, block_table: &tb, logits_rows: 3, state_slot: 0 };
            let solo = StepLayout::new(&[a], KV, 10, 2, 4, STREAMED).unwrap();
            let both = StepLayout::new(&[b, a], KV, 10, 2, 4, STREAMED).unwrap();
            assert_eq!(strip(&solo, 0, 0), strip(&both, 1, 3), "ctx {ctx}");
        }
    }

    #[test]
    fn out_of_vocabulary_ids_are_refused() {
        let s = SeqStep { tokens: &[10], start_pos: 0, block_table: &[0], logits_rows: 1, state_slot: 0 };
        let e = StepLayout::new(&[s], KV, 10, 1, 1, classic(false)).unwrap_err();
        assert!(e.to_string().contains("outside the vocabulary"));
    }
}
