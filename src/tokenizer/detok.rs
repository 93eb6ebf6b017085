//! Incremental detokenization: streaming text from generated token ids, with the "prefix offset /
//! read offset" method of HF TGI and vLLM. Owns the ids of a small trailing window and nothing
//! else; the tokenizer is shared.
//!
//! Each push decodes `ids[prefix..]` and compares it with `decode(ids[prefix..read])` (the text of
//! the last emitted chunk). Decoding with that chunk in front keeps context-dependent pieces right
//! (SentencePiece's leading-space strip applies to the chunk, not to the new token), and text is
//! only released when it does not end in U+FFFD, so a multi-byte character split across tokens
//! (byte-level BPE, byte fallback) is never emitted half-done. The pieces concatenate to
//! `decode(all_ids)`.

use std::sync::Arc;

use super::{TokenizerBundle, TokenizerError};

/// Consecutive tokens that add no text (e.g. skipped special tokens) grow the window; past this
/// many the window is cut so a degenerate stream cannot make each push quadratic.
const MAX_WINDOW: usize = 64;
/// Tokens kept in front of the pending ones when the window is cut.
const CUT_CONTEXT: usize = 4;

pub struct IncrementalDetokenizer {
    tokenizer: Arc<TokenizerBundle>,
    skip_special: bool,
    /// Ids from the prefix offset on; older ids never influence new text.
    ids: Vec<u32>,
    /// `ids[..read]` is the already-emitted chunk whose text is `prefix_text`.
    read: usize,
    prefix_text: String,
}

impl IncrementalDetokenizer {
    pub fn new(tokenizer: Arc<TokenizerBundle>, skip_special: bool) -> Self {
        Self { tokenizer, skip_special, ids: Vec::new(), read: 0, prefix_text: String::new() }
    }

    /// Feed one generated id; returns the text it completes (often empty while a character is
    /// still incomplete).
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        self.ids.push(id);
        let text = self.tokenizer.decode(&self.ids, self.skip_special)?;
        if text.len() > self.prefix_text.len() && !text.ends_with(char::REPLACEMENT_CHARACTER) {
            return Ok(self.emit(text));
        }
        if self.ids.len() > MAX_WINDOW && !text.ends_with(char::REPLACEMENT_CHARACTER) {
            // Nothing new for a long run of tokens: restart the window near the end. The text so
            // far is all emitted (it equals `prefix_text` or is shorter), so only context is lost.
            tracing::debug!(window = self.ids.len(), "detokenizer window cut after tokens that added no text");
            self.ids.drain(..self.ids.len() - CUT_CONTEXT);
            self.read = self.ids.len();
            self.prefix_text = self.tokenizer.decode(&self.ids, self.skip_special)?;
        }
        Ok(String::new())
    }

    /// End of generation: release whatever is held back, U+FFFD included (that is what
    /// `decode(all_ids)` shows for bytes that never formed a character).
    pub fn finish(&mut self) -> Result<String, TokenizerError> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let text = self.tokenizer.decode(&self.ids, self.skip_special)?;
        Ok(self.emit(text))
    }

    /// Emits `text` (the decode of the whole window) minus the already-emitted chunk, and makes
    /// the pending ids the new chunk.
    fn emit(&mut self, text: String) -> String {
        let new = match text.strip_prefix(self.prefix_text.as_str()) {
            Some(new) => new.to_owned(),
            None => {
                // The decoder rewrote earlier text given more context; emitted text cannot be
                // taken back, so send what differs after the common prefix.
                let common = common_prefix_len(&self.prefix_text, &text);
                tracing::debug!(prefix = %self.prefix_text, text = %text, "detokenizer prefix changed");
                text[common..].to_owned()
            }
        };
        self.ids.drain(..self.read);
        self.read = self.ids.len();
        // The new chunk's text is the decode of the just-emitted ids alone: the next push compares
        // against exactly that.
        self.prefix_text = match self.tokenizer.decode(&self.ids, self.skip_special) {
            Ok(t) => t,
            Err(e) => {
                // Cannot happen for ids that just decoded inside a longer window; keep going with
                // an empty prefix rather than losing the emitted text.
                tracing::warn!(error = %e, "detokenizer could not decode its own chunk");
                String::new()
            }
        };
        new
    }
}

