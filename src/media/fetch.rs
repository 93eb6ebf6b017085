//! Fetching one remote image or video (`--allow-remote-media`) with awc on the actix worker's
//! event loop: never blocking a thread, and a request's media fetched concurrently by the caller.
//!
//! Each hop's URL passes [`RemotePolicy::check_url`]; its host is resolved here and the request
//! is sent to an address [`RemotePolicy::allowed_addrs`] accepted (awc's `address`, so awc does
//! not resolve again: what was checked is what is connected to). Redirects are not followed by
//! awc but here, at most `max_redirects`, each hop checked again. The body is read chunk by
//! chunk and reading stops as soon as it passes the byte limit, whatever `Content-Length` said
//! (a declared length over the limit fails before reading). One timeout covers the whole fetch.
//!
//! https trusts the Mozilla roots compiled in (`webpki-roots`, the bundle Python's `certifi`
//! gives vLLM's fetcher; nothing depends on the host's certificate store, which slim images
//! lack) plus the PEM certificates of `--media-extra-ca` for private CAs.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use futures_util::StreamExt as _;

use super::remote::{redirect_target, RemotePolicy, Target};

/// The rules and the TLS settings remote media is fetched with (one per server).
#[derive(Clone, Debug)]
pub struct Fetcher {
    pub policy: RemotePolicy,
    tls: Arc<rustls::ClientConfig>,
}

/// Why one fetch failed (the API names the URL and, for size, the flag).
#[derive(Debug, PartialEq, Eq)]
pub enum FetchFailure {
    /// The body passed the limit (declared or while streaming); `declared` when the server said so.
    TooBig {
        declared: Option<u64>,
    },
    Other(String),
}

impl Fetcher {
    /// `extra_ca`: a PEM file of root certificates trusted besides the built-in ones.
    pub fn new(policy: RemotePolicy, extra_ca: Option<&Path>) -> Result<Fetcher, String> {
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        if let Some(path) = extra_ca {
            use rustls::pki_types::pem::PemObject as _;
            use rustls::pki_types::CertificateDer;
            let shown = path.display();
            let mut added = 0;
            for cert in CertificateDer::pem_file_iter(path).map_err(|e| format!("--media-extra-ca {shown}: {e}"))? {
                let cert = cert.map_err(|e| format!("--media-extra-ca {shown}: {e}"))?;
                roots.add(cert).map_err(|e| format!("--media-extra-ca {shown}: {e}"))?;
                added += 1;
            }
            if added == 0 {
                return Err(format!("--media-extra-ca {shown}: no PEM certificate in the file"));
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS settings: {e}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Fetcher { policy, tls: Arc::new(tls) })
    }

    /// Fetch `url` under the policy, reading at most `max_bytes` of body. Must run on an actix
    /// (tokio current-thread) runtime: awc's client is not `Send`.
    pub async fn fetch(&self, url: &str, max_bytes: usize) -> Result<Vec<u8>, FetchFailure> {
        let started = Instant::now();
        let timeout = self.policy.timeout;
        let result = match tokio::time::timeout(timeout, self.hops(url, max_bytes)).await {
            Ok(r) => r,
            Err(_) => Err(FetchFailure::Other(format!(
                "it took longer than the fetch timeout of {} s (--media-fetch-timeout)",
                timeout.as_secs_f64()
            ))),
        };
        let host = self.policy.check_url(url).map(|t| t.host).unwrap_or_default();
        let ms = started.elapsed().as_millis() as u64;
        match &result {
            Ok(body) => tracing::debug!(host, bytes = body.len(), ms, "fetched remote media"),
            Err(e) => tracing::debug!(host, ms, error = ?e, "remote media fetch failed"),
        }
        result
    }

    async fn hops(&self, url: &str, max_bytes: usize) -> Result<Vec<u8>, FetchFailure> {
        let other = FetchFailure::Other;
        // awc's own timeouts sit above ours, so the caller's single deadline is the one that fires.
        let slack = self.policy.timeout + std::time::Duration::from_secs(1);
        let connector = awc::Connector::new().rustls_0_23(self.tls.clone()).timeout(slack).handshake_timeout(slack);
        let client = awc::Client::builder().connector(connector).disable_redirects().timeout(slack).finish();
        let mut current = url.to_string();
        let mut redirects = 0;
        loop {
            let target = self.policy.check_url(&current).map_err(|e| other(hop_note(&current, url, e)))?;
            let resolved = resolve(&target).await.map_err(|e| other(hop_note(&current, url, e)))?;
            let addrs = self.policy.allowed_addrs(&target, &resolved).map_err(|e| other(hop_note(&current, url, e)))?;
            let mut response = None;
            let mut last_error = String::new();
            for addr in addrs {
                match client.get(&current).address(addr).insert_header(("Accept", "*/*")).send().await {
                    Ok(r) => {
                        response = Some(r);
                        break;
                    }
                    Err(e) => last_error = e.to_string(),
                }
            }
            let Some(mut response) = response else {
                return Err(other(hop_note(&current, url, format!("the request failed: {last_error}"))));
            };
            let status = response.status();
            if status.is_redirection() {
                if let Some(location) = response.headers().get(awc::http::header::LOCATION) {
                    if redirects == self.policy.max_redirects {
                        return Err(other(format!("it redirects more than {} times", self.policy.max_redirects)));
                    }
                    let location = location.to_str().map_err(|_| other("a redirect's Location is not text".into()))?;
                    current = redirect_target(&current, location).map_err(other)?;
                    redirects += 1;
                    continue;
                }
            }
            if !status.is_success() {
                return Err(other(hop_note(&current, url, format!("the server answered HTTP {status}"))));
            }
            let declared = response
                .headers()
                .get(awc::http::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
            if declared.is_some_and(|n| n > max_bytes as u64) {
                return Err(FetchFailure::TooBig { declared });
            }
            let framed = declared.is_some()
                || response.headers().contains_key(awc::http::header::TRANSFER_ENCODING)
                || response.version() != awc::http::Version::HTTP_11;
            if !framed {
                // actix-http reads an HTTP/1.1 body delimited only by the connection closing as
                // empty: say so rather than hand an empty "image" to the decoder.
                return Err(other(hop_note(
                    &current,
                    url,
                    "the HTTP/1.1 response has neither a Content-Length nor chunked encoding; \
                     bodies that end only when the connection closes are not read"
                        .into(),
                )));
            }
            let mut body = Vec::with_capacity(declared.map_or(0, |n| n as usize));
            while let Some(chunk) = response.next().await {
                let chunk = chunk.map_err(|e| other(format!("reading the body failed: {e}")))?;
                if body.len() + chunk.len() > max_bytes {
                    return Err(FetchFailure::TooBig { declared: None });
                }
                body.extend_from_slice(&chunk);
            }
            return Ok(body);
        }
    }
}

/// A failure on a redirect hop names the hop.
fn hop_note(current: &str, first: &str, why: String) -> String {
    if current == first {
        why
    } else {
        format!("{why} (at `{current}`, where it was redirected)")
    }
}

async fn resolve(target: &Target) -> Result<Vec<SocketAddr>, String> {
    let addrs = tokio::net::lookup_host((target.host.as_str(), target.port))
        .await
        .map_err(|e| format!("the host `{}` cannot be resolved: {e}", target.host))?;
    Ok(addrs.collect())
}
