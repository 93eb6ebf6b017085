//! The CPU compute of `glm5_next`'s MTP (next-token-prediction) layer, the drafter behind
//! `--speculative mtp` (`spec::mtp` is its policy). The layer predicts token `t_{j+2}` from the
//! target's final normed hidden state `h_j` and the token `t_{j+1}`:
//!
//! `x'_j = eh_proj([enorm(E[t_{j+1}]) ; hnorm(h_j)])`, then the MTP's decoder block over its own
//! positions `x'_0, x'_1, …` exactly as a one-layer `glm5_next` text model over input embeddings
//! (the mHC streams start as copies of `x'_j`, the block is causal, its output collapsed by the
//! stream mean), then `shared_head.norm` and the head.
//!
//! This is the DeepSeek-V3 convention applied to the mHC model; transformers defines no MTP for
//! `glm5_next` (`../shared/glm5_next_spec.md` §6), so `scripts/gen_glm5_mtp.py` states the same
//! reading and checks it with transformers' own one-layer text model. The block runs through the
//! ordinary forward ([`Glm5Model`] with one layer, its final norm `shared_head.norm`), with its own
//! paged cache and recurrent-state slots ([`Glm5Cache`]); the caller (the drafter) owns the slot
//! and block bookkeeping, and snapshots a slot before a speculative chain so it can put it back.

use super::cache::Glm5Cache;
use super::forward::Glm5Model;
use super::ops::rms_norm;
use super::weights::Glm5Weights;
use crate::backend::cpu::linear::{CpuLinear, LinearScratch};
use crate::backend::{BackendError, EmbeddedRows, KvGeometry, SeqStep, StepLogits, TapRecorder};
use crate::model::glm5_next::weights::{load_mtp, LinearWeight, TEXT_PREFIX};
use crate::model::glm5_next::Glm5Config;
use crate::model::{ModelError, WeightSource};

/// Where a step's input hidden rows come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HiddenFrom {
    /// The target's last-layer taps (the mean of its streams, before its final norm).
    Target,
    /// The MTP's own normed output (chaining to the next draft position).
    Mtp,
}

/// One sequence's rows of an MTP step: entry `start_pos + r` reads `hidden` row `r` and the token
/// after it, `next_tokens[r]`.
pub struct MtpStep<'a> {
    pub next_tokens: &'a [u32],
    pub hidden: &'a [f32],
    pub from: HiddenFrom,
    pub start_pos: usize,
    pub block_table: &'a [u32],
    pub state_slot: u32,
    /// Trailing rows that need logits (0 or 1 in the drafter; every row in tests).
    pub logits_rows: usize,
}

pub struct MtpOutput {
    pub logits: StepLogits,
    /// Per sequence, the normed output of its last row (what its head read): the hidden input of
    /// the next chained position.
    pub last_hidden: Vec<Vec<f32>>,
}

pub struct MtpHead {
    model: Glm5Model,
    enorm: Vec<f32>,
    hnorm: Vec<f32>,
    eh_proj: CpuLinear,
    main_norm: Vec<f32>,
    pub cache: Glm5Cache,
    simd: bool,
    weight_bytes: usize,
}

impl MtpHead {
    /// Load the first MTP layer of the checkpoint in `w` (target config `c`) with a cache of
    /// `geom` (block size, blocks and state slots of the MTP's own store).
    pub fn load(c: &Glm5Config, w: &dyn WeightSource, geom: KvGeometry, simd: bool) -> Result<Self, ModelError> {
        let mut layers = load_mtp::<CpuLinear>(c, w)?;
        if layers.len() > 1 {
            tracing::info!(layers = layers.len(), "glm5_next: several MTP layers; the drafter chains the first one");
        }
        let m = layers.swap_remove(0);
        let cfg = m.block_config(c);
        let d = c.hidden_size;
        let embed = match m.embed {
            Some(e) => e,
            None => <CpuLinear as LinearWeight>::load(w, &format!("{TEXT_PREFIX}embed_tokens"), c.vocab_size, d)?,
        };
        let lm_head = match m.head {
            Some(h) => Some(h),
            None if c.tie_word_embeddings => None,
            None => Some(<CpuLinear as LinearWeight>::load(w, "lm_head", c.vocab_size, d)?),
        };
        let weights = Glm5Weights { embed, layers: vec![m.block], norm: m.head_norm, lm_head };
        // The embedding is a row lookup per draft, not a read of the whole matrix.
        let weight_bytes = weights.bytes() - LinearWeight::bytes(&weights.embed) + LinearWeight::bytes(&m.eh_proj);
        let cache = Glm5Cache::new(&cfg, geom);
        tracing::info!(layer = m.index, mixer = ?m.mixer, ffn = ?m.ffn, "glm5_next MTP layer loaded on the CPU");
        Ok(MtpHead {
            model: Glm5Model { cfg, weights, group: None },
            enorm: m.enorm,
            hnorm: m.hnorm,
            eh_proj: m.eh_proj,
            main_norm: m.main_norm,
            cache,
            simd,
            weight_bytes,
        })
    }

