//! The streaming tool-call parser: text in (the answer part of the reply, after the reasoning
//! split), content and complete calls out. Text that might be the start of a call marker is held
//! back until it resolves; a call is released once it is complete (its closing marker, or the end
//! of the reply for formats without one), with arguments as a JSON object typed by the tool's
//! schema. Text that looked like a call but does not parse is given back as content, never lost.

use serde_json::{Map, Value};

use super::{type_arguments, ToolFormat, ToolSpec};
use crate::api::reasoning::partial_suffix;

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_OPEN: &str = "[TOOL_CALLS]";
const MISTRAL_ARGS: &str = "[ARGS]";
const PYTHON_TAG: &str = "<|python_tag|>";

/// One parsed call, arguments serialised as OpenAI sends them (a JSON string).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// What one push released, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Content(String),
    Call(ToolCall),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Looking for the start of a call.
    Scan,
    /// Inside a call that ends with `</tool_call>`.
    InTagged,
    /// Inside calls that run to the end of the reply (Mistral, Llama 3).
    ToEnd,
}

pub struct ToolCallParser {
    format: ToolFormat,
    tools: Vec<ToolSpec>,
    state: State,
    buf: String,
    /// Nothing but whitespace has been released yet (Llama 3 calls start the reply).
    at_start: bool,
    /// The last release was a call: whitespace before the next text is dropped.
    after_call: bool,
}

impl ToolCallParser {
    pub fn new(format: ToolFormat, tools: Vec<ToolSpec>) -> Self {
        Self { format, tools, state: State::Scan, buf: String::new(), at_start: true, after_call: false }
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                State::ToEnd => return out,
                State::InTagged => match self.buf.find(HERMES_CLOSE) {
                    Some(at) => {
                        let body = self.buf[..at].to_owned();
                        self.buf.drain(..at + HERMES_CLOSE.len());
                        self.state = State::Scan;
                        self.release_tagged(&body, true, &mut out);
                    }
                    None => return out,
                },
                State::Scan => {
                    if self.after_call || self.at_start {
                        let trimmed = self.buf.trim_start().len();
                        if trimmed == 0 {
                            return out;
                        }
                        if self.after_call {
                            self.buf.drain(..self.buf.len() - trimmed);
                            self.after_call = false;
                        }
                    }
                    if self.at_start && self.format == ToolFormat::Llama3Json {
                        let t = self.buf.trim_start();
                        if t.starts_with('{') || t.starts_with(PYTHON_TAG) {
                            self.state = State::ToEnd;
                            continue;
                        }
                        if PYTHON_TAG.starts_with(t) {
                            return out;
                        }
                    }
                    let marker = match self.format {
                        ToolFormat::Hermes | ToolFormat::Glm => HERMES_OPEN,
                        ToolFormat::Mistral => MISTRAL_OPEN,
                        ToolFormat::Llama3Json => {
                            self.release_content(self.buf.len(), &mut out);
                            return out;
                        }
                    };
                    match self.buf.find(marker) {
                        Some(at) => {
                            self.release_content(at, &mut out);
                            if self.format == ToolFormat::Mistral {
                                self.state = State::ToEnd;
                            } else {
                                self.buf.drain(..marker.len());
                                self.state = State::InTagged;
                            }
                        }
                        None => {
                            let keep = partial_suffix(&self.buf, marker);
                            self.release_content(self.buf.len() - keep, &mut out);
                            return out;
                        }
                    }
                }
            }
        }
    }

    /// End of the reply: a call without its closing marker is parsed as it stands; what does
    /// not parse is content.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        match self.state {
            State::Scan => {
                if !(rest.is_empty() || self.after_call && rest.trim().is_empty()) {
                    out.push(Piece::Content(rest));
                }
            }
            State::InTagged => self.release_tagged(&rest, false, &mut out),
            State::ToEnd => {
                let parsed = match self.format {
                    ToolFormat::Mistral => parse_mistral(&rest),
                    _ => parse_llama3(&rest),
                };
                match parsed {
                    Some(calls) if !calls.is_empty() => {
                        for (name, args) in calls {
                            out.push(self.call(name, args));
                        }
                    }
                    _ => out.push(Piece::Content(rest)),
                }
            }
        }
        self.state = State::Scan;
        out
    }

    fn release_content(&mut self, upto: usize, out: &mut Vec<Piece>) {
        if upto == 0 {
            return;
        }
        let text: String = self.buf.drain(..upto).collect();
        self.at_start = false;
        out.push(Piece::Content(text));
    }

    fn release_tagged(&mut self, body: &str, closed: bool, out: &mut Vec<Piece>) {
        let parsed = match self.format {
            ToolFormat::Glm => parse_glm(body),
            _ => parse_json_call(body.trim()),
        };
        match parsed {
            Some((name, args)) => {
                let piece = self.call(name, args);
                out.push(piece);
                self.after_call = true;
            }
            None => {
                let close = if closed { HERMES_CLOSE } else { "" };
                out.push(Piece::Content(format!("{HERMES_OPEN}{body}{close}")));
            }
        }
        self.at_start = false;
    }

    fn call(&mut self, name: String, mut args: Map<String, Value>) -> Piece {
        let schema = self.tools.iter().find(|t| t.name == name).map(|t| &t.parameters);
        type_arguments(&mut args, schema);
        self.at_start = false;
        Piece::Call(ToolCall { id: call_id(), name, arguments: Value::Object(args).to_string() })
    }
}

