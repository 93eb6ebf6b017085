//! The MTP drafter (`--speculative mtp`): `glm5_next`'s own next-token-prediction layer, run on
//! the CPU (`backend::cpu::glm5_next::mtp` computes it) and chained on its own output for drafts
//! past the first.
//!
//! Entry `j` of a sequence's MTP cache reads the target's final hidden state at position `j` (its
//! last-layer tap, which arrives with the accepted tokens) and token `t_{j+1}`, and predicts
//! `t_{j+2}`. With tokens `t_0..t_n` accepted (`t_n` not yet run by the target), entry `n-1` gives
//! the first draft; each further draft runs one more MTP position on the previous draft and the
//! MTP's own normed output in place of the target's state.
//!
//! Cache consistency: the cache only ever keeps entries built from the target's states of accepted
//! tokens ("committed"). The chained positions are speculative: the slot's recurrent state is
//! copied before the chain and put back after it, and the chain's paged records lie past the
//! committed length, where the next committed entries overwrite them. A rejected draft therefore
//! needs no undo here; the accepted tokens' real states arrive with the next update. Positions
//! whose states never arrive (a prefix-cache hit skips the target's forward there) are left out of
//! the MTP's context: drafts get worse, never wrong, since verification is exact.
//!
//! Owns: the MTP layer's weights, its own cache (paged records, recurrent-state slots) and their
//! allocation per sequence. Must not touch: the target's memory or the scheduler's decisions.

use std::collections::HashMap;
use std::sync::Arc;

use super::{DraftError, DraftRequest, DraftSource, HiddenChunk, SeqId};
use crate::backend::cpu::glm5_next::mtp::{HiddenFrom, MtpHead, MtpStep};
use crate::backend::{BackendError, KvGeometry};
use crate::model::quant::simd_available;
use crate::model::ModelBundle;

/// Tokens per block of the MTP's own paged cache.
const BLOCK_SIZE: usize = 16;
/// Sequences that can hold MTP state at once; others get no drafts until one ends.
pub const MTP_SLOTS: usize = 64;

#[derive(Debug, Default)]
struct MtpSeq {
    tokens: Vec<u32>,
    /// Target states not ingested yet.
    pending: Vec<HiddenChunk>,
    slot: Option<u32>,
    blocks: Vec<u32>,
    /// Committed entries in the MTP cache.
    entries: usize,
    /// The next target position whose state may become an entry.
    next_j: usize,
    /// The last committed entry's target position, its greedy prediction and its normed output.
    head: Option<(usize, u32, Vec<f32>)>,
}

pub struct MtpDrafter {
    head: MtpHead,
    seqs: HashMap<SeqId, MtpSeq>,
    free_slots: Vec<u32>,
    free_blocks: Vec<u32>,
    pool: Arc<rayon::ThreadPool>,
    /// The target layer whose state the MTP reads (its last).
    target_last_layer: usize,
}

/// One request's new entries: its index in the batch, the target positions, their states and the
/// tokens after them.
type IngestRows = (usize, Vec<usize>, Vec<f32>, Vec<u32>);

