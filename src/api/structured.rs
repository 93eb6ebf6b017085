//! The request fields that constrain a reply, read into a [`GrammarSpec`], and the compiled
//! grammar attached to each choice's engine request.
//!
//! Accepted spellings (one of them per request):
//! - OpenAI `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`,
//!   `{"type": "json_schema", "json_schema": {"name": …, "schema": {…}, "strict": bool}}`;
//! - vLLM `structured_outputs`: `{"json": schema}`, `{"regex": "…"}`, `{"choice": […]}`,
//!   `{"grammar": "lark"}`, `{"json_object": true}`;
//! - vLLM's older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
//!
//! A grammar llguidance rejects is a 400 whose `param` points at the field.

use std::sync::Arc;

use serde_json::Value;

use super::errors::ApiError;
use super::params::json_kind;
use super::reasoning::{ReasoningStart, THINK_CLOSE};
use super::LaneState;
use crate::actors::handle::GenerationRequest;
use crate::structured::{GrammarCompiler, GrammarError, GrammarSpec, GrammarState};

/// A constraint and the field it came from (for errors).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Constraint {
    pub spec: GrammarSpec,
    pub param: String,
}

const GUIDED: [&str; 4] = ["guided_json", "guided_regex", "guided_choice", "guided_grammar"];

/// The constraint the body asks for, if any.
pub(crate) fn requested(body: &Value) -> Result<Option<Constraint>, ApiError> {
    let mut found: Vec<Constraint> = Vec::new();
    if let Some(c) = response_format(body.get("response_format"))? {
        found.push(c);
    }
    match body.get("structured_outputs") {
        None | Some(Value::Null) => {}
        Some(Value::Object(o)) => {
            for (key, v) in o {
                let param = format!("structured_outputs.{key}");
                let spec = match key.as_str() {
                    "json_object" if v == &Value::Bool(true) => Some(GrammarSpec::JsonObject),
                    "json" | "regex" | "choice" | "grammar" => field_spec(key, v, &param)?,
                    // Options of other engines' backends; harmless to ignore.
                    "disable_any_whitespace" | "disable_fallback" | "disable_additional_properties" | "whitespace_pattern" => None,
                    _ if v.is_null() || v == &Value::Bool(false) => None,
                    other => {
                        return Err(ApiError::unsupported(
                            param,
                            format!("`structured_outputs.{other}` is not supported; use json, regex, choice, grammar or json_object"),
                        ))
                    }
                };
                if let Some(spec) = spec {
                    found.push(Constraint { spec, param });
                }
            }
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "structured_outputs",
                format!("`structured_outputs` must be an object, not {}", json_kind(other)),
            ))
        }
    }
    for key in GUIDED {
        if let Some(v) = body.get(key).filter(|v| !v.is_null()) {
            let kind = key.trim_start_matches("guided_");
            if let Some(spec) = field_spec(kind, v, key)? {
                found.push(Constraint { spec, param: key.to_owned() });
            }
        }
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => {
            let names: Vec<String> = found.iter().map(|c| format!("`{}`", c.param)).collect();
            Err(ApiError::invalid(
                found[1].param.clone(),
                format!("only one structured output constraint may be given, not {}", names.join(" and ")),
            ))
        }
    }
}

fn response_format(v: Option<&Value>) -> Result<Option<Constraint>, ApiError> {
    let obj = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(other) => {
            return Err(ApiError::invalid(
                "response_format",
                format!("`response_format` must be an object, not {}", json_kind(other)),
            ))
        }
    };
    match obj.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint { spec: GrammarSpec::JsonObject, param: "response_format".into() })),
        Some("json_schema") => {
            let Some(js) = obj.get("json_schema").and_then(Value::as_object) else {
                return Err(ApiError::invalid(
                    "response_format.json_schema",
                    "`response_format.json_schema` is required for type `json_schema` and must be an object",
                ));
            };
            let schema = match js.get("schema") {
                Some(s @ Value::Object(_)) => s.clone(),
                // OpenAI: a missing schema is an empty one (any JSON value).
                None | Some(Value::Null) => Value::Object(Default::default()),
                Some(other) => {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.schema",
                        format!(
                            "`response_format.json_schema.schema` must be a JSON schema object, not {}",
                            json_kind(other)
                        ),
                    ))
                }
            };
            let strict = match js.get("strict") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(other) => {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.strict",
                        format!("`response_format.json_schema.strict` must be a boolean, not {}", json_kind(other)),
                    ))
                }
            };
            Ok(Some(Constraint {
                spec: GrammarSpec::JsonSchema { schema, strict },
                param: "response_format.json_schema.schema".into(),
            }))
        }
        _ => Err(ApiError::invalid(
            "response_format.type",
            "`response_format.type` must be `text`, `json_object` or `json_schema`",
        )),
    }
}

