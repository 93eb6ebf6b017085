//! What a request constrains its reply to, and its compilation into a matcher.
//!
//! JSON is generated compactly (no free whitespace: `", "` between items, `": "` after keys), so a
//! small model cannot wander into endless blank lines inside an object. `strict: false` compiles
//! the schema leniently (keywords llguidance cannot enforce are ignored, with a warning in the
//! log); `strict: true` refuses them.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

use super::vocab::GrammarVocab;
use super::GrammarError;
use crate::tokenizer::TokenizerBundle;

/// A constraint on the reply, as the API received it.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON schema (`response_format: {"type": "json_schema"}`, vLLM `guided_json`).
    JsonSchema { schema: Value, strict: bool },
    /// A Lark grammar in llguidance's dialect (vLLM `guided_grammar`).
    Lark(String),
    /// A regular expression the whole reply must match (vLLM `guided_regex`).
    Regex(String),
    /// The reply is exactly one of these strings (vLLM `guided_choice`).
    Choice(Vec<String>),
}

/// Options for the JSON part of every grammar we build (see the module doc).
fn json_options(lenient: bool) -> Value {
    json!({
        "whitespace_flexible": false,
        "item_separator": ", ",
        "key_separator": ": ",
        "lenient": lenient,
    })
}

/// `schema` with our JSON options attached (an `x-guidance` the client wrote wins).
pub fn with_json_options(schema: &Value, lenient: bool) -> Result<Value, GrammarError> {
    let Value::Object(obj) = schema else {
        return Err(GrammarError::Invalid(format!("a JSON schema must be an object, not {schema}")));
    };
    let mut obj = obj.clone();
    obj.entry("x-guidance").or_insert_with(|| json_options(lenient));
    Ok(Value::Object(obj))
}

/// A Lark string literal for `text`.
pub fn lark_literal(text: &str) -> String {
    // JSON string escaping is what llguidance's Lark reads inside double quotes.
    Value::String(text.to_owned()).to_string()
}

impl GrammarSpec {
    fn to_grammar(&self) -> Result<TopLevelGrammar, GrammarError> {
        Ok(match self {
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(with_json_options(&json!({"type": "object"}), false)?)
            }
            GrammarSpec::JsonSchema { schema, strict } => {
                TopLevelGrammar::from_json_schema(with_json_options(schema, !strict)?)
            }
            GrammarSpec::Lark(text) => {
                if text.trim().is_empty() {
                    return Err(GrammarError::Invalid("the grammar is empty".into()));
                }
                TopLevelGrammar::from_lark(text.clone())
            }
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Choice(choices) => {
                if choices.is_empty() {
                    return Err(GrammarError::Invalid("the list of choices is empty".into()));
                }
                let alternatives: Vec<String> = choices.iter().map(|c| lark_literal(c)).collect();
                TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
            }
        })
    }
}

/// Compiles grammars for one model's vocabulary. Building it walks the whole vocabulary (tens of
/// milliseconds for 50k tokens), so the API builds one per model, on first use.
pub struct GrammarCompiler {
    vocab: Arc<GrammarVocab>,
    factory: ParserFactory,
}

impl GrammarCompiler {
    pub fn new(tokenizer: Arc<TokenizerBundle>) -> Result<Self, GrammarError> {
        let vocab = Arc::new(GrammarVocab::new(tokenizer)?);
        let mut factory =
            ParserFactory::new_simple(&vocab.tok_env()).map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        // Warnings go to our log through the compile result, never to stderr.
        factory.quiet();
        Ok(Self { vocab, factory })
    }

    pub fn vocab(&self) -> &Arc<GrammarVocab> {
        &self.vocab
    }

    /// A fresh matcher at the start of `spec`, or why the grammar is unusable.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Matcher, GrammarError> {
        let grammar = spec.to_grammar()?;
        let parser = self.factory.create_parser(grammar).map_err(|e| GrammarError::Invalid(e.to_string()))?;
        let mut matcher = Matcher::new(Ok(parser));
        // A grammar that compiles but admits no text at all fails on its first mask.
        if let Err(e) = matcher.compute_mask() {
            return Err(GrammarError::Invalid(e.to_string()));
        }
        for w in matcher.grammar_warnings() {
            tracing::info!(warning = %w, "grammar compiled with a warning");
        }
        Ok(matcher)
    }
}
