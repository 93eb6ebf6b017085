//! The draft-model drafter (`--speculative draft:PATH`): a smaller checkpoint with the target's
//! tokenizer proposes each sequence's next `k` tokens greedily, one batched forward per draft
//! position across every sequence asking for drafts (the first forward also feeds each sequence
//! the tokens the target accepted since last time). How many it is asked for is the adaptive
//! policy's call (`spec::adaptive`, which wraps it and prices its forwards by its weight bytes).
//!
//! The draft model runs on the CPU backend with its own paged KV store, sized for the draft model
//! and owned here (the target's KV pool is never touched). Its cache follows the accepted tokens:
//! KV written for a draft token stays valid only if the target accepted that very token at that
//! position (`DraftSeq`); anything past the accepted length is simply overwritten by the next
//! forward, since positions are what a step addresses. Models with recurrent state cannot be
//! rolled back that way and are refused.
//!
//! Owns: the draft backend, its block free list and per-sequence sync state. Must not touch: the
//! scheduler's decisions (which sequences draft, how many tokens) or the target's memory.

use std::collections::HashMap;
use std::path::Path;

use super::{DraftError, DraftRequest, DraftSource, SeqId};
use crate::backend::{Backend, KvGeometry, SeqStep};
use crate::model::default_model::CacheDir;
use crate::model::ModelBundle;

/// Tokens per block of the draft model's KV store.
const DRAFT_BLOCK_TOKENS: usize = 16;

/// What must agree between a target and its draft model for the draft's token ids to mean the
/// same tokens: vocabulary size, special ids, and (when both have tokenizers) the token strings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VocabIdentity {
    /// The model's name or path, for messages.
    pub name: String,
    pub vocab_size: usize,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// SHA-256 (hex, 16 bytes) over every token string in id order; `None` without a tokenizer.
    pub token_digest: Option<String>,
}

impl VocabIdentity {
    pub fn of(bundle: &ModelBundle) -> Self {
        use sha2::{Digest, Sha256};
        let token_digest = bundle.tokenizer.as_ref().map(|t| {
            let mut by_id: Vec<(u32, String)> =
                t.tokenizer.get_vocab(true).into_iter().map(|(s, id)| (id, s)).collect();
            by_id.sort_unstable();
            let mut h = Sha256::new();
            for (id, s) in by_id {
                h.update(id.to_le_bytes());
                h.update((s.len() as u64).to_le_bytes());
                h.update(s.as_bytes());
            }
            h.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect()
        });
        let bos_token_id = bundle.tokenizer.as_ref().and_then(|t| t.bos_token_id).or(bundle.config.bos_token_id);
        VocabIdentity {
            name: bundle.name.clone(),
            vocab_size: bundle.config.vocab_size,
            eos_token_ids: bundle.eos_token_ids(),
            bos_token_id,
            token_digest,
        }
    }

    /// Refuse a draft whose token ids would not mean the target's tokens; the message names both.
    pub fn check_draft(&self, draft: &VocabIdentity) -> Result<(), DraftError> {
        let refuse = |what: String| {
            Err(DraftError::InvalidConfig(format!(
                "draft model `{}` does not share the tokenizer of target `{}`: {what}",
                draft.name, self.name
            )))
        };
        if self.vocab_size != draft.vocab_size {
            return refuse(format!("vocabulary size {} vs {}", draft.vocab_size, self.vocab_size));
        }
        if self.eos_token_ids != draft.eos_token_ids {
            return refuse(format!("end-of-generation ids {:?} vs {:?}", draft.eos_token_ids, self.eos_token_ids));
        }
        if self.bos_token_id != draft.bos_token_id {
            return refuse(format!("BOS id {:?} vs {:?}", draft.bos_token_id, self.bos_token_id));
        }
        if let (Some(a), Some(b)) = (&draft.token_digest, &self.token_digest) {
            if a != b {
                return refuse(format!("token strings differ (digest {a} vs {b})"));
            }
        }
        Ok(())
    }
}

