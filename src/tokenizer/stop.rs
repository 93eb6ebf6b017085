//! OpenAI `stop` strings matched on streamed text across token boundaries. Owns only the text it
//! must hold back (a suffix that could still become a stop string); knows nothing of tokens.
//!
//! The result does not depend on how the text is chunked: generation stops at the first point
//! where the text so far contains any stop string (the earliest *end*; at equal ends, the earliest
//! start, i.e. the longest match), exactly as if the text arrived one character at a time.

/// What one [`StopMatcher::push`] produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopOutcome {
    /// Keep generating; `emit` is safe to send (possibly empty while a candidate is held back).
    Continue { emit: String },
    /// A stop string completed: `emit` is the text before it (the stop itself is never sent) and
    /// generation should end.
    Stopped { emit: String, matched: String },
}

#[derive(Clone, Debug)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Longest suffix of the text seen so far that is a proper prefix of some stop string.
    held: String,
    /// The stop that ended generation; later pushes are ignored.
    matched: Option<String>,
}

impl StopMatcher {
    /// Empty stop strings are dropped: they would match before any text.
    pub fn new(stops: Vec<String>) -> Self {
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        Self { stops, held: String::new(), matched: None }
    }

    pub fn is_stopped(&self) -> bool {
        self.matched.is_some()
    }

    /// Feed the next piece of text. After `Stopped`, every further push returns `Stopped` again
    /// with empty `emit` (the text after a stop is discarded).
    pub fn push(&mut self, text: &str) -> StopOutcome {
        if let Some(m) = &self.matched {
            return StopOutcome::Stopped { emit: String::new(), matched: m.clone() };
        }
        if self.stops.is_empty() {
            return StopOutcome::Continue { emit: text.to_owned() };
        }
        let mut buf = std::mem::take(&mut self.held);
        buf.push_str(text);

        if let Some((start, idx)) = self.earliest_match(&buf) {
            let matched = self.stops[idx].clone();
            buf.truncate(start);
            self.matched = Some(matched.clone());
            return StopOutcome::Stopped { emit: buf, matched };
        }
        let keep = self.longest_partial_suffix(&buf);
        self.held = buf.split_off(buf.len() - keep);
        StopOutcome::Continue { emit: buf }
    }

