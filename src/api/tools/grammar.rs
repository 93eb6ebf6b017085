//! The grammar of a forced tool call (`tool_choice` required or a named function): the rest of
//! the call after the prefix [`forced_call_prefix`](super::forced_call_prefix) already wrote into
//! the prompt, in the model family's syntax, with arguments that follow the tool's `parameters`
//! schema. Hermes (the default for templates without tool syntax) and GLM are enforced; other
//! families keep the prefix alone.

use serde_json::{Map, Value};

use super::{ToolChoice, ToolFormat, ToolSpec};
use crate::structured::spec::{lark_literal, with_json_options};
use crate::structured::{GrammarSpec, GrammarVocab};

/// Lark for the rest of the forced call; `None` when the family is not enforced or nothing is
/// forced. `choice` is the effective one (`required` with a single tool already named).
pub fn forced_call_grammar(
    format: ToolFormat,
    choice: &ToolChoice,
    tools: &[ToolSpec],
    vocab: &GrammarVocab,
) -> Option<GrammarSpec> {
    let candidates: Vec<&ToolSpec> = match choice {
        ToolChoice::Named(n) => tools.iter().filter(|t| &t.name == n).collect(),
        ToolChoice::Required => tools.iter().collect(),
        ToolChoice::Auto | ToolChoice::None => return None,
    };
    if candidates.is_empty() {
        return None;
    }
    let named = matches!(choice, ToolChoice::Named(_));
    let markup = |text: &str| match vocab.special_token_id(text) {
        Some(id) => format!("<[{id}]>"),
        None => lark_literal(text),
    };
    let lark = match format {
        ToolFormat::Hermes => hermes(&candidates, named, &markup),
        ToolFormat::Glm => glm(&candidates, named, &markup),
        ToolFormat::Llama3Json | ToolFormat::Mistral => return None,
    };
    Some(GrammarSpec::Lark(lark))
}

/// A tool's arguments schema as an inline `%json` (our JSON options attached).
fn json_rule(schema: &Value) -> String {
    let schema = if schema.as_object().is_some_and(Map::is_empty) {
        serde_json::json!({"type": "object"})
    } else {
        schema.clone()
    };
    let schema = with_json_options(&schema, true).unwrap_or(schema);
    format!("%json {schema}")
}

/// `<tool_call>\n{"name": "…", "arguments": {…}}\n</tool_call>`: the prefix ends after
/// `"arguments": ` (named) or after `{"name": "` (required).
fn hermes(tools: &[&ToolSpec], named: bool, markup: &dyn Fn(&str) -> String) -> String {
    let close = format!("\"}}\\n\" {}", markup("</tool_call>"));
    if named {
        return format!("start: {} {close}\n", json_rule(&tools[0].parameters));
    }
    let mut rules = Vec::new();
    let mut alts = Vec::new();
    for (i, t) in tools.iter().enumerate() {
        // The name as it sits inside the JSON string the prefix opened.
        let quoted = Value::String(t.name.clone()).to_string();
        let inner = &quoted[1..quoted.len() - 1];
        let head = lark_literal(&format!("{inner}\", \"arguments\": "));
        rules.push(format!("call_{i}: {head} {}", json_rule(&t.parameters)));
        alts.push(format!("call_{i}"));
    }
    format!("start: ({}) {close}\n{}\n", alts.join(" | "), rules.join("\n"))
}

