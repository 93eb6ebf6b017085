//! Engine events → an Anthropic `message`: content blocks (`thinking`, `text`, `tool_use`) in the
//! order the reply wrote them, `stop_reason`, and `usage` whose `cache_read_input_tokens` are the
//! prompt tokens the prefix cache served (`input_tokens` counts the rest, as Anthropic does).
//! Streaming follows Anthropic's event sequence: `message_start`, per block
//! `content_block_start` / `content_block_delta`… / `content_block_stop`, then `message_delta`
//! (stop reason, usage) and `message_stop`; an engine failure is an `error` event. A `tool_use`
//! block starts (with an empty `input`) as soon as the call's name is known; its input follows
//! as `input_json_delta` pieces as the model writes it (they concatenate to the non-streamed
//! block's input JSON), and the block stops when the call ends.

use std::sync::Arc;

use actix_web::HttpResponse;
use bytes::{Bytes, BytesMut};
use serde_json::{json, Value};

use super::error_json;
use crate::actors::handle::{FinishReason, StreamEvent, Usage};
use crate::api::errors::ApiError;
use crate::api::metrics;
use crate::api::output::{ReplyParser, ReplyPiece, ReplySetup};
use crate::api::sse::{self, Choices, SseSource};
use crate::api::tools::parse::CallEvent;
use crate::tokenizer::TokenizerBundle;

/// How many trailing tokens are decoded to tell which stop sequence ended the reply.
const STOP_WINDOW: usize = 16;

/// What a reply needs to know about its request.
pub(crate) struct Reply {
    pub id: String,
    pub model: String,
    pub lane: String,
    pub prompt_len: usize,
    pub setup: ReplySetup,
    pub stop_sequences: Vec<String>,
    /// Ids that end a turn (EOS, end-of-turn, the request's stop ids).
    pub end_ids: Vec<u32>,
    pub tokenizer: Option<Arc<TokenizerBundle>>,
}

impl Reply {
    fn usage(&self, usage: Usage) -> Value {
        let cached = usage.cached_tokens.min(self.prompt_len);
        json!({
            "input_tokens": self.prompt_len - cached,
            "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
        })
    }

    /// `(stop_reason, stop_sequence)`.
    fn stop(&self, reason: FinishReason, made_calls: bool, tail: &[u32]) -> (&'static str, Option<String>) {
        match reason {
            _ if made_calls => ("tool_use", None),
            FinishReason::Length => ("max_tokens", None),
            // Not one of Anthropic's reasons: the server, not the model, ended the turn, and the
            // client should know.
            FinishReason::Repetition => ("repetition", None),
            FinishReason::Stop => match tail.last() {
                Some(id) if !self.end_ids.contains(id) && !self.stop_sequences.is_empty() => {
                    ("stop_sequence", self.matched_stop(tail))
                }
                _ => ("end_turn", None),
            },
        }
    }

    /// The stop sequence at the end of the reply: the engine cut it from the text, so it is
    /// found in the decoded last tokens (the one ending latest wins).
    fn matched_stop(&self, tail: &[u32]) -> Option<String> {
        let text = self.tokenizer.as_ref()?.decode(tail, false).ok()?;
        self.stop_sequences
            .iter()
            .filter_map(|s| text.rfind(s.as_str()).map(|at| (at + s.len(), s)))
            .max_by_key(|(end, _)| *end)
            .map(|(_, s)| s.clone())
    }

    fn message(&self, content: Vec<Value>, stop: Option<(&'static str, Option<String>)>, usage: Value) -> Value {
        let (stop_reason, stop_sequence) = match stop {
            Some((r, s)) => (Value::from(r), s.map_or(Value::Null, Value::String)),
            None => (Value::Null, Value::Null),
        };
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        })
    }

    pub async fn collect(self, mut choices: Choices) -> Result<HttpResponse, ApiError> {
        let mut parser = self.setup.parser();
        let mut blocks = Blocks::default();
        let mut tail = Vec::new();
        let mut finish = None;
        while let Some((_, event)) = choices.next().await {
            match event {
                StreamEvent::Delta { text, tokens } => {
                    blocks.add(parser.push(&text));
                    keep_tail(&mut tail, tokens.iter().map(|t| t.id));
                }
                StreamEvent::Finished { reason, usage } => {
                    blocks.add(parser.finish());
                    finish = Some((reason, usage));
                }
                StreamEvent::Error(e) => {
                    metrics::request_error(&self.lane, e.kind());
                    return Err(ApiError::engine(e, Some("messages")));
                }
            }
        }
        let (reason, usage) = finish.ok_or_else(|| ApiError::Internal("the reply ended without finishing".into()))?;
        let stop = self.stop(reason, blocks.whole_calls > 0, &tail);
        Ok(HttpResponse::Ok().json(self.message(blocks.blocks, Some(stop), self.usage(usage))))
    }
}

