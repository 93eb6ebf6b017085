//! Conversations encoded so that a client's text can never become a control token: only the chat
//! template's own markup turns into added-token ids (role markers, `<think>`, `<tool_call>`,
//! image placeholders, end-of-turn); the same strings typed inside a message stay plain text.
//!
//! How: every string of the request (message fields other than `role`, tool definitions, template
//! kwargs) has each added-token occurrence replaced by a marker made of private-use characters
//! that no vocabulary contains, the template renders that, and the tokenizer's own added-token
//! matcher runs over the rendered text, so everything it finds is template markup. The markers are
//! then put back and the restored text is tokenized with those markup tokens fixed and nothing
//! else matched as an added token; the text between two markup tokens is normalized,
//! pre-tokenized and run through the model exactly as the tokenizer does for any piece between
//! added tokens. Two consequences:
//! - BPE merges across the edge of a message are untouched: the tokenizer never splits at the
//!   edge of a message, only at added tokens, and we split at the same markup tokens it would.
//!   A typed `<|im_start|>` is tokenized together with its neighbours as the ordinary text it is.
//! - A conversation that contains no added-token text renders to the very string the template
//!   renders without markers, and is encoded by the tokenizer's own `encode`: nothing changes for
//!   ordinary prompts.
//!
//! Template logic that inspects text for a marker (Qwen3 splitting assistant content on
//! `</think>`) sees the escaped form, so typed markers are kept as literal text there too; only
//! a message's `reasoning_content` field is reasoning. Added tokens made only of whitespace
//! (indentation runs some vocabularies add) are not control tokens and are left to the tokenizer.
//! A raw `prompt` on /v1/completions is not a conversation and is encoded as given, specials
//! included (what llama.cpp and vLLM do for raw prompts).

use std::collections::HashSet;

use aho_corasick::{AhoCorasick, MatchKind};
use serde_json::Value;
use tokenizers::normalizer::Range;
use tokenizers::{Model, Normalizer, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, Token};

use super::chat::{ChatRender, ChatTemplate};
use super::{TokenizerBundle, TokenizerError};

/// Opens a marker; never in a vocabulary (plane 15 private use), escaped when a client types it.
const MARK_OPEN: char = '\u{F0000}';
const MARK_CLOSE: char = '\u{F0001}';
/// Marker digits: the index of the escaped text in base 16, as U+F0010..=U+F001F.
const MARK_DIGIT0: u32 = 0xF0010;

/// Encodes conversations for one tokenizer. Build once per model; `&self` is thread-safe.
pub struct ChatEncoder {
    /// Every protected added token's text, plus the marker delimiters.
    escapes: AhoCorasick,
    /// Ids a client's text must never produce.
    protected_ids: HashSet<u32>,
    /// Ids of added tokens matched after normalization (`normalized: true`).
    normalized_ids: HashSet<u32>,
}

impl std::fmt::Debug for ChatEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatEncoder").field("protected_ids", &self.protected_ids.len()).finish()
    }
}

