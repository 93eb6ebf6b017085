//! Chat templates: turns a conversation (OpenAI-style message objects, tool definitions and
//! `chat_template_kwargs`) into the prompt string that HF transformers'
//! `apply_chat_template(..., tokenize=False)` produces for the same inputs.
//!
//! Owns template compilation (minijinja, configured like HF's Jinja2 sandbox: `trim_blocks`,
//! `lstrip_blocks`, loop controls, lenient undefined values) and the Python-compatible pieces
//! templates depend on: `tojson` as `json.dumps(ensure_ascii=False)`, printing values the way
//! Python's `str()` does (`None`, `True`, list and dict reprs, float reprs), `strftime_now`,
//! `raise_exception`, and the message normalisation HF applies before rendering. Knows nothing
//! about token ids or models.
//!
//! Known gaps (no HF template we know of depends on them): the `~` operator still prints
//! booleans and `none` minijinja's way (`true`, `none`), and Python-only objects (tuples,
//! namespaces) print in minijinja's form.

use std::borrow::Cow;
use std::fmt::Write as _;

use chrono::format::{Item, StrftimeItems};
use chrono::NaiveDateTime;
use minijinja::value::{ArgType, Kwargs, Rest, Value, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, UndefinedBehavior};

use super::TokenizerError;

const TEMPLATE_NAME: &str = "chat_template";

/// Names HF passes to the template itself; a kwarg with one of these names is a `TypeError`
/// there ("got multiple values for keyword argument"), so it is an error here too.
const RESERVED_NAMES: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// Message fields that carry reasoning, in HF's order of preference (`_REASONING_FIELDS`).
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// One render request. `messages` is the JSON array the client sent; every field of every
/// message reaches the template (`content`, `tool_calls`, `reasoning_content`, `name`,
/// `tool_call_id`, anything else), except fields whose value is `null`, which HF drops.
pub struct ChatRender<'a> {
    pub messages: &'a serde_json::Value,
    pub tools: Option<&'a serde_json::Value>,
    pub add_generation_prompt: bool,
    /// `chat_template_kwargs` (e.g. `enable_thinking`, `reasoning_effort`), visible to the
    /// template as globals; they override `bos_token` / `eos_token` like in HF.
    pub kwargs: &'a serde_json::Map<String, serde_json::Value>,
}

/// A compiled chat template. Compile once per model; `render` is `&self` and thread-safe.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("bos_token", &self.bos_token).field("eos_token", &self.eos_token).finish()
    }
}