    /// End of generation without a stop: release what was held back.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Start offset and index of the stop that completes first in `buf`; ties on the end go to the
    /// longer stop (the one starting earlier).
    fn earliest_match(&self, buf: &str) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize, usize)> = None; // (end, start, idx)
        for (idx, stop) in self.stops.iter().enumerate() {
            if let Some(start) = buf.find(stop.as_str()) {
                let cand = (start + stop.len(), start, idx);
                if best.is_none_or(|b| (cand.0, cand.1) < (b.0, b.1)) {
                    best = Some(cand);
                }
            }
        }
        best.map(|(_, start, idx)| (start, idx))
    }

    /// Byte length of the longest suffix of `buf` that is a proper prefix of some stop string.
    /// A byte-wise match starting at a char boundary of the stop also starts at one in `buf`, so
    /// the split is always valid UTF-8.
    fn longest_partial_suffix(&self, buf: &str) -> usize {
        let mut best = 0;
        for stop in &self.stops {
            let max = (stop.len() - 1).min(buf.len());
            for len in (best + 1..=max).rev() {
                if stop.is_char_boundary(len) && buf.as_bytes().ends_with(&stop.as_bytes()[..len]) {
                    best = len;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(stops.iter().map(|s| s.to_string()).collect())
    }

    fn cont(s: &str) -> StopOutcome {
        StopOutcome::Continue { emit: s.to_string() }
    }

    fn stopped(emit: &str, matched: &str) -> StopOutcome {
        StopOutcome::Stopped { emit: emit.to_string(), matched: matched.to_string() }
    }

    /// Feeds `pieces` and returns (all emitted text, matched stop), flushing with `finish` when no
    /// stop matched.
    fn run(stops: &[&str], pieces: &[&str]) -> (String, Option<String>) {
        let mut m = matcher(stops);
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                StopOutcome::Continue { emit } => out.push_str(&emit),
                StopOutcome::Stopped { emit, matched } => {
                    out.push_str(&emit);
                    assert!(m.is_stopped());
                    assert_eq!(m.finish(), "", "nothing is held after a stop");
                    return (out, Some(matched));
                }
            }
        }
        out.push_str(&m.finish());
        (out, None)
    }

    /// Reference: the first position (in chars) at which the text so far contains a stop.
    fn reference(stops: &[&str], text: &str) -> (String, Option<String>) {
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        for &(i, c) in &chars {
            let end = i + c.len_utf8();
            let so_far = &text[..end];
            // Longest stop ending here (earliest start).
            let mut hit: Option<&str> = None;
            for s in stops.iter().filter(|s| !s.is_empty()) {
                if so_far.ends_with(*s) && hit.is_none_or(|h| s.len() > h.len()) {
                    hit = Some(s);
                }
            }
            if let Some(s) = hit {
                return (text[..end - s.len()].to_string(), Some(s.to_string()));
            }
        }
        (text.to_string(), None)
    }

    #[test]
    fn no_stops_passes_text_through() {
        let mut m = matcher(&[]);
        assert_eq!(m.push("hello"), cont("hello"));
        assert_eq!(m.finish(), "");
        let mut m = matcher(&[""]);
        assert_eq!(m.push("a"), cont("a"), "empty stop strings are ignored");
    }

    #[test]
    fn stop_inside_one_push() {
        let mut m = matcher(&["END"]);
        assert_eq!(m.push("abcENDdef"), stopped("abc", "END"));
        assert_eq!(m.push("more"), stopped("", "END"), "pushes after the stop are ignored");
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn stop_at_start_and_end_of_push() {
        assert_eq!(matcher(&["x"]).push("xyz"), stopped("", "x"));
        assert_eq!(matcher(&["yz"]).push("xyz"), stopped("x", "yz"));
    }

    #[test]
    fn stop_split_over_three_pushes() {
        let mut m = matcher(&["<|end|>"]);
        assert_eq!(m.push("Hello <|"), cont("Hello "));
        assert_eq!(m.push("en"), cont(""));
        assert_eq!(m.push("d|> tail"), stopped("", "<|end|>"));
    }

    #[test]
    fn false_start_is_released() {
        let mut m = matcher(&["<|end|>"]);
        assert_eq!(m.push("a <|e"), cont("a "));
        assert_eq!(m.push("x"), cont("<|ex"));
        assert_eq!(m.push("<"), cont(""));
        assert_eq!(m.finish(), "<");
    }

    #[test]
    fn held_suffix_restarts_inside_itself() {
        // "aab": after "aa" the held "aa" fails at "a a a", but the suffix "aa" is again a prefix.
        let mut m = matcher(&["aab"]);
        assert_eq!(m.push("aa"), cont(""));
        assert_eq!(m.push("a"), cont("a"));
        assert_eq!(m.push("b!"), stopped("", "aab"));
    }

    #[test]
    fn overlapping_candidates() {
        // "abcd" is pending when "bc" completes: the earlier-ending stop wins.
        let mut m = matcher(&["abcd", "bc"]);
        assert_eq!(m.push("xab"), cont("x"));
        assert_eq!(m.push("c"), stopped("a", "bc"));
        // Both complete at the same character: the longer (earlier start) one wins.
        assert_eq!(run(&["bcd", "abcd"], &["xab", "cd"]), ("x".to_string(), Some("abcd".to_string())));
        assert_eq!(run(&["cd", "abcd"], &["xabcd"]), ("x".to_string(), Some("abcd".to_string())));
    }

    #[test]
    fn stop_that_is_a_prefix_of_another() {
        // "ab" completes before "abc" could: stop at "ab" whatever the chunking.
        assert_eq!(run(&["abc", "ab"], &["xabc"]), ("x".to_string(), Some("ab".to_string())));
        assert_eq!(run(&["abc", "ab"], &["xa", "bc"]), ("x".to_string(), Some("ab".to_string())));
        assert_eq!(run(&["ab", "abc"], &["x", "a", "b"]), ("x".to_string(), Some("ab".to_string())));
        // The longer one is held while only its prefix is seen.
        let mut m = matcher(&["abc", "abd"]);
        assert_eq!(m.push("zab"), cont("z"));
        assert_eq!(m.push("d"), stopped("", "abd"));
    }

    #[test]
    fn unicode_is_split_only_on_char_boundaries() {
        let mut m = matcher(&["🛑stop", "終わり"]);
        assert_eq!(m.push("日本語🛑"), cont("日本語"));
        assert_eq!(m.push("st"), cont(""));
        assert_eq!(m.push("op"), stopped("", "🛑stop"));
        let mut m = matcher(&["終わり"]);
        assert_eq!(m.push("これで終"), cont("これで"));
        assert_eq!(m.push("わ"), cont(""));
        assert_eq!(m.push("る"), cont("終わる"));
        assert_eq!(m.push("終わり。"), stopped("", "終わり"));
        // A stop sharing a leading byte with other text (é = C3 A9, ã = C3 A3) is never held by bytes alone.
        let mut m = matcher(&["é!"]);
        assert_eq!(m.push("ã"), cont("ã"));
        assert_eq!(m.push("é"), cont(""));
        assert_eq!(m.finish(), "é");
    }

    #[test]
    fn finish_flushes_held_text() {
        let mut m = matcher(&["\n\nUser:"]);
        assert_eq!(m.push("answer.\n\nUs"), cont("answer."));
        assert_eq!(m.finish(), "\n\nUs");
        assert_eq!(m.finish(), "", "finish drains");
    }

    #[test]
    fn any_chunking_matches_the_char_by_char_reference() {
        let stops: &[&[&str]] = &[
            &["abc", "ab"],
            &["abcd", "bc"],
            &["aab", "b a"],
            &["</s>", "<|im_end|>", "\n\n"],
            &["終わり", "わり!"],
            &["🙂🙂", "🙂x"],
        ];
        let texts = [
            "xx aab b a abcd",
            "zzabzzabc",
            "hello </s world <|im_end|> after",
            "line\nline\n\nnext",
            "これで終わ終わり!",
            "🙂y🙂🙂x",
            "nothing to see here",
            "a",
            "",
        ];
        // Deterministic pseudo-random chunkings at char boundaries (no RNG state between tests).
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for stop_set in stops {
            for text in texts {
                let want = reference(stop_set, text);
                let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
                for _ in 0..40 {
                    let mut pieces = Vec::new();
                    let mut last = 0;
                    for &b in &bounds[1..] {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        if x.is_multiple_of(3) || b == text.len() {
                            pieces.push(&text[last..b]);
                            last = b;
                        }
                    }
                    assert_eq!(run(stop_set, &pieces), want, "stops {stop_set:?}, pieces {pieces:?}");
                }
                // One char at a time and all at once.
                let chars: Vec<String> = text.chars().map(String::from).collect();
                let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
                assert_eq!(run(stop_set, &refs), want);
                assert_eq!(run(stop_set, &[text]), want);
            }
        }
    }

    #[test]
    fn held_text_never_exceeds_longest_stop() {
        let mut m = matcher(&["abcdef"]);
        for _ in 0..100 {
            let _ = m.push("abcde");
            assert!(m.held.len() < 6);
        }
    }
}
