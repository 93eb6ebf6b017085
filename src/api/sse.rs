//! Engine streams → HTTP: [`Choices`] multiplexes the `n` event streams of one request (owning
//! the receivers, so dropping it cancels every choice), records token timing, and turns a stream
//! that ends without a final event into an error. Also the Server-Sent Events framing and the
//! streaming response builder shared by both endpoints.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use actix_web::HttpResponse;
use bytes::Bytes;
use serde::Serialize;

use super::errors::ApiError;
use super::metrics::{self, TokenClock};
use crate::actors::handle::{EngineError, EventStream, FinishReason, StreamEvent};

/// The `n` event streams of one request, polled fairly. Dropping it drops every receiver that is
/// still open, which is how the engine learns that the client went away.
pub struct Choices {
    receivers: Vec<Option<EventStream>>,
    clocks: Vec<TokenClock>,
    lane: String,
    /// Round-robin start, so one fast choice cannot starve the others.
    cursor: usize,
}

impl Choices {
    pub fn new(receivers: Vec<EventStream>, lane: &str, start: Instant) -> Self {
        let clocks = receivers.iter().map(|_| TokenClock::new(start)).collect();
        Self { receivers: receivers.into_iter().map(Some).collect(), clocks, lane: lane.to_owned(), cursor: 0 }
    }

    /// The next event of any choice, with its index; `None` once every choice has ended. A
    /// choice ends with exactly one `Finished` or `Error`; a stream the engine closed without
    /// either yields an `Error` so no client ever waits on a silent stream.
    pub async fn next(&mut self) -> Option<(usize, StreamEvent)> {
        let (i, event) = NextEvent { choices: self }.await?;
        match &event {
            StreamEvent::Delta { tokens, .. } => self.clocks[i].tokens(&self.lane, tokens.len()),
            StreamEvent::Finished { reason: FinishReason::Repetition, .. } => metrics::loop_guard_stop(&self.lane),
            _ => {}
        }
        Some((i, event))
    }

    /// Drop every open receiver now (another choice failed: cancel the rest).
    pub fn cancel_all(&mut self) {
        self.receivers.iter_mut().for_each(|r| *r = None);
    }

    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<(usize, StreamEvent)>> {
        let n = self.receivers.len();
        let mut open = false;
        for k in 0..n {
            let i = (self.cursor + k) % n;
            let Some(rx) = self.receivers[i].as_mut() else { continue };
            open = true;
            match rx.poll_recv(cx) {
                Poll::Ready(Some(event)) => {
                    if matches!(event, StreamEvent::Finished { .. } | StreamEvent::Error(_)) {
                        self.receivers[i] = None;
                    }
                    self.cursor = (i + 1) % n;
                    return Poll::Ready(Some((i, event)));
                }
                Poll::Ready(None) => {
                    self.receivers[i] = None;
                    self.cursor = (i + 1) % n;
                    let err = EngineError::Executor("the engine closed the stream without finishing it".into());
                    return Poll::Ready(Some((i, StreamEvent::Error(err))));
                }
                Poll::Pending => {}
            }
        }
        if open {
            Poll::Pending
        } else {
            Poll::Ready(None)
        }
    }
}

impl Drop for Choices {
    fn drop(&mut self) {
        if self.receivers.iter().any(Option::is_some) {
            tracing::debug!(lane = %self.lane, "client went away; cancelling its request");
            metrics::request_cancelled(&self.lane);
        }
    }
}

struct NextEvent<'a> {
    choices: &'a mut Choices,
}

impl Future for NextEvent<'_> {
    type Output = Option<(usize, StreamEvent)>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.choices.poll_next(cx)
    }
}

/// One SSE event carrying a JSON payload.
pub fn event<T: Serialize>(payload: &T) -> Bytes {
    match serde_json::to_vec(payload) {
        Ok(json) => frame(&json),
        // Our payloads are plain structs; should one ever fail, the client still gets a
        // well-formed error event instead of a broken frame.
        Err(e) => error_event(&ApiError::Internal(format!("could not serialize a stream chunk: {e}"))),
    }
}

pub fn error_event(err: &ApiError) -> Bytes {
    frame(err.to_json().as_bytes())
}

pub fn done_event() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

fn frame(json: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(json.len() + 8);
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(json);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// Something that produces the next piece of an SSE body; `None` ends the body.
pub trait SseSource: 'static {
    fn next_chunk(&mut self) -> impl Future<Output = Option<Bytes>>;
}

/// A `text/event-stream` response driven by `source`. When the client disconnects, actix drops
/// the body stream, which drops `source` and with it the engine receivers.
pub fn sse_response<S: SseSource>(source: S) -> HttpResponse {
    let body = futures_util::stream::unfold(source, |mut source| async move {
        let chunk = source.next_chunk().await?;
        Some((Ok::<Bytes, std::convert::Infallible>(chunk), source))
    });
    HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header(("Cache-Control", "no-cache"))
        // Tell reverse proxies not to buffer the stream.
        .insert_header(("X-Accel-Buffering", "no"))
        .streaming(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actors::handle::Usage;

    fn delta(t: &str) -> StreamEvent {
        StreamEvent::Delta { text: t.into(), tokens: vec![] }
    }

    #[tokio::test]
    async fn choices_interleave_and_report_silent_streams() {
        let (tx0, rx0) = tokio::sync::mpsc::channel(8);
        let (tx1, rx1) = tokio::sync::mpsc::channel(8);
        tx0.send(delta("a")).await.unwrap();
        tx0.send(delta("b")).await.unwrap();
        tx1.send(delta("x")).await.unwrap();
        tx0.send(StreamEvent::Finished { reason: FinishReason::Stop, usage: Usage::default() }).await.unwrap();
        drop(tx1); // closed without a final event
        let mut c = Choices::new(vec![rx0, rx1], "voice", Instant::now());
        let mut seen = Vec::new();
        while let Some((i, ev)) = c.next().await {
            seen.push((i, ev));
        }
        assert_eq!(seen[0], (0, delta("a")));
        assert_eq!(seen[1], (1, delta("x")), "round robin");
        assert_eq!(seen[2], (0, delta("b")));
        assert!(matches!(seen[3], (1, StreamEvent::Error(EngineError::Executor(_)))), "{:?}", seen[3]);
        assert!(matches!(seen[4], (0, StreamEvent::Finished { .. })));
        assert_eq!(seen.len(), 5);
    }

    #[tokio::test]
    async fn dropping_choices_closes_the_senders() {
        let (tx, rx) = tokio::sync::mpsc::channel::<StreamEvent>(1);
        let c = Choices::new(vec![rx], "voice", Instant::now());
        assert!(!tx.is_closed());
        drop(c);
        assert!(tx.is_closed());
    }

    #[test]
    fn framing() {
        assert_eq!(&event(&serde_json::json!({"a": 1}))[..], b"data: {\"a\":1}\n\n");
        assert_eq!(&done_event()[..], b"data: [DONE]\n\n");
    }
}
