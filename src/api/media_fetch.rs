//! Remote media of a request (`--allow-remote-media`), fetched before the request is prepared:
//! rendering and decoding run on the blocking pool, fetching must not, so the handler calls
//! [`prefetch`] on its actix worker first. It finds the `http(s)` URLs of the request's image and
//! video parts (the same parsers as `api::media`), fetches them all concurrently with
//! `media::fetch`, and hands the bodies (or each failure, already worded) to `attach_media`,
//! which reports a failure as the 400 of the part that named the URL.
//!
//! Nothing is fetched for a model without a vision tower or a request over the image, video or
//! frame counts: those get their 400 from `check_media` before any network work.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::Value;

use super::media::{image_source, is_image_part, is_media_part, MediaOptions, MediaSource};
use super::media_video::{video_source, VideoSource};
use super::{blocking, LaneState};
use crate::media::fetch::FetchFailure;
use crate::media::MediaError;

/// Each fetched URL's body, or why it could not be fetched (the message names the URL).
pub(crate) type Fetched = Arc<HashMap<String, Result<Vec<u8>, String>>>;

/// The body of a remote `url` from `fetched`: its fetch error, or a refusal when it was not
/// fetched (remote media off; the policy in `media::source` refuses first in that case).
pub(crate) fn fetched_bytes<'a>(fetched: &'a Fetched, url: &str) -> Result<&'a [u8], MediaError> {
    match fetched.get(url) {
        Some(Ok(bytes)) => Ok(bytes),
        Some(Err(why)) => Err(MediaError::Fetch(why.clone())),
        None => Err(MediaError::Refused(format!("`{url}` was not fetched"))),
    }
}

fn is_remote(url: &str) -> bool {
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    lower.starts_with("http://") || lower.starts_with("https://")
}

/// The remote URLs of `body`'s media parts and whether each is a video container (its byte
/// limit is `--max-video-bytes`); `None` when the request is over a count limit.
fn remote_urls(body: &[u8], opts: &MediaOptions) -> Option<Vec<(String, bool)>> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let (mut images, mut videos, mut urls) = (0usize, 0usize, Vec::new());
    for m in v.get("messages")?.as_array()? {
        let Some(Value::Array(parts)) = m.get("content") else { continue };
        for part in parts.iter().filter(|p| is_media_part(p)) {
            if is_image_part(part) {
                images += 1;
                if let Ok(MediaSource::Url(u)) = image_source(part, "") {
                    urls.push((u, false));
                }
                continue;
            }
            videos += 1;
            match video_source(part, "") {
                Ok(VideoSource::Container(u)) => urls.push((u, true)),
                Ok(VideoSource::Frames { urls: frames, .. }) => {
                    if frames.len() > opts.max_video_frames {
                        return None;
                    }
                    urls.extend(frames.into_iter().map(|u| (u, false)));
                }
                Err(_) => {}
            }
        }
    }
    if images > opts.max_images || videos > opts.max_videos {
        return None;
    }
    urls.retain(|(u, _)| is_remote(u));
    urls.sort();
    urls.dedup();
    Some(urls)
}

/// Fetch every remote media URL of the request `body` (see the module doc).
pub(crate) async fn prefetch(state: &LaneState, body: &bytes::Bytes) -> Result<Fetched, super::errors::ApiError> {
    let opts = &state.shared.opts.media;
    let Some(fetcher) = opts.fetcher.clone() else { return Ok(Fetched::default()) };
    if state.shared.engine.model().vision.is_none() || !body.windows(3).any(|w| w == b"://") {
        return Ok(Fetched::default());
    }
    let (body, o) = (body.clone(), opts.clone());
    let Some(urls) = blocking(move || Ok(remote_urls(&body, &o))).await? else { return Ok(Fetched::default()) };
    let fetches = urls.into_iter().map(|(url, video)| {
        let fetcher = fetcher.clone();
        let (limit, flag, what) = if video {
            (opts.max_video_bytes, "--max-video-bytes", "video")
        } else {
            (opts.max_bytes, "--max-image-bytes", "image")
        };
        async move {
            let result = fetcher.fetch(&url, limit).await.map_err(|f| match f {
                FetchFailure::TooBig { declared: Some(n) } => format!(
                    "fetching `{url}` failed: it is {n} bytes, more than the limit of {limit} bytes per {what} ({flag})"
                ),
                FetchFailure::TooBig { declared: None } => format!(
                    "fetching `{url}` failed: its body passed the limit of {limit} bytes per {what} ({flag}); \
                     reading stopped there"
                ),
                FetchFailure::Other(why) => format!("fetching `{url}` failed: {why}"),
            });
            (url, result)
        }
    });
    let results = futures_util::future::join_all(fetches).await;
    Ok(Arc::new(results.into_iter().collect()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn remote_urls_of_both_apis_and_both_video_forms_are_found_once() {
        let body = json!({"messages": [
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://a/x.png"}},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "image", "source": {"type": "url", "url": "HTTPS://b/y.png"}},
                {"type": "video_url", "video_url": {"url": "https://c/v.mp4"}},
                {"type": "video", "video": ["http://a/x.png", "http://d/f1.png"], "fps": 2},
                {"type": "text", "text": "http://not-media/"},
            ]},
        ]});
        let opts = MediaOptions::default();
        let urls = remote_urls(body.to_string().as_bytes(), &opts).expect("under the limits");
        assert_eq!(
            urls,
            [
                ("HTTPS://b/y.png".to_string(), false),
                ("http://a/x.png".into(), false),
                ("http://d/f1.png".into(), false),
                ("https://c/v.mp4".into(), true),
            ]
        );
        let few = MediaOptions { max_images: 1, ..MediaOptions::default() };
        assert_eq!(remote_urls(body.to_string().as_bytes(), &few), None, "over the image count: nothing fetched");
        assert_eq!(remote_urls(b"not json", &opts), None);
    }
}
