//! The layout of `glm5_next`'s per-token cache records and recurrent-state slots, in f32
//! elements, fixed by the config — what every backend stores and what their block and slot images
//! hold, so images are portable between backends of the same model:
//! * paged per-token records (one block = `block_size` tokens): for every DSA layer the
//!   normalised MLA latent `c` (`kv_lora_rank`), and for every full-indexer layer the indexer key
//!   `k^I`, its pool-compression gate logits `γ^I` and, at a pool's last token, the pooled key
//!   `K_p` (each `index_head_dim`) — written once when the pool completes;
//! * recurrent-state slots (one per live sequence): for every KDA layer the last `K−1` raw
//!   (pre-conv) q|k|v projections and the `[H, d_k, d_v]` delta-rule state.
//!
//! Images are raw little-endian f32 records in this order. Where the records live (host memory,
//! GPU memory) is the backend's business.

use super::config::{Glm5Config, MixerKind};

/// Offsets of one DSA layer's fields inside a token record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DsaSlots {
    pub latent: usize,
    /// `k^I`, then `γ^I`, then the pooled key; `None` for shared-indexer layers.
    pub indexer: Option<usize>,
}

/// Offsets of one KDA layer's fields inside a state slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KdaSlots {
    /// `[K−1, 3Q]` conv window, oldest first.
    pub conv: usize,
    /// `[H, d, d]` recurrent state.
    pub state: usize,
}

/// Where each layer's fields sit in a token record and in a state slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheLayout {
    /// f32 per token record.
    pub token_stride: usize,
    /// Per layer: `Some` for DSA layers.
    pub dsa: Vec<Option<DsaSlots>>,
    /// f32 per state slot.
    pub slot_stride: usize,
    /// Per layer: `Some` for KDA layers.
    pub kda: Vec<Option<KdaSlots>>,
}

impl CacheLayout {
    pub fn new(c: &Glm5Config) -> Self {
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
        CacheLayout { token_stride, dsa, slot_stride, kda }
    }

    /// Bytes of one token's record and of one recurrent-state slot (both f32, on either device):
    /// what the capacity card prices before anything is allocated.
    pub fn bytes(&self) -> (usize, usize) {
        (4 * self.token_stride, 4 * self.slot_stride)
    }
}
