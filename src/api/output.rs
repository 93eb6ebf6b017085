//! What a chat reply's text means: reasoning, answer text and tool calls. [`ReplySetup`] is
//! decided once per request from the template, the rendered prompt and the request's tools;
//! [`ReplyParser`] (one per choice) runs the reasoning split first and the tool-call parser on the
//! answer only, so a call written inside the reasoning block is not a call. Calls come out as
//! [`CallEvent`]s (header, argument pieces, end): the streamed replies send them as they come,
//! the non-streamed ones assemble them with `CallList`, so both carry the same arguments.
//!
//! Markers that the vocabulary holds as *special* tokens (GLM's `<think>`) are dropped by the
//! detokenizer's default; for such models the request keeps special tokens in the text and this
//! parser removes every other special token's text (EOS and turn markers) itself.

use super::reasoning::{ReasoningSplitter, ReasoningStart, THINK_CLOSE, THINK_OPEN};
use super::tools::parse::{CallEvent, Piece, ToolCallParser};
use super::tools::{ToolFormat, ToolSpec};
use crate::tokenizer::TokenizerBundle;

/// Markers the parsers read, which must reach them as text.
const MARKERS: [&str; 9] = [
    THINK_OPEN,
    THINK_CLOSE,
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "[TOOL_CALLS]",
];

/// Per-request decisions, shared by the request's choices.
#[derive(Clone, Debug)]
pub struct ReplySetup {
    pub reasoning: ReasoningStart,
    /// `None`: tool calls are not parsed (no tools, or `tool_choice: none`).
    pub tools: Option<(ToolFormat, Vec<ToolSpec>)>,
    /// Text appended to the prompt that opened a forced call; the parser reads it first.
    pub forced_prefix: Option<String>,
    /// Special-token texts to remove from the reply, when special tokens are kept (see the module
    /// doc); empty otherwise.
    pub strip: Vec<String>,
}

impl ReplySetup {
    /// Whether the request must keep special tokens in its text, and which to strip then.
    pub fn special_tokens(tokenizer: &TokenizerBundle) -> (bool, Vec<String>) {
        let added = tokenizer.tokenizer.get_added_tokens_decoder();
        let special: Vec<String> = added.values().filter(|t| t.special).map(|t| t.content.clone()).collect();
        if !special.iter().any(|s| MARKERS.contains(&s.as_str())) {
            return (false, Vec::new());
        }
        let mut strip: Vec<String> = special.into_iter().filter(|s| !MARKERS.contains(&s.as_str())).collect();
        // Longest first, so a token that contains another is removed whole.
        strip.sort_by_key(|s| std::cmp::Reverse(s.len()));
        (true, strip)
    }

    pub fn parser(&self) -> ReplyParser {
        let mut tools = self.tools.as_ref().map(|(f, t)| ToolCallParser::new(*f, t.clone()));
        // The prefix opens a call; with the name fixed it releases the call's header, which
        // goes out with the reply's first piece.
        let pending = match (tools.as_mut(), self.forced_prefix.as_deref()) {
            (Some(p), Some(prefix)) => p.push(prefix).into_iter().map(ReplyPiece::from).collect(),
            _ => Vec::new(),
        };
        ReplyParser { reasoning: ReasoningSplitter::new(self.reasoning), tools, strip: self.strip.clone(), pending }
    }
}

/// One piece of a reply, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplyPiece {
    Reasoning(String),
    Content(String),
    Call(CallEvent),
}

impl From<Piece> for ReplyPiece {
    fn from(piece: Piece) -> Self {
        match piece {
            Piece::Content(c) => Self::Content(c),
            Piece::Call(e) => Self::Call(e),
        }
    }
}

pub struct ReplyParser {
    reasoning: ReasoningSplitter,
    tools: Option<ToolCallParser>,
    strip: Vec<String>,
    /// What the forced prefix released, not yet handed out.
    pending: Vec<ReplyPiece>,
}