/// `json` (a schema object, or a JSON text of one), `regex`, `grammar` (strings), `choice` (a
/// list of strings).
fn field_spec(kind: &str, v: &Value, param: &str) -> Result<Option<GrammarSpec>, ApiError> {
    let wrong = |what: &str| ApiError::invalid(param, format!("`{param}` must be {what}, not {}", json_kind(v)));
    Ok(Some(match kind {
        "json" => match v {
            Value::Object(_) => GrammarSpec::JsonSchema { schema: v.clone(), strict: true },
            Value::String(text) => {
                let schema: Value = serde_json::from_str(text)
                    .map_err(|e| ApiError::invalid(param, format!("`{param}` is not valid JSON: {e}")))?;
                GrammarSpec::JsonSchema { schema, strict: true }
            }
            _ => return Err(wrong("a JSON schema")),
        },
        "regex" => GrammarSpec::Regex(v.as_str().ok_or_else(|| wrong("a string"))?.to_owned()),
        "grammar" => GrammarSpec::Lark(v.as_str().ok_or_else(|| wrong("a string"))?.to_owned()),
        "choice" => {
            let items = v.as_array().ok_or_else(|| wrong("a list of strings"))?;
            let choices: Option<Vec<String>> = items.iter().map(|c| c.as_str().map(str::to_owned)).collect();
            GrammarSpec::Choice(choices.ok_or_else(|| wrong("a list of strings"))?)
        }
        _ => return Ok(None),
    }))
}

/// The compiler, or a 400/500 saying why this model has none.
pub(crate) fn compiler(state: &LaneState, param: &str) -> Result<Arc<GrammarCompiler>, ApiError> {
    state
        .shared
        .grammar_compiler()
        .map_err(|e| ApiError::unsupported(param, format!("structured outputs are unavailable: {e}")))
}

/// Compile `constraint` and give each request its own matcher. With a reasoning block opened by
/// the template, the grammar starts after `</think>`.
pub(crate) fn attach(
    state: &LaneState,
    requests: &mut [GenerationRequest],
    constraint: &Constraint,
    reasoning: ReasoningStart,
) -> Result<(), ApiError> {
    let compiler = compiler(state, &constraint.param)?;
    let matcher = compiler.compile(&constraint.spec).map_err(|e| match e {
        GrammarError::Invalid(why) => {
            ApiError::invalid(constraint.param.clone(), format!("`{}` was rejected: {why}", constraint.param))
        }
        GrammarError::Vocabulary(why) => ApiError::unsupported(constraint.param.clone(), why),
    })?;
    let start_after = (reasoning == ReasoningStart::Inside).then(|| compiler.vocab().encode(THINK_CLOSE));
    // The ids the scheduler ends a reply on: the grammar allows all of them where it may end.
    let eos = state.shared.engine.model().eos_token_ids.clone();
    let vocab_size = compiler.vocab().vocab_size();
    for req in requests.iter_mut() {
        let state = GrammarState::new(matcher.deep_clone(), start_after.clone(), eos.clone(), vocab_size);
        req.grammar = Some(state.into_handle());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(body: Value) -> Option<GrammarSpec> {
        requested(&body).expect("accepted").map(|c| c.spec)
    }

    #[test]
    fn every_spelling_reads_into_a_spec() {
        assert_eq!(spec(json!({"response_format": {"type": "text"}})), None);
        assert_eq!(spec(json!({"response_format": {"type": "json_object"}})), Some(GrammarSpec::JsonObject));
        let schema = json!({"type": "object"});
        assert_eq!(
            spec(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}})
            ),
            Some(GrammarSpec::JsonSchema { schema: schema.clone(), strict: true })
        );
        assert_eq!(
            spec(json!({"guided_json": schema})),
            Some(GrammarSpec::JsonSchema { schema: schema.clone(), strict: true })
        );
        assert_eq!(
            spec(json!({"guided_json": "{\"type\": \"object\"}"})),
            Some(GrammarSpec::JsonSchema { schema: schema.clone(), strict: true })
        );
        assert_eq!(spec(json!({"structured_outputs": {"regex": "a+"}})), Some(GrammarSpec::Regex("a+".into())));
        assert_eq!(spec(json!({"guided_choice": ["a", "b"]})), Some(GrammarSpec::Choice(vec!["a".into(), "b".into()])));
        assert_eq!(
            spec(json!({"structured_outputs": {"grammar": "start: \"x\""}})),
            Some(GrammarSpec::Lark("start: \"x\"".into()))
        );
        assert_eq!(spec(json!({"structured_outputs": {"json_object": true}})), Some(GrammarSpec::JsonObject));
    }

    #[test]
    fn malformed_fields_name_themselves() {
        let param = |body: Value| requested(&body).unwrap_err().body().param.map(str::to_owned);
        assert_eq!(param(json!({"response_format": "json"})), Some("response_format".into()));
        assert_eq!(param(json!({"response_format": {"type": "yaml"}})), Some("response_format.type".into()));
        assert_eq!(
            param(json!({"response_format": {"type": "json_schema"}})),
            Some("response_format.json_schema".into())
        );
        assert_eq!(
            param(json!({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}})),
            Some("response_format.json_schema.schema".into())
        );
        assert_eq!(param(json!({"guided_regex": 5})), Some("guided_regex".into()));
        assert_eq!(param(json!({"guided_choice": ["a", 1]})), Some("guided_choice".into()));
        assert_eq!(param(json!({"guided_json": "{not json"})), Some("guided_json".into()));
        assert_eq!(param(json!({"structured_outputs": {"xml": "x"}})), Some("structured_outputs.xml".into()));
        assert_eq!(
            param(json!({"response_format": {"type": "json_object"}, "guided_regex": "a"})),
            Some("guided_regex".into())
        );
    }
}