impl ChatEncoder {
    pub fn new(bundle: &TokenizerBundle) -> Result<ChatEncoder, TokenizerError> {
        let added = bundle.tokenizer.get_added_tokens_decoder();
        let mut patterns: Vec<String> = vec![MARK_OPEN.to_string(), MARK_CLOSE.to_string()];
        let mut protected_ids = HashSet::new();
        let mut normalized_ids = HashSet::new();
        for (id, tok) in &added {
            if tok.normalized {
                normalized_ids.insert(*id);
            }
            if tok.content.chars().all(char::is_whitespace) {
                continue;
            }
            protected_ids.insert(*id);
            patterns.push(tok.content.clone());
        }
        let escapes = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&patterns)
            .map_err(|e| TokenizerError::Tokenizer(format!("added-token matcher: {e}")))?;
        Ok(ChatEncoder { escapes, protected_ids, normalized_ids })
    }

    /// Render `req` with `template` and encode it (no BOS added: templates write their own).
    pub fn render_and_encode(
        &self,
        bundle: &TokenizerBundle,
        template: &ChatTemplate,
        req: &ChatRender<'_>,
    ) -> Result<Vec<u32>, TokenizerError> {
        let text = self.render(template, req)?;
        self.encode(bundle, &text)
    }

    /// Render `req` with every client string escaped.
    pub fn render(&self, template: &ChatTemplate, req: &ChatRender<'_>) -> Result<EscapedText, TokenizerError> {
        let mut originals = Vec::new();
        let messages = self.escape_messages(req.messages, &mut originals);
        let tools = req.tools.map(|t| self.escape_value(t, &mut originals));
        let kwargs: serde_json::Map<String, Value> =
            req.kwargs.iter().map(|(k, v)| (k.clone(), self.escape_value(v, &mut originals))).collect();
        let rendered = template.render(&ChatRender {
            messages: &messages,
            tools: tools.as_ref(),
            add_generation_prompt: req.add_generation_prompt,
            kwargs: &kwargs,
        })?;
        let mut text = EscapedText { escaped: rendered, restored: String::new(), shifts: Vec::new() };
        text.restore(&originals)?;
        Ok(text)
    }

    /// Encode rendered text: markup tokens are the added tokens found in the escaped text.
    pub fn encode(&self, bundle: &TokenizerBundle, text: &EscapedText) -> Result<Vec<u32>, TokenizerError> {
        let tok = &bundle.tokenizer;
        if text.shifts.is_empty() {
            // Nothing was escaped: the tokenizer's own encoding is the answer.
            return bundle.encode(&text.escaped, false);
        }
        let found = tok.get_added_vocabulary().extract_and_normalize(tok.get_normalizer(), &text.escaped);
        let markup: Vec<Markup> = found
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .filter_map(|(_, (start, end), tokens)| {
                let id = tokens.as_ref()?.first()?.id;
                Some(Markup {
                    start: text.restored_offset(start),
                    end: text.restored_offset(end),
                    id,
                    normalized: self.normalized_ids.contains(&id),
                })
            })
            .collect();
        let ids = encode_with_markup(bundle, &text.restored, &markup)?;
        let markup_ids = markup.iter().filter(|m| self.protected_ids.contains(&m.id)).count();
        let protected_ids = ids.iter().filter(|id| self.protected_ids.contains(id)).count();
        if protected_ids != markup_ids {
            // The model's own merges spell a control token out of plain text: refuse rather
            // than let the text act as one.
            return Err(TokenizerError::Template(
                "a message contains text this model's tokenizer turns into a control token".into(),
            ));
        }
        Ok(ids)
    }

    fn escape_messages(&self, messages: &Value, originals: &mut Vec<String>) -> Value {
        match messages {
            Value::Array(items) => Value::Array(
                items
                    .iter()
                    .map(|m| match m {
                        Value::Object(obj) => Value::Object(
                            obj.iter()
                                .map(|(k, v)| {
                                    // The role was validated against a fixed list; templates
                                    // compare it, so it stays as sent.
                                    let v = if k == "role" { v.clone() } else { self.escape_value(v, originals) };
                                    (k.clone(), v)
                                })
                                .collect(),
                        ),
                        other => self.escape_value(other, originals),
                    })
                    .collect(),
            ),
            other => other.clone(),
        }
    }

    fn escape_value(&self, v: &Value, originals: &mut Vec<String>) -> Value {
        match v {
            Value::String(s) => Value::String(self.escape_str(s, originals)),
            Value::Array(items) => Value::Array(items.iter().map(|x| self.escape_value(x, originals)).collect()),
            Value::Object(obj) => {
                Value::Object(obj.iter().map(|(k, x)| (k.clone(), self.escape_value(x, originals))).collect())
            }
            other => other.clone(),
        }
    }

    fn escape_str(&self, s: &str, originals: &mut Vec<String>) -> String {
        let mut out = String::new();
        let mut last = 0;
        for m in self.escapes.find_iter(s) {
            out.push_str(&s[last..m.start()]);
            push_marker(&mut out, originals.len());
            originals.push(s[m.start()..m.end()].to_owned());
            last = m.end();
        }
        if last == 0 {
            return s.to_owned();
        }
        out.push_str(&s[last..]);
        out
    }
}

/// A markup token of the restored text (byte offsets).
struct Markup {
    start: usize,
    end: usize,
    id: u32,
    normalized: bool,
}

fn push_marker(out: &mut String, index: usize) {
    out.push(MARK_OPEN);
    let digits = format!("{index:x}");
    for d in digits.chars() {
        let v = d.to_digit(16).unwrap_or(0);
        out.push(char::from_u32(MARK_DIGIT0 + v).unwrap_or(MARK_CLOSE));
    }
    out.push(MARK_CLOSE);
}

/// A rendered conversation: the text the template produced from escaped strings, and the text
/// with the client's strings put back.
#[derive(Debug, Clone)]
pub struct EscapedText {
    escaped: String,
    restored: String,
    /// For each marker: its end in `escaped` and the length change up to and including it.
    shifts: Vec<(usize, isize)>,
}

impl EscapedText {
    /// The prompt as the model will read it.
    pub fn text(&self) -> &str {
        if self.shifts.is_empty() {
            &self.escaped
        } else {
            &self.restored
        }
    }

