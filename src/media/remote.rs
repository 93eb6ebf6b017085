//! The rules a remote media URL must pass before and while it is fetched (`media::fetch` does the
//! fetching): `http`/`https` only, the host in `--allowed-media-domains` when that list is given,
//! and otherwise every address the host resolves to public (no loopback, private, link-local,
//! unspecified, shared, multicast or broadcast address: the server must not become a proxy into
//! its own network). The address checked is the address connected to, so a DNS answer that
//! changes between the check and the connect (rebinding) cannot slip through. Redirects are
//! resolved against the URL they came from and each hop passes the same rules.
//!
//! Plain data and pure functions: unit-tested without sockets.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

/// `--allowed-media-domains`, `--media-fetch-timeout` and the redirect limit.
#[derive(Clone, Debug)]
pub struct RemotePolicy {
    /// When `Some`, only these hosts (lowercase, exact) are fetched, whatever they resolve to.
    pub allowed_domains: Option<Vec<String>>,
    /// The whole fetch of one media (every hop, headers and body).
    pub timeout: Duration,
    pub max_redirects: usize,
}

impl RemotePolicy {
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
    pub const DEFAULT_MAX_REDIRECTS: usize = 5;

    /// Parse a comma list of hosts (`--allowed-media-domains`); empty entries are dropped.
    pub fn domains_from_list(list: &str) -> Vec<String> {
        list.split(',').map(|d| d.trim().trim_end_matches('.').to_ascii_lowercase()).filter(|d| !d.is_empty()).collect()
    }

    /// The scheme and host rules for one hop; returns where to connect (host, port, https?).
    pub fn check_url(&self, url: &str) -> Result<Target, String> {
        let uri: awc::http::Uri = url.parse().map_err(|e| format!("it is not a valid URL ({e})"))?;
        let https = match uri.scheme_str().map(str::to_ascii_lowercase).as_deref() {
            Some("http") => false,
            Some("https") => true,
            _ => return Err("only http:// and https:// URLs are fetched".into()),
        };
        let host = uri.host().ok_or("the URL has no host")?;
        let host = host.trim_start_matches('[').trim_end_matches(']').trim_end_matches('.').to_ascii_lowercase();
        if host.is_empty() {
            return Err("the URL has no host".into());
        }
        if let Some(allowed) = &self.allowed_domains {
            if !allowed.contains(&host) {
                return Err(format!("the host `{host}` is not in --allowed-media-domains"));
            }
        }
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        Ok(Target { host, port, https })
    }

    /// The addresses of `target` that may be connected to: all of them for a listed host, the
    /// public ones otherwise; an error naming the first refused address when none is left.
    pub fn allowed_addrs(&self, target: &Target, resolved: &[SocketAddr]) -> Result<Vec<SocketAddr>, String> {
        if resolved.is_empty() {
            return Err(format!("the host `{}` resolves to no address", target.host));
        }
        if self.allowed_domains.is_some() {
            return Ok(resolved.to_vec());
        }
        let ok: Vec<SocketAddr> = resolved.iter().copied().filter(|a| !is_internal(a.ip())).collect();
        if ok.is_empty() {
            return Err(format!(
                "the host `{}` resolves to {}, a loopback, private, link-local or otherwise internal address; \
                 the server fetches those only from hosts listed in --allowed-media-domains",
                target.host,
                resolved[0].ip()
            ));
        }
        Ok(ok)
    }
}

impl Default for RemotePolicy {
    fn default() -> Self {
        RemotePolicy {
            allowed_domains: None,
            timeout: Self::DEFAULT_TIMEOUT,
            max_redirects: Self::DEFAULT_MAX_REDIRECTS,
        }
    }
}

/// Where one hop connects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// Lowercase, without IPv6 brackets.
    pub host: String,
    pub port: u16,
    pub https: bool,
}

/// Addresses a public fetch must never reach.
pub fn is_internal(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_internal_v4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => is_internal_v4(v4),
            None => is_internal_v6(v6),
        },
    }
}

fn is_internal_v4(ip: Ipv4Addr) -> bool {
    let [a, b, ..] = ip.octets();
    ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_unspecified()
        || ip.is_broadcast()
        || ip.is_multicast()
        || a == 0 // "this network"
        || (a == 100 && (64..128).contains(&b)) // shared address space (carrier-grade NAT)
        || (a == 192 && b == 0 && ip.octets()[2] == 0) // IETF protocol assignments
        || a >= 240 // reserved
}

fn is_internal_v6(ip: Ipv6Addr) -> bool {
    let first = ip.segments()[0];
    ip.is_loopback()
        || ip.is_unspecified()
        || ip.is_multicast()
        || (first & 0xfe00) == 0xfc00 // unique local fc00::/7
        || (first & 0xffc0) == 0xfe80 // link-local fe80::/10
        || (first & 0xffc0) == 0xfec0 // site-local (deprecated) fec0::/10
        || ip.to_ipv4().is_some_and(|v4| ip.segments()[..6] == [0; 6] && is_internal_v4(v4))
    // ::a.b.c.d
}

