//! A call's arguments as they stream: [`ArgsWriter`], the one serialiser that both the streamed
//! pieces and the non-streamed `arguments` string are made of, and the incremental readers of
//! the call syntaxes ([`JsonCall`] for `{"name": …, "arguments": {…}}`, [`JsonArgs`] for a bare
//! arguments object, [`GlmCall`] for `name<arg_key>k</arg_key><arg_value>v</arg_value>…`,
//! [`NamedCall`] for Mistral's `name[ARGS]{…}`).
//!
//! The arguments string is the model's object re-serialised compactly (serde_json's compact
//! form: `{"k":v,"k2":v2}`), keys in the order written, each value typed by the tool's schema
//! ([`type_argument`]). A value is released once it is complete, so every finished top-level
//! argument is a piece (`{"city":"Oslo"`, `,"days":3`, then `}`); a value that stays a string
//! under the schema is released as it is written (JSON-escaped text, cut only between whole
//! escapes), so a long string argument streams too. A key written twice is passed on twice
//! (JSON readers keep the last).
//!
//! A reader works on the parser's buffer, which holds the call's raw text from its opening
//! marker: it moves a cursor over what it has read and stops with [`Progress`]. On a fault the
//! cursor is where reading failed, and [`JsonCall::seal`] / [`GlmCall::seal`] give the text that
//! closes what was already released into a valid object.

use serde_json::{Map, Value};

use super::{string_stays_string, type_argument, ToolSpec};
use crate::api::reasoning::partial_suffix;

/// Where a reader stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Progress {
    /// Everything there was is read; more text is needed.
    NeedMore,
    /// The call (or arguments object) is complete; the cursor is just past it.
    Done,
    /// The text is not a call of an offered tool; the cursor is where reading failed.
    Fault,
}

/// What a reader releases.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum CallOut {
    /// The call's name is complete and names an offered tool.
    Header(String),
    /// The next piece of the arguments string.
    Args(String),
}

/// Writes a call's arguments as one compact JSON object, a piece at a time.
#[derive(Clone, Debug, Default)]
pub struct ArgsWriter {
    members: usize,
    in_string: bool,
}

impl ArgsWriter {
    fn lead(&mut self) -> &'static str {
        self.members += 1;
        if self.members == 1 {
            "{"
        } else {
            ","
        }
    }

    /// `{"key":value` for the first member, `,"key":value` after.
    pub fn member(&mut self, key: &str, value: &Value) -> String {
        format!("{}{}:{value}", self.lead(), json_string(key))
    }

    /// The start of a string member, up to its opening quote.
    pub fn open_string(&mut self, key: &str) -> String {
        self.in_string = true;
        format!("{}{}:\"", self.lead(), json_string(key))
    }

    /// Text of the open string member, escaped. Escaping is per character, so the pieces of a
    /// string escape to the escaped whole.
    pub fn string_text(&self, text: &str) -> String {
        let quoted = json_string(text);
        quoted[1..quoted.len() - 1].to_owned()
    }

    pub fn close_string(&mut self) -> String {
        self.in_string = false;
        "\"".to_owned()
    }

    /// What ends the object: an open string's quote, `{` when nothing was written, `}`.
    pub fn close(&mut self) -> String {
        let mut s = String::new();
        if std::mem::take(&mut self.in_string) {
            s.push('"');
        }
        if self.members == 0 {
            s.push('{');
        }
        s.push('}');
        s
    }
}

/// The arguments string of a whole object (typed already), as the pieces would spell it.
pub fn arguments_json(args: &Map<String, Value>) -> String {
    let mut w = ArgsWriter::default();
    let mut s: String = args.iter().map(|(k, v)| w.member(k, v)).collect();
    s.push_str(&w.close());
    s
}

fn json_string(s: &str) -> String {
    Value::from(s).to_string()
}

// ------------------------------------------------------------------ JSON scanning

fn skip_ws(text: &str, pos: &mut usize) {
    let rest = &text[*pos..];
    *pos += rest.len() - rest.trim_start().len();
}