impl ChatTemplate {
    /// Compile `source`. Syntax errors are reported here, not at the first request.
    pub fn new(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<ChatTemplate, TokenizerError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        // Jinja2's default `Undefined`: printing and iterating are fine, attribute access fails.
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        // HF's environment never autoescapes; minijinja would pick HTML escaping by file name.
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(|out, _state, value| match value.as_str() {
            Some(s) if value.kind() == ValueKind::String => out.write_str(s).map_err(Error::from),
            _ => out.write_str(&py_str(value)).map_err(Error::from),
        });
        // Debug mode copies template state into every error; messages carry what clients need.
        env.set_debug(false);
        env.add_filter("tojson", tojson);
        env.add_filter("string", |v: &Value| -> Value {
            if v.kind() == ValueKind::String {
                v.clone()
            } else {
                Value::from(py_str(v))
            }
        });
        // Jinja2's `sequence` test accepts anything with a length and indexing: strings and dicts too.
        env.add_test("sequence", |v: &Value| {
            matches!(v.kind(), ValueKind::String | ValueKind::Seq | ValueKind::Map | ValueKind::Bytes)
        });
        // Python's bool is an int, so Jinja2 counts it as a number.
        env.add_test("number", |v: &Value| matches!(v.kind(), ValueKind::Number | ValueKind::Bool));
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_fn(None));
        env.add_template_owned(TEMPLATE_NAME, rewrite_generation_tags(source).into_owned())
            .map_err(|e| TokenizerError::Template(e.to_string()))?;
        Ok(ChatTemplate { env, bos_token: bos_token.map(str::to_owned), eos_token: eos_token.map(str::to_owned) })
    }

    /// The template a model ships with (`None` when it has none), with its special tokens.
    pub fn from_bundle(bundle: &super::TokenizerBundle) -> Result<Option<ChatTemplate>, TokenizerError> {
        bundle
            .chat_template
            .as_deref()
            .map(|src| ChatTemplate::new(src, bundle.bos_token.as_deref(), bundle.eos_token.as_deref()))
            .transpose()
    }

    /// Freeze the clock `strftime_now` reads (local time, like Python's `datetime.now()`), so
    /// renders are reproducible (golden tests, cache keys).
    pub fn with_fixed_now(mut self, now: NaiveDateTime) -> ChatTemplate {
        self.env.add_function("strftime_now", strftime_fn(Some(now)));
        self
    }

    pub fn render(&self, req: &ChatRender<'_>) -> Result<String, TokenizerError> {
        let messages = normalize_messages(req.messages)?;
        let tools = match req.tools {
            None | Some(serde_json::Value::Null) => Value::from(()),
            Some(t @ serde_json::Value::Array(_)) => Value::from_serialize(t),
            Some(_) => return Err(TokenizerError::Template("`tools` must be an array of tool definitions".into())),
        };
        let mut ctx: Vec<(String, Value)> = Vec::with_capacity(req.kwargs.len() + 6);
        if let Some(b) = &self.bos_token {
            ctx.push(("bos_token".into(), Value::from(b.as_str())));
        }
        if let Some(e) = &self.eos_token {
            ctx.push(("eos_token".into(), Value::from(e.as_str())));
        }
        for (k, v) in req.kwargs {
            if RESERVED_NAMES.contains(&k.as_str()) {
                return Err(TokenizerError::Template(format!(
                    "chat_template_kwargs may not set `{k}`: it is passed to the template separately"
                )));
            }
            // Later entries win when the map is built, so a kwarg replaces bos_token/eos_token.
            ctx.push((k.clone(), Value::from_serialize(v)));
        }
        ctx.push(("messages".into(), Value::from_serialize(&messages)));
        ctx.push(("tools".into(), tools));
        ctx.push(("documents".into(), Value::from(())));
        ctx.push(("add_generation_prompt".into(), Value::from(req.add_generation_prompt)));
        let ctx: Value = ctx.into_iter().collect();
        let template = self.env.get_template(TEMPLATE_NAME).map_err(template_error)?;
        template.render(ctx).map_err(template_error)
    }
}

/// HF (`apply_chat_template` in transformers 5) drops `null` fields from each message, then
/// copies reasoning found under `reasoning_content`, `thinking` or `reasoning` to both
/// `thinking` (read by gpt-oss templates) and `reasoning_content` (read by most others).
fn normalize_messages(messages: &serde_json::Value) -> Result<Vec<serde_json::Value>, TokenizerError> {
    let arr = messages
        .as_array()
        .ok_or_else(|| TokenizerError::Template("`messages` must be an array of message objects".into()))?;
    if arr.is_empty() {
        return Err(TokenizerError::Template("cannot apply a chat template to an empty conversation".into()));
    }
    let mut out = Vec::with_capacity(arr.len());
    for (i, m) in arr.iter().enumerate() {
        let obj = m.as_object().ok_or_else(|| TokenizerError::Template(format!("message {i} is not a JSON object")))?;
        let mut msg: serde_json::Map<String, serde_json::Value> =
            obj.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.clone(), v.clone())).collect();
        if let Some(reasoning) = REASONING_FIELDS.iter().find_map(|k| msg.get(*k)).cloned() {
            // Same key order as `{"thinking": r, **message, "reasoning_content": r}`.
            let mut aliased = serde_json::Map::with_capacity(msg.len() + 2);
            aliased.insert("thinking".into(), reasoning.clone());
            aliased.extend(msg);
            aliased.insert("reasoning_content".into(), reasoning);
            msg = aliased;
        }
        out.push(serde_json::Value::Object(msg));
    }
    Ok(out)
}

