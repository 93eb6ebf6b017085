//! The streaming tool-call parser: text in (the answer part of the reply, after the reasoning
//! split), content and call events out, in order. Text that might be the start of a call marker
//! is held back until it resolves. A call is released as it is written: [`CallEvent::Start`]
//! (index, id, name) as soon as the name is complete and names an offered tool, then
//! [`CallEvent::Arguments`] pieces (see [`args`](super::args): every completed top-level argument
//! is a piece, string values stream as written), then [`CallEvent::End`]. The pieces of a call
//! concatenate to its `arguments` string; the non-streamed replies are assembled from the same
//! events ([`CallList`]), so streamed and non-streamed arguments are equal by construction.
//!
//! Text that does not become a call is content, never lost:
//! - before the header (a name that is not an offered tool, a body that is not the syntax), the
//!   call's text so far is content and reading resumes where it failed;
//! - after the header (the arguments turn out malformed, or the reply ends inside the call), the
//!   call is ended with the text that closes what was sent into a valid JSON object (an open
//!   string's quote, `}`) and `End { whole: false }`; then the call's raw text up to the fault is
//!   content and reading resumes there. Pieces already sent are never contradicted. A call that
//!   did not end whole does not make the reply's finish reason `tool_calls`.
//!
//! Formats: Hermes / Qwen and GLM calls sit in `<tool_call>…</tool_call>`; Llama 3 calls start
//! the reply (optionally after `<|python_tag|>`) and are separated by `;`; Mistral's follow
//! `[TOOL_CALLS]`, as a `[{…}, …]` list or `name[ARGS]{…}`. A call whose closing marker never
//! comes (a forced call's `</tool_call>` is a stop string, cut from the text) is complete when
//! its body is.

use super::args::{CallOut, GlmCall, JsonCall, NamedCall, Progress, TAG_CLOSE};
use super::{ToolFormat, ToolSpec};
use crate::api::reasoning::partial_suffix;

const TAG_OPEN: &str = "<tool_call>";
const MISTRAL_OPEN: &str = "[TOOL_CALLS]";
const PYTHON_TAG: &str = "<|python_tag|>";

/// One call, as a non-streamed reply shows it: arguments as a JSON string.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// A step of one call; `index` counts the reply's calls from 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallEvent {
    Start {
        index: usize,
        id: String,
        name: String,
    },
    /// The next piece of the call's arguments string.
    Arguments {
        index: usize,
        text: String,
    },
    /// The arguments are complete; `whole: false` when the parser closed them (see the module doc).
    End {
        index: usize,
        whole: bool,
    },
}

/// What one push released, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Content(String),
    Call(CallEvent),
}

/// Calls assembled from their events (the non-streamed view).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CallList {
    pub calls: Vec<ToolCall>,
    /// How many calls ended whole.
    pub whole: usize,
}

impl CallList {
    pub fn add(&mut self, event: CallEvent) {
        match event {
            CallEvent::Start { id, name, .. } => self.calls.push(ToolCall { id, name, arguments: String::new() }),
            CallEvent::Arguments { text, .. } => {
                if let Some(call) = self.calls.last_mut() {
                    call.arguments.push_str(&text);
                }
            }
            CallEvent::End { whole, .. } => self.whole += usize::from(whole),
        }
    }
}

/// The reader of the call being read.
enum Reader {
    Json(JsonCall),
    Glm(GlmCall),
    Named(NamedCall),
}

impl Reader {
    fn advance(&mut self, text: &str, pos: &mut usize, tools: &[ToolSpec], out: &mut Vec<CallOut>) -> Progress {
        match self {
            Self::Json(r) => r.advance(text, pos, tools, out),
            Self::Glm(r) => r.advance(text, pos, tools, out),
            Self::Named(r) => r.advance(text, pos, tools, out),
        }
    }

    fn finish(&mut self, text: &str, pos: &mut usize, tools: &[ToolSpec], out: &mut Vec<CallOut>) -> Progress {
        match self {
            Self::Glm(r) => r.finish(text, pos, tools, out),
            Self::Json(_) | Self::Named(_) => Progress::Fault,
        }
    }

    fn header_sent(&self) -> bool {
        match self {
            Self::Json(r) => r.header_sent(),
            Self::Glm(r) => r.header_sent(),
            Self::Named(r) => r.header_sent(),
        }
    }

    fn seal(&mut self) -> String {
        match self {
            Self::Json(r) => r.seal(),
            Self::Glm(r) => r.seal(),
            Self::Named(r) => r.seal(),
        }
    }
}