/// The byte after the JSON string that starts at `pos` (a `"`), once it is complete.
fn string_end(text: &str, pos: usize) -> Option<usize> {
    let b = text.as_bytes();
    let mut i = pos + 1;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'"' => return Some(i + 1),
            _ => i += 1,
        }
    }
    None
}

/// The byte after the JSON value that starts at `pos`, once it is complete (a scalar is complete
/// at the character after it). Validity is left to serde_json.
fn value_end(text: &str, pos: usize) -> Option<usize> {
    let b = text.as_bytes();
    match b[pos] {
        b'"' => string_end(text, pos),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut i = pos;
            while i < b.len() {
                match b[i] {
                    b'"' => {
                        i = string_end(text, i)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
            None
        }
        _ => (pos..b.len()).find(|&i| matches!(b[i], b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')),
    }
}

/// The complete value at `pos`: `Ok(None)` while incomplete, `Err` when it is not JSON.
fn read_value(text: &str, pos: &mut usize) -> Result<Option<Value>, ()> {
    let Some(end) = value_end(text, *pos) else { return Ok(None) };
    let v = serde_json::from_str(&text[*pos..end]).map_err(|_| ())?;
    *pos = end;
    Ok(Some(v))
}

/// The length of the unit of JSON string text at `i`: a character, an escape, or the two
/// escapes of a surrogate pair; `None` while it is incomplete. Broken escapes count as units
/// too (serde_json refuses them when they are decoded).
fn unit_len(text: &str, i: usize) -> Option<usize> {
    let b = text.as_bytes();
    if b[i] != b'\\' {
        return text[i..].chars().next().map(char::len_utf8);
    }
    let need = match b.get(i + 1)? {
        b'u' => {
            let high = text
                .get(i + 2..i + 6)
                .and_then(|h| u16::from_str_radix(h, 16).ok())
                .is_some_and(|h| (0xD800..0xDC00).contains(&h));
            match text.get(i + 6..i + 8) {
                Some("\\u") if high => 12,
                None if high && b.len() < i + 8 => return None,
                _ => 6,
            }
        }
        _ => 2,
    };
    if i + need > b.len() {
        return None;
    }
    let mut end = i + need;
    while !text.is_char_boundary(end) {
        end += 1;
    }
    Some(end - i)
}

/// How far the string text from `pos` (inside a JSON string) can be decoded now: whole units up
/// to the closing quote or the end. Returns (end of the decodable text, whether the closing
/// quote is there).
fn string_safe_end(text: &str, pos: usize) -> (usize, bool) {
    let mut i = pos;
    while i < text.len() {
        if text.as_bytes()[i] == b'"' {
            return (i, true);
        }
        match unit_len(text, i) {
            Some(n) => i += n,
            None => return (i, false),
        }
    }
    (i, false)
}

fn decode_string_text(raw: &str) -> Option<String> {
    serde_json::from_str(&format!("\"{raw}\"")).ok()
}

// ------------------------------------------------------------------ readers

/// A bare JSON arguments object, streamed member by member.
#[derive(Clone, Debug)]
pub(super) struct JsonArgs {
    state: ArgsState,
    writer: ArgsWriter,
    schema: Value,
}

#[derive(Clone, Debug)]
enum ArgsState {
    Open,
    FirstKey,
    Key,
    Colon(String),
    Value(String),
    InString,
    Separator,
}

impl JsonArgs {
    pub fn new(schema: Value) -> Self {
        Self { state: ArgsState::Open, writer: ArgsWriter::default(), schema }
    }

    pub fn advance(&mut self, text: &str, pos: &mut usize, out: &mut Vec<CallOut>) -> Progress {
        let mut emit = |s: String| {
            if !s.is_empty() {
                out.push(CallOut::Args(s));
            }
        };
        loop {
            if !matches!(self.state, ArgsState::InString) {
                skip_ws(text, pos);
                if *pos == text.len() {
                    return Progress::NeedMore;
                }
            }
            let c = text.as_bytes().get(*pos).copied();
            match std::mem::replace(&mut self.state, ArgsState::Open) {
                ArgsState::Open if c == Some(b'{') => {
                    *pos += 1;
                    self.state = ArgsState::FirstKey;
                }
                ArgsState::FirstKey if c == Some(b'}') => {
                    *pos += 1;
                    emit(self.writer.close());
                    return Progress::Done;
                }
                ArgsState::FirstKey | ArgsState::Key if c == Some(b'"') => match read_value(text, pos) {
                    Ok(None) => {
                        self.state = ArgsState::Key;
                        return Progress::NeedMore;
                    }
                    Ok(Some(Value::String(key))) => self.state = ArgsState::Colon(key),
                    _ => return Progress::Fault,
                },
                ArgsState::Colon(key) if c == Some(b':') => {
                    *pos += 1;
                    self.state = ArgsState::Value(key);
                }
                ArgsState::Value(key) => {
                    if c == Some(b'"') && string_stays_string(Some(&self.schema), &key) {
                        *pos += 1;
                        emit(self.writer.open_string(&key));
                        self.state = ArgsState::InString;
                        continue;
                    }
                    match read_value(text, pos) {
                        Ok(None) => {
                            self.state = ArgsState::Value(key);
                            return Progress::NeedMore;
                        }
                        Ok(Some(v)) => {
                            let typed = type_argument(Some(&self.schema), &key, v);
                            emit(self.writer.member(&key, &typed));
                            self.state = ArgsState::Separator;
                        }
                        Err(()) => return Progress::Fault,
                    }
                }
                ArgsState::InString => {
                    let (end, closed) = string_safe_end(text, *pos);
                    if end > *pos {
                        let Some(s) = decode_string_text(&text[*pos..end]) else {
                            // Release the units before the bad one, so that where the text
                            // was cut does not change what is released.
                            while let Some(n) = unit_len(text, *pos).filter(|n| *pos + n <= end) {
                                let Some(s) = decode_string_text(&text[*pos..*pos + n]) else { break };
                                emit(self.writer.string_text(&s));
                                *pos += n;
                            }
                            self.state = ArgsState::InString;
                            return Progress::Fault;
                        };
                        emit(self.writer.string_text(&s));
                        *pos = end;
                    }
                    if !closed {
                        self.state = ArgsState::InString;
                        return Progress::NeedMore;
                    }
                    *pos += 1;
                    emit(self.writer.close_string());
                    self.state = ArgsState::Separator;
                }
                ArgsState::Separator if c == Some(b',') => {
                    *pos += 1;
                    self.state = ArgsState::Key;
                }
                ArgsState::Separator if c == Some(b'}') => {
                    *pos += 1;
                    emit(self.writer.close());
                    return Progress::Done;
                }
                _ => return Progress::Fault,
            }
        }
    }

    /// What closes the pieces released so far into a valid object.
    pub fn seal(&mut self) -> String {
        self.writer.close()
    }
}

/// `{"name": …, "arguments" | "parameters": {…}}` (Hermes / Qwen, Llama 3, Mistral's list).
#[derive(Clone, Debug)]
pub(super) struct JsonCall {
    state: CallState,
    /// The offered tool's name and schema, once the name is read.
    tool: Option<(String, Value)>,
    args: Option<JsonArgs>,
    /// Arguments written before the name: released whole once the name comes.
    early_args: Option<Value>,
    args_seen: bool,
    args_done: bool,
}

#[derive(Clone, Debug)]
enum CallState {
    Open,
    FirstKey,
    Key,
    Colon(String),
    Value(String),
    Args,
    Separator,
}

impl JsonCall {
    pub fn new() -> Self {
        Self { state: CallState::Open, tool: None, args: None, early_args: None, args_seen: false, args_done: false }
    }

    pub fn header_sent(&self) -> bool {
        self.tool.is_some()
    }

    pub fn advance(&mut self, text: &str, pos: &mut usize, tools: &[ToolSpec], out: &mut Vec<CallOut>) -> Progress {
        loop {
            if let CallState::Args = self.state {
                let Some(args) = self.args.as_mut() else { return Progress::Fault };
                match args.advance(text, pos, out) {
                    Progress::Done => {
                        self.args_done = true;
                        self.state = CallState::Separator;
                    }
                    other => return other,
                }
                continue;
            }
            skip_ws(text, pos);
            if *pos == text.len() {
                return Progress::NeedMore;
            }
            let c = text.as_bytes()[*pos];
            match std::mem::replace(&mut self.state, CallState::Open) {
                CallState::Open if c == b'{' => {
                    *pos += 1;
                    self.state = CallState::FirstKey;
                }
                CallState::FirstKey | CallState::Key if c == b'"' => match read_value(text, pos) {
                    Ok(None) => {
                        self.state = CallState::Key;
                        return Progress::NeedMore;
                    }
                    Ok(Some(Value::String(key))) => self.state = CallState::Colon(key),
                    _ => return Progress::Fault,
                },
                CallState::Colon(key) if c == b':' => {
                    *pos += 1;
                    self.state = CallState::Value(key);
                }
                CallState::Value(key) => {
                    let is_args = key == "arguments" || key == "parameters";
                    if is_args && self.args_seen || key == "name" && self.tool.is_some() {
                        return Progress::Fault;
                    }
                    if is_args && c == b'{' {
                        if let Some((_, schema)) = &self.tool {
                            self.args_seen = true;
                            self.args = Some(JsonArgs::new(schema.clone()));
                            self.state = CallState::Args;
                            continue;
                        }
                    }
                    let at = *pos;
                    let v = match read_value(text, pos) {
                        Ok(Some(v)) => v,
                        Ok(None) => {
                            self.state = CallState::Value(key);
                            return Progress::NeedMore;
                        }
                        Err(()) => return Progress::Fault,
                    };
                    if key == "name" {
                        let Some(tool) = v.as_str().and_then(|n| tools.iter().find(|t| t.name == n)) else {
                            *pos = at;
                            return Progress::Fault;
                        };
                        out.push(CallOut::Header(tool.name.clone()));
                        self.tool = Some((tool.name.clone(), tool.parameters.clone()));
                        if let Some(early) = self.early_args.take() {
                            if !self.release_whole(early, out) {
                                return Progress::Fault;
                            }
                        }
                    } else if is_args {
                        self.args_seen = true;
                        if self.tool.is_some() {
                            if !self.release_whole(v, out) {
                                *pos = at;
                                return Progress::Fault;
                            }
                        } else {
                            self.early_args = Some(v);
                        }
                    }
                    self.state = CallState::Separator;
                }
                CallState::Separator if c == b',' => {
                    *pos += 1;
                    self.state = CallState::Key;
                }
                CallState::Separator if c == b'}' => {
                    if self.tool.is_none() {
                        return Progress::Fault;
                    }
                    *pos += 1;
                    if !self.args_done {
                        self.args_done = true;
                        out.push(CallOut::Args("{}".to_owned()));
                    }
                    return Progress::Done;
                }
                _ => return Progress::Fault,
            }
        }
    }

    /// Arguments given whole (an object, a JSON string holding one, or null): typed and
    /// released as one piece. `false` when they are not an object.
    fn release_whole(&mut self, v: Value, out: &mut Vec<CallOut>) -> bool {
        let Some((_, schema)) = &self.tool else { return false };
        let args = match v {
            Value::Null => Map::new(),
            Value::Object(m) => m,
            Value::String(s) if s.trim().is_empty() => Map::new(),
            Value::String(s) => match serde_json::from_str::<Value>(&s) {
                Ok(Value::Object(m)) => m,
                _ => return false,
            },
            _ => return false,
        };
        let typed: Map<String, Value> =
            args.into_iter().map(|(k, v)| (k.clone(), type_argument(Some(schema), &k, v))).collect();
        out.push(CallOut::Args(arguments_json(&typed)));
        self.args_done = true;
        true
    }

    /// What closes the released arguments after a fault (empty when they are complete).
    pub fn seal(&mut self) -> String {
        if self.args_done {
            return String::new();
        }
        self.args_done = true;
        match self.args.as_mut() {
            Some(args) => args.seal(),
            None => "{}".to_owned(),
        }
    }
}

const ARG_KEY: &str = "<arg_key>";
const ARG_KEY_CLOSE: &str = "</arg_key>";
const ARG_VALUE: &str = "<arg_value>";
const ARG_VALUE_CLOSE: &str = "</arg_value>";
pub(super) const TAG_CLOSE: &str = "</tool_call>";

/// GLM's call body after `<tool_call>`: `name`, then `<arg_key>k</arg_key><arg_value>v</arg_value>`
/// pairs (whitespace between parts allowed), then `</tool_call>`. Values are text; the schema
/// types them. A value runs to its `</arg_value>`, whatever it holds.
#[derive(Clone, Debug)]
pub(super) struct GlmCall {
    state: GlmState,
    writer: ArgsWriter,
    schema: Option<Value>,
    done: bool,
}

#[derive(Clone, Debug)]
enum GlmState {
    Name,
    BeforeKey,
    Key,
    BeforeValue(String),
    Value(String),
    InString,
}

/// Where `marker` starts in `text[pos..]` after whitespace: `Some(true)` it is there,
/// `Some(false)` the text so far could still become it, `None` it is not.
fn marker_after_ws(text: &str, pos: usize, marker: &str) -> Option<bool> {
    let rest = text[pos..].trim_start();
    if rest.starts_with(marker) {
        Some(true)
    } else if marker.starts_with(rest) {
        Some(false)
    } else {
        None
    }
}

impl GlmCall {
    pub fn new() -> Self {
        Self { state: GlmState::Name, writer: ArgsWriter::default(), schema: None, done: false }
    }

    pub fn header_sent(&self) -> bool {
        self.schema.is_some()
    }

    fn name(&mut self, name: &str, tools: &[ToolSpec], out: &mut Vec<CallOut>) -> bool {
        let name = name.trim();
        let Some(tool) = tools.iter().find(|t| t.name == name) else { return false };
        out.push(CallOut::Header(tool.name.clone()));
        self.schema = Some(tool.parameters.clone());
        self.state = GlmState::BeforeKey;
        true
    }

    fn close(&mut self, out: &mut Vec<CallOut>) -> Progress {
        self.done = true;
        out.push(CallOut::Args(self.writer.close()));
        Progress::Done
    }

    pub fn advance(&mut self, text: &str, pos: &mut usize, tools: &[ToolSpec], out: &mut Vec<CallOut>) -> Progress {
        loop {
            let rest = &text[*pos..];
            match std::mem::replace(&mut self.state, GlmState::Name) {
                GlmState::Name => {
                    let end = [rest.find(ARG_KEY), rest.find(TAG_CLOSE)].into_iter().flatten().min();
                    let Some(end) = end else { return Progress::NeedMore };
                    if !self.name(&rest[..end], tools, out) {
                        return Progress::Fault;
                    }
                    *pos += end;
                }
                GlmState::BeforeKey => {
                    let close = marker_after_ws(text, *pos, TAG_CLOSE);
                    let key = marker_after_ws(text, *pos, ARG_KEY);
                    self.state = GlmState::BeforeKey;
                    if close == Some(true) {
                        skip_ws(text, pos);
                        *pos += TAG_CLOSE.len();
                        return self.close(out);
                    }
                    match key {
                        Some(true) => {
                            skip_ws(text, pos);
                            *pos += ARG_KEY.len();
                            self.state = GlmState::Key;
                        }
                        Some(false) => return Progress::NeedMore,
                        None if close == Some(false) => return Progress::NeedMore,
                        None => {
                            skip_ws(text, pos);
                            return Progress::Fault;
                        }
                    }
                }
                GlmState::Key => {
                    let Some(end) = rest.find(ARG_KEY_CLOSE) else {
                        self.state = GlmState::Key;
                        return Progress::NeedMore;
                    };
                    self.state = GlmState::BeforeValue(rest[..end].trim().to_owned());
                    *pos += end + ARG_KEY_CLOSE.len();
                }
                GlmState::BeforeValue(key) => match marker_after_ws(text, *pos, ARG_VALUE) {
                    Some(true) => {
                        skip_ws(text, pos);
                        *pos += ARG_VALUE.len();
                        if string_stays_string(self.schema.as_ref(), &key) {
                            out.push(CallOut::Args(self.writer.open_string(&key)));
                            self.state = GlmState::InString;
                        } else {
                            self.state = GlmState::Value(key);
                        }
                    }
                    Some(false) => {
                        self.state = GlmState::BeforeValue(key);
                        return Progress::NeedMore;
                    }
                    None => {
                        skip_ws(text, pos);
                        return Progress::Fault;
                    }
                },
                GlmState::Value(key) => {
                    let Some(end) = rest.find(ARG_VALUE_CLOSE) else {
                        self.state = GlmState::Value(key);
                        return Progress::NeedMore;
                    };
                    let typed = type_argument(self.schema.as_ref(), &key, Value::String(rest[..end].to_owned()));
                    out.push(CallOut::Args(self.writer.member(&key, &typed)));
                    *pos += end + ARG_VALUE_CLOSE.len();
                    self.state = GlmState::BeforeKey;
                }
                GlmState::InString => {
                    let (end, closed) = match rest.find(ARG_VALUE_CLOSE) {
                        Some(end) => (end, true),
                        None => (rest.len() - partial_suffix(rest, ARG_VALUE_CLOSE), false),
                    };
                    if end > 0 {
                        out.push(CallOut::Args(self.writer.string_text(&rest[..end])));
                    }
                    *pos += end;
                    if !closed {
                        self.state = GlmState::InString;
                        return Progress::NeedMore;
                    }
                    *pos += ARG_VALUE_CLOSE.len();
                    out.push(CallOut::Args(self.writer.close_string()));
                    self.state = GlmState::BeforeKey;
                }
            }
        }
    }

    /// The end of the reply inside the call: a call whose last part is complete is complete
    /// (a forced call's `</tool_call>` is a stop string, cut from the text); otherwise a fault.
    pub fn finish(&mut self, text: &str, pos: &mut usize, tools: &[ToolSpec], out: &mut Vec<CallOut>) -> Progress {
        match self.state {
            GlmState::Name => {
                if !self.name(&text[*pos..], tools, out) {
                    return Progress::Fault;
                }
                *pos = text.len();
                self.close(out)
            }
            GlmState::BeforeKey if TAG_CLOSE.starts_with(text[*pos..].trim()) => {
                *pos = text.len();
                self.close(out)
            }
            _ => Progress::Fault,
        }
    }

    pub fn seal(&mut self) -> String {
        if std::mem::replace(&mut self.done, true) {
            return String::new();
        }
        self.writer.close()
    }
}

/// Mistral's `name[ARGS]{…}` after `[TOOL_CALLS]`.
#[derive(Clone, Debug)]
pub(super) struct NamedCall {
    args: Option<JsonArgs>,
    done: bool,
}

pub(super) const MISTRAL_ARGS: &str = "[ARGS]";

impl NamedCall {
    pub fn new() -> Self {
        Self { args: None, done: false }
    }

    pub fn header_sent(&self) -> bool {
        self.args.is_some()
    }

    pub fn advance(&mut self, text: &str, pos: &mut usize, tools: &[ToolSpec], out: &mut Vec<CallOut>) -> Progress {
        if self.args.is_none() {
            let rest = &text[*pos..];
            let Some(end) = rest.find(MISTRAL_ARGS) else { return Progress::NeedMore };
            let name = rest[..end].trim();
            let Some(tool) = tools.iter().find(|t| t.name == name) else { return Progress::Fault };
            out.push(CallOut::Header(tool.name.clone()));
            self.args = Some(JsonArgs::new(tool.parameters.clone()));
            *pos += end + MISTRAL_ARGS.len();
        }
        let Some(args) = self.args.as_mut() else { return Progress::Fault };
        let progress = args.advance(text, pos, out);
        self.done = progress == Progress::Done;
        progress
    }

    pub fn seal(&mut self) -> String {
        match self.args.as_mut() {
            Some(args) if !std::mem::replace(&mut self.done, true) => args.seal(),
            _ => String::new(),
        }
    }
}
