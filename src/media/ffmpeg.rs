//! Container decoding with the ffmpeg libraries (`video-ffmpeg` feature), as transformers' PyAV
//! path reads a video: the best video stream, its frame count and average rate from the
//! container (`duration = frames / rate`), `VideoProcessor::sample_frames` on that metadata, and
//! every kept frame converted to RGB24 with swscale's bilinear flags (PyAV's default
//! `to_ndarray(format="rgb24")`). Streams that do not state their frame count are counted by
//! demuxing first. libav reads from a file, so the bytes are written to a private temporary file
//! that is removed afterwards.

use std::io::Write;

use ffmpeg_next as ff;

use super::container::{DecodedVideo, VideoLimits};
use super::{MediaError, RgbImage, VideoMeta, VideoProcessor};

fn bad(e: impl std::fmt::Display) -> MediaError {
    MediaError::Decode(format!("the video could not be decoded: {e}"))
}

/// A temporary file removed on drop.
struct TempFile(std::path::PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn temp_file(bytes: &[u8]) -> Result<TempFile, MediaError> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = format!("shelfserve-video-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
    let path = std::env::temp_dir().join(name);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(&path).map_err(bad)?;
    let file = TempFile(path);
    f.write_all(bytes).map_err(bad)?;
    Ok(file)
}

/// Decode `bytes` and keep the frames `processor.sample_frames` picks.
pub fn decode_video(bytes: &[u8], processor: &VideoProcessor, limits: VideoLimits) -> Result<DecodedVideo, MediaError> {
    ff::init().map_err(bad)?;
    let file = temp_file(bytes)?;
    let mut input = ff::format::input(&file.0).map_err(bad)?;
    let stream = input.streams().best(ff::media::Type::Video).ok_or_else(|| bad("it has no video stream"))?;
    let index = stream.index();
    let rate = stream.avg_frame_rate();
    let fps = if rate.denominator() != 0 { f64::from(rate) } else { 0.0 };
    if fps.is_nan() || fps <= 0.0 {
        return Err(bad("its video stream states no frame rate"));
    }
    let mut total = usize::try_from(stream.frames()).unwrap_or(0);
    let parameters = stream.parameters();
    if total == 0 {
        total = input.packets().filter(|(s, _)| s.index() == index).count();
        input = ff::format::input(&file.0).map_err(bad)?;
    }
    if total == 0 {
        return Err(bad("its video stream has no frames"));
    }
    let meta = VideoMeta { total_frames: total, fps, duration: Some(total as f64 / fps) };
    let indices = processor.sample_frames(meta, None);
    if indices.len() > limits.max_frames {
        return Err(MediaError::TooManyFrames { frames: indices.len(), limit: limits.max_frames });
    }
    let mut decoder =
        ff::codec::context::Context::from_parameters(parameters).map_err(bad)?.decoder().video().map_err(bad)?;
    let (w, h) = (decoder.width(), decoder.height());
    if w as u64 * h as u64 > limits.max_pixels {
        return Err(MediaError::TooManyPixels { width: w, height: h, limit: limits.max_pixels });
    }
    let mut scaler = ff::software::scaling::Context::get(
        decoder.format(),
        w,
        h,
        ff::format::Pixel::RGB24,
        w,
        h,
        ff::software::scaling::Flags::BILINEAR,
    )
    .map_err(bad)?;
    // `indices` is sorted and may repeat its last entry (padding to an even count).
    let last = *indices.last().expect("sampling keeps at least one frame");
    let mut frames: Vec<RgbImage> = Vec::with_capacity(indices.len());
    let mut next = 0usize;
    let mut seen = 0usize;
    let mut decoded = ff::frame::Video::empty();
    let mut keep = |frame: &ff::frame::Video, frames: &mut Vec<RgbImage>| -> Result<(), MediaError> {
        let mut rgb = ff::frame::Video::empty();
        scaler.run(frame, &mut rgb).map_err(bad)?;
        let stride = rgb.stride(0);
        let row = w as usize * 3;
        let data = rgb.data(0);
        let mut out = Vec::with_capacity(row * h as usize);
        for y in 0..h as usize {
            out.extend_from_slice(&data[y * stride..y * stride + row]);
        }
        frames.push(RgbImage::new(w, h, out));
        Ok(())
    };
    let mut drain = |decoder: &mut ff::decoder::Video, frames: &mut Vec<RgbImage>| -> Result<bool, MediaError> {
        while decoder.receive_frame(&mut decoded).is_ok() {
            while next < indices.len() && indices[next] == seen {
                if next > 0 && indices[next - 1] == seen {
                    let copy = frames.last().expect("a frame was kept").clone();
                    frames.push(copy);
                } else {
                    keep(&decoded, frames)?;
                }
                next += 1;
            }
            seen += 1;
            if seen > last {
                return Ok(true);
            }
        }
        Ok(false)
    };
    let mut done = false;
    for (s, packet) in input.packets() {
        if s.index() != index {
            continue;
        }
        decoder.send_packet(&packet).map_err(bad)?;
        if drain(&mut decoder, &mut frames)? {
            done = true;
            break;
        }
    }
    if !done {
        decoder.send_eof().map_err(bad)?;
        drain(&mut decoder, &mut frames)?;
    }
    // A container that stated more frames than it holds: the missing tail repeats the last
    // frame decoded (PyAV would return fewer; the count must stay even for the temporal patch).
    if frames.is_empty() {
        return Err(bad("no frame could be decoded"));
    }
    while frames.len() < indices.len() {
        frames.push(frames.last().expect("not empty").clone());
    }
    Ok(DecodedVideo { frames, indices, fps })
}