/// Free blocks of the draft model's KV store.
#[derive(Debug)]
pub struct DraftBlocks {
    free: Vec<u32>,
    total: usize,
}

impl DraftBlocks {
    pub fn new(num_blocks: usize) -> Self {
        // Popped from the back: hand out low ids first (only for readable logs).
        DraftBlocks { free: (0..num_blocks as u32).rev().collect(), total: num_blocks }
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    pub fn used(&self) -> usize {
        self.total - self.free.len()
    }

    /// Grow `table` to `blocks` blocks; false (and `table` unchanged) when too few are free.
    pub fn grow(&mut self, table: &mut Vec<u32>, blocks: usize) -> bool {
        let more = blocks.saturating_sub(table.len());
        if more > self.free.len() {
            return false;
        }
        let at = self.free.len() - more;
        table.extend(self.free.drain(at..).rev());
        true
    }

    pub fn release(&mut self, table: &mut Vec<u32>) {
        self.free.append(table);
    }
}

/// One sequence as the draft model sees it: every accepted token, how many leading ones have
/// valid KV in the draft's store, and the draft tokens whose KV was written after them (valid
/// too, for as long as the target accepts exactly those tokens).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DraftSeq {
    pub tokens: Vec<u32>,
    /// Leading `tokens` whose KV is in the draft store.
    pub cached: usize,
    /// Draft tokens fed at positions `tokens.len()..` (only meaningful when `cached == tokens.len()`).
    pub fed: Vec<u32>,
    pub blocks: Vec<u32>,
}

impl DraftSeq {
    /// Accepted tokens arrive: an accepted draft that was fed keeps its KV; the first token that
    /// differs ends that, and its position is recomputed next time.
    pub fn extend(&mut self, tokens: &[u32]) {
        for &t in tokens {
            if self.cached == self.tokens.len() && self.fed.first() == Some(&t) {
                self.fed.remove(0);
                self.cached += 1;
            } else {
                self.fed.clear();
            }
            self.tokens.push(t);
        }
    }

    pub fn truncate(&mut self, len: usize) {
        if len < self.tokens.len() {
            self.tokens.truncate(len);
            self.cached = self.cached.min(len);
            self.fed.clear();
        }
    }

    /// Start position and tokens of the next forward: everything not yet cached, and at least the
    /// last token (its logits give the first draft).
    pub fn pending(&self) -> (usize, &[u32]) {
        let start = self.cached.min(self.tokens.len().saturating_sub(1));
        (start, &self.tokens[start..])
    }

    /// Forget the cache (blocks are released by the caller): the next forward starts at 0.
    fn reset_cache(&mut self) {
        self.cached = 0;
        self.fed.clear();
    }
}

/// A draft model on the CPU backend with its own KV store.
pub struct DraftModel {
    backend: Box<dyn Backend>,
    geometry: KvGeometry,
    /// Positions the draft model can address (its context length).
    max_positions: usize,
    blocks: DraftBlocks,
    seqs: HashMap<SeqId, DraftSeq>,
    /// Stored bytes of the draft's weights (0 when built from a bare backend): what pricing its
    /// proposals against the target reads.
    weight_bytes: u64,
}

/// How to build a draft model: its CPU threads and how many tokens its KV store holds.
#[derive(Clone, Copy, Debug)]
pub struct DraftModelOptions {
    /// CPU worker threads (0 = one per core).
    pub threads: usize,
    /// Tokens of KV the draft store holds across all sequences.
    pub pool_tokens: usize,
    /// A DFlash drafter's forward pass on the target's GPU (`spec::dflash::device_for`).
    pub dflash_cuda: Option<crate::spec::dflash::DFlashCudaOptions>,
}

