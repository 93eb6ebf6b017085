//! Where `glm5_next`'s cache lives on the CPU, in f32:
//! * paged per-token records (one block = `block_size` tokens): for every DSA layer the
//!   normalised MLA latent `c` (`kv_lora_rank`), and for every full-indexer layer the indexer key
//!   `k^I`, its pool-compression gate logits `γ^I` and, at a pool's last token, the pooled key
//!   `K_p` (each `index_head_dim`) — written once when the pool completes;
//! * recurrent-state slots (one per live sequence): for every KDA layer the last `K−1` raw
//!   (pre-conv) q|k|v projections and the `[H, d_k, d_v]` delta-rule state.
//!
//! The layout is fixed by the config, so images from `read_*` are portable between backends of
//! the same model.

use super::config::{Glm5Config, MixerKind};
use crate::backend::KvGeometry;

/// Offsets of one DSA layer's fields inside a token record.
#[derive(Clone, Copy, Debug)]
pub struct DsaSlots {
    pub latent: usize,
    /// `k^I`, then `γ^I`, then the pooled key; `None` for shared-indexer layers.
    pub indexer: Option<usize>,
}

/// Offsets of one KDA layer's fields inside a state slot.
#[derive(Clone, Copy, Debug)]
pub struct KdaSlots {
    /// `[K−1, 3Q]` conv window, oldest first.
    pub conv: usize,
    /// `[H, d, d]` recurrent state.
    pub state: usize,
}

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

/// Per layer: where each field sits in a token record and in a state slot.
struct Layout {
    token_stride: usize,
    dsa: Vec<Option<DsaSlots>>,
    slot_stride: usize,
    kda: Vec<Option<KdaSlots>>,
}

fn layout(c: &Glm5Config) -> Layout {
    let (mut token_stride, mut slot_stride) = (0, 0);
    let mut dsa = Vec::new();
    let mut kda = Vec::new();
    let q3 = 3 * c.linear_qkv_dim();
    let hd = c.linear_head_dim;
    for l in 0..c.num_hidden_layers {
        match c.layer_types[l] {
            MixerKind::Dsa => {
                let latent = token_stride;
                token_stride += c.kv_lora_rank;
                let indexer = c.has_indexer(l).then(|| {
                    let o = token_stride;
                    token_stride += 3 * c.index_head_dim;
                    o
                });
                dsa.push(Some(DsaSlots { latent, indexer }));
                kda.push(None);
            }
            MixerKind::Kda => {
                let conv = slot_stride;
                slot_stride += (c.linear_conv_kernel_dim - 1) * q3;
                let state = slot_stride;
                slot_stride += c.linear_num_heads * hd * hd;
                kda.push(Some(KdaSlots { conv, state }));
                dsa.push(None);
            }
        }
    }
    Layout { token_stride, dsa, slot_stride, kda }
}

/// Bytes of one token's record and of one recurrent-state slot (both f32), as
/// [`Glm5Cache::new`] lays them out: what the capacity card prices before anything is allocated.
pub fn cache_bytes(c: &Glm5Config) -> (usize, usize) {
    let l = layout(c);
    (4 * l.token_stride, 4 * l.slot_stride)
}

impl Glm5Cache {
    pub fn new(c: &Glm5Config, geom: KvGeometry) -> Self {
        let Layout { token_stride, dsa, slot_stride, kda } = layout(c);
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
