//! What one token id looks like to a client that asked for logprobs: its text and its exact
//! bytes (OpenAI's `bytes`, which lets clients rebuild characters split across tokens).
//!
//! Byte-level BPE vocabularies (GPT-2, SmolLM2, Llama 3, Qwen) store each byte as a printable
//! stand-in character, and SentencePiece vocabularies store bytes as `<0xNN>` and spaces as `▁`;
//! both are reversed here so `bytes` are the token's real bytes even when they are not valid
//! UTF-8 on their own. Other tokenizers fall back to decoding the id alone. Owns nothing but the
//! reverse byte table.

use std::collections::HashMap;
use std::sync::Arc;

use tokenizers::decoders::DecoderWrapper;

use crate::tokenizer::TokenizerBundle;

#[derive(Debug)]
enum Scheme {
    /// Stand-in character → byte (GPT-2's `bytes_to_unicode`, reversed).
    ByteLevel(HashMap<char, u8>),
    SentencePiece,
    /// Decode the id alone and take the text's bytes.
    Decode,
}

/// Token id → (text, bytes), for one tokenizer.
pub struct TokenPieces {
    tokenizer: Arc<TokenizerBundle>,
    scheme: Scheme,
}

impl TokenPieces {
    pub fn new(tokenizer: Arc<TokenizerBundle>) -> Self {
        let scheme = match tokenizer.tokenizer.get_decoder() {
            Some(d) if uses(d, &|d| matches!(d, DecoderWrapper::ByteLevel(_))) => Scheme::ByteLevel(unicode_to_bytes()),
            Some(d) if uses(d, &|d| matches!(d, DecoderWrapper::Metaspace(_) | DecoderWrapper::ByteFallback(_))) => {
                Scheme::SentencePiece
            }
            _ => Scheme::Decode,
        };
        Self { tokenizer, scheme }
    }

    /// The token's text (lossy where its bytes are not UTF-8 by themselves) and its bytes.
    pub fn piece(&self, id: u32) -> (String, Vec<u8>) {
        let bytes = self.bytes(id);
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    }

    fn bytes(&self, id: u32) -> Vec<u8> {
        let tok = &self.tokenizer.tokenizer;
        let added = tok.get_added_vocabulary().simple_id_to_token(id);
        if let Some(content) = added {
            // Added tokens are stored verbatim, not in the model's byte encoding.
            return content.into_bytes();
        }
        match (&self.scheme, tok.id_to_token(id)) {
            (Scheme::ByteLevel(table), Some(raw)) => {
                let mapped: Option<Vec<u8>> = raw.chars().map(|c| table.get(&c).copied()).collect();
                mapped.unwrap_or_else(|| raw.into_bytes())
            }
            (Scheme::SentencePiece, Some(raw)) => sentencepiece_bytes(&raw),
            _ => self.tokenizer.decode(&[id], false).map(String::into_bytes).unwrap_or_default(),
        }
    }
}

fn uses(d: &DecoderWrapper, pred: &dyn Fn(&DecoderWrapper) -> bool) -> bool {
    match d {
        DecoderWrapper::Sequence(s) => s.get_decoders().iter().any(|d| uses(d, pred)),
        other => pred(other),
    }
}

fn sentencepiece_bytes(raw: &str) -> Vec<u8> {
    // Byte-fallback pieces look exactly like `<0x0A>`.
    if raw.len() == 6 && raw.starts_with("<0x") && raw.ends_with('>') {
        if let Ok(b) = u8::from_str_radix(&raw[3..5], 16) {
            return vec![b];
        }
    }
    raw.replace('\u{2581}', " ").into_bytes()
}

/// GPT-2's byte → printable character table, reversed.
fn unicode_to_bytes() -> HashMap<char, u8> {
    let mut printable: Vec<u8> = (b'!'..=b'~').chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut chars: Vec<u32> = printable.iter().map(|&b| u32::from(b)).collect();
    let mut extra = 0;
    for b in 0..=255u8 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + extra);
            extra += 1;
        }
    }
    printable.into_iter().zip(chars).filter_map(|(b, c)| char::from_u32(c).map(|c| (c, b))).collect()
}

/// Logprobs must be JSON numbers; a `-inf` (a token the bias or a mask ruled out) is reported
/// as -9999, like vLLM.
pub fn finite_logprob(lp: f32) -> f32 {
    if lp.is_finite() {
        lp
    } else if lp > 0.0 {
        0.0
    } else {
        -9999.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn bundle(json: serde_json::Value) -> Arc<TokenizerBundle> {
        let tokenizer: tokenizers::Tokenizer = json.to_string().parse().expect("tokenizer json");
        Arc::new(TokenizerBundle {
            tokenizer,
            origin: PathBuf::from("<test>"),
            chat_template: None,
            bos_token: None,
            eos_token: None,
            bos_token_id: None,
            eos_token_ids: vec![],
            add_bos_token: false,
        })
    }

    #[test]
    fn byte_level_tokens_give_their_real_bytes() {
        let table = unicode_to_bytes();
        assert_eq!(table.len(), 256);
        let mut b2u: Vec<(u8, char)> = table.iter().map(|(&c, &b)| (b, c)).collect();
        b2u.sort();
        let enc = |bytes: &[u8]| -> String { bytes.iter().map(|&b| b2u[b as usize].1).collect() };
        // "é" is C3 A9: one token holding only the first byte, one holding " é".
        let vocab = serde_json::json!({ enc(b"\xC3"): 0, enc(b" \xC3\xA9"): 1, enc(b"a"): 2 });
        let tok = bundle(serde_json::json!({
            "version": "1.0",
            "added_tokens": [{"id": 3, "content": "<|im_end|>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                      "ignore_merges": false, "vocab": vocab, "merges": []}
        }));
        let p = TokenPieces::new(tok);
        assert_eq!(p.piece(0), ("\u{FFFD}".to_owned(), vec![0xC3]));
        assert_eq!(p.piece(1), (" é".to_owned(), vec![b' ', 0xC3, 0xA9]));
        assert_eq!(p.piece(3), ("<|im_end|>".to_owned(), b"<|im_end|>".to_vec()));
    }

    #[test]
    fn sentencepiece_pieces() {
        assert_eq!(sentencepiece_bytes("<0x0A>"), vec![b'\n']);
        assert_eq!(sentencepiece_bytes("\u{2581}hello"), b" hello".to_vec());
        assert_eq!(sentencepiece_bytes("<0xZZ>"), b"<0xZZ>".to_vec());
    }

    #[test]
    fn non_finite_logprobs_become_numbers() {
        assert_eq!(finite_logprob(f32::NEG_INFINITY), -9999.0);
        assert_eq!(finite_logprob(f32::NAN), -9999.0);
        assert_eq!(finite_logprob(-1.5), -1.5);
    }
}