/// A fresh `call_…` id.
pub fn call_id() -> String {
    format!("call_{:024x}", rand::random::<u128>() >> 32)
}

/// `{"name": …, "arguments"|"parameters": {…} or "<json>"}`.
fn json_call(v: &Value) -> Option<(String, Map<String, Value>)> {
    let obj = v.as_object()?;
    let name = obj.get("name")?.as_str()?.to_owned();
    let args = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(Value::String(s)) if s.trim().is_empty() => Map::new(),
        Some(Value::String(s)) => serde_json::from_str::<Value>(s).ok()?.as_object()?.clone(),
        Some(_) => return None,
    };
    Some((name, args))
}

fn parse_json_call(body: &str) -> Option<(String, Map<String, Value>)> {
    json_call(&serde_json::from_str(body).ok()?)
}

/// `name<arg_key>k</arg_key><arg_value>v</arg_value>…` (newlines between parts allowed); values
/// are text, typed later by the schema.
fn parse_glm(body: &str) -> Option<(String, Map<String, Value>)> {
    let (name, mut rest) = match body.find("<arg_key>") {
        Some(at) => (body[..at].trim(), &body[at..]),
        None => (body.trim(), ""),
    };
    if name.is_empty() || name.contains(char::is_whitespace) || name.contains('<') {
        return None;
    }
    let mut args = Map::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let after_key = rest.strip_prefix("<arg_key>")?;
        let key_end = after_key.find("</arg_key>")?;
        let key = after_key[..key_end].trim();
        let after = after_key[key_end + "</arg_key>".len()..].trim_start();
        let after_val = after.strip_prefix("<arg_value>")?;
        let val_end = after_val.find("</arg_value>")?;
        args.insert(key.to_owned(), Value::String(after_val[..val_end].to_owned()));
        rest = &after_val[val_end + "</arg_value>".len()..];
    }
    Some((name.to_owned(), args))
}

/// One or more JSON calls, optionally after `<|python_tag|>`, separated by `;` or whitespace.
fn parse_llama3(text: &str) -> Option<Vec<(String, Map<String, Value>)>> {
    let mut rest = text.trim_start();
    rest = rest.strip_prefix(PYTHON_TAG).unwrap_or(rest);
    let mut calls = Vec::new();
    loop {
        rest = rest.trim_start().trim_start_matches(';').trim_start();
        if rest.is_empty() {
            return Some(calls);
        }
        let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let v = stream.next()?.ok()?;
        calls.push(json_call(&v)?);
        rest = &rest[stream.byte_offset()..];
    }
}

