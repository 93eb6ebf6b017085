//! Video containers (mp4, webm, mkv, …) to sampled RGB frames. Decoding needs the ffmpeg
//! libraries and is compiled only with the `video-ffmpeg` cargo feature (`docs/vision.md` lists
//! the Debian packages); without it every container is refused with a message that names the
//! feature and the frame-list form that needs no decoder.

use super::RgbImage;

/// What one decoded video may cost.
#[derive(Clone, Copy, Debug)]
pub struct VideoLimits {
    /// Frames kept after sampling.
    pub max_frames: usize,
    /// Width × height of a frame.
    pub max_pixels: u64,
}

/// The sampled frames of a container, their indices in the stream and the stream's frame rate
/// (for the timestamps the prompt carries).
pub struct DecodedVideo {
    pub frames: Vec<RgbImage>,
    pub indices: Vec<usize>,
    pub fps: f64,
}

/// The message a build without a decoder gives for a container.
pub const NO_DECODER: &str = "decoding video containers (mp4, webm, ...) needs a server built with the \
     `video-ffmpeg` cargo feature; send the frames instead as {\"type\": \"video\", \"video\": [image URLs], \
     \"fps\": N}";

/// Decode `bytes` and keep the frames `processor.sample_frames` picks.
#[cfg(not(feature = "video-ffmpeg"))]
pub fn decode_video(
    bytes: &[u8],
    processor: &super::VideoProcessor,
    limits: VideoLimits,
) -> Result<DecodedVideo, super::MediaError> {
    let _ = (bytes, processor, limits);
    Err(super::MediaError::NoDecoder(NO_DECODER.into()))
}

#[cfg(feature = "video-ffmpeg")]
pub use super::ffmpeg::decode_video;
