//! Text ↔ token ids: the HF `tokenizers` tokenizer (loaded from `tokenizer.json` or built from
//! GGUF metadata), special tokens, end-of-generation ids, incremental detokenization and chat
//! templates, and (`literal`) the encoding of conversations in which only the template's markup
//! becomes control tokens. Owns no model weights and no serving state.

pub mod bounded;
pub mod chat;
pub mod detok;
pub mod gguf_vocab;
pub mod literal;
pub mod stop;

use std::path::PathBuf;

/// A tokenizer plus the special-token facts the engine needs.
#[derive(Clone)]
pub struct TokenizerBundle {
    pub tokenizer: tokenizers::Tokenizer,
    /// Where it came from, for messages.
    pub origin: PathBuf,
    /// Jinja chat template (HF `tokenizer_config.json` or GGUF `tokenizer.chat_template`).
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub bos_token_id: Option<u32>,
    /// Every id that ends generation (eos, plus end-of-turn tokens such as `<|im_end|>`).
    pub eos_token_ids: Vec<u32>,
    /// Whether plain (non-chat) prompts get BOS prepended.
    pub add_bos_token: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
}

impl TokenizerBundle {
    /// Encode text. `add_special` adds BOS (etc.) as the model's post-processor says; chat
    /// prompts are rendered with their special tokens already and use `false`.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let enc = self.tokenizer.encode(text, add_special).map_err(|e| TokenizerError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.tokenizer.decode(ids, skip_special).map_err(|e| TokenizerError::Tokenizer(e.to_string()))
    }

    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_token_ids.contains(&id)
    }
}
