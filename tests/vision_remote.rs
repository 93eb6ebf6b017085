//! Remote media (`--allow-remote-media`) against real sockets: the real `shelfserve serve` on the
//! smallest chat checkpoint with a vision tower (`tests/fixtures/glm5/vision-chat`) fetches from
//! a real HTTP server started here (std sockets, one thread per connection) and from an https
//! one whose certificate a test CA made at test time signs (trusted with `--media-extra-ca`):
//! - the reply for an `http://` (and `https://`, and redirected) image URL equals, greedy, the
//!   reply for the same image as a data URL;
//! - a 404, a body that streams past the byte cap without `Content-Length` (chunked, and HTTP/1.0
//!   until the connection closes), an HTTP/1.1 body with no framing at all, a declared length
//!   over the cap, a server that stalls past `--media-fetch-timeout`, a redirect loop, a body that
//!   is no image and a host not in `--allowed-media-domains` are 400s naming the URL and reason,
//!   and the server keeps serving;
//! - without `--allowed-media-domains`, a `127.0.0.1` URL is refused by the internal-address
//!   guard; without `--allow-remote-media`, the old refusal naming the flag stays.

mod binary_server;
mod common;
mod e2e_http;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use binary_server::Server;
use serde_json::{json, Value};

const MODEL: &str = "glm5-vision";
/// The byte cap the fetching server runs with: above the fixture image, far below `/endless`.
const MAX_IMAGE_BYTES: usize = 64 << 10;

fn fixture_dir() -> PathBuf {
    common::fixture("glm5/vision-chat")
}

fn image() -> Vec<u8> {
    std::fs::read(common::fixture("media/exact.png")).expect("read the image")
}

// ---------------------------------------------------------------- a small origin server

/// Answer one request on `stream` (plain or TLS) by its path; `base` is `scheme://host:port`.
fn respond<S: Read + Write>(stream: S, base: &str, png: &[u8]) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream);
    let mut first = String::new();
    reader.read_line(&mut first)?;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
    }
    let path = first.split_whitespace().nth(1).unwrap_or("/").to_string();
    let mut s = reader.into_inner();
    let head = |status: &str, extra: &str| format!("HTTP/1.1 {status}\r\nConnection: close\r\n{extra}\r\n");
    match path.as_str() {
        "/cat.png" => {
            s.write_all(
                head("200 OK", &format!("Content-Type: image/png\r\nContent-Length: {}\r\n", png.len())).as_bytes(),
            )?;
            s.write_all(png)?;
        }
        // Two hops: a relative and an absolute `Location`.
        "/hop1" => s.write_all(head("302 Found", "Location: /hop2\r\nContent-Length: 0\r\n").as_bytes())?,
        "/hop2" => s.write_all(
            head("301 Moved Permanently", &format!("Location: {base}/cat.png\r\nContent-Length: 0\r\n")).as_bytes(),
        )?,
        p if p.starts_with("/loop/") => {
            let n: u32 = p["/loop/".len()..].parse().unwrap_or(0);
            s.write_all(head("302 Found", &format!("Location: /loop/{}\r\nContent-Length: 0\r\n", n + 1)).as_bytes())?
        }
        "/missing" => {
            s.write_all(head("404 Not Found", "Content-Length: 9\r\n").as_bytes()).and(s.write_all(b"not here\n"))?
        }
        "/garbage" => {
            s.write_all(head("200 OK", "Content-Length: 12\r\n").as_bytes()).and(s.write_all(b"not an image"))?
        }
        "/declared" => s.write_all(head("200 OK", &format!("Content-Length: {}\r\n", 1u64 << 40)).as_bytes())?,
        // No Content-Length, 64 MiB in chunks (HTTP/1.1 chunked, or an HTTP/1.0 body that ends
        // when the connection closes).
        "/endless" | "/endless-1.0" => {
            let chunked = path == "/endless";
            let mut h = head("200 OK", if chunked { "Transfer-Encoding: chunked\r\n" } else { "" });
            if !chunked {
                h = h.replacen("HTTP/1.1", "HTTP/1.0", 1);
            }
            s.write_all(h.as_bytes())?;
            let chunk = vec![0x89u8; 16 << 10];
            for _ in 0..4096 {
                if chunked {
                    s.write_all(b"4000\r\n")?;
                }
                s.write_all(&chunk)?;
                if chunked {
                    s.write_all(b"\r\n")?;
                }
            }
        }
        // HTTP/1.1 without a length or chunking: awc reads such a body as empty, so it is refused.
        "/unframed" => s.write_all(head("200 OK", "").as_bytes()).and(s.write_all(png))?,
        // Headers and half the body, then nothing for longer than the fetch timeout.
        "/stall" => {
            s.write_all(head("200 OK", &format!("Content-Length: {}\r\n", png.len())).as_bytes())?;
            s.write_all(&png[..png.len() / 2])?;
            s.flush()?;
            std::thread::sleep(Duration::from_secs(30));
        }
        _ => s.write_all(head("400 Bad Request", "Content-Length: 0\r\n").as_bytes())?,
    }
    s.flush()
}