impl DraftModel {
    /// Open `path` (a GGUF file, an HF directory, or `default`) with the target's loaders, check it
    /// against the target's vocabulary and build it on the CPU backend.
    pub fn open(path: &str, target: &VocabIdentity, opts: DraftModelOptions) -> Result<Self, DraftError> {
        let fail = |msg: String| DraftError::DraftModel { path: path.to_string(), msg };
        if path != crate::model::default_model::DEFAULT_MODEL_NAME && !Path::new(path).exists() {
            return Err(fail("no such file or directory (give a .gguf file or an HF model directory)".into()));
        }
        let bundle = crate::model::open(path, &CacheDir::from_env()).map_err(|e| fail(e.to_string()))?;
        Self::from_bundle(path, &bundle, target, opts)
    }

    /// Build from an opened bundle (see [`DraftModel::open`]).
    pub fn from_bundle(
        path: &str,
        bundle: &ModelBundle,
        target: &VocabIdentity,
        opts: DraftModelOptions,
    ) -> Result<Self, DraftError> {
        let fail = |msg: String| DraftError::DraftModel { path: path.to_string(), msg };
        if crate::model::glm5_next::MODEL_TYPES.contains(&bundle.config.model_type.as_str()) {
            return Err(fail(format!(
                "`{}` keeps recurrent state, which a draft model cannot roll back yet; use a llama-family draft",
                bundle.config.model_type
            )));
        }
        let mut draft_vocab = VocabIdentity::of(bundle);
        draft_vocab.name = path.to_string();
        target.check_draft(&draft_vocab)?;
        let max_positions = bundle.config.max_position_embeddings.max(1);
        let num_blocks = opts.pool_tokens.max(DRAFT_BLOCK_TOKENS).div_ceil(DRAFT_BLOCK_TOKENS);
        let geometry = KvGeometry { block_size: DRAFT_BLOCK_TOKENS, num_blocks, state_slots: 1 };
        let (backend, _) =
            crate::generate::any_cpu_backend(bundle, opts.threads, geometry).map_err(|e| fail(e.to_string()))?;
        let mut model = Self::with_backend(backend, max_positions).map_err(fail)?;
        model.weight_bytes = bundle.stored_weight_bytes();
        Ok(model)
    }

    /// Wrap a built backend (attention-only) whose model addresses `max_positions` positions.
    pub fn with_backend(backend: Box<dyn Backend>, max_positions: usize) -> Result<Self, String> {
        if backend.state_slot_bytes() > 0 {
            return Err("the draft backend keeps recurrent state, which cannot be rolled back yet".into());
        }
        let geometry = backend.kv_geometry();
        Ok(DraftModel {
            backend,
            geometry,
            max_positions,
            blocks: DraftBlocks::new(geometry.num_blocks),
            seqs: HashMap::new(),
            weight_bytes: 0,
        })
    }

    /// Stored bytes of the draft's weights (0 when built by [`DraftModel::with_backend`]).
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }

    /// Blocks of the draft store in use (for tests: 0 once every sequence is forgotten).
    pub fn blocks_used(&self) -> usize {
        self.blocks.used()
    }

    /// The cached state of `seq` (for tests).
    pub fn seq_state(&self, seq: SeqId) -> Option<&DraftSeq> {
        self.seqs.get(&seq)
    }

    fn drop_cache(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.reset_cache();
            self.blocks.release(&mut s.blocks);
        }
    }

    /// Clamp `k` to what the draft can address and reserve blocks for it; 0 when it cannot draft.
    fn reserve(&mut self, seq: SeqId, k: usize) -> usize {
        let Some(s) = self.seqs.get_mut(&seq) else { return 0 };
        if s.tokens.is_empty() {
            return 0;
        }
        // Feeding drafts 1..k-1 writes positions up to tokens.len() + k - 2.
        let k = k.min((self.max_positions + 1).saturating_sub(s.tokens.len()));
        if k == 0 {
            return 0;
        }
        let positions = s.tokens.len() + k - 1;
        if self.blocks.grow(&mut s.blocks, self.geometry.blocks_for(positions)) {
            return k;
        }
        // The store is full: give this sequence's blocks back and draft nothing for it now (it
        // recomputes from the start when blocks are free again).
        s.reset_cache();
        self.blocks.release(&mut s.blocks);
        0
    }

    /// One batched forward; on failure every sequence in it loses its cache and drafts.
    fn forward_argmax(&mut self, batch: &[(SeqId, usize, Vec<u32>)]) -> Option<Vec<u32>> {
        let steps: Vec<SeqStep<'_>> = batch
            .iter()
            .map(|(seq, start, tokens)| SeqStep {
                tokens,
                start_pos: *start,
                block_table: &self.seqs[seq].blocks,
                logits_rows: 1,
                state_slot: 0,
            })
            .collect();
        match self.backend.forward(&steps) {
            Ok(logits) => Some((0..batch.len()).map(|i| logits.last_row(i).map_or(0, argmax)).collect()),
            Err(e) => {
                tracing::warn!(error = %e, "draft model forward failed; these sequences get no drafts this step");
                for (seq, _, _) in batch {
                    self.drop_cache(*seq);
                }
                None
            }
        }
    }
}