/// The error `raise_exception` attaches, so the message reaches the client verbatim.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn raise_exception(msg: Value) -> Result<Value, Error> {
    let msg = if msg.kind() == ValueKind::String { msg.as_str().unwrap_or_default().to_owned() } else { py_str(&msg) };
    Err(Error::new(ErrorKind::InvalidOperation, msg.clone()).with_source(Raised(msg)))
}

fn template_error(e: Error) -> TokenizerError {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(err) = cur {
        if let Some(raised) = err.downcast_ref::<Raised>() {
            return TokenizerError::Template(raised.0.clone());
        }
        cur = err.source();
    }
    TokenizerError::Template(e.to_string())
}

type StrftimeFn = Box<dyn Fn(&str) -> Result<String, Error> + Send + Sync>;

fn strftime_fn(fixed: Option<NaiveDateTime>) -> StrftimeFn {
    Box::new(move |fmt: &str| {
        let now = fixed.unwrap_or_else(|| chrono::Local::now().naive_local());
        let items: Vec<Item<'_>> = StrftimeItems::new(fmt).collect();
        if items.iter().any(|i| matches!(i, Item::Error)) {
            return Err(Error::new(ErrorKind::InvalidOperation, format!("strftime_now: invalid format {fmt:?}")));
        }
        let mut s = String::new();
        // chrono reports specifiers a naive time cannot fill (%z, %Z) as a formatting error
        // instead of panicking only when written through `write!`.
        write!(s, "{}", now.format_with_items(items.into_iter())).map_err(|_| {
            Error::new(ErrorKind::InvalidOperation, format!("strftime_now: unsupported format {fmt:?}"))
        })?;
        Ok(s)
    })
}

/// HF's `{% generation %}...{% endgeneration %}` marks assistant spans for training masks and
/// renders its body unchanged; minijinja has no such tag, so it becomes an always-true `if`,
/// keeping the whitespace-control markers so trimming is identical.
fn rewrite_generation_tags(src: &str) -> Cow<'_, str> {
    if !src.contains("generation") {
        return Cow::Borrowed(src);
    }
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(pos) = rest.find("{%") {
        out.push_str(&rest[..pos]);
        let tag = &rest[pos..];
        match parse_generation_tag(tag) {
            Some((len, left, name, right)) => {
                let body = if name == "generation" { "if true" } else { "endif" };
                let _ = write!(out, "{{%{left} {body} {right}%}}");
                rest = &tag[len..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    Cow::Owned(out)
}

/// `{%[-+]? generation|endgeneration [-+]?%}` at the start of `s`: (length, left marker, name,
/// right marker).
fn parse_generation_tag(s: &str) -> Option<(usize, &str, &str, &str)> {
    let mut i = 2;
    let b = s.as_bytes();
    let left_end = if matches!(b.get(i), Some(b'-' | b'+')) { i + 1 } else { i };
    let left = &s[i..left_end];
    i = left_end;
    while matches!(b.get(i), Some(c) if c.is_ascii_whitespace()) {
        i += 1;
    }
    let name_start = i;
    while matches!(b.get(i), Some(c) if c.is_ascii_alphabetic()) {
        i += 1;
    }
    let name = &s[name_start..i];
    if name != "generation" && name != "endgeneration" {
        return None;
    }
    while matches!(b.get(i), Some(c) if c.is_ascii_whitespace()) {
        i += 1;
    }
    let right_start = i;
    if matches!(b.get(i), Some(b'-' | b'+')) {
        i += 1;
    }
    let right = &s[right_start..i];
    if s.get(i..i + 2) != Some("%}") {
        return None;
    }
    Some((i + 2, left, name, right))
}

// ---- Python-compatible value printing -------------------------------------------------------------

/// `str(value)` as Python prints it, which is what Jinja2 writes for `{{ value }}`.
fn py_str(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => v.as_str().unwrap_or_default().to_owned(),
        _ => {
            let mut s = String::new();
            py_repr(&mut s, v);
            s
        }
    }
}

/// `repr(value)`: strings quoted, containers with Python's brackets and separators.
fn py_repr(out: &mut String, v: &Value) {
    match v.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&py_number(v)),
        ValueKind::String => py_repr_str(out, v.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => match v.try_iter() {
            Ok(iter) => {
                out.push('[');
                for (i, item) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_repr(out, &item);
                }
                out.push(']');
            }
            Err(_) => out.push_str(&v.to_string()),
        },
        ValueKind::Map => match v.try_iter() {
            Ok(keys) => {
                out.push('{');
                for (i, k) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_repr(out, &k);
                    out.push_str(": ");
                    py_repr(out, &v.get_item(&k).unwrap_or_default());
                }
                out.push('}');
            }
            Err(_) => out.push_str(&v.to_string()),
        },
        _ => out.push_str(&v.to_string()),
    }
}