/// Serve on a free port of 127.0.0.1 until the test process ends; `tls` makes it https. The
/// counter counts connections accepted.
fn origin(tls: Option<Arc<rustls::ServerConfig>>) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind the origin");
    let addr = listener.local_addr().expect("its address");
    let base = format!("{}://{addr}", if tls.is_some() { "https" } else { "http" });
    let png = Arc::new(image());
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            counter.fetch_add(1, Ordering::SeqCst);
            let (tls, base, png) = (tls.clone(), base.clone(), png.clone());
            std::thread::spawn(move || {
                let _ = conn.set_read_timeout(Some(Duration::from_secs(60)));
                let _ = match tls {
                    None => respond(conn, &base, &png),
                    Some(cfg) => match rustls::ServerConnection::new(cfg) {
                        Ok(c) => {
                            let mut s = rustls::StreamOwned::new(c, conn);
                            let r = respond(&mut s, &base, &png);
                            s.conn.send_close_notify();
                            let _ = s.flush();
                            r
                        }
                        Err(e) => Err(std::io::Error::other(e)),
                    },
                };
            });
        }
    });
    (addr, accepted)
}

/// A CA made now, its PEM, and a server config for 127.0.0.1 signed by it.
fn test_ca() -> (String, Arc<rustls::ServerConfig>) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "shelfserve test media CA");
    let ca_cert = ca.self_signed(&ca_key).expect("self-sign the CA");
    let leaf_key = KeyPair::generate().expect("leaf key");
    let leaf = CertificateParams::new(vec!["127.0.0.1".to_string()])
        .expect("leaf params")
        .signed_by(&leaf_key, &ca_cert, &ca_key)
        .expect("sign the leaf");
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into());
    let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_no_client_auth()
        .with_single_cert(vec![leaf.der().clone()], key)
        .expect("server certificate");
    (ca_cert.pem(), Arc::new(cfg))
}

// ---------------------------------------------------------------- requests

fn chat(server: &Server, url: &str) -> e2e_http::Response {
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "What is in the picture?"},
        ]}],
        "max_tokens": 8,
        "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": false},
    });
    server.target("voice").post("/v1/chat/completions", &body).expect("/v1/chat/completions")
}

fn reply_text(r: &e2e_http::Response) -> String {
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["choices"][0]["message"]["content"].as_str().expect("content").to_owned()
}

/// A 400 whose message holds every one of `needles`.
fn expect_400(r: &e2e_http::Response, needles: &[&str]) {
    assert_eq!(r.status, 400, "{}", r.text());
    let v: Value = r.json();
    let message = v["error"]["message"].as_str().unwrap_or_default();
    for n in needles {
        assert!(message.contains(n), "`{n}` missing from: {message}");
    }
}

fn data_url() -> String {
    use base64::Engine as _;
    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(image()))
}

#[test]
fn remote_images_are_fetched_under_the_rules() {
    let (http, _) = origin(None);
    let (ca_pem, tls) = test_ca();
    let (https, _) = origin(Some(tls));
    let dir = tempfile::tempdir().expect("temp dir");
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, ca_pem).expect("write the CA");
    let server = Server::start(
        &fixture_dir(),
        MODEL,
        &[
            "--allow-remote-media",
            "--allowed-media-domains",
            "127.0.0.1",
            "--media-fetch-timeout",
            "2",
            "--max-image-bytes",
            &MAX_IMAGE_BYTES.to_string(),
            "--media-extra-ca",
            ca_file.to_str().expect("utf-8 path"),
        ],
        "remote",
    );
    let expected = reply_text(&chat(&server, &data_url()));
    assert!(!expected.is_empty(), "the data-URL reply is empty");
    for url in [format!("http://{http}/cat.png"), format!("http://{http}/hop1"), format!("https://{https}/cat.png")] {
        assert_eq!(reply_text(&chat(&server, &url)), expected, "{url}");
    }

    let cases: [(String, &[&str]); 9] = [
        (format!("http://{http}/missing"), &["HTTP 404"]),
        (format!("http://{http}/endless"), &["passed the limit of 65536 bytes", "--max-image-bytes"]),
        (format!("http://{http}/endless-1.0"), &["passed the limit of 65536 bytes", "--max-image-bytes"]),
        (format!("http://{http}/unframed"), &["neither a Content-Length nor chunked"]),
        (format!("http://{http}/declared"), &["1099511627776 bytes", "--max-image-bytes"]),
        (format!("http://{http}/stall"), &["--media-fetch-timeout"]),
        (format!("http://{http}/loop/0"), &["redirects more than 5 times"]),
        (format!("http://{http}/garbage"), &["could not be decoded"]),
        (format!("http://localhost:{}/cat.png", http.port()), &["`localhost` is not in --allowed-media-domains"]),
    ];
    for (url, needles) in &cases {
        let r = chat(&server, url);
        if !needles[0].contains("decoded") {
            expect_400(&r, &[&format!("`{url}`")]);
        }
        expect_400(&r, needles);
    }
    let r = server.target("voice").get("/health").expect("/health");
    assert_eq!(r.status, 200, "still serving after every error case: {}", r.text());
}

#[test]
fn internal_addresses_need_a_listed_host_and_remote_media_needs_the_flag() {
    let (http, accepted) = origin(None);
    let url = format!("http://{http}/cat.png");
    let guarded = Server::start(&fixture_dir(), MODEL, &["--allow-remote-media"], "guarded");
    expect_400(&chat(&guarded, &url), &["127.0.0.1", "internal address", "--allowed-media-domains"]);
    drop(guarded);
    let off = Server::start(&fixture_dir(), MODEL, &[], "off");
    expect_400(&chat(&off, &url), &["--allow-remote-media"]);
    assert_eq!(accepted.load(Ordering::SeqCst), 0, "neither server may connect to the origin");
}
