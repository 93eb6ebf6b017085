//! Images and video in chat requests: OpenAI `image_url`, `video_url` and `video` (a list of
//! frame URLs) content parts, and Anthropic `image` blocks.
//!
//! Before the template renders, [`take_media`] swaps every image part of the conversation for a
//! bare `{"type": "image"}` part and every video part for `{"type": "video"}` (what HF chat
//! templates test for) and keeps its source; the template writes one placeholder token per image
//! or video. After tokenizing, [`attach_media`] resolves each source under the server's media
//! policy (data URLs; `file://` only under `--allowed-local-media-path`; `http(s)` URLs only
//! with `--allow-remote-media`, fetched beforehand by `api::media_fetch`),
//! decodes and processes it with the model's image or video processor under the per-request
//! limits, and expands its placeholder as transformers' processor does: an image's into one token
//! per merged patch group of its grid; a video's into, per frame pair, `<|begin_of_image|>`, the
//! pair's placeholders, `<|end_of_image|>` and its timestamp text (`api::media_video`). The
//! engine gets plain data ([`PromptImage`], one per image and one per frame pair): pixels, grid,
//! span and content hash; the executors run the vision tower.
//!
//! Every failure here is the client's (400), in the endpoint's error shape, naming the limit or
//! rule it broke.

use std::borrow::Cow;
use std::path::PathBuf;
use std::sync::Arc;

use base64::Engine as _;
use serde_json::Value;

use super::errors::ApiError;
use super::media_fetch::fetched_bytes;
pub(crate) use super::media_fetch::Fetched;
use crate::actors::handle::{PromptImage, VisionInfo};
use crate::media::fetch::Fetcher;
use crate::media::source::{resolve, MediaBytes, MediaPolicy};
use crate::media::{content_hash, decode_image, DecodeLimits, MediaError};

/// The server's media settings (`serve` flags).
#[derive(Clone, Debug)]
pub struct MediaOptions {
    /// `--allowed-local-media-path`: `file://` URLs must resolve inside it; `None` refuses them.
    pub allowed_local_path: Option<PathBuf>,
    /// `--allow-remote-media`: `http(s)` URLs are fetched (by `fetcher`); without it, a 400
    /// naming the flag.
    pub allow_remote: bool,
    /// The client and rules remote media is fetched with; `Some` exactly when `allow_remote`.
    pub fetcher: Option<Arc<Fetcher>>,
    /// `--max-images-per-request`.
    pub max_images: usize,
    /// `--max-image-pixels`: decoded width × height of one image.
    pub max_pixels: u64,
    /// `--max-image-bytes`: encoded bytes of one image (and of one frame of a frame list).
    pub max_bytes: usize,
    /// `--max-videos-per-request`.
    pub max_videos: usize,
    /// `--max-video-frames`: frames of one video that reach the model (a frame list's length,
    /// or what sampling keeps of a decoded container).
    pub max_video_frames: usize,
    /// `--max-video-bytes`: encoded bytes of one video container.
    pub max_video_bytes: usize,
}

impl MediaOptions {
    pub const DEFAULT_MAX_IMAGES: usize = 8;
    pub const DEFAULT_MAX_PIXELS: u64 = 33_177_600; // 7680 × 4320
    pub const DEFAULT_MAX_BYTES: usize = 20 << 20;
    pub const DEFAULT_MAX_VIDEOS: usize = 2;
    pub const DEFAULT_MAX_VIDEO_FRAMES: usize = 64;
    pub const DEFAULT_MAX_VIDEO_BYTES: usize = 100 << 20;
}

impl Default for MediaOptions {
    fn default() -> Self {
        MediaOptions {
            allowed_local_path: None,
            allow_remote: false,
            fetcher: None,
            max_images: Self::DEFAULT_MAX_IMAGES,
            max_pixels: Self::DEFAULT_MAX_PIXELS,
            max_bytes: Self::DEFAULT_MAX_BYTES,
            max_videos: Self::DEFAULT_MAX_VIDEOS,
            max_video_frames: Self::DEFAULT_MAX_VIDEO_FRAMES,
            max_video_bytes: Self::DEFAULT_MAX_VIDEO_BYTES,
        }
    }
}

/// Where one image or video of the conversation comes from, and the request field that sent it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct MediaRef {
    pub param: String,
    pub source: MediaSource,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum MediaSource {
    /// An OpenAI `image_url.url` or an Anthropic `url` source.
    Url(String),
    /// An Anthropic `base64` source.
    Base64(String),
    /// A video: a container URL (`video_url.url`, or a `video` part's string) or a frame list.
    Video(super::media_video::VideoSource),
}

