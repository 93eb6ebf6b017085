//! Images in chat requests: OpenAI `image_url` content parts and Anthropic `image` blocks.
//!
//! Before the template renders, [`take_images`] swaps every image part of the conversation for a
//! bare `{"type": "image"}` part (what HF chat templates test for) and keeps its source; the
//! template writes one placeholder token per image. After tokenizing, [`attach_images`] resolves
//! each source under the server's media policy (data URLs; `file://` only under
//! `--allowed-local-media-path`; no remote fetching), decodes and processes it with the model's
//! image processor under the per-request limits, and repeats its placeholder once per merged patch
//! group of its grid, as transformers' processor does. The engine gets plain data
//! ([`PromptImage`]): pixels, grid, span and content hash; the executors run the vision tower.
//!
//! Every failure here is the client's (400), in the endpoint's error shape, naming the limit or
//! rule it broke.

use std::path::PathBuf;
use std::sync::Arc;

use base64::Engine as _;
use serde_json::Value;

use super::errors::ApiError;
use crate::actors::handle::{PromptImage, VisionInfo};
use crate::media::source::{resolve, MediaBytes, MediaPolicy};
use crate::media::{content_hash, decode_image, expand_placeholders, DecodeLimits, MediaError};

/// The server's media settings (`serve` flags).
#[derive(Clone, Debug)]
pub struct MediaOptions {
    /// `--allowed-local-media-path`: `file://` URLs must resolve inside it; `None` refuses them.
    pub allowed_local_path: Option<PathBuf>,
    /// `--allow-remote-media`. This server does not fetch remote media yet: with the flag on,
    /// `http(s)` URLs get a 400 that says so; without it, a 400 naming the flag.
    pub allow_remote: bool,
    /// `--max-images-per-request`.
    pub max_images: usize,
    /// `--max-image-pixels`: decoded width × height of one image.
    pub max_pixels: u64,
    /// `--max-image-bytes`: encoded bytes of one image.
    pub max_bytes: usize,
}

impl MediaOptions {
    pub const DEFAULT_MAX_IMAGES: usize = 8;
    pub const DEFAULT_MAX_PIXELS: u64 = 33_177_600; // 7680 × 4320
    pub const DEFAULT_MAX_BYTES: usize = 20 << 20;
}

impl Default for MediaOptions {
    fn default() -> Self {
        MediaOptions {
            allowed_local_path: None,
            allow_remote: false,
            max_images: Self::DEFAULT_MAX_IMAGES,
            max_pixels: Self::DEFAULT_MAX_PIXELS,
            max_bytes: Self::DEFAULT_MAX_BYTES,
        }
    }
}

/// Where one image of the conversation comes from, and the request field that sent it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ImageRef {
    pub param: String,
    pub source: ImageSource,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum ImageSource {
    /// An OpenAI `image_url.url` or an Anthropic `url` source.
    Url(String),
    /// An Anthropic `base64` source.
    Base64(String),
}

/// True for a content part that [`take_images`] takes: OpenAI `image_url` or Anthropic `image`.
pub(crate) fn is_image_part(part: &Value) -> bool {
    matches!(part.get("type").and_then(Value::as_str), Some("image_url" | "image"))
}

/// Replace each image part of `messages` (list contents, in message and part order) with
/// `{"type": "image"}` and return their sources in the same order.
pub(crate) fn take_images(messages: &mut [Value]) -> Result<Vec<ImageRef>, ApiError> {
    let mut refs = Vec::new();
    for (i, m) in messages.iter_mut().enumerate() {
        let Some(Value::Array(parts)) = m.get_mut("content") else { continue };
        for (j, part) in parts.iter_mut().enumerate() {
            if !is_image_part(part) {
                continue;
            }
            let param = format!("messages[{i}].content[{j}]");
            let source = image_source(part, &param)?;
            refs.push(ImageRef { param, source });
            *part = serde_json::json!({"type": "image"});
        }
    }
    Ok(refs)
}