/// `[TOOL_CALLS][{…}, …]` or `[TOOL_CALLS]name[ARGS]{…}` (repeated).
fn parse_mistral(text: &str) -> Option<Vec<(String, Map<String, Value>)>> {
    let mut calls = Vec::new();
    for part in text.split(MISTRAL_OPEN).map(str::trim).filter(|p| !p.is_empty()) {
        if part.starts_with('[') {
            let list: Vec<Value> = serde_json::from_str(part).ok()?;
            for v in &list {
                calls.push(json_call(v)?);
            }
        } else {
            let (name, args) = part.split_once(MISTRAL_ARGS)?;
            let args = serde_json::from_str::<Value>(args.trim()).ok()?.as_object()?.clone();
            calls.push((name.trim().to_owned(), args));
        }
    }
    Some(calls)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools() -> Vec<ToolSpec> {
        vec![
            ToolSpec {
                name: "get_weather".into(),
                description: None,
                parameters: json!({"type": "object", "properties": {"location": {"type": "string"},
                    "unit": {"type": "string"}, "days": {"type": "integer"}}}),
            },
            ToolSpec { name: "get_time".into(), description: None, parameters: json!({}) },
        ]
    }

    /// (content, [(name, arguments as JSON)]) of `text` fed whole, and checked to be the same
    /// fed in two pieces at every cut and character by character.
    fn parse(format: ToolFormat, text: &str) -> (String, Vec<(String, Value)>) {
        let run = |pieces: &[&str]| {
            let mut p = ToolCallParser::new(format, tools());
            let mut out = Vec::new();
            for s in pieces {
                out.extend(p.push(s));
            }
            out.extend(p.finish());
            let mut content = String::new();
            let mut calls = Vec::new();
            for piece in out {
                match piece {
                    Piece::Content(c) => content.push_str(&c),
                    Piece::Call(c) => {
                        assert!(c.id.starts_with("call_") && c.id.len() == 29, "{}", c.id);
                        calls.push((c.name, serde_json::from_str::<Value>(&c.arguments).unwrap()));
                    }
                }
            }
            (content, calls)
        };
        let whole = run(&[text]);
        for i in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
            assert_eq!(run(&[&text[..i], &text[i..]]), whole, "cut at {i}");
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        assert_eq!(run(&chars.iter().map(String::as_str).collect::<Vec<_>>()), whole, "char by char");
        whole
    }

    // Golden outputs below follow the examples each family documents for its chat template.

    #[test]
    fn hermes_qwen_single_parallel_and_zero_argument_calls() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"San Francisco, CA\", \"unit\": \"celsius\"}}\n</tool_call>";
        let (content, calls) = parse(ToolFormat::Hermes, text);
        assert_eq!(content, "");
        assert_eq!(calls, vec![("get_weather".into(), json!({"location": "San Francisco, CA", "unit": "celsius"}))]);

        let text = "Let me check both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\", \"days\": \"3\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        let (content, calls) = parse(ToolFormat::Hermes, text);
        assert_eq!(content, "Let me check both.\n");
        assert_eq!(
            calls,
            vec![("get_weather".into(), json!({"location": "Paris", "days": 3})), ("get_time".into(), json!({})),]
        );
    }

    #[test]
    fn hermes_text_without_calls_and_broken_calls_stay_content() {
        let text = "Use the <tool tag> like <tool_ca... no.";
        assert_eq!(parse(ToolFormat::Hermes, text), (text.to_owned(), vec![]));
        let text = "<tool_call>\n{\"name\": oops}\n</tool_call>";
        assert_eq!(parse(ToolFormat::Hermes, text), (text.to_owned(), vec![]));
        // Max tokens before the closing tag, but the JSON is complete: still a call.
        let (_, calls) = parse(ToolFormat::Hermes, "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n");
        assert_eq!(calls.len(), 1);
        // Cut mid-JSON: given back as text.
        let (content, calls) = parse(ToolFormat::Hermes, "<tool_call>\n{\"name\": \"get_ti");
        assert_eq!((content.as_str(), calls.len()), ("<tool_call>\n{\"name\": \"get_ti", 0));
    }

    #[test]
    fn glm_calls_with_typed_arguments() {
        // GLM-4.5 writes each part on its own line; GLM-4.7 / 5 write them back to back.
        let glm45 = "I'll look it up.\n<tool_call>get_weather\n<arg_key>location</arg_key>\n<arg_value>Beijing</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>";
        let (content, calls) = parse(ToolFormat::Glm, glm45);
        assert_eq!(content, "I'll look it up.\n");
        assert_eq!(calls, vec![("get_weather".into(), json!({"location": "Beijing", "days": 2}))]);

        let glm47 = "<tool_call>get_weather<arg_key>location</arg_key><arg_value>42</arg_value></tool_call><tool_call>get_time</tool_call>";
        let (content, calls) = parse(ToolFormat::Glm, glm47);
        assert_eq!(content, "");
        // `location` is a string in the schema: "42" stays a string.
        assert_eq!(calls, vec![("get_weather".into(), json!({"location": "42"})), ("get_time".into(), json!({}))]);
    }

    #[test]
    fn llama3_json_calls() {
        let text = "{\"name\": \"get_weather\", \"parameters\": {\"location\": \"Paris\", \"days\": 2}}";
        assert_eq!(
            parse(ToolFormat::Llama3Json, text),
            (String::new(), vec![("get_weather".into(), json!({"location": "Paris", "days": 2}))])
        );
        let text = "<|python_tag|>{\"name\": \"get_time\", \"parameters\": {}}; {\"name\": \"get_weather\", \"parameters\": {\"location\": \"Rome\"}}";
        let (_, calls) = parse(ToolFormat::Llama3Json, text);
        assert_eq!(calls.iter().map(|c| c.0.as_str()).collect::<Vec<_>>(), ["get_time", "get_weather"]);
        // Prose is prose, even if it contains braces later.
        let text = "The set {1, 2} has two elements.";
        assert_eq!(parse(ToolFormat::Llama3Json, text), (text.to_owned(), vec![]));
    }

    #[test]
    fn mistral_calls() {
        let text = "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\"}}, {\"name\": \"get_time\", \"arguments\": {}}]";
        let (content, calls) = parse(ToolFormat::Mistral, text);
        assert_eq!(content, "");
        assert_eq!(calls, vec![("get_weather".into(), json!({"location": "Paris"})), ("get_time".into(), json!({}))]);
        let text = "[TOOL_CALLS]get_weather[ARGS]{\"location\": \"Paris\", \"days\": \"1\"}";
        let (_, calls) = parse(ToolFormat::Mistral, text);
        assert_eq!(calls, vec![("get_weather".into(), json!({"location": "Paris", "days": 1}))]);
    }
}
