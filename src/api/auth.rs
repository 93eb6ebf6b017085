//! API-key checks at the edge: deny by default, decided on the path the router will see.
//!
//! Owns: which paths are public, the path normalization that decision is made on, and the
//! constant-time key comparison. It must not know any route's handler.
//!
//! The check runs before routing (and before the body is read), so it cannot ask the router
//! which route matched. Instead it never grants more than the router could route: a request is
//! let through without a key only when its *normalized* path (percent-decoded, repeated slashes
//! collapsed, dot segments resolved, trailing slash dropped) is one of the public routes.
//! Normalization only removes things, so a raw path the router sends to a protected route
//! normalizes to that protected route and is checked; everything else, unknown paths included,
//! needs the key.

use actix_web::http::header;
use actix_web::HttpRequest;

/// Routes reachable without a key.
const HEALTH: &str = "/health";
const METRICS: &str = "/metrics";

/// The accepted keys and which routes are public.
#[derive(Clone, Default)]
pub struct AuthPolicy {
    keys: Vec<Vec<u8>>,
    metrics_public: bool,
}

impl AuthPolicy {
    /// `keys` empty: no authentication at all.
    pub fn new(keys: impl IntoIterator<Item = String>, metrics_public: bool) -> Self {
        Self { keys: keys.into_iter().filter(|k| !k.is_empty()).map(String::into_bytes).collect(), metrics_public }
    }

    pub fn enabled(&self) -> bool {
        !self.keys.is_empty()
    }

    pub fn metrics_public(&self) -> bool {
        self.metrics_public
    }

    /// Whether a request for `raw_path` (the URI path as sent, before any decoding) may go on.
    pub fn admits(&self, raw_path: &str, req: &HttpRequest) -> bool {
        !self.enabled() || self.is_public(raw_path) || self.authorized(req)
    }

    fn is_public(&self, raw_path: &str) -> bool {
        let path = normalize_path(raw_path);
        path == HEALTH || (self.metrics_public && path == METRICS)
    }

    fn authorized(&self, req: &HttpRequest) -> bool {
        // Anthropic's clients send the key as `x-api-key: <key>`.
        if let Some(key) = req.headers().get("x-api-key").and_then(|v| v.to_str().ok()) {
            return self.matches(key.trim().as_bytes());
        }
        let Some(value) = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) else {
            return false;
        };
        let mut parts = value.trim().splitn(2, ' ');
        let scheme_ok = parts.next().is_some_and(|s| s.eq_ignore_ascii_case("bearer"));
        let given = parts.next().unwrap_or("").trim().as_bytes();
        let matched = self.matches(given);
        scheme_ok && matched
    }

    fn matches(&self, given: &[u8]) -> bool {
        // Every key is compared in full, so timing reveals neither which key nor how much matched.
        self.keys.iter().fold(false, |any, key| any | constant_time_eq(given, key))
    }
}

impl std::fmt::Debug for AuthPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthPolicy")
            .field("keys", &self.keys.len())
            .field("metrics_public", &self.metrics_public)
            .finish()
    }
}

/// Keys from a file: one per line; blank lines and lines starting with `#` are skipped.
pub fn read_key_file(path: &std::path::Path) -> std::io::Result<Vec<String>> {
    let text = std::fs::read_to_string(path)?;
    let keys: Vec<String> =
        text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(str::to_owned).collect();
    if keys.is_empty() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "the key file holds no key"));
    }
    Ok(keys)
}

/// Percent-decode, collapse repeated slashes, resolve `.` and `..` segments and drop a trailing
/// slash. Bytes that do not decode to UTF-8 are kept lossily; that can only make a path
/// non-public.
pub fn normalize_path(raw: &str) -> String {
    let decoded = percent_decode(raw);
    let mut segments: Vec<&str> = Vec::new();
    for seg in decoded.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    format!("/{}", segments.join("/"))
}