/// `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>…</tool_call>`, a newline allowed
/// before each key and before the close; string values are raw text, others JSON. The prefix
/// ends after the name (named) or after `<tool_call>` (required).
fn glm(tools: &[&ToolSpec], named: bool, markup: &dyn Fn(&str) -> String) -> String {
    let (key_open, key_close) = (markup("<arg_key>"), markup("</arg_key>"));
    let (value_open, value_close) = (markup("<arg_value>"), markup("</arg_value>"));
    let mut rules = vec!["TEXT: /[^<]*/".to_owned()];
    let mut alts = Vec::new();
    for (i, t) in tools.iter().enumerate() {
        let props = t.parameters.get("properties").and_then(Value::as_object);
        let required: Vec<&str> = t
            .parameters
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut parts = Vec::new();
        for (j, (key, schema)) in props.into_iter().flatten().enumerate() {
            let is_string =
                schema.get("type").and_then(Value::as_str) == Some("string") && schema.get("enum").is_none();
            let value = if is_string { "TEXT".to_owned() } else { json_rule(schema) };
            rules.push(format!(
                "arg_{i}_{j}: \"\\n\"? {key_open} {} {key_close} \"\\n\"? {value_open} {value} {value_close}",
                lark_literal(key)
            ));
            let optional = if required.contains(&key.as_str()) { "" } else { "?" };
            parts.push(format!("arg_{i}_{j}{optional}"));
        }
        let name = if named { String::new() } else { lark_literal(&t.name) };
        rules.push(format!("call_{i}: {name} {} \"\\n\"? {}", parts.join(" "), markup("</tool_call>")));
        alts.push(format!("call_{i}"));
    }
    format!("start: {}\n{}\n", alts.join(" | "), rules.join("\n"))
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::Arc;

    use serde_json::json;

    use super::*;
    use crate::api::tools::forced_call_prefix;
    use crate::api::tools::parse::{CallList, Piece, ToolCallParser};
    use crate::structured::{GrammarCompiler, GrammarState};
    use crate::tokenizer::TokenizerBundle;

    fn compiler() -> GrammarCompiler {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama-tok");
        let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).expect("fixture tokenizer");
        let bundle = TokenizerBundle {
            tokenizer,
            origin: dir,
            chat_template: None,
            bos_token: None,
            eos_token: Some("<|im_end|>".into()),
            bos_token_id: None,
            eos_token_ids: vec![2],
            add_bos_token: false,
        };
        GrammarCompiler::new(Arc::new(bundle)).expect("vocabulary")
    }

    fn tools() -> Vec<ToolSpec> {
        vec![
            ToolSpec {
                name: "get_weather".into(),
                description: None,
                parameters: json!({"type": "object", "properties": {
                    "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city", "days"]}),
            },
            ToolSpec { name: "now".into(), description: None, parameters: json!({}) },
        ]
    }

    /// Does the grammar for `choice` accept `reply` (the text after the forced prefix) to the end?
    fn accepts(c: &GrammarCompiler, format: ToolFormat, choice: &ToolChoice, reply: &str) -> bool {
        let spec = forced_call_grammar(format, choice, &tools(), c.vocab()).expect("enforced");
        let matcher = c.compile(&spec).unwrap_or_else(|e| panic!("{e}: {spec:?}"));
        let mut g = GrammarState::new(matcher, None, vec![2], c.vocab().vocab_size());
        let ids = c.vocab().encode(reply);
        if g.valid_prefix(&ids) != ids.len() {
            return false;
        }
        g.consume(&ids);
        g.next_mask().unwrap().is_allowed(2)
    }

    #[test]
    fn hermes_calls_follow_the_schema_and_parse_back() {
        let c = compiler();
        let named = ToolChoice::Named("get_weather".into());
        let reply = r#"{"city": "Oslo", "days": 3}}
</tool_call>"#;
        assert!(accepts(&c, ToolFormat::Hermes, &named, reply));
        assert!(!accepts(
            &c,
            ToolFormat::Hermes,
            &named,
            r#"{"city": "Oslo", "days": "3"}}
</tool_call>"#
        ));
        assert!(
            !accepts(
                &c,
                ToolFormat::Hermes,
                &named,
                r#"{"city": "Oslo"}}
</tool_call>"#
            ),
            "a required argument is missing"
        );
        let required = ToolChoice::Required;
        assert!(accepts(&c, ToolFormat::Hermes, &required, "now\", \"arguments\": {}}\n</tool_call>"));
        assert!(!accepts(&c, ToolFormat::Hermes, &required, "later\", \"arguments\": {}}\n</tool_call>"));
        // What the grammar allows, the parser reads as the call.
        let prefix = forced_call_prefix(ToolFormat::Hermes, &named).unwrap();
        let mut parser = ToolCallParser::new(ToolFormat::Hermes, tools());
        let mut pieces = parser.push(&prefix);
        pieces.extend(parser.push(reply));
        pieces.extend(parser.finish());
        let mut calls = CallList::default();
        for p in pieces {
            if let Piece::Call(e) = p {
                calls.add(e);
            }
        }
        assert_eq!(calls.whole, 1);
        let call = &calls.calls[0];
        assert_eq!(call.name, "get_weather");
        assert_eq!(serde_json::from_str::<Value>(&call.arguments).unwrap(), json!({"city": "Oslo", "days": 3}));
    }

    #[test]
    fn glm_calls_follow_the_schema() {
        let c = compiler();
        let named = ToolChoice::Named("get_weather".into());
        let reply = "\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>";
        assert!(accepts(&c, ToolFormat::Glm, &named, reply));
        let bad = "<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key><arg_value>three</arg_value></tool_call>";
        assert!(!accepts(&c, ToolFormat::Glm, &named, bad));
        assert!(accepts(&c, ToolFormat::Glm, &ToolChoice::Required, "now</tool_call>"));
    }

    #[test]
    fn auto_none_and_other_families_are_free() {
        let c = compiler();
        assert!(forced_call_grammar(ToolFormat::Hermes, &ToolChoice::Auto, &tools(), c.vocab()).is_none());
        assert!(forced_call_grammar(ToolFormat::Hermes, &ToolChoice::None, &tools(), c.vocab()).is_none());
        assert!(forced_call_grammar(ToolFormat::Mistral, &ToolChoice::Required, &tools(), c.vocab()).is_none());
    }
}