fn keep_tail(tail: &mut Vec<u32>, ids: impl Iterator<Item = u32>) {
    tail.extend(ids);
    if tail.len() > STOP_WINDOW {
        tail.drain(..tail.len() - STOP_WINDOW);
    }
}

/// Content blocks of a non-streamed reply; consecutive pieces of one kind share a block.
#[derive(Default)]
struct Blocks {
    blocks: Vec<Value>,
    /// The open call's arguments so far (a call's events are never interleaved with others).
    arguments: String,
    /// Calls that ended whole (they make the stop reason `tool_use`).
    whole_calls: usize,
}

impl Blocks {
    fn add(&mut self, pieces: Vec<ReplyPiece>) {
        for piece in pieces {
            match piece {
                ReplyPiece::Reasoning(t) => self.append("thinking", &t),
                ReplyPiece::Content(t) => self.append("text", &t),
                ReplyPiece::Call(CallEvent::Start { id, name, .. }) => {
                    self.arguments.clear();
                    self.blocks.push(tool_use_start(&id, &name));
                }
                ReplyPiece::Call(CallEvent::Arguments { text, .. }) => self.arguments.push_str(&text),
                ReplyPiece::Call(CallEvent::End { whole, .. }) => {
                    self.whole_calls += usize::from(whole);
                    let input = serde_json::from_str(&self.arguments).unwrap_or_else(|_| json!({}));
                    if let Some(block) = self.blocks.last_mut().filter(|b| b["type"] == "tool_use") {
                        block["input"] = input;
                    }
                }
            }
        }
    }

    fn append(&mut self, kind: &'static str, text: &str) {
        if let Some(last) = self.blocks.last_mut().filter(|b| b["type"] == kind) {
            let mut joined = last[kind].as_str().unwrap_or("").to_owned();
            joined.push_str(text);
            last[kind] = Value::String(joined);
            return;
        }
        // A text block of only whitespace between other blocks says nothing.
        if kind == "text" && text.trim().is_empty() {
            return;
        }
        let mut block = json!({"type": kind, kind: text});
        if kind == "thinking" {
            block["signature"] = Value::String(String::new());
        }
        self.blocks.push(block);
    }
}

/// A `tool_use` block as it starts: `input` empty, filled by the call's arguments.
fn tool_use_start(call_id: &str, name: &str) -> Value {
    let id = format!("toolu_{}", call_id.trim_start_matches("call_"));
    json!({"type": "tool_use", "id": id, "name": name, "input": {}})
}

pub(crate) fn stream(choices: Choices, reply: Reply) -> HttpResponse {
    let parser = reply.setup.parser();
    sse::sse_response(MessageStream {
        choices,
        reply,
        parser,
        open: None,
        index: 0,
        whole_calls: 0,
        tail: Vec::new(),
        state: Phase::Start,
    })
}

#[derive(PartialEq, Eq)]
enum Phase {
    Start,
    Body,
    Done,
}

/// The streamed `message`.
struct MessageStream {
    choices: Choices,
    reply: Reply,
    parser: ReplyParser,
    /// The open content block's kind (`thinking`, `text` or `tool_use`).
    open: Option<&'static str>,
    /// Index of the next block.
    index: usize,
    /// Calls that ended whole (they make the stop reason `tool_use`).
    whole_calls: usize,
    tail: Vec<u32>,
    state: Phase,
}