impl MediaRef {
    fn is_video(&self) -> bool {
        matches!(self.source, MediaSource::Video(_))
    }
}

/// True for a content part that [`take_media`] takes as an image: OpenAI `image_url` or
/// Anthropic `image`.
pub(crate) fn is_image_part(part: &Value) -> bool {
    matches!(part.get("type").and_then(Value::as_str), Some("image_url" | "image"))
}

/// True for any content part [`take_media`] takes: an image, a `video_url` or a `video`.
pub(crate) fn is_media_part(part: &Value) -> bool {
    is_image_part(part) || matches!(part.get("type").and_then(Value::as_str), Some("video_url" | "video"))
}

/// Replace each image part of `messages` (list contents, in message and part order) with
/// `{"type": "image"}` and each video part with `{"type": "video"}`, and return their sources in
/// the same order.
pub(crate) fn take_media(messages: &mut [Value]) -> Result<Vec<MediaRef>, ApiError> {
    let mut refs = Vec::new();
    for (i, m) in messages.iter_mut().enumerate() {
        let Some(Value::Array(parts)) = m.get_mut("content") else { continue };
        for (j, part) in parts.iter_mut().enumerate() {
            if !is_media_part(part) {
                continue;
            }
            let param = format!("messages[{i}].content[{j}]");
            if is_image_part(part) {
                let source = image_source(part, &param)?;
                refs.push(MediaRef { param, source });
                *part = serde_json::json!({"type": "image"});
            } else {
                let source = MediaSource::Video(super::media_video::video_source(part, &param)?);
                refs.push(MediaRef { param, source });
                *part = serde_json::json!({"type": "video"});
            }
        }
    }
    Ok(refs)
}

pub(crate) fn image_source(part: &Value, param: &str) -> Result<MediaSource, ApiError> {
    let bad =
        |field: &str, what: &str| ApiError::invalid(format!("{param}.{field}"), format!("`{param}.{field}` {what}"));
    if part.get("type").and_then(Value::as_str) == Some("image_url") {
        // `image_url` is `{"url": …, "detail"?: …}`; a bare string is accepted as the URL too.
        return match part.get("image_url") {
            Some(Value::String(u)) => Ok(MediaSource::Url(u.clone())),
            Some(Value::Object(o)) => match o.get("url") {
                Some(Value::String(u)) => Ok(MediaSource::Url(u.clone())),
                _ => Err(bad("image_url.url", "must be a string (a `data:` URL or a `file://` path)")),
            },
            _ => Err(bad("image_url", "must be an object with a `url`")),
        };
    }
    // Anthropic: `{"type": "image", "source": {"type": "base64", "media_type", "data"} | {"type": "url", "url"}}`.
    let Some(source) = part.get("source").filter(|s| s.is_object()) else {
        return Err(bad("source", "must be an object with a `type` of `base64` or `url`"));
    };
    match source.get("type").and_then(Value::as_str) {
        Some("base64") => match source.get("data") {
            Some(Value::String(d)) => Ok(MediaSource::Base64(d.clone())),
            _ => Err(bad("source.data", "must be a base64 string")),
        },
        Some("url") => match source.get("url") {
            Some(Value::String(u)) => Ok(MediaSource::Url(u.clone())),
            _ => Err(bad("source.url", "must be a string")),
        },
        _ => Err(bad("source.type", "must be `base64` or `url`")),
    }
}

/// The request before any media work: a model that takes none (or not video, or not here), or
/// too many images or videos.
pub(crate) fn check_media(refs: &[MediaRef], vision: Option<&VisionInfo>, opts: &MediaOptions) -> Result<(), ApiError> {
    let Some(first) = refs.first() else { return Ok(()) };
    let Some(vision) = vision else {
        return Err(ApiError::unsupported(
            first.param.clone(),
            "this model has no vision tower, so it takes no images or video; send text only",
        ));
    };
    if let Some(why) = &vision.refused {
        return Err(ApiError::unsupported(first.param.clone(), why.clone()));
    }
    let images: Vec<&MediaRef> = refs.iter().filter(|r| !r.is_video()).collect();
    let videos: Vec<&MediaRef> = refs.iter().filter(|r| r.is_video()).collect();
    if let (Some(v), None) = (videos.first(), &vision.video) {
        return Err(ApiError::unsupported(
            v.param.clone(),
            "this model's config names no video tokens (video_token_id, image_start_token_id, image_end_token_id), \
             so it takes no video",
        ));
    }
    if images.len() > opts.max_images {
        return Err(ApiError::invalid(
            images[opts.max_images].param.clone(),
            format!(
                "the request has {} images, more than the limit of {} images per request (--max-images-per-request)",
                images.len(),
                opts.max_images
            ),
        ));
    }
    if videos.len() > opts.max_videos {
        return Err(ApiError::invalid(
            videos[opts.max_videos].param.clone(),
            format!(
                "the request has {} videos, more than the limit of {} videos per request (--max-videos-per-request)",
                videos.len(),
                opts.max_videos
            ),
        ));
    }
    for v in &videos {
        if let MediaSource::Video(src) = &v.source {
            super::media_video::check_frames(src, &v.param, opts)?;
        }
    }
    Ok(())
}

