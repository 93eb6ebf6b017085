//! Where an image's bytes may come from, as a policy over the URL a client sent: `data:` URLs
//! (base64) always; `file://` paths only inside one allowed directory (resolved through links
//! before the check, so a link cannot lead outside); `http(s)://` only when remote media is
//! allowed, and then handed back for the caller to fetch (`media::fetch`, under `media::remote`'s
//! rules and the same byte limit). Everything
//! else is refused with a message that names the rule.

use std::io::Read;
use std::path::{Path, PathBuf};

use base64::Engine as _;

use super::MediaError;

/// What the server allows (`--allowed-local-media-path`, `--allow-remote-media`).
#[derive(Clone, Debug, Default)]
pub struct MediaPolicy {
    pub allowed_local_path: Option<PathBuf>,
    pub allow_remote: bool,
    /// Encoded bytes per image.
    pub max_bytes: usize,
}

/// A resolved image reference.
#[derive(Debug, PartialEq, Eq)]
pub enum MediaBytes {
    /// The bytes are here (data URL or local file).
    Inline(Vec<u8>),
    /// An allowed `http(s)` URL the caller fetches (with `max_bytes` and a timeout).
    Remote(String),
}

fn refused(msg: impl Into<String>) -> MediaError {
    MediaError::Refused(msg.into())
}

/// Resolve `url` under `policy`.
pub fn resolve(url: &str, policy: &MediaPolicy) -> Result<MediaBytes, MediaError> {
    if let Some(rest) = url.strip_prefix("data:") {
        return data_url(rest, policy.max_bytes).map(MediaBytes::Inline);
    }
    if let Some(path) = url.strip_prefix("file://") {
        return local_file(Path::new(path), policy).map(MediaBytes::Inline);
    }
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") {
        if !policy.allow_remote {
            return Err(refused(
                "remote media URLs are off on this server (it was not started with --allow-remote-media)",
            ));
        }
        return Ok(MediaBytes::Remote(url.to_string()));
    }
    Err(refused("an image URL must be a `data:` URL, a `file://` path or an `http(s)://` URL"))
}

/// `data:[<type>];base64,<payload>`.
fn data_url(rest: &str, max_bytes: usize) -> Result<Vec<u8>, MediaError> {
    let Some((meta, payload)) = rest.split_once(',') else {
        return Err(refused("a data URL needs a `,` before its payload"));
    };
    if !meta.split(';').any(|p| p.eq_ignore_ascii_case("base64")) {
        return Err(refused("only base64 data URLs are accepted (`data:image/png;base64,...`)"));
    }
    // Checked before decoding: base64 is 4 characters per 3 bytes.
    let estimate = payload.len() / 4 * 3;
    if estimate > max_bytes.saturating_add(3) {
        return Err(MediaError::TooManyBytes { bytes: estimate, limit: max_bytes });
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(payload.trim())
        .map_err(|e| MediaError::Decode(format!("the data URL is not valid base64: {e}")))?;
    if bytes.len() > max_bytes {
        return Err(MediaError::TooManyBytes { bytes: bytes.len(), limit: max_bytes });
    }
    Ok(bytes)
}

fn local_file(path: &Path, policy: &MediaPolicy) -> Result<Vec<u8>, MediaError> {
    let Some(root) = &policy.allowed_local_path else {
        return Err(refused(
            "local media paths are off on this server (it was not started with --allowed-local-media-path)",
        ));
    };
    let not_found = |p: &Path, e: std::io::Error| refused(format!("`{}` cannot be read: {e}", p.display()));
    let root = root.canonicalize().map_err(|e| not_found(root.as_path(), e))?;
    let real = path.canonicalize().map_err(|e| not_found(path, e))?;
    if !real.starts_with(&root) {
        return Err(refused(format!("`{}` is outside the allowed media directory", path.display())));
    }
    let file = std::fs::File::open(&real).map_err(|e| not_found(path, e))?;
    let meta = file.metadata().map_err(|e| not_found(path, e))?;
    if !meta.is_file() {
        return Err(refused(format!("`{}` is not a regular file", path.display())));
    }
    if meta.len() > policy.max_bytes as u64 {
        return Err(MediaError::TooManyBytes { bytes: meta.len() as usize, limit: policy.max_bytes });
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    // `take` bounds a file that grows while it is read.
    file.take(policy.max_bytes as u64 + 1).read_to_end(&mut bytes).map_err(|e| not_found(path, e))?;
    if bytes.len() > policy.max_bytes {
        return Err(MediaError::TooManyBytes { bytes: bytes.len(), limit: policy.max_bytes });
    }
    Ok(bytes)
}