fn event(name: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

impl MessageStream {
    fn close(&mut self, out: &mut BytesMut) {
        if let Some(kind) = self.open.take() {
            let index = self.index - 1;
            if kind == "thinking" {
                let delta = json!({"type": "content_block_delta", "index": index,
                                   "delta": {"type": "signature_delta", "signature": ""}});
                out.extend_from_slice(&event("content_block_delta", &delta));
            }
            out.extend_from_slice(&event("content_block_stop", &json!({"type": "content_block_stop", "index": index})));
        }
    }

    fn start_block(&mut self, block: Value, out: &mut BytesMut) -> usize {
        self.close(out);
        let index = self.index;
        self.index += 1;
        out.extend_from_slice(&event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": index, "content_block": block}),
        ));
        index
    }

    fn text(&mut self, kind: &'static str, text: String, out: &mut BytesMut) {
        if text.is_empty() || (kind == "text" && self.open != Some("text") && text.trim().is_empty()) {
            return;
        }
        if self.open != Some(kind) {
            let mut block = json!({"type": kind, kind: ""});
            if kind == "thinking" {
                block["signature"] = Value::String(String::new());
            }
            self.start_block(block, out);
            self.open = Some(kind);
        }
        let delta_type = if kind == "thinking" { "thinking_delta" } else { "text_delta" };
        let delta = json!({"type": "content_block_delta", "index": self.index - 1,
                           "delta": {"type": delta_type, kind: text}});
        out.extend_from_slice(&event("content_block_delta", &delta));
    }

    fn pieces(&mut self, pieces: Vec<ReplyPiece>) -> BytesMut {
        let mut out = BytesMut::new();
        for piece in pieces {
            match piece {
                ReplyPiece::Reasoning(t) => self.text("thinking", t, &mut out),
                ReplyPiece::Content(t) => self.text("text", t, &mut out),
                ReplyPiece::Call(CallEvent::Start { id, name, .. }) => {
                    self.start_block(tool_use_start(&id, &name), &mut out);
                    self.open = Some("tool_use");
                }
                ReplyPiece::Call(CallEvent::Arguments { text, .. }) => {
                    let delta = json!({"type": "content_block_delta", "index": self.index - 1,
                                       "delta": {"type": "input_json_delta", "partial_json": text}});
                    out.extend_from_slice(&event("content_block_delta", &delta));
                }
                ReplyPiece::Call(CallEvent::End { whole, .. }) => {
                    self.whole_calls += usize::from(whole);
                    self.close(&mut out);
                }
            }
        }
        out
    }
}

impl SseSource for MessageStream {
    async fn next_chunk(&mut self) -> Option<Bytes> {
        match self.state {
            Phase::Done => return None,
            Phase::Start => {
                self.state = Phase::Body;
                let usage = self.reply.usage(Usage::default());
                let start = json!({"type": "message_start", "message": self.reply.message(Vec::new(), None, usage)});
                let mut out = BytesMut::from(&event("message_start", &start)[..]);
                out.extend_from_slice(&event("ping", &json!({"type": "ping"})));
                return Some(out.freeze());
            }
            Phase::Body => {}
        }
        loop {
            match self.choices.next().await {
                Some((_, StreamEvent::Delta { text, tokens })) => {
                    keep_tail(&mut self.tail, tokens.iter().map(|t| t.id));
                    let pieces = self.parser.push(&text);
                    let out = self.pieces(pieces);
                    if !out.is_empty() {
                        return Some(out.freeze());
                    }
                }
                Some((_, StreamEvent::Finished { reason, usage })) => {
                    let pieces = self.parser.finish();
                    let mut out = self.pieces(pieces);
                    self.close(&mut out);
                    let (stop_reason, stop_sequence) = self.reply.stop(reason, self.whole_calls > 0, &self.tail);
                    let delta = json!({"type": "message_delta",
                                       "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                       "usage": self.reply.usage(usage)});
                    out.extend_from_slice(&event("message_delta", &delta));
                    out.extend_from_slice(&event("message_stop", &json!({"type": "message_stop"})));
                    self.state = Phase::Done;
                    return Some(out.freeze());
                }
                Some((_, StreamEvent::Error(e))) => {
                    self.state = Phase::Done;
                    metrics::request_error(&self.reply.lane, e.kind());
                    return Some(event("error", &error_json(&ApiError::engine(e, Some("messages")))));
                }
                None => {
                    self.state = Phase::Done;
                    return None;
                }
            }
        }
    }
}