    pub fn hidden_size(&self) -> usize {
        self.model.cfg.hidden_size
    }

    pub fn vocab_size(&self) -> usize {
        self.model.cfg.vocab_size
    }

    /// Bytes of weights one drafted token reads: the block, `eh_proj` and the head.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// `eh_proj([enorm(E[t]) ; hnorm(h)])` for each row.
    fn inputs(&self, s: &MtpStep<'_>) -> Result<Vec<f32>, BackendError> {
        let (d, eps) = (self.hidden_size(), self.model.cfg.rms_norm_eps);
        let n = s.next_tokens.len();
        if s.hidden.len() != n * d {
            return Err(BackendError::InvalidStep(format!(
                "MTP step: {} hidden values for {n} rows of width {d}",
                s.hidden.len()
            )));
        }
        if let Some(&t) = s.next_tokens.iter().find(|&&t| t as usize >= self.vocab_size()) {
            return Err(BackendError::InvalidStep(format!("token id {t} is outside the vocabulary")));
        }
        let mut cat = vec![0f32; n * 2 * d];
        for ((row, &t), h) in cat.chunks_mut(2 * d).zip(s.next_tokens).zip(s.hidden.chunks(d)) {
            let (e, hh) = row.split_at_mut(d);
            self.model.weights.embed.row_f32(t as usize, e);
            rms_norm(e, &self.enorm, eps);
            hh.copy_from_slice(h);
            if s.from == HiddenFrom::Target {
                rms_norm(hh, &self.main_norm, eps);
            }
            rms_norm(hh, &self.hnorm, eps);
        }
        let mut x = vec![0f32; n * d];
        self.eh_proj.forward(&cat, n, &mut x, &mut LinearScratch::default(), self.simd)?;
        Ok(x)
    }

    /// Run the MTP layer over `steps` (one per sequence, distinct slots), appending to its cache.
    pub fn step(&mut self, steps: &[MtpStep<'_>]) -> Result<MtpOutput, BackendError> {
        let d = self.hidden_size();
        let inputs = steps.iter().map(|s| self.inputs(s)).collect::<Result<Vec<_>, _>>()?;
        let batch: Vec<SeqStep<'_>> = steps
            .iter()
            .map(|s| SeqStep {
                tokens: s.next_tokens,
                start_pos: s.start_pos,
                block_table: s.block_table,
                logits_rows: s.logits_rows,
                state_slot: s.state_slot,
            })
            .collect();
        let embeds: Vec<Vec<EmbeddedRows<'_>>> =
            inputs.iter().map(|x| vec![EmbeddedRows { first_row: 0, hidden: d, data: x }]).collect();
        let mut taps = TapRecorder::new(&[0], d, &batch);
        let logits = self.model.forward_full(&mut self.cache, &batch, &[], &embeds, self.simd, taps.as_mut())?;
        let taps = taps.expect("one layer tapped").finish();
        let eps = self.model.cfg.rms_norm_eps;
        let last_hidden = steps
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let n = s.next_tokens.len();
                let mut h = taps.seq_rows(i, n.saturating_sub(1), n).to_vec();
                if !h.is_empty() {
                    rms_norm(&mut h, &self.model.weights.norm, eps);
                }
                h
            })
            .collect();
        Ok(MtpOutput { logits, last_hidden })
    }

    /// A copy of `slot`'s recurrent state (before a speculative chain).
    pub fn save_slot(&self, slot: usize) -> Vec<f32> {
        let s = self.cache.slot_stride;
        self.cache.state[slot * s..(slot + 1) * s].to_vec()
    }

    /// Put back a copy from [`Self::save_slot`], taken when the slot had reached `pos`.
    pub fn restore_slot(&mut self, slot: usize, image: &[f32], pos: usize) {
        self.cache.slot_mut(slot).copy_from_slice(image);
        self.cache.slot_pos[slot] = Some(pos);
        self.cache.checkpoints[slot] = None;
    }
}
