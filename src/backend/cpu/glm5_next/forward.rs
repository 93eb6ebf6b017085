//! The CPU forward pass of `glm5_next` over a ragged batch: embedding, per layer the mHC sites
//! around the mixer (KDA or MLA+DSA) and the FFN (dense or MoE), final norm and `lm_head`.

use rayon::prelude::*;

use super::cache::{self, Glm5Cache};
use super::ops::{hc_normalize, hyper_connection, hyper_expand, rms_norm, HcWeights};
use super::shard::RankGroup;
use super::weights::{Ffn, Glm5Weights, HyperConnection, Mixer};
use super::{ffn, kda, mla};
use crate::backend::cpu::linear::LinearScratch;
pub use crate::backend::glm5_steps::SeqRows;
use crate::backend::glm5_steps::{logits_rows, plan_rows};
use crate::backend::{BackendError, EmbeddedRows, SeqStep, StepLogits, TapRecorder};
use crate::model::glm5_next::config::{IndexerKind, MixerKind};
use crate::model::glm5_next::Glm5Config;

/// Config and weights: everything needed to run a forward pass over a given cache. Under tensor
/// parallelism `cfg` is the rank's local config, `weights` its shard and `group` its handle to the
/// other ranks (`shard.rs`).
pub struct Glm5Model {
    pub cfg: Glm5Config,
    pub weights: Glm5Weights,
    pub group: Option<RankGroup>,
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

/// The mean of a row's `m` residual streams (`out` is one stream wide).
fn collapse_streams(xr: &[f32], m: usize, out: &mut [f32]) {
    let d = out.len();
    for (ch, v) in out.iter_mut().enumerate() {
        *v = (0..m).map(|s| xr[s * d + ch]).sum::<f32>() / m as f32;
    }
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

/// Overwrite the given rows of `x` (`streams` mHC streams of width `d` per row) with their
/// embeddings, after a check that each run has the model's width and lies inside its
/// sequence's step.
fn place_embeddings(
    x: &mut [f32],
    streams: usize,
    d: usize,
    seqs: &[SeqRows<'_>],
    embeds: &[Vec<EmbeddedRows<'_>>],
) -> Result<(), BackendError> {
    let stride = streams * d;
    for (s, runs) in seqs.iter().zip(embeds.iter().chain(std::iter::repeat(&Vec::new()))) {
        for run in runs {
            let rows = run.data.len() / d;
            if run.hidden != d || run.data.len() % d != 0 || run.first_row + rows > s.n {
                return Err(BackendError::InvalidStep(format!(
                    "embedded rows {}..{} of width {} do not fit a step of {} tokens of width {d}",
                    run.first_row,
                    run.first_row + rows,
                    run.hidden,
                    s.n
                )));
            }
            for (r, e) in run.data.chunks(d).enumerate() {
                let row = &mut x[(s.row0 + run.first_row + r) * stride..][..stride];
                row.chunks_mut(d).for_each(|stream| stream.copy_from_slice(e));
            }
        }
    }
    Ok(())
}

impl Glm5Model {
    /// Sum a row-parallel partial result over the ranks (nothing to do unsharded).
    fn reduce(&self, mut y: Vec<f32>) -> Result<Vec<f32>, BackendError> {
        if let Some(g) = &self.group {
            g.all_reduce(&mut y)?;
        }
        Ok(y)
    }

    /// Run one step over `batch`, appending to the cache, and return the requested logits.
    /// Slots of sequences starting at position 0 are reset first. Sequences with `verify[i]` set
    /// keep per-token state checkpoints until `Glm5Cache::commit_verified`; every other slot in
    /// the batch drops checkpoints left from an earlier step.
    pub fn forward(
        &self,
        cache: &mut Glm5Cache,
        batch: &[SeqStep<'_>],
        verify: &[bool],
        simd: bool,
    ) -> Result<StepLogits, BackendError> {
        self.forward_full(cache, batch, verify, &[], simd, None)
    }

    /// [`Self::forward`] where the rows `embeds[i]` of sequence `i` take the given embeddings
    /// (image placeholders) instead of their token's; `embeds` may be shorter than the batch.
    pub fn forward_embedded(
        &self,
        cache: &mut Glm5Cache,
        batch: &[SeqStep<'_>],
        verify: &[bool],
        embeds: &[Vec<EmbeddedRows<'_>>],
        simd: bool,
    ) -> Result<StepLogits, BackendError> {
        self.forward_full(cache, batch, verify, embeds, simd, None)
    }

    /// [`Glm5Model::forward`], also offering every layer's output (the mean of its mHC streams)
    /// to `taps`.
    pub fn forward_tapped(
        &self,
        cache: &mut Glm5Cache,
        batch: &[SeqStep<'_>],
        verify: &[bool],
        simd: bool,
        taps: Option<&mut TapRecorder>,
    ) -> Result<StepLogits, BackendError> {
        self.forward_full(cache, batch, verify, &[], simd, taps)
    }

    /// The forward with image embeddings and layer taps both optional.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward_full(
        &self,
        cache: &mut Glm5Cache,
        batch: &[SeqStep<'_>],
        verify: &[bool],
        embeds: &[Vec<EmbeddedRows<'_>>],
        simd: bool,
        mut taps: Option<&mut TapRecorder>,
    ) -> Result<StepLogits, BackendError> {
        let c = &self.cfg;
        let (m, d) = (c.hc_mult, c.hidden_size);
        let seqs = plan_rows(batch, verify, &cache.slot_pos, c.vocab_size)?;
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
        let n_rows: usize = seqs.iter().map(|s| s.n).sum();
        let mut x = vec![0f32; n_rows * m * d];
        let tokens = batch.iter().flat_map(|s| s.tokens.iter());
        for (xr, &t) in x.chunks_mut(m * d).zip(tokens) {
            self.weights.embed.row_f32(t as usize, &mut xr[..d]);
            let (first, rest) = xr.split_at_mut(d);
            rest.chunks_mut(d).for_each(|s| s.copy_from_slice(first));
        }
        place_embeddings(&mut x, m, d, &seqs, embeds)?;
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
                    let group = self.group.as_ref();
                    let (y, sel) = mla::forward(c, w, &u, &seqs, cache, slots, shared, group, simd)?;
                    carried = sel;
                    y
                }
            };
            let y = self.reduce(y)?;
            x = expand(c, &hcw, &x, &y);
            let (u, hcw) = hc_site(c, &layer.ffn_hc, &layer.post_norm, &x, simd)?;
            let z = match &layer.ffn {
                Ffn::Dense(w) => ffn::mlp(w, &u, n_rows, c.swiglu_limit, simd)?,
                Ffn::Moe(w) => {
                    let held = self.group.as_ref().map_or(0..c.n_routed_experts, |g| g.experts.clone());
                    ffn::moe(c, w, &u, n_rows, held, simd)?
                }
            };
            let z = self.reduce(z)?;
            x = expand(c, &hcw, &x, &z);
            if let Some(taps) = taps.as_deref_mut() {
                taps.offer(l, |r, out| collapse_streams(&x[r * m * d..(r + 1) * m * d], m, out));
            }
        }
        // Logits rows: each sequence's last `logits_rows` tokens.
        let (rows, offsets) = logits_rows(batch, &seqs);
        let mut h = vec![0f32; rows.len() * d];
        for (hr, &r) in h.chunks_mut(d).zip(&rows) {
            collapse_streams(&x[r * m * d..(r + 1) * m * d], m, hr);
            rms_norm(hr, &self.weights.norm, c.rms_norm_eps);
        }
        let head = self.weights.lm_head.as_ref().unwrap_or(&self.weights.embed);
        let mut data = vec![0f32; rows.len() * head.rows];
        head.forward(&h, rows.len(), &mut data, &mut LinearScratch::default(), simd)?;
        if let Some(g) = &self.group {
            data = g.gather_vocab(&data, rows.len(), c.vocab_size)?;
        }
        Ok(StepLogits { vocab: c.vocab_size, data, offsets })
    }
}
