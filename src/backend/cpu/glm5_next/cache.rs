//! `glm5_next`'s cache in host memory, in f32, laid out as `model::glm5_next::cache_layout`
//! says: the paged per-token records and the recurrent-state slots, plus the per-slot bookkeeping
//! the CPU forward needs (position reached, verification checkpoints).

use crate::backend::KvGeometry;
use crate::model::glm5_next::cache_layout::CacheLayout;
pub use crate::model::glm5_next::cache_layout::{DsaSlots, KdaSlots};
use crate::model::glm5_next::Glm5Config;

pub struct Glm5Cache {
    pub geom: KvGeometry,
    /// f32 per token record.
    pub token_stride: usize,
    /// Per layer: `Some` for DSA layers.
    pub dsa: Vec<Option<DsaSlots>>,
    pub kv: Vec<f32>,
    /// f32 per state slot.
    pub slot_stride: usize,
    /// Per layer: `Some` for KDA layers.
    pub kda: Vec<Option<KdaSlots>>,
    pub state: Vec<f32>,
    /// Per slot, the position its state has reached; `None` after a snapshot was written into it
    /// (the image carries no position). Lets the forward refuse a step that would continue
    /// another sequence's state.
    pub slot_pos: Vec<Option<usize>>,
    /// Per slot, the states kept during a draft-verification step until it is committed.
    pub checkpoints: Vec<Option<StepCheckpoints>>,
    /// Per slot, page-end snapshots asked for inside the next step (`Backend::mark_state_snapshots`).
    pub marks: Vec<Option<StateMarks>>,
}

/// The slot's state after given token counts inside one step (page ends a prefill chunk crosses),
/// filled by the KDA layers as the step runs. Each image is a whole slot, `slot_stride` floats.
#[derive(Clone, Debug)]
pub struct StateMarks {
    /// Token counts into the step, ascending, each below the step's length.
    pub after: Vec<usize>,
    /// `after.len()` slot images, in that order.
    pub images: Vec<f32>,
    /// Tokens of the step the KDA layers ran over (0 until one did): marks at or past it were
    /// never filled, so none is handed out (a step of the wrong length, or one that failed early).
    pub step_tokens: usize,
}

impl StateMarks {
    /// The mark index whose state is the one after token `t` of the step (0-based), if any.
    pub fn index_after_token(&self, t: usize) -> Option<usize> {
        self.after.binary_search(&(t + 1)).ok()
    }
}

/// A slot's state after each token of a verification step but the last (the slot itself holds
/// that one), so the step can be rolled back to any accepted length. Each image is a whole slot
/// (every KDA layer's conv window and recurrent state), `slot_stride` floats.
#[derive(Clone, Debug)]
pub struct StepCheckpoints {
    /// Position of the step's first token.
    pub start_pos: usize,
    /// Tokens in the step.
    pub tokens: usize,
    /// `tokens - 1` slot images: image `t` is the state after token `t`.
    pub images: Vec<f32>,
}

impl Glm5Cache {
    pub fn new(c: &Glm5Config, geom: KvGeometry) -> Self {
        let CacheLayout { token_stride, dsa, slot_stride, kda } = CacheLayout::new(c);
        Glm5Cache {
            geom,
            token_stride,
            dsa,
            kv: vec![0f32; geom.num_blocks * geom.block_size * token_stride],
            slot_stride,
            kda,
            state: vec![0f32; geom.state_slots * slot_stride],
            slot_pos: vec![Some(0); geom.state_slots],
            checkpoints: vec![None; geom.state_slots],
            marks: vec![None; geom.state_slots],
        }
    }

    /// Index of position `pos`'s record in `kv`, through the sequence's block table.
    pub fn record(&self, table: &[u32], pos: usize) -> usize {
        let bs = self.geom.block_size;
        (table[pos / bs] as usize * bs + pos % bs) * self.token_stride
    }

    pub fn bytes(&self) -> usize {
        4 * (self.kv.len() + self.state.len())
    }

    pub fn block_bytes(&self) -> usize {
        4 * self.geom.block_size * self.token_stride
    }

    pub fn slot_bytes(&self) -> usize {
        4 * self.slot_stride
    }

    /// Roll `slot` back to the state after the first `kept` tokens of its last verification step
    /// (`kept` = last known token + accepted drafts) and drop the step's checkpoints. Keeping all
    /// of the step's tokens leaves the slot as it is.
    pub fn commit_verified(&mut self, slot: usize, kept: usize) -> Result<(), String> {
        let ck = self.checkpoints[slot]
            .take()
            .ok_or_else(|| format!("recurrent-state slot {slot} has no verification step to commit"))?;
        if kept == 0 || kept > ck.tokens {
            return Err(format!("cannot keep {kept} tokens of a {}-token verification step", ck.tokens));
        }
        if kept < ck.tokens {
            let stride = self.slot_stride;
            let image = &ck.images[(kept - 1) * stride..kept * stride];
            self.state[slot * stride..(slot + 1) * stride].copy_from_slice(image);
        }
        self.slot_pos[slot] = Some(ck.start_pos + kept);
        Ok(())
    }

    pub fn slot_mut(&mut self, slot: usize) -> &mut [f32] {
        &mut self.state[slot * self.slot_stride..(slot + 1) * self.slot_stride]
    }

    pub fn read_blocks(&self, blocks: &[u32]) -> Vec<u8> {
        let n = self.geom.block_size * self.token_stride;
        let mut out = Vec::with_capacity(blocks.len() * n * 4);
        for &b in blocks {
            out.extend(self.kv[b as usize * n..(b as usize + 1) * n].iter().flat_map(|v| v.to_le_bytes()));
        }
        out
    }

    pub fn write_blocks(&mut self, blocks: &[u32], image: &[u8]) {
        let n = self.geom.block_size * self.token_stride;
        for (&b, chunk) in blocks.iter().zip(image.chunks_exact(n * 4)) {
            let dst = &mut self.kv[b as usize * n..(b as usize + 1) * n];
            for (d, s) in dst.iter_mut().zip(chunk.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
    }

    /// Asks for `slot`'s state after each of `after` tokens of its next step.
    pub fn mark(&mut self, slot: usize, after: &[usize]) {
        let images = vec![0f32; after.len() * self.slot_stride];
        self.marks[slot] = Some(StateMarks { after: after.to_vec(), images, step_tokens: 0 });
    }

    /// The marked images of `slot` as byte images (empty when none were marked), clearing the marks.
    pub fn take_marks(&mut self, slot: usize) -> Vec<Vec<u8>> {
        let Some(m) = self.marks[slot].take() else { return Vec::new() };
        if m.after.last().is_some_and(|&k| k >= m.step_tokens) {
            return Vec::new();
        }
        m.images.chunks_exact(self.slot_stride).map(|img| img.iter().flat_map(|v| v.to_le_bytes()).collect()).collect()
    }

    pub fn read_slot(&self, slot: usize) -> Vec<u8> {
        self.state[slot * self.slot_stride..(slot + 1) * self.slot_stride]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect()
    }

    pub fn write_slot(&mut self, slot: usize, image: &[u8]) {
        self.slot_pos[slot] = None;
        self.checkpoints[slot] = None;
        for (d, s) in self.slot_mut(slot).iter_mut().zip(image.chunks_exact(4)) {
            *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        }
    }
}
