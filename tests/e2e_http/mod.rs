//! A small blocking HTTP/1.1 client for the end-to-end tests and the soak example (both include
//! this file): one TCP connection per request (`Connection: close`), so the caller decides when a
//! client goes away simply by dropping the [`ChatStream`] or the raw socket. It reads
//! `Content-Length`, chunked and read-to-EOF bodies, parses Server-Sent Events, and timestamps
//! every streamed token so tests can measure time to first token and inter-token latency.
//!
//! Plain std sockets on the caller's thread (no async runtime of its own): the engine under test
//! runs on its own runtime, and the clients cannot be slowed down by it or slow it down.
#![allow(dead_code)]

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A complete (non-streamed) response.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Response {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|_| Value::String(self.text()))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Where requests go and how long a read may stall before it is an error (so a broken server
/// fails a test instead of hanging it).
#[derive(Clone, Debug)]
pub struct Target {
    pub addr: SocketAddr,
    pub api_key: Option<String>,
    pub patience: Duration,
}

impl Target {
    pub fn new(addr: SocketAddr, patience: Duration) -> Self {
        Self { addr, api_key: None, patience }
    }

    /// Parse `http://HOST:PORT[/v1]`.
    pub fn from_url(url: &str, patience: Duration) -> Result<Self, String> {
        let rest = url.strip_prefix("http://").ok_or_else(|| format!("`{url}`: only http:// URLs are supported"))?;
        let hostport = rest.split('/').next().unwrap_or(rest);
        use std::net::ToSocketAddrs;
        let addr = hostport
            .to_socket_addrs()
            .map_err(|e| format!("`{url}`: {e}"))?
            .next()
            .ok_or_else(|| format!("`{url}`: no address"))?;
        Ok(Self::new(addr, patience))
    }

    fn connect(&self) -> io::Result<TcpStream> {
        let s = TcpStream::connect_timeout(&self.addr, self.patience)?;
        s.set_read_timeout(Some(self.patience))?;
        s.set_write_timeout(Some(self.patience))?;
        s.set_nodelay(true)?;
        Ok(s)
    }

    /// Open a connection and send one request; the response is left unread.
    pub fn send(&self, method: &str, path: &str, body: Option<&Value>) -> io::Result<TcpStream> {
        let mut s = self.connect()?;
        let body = body.map(Value::to_string).unwrap_or_default();
        let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n", self.addr);
        if let Some(k) = &self.api_key {
            head.push_str(&format!("Authorization: Bearer {k}\r\n"));
        }
        if method != "GET" {
            head.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len()));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes())?;
        s.write_all(body.as_bytes())?;
        s.flush()?;
        Ok(s)
    }

    pub fn request(&self, method: &str, path: &str, body: Option<&Value>) -> io::Result<Response> {
        let s = self.send(method, path, body)?;
        let mut body = Body::open(s)?;
        let mut bytes = Vec::new();
        body.read_to_end(&mut bytes)?;
        Ok(Response { status: body.status, body: bytes })
    }

    pub fn get(&self, path: &str) -> io::Result<Response> {
        self.request("GET", path, None)
    }

    pub fn post(&self, path: &str, body: &Value) -> io::Result<Response> {
        self.request("POST", path, Some(body))
    }

    /// POST a streaming request and read it to the end, for tests: a refused request, a broken
    /// connection or a stream that does not end with `[DONE]` and no error fails the caller.
    pub fn stream_to_clean_end(&self, path: &str, body: &Value) -> Streamed {
        match self.stream(path, body).expect("send the request") {
            Ok(s) => {
                let r = s.finish().expect("read the stream");
                assert!(r.done && r.error.is_none(), "stream did not end cleanly: {r:?}");
                r
            }
            Err(resp) => panic!("status {}: {}", resp.status, resp.text()),
        }
    }

    /// POST a streaming chat/completions request. A non-200 answer comes back as `Err(response)`.
    pub fn stream(&self, path: &str, body: &Value) -> io::Result<Result<ChatStream, Response>> {
        let started = Instant::now();
        let s = self.send("POST", path, Some(body))?;
        let mut body = Body::open(s)?;
        if body.status != 200 {
            let mut bytes = Vec::new();
            body.read_to_end(&mut bytes)?;
            return Ok(Err(Response { status: body.status, body: bytes }));
        }
        Ok(Ok(ChatStream { body, started, pending: Vec::new(), done: false, result: Streamed::default() }))
    }
}

