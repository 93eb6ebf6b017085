//! The compute thread's vision-tower cache and the encoding of a step's images: which images a
//! step's sequences cover, encoded once each (cached by content hash across steps), and the
//! embedding runs each sequence's rows take. No actor code; the executor's thread owns the cache.

use std::sync::Arc;

use super::executor::{PlanSeq, StepPlan};
use super::handle::PromptImage;
use crate::backend::{Backend, BackendError, ImageEmbedding, ImageInput};
use crate::sched::SeqId;

/// Vision-tower outputs by image content hash, owned by the compute thread: an image whose
/// placeholders span several prefill chunks (or that a resumed or repeated request sends again)
/// is encoded once while it stays among the most recent `capacity` images.
pub struct EncoderCache {
    capacity: usize,
    entries: std::collections::VecDeque<(u64, Arc<ImageEmbedding>)>,
}

impl EncoderCache {
    pub fn new(capacity: usize) -> Self {
        EncoderCache { capacity, entries: std::collections::VecDeque::new() }
    }

    fn get(&mut self, hash: u64) -> Option<Arc<ImageEmbedding>> {
        let i = self.entries.iter().position(|(h, _)| *h == hash)?;
        let entry = self.entries.remove(i).expect("index from position");
        let e = Arc::clone(&entry.1);
        self.entries.push_back(entry);
        Some(e)
    }

    fn insert(&mut self, hash: u64, e: Arc<ImageEmbedding>) {
        if self.capacity > 0 {
            if self.entries.len() == self.capacity {
                self.entries.pop_front();
            }
            self.entries.push_back((hash, e));
        }
    }
}

/// Images the step's sequences cover, encoded: per sequence, `(first row in the step, image
/// embedding, first image row)` runs.
pub(super) type StepEmbeds = Vec<Vec<(usize, Arc<ImageEmbedding>, usize, usize)>>;

/// Encode the images the step's sequences cover that the cache does not hold, in one
/// `Backend::encode_images` call (each distinct image once). A sequence one of whose images
/// fails is returned in the second list with the reason, and gets no runs: only its request
/// fails.
pub(super) fn encode_step_images(
    backend: &mut dyn Backend,
    plan: &StepPlan,
    cache: &mut EncoderCache,
) -> (StepEmbeds, Vec<(SeqId, String)>) {
    fn covered(s: &PlanSeq) -> impl Iterator<Item = &PromptImage> + '_ {
        let (lo, hi) = (s.start_pos, s.start_pos + s.tokens.len() - s.num_draft);
        s.images.iter().filter(move |img| img.span.start < hi && img.span.end > lo)
    }
    let mut ready: std::collections::HashMap<u64, Result<Arc<ImageEmbedding>, String>> = Default::default();
    let mut missing: Vec<&PromptImage> = Vec::new();
    for img in plan.seqs.iter().flat_map(covered) {
        if ready.contains_key(&img.hash) {
            continue;
        }
        match cache.get(img.hash) {
            Some(e) => {
                ready.insert(img.hash, Ok(e));
            }
            None if missing.iter().any(|m| m.hash == img.hash) => {}
            None => missing.push(img),
        }
    }
    if !missing.is_empty() {
        let inputs: Vec<ImageInput<'_>> =
            missing.iter().map(|m| ImageInput { pixel_values: &m.pixel_values, grid: m.grid }).collect();
        let mut results = backend.encode_images(&inputs);
        results
            .resize_with(missing.len(), || Err(BackendError::InvalidStep("the backend encoded too few images".into())));
        for (img, r) in missing.iter().zip(results) {
            let r = match r {
                Ok(e) if e.rows != img.span.len() => Err(format!(
                    "an image of grid {:?} encodes to {} rows but holds {} placeholder tokens",
                    img.grid,
                    e.rows,
                    img.span.len()
                )),
                Ok(e) => {
                    let e = Arc::new(e);
                    cache.insert(img.hash, Arc::clone(&e));
                    Ok(e)
                }
                Err(e) => Err(e.to_string()),
            };
            ready.insert(img.hash, r);
        }
    }
    let mut rejected = Vec::new();
    let embeds = plan
        .seqs
        .iter()
        .map(|s| {
            let lo = s.start_pos;
            let runs: Result<Vec<_>, String> = covered(s)
                .map(|img| {
                    let e = ready[&img.hash].clone()?;
                    let (a, b) = (img.span.start.max(lo), img.span.end.min(lo + s.tokens.len() - s.num_draft));
                    Ok((a - lo, e, a - img.span.start, b - a))
                })
                .collect();
            runs.unwrap_or_else(|e| {
                rejected.push((s.seq, e));
                Vec::new()
            })
        })
        .collect();
    (embeds, rejected)
}
