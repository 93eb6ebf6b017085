//! GLM-5.3-Flash (`glm5_next`): config, weight loading and the CPU forward pass, matching
//! transformers' `Glm5NextForConditionalGeneration` text model (reference for every formula:
//! `docs`' spec of the architecture and transformers' `modeling_glm5_next.py`).
//!
//! Structure of one decoder layer: 4 mHC residual streams → collapse → RMSNorm → mixer (KDA linear
//! attention, or NoPE MLA with the DSA indexer) → expand; again for the FFN (dense SwiGLU or MoE).
//! The final hidden state is the streams' mean, RMS-normalised, then `lm_head`.
//!
//! Owns the model's math and its cache layout; never decides which blocks, slots or sequences
//! (the scheduler and KV pool do). Per-sequence state is passed in (`cache::Glm5Cache`), never
//! owned by the weights. The vision tower and the MTP layer are not run.

pub mod accounting;
pub mod backend;
pub mod cache;
pub mod config;
pub mod ffn;
pub mod kda;
pub mod layout;
pub mod mla;
pub mod ops;
pub mod weights;

use crate::backend::cpu::linear::LinearScratch;
use std::path::Path;

use rayon::prelude::*;

pub use self::backend::Glm5Backend;
pub use self::config::Glm5Config;
use self::config::{IndexerKind, MixerKind};
use self::ops::{hc_normalize, hyper_connection, hyper_expand, rms_norm, HcWeights};
use self::weights::{Ffn, Glm5Weights, HyperConnection, Mixer};
use crate::backend::{BackendError, SeqStep, StepLogits};
use crate::config::LlamaConfig;
use crate::model::hf::{self, SafetensorsWeights};
use crate::model::{ModelBundle, ModelError};

/// The HF `model_type` values this module serves.
pub const MODEL_TYPES: [&str; 2] = ["glm5_next", "glm5_next_text"];

/// One sequence's rows in a step's flattened batch.
#[derive(Clone, Copy, Debug)]
pub struct SeqRows<'a> {
    /// First row of this sequence in the batch.
    pub row0: usize,
    /// Rows (tokens) this step.
    pub n: usize,
    /// Absolute position of the first row.
    pub start_pos: usize,
    pub table: &'a [u32],
    /// Recurrent-state slot.
    pub slot: usize,
    /// Keep the recurrent state after each token (a draft-verification step; see
    /// `cache::StepCheckpoints`).
    pub checkpoint: bool,
}

/// Whether `dir/config.json` declares a `glm5_next` model.
pub fn is_glm5_dir(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join(hf::CONFIG_FILE))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v.get("model_type").and_then(|m| m.as_str()).map(|m| MODEL_TYPES.contains(&m)))
        .unwrap_or(false)
}

/// Read `dir/config.json` as a `glm5_next` config.
pub fn read_config(dir: &Path) -> Result<Glm5Config, ModelError> {
    let path = dir.join(hf::CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
    Glm5Config::from_hf_json(&text, &path)
}

/// The llama-shaped summary the serving layers read (vocab, context, special ids); the model
/// itself is described by [`Glm5Config`], re-read from the directory by the backend.
fn summary(c: &Glm5Config) -> LlamaConfig {
    LlamaConfig {
        model_type: MODEL_TYPES[0].into(),
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        intermediate_size: c.intermediate_size,
        num_hidden_layers: c.num_hidden_layers,
        num_attention_heads: c.num_attention_heads,
        num_key_value_heads: c.num_attention_heads,
        head_dim: c.qk_nope_head_dim,
        rms_norm_eps: c.rms_norm_eps,
        rope_theta: 0.0,
        rope_scaling: None,
        max_position_embeddings: c.max_position_embeddings,
        tie_word_embeddings: c.tie_word_embeddings,
        attention_qkv_bias: false,
        attention_out_bias: false,
        mlp_bias: false,
        qk_norm: false,
        sliding_window: None,
        rope_ggml_style: false,
        bos_token_id: c.bos_token_id,
        eos_token_ids: c.eos_token_ids.clone(),
    }
}

/// Open a `glm5_next` HF directory: config, memory-mapped weights, tokenizer, generation config.
pub fn open_dir(dir: &Path) -> Result<ModelBundle, ModelError> {
    let cfg = read_config(dir)?;
    let config = summary(&cfg);
    let weights = SafetensorsWeights::open_dir(dir)?;
    let generation = hf::read_generation_config(dir)?;
    let tokenizer = hf::load_tokenizer(dir, &config, &generation)?;
    tracing::info!(dir = %dir.display(), layers = cfg.num_hidden_layers, tensors = weights.len(), "opened glm5_next model");
    let name = dir
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| dir.display().to_string());
    Ok(ModelBundle { name, config, weights: Box::new(weights), tokenizer, generation })
}

