//! Structured outputs: a grammar (JSON schema, any JSON object, Lark, regex, a list of choices, or
//! a forced tool call in a model family's syntax) compiled by `llguidance` over our vocabulary,
//! and the per-request matcher that says which tokens may come next.
//!
//! - [`vocab`]: the bridge from a [`TokenizerBundle`](crate::tokenizer::TokenizerBundle) (HF
//!   `tokenizers`, GGUF vocabularies included, since those are converted to one) to `toktrie`.
//! - [`spec`]: what a request asks for ([`GrammarSpec`]) and its compilation ([`GrammarCompiler`]);
//!   a grammar llguidance rejects is a [`GrammarError`] naming why.
//! - [`state`]: the live matcher of one sequence ([`GrammarState`]) behind a shared handle, the
//!   mask job started when a step is dispatched ([`PendingMasks`], joined by the sampler), the
//!   draft check and the mask applied to a logits row.
//!
//! Owns no I/O, no actor and no model. Policy (when a mask is computed, which tokens are consumed)
//! is decided by the scheduler; the executor only waits for the masks and applies them.

pub mod spec;
pub mod state;
#[cfg(test)]
mod tests;
pub mod vocab;

pub use spec::{GrammarCompiler, GrammarSpec};
pub use state::{apply_mask, GrammarHandle, GrammarState, PendingMasks, TokenMask};
pub use vocab::GrammarVocab;

/// A grammar that cannot be used, with llguidance's reason.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GrammarError {
    /// The client's schema or grammar: a 400 naming the field.
    #[error("{0}")]
    Invalid(String),
    /// The model's vocabulary cannot be turned into a token trie (a server-side limitation).
    #[error("structured outputs are unavailable for this model's tokenizer: {0}")]
    Vocabulary(String),
}