/// Byte length of the longest common prefix of `a` and `b`, on a char boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
    a.char_indices().zip(b.chars()).find(|((_, x), y)| x != y).map_or(a.len().min(b.len()), |((i, _), _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::path::PathBuf;

    /// GPT-2's byte → printable-char map, which byte-level BPE vocabularies are written in.
    fn bytes_to_unicode() -> BTreeMap<u8, char> {
        let printable: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
        let mut map = BTreeMap::new();
        for &b in &printable {
            map.insert(b as u8, char::from_u32(b).unwrap());
        }
        let mut n = 0;
        for b in 0u32..256 {
            if !printable.contains(&b) {
                map.insert(b as u8, char::from_u32(256 + n).unwrap());
                n += 1;
            }
        }
        map
    }

    /// A byte-level BPE tokenizer (as GPT-2 / SmolLM2 use) with extra tokens whose bytes cut
    /// characters in awkward places. Returns the bundle and a name → id table for the extras.
    fn byte_level_tokenizer() -> (Arc<TokenizerBundle>, BTreeMap<&'static str, u32>) {
        let b2u = bytes_to_unicode();
        let enc = |bytes: &[u8]| -> String { bytes.iter().map(|b| b2u[b]).collect() };
        let mut vocab: Vec<String> = (0u8..=255).map(|b| enc(&[b])).collect();
        let mut merges: Vec<(String, String)> = Vec::new();
        let mut extras = BTreeMap::new();
        // Each extra token is a merge of two existing tokens (so BPE can also produce it).
        let mut add = |name: &'static str, left: &[u8], right: &[u8]| {
            let (l, r) = (enc(left), enc(right));
            merges.push((l.clone(), r.clone()));
            extras.insert(name, vocab.len() as u32);
            vocab.push(format!("{l}{r}"));
        };
        let grin = "😀".as_bytes(); // F0 9F 98 80
        let ni = "你".as_bytes(); // E4 BD A0
        let hao = "好".as_bytes(); // E5 A5 BD
        add("grin_head", &grin[..1], &grin[1..2]); // F0 9F
        add("grin_tail", &grin[2..3], &grin[3..]); // 98 80
        add("ni_tail_hao_head", &ni[2..], &hao[..1]); // A0 E5: end of one char, start of the next
        add("space_h", b" ", b"h");
        add("space_hi", b" h", b"i");
        let json = serde_json::json!({
            "version": "1.0",
            "added_tokens": [
                {"id": vocab.len(), "content": "<|im_end|>", "single_word": false, "lstrip": false,
                 "rstrip": false, "normalized": false, "special": true}
            ],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab.iter().enumerate().map(|(i, t)| (t.clone(), serde_json::Value::from(i))).collect::<serde_json::Map<String, serde_json::Value>>(),
                "merges": merges.iter().map(|(a, b)| vec![a.clone(), b.clone()]).collect::<Vec<_>>(),
            }
        });
        let end_id = vocab.len() as u32;
        extras.insert("im_end", end_id);
        let tokenizer: tokenizers::Tokenizer = json.to_string().parse().expect("test tokenizer json");
        let bundle = TokenizerBundle {
            tokenizer,
            origin: PathBuf::from("<test byte-level BPE>"),
            chat_template: None,
            bos_token: None,
            eos_token: Some("<|im_end|>".into()),
            bos_token_id: None,
            eos_token_ids: vec![end_id],
            add_bos_token: false,
        };
        (Arc::new(bundle), extras)
    }

    /// Streams `ids`, checks the invariants and returns the pieces (the last one from `finish`).
    fn stream(tok: &Arc<TokenizerBundle>, ids: &[u32], skip_special: bool) -> Vec<String> {
        let mut d = IncrementalDetokenizer::new(tok.clone(), skip_special);
        let mut pieces: Vec<String> = ids.iter().map(|&id| d.push(id).expect("push")).collect();
        pieces.push(d.finish().expect("finish"));
        let whole = tok.decode(ids, skip_special).expect("decode");
        assert_eq!(pieces.concat(), whole, "concatenation must equal decode(all) for {ids:?}: {pieces:?}");
        if !whole.contains(char::REPLACEMENT_CHARACTER) {
            for p in &pieces {
                assert!(!p.contains(char::REPLACEMENT_CHARACTER), "U+FFFD mid-stream in {pieces:?} for {ids:?}");
            }
        }
        assert_eq!(d.finish().unwrap(), "", "finish is idempotent");
        pieces
    }

    fn byte_ids(s: &str) -> Vec<u32> {
        // In this vocabulary the first 256 ids are the bytes themselves.
        s.bytes().map(u32::from).collect()
    }

    #[test]
    fn emoji_split_into_single_bytes_waits_for_the_last_byte() {
        let (tok, _) = byte_level_tokenizer();
        let ids = byte_ids("a😀b");
        let pieces = stream(&tok, &ids, false);
        assert_eq!(pieces, vec!["a", "", "", "", "😀", "b", ""]);
    }

    #[test]
    fn emoji_split_across_merged_tokens() {
        let (tok, x) = byte_level_tokenizer();
        let ids = vec![x["grin_head"], x["grin_tail"], x["grin_head"], x["grin_tail"]];
        assert_eq!(stream(&tok, &ids, false), vec!["", "😀", "", "😀", ""]);
    }

    #[test]
    fn token_ending_one_char_and_starting_the_next() {
        let (tok, x) = byte_level_tokenizer();
        // 你 = E4 BD | A0 E5 | A5 BD = 好: the middle token completes 你 and starts 好.
        let ids = vec![0xE4, 0xBD, x["ni_tail_hao_head"], 0xA5, 0xBD];
        let pieces = stream(&tok, &ids, false);
        assert_eq!(pieces, vec!["", "", "", "", "你好", ""]);
    }

    #[test]
    fn ascii_is_emitted_immediately_and_spaces_survive() {
        let (tok, x) = byte_level_tokenizer();
        let ids = vec![b'H' as u32, x["space_hi"], x["space_h"], b'!' as u32];
        assert_eq!(stream(&tok, &ids, false), vec!["H", " hi", " h", "!", ""]);
    }

    #[test]
    fn special_tokens_kept_or_skipped() {
        let (tok, x) = byte_level_tokenizer();
        let mut ids = byte_ids("ok");
        ids.push(x["im_end"]);
        ids.extend(byte_ids("然"));
        let kept = stream(&tok, &ids, false);
        assert_eq!(kept.concat(), "ok<|im_end|>然");
        let skipped = stream(&tok, &ids, true);
        assert_eq!(skipped.concat(), "ok然");
    }

    #[test]
    fn incomplete_bytes_at_the_end_are_flushed_by_finish() {
        let (tok, _) = byte_level_tokenizer();
        let ids = vec![b'x' as u32, 0xF0, 0x9F];
        let pieces = stream(&tok, &ids, false);
        assert_eq!(pieces[..3], ["x", "", ""]);
        assert_eq!(pieces[3], "\u{FFFD}", "finish releases what decode(all) shows");
    }

    #[test]
    fn invalid_bytes_mid_stream_are_released_once_followed_by_text() {
        let (tok, _) = byte_level_tokenizer();
        // A lone continuation byte never becomes a character.
        let ids = vec![b'a' as u32, 0x80, b'b' as u32, 0xE4, b'c' as u32];
        let pieces = stream(&tok, &ids, false);
        assert_eq!(pieces.concat(), "a\u{FFFD}b\u{FFFD}c");
    }

    #[test]
    fn long_runs_of_empty_tokens_stay_correct() {
        let (tok, x) = byte_level_tokenizer();
        let mut ids = byte_ids("start ");
        ids.extend(std::iter::repeat_n(x["im_end"], 3 * MAX_WINDOW));
        ids.extend(byte_ids("end 😀"));
        let pieces = stream(&tok, &ids, true);
        assert_eq!(pieces.concat(), "start end 😀");
    }

    #[test]
    fn random_byte_level_splits_of_mixed_scripts() {
        let (tok, _) = byte_level_tokenizer();
        let texts = ["héllo wörld 😀👍🏽 你好世界 こんにちは", "🇯🇵 flag, ZWJ 👩‍👩‍👧 family", "Ωmega ∑ ∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"];
        for text in texts {
            // BPE encodes with the merges above; the ids mix single bytes and merged tokens.
            let encoded = tok.encode(text, false).expect("encode");
            assert_eq!(tok.decode(&encoded, false).unwrap(), text, "test tokenizer round-trips");
            stream(&tok, &encoded, false);
            stream(&tok, &byte_ids(text), false);
        }
    }

    /// The real SmolLM2 tokenizer, built from the GGUF the engine embeds.
    #[test]
    fn smollm2_gguf_tokenizer_streams_exactly() {
        let Some(path) = std::env::var_os("SHELFSERVE_DEFAULT_GGUF").map(PathBuf::from) else {
            eprintln!("SKIPPED smollm2_gguf_tokenizer_streams_exactly: SHELFSERVE_DEFAULT_GGUF is not set");
            return;
        };
        if !path.exists() {
            eprintln!("SKIPPED smollm2_gguf_tokenizer_streams_exactly: {} does not exist", path.display());
            return;
        }
        let g = crate::model::gguf::GgufFile::open(&path).expect("open GGUF");
        let tok = Arc::new(crate::tokenizer::gguf_vocab::tokenizer_from_gguf(&g, &path).expect("GGUF tokenizer"));
        let texts = [
            "Hello, world! How are you today?",
            "Emoji: 😀🎉👍🏽 and a family 👩‍👩‍👧 in one go.",
            "中文：你好，世界。日本語：こんにちは。한국어: 안녕하세요",
            "Code:\n    fn main() { println!(\"{}\", 42); }\n\n",
            "Mixed 🇯🇵🇫🇷 flags, math ∑∫√ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢.",
        ];
        let mut saw_split_char = false;
        for text in texts {
            let ids = tok.encode(text, false).expect("encode");
            assert_eq!(tok.decode(&ids, false).unwrap(), text);
            let pieces = stream(&tok, &ids, false);
            // Some token must end mid-character (an empty piece) for this test to exercise the hold-back.
            saw_split_char |= pieces[..ids.len()].iter().any(|p| p.is_empty());
            // Special tokens of the chat format, skipped and kept.
            let mut chat = tok.encode("<|im_start|>assistant\n", false).expect("encode");
            chat.extend(&ids);
            chat.extend(tok.encode("<|im_end|>", false).expect("encode"));
            stream(&tok, &chat, true);
            stream(&tok, &chat, false);
        }
        assert!(saw_split_char, "no text split a character across tokens; the test lost its point");
    }
}