/// Decode and process every image and video of `refs`, then expand the template's one
/// placeholder per image or video in `ids` (see the module doc). `remote` holds the request's
/// fetched remote media; `encode_text` tokenizes a frame pair's timestamp text. Returns the expanded ids and one [`PromptImage`] per image and
/// per frame pair, in prompt order.
pub(crate) fn attach_media(
    refs: &[MediaRef],
    ids: Vec<u32>,
    vision: Option<&VisionInfo>,
    opts: &MediaOptions,
    remote: &Fetched,
    param: &str,
    encode_text: &dyn Fn(&str) -> Result<Vec<u32>, ApiError>,
) -> Result<(Vec<u32>, Vec<PromptImage>), ApiError> {
    if refs.is_empty() {
        return Ok((ids, Vec::new()));
    }
    check_media(refs, vision, opts)?;
    let vision = vision.expect("checked above");
    let video_token = vision.video.as_ref().map(|v| v.video_token_id);
    let (images, videos): (Vec<&MediaRef>, Vec<&MediaRef>) = refs.iter().partition(|r| !r.is_video());
    for (what, token, want) in
        [("image", Some(vision.image_token_id), images.len()), ("video", video_token, videos.len())]
    {
        let wrote = token.map_or(0, |t| ids.iter().filter(|&&x| x == t).count());
        if wrote != want {
            return Err(ApiError::invalid(
                param,
                format!(
                    "the chat template wrote {wrote} {what} placeholders for {want} {what}s: this model's template \
                     does not place {what}s where the messages put them"
                ),
            ));
        }
    }
    // Each kind fills its own placeholders in order, as transformers' processor does.
    let mut processed_images = Vec::with_capacity(images.len());
    for r in &images {
        processed_images.push(load(r, vision, opts, remote).map_err(|e| media_error(&r.param, e, opts))?);
    }
    let mut processed_videos = Vec::with_capacity(videos.len());
    for r in &videos {
        let MediaSource::Video(src) = &r.source else { unreachable!("partitioned by kind") };
        processed_videos.push(super::media_video::load(src, &r.param, vision, opts, remote, encode_text)?);
    }
    let (mut next_image, mut next_video) = (processed_images.into_iter(), processed_videos.into_iter());
    let mut out = Vec::with_capacity(ids.len());
    let mut prompt_images = Vec::new();
    let mut push_run = |out: &mut Vec<u32>, img: crate::media::ProcessedImage| {
        let n = img.tokens(vision.merge_size);
        let span = out.len()..out.len() + n;
        out.extend(std::iter::repeat_n(vision.image_token_id, n));
        prompt_images.push(PromptImage {
            span,
            grid: img.grid,
            hash: content_hash(&img),
            pixel_values: Arc::from(img.pixel_values),
        });
    };
    for t in ids {
        if t == vision.image_token_id {
            push_run(&mut out, next_image.next().expect("placeholders counted above"));
        } else if Some(t) == video_token {
            let video = vision.video.as_ref().expect("a video token implies video info");
            let v = next_video.next().expect("placeholders counted above");
            for (pair, label) in v.pairs.into_iter().zip(v.labels) {
                out.push(video.image_start_token_id);
                push_run(&mut out, pair);
                out.push(video.image_end_token_id);
                out.extend(label);
            }
        } else {
            out.push(t);
        }
    }
    Ok((out, prompt_images))
}

fn load(
    r: &MediaRef,
    vision: &VisionInfo,
    opts: &MediaOptions,
    remote: &Fetched,
) -> Result<crate::media::ProcessedImage, MediaError> {
    let policy = MediaPolicy {
        allowed_local_path: opts.allowed_local_path.clone(),
        allow_remote: opts.allow_remote,
        max_bytes: opts.max_bytes,
    };
    let bytes: Cow<[u8]> = match &r.source {
        MediaSource::Url(url) => match resolve(url, &policy)? {
            MediaBytes::Inline(b) => Cow::Owned(b),
            MediaBytes::Remote(url) => Cow::Borrowed(fetched_bytes(remote, &url)?),
        },
        MediaSource::Video(_) => unreachable!("videos load in media_video"),
        MediaSource::Base64(data) => {
            let estimate = data.len() / 4 * 3;
            if estimate > opts.max_bytes.saturating_add(3) {
                return Err(MediaError::TooManyBytes { bytes: estimate, limit: opts.max_bytes });
            }
            Cow::Owned(
                base64::engine::general_purpose::STANDARD
                    .decode(data.trim())
                    .map_err(|e| MediaError::Decode(format!("the base64 data is not valid: {e}")))?,
            )
        }
    };
    let img = decode_image(&bytes, DecodeLimits { max_bytes: opts.max_bytes, max_pixels: opts.max_pixels })?;
    vision.processor.process(&img)
}