/// What may follow a complete call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Group {
    /// `</tool_call>` (Hermes; GLM's reader reads its own).
    CloseTag,
    /// Nothing in particular: back to content.
    Single,
    /// `;` and another call (Llama 3).
    Semicolon,
    /// `,` and another call, or `]` (Mistral's list).
    List,
}

enum State {
    /// Content, looking for the start of a call.
    Scan,
    Call(Box<Reader>, Group),
    Between(Group),
    /// After `[TOOL_CALLS]`: a list or a named call.
    MistralOpen,
}

pub struct ToolCallParser {
    format: ToolFormat,
    tools: Vec<ToolSpec>,
    state: State,
    /// Text not released yet; inside a call it starts at the call's opening marker.
    buf: String,
    /// How far a call's reader has read `buf`.
    pos: usize,
    /// Nothing but whitespace has been released yet (Llama 3 calls start the reply).
    at_start: bool,
    /// The last release was a call: whitespace before the next text is dropped.
    after_call: bool,
    /// Calls started so far.
    calls: usize,
}

impl ToolCallParser {
    pub fn new(format: ToolFormat, tools: Vec<ToolSpec>) -> Self {
        Self {
            format,
            tools,
            state: State::Scan,
            buf: String::new(),
            pos: 0,
            at_start: true,
            after_call: false,
            calls: 0,
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        self.run(false, &mut out);
        out
    }

    /// End of the reply: a call is complete if its body is (see the module doc); whatever is
    /// held back is released.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        self.run(true, &mut out);
        out
    }

    fn run(&mut self, at_end: bool, out: &mut Vec<Piece>) {
        loop {
            let go_on = match std::mem::replace(&mut self.state, State::Scan) {
                State::Scan => self.scan(at_end, out),
                State::Call(reader, group) => self.read_call(reader, group, at_end, out),
                State::Between(group) => self.between(group, at_end),
                State::MistralOpen => self.mistral_open(at_end, out),
            };
            if !go_on {
                return;
            }
        }
    }

    /// Content up to the next call marker. `false`: wait for more text.
    fn scan(&mut self, at_end: bool, out: &mut Vec<Piece>) -> bool {
        if self.after_call || self.at_start {
            let trimmed = self.buf.trim_start().len();
            if trimmed == 0 {
                if at_end && !self.after_call {
                    self.release(self.buf.len(), out);
                }
                if at_end {
                    self.buf.clear();
                }
                return false;
            }
            if self.after_call {
                self.buf.drain(..self.buf.len() - trimmed);
                self.after_call = false;
            }
        }
        if self.at_start && self.format == ToolFormat::Llama3Json {
            let t = self.buf.trim_start();
            let lead = self.buf.len() - t.len();
            if t.starts_with('{') || t.starts_with(PYTHON_TAG) {
                self.pos = lead + if t.starts_with(PYTHON_TAG) { PYTHON_TAG.len() } else { 0 };
                self.state = State::Call(Box::new(Reader::Json(JsonCall::new())), Group::Semicolon);
                return true;
            }
            if PYTHON_TAG.starts_with(t) && !at_end {
                return false;
            }
        }
        let marker = match self.format {
            ToolFormat::Hermes | ToolFormat::Glm => TAG_OPEN,
            ToolFormat::Mistral => MISTRAL_OPEN,
            ToolFormat::Llama3Json => {
                self.release(self.buf.len(), out);
                return false;
            }
        };
        match self.buf.find(marker) {
            Some(at) => {
                self.release(at, out);
                self.pos = marker.len();
                self.state = match self.format {
                    ToolFormat::Glm => State::Call(Box::new(Reader::Glm(GlmCall::new())), Group::Single),
                    ToolFormat::Mistral => State::MistralOpen,
                    _ => State::Call(Box::new(Reader::Json(JsonCall::new())), Group::CloseTag),
                };
                true
            }
            None => {
                let keep = if at_end { 0 } else { partial_suffix(&self.buf, marker) };
                self.release(self.buf.len() - keep, out);
                false
            }
        }
    }

    fn read_call(&mut self, mut reader: Box<Reader>, group: Group, at_end: bool, out: &mut Vec<Piece>) -> bool {
        let mut released = Vec::new();
        let mut progress = reader.advance(&self.buf, &mut self.pos, &self.tools, &mut released);
        if progress == Progress::NeedMore && at_end {
            progress = reader.finish(&self.buf, &mut self.pos, &self.tools, &mut released);
        }
        self.emit(released, out);
        match progress {
            Progress::NeedMore => {
                self.state = State::Call(reader, group);
                false
            }
            Progress::Done => {
                out.push(Piece::Call(CallEvent::End { index: self.calls - 1, whole: true }));
                self.buf.drain(..self.pos);
                self.pos = 0;
                self.state = match group {
                    Group::Single => {
                        self.after_call = true;
                        State::Scan
                    }
                    g => State::Between(g),
                };
                true
            }
            Progress::Fault => {
                self.fault(&mut reader, out);
                true
            }
        }
    }