impl ReplyParser {
    pub fn push(&mut self, text: &str) -> Vec<ReplyPiece> {
        let text = self.strip_special(text);
        let split = self.reasoning.push(&text);
        self.route(split.reasoning, split.content, false)
    }

    pub fn finish(&mut self) -> Vec<ReplyPiece> {
        let split = self.reasoning.finish();
        self.route(split.reasoning, split.content, true)
    }

    fn strip_special(&self, text: &str) -> String {
        let mut t = text.to_owned();
        for s in &self.strip {
            if t.contains(s.as_str()) {
                t = t.replace(s.as_str(), "");
            }
        }
        t
    }

    fn route(&mut self, reasoning: String, content: String, last: bool) -> Vec<ReplyPiece> {
        let mut out = std::mem::take(&mut self.pending);
        if !reasoning.is_empty() {
            out.push(ReplyPiece::Reasoning(reasoning));
        }
        match self.tools.as_mut() {
            Some(p) => {
                let mut pieces = p.push(&content);
                if last {
                    pieces.extend(p.finish());
                }
                out.extend(pieces.into_iter().map(ReplyPiece::from));
            }
            None if !content.is_empty() => out.push(ReplyPiece::Content(content)),
            None => {}
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::tools::parse::CallList;
    use serde_json::json;

    fn collect(setup: &ReplySetup, pieces: &[&str]) -> (String, String, Vec<(String, String)>) {
        let mut p = setup.parser();
        let mut all = Vec::new();
        for s in pieces {
            all.extend(p.push(s));
        }
        all.extend(p.finish());
        let (mut r, mut c, mut calls) = (String::new(), String::new(), CallList::default());
        for piece in all {
            match piece {
                ReplyPiece::Reasoning(t) => r += &t,
                ReplyPiece::Content(t) => c += &t,
                ReplyPiece::Call(e) => calls.add(e),
            }
        }
        (r, c, calls.calls.into_iter().map(|k| (k.name, k.arguments)).collect())
    }

    fn tools() -> Vec<ToolSpec> {
        vec![ToolSpec { name: "get_time".into(), description: None, parameters: json!({}) }]
    }

    #[test]
    fn a_call_inside_reasoning_is_not_a_call() {
        let setup = ReplySetup {
            reasoning: ReasoningStart::MayOpen,
            tools: Some((ToolFormat::Glm, tools())),
            forced_prefix: None,
            strip: Vec::new(),
        };
        let text = "<think>maybe <tool_call>get_time</tool_call>?</think>No call needed.";
        let (r, c, calls) = collect(&setup, &[text]);
        assert_eq!(r, "maybe <tool_call>get_time</tool_call>?");
        assert_eq!(c, "No call needed.");
        assert!(calls.is_empty());
        let text = "<think>I need the time.</think>\n<tool_call>get_time</tool_call>";
        let (r, c, calls) =
            collect(&setup, &["<think>I need", " the time.</think>\n<tool_", "call>get_time</tool_call>"]);
        assert_eq!((r.as_str(), c.as_str()), ("I need the time.", ""), "{text}");
        assert_eq!(calls, vec![("get_time".to_owned(), "{}".to_owned())]);
    }

    #[test]
    fn forced_prefix_is_read_first_and_special_tokens_are_stripped() {
        let setup = ReplySetup {
            reasoning: ReasoningStart::Off,
            tools: Some((ToolFormat::Hermes, tools())),
            forced_prefix: Some("<tool_call>\n{\"name\": \"get_time\", \"arguments\": ".into()),
            strip: vec!["<|im_end|>".into()],
        };
        let (r, c, calls) = collect(&setup, &["{}}\n</tool_call>", "<|im_end|>"]);
        assert_eq!((r.as_str(), c.as_str()), ("", ""));
        assert_eq!(calls, vec![("get_time".to_owned(), "{}".to_owned())]);
        // The prefix names the tool: its header comes first, with the first push.
        let mut p = setup.parser();
        let first = p.push("{");
        assert!(
            matches!(&first[..], [ReplyPiece::Call(CallEvent::Start { index: 0, name, .. })] if name == "get_time")
        );
    }
}