pub(crate) fn media_error(param: &str, e: MediaError, opts: &MediaOptions) -> ApiError {
    let message = match e {
        MediaError::TooManyPixels { width, height, .. } => format!(
            "the image is {width}x{height} pixels, more than the limit of {} pixels per image (--max-image-pixels)",
            opts.max_pixels
        ),
        MediaError::TooManyBytes { bytes, .. } => format!(
            "the image is {bytes} bytes, more than the limit of {} bytes per image (--max-image-bytes)",
            opts.max_bytes
        ),
        MediaError::TooManyFrames { frames, limit } => format!(
            "the video has {frames} frames, more than the limit of {limit} frames per video (--max-video-frames)"
        ),
        MediaError::Settings(m) => return ApiError::Internal(format!("the model's image processor: {m}")),
        other => other.to_string(),
    };
    ApiError::invalid(param, message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn image_parts_of_both_apis_become_bare_image_parts_in_order() {
        let mut messages = vec![
            json!({"role": "system", "content": "be brief"}),
            json!({"role": "user", "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "BBBB"}},
            ]}),
        ];
        let refs = take_media(&mut messages).expect("valid parts");
        assert_eq!(
            refs,
            vec![
                MediaRef {
                    param: "messages[1].content[1]".into(),
                    source: MediaSource::Url("data:image/png;base64,AAAA".into())
                },
                MediaRef { param: "messages[1].content[2]".into(), source: MediaSource::Base64("BBBB".into()) },
            ]
        );
        assert_eq!(messages[1]["content"][1], json!({"type": "image"}));
        assert_eq!(messages[1]["content"][2], json!({"type": "image"}));
        let err = take_media(&mut [json!({"role": "user", "content": [{"type": "image_url", "image_url": {}}]})])
            .expect_err("no url");
        assert!(err.to_string().contains("messages[0].content[0].image_url.url"), "{err}");
    }

    #[test]
    fn limits_are_checked_before_any_decoding_and_name_their_flag() {
        let refs: Vec<MediaRef> = (0..3)
            .map(|j| MediaRef { param: format!("messages[0].content[{j}]"), source: MediaSource::Url("x".into()) })
            .collect();
        let no_vision = check_media(&refs, None, &MediaOptions::default()).expect_err("no tower");
        assert!(no_vision.to_string().contains("no vision tower"), "{no_vision}");
        let vision =
            VisionInfo { image_token_id: 9, merge_size: 2, processor: Default::default(), video: None, refused: None };
        let opts = MediaOptions { max_images: 2, ..MediaOptions::default() };
        let err = check_media(&refs, Some(&vision), &opts).expect_err("3 > 2");
        assert!(err.to_string().contains("--max-images-per-request"), "{err}");
        assert!(matches!(&err, ApiError::InvalidField { param, .. } if param == "messages[0].content[2]"));

        let video = MediaRef {
            param: "messages[0].content[3]".into(),
            source: MediaSource::Video(super::super::media_video::VideoSource::Frames {
                urls: vec!["x".into()],
                fps: None,
            }),
        };
        let err = check_media(std::slice::from_ref(&video), Some(&vision), &opts).expect_err("no video tokens");
        assert!(err.to_string().contains("takes no video"), "{err}");
        let with_video = VisionInfo {
            video: Some(crate::actors::handle::VideoInfo {
                video_token_id: 10,
                image_start_token_id: 11,
                image_end_token_id: 12,
                processor: Default::default(),
            }),
            ..vision.clone()
        };
        let two = [video.clone(), video.clone()];
        let opts = MediaOptions { max_videos: 1, ..MediaOptions::default() };
        let err = check_media(&two, Some(&with_video), &opts).expect_err("2 > 1");
        assert!(err.to_string().contains("--max-videos-per-request"), "{err}");
        check_media(&two[..1], Some(&with_video), &opts).expect("one video is fine");
        let refused = VisionInfo { refused: Some("not under --tp 2".into()), ..with_video };
        let err = check_media(&two[..1], Some(&refused), &opts).expect_err("refused");
        assert!(err.to_string().contains("--tp 2"), "{err}");
    }
}