    fn emit(&mut self, released: Vec<CallOut>, out: &mut Vec<Piece>) {
        for r in released {
            match r {
                CallOut::Header(name) => {
                    self.at_start = false;
                    out.push(Piece::Call(CallEvent::Start { index: self.calls, id: call_id(), name }));
                    self.calls += 1;
                }
                CallOut::Args(text) if !text.is_empty() => {
                    out.push(Piece::Call(CallEvent::Arguments { index: self.calls - 1, text }));
                }
                CallOut::Args(_) => {}
            }
        }
    }

    /// The call is not what it looked like (see the module doc).
    fn fault(&mut self, reader: &mut Reader, out: &mut Vec<Piece>) {
        if reader.header_sent() {
            let index = self.calls - 1;
            let seal = reader.seal();
            if !seal.is_empty() {
                out.push(Piece::Call(CallEvent::Arguments { index, text: seal }));
            }
            out.push(Piece::Call(CallEvent::End { index, whole: false }));
        }
        // At least one character, so the same text is never read as the same call again.
        let first = self.buf.chars().next().map_or(0, char::len_utf8);
        self.release(self.pos.max(first), out);
        self.pos = 0;
        self.after_call = false;
        self.state = State::Scan;
    }

    /// After a complete call: its group's separator and the next call, or back to content.
    /// What is held at the end of the reply (whitespace, separators, a partial closing tag) is
    /// markup and dropped.
    fn between(&mut self, group: Group, at_end: bool) -> bool {
        let t = self.buf.trim_start();
        let lead = self.buf.len() - t.len();
        let next_call = |this: &mut Self, at: usize, group: Group| {
            this.buf.drain(..at);
            this.pos = 0;
            this.state = State::Call(Box::new(Reader::Json(JsonCall::new())), group);
            true
        };
        let hold = |this: &mut Self, group: Group| {
            if at_end {
                this.buf.clear();
            } else {
                this.state = State::Between(group);
            }
            false
        };
        match group {
            Group::CloseTag if t.starts_with(TAG_CLOSE) => {
                self.buf.drain(..lead + TAG_CLOSE.len());
            }
            Group::CloseTag if TAG_CLOSE.starts_with(t) => return hold(self, group),
            Group::Semicolon => {
                let rest = t.trim_start_matches(|c: char| c == ';' || c.is_whitespace());
                let at = self.buf.len() - rest.len();
                if rest.starts_with('{') {
                    return next_call(self, at, group);
                }
                if rest.is_empty() {
                    return hold(self, group);
                }
            }
            Group::List => {
                if let Some(after) = t.strip_prefix(',') {
                    let rest = after.trim_start();
                    if rest.starts_with('{') {
                        let at = self.buf.len() - rest.len();
                        return next_call(self, at, group);
                    }
                    if rest.is_empty() {
                        return hold(self, group);
                    }
                } else if t.starts_with(']') {
                    self.buf.drain(..lead + 1);
                } else if t.is_empty() {
                    return hold(self, group);
                }
            }
            Group::CloseTag | Group::Single => {}
        }
        // Whatever else follows is content.
        self.after_call = true;
        self.state = State::Scan;
        true
    }

    fn mistral_open(&mut self, at_end: bool, out: &mut Vec<Piece>) -> bool {
        let t = self.buf[self.pos..].trim_start();
        if t.is_empty() && !at_end {
            self.state = State::MistralOpen;
            return false;
        }
        if t.starts_with('[') {
            self.pos = self.buf.len() - t.len() + 1;
            self.state = State::Call(Box::new(Reader::Json(JsonCall::new())), Group::List);
        } else if t.is_empty() {
            self.fault(&mut Reader::Named(NamedCall::new()), out);
        } else {
            self.state = State::Call(Box::new(Reader::Named(NamedCall::new())), Group::Single);
        }
        true
    }

    fn release(&mut self, upto: usize, out: &mut Vec<Piece>) {
        if upto == 0 {
            return;
        }
        let text: String = self.buf.drain(..upto).collect();
        self.at_start = false;
        out.push(Piece::Content(text));
    }
}

/// A fresh `call_…` id.
pub fn call_id() -> String {
    format!("call_{:024x}", rand::random::<u128>() >> 32)
}

#[cfg(test)]
#[path = "parse_tests.rs"]
mod tests;