    /// Append markup of the server's own (a forced tool-call opening, a closing `</think>`): it
    /// becomes control tokens like the template's markup.
    pub fn push_markup(&mut self, markup: &str) {
        self.escaped.push_str(markup);
        if !self.shifts.is_empty() {
            self.restored.push_str(markup);
        }
    }

    fn restore(&mut self, originals: &[String]) -> Result<(), TokenizerError> {
        if originals.is_empty() {
            // Nothing was escaped, so nothing needs putting back.
            return Ok(());
        }
        let mut out = String::with_capacity(self.escaped.len());
        let mut shift: isize = 0;
        let mut chars = self.escaped.char_indices();
        while let Some((i, c)) = chars.next() {
            match c {
                MARK_OPEN => {
                    let mut index = 0usize;
                    let mut end = None;
                    for (j, d) in chars.by_ref() {
                        match d as u32 {
                            v if (MARK_DIGIT0..MARK_DIGIT0 + 16).contains(&v) => {
                                index = index.checked_mul(16).ok_or_else(cut_marker)? + (v - MARK_DIGIT0) as usize;
                            }
                            _ if d == MARK_CLOSE => {
                                end = Some(j + d.len_utf8());
                                break;
                            }
                            _ => return Err(cut_marker()),
                        }
                    }
                    let end = end.ok_or_else(cut_marker)?;
                    let original = originals.get(index).ok_or_else(cut_marker)?;
                    out.push_str(original);
                    shift += original.len() as isize - (end - i) as isize;
                    self.shifts.push((end, shift));
                }
                MARK_CLOSE => return Err(cut_marker()),
                // A lone digit (a client may type one) means nothing without an opening mark.
                c => out.push(c),
            }
        }
        self.restored = out;
        Ok(())
    }

    /// Where byte `pos` of the escaped text (never inside a marker) lands in the restored text.
    fn restored_offset(&self, pos: usize) -> usize {
        let before = self.shifts.partition_point(|&(end, _)| end <= pos);
        let shift = if before == 0 { 0 } else { self.shifts[before - 1].1 };
        (pos as isize + shift) as usize
    }
}

fn cut_marker() -> TokenizerError {
    TokenizerError::Template(
        "the chat template cut through a message's text, which this server cannot encode safely".into(),
    )
}

/// Tokenize `text` the way the tokenizer does, except that the added tokens are exactly
/// `markup` (sorted, non-overlapping byte ranges of `text`): non-normalized ones split the raw
/// text, normalized ones split it after normalization, and the pieces between them go through
/// the pre-tokenizer and the model.
fn encode_with_markup(bundle: &TokenizerBundle, text: &str, markup: &[Markup]) -> Result<Vec<u32>, TokenizerError> {
    let tok = &bundle.tokenizer;
    let err = |e: tokenizers::Error| TokenizerError::Tokenizer(e.to_string());
    let mut pre = PreTokenizedString::from(text);
    let split_at = |piece: tokenizers::NormalizedString, normalized: bool| {
        let base = piece.offsets_original().0;
        let len = piece.len_original();
        let mut out: Vec<(tokenizers::NormalizedString, Option<Vec<Token>>)> = Vec::new();
        let mut cursor = 0;
        for m in markup.iter().filter(|m| m.normalized == normalized && m.start >= base && m.end <= base + len) {
            let (s, e) = (m.start - base, m.end - base);
            if s > cursor {
                out.extend(piece.slice(Range::Original(cursor..s)).map(|n| (n, None)));
            }
            if let Some(n) = piece.slice(Range::Original(s..e)) {
                let value = n.get().to_owned();
                let token = Token::new(m.id, value, (0, n.len()));
                out.push((n, Some(vec![token])));
            }
            cursor = e;
        }
        if cursor < len {
            out.extend(piece.slice(Range::Original(cursor..len)).map(|n| (n, None)));
        }
        out
    };
    pre.split(|_, piece| Ok(split_at(piece, false))).map_err(err)?;
    let normalizer = tok.get_normalizer();
    pre.split(|_, mut piece| {
        if let Some(n) = normalizer {
            n.normalize(&mut piece)?;
        }
        Ok(split_at(piece, true))
    })
    .map_err(err)?;
    if let Some(p) = tok.get_pre_tokenizer() {
        p.pre_tokenize(&mut pre).map_err(err)?;
    }
    let model = tok.get_model();
    pre.tokenize(|n| model.tokenize(n.get())).map_err(err)?;
    let encoding = pre.into_encoding(None, 0, OffsetType::None).map_err(err)?;
    Ok(encoding.get_ids().to_vec())
}

#[cfg(test)]
mod tests;