/// Drop pending chunks wholly before the next position to ingest.
fn prune(s: &mut MtpSeq, d: usize) {
    let next = s.next_j;
    s.pending.retain(|c| {
        let width = (c.layers.len() * d).max(1);
        c.start_pos + c.data.len() / width > next
    });
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

impl MtpDrafter {
    /// The MTP layer of `target` (a `glm5_next` checkpoint that has one), with a cache for
    /// `pool_tokens` tokens over [`MTP_SLOTS`] sequences, on `threads` CPU threads (0 = every core).
    pub fn open(target: &ModelBundle, threads: usize, pool_tokens: usize) -> Result<Self, DraftError> {
        let fail = |msg: String| DraftError::Mtp(msg);
        let t = &target.config;
        if !crate::model::glm5_next::MODEL_TYPES.contains(&t.model_type.as_str()) {
            return Err(fail(format!(
                "the target is a `{}` model; the MTP drafter needs a glm5_next checkpoint with an MTP layer",
                t.model_type
            )));
        }
        let cfg = crate::model::glm5_next::read_config(target.weights.origin()).map_err(|e| fail(e.to_string()))?;
        let blocks = pool_tokens.div_ceil(BLOCK_SIZE) + 2 * MTP_SLOTS;
        let geom = KvGeometry { block_size: BLOCK_SIZE, num_blocks: blocks, state_slots: MTP_SLOTS };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("mtp-{i}"))
            .build()
            .map_err(|e| fail(format!("thread pool: {e}")))?;
        let head = pool
            .install(|| MtpHead::load(&cfg, target.weights.as_ref(), geom, simd_available()))
            .map_err(|e| fail(e.to_string()))?;
        Ok(MtpDrafter {
            head,
            seqs: HashMap::new(),
            free_slots: (0..MTP_SLOTS as u32).rev().collect(),
            free_blocks: (0..blocks as u32).rev().collect(),
            pool: Arc::new(pool),
            target_last_layer: cfg.num_hidden_layers - 1,
        })
    }

    /// Bytes of weights a drafted token reads (the MTP block, `eh_proj` and the head).
    pub fn weight_bytes(&self) -> u64 {
        self.head.weight_bytes() as u64
    }

    /// The rows of `seq`'s pending target states that can become entries now: positions from
    /// `next_j` on whose next token is known, in order, each with its state.
    fn ingestible(&self, s: &MtpSeq) -> (Vec<usize>, Vec<f32>) {
        let d = self.head.hidden_size();
        let (mut pos, mut data) = (Vec::new(), Vec::new());
        let mut from = s.next_j;
        for c in &s.pending {
            let Some(col) = c.layers.iter().position(|&l| l == self.target_last_layer) else { continue };
            let width = c.layers.len() * d;
            if width == 0 {
                continue;
            }
            for (r, row) in c.data.chunks_exact(width).enumerate() {
                let j = c.start_pos + r;
                if j >= from && j + 1 < s.tokens.len() {
                    pos.push(j);
                    data.extend_from_slice(&row[col * d..(col + 1) * d]);
                    from = j + 1;
                }
            }
        }
        (pos, data)
    }

    /// Give `s` a slot and blocks for `positions` entries; false when the store is full.
    fn reserve(slots: &mut Vec<u32>, blocks: &mut Vec<u32>, s: &mut MtpSeq, positions: usize) -> bool {
        if s.slot.is_none() {
            match slots.pop() {
                Some(x) => s.slot = Some(x),
                None => return false,
            }
        }
        let need = positions.div_ceil(BLOCK_SIZE);
        while s.blocks.len() < need {
            match blocks.pop() {
                Some(b) => s.blocks.push(b),
                None => return false,
            }
        }
        true
    }

    fn propose_inner(&mut self, requests: &[DraftRequest]) -> Result<Vec<Vec<u32>>, BackendError> {
        let mut out = vec![Vec::new(); requests.len()];
        // 1. Commit every new target state of the requested sequences, in one batched step.
        let mut ingest: Vec<IngestRows> = Vec::new();
        for (i, r) in requests.iter().enumerate() {
            let Some(s) = self.seqs.get(&r.seq) else { continue };
            let (pos, data) = self.ingestible(s);
            let next: Vec<u32> = pos.iter().map(|&j| s.tokens[j + 1]).collect();
            let s = self.seqs.get_mut(&r.seq).expect("present");
            let want = s.entries + pos.len() + r.k.max(1);
            if !Self::reserve(&mut self.free_slots, &mut self.free_blocks, s, want) {
                continue;
            }
            if !pos.is_empty() {
                ingest.push((i, pos, data, next));
            }
        }
        if !ingest.is_empty() {
            let steps: Vec<MtpStep<'_>> = ingest
                .iter()
                .map(|(i, pos, data, next)| {
                    let s = &self.seqs[&requests[*i].seq];
                    let last = *pos.last().expect("non-empty");
                    MtpStep {
                        next_tokens: next,
                        hidden: data,
                        from: HiddenFrom::Target,
                        start_pos: s.entries,
                        block_table: &s.blocks,
                        state_slot: s.slot.expect("reserved"),
                        logits_rows: usize::from(last + 2 == s.tokens.len()),
                    }
                })
                .collect();
            let head = &mut self.head;
            let res = self.pool.install(|| head.step(&steps))?;
            let d = self.head.hidden_size();
            for (n, (i, pos, _, _)) in ingest.iter().enumerate() {
                let s = self.seqs.get_mut(&requests[*i].seq).expect("present");
                let last = *pos.last().expect("non-empty");
                s.entries += pos.len();
                s.next_j = last + 1;
                s.head = res.logits.last_row(n).map(|row| (last, argmax(row), res.last_hidden[n].clone()));
                prune(s, d);
            }
        }
        // 2. The first draft of every sequence whose newest entry reads its newest token.
        let mut chain: Vec<(usize, Vec<f32>)> = Vec::new();
        for (i, r) in requests.iter().enumerate() {
            let Some(s) = self.seqs.get(&r.seq) else { continue };
            if r.k == 0 || s.slot.is_none() {
                continue;
            }
            if let Some((j, t, h)) = &s.head {
                if j + 2 == s.tokens.len() {
                    out[i].push(*t);
                    if r.k > 1 && s.blocks.len() * BLOCK_SIZE >= s.entries + r.k - 1 {
                        chain.push((i, h.clone()));
                    }
                }
            }
        }
        if chain.is_empty() {
            return Ok(out);
        }
        // 3. Chain the layer on its own output; the committed state is put back afterwards.
        let saved: Vec<Vec<f32>> = chain
            .iter()
            .map(|(i, _)| self.head.save_slot(self.seqs[&requests[*i].seq].slot.expect("reserved") as usize))
            .collect();
        let mut depth = 1;
        let result = loop {
            let live: Vec<usize> =
                (0..chain.len()).filter(|&c| out[chain[c].0].len() < requests[chain[c].0].k).collect();
            if live.is_empty() || depth > super::MAX_SPECULATIVE_TOKENS {
                break Ok(());
            }
            let toks: Vec<[u32; 1]> = live.iter().map(|&c| [*out[chain[c].0].last().expect("drafted")]).collect();
            let steps: Vec<MtpStep<'_>> = live
                .iter()
                .zip(&toks)
                .map(|(&c, tok)| {
                    let s = &self.seqs[&requests[chain[c].0].seq];
                    MtpStep {
                        next_tokens: tok,
                        hidden: &chain[c].1,
                        from: HiddenFrom::Mtp,
                        start_pos: s.entries + depth - 1,
                        block_table: &s.blocks,
                        state_slot: s.slot.expect("reserved"),
                        logits_rows: 1,
                    }
                })
                .collect();
            let head = &mut self.head;
            let res = match self.pool.install(|| head.step(&steps)) {
                Ok(r) => r,
                Err(e) => break Err(e),
            };
            for (n, &c) in live.iter().enumerate() {
                // One logits row per chained step (logits_rows = 1).
                out[chain[c].0].extend(res.logits.last_row(n).map(argmax));
                chain[c].1 = res.last_hidden[n].clone();
            }
            depth += 1;
        };
        for ((i, _), image) in chain.iter().zip(&saved) {
            let s = &self.seqs[&requests[*i].seq];
            self.head.restore_slot(s.slot.expect("reserved") as usize, image, s.entries);
        }
        result.map(|()| out)
    }

    /// Commit every entry `seq` can commit now, as `propose` would, and return their MTP logits
    /// (tests compare them with the reference): one row per target position ingested.
    pub fn commit_logits(&mut self, seq: SeqId) -> Result<Vec<f32>, BackendError> {
        let s = self.seqs.get(&seq).ok_or_else(|| BackendError::InvalidStep(format!("no sequence {seq}")))?;
        let (pos, data) = self.ingestible(s);
        let next: Vec<u32> = pos.iter().map(|&j| s.tokens[j + 1]).collect();
        let s = self.seqs.get_mut(&seq).expect("present");
        let want = s.entries + pos.len();
        if pos.is_empty() || !Self::reserve(&mut self.free_slots, &mut self.free_blocks, s, want) {
            return Ok(Vec::new());
        }
        let step = MtpStep {
            next_tokens: &next,
            hidden: &data,
            from: HiddenFrom::Target,
            start_pos: s.entries,
            block_table: &s.blocks,
            state_slot: s.slot.expect("reserved"),
            logits_rows: pos.len(),
        };
        let head = &mut self.head;
        let res = self.pool.install(|| head.step(&[step]))?;
        let last = *pos.last().expect("non-empty");
        s.entries += pos.len();
        s.next_j = last + 1;
        s.head = res.logits.last_row(0).map(|row| (last, argmax(row), res.last_hidden[0].clone()));
        prune(s, self.head.hidden_size());
        Ok(res.logits.data)
    }

    /// Free `seq`'s slot and blocks.
    fn release(&mut self, s: MtpSeq) {
        self.free_slots.extend(s.slot);
        self.free_blocks.extend(s.blocks);
    }
}