/// Config and weights: everything needed to run a forward pass over a given cache.
pub struct Glm5Model {
    pub cfg: Glm5Config,
    pub weights: Glm5Weights,
}

/// One mHC site over all rows: collapsed + normalised block inputs and the expand weights.
fn hc_site(
    c: &Glm5Config,
    hc: &HyperConnection,
    norm: &[f32],
    x: &[f32],
    simd: bool,
) -> Result<(Vec<f32>, Vec<HcWeights>), BackendError> {
    let (m, d) = (c.hc_mult, c.hidden_size);
    let rows = x.len() / (m * d);
    let mut xn = vec![0f32; x.len()];
    xn.par_chunks_mut(m * d).zip(x.par_chunks(m * d)).for_each(|(o, xr)| hc_normalize(xr, c.rms_norm_eps, o));
    let n = (2 + m) * m;
    let mut mix = vec![0f32; rows * n];
    hc.proj.forward(&xn, rows, &mut mix, &mut LinearScratch::default(), simd)?;
    let mut u = vec![0f32; rows * d];
    let hcw = u
        .par_chunks_mut(d)
        .zip(x.par_chunks(m * d))
        .zip(mix.par_chunks(n))
        .map(|((ur, xr), mr)| {
            let w = hyper_connection(hc, mr, xr, m, c.hc_eps, c.hc_sinkhorn_iters, ur);
            rms_norm(ur, norm, c.rms_norm_eps);
            w
        })
        .collect();
    Ok((u, hcw))
}

fn expand(c: &Glm5Config, hcw: &[HcWeights], x: &[f32], y: &[f32]) -> Vec<f32> {
    let (m, d) = (c.hc_mult, c.hidden_size);
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(m * d)
        .zip(x.par_chunks(m * d))
        .zip(y.par_chunks(d))
        .zip(hcw)
        .for_each(|(((o, xr), yr), w)| hyper_expand(w, xr, yr, o));
    out
}