/// The absolute URL a redirect's `Location` names, resolved against the URL it came from.
pub fn redirect_target(base: &str, location: &str) -> Result<String, String> {
    let location = location.trim();
    let lower = location.get(..8).unwrap_or(location).to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") {
        return Ok(location.to_string());
    }
    let uri: awc::http::Uri = base.parse().map_err(|e| format!("bad URL ({e})"))?;
    let scheme = uri.scheme_str().ok_or("the URL has no scheme")?;
    let authority = uri.authority().ok_or("the URL has no host")?;
    if location.contains("://") {
        return Err(format!("the redirect goes to `{location}`, which is not an http(s) URL"));
    }
    if let Some(rest) = location.strip_prefix("//") {
        return Ok(format!("{scheme}://{rest}"));
    }
    if location.starts_with('/') {
        return Ok(format!("{scheme}://{authority}{location}"));
    }
    let path = uri.path();
    let dir = &path[..path.rfind('/').map_or(0, |i| i + 1)];
    let dir = if dir.is_empty() { "/" } else { dir };
    Ok(format!("{scheme}://{authority}{dir}{location}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("socket address")
    }

    #[test]
    fn schemes_hosts_and_ports_are_checked() {
        let open = RemotePolicy::default();
        assert_eq!(
            open.check_url("http://Example.COM/a.png").unwrap(),
            Target { host: "example.com".into(), port: 80, https: false }
        );
        assert_eq!(
            open.check_url("HTTPS://[::1]:8443/x").unwrap(),
            Target { host: "::1".into(), port: 8443, https: true }
        );
        assert!(open.check_url("ftp://example.com/a").unwrap_err().contains("http"));
        assert!(open.check_url("http:///nohost").is_err());
        let listed = RemotePolicy {
            allowed_domains: Some(RemotePolicy::domains_from_list(" img.example.com, 127.0.0.1 ,,")),
            ..RemotePolicy::default()
        };
        assert_eq!(listed.allowed_domains.as_deref().unwrap(), ["img.example.com", "127.0.0.1"]);
        assert!(listed.check_url("http://127.0.0.1:9/a").is_ok());
        assert!(listed.check_url("https://IMG.example.com./a").is_ok());
        let err = listed.check_url("http://evil.example.com/a").unwrap_err();
        assert!(err.contains("--allowed-media-domains") && err.contains("evil.example.com"), "{err}");
    }

    #[test]
    fn internal_addresses_are_refused_unless_the_host_is_listed() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "255.255.255.255",
            "224.0.0.1",
            "::1",
            "::",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
        ] {
            assert!(is_internal(ip.parse().unwrap()), "{ip} must be internal");
        }
        for ip in ["8.8.8.8", "1.1.1.1", "172.32.0.1", "100.128.0.1", "2606:4700::1111", "::ffff:8.8.8.8"] {
            assert!(!is_internal(ip.parse().unwrap()), "{ip} is public");
        }
        let open = RemotePolicy::default();
        let target = open.check_url("http://localhost:8080/a").unwrap();
        let err = open.allowed_addrs(&target, &[addr("127.0.0.1:8080"), addr("[::1]:8080")]).unwrap_err();
        assert!(err.contains("127.0.0.1") && err.contains("--allowed-media-domains"), "{err}");
        // A host with one public and one internal record: only the public one is connected to.
        let mixed = [addr("10.0.0.1:80"), addr("93.184.216.34:80")];
        assert_eq!(open.allowed_addrs(&target, &mixed).unwrap(), [addr("93.184.216.34:80")]);
        assert!(open.allowed_addrs(&target, &[]).is_err());
        let listed = RemotePolicy { allowed_domains: Some(vec!["localhost".into()]), ..RemotePolicy::default() };
        assert_eq!(listed.allowed_addrs(&target, &[addr("127.0.0.1:8080")]).unwrap(), [addr("127.0.0.1:8080")]);
    }

    #[test]
    fn redirects_resolve_against_the_url_they_came_from() {
        let base = "https://a.example/img/cat.png?x=1";
        assert_eq!(redirect_target(base, "http://b.example/d.png").unwrap(), "http://b.example/d.png");
        assert_eq!(redirect_target(base, "//c.example/e.png").unwrap(), "https://c.example/e.png");
        assert_eq!(redirect_target(base, "/root.png").unwrap(), "https://a.example/root.png");
        assert_eq!(redirect_target(base, "dog.png").unwrap(), "https://a.example/img/dog.png");
        assert_eq!(redirect_target("http://h:81", "x.png").unwrap(), "http://h:81/x.png");
        assert!(redirect_target(base, "file:///etc/passwd").is_err());
    }
}