impl DraftSource for MtpDrafter {
    fn name(&self) -> &'static str {
        "mtp"
    }

    fn hidden_taps(&self) -> Vec<usize> {
        vec![self.target_last_layer]
    }

    fn extend(&mut self, seq: SeqId, tokens: &[u32]) {
        self.seqs.entry(seq).or_default().tokens.extend_from_slice(tokens);
    }

    fn extend_hidden(&mut self, seq: SeqId, chunks: Vec<HiddenChunk>) {
        self.seqs.entry(seq).or_default().pending.extend(chunks);
    }

    fn propose(&mut self, seq: SeqId, k: usize) -> Vec<u32> {
        self.propose_batch(&[DraftRequest { seq, k }]).pop().unwrap_or_default()
    }

    fn propose_batch(&mut self, requests: &[DraftRequest]) -> Vec<Vec<u32>> {
        match self.propose_inner(requests) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "MTP drafter failed; these sequences get no drafts this step");
                vec![Vec::new(); requests.len()]
            }
        }
    }

    fn forget(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.remove(&seq) {
            self.release(s);
        }
    }

    /// Cut the context to `len` tokens. The recurrent state cannot be rewound, so when committed
    /// entries read tokens past the cut the MTP context restarts empty (from `len` on).
    fn truncate(&mut self, seq: SeqId, len: usize) {
        let d = self.head.hidden_size();
        let Some(s) = self.seqs.get_mut(&seq) else { return };
        if len >= s.tokens.len() {
            return;
        }
        s.tokens.truncate(len);
        for c in &mut s.pending {
            let width = c.layers.len() * d;
            c.data.truncate(len.saturating_sub(c.start_pos) * width);
        }
        s.pending.retain(|c| !c.data.is_empty());
        if s.next_j >= len {
            s.entries = 0;
            s.next_j = len;
            s.head = None;
        }
    }

    fn len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.tokens.len())
    }

    fn sequences(&self) -> usize {
        self.seqs.len()
    }
}