fn image_source(part: &Value, param: &str) -> Result<ImageSource, ApiError> {
    let bad =
        |field: &str, what: &str| ApiError::invalid(format!("{param}.{field}"), format!("`{param}.{field}` {what}"));
    if part.get("type").and_then(Value::as_str) == Some("image_url") {
        // `image_url` is `{"url": …, "detail"?: …}`; a bare string is accepted as the URL too.
        return match part.get("image_url") {
            Some(Value::String(u)) => Ok(ImageSource::Url(u.clone())),
            Some(Value::Object(o)) => match o.get("url") {
                Some(Value::String(u)) => Ok(ImageSource::Url(u.clone())),
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
            Some(Value::String(d)) => Ok(ImageSource::Base64(d.clone())),
            _ => Err(bad("source.data", "must be a base64 string")),
        },
        Some("url") => match source.get("url") {
            Some(Value::String(u)) => Ok(ImageSource::Url(u.clone())),
            _ => Err(bad("source.url", "must be a string")),
        },
        _ => Err(bad("source.type", "must be `base64` or `url`")),
    }
}

/// The request before any image work: too many images, or a model that takes none.
pub(crate) fn check_images(
    refs: &[ImageRef],
    vision: Option<&VisionInfo>,
    opts: &MediaOptions,
) -> Result<(), ApiError> {
    let Some(first) = refs.first() else { return Ok(()) };
    if vision.is_none() {
        return Err(ApiError::unsupported(
            first.param.clone(),
            "this model has no vision tower, so it takes no images; send text only",
        ));
    }
    if refs.len() > opts.max_images {
        return Err(ApiError::invalid(
            refs[opts.max_images].param.clone(),
            format!(
                "the request has {} images, more than the limit of {} images per request (--max-images-per-request)",
                refs.len(),
                opts.max_images
            ),
        ));
    }
    Ok(())
}

/// Decode and process every image of `refs`, then expand the template's one placeholder per
/// image in `ids` into the image's run of placeholder tokens. Returns the expanded ids and the
/// images with their spans.
pub(crate) fn attach_images(
    refs: &[ImageRef],
    ids: Vec<u32>,
    vision: Option<&VisionInfo>,
    opts: &MediaOptions,
    param: &str,
) -> Result<(Vec<u32>, Vec<PromptImage>), ApiError> {
    if refs.is_empty() {
        return Ok((ids, Vec::new()));
    }
    check_images(refs, vision, opts)?;
    let vision = vision.expect("checked above");
    let placeholders = ids.iter().filter(|&&t| t == vision.image_token_id).count();
    if placeholders != refs.len() {
        return Err(ApiError::invalid(
            param,
            format!(
                "the chat template wrote {placeholders} image placeholders for {} images: this model's template \
                 does not place images where the messages put them",
                refs.len()
            ),
        ));
    }
    let mut processed = Vec::with_capacity(refs.len());
    for r in refs {
        processed.push(load(r, vision, opts).map_err(|e| media_error(&r.param, e, opts))?);
    }
    let counts: Vec<usize> = processed.iter().map(|p| p.tokens(vision.merge_size)).collect();
    let (ids, spans) = expand_placeholders(&ids, vision.image_token_id, &counts).expect("placeholders counted above");
    let images = processed
        .into_iter()
        .zip(spans)
        .map(|(img, span)| PromptImage {
            span,
            grid: img.grid,
            hash: content_hash(&img),
            pixel_values: Arc::from(img.pixel_values),
        })
        .collect();
    Ok((ids, images))
}

fn load(r: &ImageRef, vision: &VisionInfo, opts: &MediaOptions) -> Result<crate::media::ProcessedImage, MediaError> {
    let policy = MediaPolicy {
        allowed_local_path: opts.allowed_local_path.clone(),
        allow_remote: opts.allow_remote,
        max_bytes: opts.max_bytes,
    };
    let bytes = match &r.source {
        ImageSource::Url(url) => match resolve(url, &policy)? {
            MediaBytes::Inline(b) => b,
            MediaBytes::Remote(_) => {
                return Err(MediaError::Refused(
                    "this server does not fetch remote media yet; send the image as a `data:` URL (base64)".into(),
                ))
            }
        },
        ImageSource::Base64(data) => {
            let estimate = data.len() / 4 * 3;
            if estimate > opts.max_bytes.saturating_add(3) {
                return Err(MediaError::TooManyBytes { bytes: estimate, limit: opts.max_bytes });
            }
            base64::engine::general_purpose::STANDARD
                .decode(data.trim())
                .map_err(|e| MediaError::Decode(format!("the base64 data is not valid: {e}")))?
        }
    };
    let img = decode_image(&bytes, DecodeLimits { max_bytes: opts.max_bytes, max_pixels: opts.max_pixels })?;
    vision.processor.process(&img)
}

fn media_error(param: &str, e: MediaError, opts: &MediaOptions) -> ApiError {
    let message = match e {
        MediaError::TooManyPixels { width, height, .. } => format!(
            "the image is {width}x{height} pixels, more than the limit of {} pixels per image (--max-image-pixels)",
            opts.max_pixels
        ),
        MediaError::TooManyBytes { bytes, .. } => format!(
            "the image is {bytes} bytes, more than the limit of {} bytes per image (--max-image-bytes)",
            opts.max_bytes
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
        let refs = take_images(&mut messages).expect("valid parts");
        assert_eq!(
            refs,
            vec![
                ImageRef {
                    param: "messages[1].content[1]".into(),
                    source: ImageSource::Url("data:image/png;base64,AAAA".into())
                },
                ImageRef { param: "messages[1].content[2]".into(), source: ImageSource::Base64("BBBB".into()) },
            ]
        );
        assert_eq!(messages[1]["content"][1], json!({"type": "image"}));
        assert_eq!(messages[1]["content"][2], json!({"type": "image"}));
        let err = take_images(&mut [json!({"role": "user", "content": [{"type": "image_url", "image_url": {}}]})])
            .expect_err("no url");
        assert!(err.to_string().contains("messages[0].content[0].image_url.url"), "{err}");
    }

    #[test]
    fn limits_are_checked_before_any_decoding_and_name_their_flag() {
        let refs: Vec<ImageRef> = (0..3)
            .map(|j| ImageRef { param: format!("messages[0].content[{j}]"), source: ImageSource::Url("x".into()) })
            .collect();
        let no_vision = check_images(&refs, None, &MediaOptions::default()).expect_err("no tower");
        assert!(no_vision.to_string().contains("no vision tower"), "{no_vision}");
        let vision = VisionInfo { image_token_id: 9, merge_size: 2, processor: Default::default() };
        let opts = MediaOptions { max_images: 2, ..MediaOptions::default() };
        let err = check_images(&refs, Some(&vision), &opts).expect_err("3 > 2");
        assert!(err.to_string().contains("--max-images-per-request"), "{err}");
        assert!(matches!(&err, ApiError::InvalidField { param, .. } if param == "messages[0].content[2]"));
    }
}