/// A response body over its connection: status and headers read, the body decoded on demand.
struct Body {
    status: u16,
    conn: BufReader<TcpStream>,
    framing: Framing,
}

enum Framing {
    Length(u64),
    /// Bytes left in the current chunk; `None` before the first chunk header.
    Chunked {
        left: u64,
        finished: bool,
    },
    UntilEof,
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

impl Body {
    fn open(s: TcpStream) -> io::Result<Body> {
        let mut conn = BufReader::new(s);
        let mut line = String::new();
        conn.read_line(&mut line)?;
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse::<u16>().ok())
            .ok_or_else(|| bad(format!("bad status line {line:?}")))?;
        let mut framing = Framing::UntilEof;
        loop {
            line.clear();
            if conn.read_line(&mut line)? == 0 {
                return Err(bad("connection closed inside the response head"));
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((name, value)) = l.split_once(':') {
                let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
                if name == "content-length" {
                    framing = Framing::Length(value.parse().map_err(|_| bad("bad content-length"))?);
                } else if name == "transfer-encoding" && value.eq_ignore_ascii_case("chunked") {
                    framing = Framing::Chunked { left: 0, finished: false };
                }
            }
        }
        Ok(Body { status, conn, framing })
    }
}

impl Read for Body {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match &mut self.framing {
            Framing::UntilEof => self.conn.read(buf),
            Framing::Length(left) => {
                if *left == 0 {
                    return Ok(0);
                }
                let want = buf.len().min(*left as usize);
                let n = self.conn.read(&mut buf[..want])?;
                if n == 0 {
                    return Err(bad("connection closed before the end of the body"));
                }
                *left -= n as u64;
                Ok(n)
            }
            Framing::Chunked { left, finished } => {
                if *finished {
                    return Ok(0);
                }
                if *left == 0 {
                    let mut line = String::new();
                    self.conn.read_line(&mut line)?;
                    // The CRLF that ends the previous chunk's data.
                    if line.trim().is_empty() {
                        line.clear();
                        self.conn.read_line(&mut line)?;
                    }
                    let size = line.trim().split(';').next().unwrap_or("");
                    if size.is_empty() {
                        return Err(bad("connection closed inside a chunked body"));
                    }
                    *left = u64::from_str_radix(size, 16).map_err(|_| bad(format!("bad chunk size {line:?}")))?;
                    if *left == 0 {
                        *finished = true;
                        return Ok(0);
                    }
                }
                let want = buf.len().min(*left as usize);
                let n = self.conn.read(&mut buf[..want])?;
                if n == 0 {
                    return Err(bad("connection closed inside a chunk"));
                }
                *left -= n as u64;
                Ok(n)
            }
        }
    }
}

/// One streamed token: its bytes (from `logprobs`), log-probability, and when its chunk arrived.
#[derive(Clone, Debug, PartialEq)]
pub struct StreamedToken {
    pub bytes: Vec<u8>,
    pub logprob: f64,
    pub at: Duration,
}

/// What a stream delivered so far.
#[derive(Clone, Debug, Default)]
pub struct Streamed {
    /// Concatenated `delta.content` (chat) or `text` (completions) of choice 0.
    pub text: String,
    /// Tokens of choice 0, in order (requires `logprobs` in the request).
    pub tokens: Vec<StreamedToken>,
    /// Tokens of choice 0 seen so far (text pieces when the request has no `logprobs`).
    pub count: usize,
    /// Arrival of the first chunk that carried a token or text, since the request was sent.
    pub first_token: Option<Duration>,
    pub finish_reason: Option<String>,
    /// `usage` of the final chunk when `include_usage` was asked for.
    pub usage: Option<Value>,
    /// An error event inside the stream.
    pub error: Option<Value>,
    /// `data: [DONE]` arrived.
    pub done: bool,
}

impl Streamed {
    /// Gaps between consecutive token chunks (inter-token latency as the client sees it).
    pub fn gaps(&self) -> Vec<Duration> {
        let mut times: Vec<Duration> = self.tokens.iter().map(|t| t.at).collect();
        times.dedup();
        times.windows(2).map(|w| w[1].saturating_sub(w[0])).collect()
    }
}

/// An open SSE response. Drop it to disconnect.
pub struct ChatStream {
    body: Body,
    started: Instant,
    pending: Vec<u8>,
    done: bool,
    pub result: Streamed,
}

