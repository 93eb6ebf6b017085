//! Our tokenizer as llguidance sees it: every token id's bytes in a `toktrie::TokTrie` (special
//! tokens carry the trie's marker byte, so text can never spell them and a grammar names them as
//! `<[id]>`), and text → ids through the same HF tokenizer the server encodes prompts with.

use std::sync::Arc;

use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use super::GrammarError;
use crate::tokenizer::TokenizerBundle;

/// The vocabulary of one model, shared by every grammar compiled for it.
pub struct GrammarVocab {
    trie: TokTrie,
    tokenizer: Arc<TokenizerBundle>,
}

impl GrammarVocab {
    /// Token bytes are read from the tokenizer's own JSON (byte-level BPE and SentencePiece
    /// byte-fallback vocabularies; a GGUF vocabulary has been converted to one of those).
    /// Every end-of-generation id of the bundle is an EOS for the grammar.
    pub fn new(tokenizer: Arc<TokenizerBundle>) -> Result<Self, GrammarError> {
        let json = tokenizer.tokenizer.to_string(false).map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        let value: serde_json::Value =
            serde_json::from_str(&json).map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        // llguidance asserts on a malformed byte-fallback token; a panic here must not take the
        // request's thread down.
        let bytes = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            llguidance::token_bytes_from_tokenizer_json(&value)
        }))
        .map_err(|_| GrammarError::Vocabulary("malformed byte-fallback token in the vocabulary".into()))?
        .map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        let vocab_size = bytes.len().max(tokenizer.tokenizer.get_vocab_size(true));
        let mut words = bytes;
        words.resize(vocab_size, Vec::new());
        let eos = tokenizer.eos_token_ids.clone();
        let Some(&first_eos) = eos.first() else {
            return Err(GrammarError::Vocabulary("the tokenizer names no end-of-generation token".into()));
        };
        let mut info = TokRxInfo::new(vocab_size as u32, first_eos);
        info.tok_bos = tokenizer.bos_token_id;
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        Ok(Self { trie, tokenizer })
    }

    pub fn tok_env(self: &Arc<Self>) -> TokEnv {
        self.clone()
    }

    pub fn vocab_size(&self) -> usize {
        self.trie.vocab_size()
    }

    /// The id of `text` when it is exactly one special (added) token, as a grammar must name it.
    pub fn special_token_id(&self, text: &str) -> Option<u32> {
        let id = self.tokenizer.tokenizer.token_to_id(text)?;
        self.trie.is_special_token(id).then_some(id)
    }

    /// Ids of `text` as the model writes it (special tokens included).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.tokenizer.encode(text, false).unwrap_or_default()
    }
}

impl TokenizerEnv for GrammarVocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.tokenizer.encode(&String::from_utf8_lossy(s), false).unwrap_or_default()
    }
}
