//! Video parts of chat requests (`api::media` takes them out of the messages):
//!
//! * `{"type": "video_url", "video_url": {"url": …}}` (or a `video` part whose `video` is one
//!   URL): a container (mp4, webm, …) as a `data:` URL, a `file://` path or a fetched `http(s)`
//!   URL under the same policy as images, decoded and sampled at the video processor's rate with the `video-ffmpeg` cargo
//!   feature, refused with a 400 naming the feature without it;
//! * `{"type": "video", "video": [frame URLs…], "fps": N}`: frames already sampled, each an image
//!   URL under the image rules, `N` frames per second of the original (transformers' default of
//!   24 when absent); no decoder needed.
//!
//! Either way the frames go through `media::VideoProcessor` and come back as one image per frame
//! pair plus the pair's tokenized timestamp text.

use std::borrow::Cow;

use serde_json::Value;

use super::errors::ApiError;
use super::media::{media_error, MediaOptions};
use super::media_fetch::{fetched_bytes, Fetched};
use crate::actors::handle::VisionInfo;
use crate::media::container::{decode_video, VideoLimits};
use crate::media::source::{resolve, MediaBytes, MediaPolicy};
use crate::media::{decode_image, frame_labels, DecodeLimits, MediaError, ProcessedImage};

/// The frame rate transformers assumes for frames given without metadata.
pub const DEFAULT_FRAME_LIST_FPS: f64 = 24.0;

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum VideoSource {
    /// A container URL.
    Container(String),
    /// Pre-sampled frames (image URLs) and the rate they were taken at.
    Frames { urls: Vec<String>, fps: Option<f64> },
}

/// A processed video: its frame pairs as images and each pair's timestamp tokens.
pub(crate) struct LoadedVideo {
    pub pairs: Vec<ProcessedImage>,
    pub labels: Vec<Vec<u32>>,
}

pub(crate) fn video_source(part: &Value, param: &str) -> Result<VideoSource, ApiError> {
    let bad =
        |field: &str, what: &str| ApiError::invalid(format!("{param}.{field}"), format!("`{param}.{field}` {what}"));
    if part.get("type").and_then(Value::as_str) == Some("video_url") {
        return match part.get("video_url") {
            Some(Value::String(u)) => Ok(VideoSource::Container(u.clone())),
            Some(Value::Object(o)) => match o.get("url") {
                Some(Value::String(u)) => Ok(VideoSource::Container(u.clone())),
                _ => Err(bad("video_url.url", "must be a string (a `data:` URL or a `file://` path)")),
            },
            _ => Err(bad("video_url", "must be an object with a `url`")),
        };
    }
    let fps = match part.get("fps") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_f64().filter(|f| f.is_finite() && *f > 0.0) {
            Some(f) => Some(f),
            None => return Err(bad("fps", "must be a positive number (frames per second of the original video)")),
        },
    };
    match part.get("video") {
        Some(Value::String(u)) => Ok(VideoSource::Container(u.clone())),
        Some(Value::Array(frames)) => {
            let urls = frames
                .iter()
                .enumerate()
                .map(|(k, f)| match f {
                    Value::String(u) => Ok(u.clone()),
                    Value::Object(o) => match o.get("url").or_else(|| o.get("image_url").and_then(|i| i.get("url"))) {
                        Some(Value::String(u)) => Ok(u.clone()),
                        _ => Err(bad(&format!("video[{k}]"), "must be an image URL or an object with a `url`")),
                    },
                    _ => Err(bad(&format!("video[{k}]"), "must be an image URL (a `data:` URL or a `file://` path)")),
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(VideoSource::Frames { urls, fps })
        }
        _ => Err(bad("video", "must be a list of frame image URLs, or one video URL")),
    }
}

/// Limits that need no decoding: a frame list's length.
pub(crate) fn check_frames(src: &VideoSource, param: &str, opts: &MediaOptions) -> Result<(), ApiError> {
    if let VideoSource::Frames { urls, .. } = src {
        if urls.is_empty() {
            return Err(ApiError::invalid(format!("{param}.video"), format!("`{param}.video` has no frames")));
        }
        if urls.len() > opts.max_video_frames {
            return Err(media_error(
                &format!("{param}.video"),
                MediaError::TooManyFrames { frames: urls.len(), limit: opts.max_video_frames },
                opts,
            ));
        }
    }
    Ok(())
}

fn resolve_bytes<'a>(url: &str, policy: &MediaPolicy, remote: &'a Fetched) -> Result<Cow<'a, [u8]>, MediaError> {
    match resolve(url, policy)? {
        MediaBytes::Inline(b) => Ok(Cow::Owned(b)),
        MediaBytes::Remote(url) => fetched_bytes(remote, &url).map(Cow::Borrowed),
    }
}