impl ChatStream {
    /// The next SSE `data:` payload, or `None` at the end of the body.
    fn next_event(&mut self) -> io::Result<Option<String>> {
        loop {
            if let Some(end) = find(&self.pending, b"\n\n") {
                let event: Vec<u8> = self.pending.drain(..end + 2).collect();
                let text = String::from_utf8(event).map_err(|_| bad("SSE event is not UTF-8"))?;
                let data: Vec<&str> =
                    text.lines().filter_map(|l| l.strip_prefix("data:")).map(str::trim_start).collect();
                if data.is_empty() {
                    continue;
                }
                return Ok(Some(data.join("\n")));
            }
            let mut buf = [0u8; 8192];
            let n = self.body.read(&mut buf)?;
            if n == 0 {
                if self.pending.iter().all(u8::is_ascii_whitespace) {
                    return Ok(None);
                }
                return Err(bad(format!("stream ended inside an event: {:?}", String::from_utf8_lossy(&self.pending))));
            }
            self.pending.extend_from_slice(&buf[..n]);
        }
    }

    /// Read one event and fold it into `result`. Returns the number of tokens (or text pieces)
    /// it carried for choice 0, or `None` once the stream is over.
    pub fn step(&mut self) -> io::Result<Option<usize>> {
        if self.done {
            return Ok(None);
        }
        let Some(data) = self.next_event()? else {
            self.done = true;
            return Ok(None);
        };
        let at = self.started.elapsed();
        if data == "[DONE]" {
            self.result.done = true;
            self.done = true;
            return Ok(None);
        }
        let v: Value =
            serde_json::from_str(&data).map_err(|e| bad(format!("SSE payload is not JSON ({e}): {data}")))?;
        if v.get("error").is_some() {
            self.result.error = Some(v["error"].clone());
            return Ok(Some(0));
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            self.result.usage = Some(u.clone());
        }
        let mut carried = 0;
        for choice in v["choices"].as_array().into_iter().flatten() {
            if choice["index"].as_u64().unwrap_or(0) != 0 {
                continue;
            }
            let text = choice["delta"]["content"].as_str().or(choice["text"].as_str()).unwrap_or("");
            self.result.text.push_str(text);
            let mut n = 0;
            // Chat: logprobs.content[] with bytes; completions: logprobs.tokens[] strings.
            if let Some(content) = choice["logprobs"]["content"].as_array() {
                for t in content {
                    let bytes = t["bytes"]
                        .as_array()
                        .map(|b| b.iter().filter_map(Value::as_u64).map(|x| x as u8).collect())
                        .unwrap_or_else(|| t["token"].as_str().unwrap_or("").as_bytes().to_vec());
                    self.result.tokens.push(StreamedToken {
                        bytes,
                        logprob: t["logprob"].as_f64().unwrap_or(f64::NAN),
                        at,
                    });
                    n += 1;
                }
            } else if let Some(tokens) = choice["logprobs"]["tokens"].as_array() {
                let lps = choice["logprobs"]["token_logprobs"].as_array();
                for (i, t) in tokens.iter().enumerate() {
                    let logprob = lps.and_then(|l| l.get(i)).and_then(Value::as_f64).unwrap_or(f64::NAN);
                    self.result.tokens.push(StreamedToken {
                        bytes: t.as_str().unwrap_or("").as_bytes().to_vec(),
                        logprob,
                        at,
                    });
                    n += 1;
                }
            }
            if n == 0 && !text.is_empty() {
                n = 1;
            }
            if n > 0 && self.result.first_token.is_none() {
                self.result.first_token = Some(at);
            }
            carried += n;
            self.result.count += n;
            if let Some(r) = choice["finish_reason"].as_str() {
                self.result.finish_reason = Some(r.to_owned());
            }
        }
        Ok(Some(carried))
    }

    /// Read until at least `n` tokens (or text pieces) arrived in total, or the stream ended.
    pub fn read_tokens(&mut self, n: usize) -> io::Result<&Streamed> {
        while self.result.count < n {
            if self.step()?.is_none() {
                break;
            }
        }
        Ok(&self.result)
    }

    /// Read to the end of the stream.
    pub fn finish(mut self) -> io::Result<Streamed> {
        while self.step()?.is_some() {}
        Ok(self.result)
    }

    /// When the request was sent.
    pub fn started(&self) -> Instant {
        self.started
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Percentile (0..=100) of a list of durations, nearest-rank; `None` when empty.
pub fn percentile(values: &[Duration], p: f64) -> Option<Duration> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort();
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    Some(v[rank.clamp(1, v.len()) - 1])
}

/// Print a duration in milliseconds with one decimal.
pub fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}
