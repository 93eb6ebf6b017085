//! Images and video in: decoding user media into RGB pixels and turning them into the vision
//! tower's input exactly as transformers' `Glm5NextImageProcessor` does (resize under the
//! image-token budget with PIL's bicubic filter, rescale, normalize, temporal duplication, patch
//! flattening) and its `Glm5NextVideoProcessor` (frame sampling, one canvas per video, torch's
//! resize; `video`), plus the content hash that identifies an image to the caches.
//!
//! Owns pixels and their layout, and the fetching of remote media (`remote` holds its rules,
//! `fetch` the client): no model weights, no tokens. The API decides which bytes are allowed in
//! (data URLs, local paths, remote fetches) and the backend runs the tower on what this module
//! produces. Nothing here touches the scheduler, the KV pool or a device.

pub mod container;
pub mod decode;
pub mod fetch;
#[cfg(feature = "video-ffmpeg")]
mod ffmpeg;
pub mod processor;
pub mod remote;
pub mod resample;
pub mod source;
pub mod video;

pub use self::decode::{decode_image, DecodeLimits, RgbImage};
pub use self::processor::{ImageProcessor, ProcessedImage};
pub use self::video::{frame_labels, ProcessedVideo, VideoMeta, VideoProcessor};

/// Why an image could not be turned into model input; every variant is the client's fault (400).
#[derive(Debug, thiserror::Error)]
pub enum MediaError {
    #[error("the image could not be decoded: {0}")]
    Decode(String),
    #[error("the image is {width}x{height} pixels, more than the limit of {limit} pixels")]
    TooManyPixels { width: u32, height: u32, limit: u64 },
    #[error("the image is {bytes} bytes, more than the limit of {limit} bytes")]
    TooManyBytes { bytes: usize, limit: usize },
    /// The server's media policy refuses the reference (scheme, directory, remote fetching).
    #[error("{0}")]
    Refused(String),
    #[error("image processor: {0}")]
    Settings(String),
    #[error("the video has {frames} frames, more than the limit of {limit} frames")]
    TooManyFrames { frames: usize, limit: usize },
    /// A video container (mp4, webm, ...) on a build without the `video-ffmpeg` feature.
    #[error("{0}")]
    NoDecoder(String),
    /// A remote URL could not be fetched (the message names the URL and why).
    #[error("{0}")]
    Fetch(String),
}

/// A stable 64-bit content hash of an image's model input (grid and pixel values): equal inputs
/// share a cache identity, different images never do (except by a 2^-64 accident).
pub fn content_hash(image: &ProcessedImage) -> u64 {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for g in image.grid {
        h.update((g as u64).to_le_bytes());
    }
    for v in &image.pixel_values {
        h.update(v.to_le_bytes());
    }
    let d = h.finalize();
    u64::from_le_bytes(d[..8].try_into().expect("a SHA-256 digest has 32 bytes"))
}

/// Repeat each single `placeholder` of `ids` (one per image, as chat templates write them)
/// `counts[k]` times for the `k`-th image (its `ProcessedImage::tokens`), as transformers'
/// processor expands them. Returns the expanded ids and each image's span in them; `None` when
/// the ids hold a different number of placeholders than there are images.
pub fn expand_placeholders(
    ids: &[u32],
    placeholder: u32,
    counts: &[usize],
) -> Option<(Vec<u32>, Vec<std::ops::Range<usize>>)> {
    if ids.iter().filter(|&&t| t == placeholder).count() != counts.len() {
        return None;
    }
    let mut out = Vec::with_capacity(ids.len() + counts.iter().sum::<usize>());
    let mut spans = Vec::with_capacity(counts.len());
    let mut next = counts.iter();
    for &t in ids {
        if t != placeholder {
            out.push(t);
            continue;
        }
        let n = *next.next()?;
        spans.push(out.len()..out.len() + n);
        out.extend(std::iter::repeat_n(t, n));
    }
    Some((out, spans))
}