fn py_number(v: &Value) -> String {
    if v.is_integer() {
        v.to_string()
    } else {
        f64::try_from(v.clone()).map(py_float_repr).unwrap_or_else(|_| v.to_string())
    }
}

/// Python's `repr(float)`: shortest round-trip digits, scientific notation when the decimal
/// exponent is below -4 or at least 16, and always a `.0` on integral values.
fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf".into() } else { "-inf".into() };
    }
    // `{:e}` gives the shortest round-trip digits: "-1.2345e-7", "0e0".
    let sci = format!("{f:e}");
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mant) = match mant.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mant),
    };
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    let n = digits.len() as i32;
    let body = if (-4..16).contains(&exp) {
        let point = exp + 1;
        if point <= 0 {
            format!("0.{}{digits}", "0".repeat((-point) as usize))
        } else if point >= n {
            format!("{digits}{}.0", "0".repeat((point - n) as usize))
        } else {
            format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
        }
    } else {
        let m = if n == 1 { digits.clone() } else { format!("{}.{}", &digits[..1], &digits[1..]) };
        format!("{m}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
    };
    format!("{sign}{body}")
}

fn py_repr_str(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !py_printable(c) => {
                let cp = c as u32;
                let _ = if cp <= 0xff {
                    write!(out, "\\x{cp:02x}")
                } else if cp <= 0xffff {
                    write!(out, "\\u{cp:04x}")
                } else {
                    write!(out, "\\U{cp:08x}")
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// An approximation of `str.isprintable` for one character: control, separator (other than
/// the plain space) and common format characters are escaped by `repr`.
fn py_printable(c: char) -> bool {
    if c == ' ' {
        return true;
    }
    if c.is_control() || c.is_whitespace() {
        return false;
    }
    !matches!(c as u32, 0xad | 0x200b..=0x200f | 0x202a..=0x202e | 0x2060..=0x2064 | 0xfeff)
}

// ---- tojson: json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) ----

struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

/// HF's `tojson` filter. Parameters may be given by position in Python's order
/// (`ensure_ascii, indent, separators, sort_keys`) or by name.
fn tojson(value: &Value, args: Rest<Value>) -> Result<Value, Error> {
    let mut positional: Vec<Value> = args.0;
    let kwargs = match positional.last() {
        Some(last) if last.is_kwargs() => {
            let kw = Kwargs::from_value(Some(last))?;
            positional.pop();
            kw
        }
        _ => Kwargs::from_iter(std::iter::empty::<(String, Value)>()),
    };
    if positional.len() > 4 {
        return Err(Error::new(ErrorKind::TooManyArguments, "tojson takes at most 4 positional arguments"));
    }
    let mut positional = positional.into_iter();
    let (ensure_ascii, indent, separators, sort_keys) =
        (positional.next(), positional.next(), positional.next(), positional.next());
    fn pick(pos: Option<Value>, kwargs: &Kwargs, name: &str) -> Result<Option<Value>, Error> {
        let kw: Option<Value> = kwargs.get(name)?;
        match (pos, kw) {
            (Some(_), Some(_)) => Err(Error::new(
                ErrorKind::TooManyArguments,
                format!("tojson got multiple values for argument '{name}'"),
            )),
            (p, k) => Ok(p.or(k)),
        }
    }
    let ensure_ascii = pick(ensure_ascii, &kwargs, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let indent = match pick(indent, &kwargs, "indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_owned()),
        Some(v) => {
            let n = v
                .as_i64()
                .ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an int or str"))?;
            Some(" ".repeat(n.max(0) as usize))
        }
    };
    let (item_sep, key_sep) = match pick(separators, &kwargs, "separators")? {
        Some(v) if !v.is_none() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                    (a.as_str().unwrap_or_default().to_owned(), b.as_str().unwrap_or_default().to_owned())
                }
                _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings")),
            }
        }
        // json.dumps drops the space after ',' when indenting, since lines end there anyway.
        _ => (if indent.is_some() { "," } else { ", " }.to_owned(), ": ".to_owned()),
    };
    let sort_keys = pick(sort_keys, &kwargs, "sort_keys")?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let opts = JsonOpts { ensure_ascii, indent, item_sep, key_sep, sort_keys };
    let mut out = String::new();
    write_json(&mut out, value, &opts, 0)?;
    Ok(Value::from(out))
}

fn not_serializable(v: &Value) -> Error {
    let ty = match v.kind() {
        ValueKind::Undefined => "Undefined".to_owned(),
        other => other.to_string(),
    };
    Error::new(ErrorKind::InvalidOperation, format!("Object of type {ty} is not JSON serializable"))
}

fn write_json(out: &mut String, v: &Value, o: &JsonOpts, level: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                let f = f64::try_from(v.clone())?;
                out.push_str(&if f.is_nan() {
                    "NaN".to_owned()
                } else if f.is_infinite() {
                    if f > 0.0 { "Infinity" } else { "-Infinity" }.to_owned()
                } else {
                    py_float_repr(f)
                });
            }
        }
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or_default(), o.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline_indent(out, o, level + 1);
                write_json(out, item, o, level + 1)?;
            }
            newline_indent(out, o, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for k in v.try_iter()? {
                let item = v.get_item(&k)?;
                entries.push((json_key(&k)?, item));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if o.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            out.push('{');
            for (i, (k, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline_indent(out, o, level + 1);
                write_json_str(out, k, o.ensure_ascii);
                out.push_str(&o.key_sep);
                write_json(out, item, o, level + 1)?;
            }
            newline_indent(out, o, level);
            out.push('}');
        }
        _ => return Err(not_serializable(v)),
    }
    Ok(())
}