impl Glm5Model {
    /// Run one step over `batch`, appending to the cache, and return the requested logits.
    /// Slots of sequences starting at position 0 are reset first. Sequences with `verify[i]` set
    /// keep per-token state checkpoints until `Glm5Cache::commit_verified`; every other slot in
    /// the batch drops checkpoints left from an earlier step.
    pub fn forward(
        &self,
        cache: &mut cache::Glm5Cache,
        batch: &[SeqStep<'_>],
        verify: &[bool],
        simd: bool,
    ) -> Result<StepLogits, BackendError> {
        let c = &self.cfg;
        let (m, d) = (c.hc_mult, c.hidden_size);
        let mut seqs = Vec::with_capacity(batch.len());
        let mut row0 = 0;
        for s in batch {
            let slot = s.state_slot as usize;
            if slot >= cache.geom.state_slots {
                return Err(BackendError::InvalidStep(format!(
                    "recurrent-state slot {slot} is out of range, the backend has {}",
                    cache.geom.state_slots
                )));
            }
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                return Err(BackendError::InvalidStep(format!(
                    "token id {t} is outside the vocabulary of {}",
                    c.vocab_size
                )));
            }
            // The recurrent state can only continue from where it stopped (or from a restored
            // snapshot): anything else means the slot holds another sequence's state.
            if let Some(at) = cache.slot_pos[slot] {
                if s.start_pos != 0 && s.start_pos != at {
                    return Err(BackendError::InvalidStep(format!(
                        "recurrent-state slot {slot} holds a state at position {at}, but the step continues from \
                         position {} (restore that position's snapshot with write_state_slot first)",
                        s.start_pos
                    )));
                }
            }
            let checkpoint = verify.get(seqs.len()).copied().unwrap_or(false);
            seqs.push(SeqRows {
                row0,
                n: s.tokens.len(),
                start_pos: s.start_pos,
                table: s.block_table,
                slot,
                checkpoint,
            });
            row0 += s.tokens.len();
        }
        if seqs.iter().enumerate().any(|(i, a)| seqs[..i].iter().any(|b| b.slot == a.slot)) {
            return Err(BackendError::InvalidStep("two sequences in one step share a recurrent-state slot".into()));
        }
        for s in &seqs {
            if s.start_pos == 0 {
                cache.slot_mut(s.slot).fill(0.0);
            }
            cache.slot_pos[s.slot] = Some(s.start_pos + s.n);
            cache.checkpoints[s.slot] = s.checkpoint.then(|| cache::StepCheckpoints {
                start_pos: s.start_pos,
                tokens: s.n,
                images: vec![0f32; (s.n - 1) * cache.slot_stride],
            });
        }
        let n_rows = row0;
        let mut x = vec![0f32; n_rows * m * d];
        let tokens = batch.iter().flat_map(|s| s.tokens.iter());
        for (xr, &t) in x.chunks_mut(m * d).zip(tokens) {
            self.weights.embed.row_f32(t as usize, &mut xr[..d]);
            let (first, rest) = xr.split_at_mut(d);
            rest.chunks_mut(d).for_each(|s| s.copy_from_slice(first));
        }
        let mut carried: Option<mla::Selection> = None;
        for (l, layer) in self.weights.layers.iter().enumerate() {
            let (u, hcw) = hc_site(c, &layer.attn_hc, &layer.input_norm, &x, simd)?;
            let y = match &layer.mixer {
                Mixer::Kda(w) => {
                    carried = None;
                    let slots =
                        cache.kda[l].ok_or_else(|| BackendError::InvalidStep(format!("layer {l}: no KDA slots")))?;
                    kda::forward(c, w, &u, &seqs, cache, slots, simd)?
                }
                Mixer::Dsa(w) => {
                    let slots =
                        cache.dsa[l].ok_or_else(|| BackendError::InvalidStep(format!("layer {l}: no DSA slots")))?;
                    let shared = (c.layer_types[l] == MixerKind::Dsa && c.indexer_types[l] == IndexerKind::Shared)
                        .then_some(carried.as_ref())
                        .flatten();
                    let (y, sel) = mla::forward(c, w, &u, &seqs, cache, slots, shared, simd)?;
                    carried = sel;
                    y
                }
            };
            x = expand(c, &hcw, &x, &y);
            let (u, hcw) = hc_site(c, &layer.ffn_hc, &layer.post_norm, &x, simd)?;
            let z = match &layer.ffn {
                Ffn::Dense(w) => ffn::mlp(w, &u, n_rows, c.swiglu_limit, simd)?,
                Ffn::Moe(w) => ffn::moe(c, w, &u, n_rows, simd)?,
            };
            x = expand(c, &hcw, &x, &z);
        }
        // Logits rows: each sequence's last `logits_rows` tokens.
        let mut offsets = vec![0];
        let mut rows = Vec::new();
        for (s, sr) in batch.iter().zip(&seqs) {
            rows.extend(sr.row0 + sr.n - s.logits_rows..sr.row0 + sr.n);
            offsets.push(rows.len());
        }
        let mut h = vec![0f32; rows.len() * d];
        for (hr, &r) in h.chunks_mut(d).zip(&rows) {
            let xr = &x[r * m * d..(r + 1) * m * d];
            for (ch, v) in hr.iter_mut().enumerate() {
                *v = (0..m).map(|s| xr[s * d + ch]).sum::<f32>() / m as f32;
            }
            rms_norm(hr, &self.weights.norm, c.rms_norm_eps);
        }
        let mut data = vec![0f32; rows.len() * c.vocab_size];
        self.weights.lm_head.as_ref().unwrap_or(&self.weights.embed).forward(
            &h,
            rows.len(),
            &mut data,
            &mut LinearScratch::default(),
            simd,
        )?;
        Ok(StepLogits { vocab: c.vocab_size, data, offsets })
    }
}