fn percent_decode(raw: &str) -> String {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = |b: u8| (b as char).to_digit(16);
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Compare without an early exit, so response timing does not reveal how much of a guessed key
/// was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, &x) in a.iter().enumerate() {
        diff |= usize::from(x ^ b.get(i).copied().unwrap_or(!x));
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::test::TestRequest;

    #[test]
    fn key_comparison() {
        assert!(constant_time_eq(b"sk-abc", b"sk-abc"));
        assert!(!constant_time_eq(b"sk-abc", b"sk-abd"));
        assert!(!constant_time_eq(b"sk-ab", b"sk-abc"));
        assert!(!constant_time_eq(b"sk-abc", b"sk-ab"));
        assert!(!constant_time_eq(b"", b"x"));
    }

    #[test]
    fn normalization() {
        for (raw, want) in [
            ("/health", "/health"),
            ("/%76%31/completions", "/v1/completions"),
            ("/%2576", "/%76"),
            ("//v1//models/", "/v1/models"),
            ("/v1/./models", "/v1/models"),
            ("/x/../v1/models", "/v1/models"),
            ("/../../health", "/health"),
            ("/health/", "/health"),
            ("/", "/"),
            ("", "/"),
            ("/%zz%4", "/%zz%4"),
            ("/%", "/%"),
            ("/%6", "/%6"),
        ] {
            assert_eq!(normalize_path(raw), want, "{raw}");
        }
    }

    #[test]
    fn only_health_is_public_and_metrics_on_request() {
        let closed = AuthPolicy::new(["k".to_owned()], false);
        let open_metrics = AuthPolicy::new(["k".to_owned()], true);
        let req = TestRequest::default().to_http_request();
        for p in ["/health", "//health", "/%68ealth", "/./health/"] {
            assert!(closed.admits(p, &req), "{p}");
        }
        for p in ["/metrics", "/v1/models", "/%76%31/completions", "/nope", "/", "/HEALTH", "/health/x"] {
            assert!(!closed.admits(p, &req), "{p}");
        }
        assert!(open_metrics.admits("/metrics", &req));
        assert!(open_metrics.admits("//%6detrics/", &req));
        assert!(!open_metrics.admits("/v1/models", &req));
    }

    #[test]
    fn bearer_keys() {
        let policy = AuthPolicy::new(["sk-one".to_owned(), "sk-two".to_owned(), String::new()], false);
        let with = |v: &str| TestRequest::default().insert_header((header::AUTHORIZATION, v)).to_http_request();
        assert!(policy.admits("/v1/models", &with("Bearer sk-one")));
        assert!(policy.admits("/v1/models", &with("bearer   sk-two ")));
        assert!(!policy.admits("/v1/models", &with("Bearer sk-three")));
        assert!(!policy.admits("/v1/models", &with("Basic sk-one")));
        assert!(!policy.admits("/v1/models", &with("Bearer ")));
        assert!(!policy.admits("/v1/models", &TestRequest::default().to_http_request()));
        assert!(AuthPolicy::new([String::new()], false).admits("/v1/models", &TestRequest::default().to_http_request()));
    }

    #[test]
    fn anthropic_x_api_key() {
        let policy = AuthPolicy::new(["sk-one".to_owned()], false);
        let with = |v: &str| TestRequest::default().insert_header(("x-api-key", v)).to_http_request();
        assert!(policy.admits("/v1/messages", &with("sk-one")));
        assert!(!policy.admits("/v1/messages", &with("sk-two")));
        assert!(!policy.admits("/v1/messages", &with("")));
    }

    #[test]
    fn key_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        std::fs::write(&path, "# team keys\nsk-a\n\n  sk-b  \n").unwrap();
        assert_eq!(read_key_file(&path).unwrap(), ["sk-a", "sk-b"]);
        std::fs::write(&path, "# nothing\n").unwrap();
        assert!(read_key_file(&path).is_err());
    }
}