/// Lowest index of the largest logit (the greedy draft).
fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

impl DraftSource for DraftModel {
    fn name(&self) -> &'static str {
        "draft-model"
    }

    fn extend(&mut self, seq: SeqId, tokens: &[u32]) {
        self.seqs.entry(seq).or_default().extend(tokens);
    }

    fn propose(&mut self, seq: SeqId, k: usize) -> Vec<u32> {
        self.propose_batch(&[DraftRequest { seq, k }]).pop().unwrap_or_default()
    }

    /// Round 0 feeds each sequence its uncached tokens and yields draft 1; round `i` feeds draft
    /// `i` of every sequence that wants more than `i` drafts and yields draft `i + 1`.
    fn propose_batch(&mut self, requests: &[DraftRequest]) -> Vec<Vec<u32>> {
        let ks: Vec<usize> = requests.iter().map(|r| self.reserve(r.seq, r.k)).collect();
        let mut drafts: Vec<Vec<u32>> = vec![Vec::new(); requests.len()];
        let mut active: Vec<usize> = (0..requests.len()).filter(|&i| ks[i] > 0).collect();
        let mut round = 0;
        while !active.is_empty() {
            let batch: Vec<(SeqId, usize, Vec<u32>)> = active
                .iter()
                .map(|&i| {
                    let s = &self.seqs[&requests[i].seq];
                    if round == 0 {
                        let (start, tokens) = s.pending();
                        (requests[i].seq, start, tokens.to_vec())
                    } else {
                        (requests[i].seq, s.tokens.len() + round - 1, vec![drafts[i][round - 1]])
                    }
                })
                .collect();
            let Some(next) = self.forward_argmax(&batch) else {
                active.iter().for_each(|&i| drafts[i].clear());
                break;
            };
            for (&i, token) in active.iter().zip(next) {
                let s = self.seqs.get_mut(&requests[i].seq).expect("reserved above");
                if round == 0 {
                    s.cached = s.tokens.len();
                    s.fed.clear();
                } else {
                    s.fed.push(drafts[i][round - 1]);
                }
                drafts[i].push(token);
            }
            round += 1;
            active.retain(|&i| ks[i] > round);
        }
        drafts
    }

    fn forget(&mut self, seq: SeqId) {
        self.drop_cache(seq);
        self.seqs.remove(&seq);
    }

    fn truncate(&mut self, seq: SeqId, len: usize) {
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.truncate(len);
        }
    }

    fn len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.tokens.len())
    }

    fn sequences(&self) -> usize {
        self.seqs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepted_fed_drafts_keep_their_cache_and_a_mismatch_ends_it() {
        let mut s = DraftSeq::default();
        s.extend(&[1, 2, 3]);
        assert_eq!(s.pending(), (0, &[1, 2, 3][..]));
        // After a propose round: prompt cached, drafts 7 and 8 fed (9 proposed but not fed).
        s.cached = 3;
        s.fed = vec![7, 8];
        // The target accepted 7, then corrected 8 to 5.
        s.extend(&[7, 5]);
        assert_eq!((s.cached, s.fed.clone()), (4, vec![]));
        assert_eq!(s.pending(), (4, &[5][..]));
        // Every fed draft accepted plus the unfed last draft and the bonus token.
        s.cached = 5;
        s.fed = vec![10, 11];
        s.extend(&[10, 11, 12, 13]);
        assert_eq!(s.cached, 7);
        assert_eq!(s.pending(), (7, &[12, 13][..]));
        // A first token that differs keeps nothing.
        s.cached = 9;
        s.fed = vec![20];
        s.extend(&[21]);
        assert_eq!(s.pending(), (9, &[21][..]));
    }

    #[test]
    fn a_fully_cached_sequence_recomputes_its_last_token_for_logits() {
        let mut s = DraftSeq::default();
        s.extend(&[4, 5]);
        s.cached = 2;
        s.fed = vec![6, 7];
        s.extend(&[6]);
        assert_eq!(s.cached, 3);
        assert_eq!(s.pending(), (2, &[6][..]));
    }

    #[test]
    fn truncate_drops_cache_past_the_cut() {
        let mut s = DraftSeq::default();
        s.extend(&[1, 2, 3, 4]);
        s.cached = 4;
        s.fed = vec![9];
        s.truncate(2);
        assert_eq!((s.tokens.clone(), s.cached, s.fed.clone()), (vec![1, 2], 2, vec![]));
        s.truncate(5);
        assert_eq!(s.tokens.len(), 2);
    }

    #[test]
    fn blocks_grow_release_and_refuse_when_short() {
        let mut b = DraftBlocks::new(4);
        let (mut x, mut y) = (Vec::new(), Vec::new());
        assert!(b.grow(&mut x, 3));
        assert_eq!(x, vec![0, 1, 2]);
        assert!(!b.grow(&mut y, 2));
        assert!(y.is_empty());
        assert!(b.grow(&mut x, 2), "already large enough");
        assert_eq!((b.used(), b.free_count()), (3, 1));
        b.release(&mut x);
        assert!(x.is_empty());
        assert!(b.grow(&mut y, 4));
        assert_eq!(b.used(), 4);
    }

    fn identity(vocab: usize, eos: Vec<u32>, digest: Option<&str>) -> VocabIdentity {
        VocabIdentity {
            name: "m".into(),
            vocab_size: vocab,
            eos_token_ids: eos,
            bos_token_id: Some(1),
            token_digest: digest.map(str::to_string),
        }
    }

    #[test]
    fn vocab_checks_name_both_models_and_the_difference() {
        let mut target = identity(512, vec![2], Some("aa"));
        target.name = "target.gguf".into();
        let mut draft = identity(512, vec![2], Some("aa"));
        draft.name = "small.gguf".into();
        assert!(target.check_draft(&draft).is_ok());
        let e = target.check_draft(&VocabIdentity { vocab_size: 49152, ..draft.clone() }).unwrap_err().to_string();
        assert!(e.contains("small.gguf") && e.contains("target.gguf") && e.contains("49152 vs 512"), "{e}");
        let e = target.check_draft(&VocabIdentity { eos_token_ids: vec![0], ..draft.clone() }).unwrap_err();
        assert!(e.to_string().contains("end-of-generation ids"), "{e}");
        let e = target.check_draft(&VocabIdentity { token_digest: Some("bb".into()), ..draft.clone() }).unwrap_err();
        assert!(e.to_string().contains("token strings differ"), "{e}");
        // Without a tokenizer on one side the strings cannot be compared; ids and sizes still are.
        assert!(target.check_draft(&VocabIdentity { token_digest: None, ..draft }).is_ok());
    }

    #[test]
    fn argmax_takes_the_lowest_index_of_ties() {
        assert_eq!(argmax(&[0.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, -5.0]), 1);
    }
}