/// Python's json turns non-string keys into strings (`True` → "true", `1` → "1").
fn json_key(k: &Value) -> Result<String, Error> {
    Ok(match k.kind() {
        ValueKind::String => k.as_str().unwrap_or_default().to_owned(),
        ValueKind::Number => {
            if k.is_integer() {
                k.to_string()
            } else {
                py_float_repr(f64::try_from(k.clone())?)
            }
        }
        ValueKind::Bool => if k.is_true() { "true" } else { "false" }.to_owned(),
        ValueKind::None => "null".to_owned(),
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("keys must be str, int, float, bool or None, not {}", k.kind()),
            ))
        }
    })
}

fn newline_indent(out: &mut String, o: &JsonOpts, level: usize) {
    if let Some(ind) = &o.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render_with(
        src: &str,
        messages: serde_json::Value,
        tools: Option<serde_json::Value>,
        gen: bool,
        kwargs: serde_json::Value,
    ) -> Result<String, TokenizerError> {
        let t = ChatTemplate::new(src, Some("<s>"), Some("</s>"))?;
        let kwargs = kwargs.as_object().cloned().unwrap_or_default();
        t.render(&ChatRender {
            messages: &messages,
            tools: tools.as_ref(),
            add_generation_prompt: gen,
            kwargs: &kwargs,
        })
    }

    fn render(src: &str) -> Result<String, TokenizerError> {
        render_with(src, json!([{"role": "user", "content": "hi"}]), None, false, json!({}))
    }

    #[test]
    fn trim_and_lstrip_blocks_like_hf() {
        let src = "{% for m in messages %}\n    {% if true %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n";
        assert_eq!(render(src).unwrap(), "[hi]\n");
    }

    #[test]
    fn raise_exception_carries_message_verbatim() {
        let err = render("{{ raise_exception('Conversation roles must alternate') }}").unwrap_err();
        match err {
            TokenizerError::Template(msg) => assert_eq!(msg, "Conversation roles must alternate"),
            other => panic!("wrong error: {other:?}"),
        }
    }

    #[test]
    fn syntax_and_runtime_errors_are_template_errors() {
        let e = ChatTemplate::new("{% if %}", None, None).unwrap_err();
        assert!(matches!(e, TokenizerError::Template(_)), "{e:?}");
        // Attribute of an undefined value fails, like Jinja2's default Undefined.
        let e = render("{{ nope.attr }}").unwrap_err();
        assert!(matches!(e, TokenizerError::Template(ref m) if m.contains("undefined")), "{e:?}");
        // ... while printing it is empty.
        assert_eq!(render("[{{ nope }}]").unwrap(), "[]");
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        let kw = json!({"x": {"b": "é<&>'\"\n", "a": [1, 2.5, null, true], "c": {}}});
        let out = render_with("{{ x | tojson }}", json!([{"role": "user"}]), None, false, kw.clone()).unwrap();
        // Key order kept, no HTML escaping, non-ASCII kept, Python's ", " and ": " separators.
        assert_eq!(out, r#"{"b": "é<&>'\"\n", "a": [1, 2.5, null, true], "c": {}}"#);
        let out =
            render_with("{{ x.a | tojson(indent=2) }}", json!([{"role": "user"}]), None, false, kw.clone()).unwrap();
        assert_eq!(out, "[\n  1,\n  2.5,\n  null,\n  true\n]");
        let out = render_with(
            "{{ x | tojson(sort_keys=true, separators=(',', ':'), ensure_ascii=true) }}",
            json!([{"role": "user"}]),
            None,
            false,
            kw,
        )
        .unwrap();
        assert_eq!(out, r#"{"a":[1,2.5,null,true],"b":"\u00e9<&>'\"\n","c":{}}"#);
        assert!(render("{{ nope | tojson }}").is_err());
        assert!(render("{{ 1 | tojson(bogus=1) }}").is_err());
    }

    #[test]
    fn python_printing_of_values() {
        assert_eq!(render("{{ none }} {{ true }} {{ 1.0 }} {{ 1e-5 }}").unwrap(), "None True 1.0 1e-05");
        assert_eq!(render("{{ [1, 'a', none] }} {{ {'k': false} }}").unwrap(), "[1, 'a', None] {'k': False}");
        assert_eq!(render("{{ none | string }}").unwrap(), "None");
    }

    #[test]
    fn float_repr_matches_python() {
        let cases = [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (0.1, "0.1"),
            (100.0, "100.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.5e-7, "1.5e-07"),
            (1e22, "1e+22"),
            (123456789.125, "123456789.125"),
            (5e-324, "5e-324"),
            (f64::MAX, "1.7976931348623157e+308"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float_repr(f), want, "{f:e}");
        }
    }

    #[test]
    fn strftime_now_uses_fixed_clock() {
        let now = chrono::NaiveDate::from_ymd_opt(2024, 7, 26).and_then(|d| d.and_hms_opt(8, 5, 9)).unwrap();
        let t = ChatTemplate::new("{{ strftime_now('%d %B %Y %H:%M:%S') }}", None, None).unwrap().with_fixed_now(now);
        let msgs = json!([{"role": "user"}]);
        let kwargs = serde_json::Map::new();
        let req = ChatRender { messages: &msgs, tools: None, add_generation_prompt: false, kwargs: &kwargs };
        assert_eq!(t.render(&req).unwrap(), "26 July 2024 08:05:09");
        let bad = ChatTemplate::new("{{ strftime_now('%Q') }}", None, None).unwrap();
        assert!(bad.render(&req).is_err());
    }

    #[test]
    fn loop_controls_and_namespace() {
        let src = "{% set ns = namespace(n=0) %}{% for i in range(10) %}{% if i == 1 %}{% continue %}{% endif %}\
                   {% if i == 4 %}{% break %}{% endif %}{% set ns.n = ns.n + i %}{{ i }}{% endfor %}={{ ns.n }}";
        assert_eq!(render(src).unwrap(), "023=5");
    }

    #[test]
    fn globals_kwargs_and_reserved_names() {
        let src = "{{ bos_token }}|{{ eos_token }}|{{ tools }}|{{ add_generation_prompt }}|{{ enable_thinking }}|{{ reasoning_effort }}";
        let out = render_with(
            src,
            json!([{"role": "user", "content": "x"}]),
            None,
            true,
            json!({"enable_thinking": false, "reasoning_effort": "low", "eos_token": "<E>"}),
        )
        .unwrap();
        assert_eq!(out, "<s>|<E>|None|True|False|low");
        let out =
            render_with("{{ tools | length }}", json!([{"role": "u"}]), Some(json!([{"a": 1}])), false, json!({}));
        assert_eq!(out.unwrap(), "1");
        let e = render_with("x", json!([{"role": "u"}]), None, false, json!({"messages": []})).unwrap_err();
        assert!(matches!(e, TokenizerError::Template(ref m) if m.contains("messages")), "{e:?}");
    }

    #[test]
    fn messages_keep_fields_drop_nulls_and_alias_reasoning() {
        let msgs = json!([
            {"role": "assistant", "content": null, "name": "bot", "tool_call_id": "c1",
             "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}], "reasoning": "why"}
        ]);
        let src = "{% for m in messages %}{{ m | tojson }}|{{ 'content' in m }}{% endfor %}";
        let out = render_with(src, msgs, None, false, json!({})).unwrap();
        assert_eq!(
            out,
            r#"{"thinking": "why", "role": "assistant", "name": "bot", "tool_call_id": "c1", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}], "reasoning": "why", "reasoning_content": "why"}|False"#
        );
    }

    #[test]
    fn rejects_bad_inputs() {
        assert!(render_with("x", json!([]), None, false, json!({})).is_err());
        assert!(render_with("x", json!({"role": "user"}), None, false, json!({})).is_err());
        assert!(render_with("x", json!(["user"]), None, false, json!({})).is_err());
        assert!(render_with("x", json!([{"role": "u"}]), Some(json!({"a": 1})), false, json!({})).is_err());
    }

    #[test]
    fn generation_tags_render_their_body() {
        assert_eq!(
            rewrite_generation_tags("a{%- generation -%}b{% endgeneration %}c{% if x %}"),
            "a{%- if true -%}b{% endif %}c{% if x %}"
        );
        let src = "{% for m in messages %}{% generation %}<{{ m.content }}>{% endgeneration %}\n{% endfor %}";
        assert_eq!(render(src).unwrap(), "<hi>");
    }

    #[test]
    fn pycompat_methods_available() {
        let src = "{{ '  a  '.strip() }}|{{ 'a,b'.split(',') }}|{{ 'Hi'.startswith('H') }}|{% for k, v in {'x': 1}.items() %}{{ k }}{{ v }}{% endfor %}";
        assert_eq!(render(src).unwrap(), "a|['a', 'b']|True|x1");
    }
}