pub(crate) fn load(
    src: &VideoSource,
    param: &str,
    vision: &VisionInfo,
    opts: &MediaOptions,
    remote: &Fetched,
    encode_text: &dyn Fn(&str) -> Result<Vec<u32>, ApiError>,
) -> Result<LoadedVideo, ApiError> {
    let video = vision.video.as_ref().expect("check_media refuses video for a model without video info");
    let mut policy = MediaPolicy {
        allowed_local_path: opts.allowed_local_path.clone(),
        allow_remote: opts.allow_remote,
        max_bytes: opts.max_bytes,
    };
    let (frames, indices, fps) = match src {
        VideoSource::Frames { urls, fps } => {
            let mut frames = Vec::with_capacity(urls.len());
            for (k, url) in urls.iter().enumerate() {
                let at = format!("{param}.video[{k}]");
                let bytes = resolve_bytes(url, &policy, remote).map_err(|e| media_error(&at, e, opts))?;
                let limits = DecodeLimits { max_bytes: opts.max_bytes, max_pixels: opts.max_pixels };
                frames.push(decode_image(&bytes, limits).map_err(|e| media_error(&at, e, opts))?);
            }
            (frames, (0..urls.len()).collect::<Vec<_>>(), fps.unwrap_or(DEFAULT_FRAME_LIST_FPS))
        }
        VideoSource::Container(url) => {
            policy.max_bytes = opts.max_video_bytes;
            let bytes = resolve_bytes(url, &policy, remote).map_err(|e| video_error(param, e, opts))?;
            let limits = VideoLimits { max_frames: opts.max_video_frames, max_pixels: opts.max_pixels };
            let d = decode_video(&bytes, &video.processor, limits).map_err(|e| video_error(param, e, opts))?;
            (d.frames, d.indices, d.fps)
        }
    };
    let processed = video.processor.process(&frames).map_err(|e| media_error(param, e, opts))?;
    let labels =
        frame_labels(&indices, fps, processed.grid[0]).iter().map(|l| encode_text(l)).collect::<Result<Vec<_>, _>>()?;
    Ok(LoadedVideo { pairs: processed.frames(), labels })
}

/// A container's errors name the video limits (`media_error` names the image ones).
fn video_error(param: &str, e: MediaError, opts: &MediaOptions) -> ApiError {
    match e {
        MediaError::TooManyBytes { bytes, .. } => ApiError::invalid(
            param,
            format!(
                "the video is {bytes} bytes, more than the limit of {} bytes per video (--max-video-bytes)",
                opts.max_video_bytes
            ),
        ),
        MediaError::NoDecoder(m) => ApiError::invalid(param, m),
        other => media_error(param, other, opts),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn both_video_forms_parse_and_bad_ones_name_their_field() {
        let p = "messages[0].content[1]";
        assert_eq!(
            video_source(&json!({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AA"}}), p).unwrap(),
            VideoSource::Container("data:video/mp4;base64,AA".into())
        );
        assert_eq!(
            video_source(&json!({"type": "video", "video": ["data:a", {"url": "data:b"}], "fps": 2}), p).unwrap(),
            VideoSource::Frames { urls: vec!["data:a".into(), "data:b".into()], fps: Some(2.0) }
        );
        let err = video_source(&json!({"type": "video", "video": ["x"], "fps": 0}), p).unwrap_err();
        assert!(err.to_string().contains("fps"), "{err}");
        let err = video_source(&json!({"type": "video", "video": [3]}), p).unwrap_err();
        assert!(matches!(&err, ApiError::InvalidField { param, .. } if param.ends_with("video[0]")), "{err}");
    }

    #[test]
    fn frame_counts_are_limited_before_decoding() {
        let opts = MediaOptions { max_video_frames: 2, ..MediaOptions::default() };
        let three = VideoSource::Frames { urls: vec!["a".into(), "b".into(), "c".into()], fps: None };
        let err = check_frames(&three, "m", &opts).unwrap_err();
        assert!(err.to_string().contains("--max-video-frames"), "{err}");
        let none = VideoSource::Frames { urls: vec![], fps: None };
        assert!(check_frames(&none, "m", &opts).is_err());
        assert!(check_frames(&VideoSource::Container("x".into()), "m", &opts).is_ok());
    }
}
