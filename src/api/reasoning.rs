//! Splits generated text into reasoning and answer: `<think>…</think>` becomes
//! `reasoning_content`, the rest `content`. Works on a stream of text pieces (a marker may arrive
//! split across pieces, so a possible marker prefix is held back until it resolves).
//!
//! Three starting points, decided from the rendered prompt (see [`ReasoningStart::detect`]):
//! the template opened the block itself (the prompt ends in `<think>`: everything is reasoning
//! until `</think>`), the template closed it (thinking off: `<think></think>` in the prompt, or no
//! reasoning syntax in the template: everything is content), or the model may open the block
//! itself as the first thing it writes. A block that never closes (max tokens) stays reasoning.
//!
//! Owns no I/O; the chat and messages handlers feed it.

pub const THINK_OPEN: &str = "<think>";
pub const THINK_CLOSE: &str = "</think>";

/// Where the reply starts relative to the reasoning block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningStart {
    /// No reasoning syntax, or thinking switched off: all content.
    Off,
    /// The model may open `<think>` as the first thing it writes.
    MayOpen,
    /// The prompt already opened `<think>`: the reply starts inside the block.
    Inside,
}

impl ReasoningStart {
    /// From the template source and the prompt it rendered.
    pub fn detect(template_source: &str, prompt: &str) -> Self {
        if !template_source.contains(THINK_OPEN) && !template_source.contains("enable_thinking") {
            return Self::Off;
        }
        let tail = prompt.trim_end();
        if tail.ends_with(THINK_OPEN) {
            Self::Inside
        } else if tail.ends_with(THINK_CLOSE) {
            // `<think></think>` rendered by the template: thinking is off for this turn.
            Self::Off
        } else {
            Self::MayOpen
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Before anything but whitespace: a `<think>` here opens the block.
    Start,
    Reasoning,
    /// Right after `</think>`: leading whitespace of the answer is dropped.
    AfterClose,
    Content,
}

/// Text of one push, split.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

#[derive(Debug)]
pub struct ReasoningSplitter {
    phase: Phase,
    pending: String,
    saw_reasoning: bool,
}

impl ReasoningSplitter {
    pub fn new(start: ReasoningStart) -> Self {
        let phase = match start {
            ReasoningStart::Off => Phase::Content,
            ReasoningStart::MayOpen => Phase::Start,
            ReasoningStart::Inside => Phase::Reasoning,
        };
        Self { phase, pending: String::new(), saw_reasoning: start == ReasoningStart::Inside }
    }

    /// Whether any reasoning block was seen (even an empty one).
    pub fn saw_reasoning(&self) -> bool {
        self.saw_reasoning
    }

    pub fn push(&mut self, text: &str) -> Split {
        let mut out = Split::default();
        self.pending.push_str(text);
        loop {
            match self.phase {
                Phase::Content => {
                    out.content.push_str(&std::mem::take(&mut self.pending));
                    return out;
                }
                Phase::Start => {
                    let trimmed = self.pending.trim_start();
                    if trimmed.is_empty() || (THINK_OPEN.starts_with(trimmed) && trimmed.len() < THINK_OPEN.len()) {
                        return out;
                    }
                    if let Some(rest) = trimmed.strip_prefix(THINK_OPEN) {
                        self.pending = rest.to_owned();
                        self.phase = Phase::Reasoning;
                        self.saw_reasoning = true;
                    } else {
                        self.phase = Phase::Content;
                    }
                }
                Phase::Reasoning => match self.pending.find(THINK_CLOSE) {
                    Some(at) => {
                        out.reasoning.push_str(&self.pending[..at]);
                        self.pending.drain(..at + THINK_CLOSE.len());
                        self.phase = Phase::AfterClose;
                    }
                    None => {
                        let keep = partial_suffix(&self.pending, THINK_CLOSE);
                        let emit = self.pending.len() - keep;
                        out.reasoning.push_str(&self.pending[..emit]);
                        self.pending.drain(..emit);
                        return out;
                    }
                },
                Phase::AfterClose => {
                    let trimmed = self.pending.trim_start();
                    if trimmed.is_empty() {
                        self.pending.clear();
                        return out;
                    }
                    self.pending = trimmed.to_owned();
                    self.phase = Phase::Content;
                }
            }
        }
    }

    /// End of generation: whatever is held back goes where the phase says (an unclosed block's
    /// text stays reasoning; a lone partial `<think` at the start is content).
    pub fn finish(&mut self) -> Split {
        let rest = std::mem::take(&mut self.pending);
        match self.phase {
            Phase::Reasoning => Split { reasoning: rest, content: String::new() },
            Phase::AfterClose => Split::default(),
            Phase::Start | Phase::Content => Split { reasoning: String::new(), content: rest },
        }
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `marker` (what must be held
/// back because the next piece may complete the marker).
pub fn partial_suffix(text: &str, marker: &str) -> usize {
    let max = marker.len().saturating_sub(1).min(text.len());
    (1..=max)
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feed `pieces` one by one and return (reasoning, content).
    fn run(start: ReasoningStart, pieces: &[&str]) -> (String, String) {
        let mut s = ReasoningSplitter::new(start);
        let (mut r, mut c) = (String::new(), String::new());
        for p in pieces {
            let o = s.push(p);
            r += &o.reasoning;
            c += &o.content;
        }
        let o = s.finish();
        (r + &o.reasoning, c + &o.content)
    }

    /// Every way of cutting `text` into two pieces gives the same split as one piece.
    fn every_cut(start: ReasoningStart, text: &str) -> (String, String) {
        let whole = run(start, &[text]);
        for i in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
            assert_eq!(run(start, &[&text[..i], &text[i..]]), whole, "cut at {i} of {text:?}");
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(run(start, &refs), whole, "char by char");
        whole
    }

    #[test]
    fn model_opens_the_block() {
        let (r, c) = every_cut(ReasoningStart::MayOpen, "<think>2+2 is 4.</think>\n\nThe answer is 4.");
        assert_eq!((r.as_str(), c.as_str()), ("2+2 is 4.", "The answer is 4."));
        let (r, c) = every_cut(ReasoningStart::MayOpen, "\n<think>\nhm\n</think>ok");
        assert_eq!((r.as_str(), c.as_str()), ("\nhm\n", "ok"));
    }

    #[test]
    fn template_opens_the_block() {
        let (r, c) = every_cut(ReasoningStart::Inside, "Let me think.</think>Paris.");
        assert_eq!((r.as_str(), c.as_str()), ("Let me think.", "Paris."));
    }

    #[test]
    fn unclosed_block_stays_reasoning() {
        let (r, c) = every_cut(ReasoningStart::Inside, "still thinking </thi");
        assert_eq!((r.as_str(), c.as_str()), ("still thinking </thi", ""));
        let (r, c) = every_cut(ReasoningStart::MayOpen, "<think>never closed");
        assert_eq!((r.as_str(), c.as_str()), ("never closed", ""));
    }

    #[test]
    fn thinking_off_is_all_content() {
        let text = "<think>not a block</think> because thinking is off";
        assert_eq!(every_cut(ReasoningStart::Off, text), (String::new(), text.to_owned()));
        // A reply that does not start with the block is content, even if it mentions tags later.
        let text = "Use <think> tags like </think> this.";
        assert_eq!(every_cut(ReasoningStart::MayOpen, text), (String::new(), text.to_owned()));
        // A lone partial tag at the end of a short reply is content, not lost.
        assert_eq!(run(ReasoningStart::MayOpen, &["<thi"]), (String::new(), "<thi".to_owned()));
    }

    #[test]
    fn start_is_detected_from_the_rendered_prompt() {
        let glm = include_str!("../../tests/fixtures/glm5/chat/chat_template.jinja");
        assert_eq!(ReasoningStart::detect(glm, "[gMASK]<sop><|user|>\nhi<|assistant|>\n"), ReasoningStart::MayOpen);
        assert_eq!(
            ReasoningStart::detect(glm, "[gMASK]<sop><|user|>\nhi<|assistant|>\n<think></think>\n"),
            ReasoningStart::Off
        );
        assert_eq!(ReasoningStart::detect("{{ '<think>' }}", "<|assistant|><think>\n"), ReasoningStart::Inside);
        assert_eq!(ReasoningStart::detect("{{ messages }}", "<|im_start|>assistant\n"), ReasoningStart::Off);
    }

    #[test]
    fn partial_suffixes() {
        assert_eq!(partial_suffix("abc</th", THINK_CLOSE), 4);
        assert_eq!(partial_suffix("abc<", THINK_CLOSE), 1);
        assert_eq!(partial_suffix("abc", THINK_CLOSE), 0);
        assert_eq!(partial_suffix("é<", THINK_CLOSE), 1);
    }
}
