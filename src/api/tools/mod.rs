//! Tool calling for the chat and messages APIs: which call syntax the model writes (chosen from
//! its chat template), the request's tools and `tool_choice`, the default tool prompt for
//! templates without tool syntax, and (in `parse`, with `args`) the streaming parser that turns
//! the model's text into calls, released as they are written: a header once the name is known,
//! then the JSON arguments (typed by each tool's schema) in pieces.
//!
//! Owns no I/O and no engine state. Reasoning text never reaches the parser (the reasoning
//! splitter runs first), so a call written while thinking is not a call.
//!
//! Default for templates without tool syntax (the default model's): the tools are described in
//! a system message (appended to the first system message, or a new one), the model is asked to
//! answer with Hermes-style `<tool_call>{"name": …, "arguments": {…}}</tool_call>` blocks, earlier
//! assistant calls are rendered back in that syntax, and `tool` messages become user messages
//! wrapped in `<tool_response>…</tool_response>`.

pub mod args;
pub mod grammar;
pub mod parse;

use serde_json::{Map, Value};

use super::errors::ApiError;
use super::params::json_kind;

/// The call syntax a model family writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// Hermes / Qwen: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`.
    Hermes,
    /// GLM-4.5 / 4.7 / 5: `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`.
    Glm,
    /// Llama 3.x JSON: `{"name": …, "parameters": {…}}`, optionally after `<|python_tag|>`,
    /// several separated by `;`.
    Llama3Json,
    /// Mistral: `[TOOL_CALLS][{"name": …, "arguments": {…}}]` or `[TOOL_CALLS]name[ARGS]{…}`.
    Mistral,
}

/// How the chat template handles tools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TemplateTools {
    pub format: ToolFormat,
    /// The template renders `tools` itself; otherwise the default prompt is injected.
    pub native: bool,
}

impl TemplateTools {
    /// From the template source: its markers name the family.
    pub fn detect(template_source: &str) -> Self {
        let has = |s: &str| template_source.contains(s);
        let format = if has("<arg_key>") {
            ToolFormat::Glm
        } else if has("[TOOL_CALLS]") {
            ToolFormat::Mistral
        } else if has("<tool_call>") {
            ToolFormat::Hermes
        } else if has("<|python_tag|>") || (has("<|start_header_id|>") && has("parameters")) {
            ToolFormat::Llama3Json
        } else {
            ToolFormat::Hermes
        };
        // A template that never mentions `tools` cannot show them to the model.
        let native = has("tools");
        Self { format, native }
    }
}

/// One function the client offered.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: Option<String>,
    /// JSON schema of the arguments (an object schema; `{}` when absent).
    pub parameters: Value,
}

/// What `tool_choice` asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    Auto,
    None,
    Required,
    Named(String),
}

impl ToolChoice {
    /// From the OpenAI `tool_choice` field.
    pub fn from_openai(v: Option<&Value>) -> Result<Self, ApiError> {
        match v {
            None | Some(Value::Null) => Ok(Self::Auto),
            Some(Value::String(s)) => match s.as_str() {
                "auto" => Ok(Self::Auto),
                "none" => Ok(Self::None),
                "required" => Ok(Self::Required),
                _ => Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` must be `auto`, `none`, `required` or a function object, not `{s}`"),
                )),
            },
            Some(Value::Object(o)) => {
                let name = o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
                match (o.get("type").and_then(Value::as_str), name) {
                    (Some("function"), Some(name)) => Ok(Self::Named(name.to_owned())),
                    _ => Err(ApiError::invalid(
                        "tool_choice",
                        "`tool_choice` as an object must be {\"type\": \"function\", \"function\": {\"name\": …}}",
                    )),
                }
            }
            Some(other) => Err(ApiError::invalid(
                "tool_choice",
                format!("`tool_choice` must be a string or an object, not {}", json_kind(other)),
            )),
        }
    }
}

/// Parse OpenAI `tools` (`[{"type": "function", "function": {name, description, parameters}}]`).
pub fn parse_openai_tools(tools: &[Value]) -> Result<Vec<ToolSpec>, ApiError> {
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let param = format!("tools[{i}]");
            let Some(obj) = t.as_object() else {
                return Err(ApiError::invalid(
                    param.clone(),
                    format!("`{param}` must be a tool object, not {}", json_kind(t)),
                ));
            };
            if let Some(kind) = obj.get("type").and_then(Value::as_str) {
                if kind != "function" {
                    return Err(ApiError::unsupported(
                        format!("{param}.type"),
                        format!("tool type `{kind}` is not supported; only `function` tools are"),
                    ));
                }
            }
            let Some(f) = obj.get("function").and_then(Value::as_object) else {
                return Err(ApiError::invalid(format!("{param}.function"), format!("`{param}.function` is required")));
            };
            let name = f.get("name").and_then(Value::as_str).filter(|n| !n.is_empty()).ok_or_else(|| {
                ApiError::invalid(format!("{param}.function.name"), format!("`{param}.function.name` is required"))
            })?;
            let parameters = f.get("parameters").cloned().unwrap_or_else(|| Value::Object(Map::new()));
            if !parameters.is_object() {
                return Err(ApiError::invalid(
                    format!("{param}.function.parameters"),
                    format!("`{param}.function.parameters` must be a JSON schema object"),
                ));
            }
            Ok(ToolSpec {
                name: name.to_owned(),
                description: f.get("description").and_then(Value::as_str).map(str::to_owned),
                parameters,
            })
        })
        .collect()
}

/// Check a choice against the offered tools.
pub fn check_choice(choice: &ToolChoice, tools: &[ToolSpec], param: &'static str) -> Result<(), ApiError> {
    match choice {
        ToolChoice::Required if tools.is_empty() => {
            Err(ApiError::invalid(param, "a required tool call needs at least one tool in `tools`"))
        }
        ToolChoice::Named(n) if !tools.iter().any(|t| &t.name == n) => {
            Err(ApiError::invalid(param, format!("`{param}` names `{n}`, which is not in `tools`")))
        }
        _ => Ok(()),
    }
}

/// The tools as the template's `tools` variable expects them (OpenAI shape).
pub fn template_tools(tools: &[ToolSpec]) -> Value {
    Value::Array(tools.iter().map(openai_tool).collect())
}

fn openai_tool(t: &ToolSpec) -> Value {
    let mut f = Map::new();
    f.insert("name".into(), Value::String(t.name.clone()));
    if let Some(d) = &t.description {
        f.insert("description".into(), Value::String(d.clone()));
    }
    f.insert("parameters".into(), t.parameters.clone());
    serde_json::json!({"type": "function", "function": Value::Object(f)})
}

/// The system text that teaches a model without tool syntax in its template how to call tools.
pub fn default_tool_prompt(tools: &[ToolSpec]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou can call functions to help answer. The available functions, one JSON \
         signature per line, are inside <tools></tools>:\n<tools>\n",
    );
    for t in tools {
        s.push_str(&openai_tool(t).to_string());
        s.push('\n');
    }
    s.push_str(
        "</tools>\n\nTo call a function, reply with one block per call, each holding a JSON object \
         with the function name and its arguments:\n<tool_call>\n{\"name\": <function-name>, \
         \"arguments\": <args-json-object>}\n</tool_call>",
    );
    s
}

/// Rewrite normalised messages for a template without tool syntax (see the module doc).
pub fn apply_default_prompt(messages: &mut Vec<Value>, tools: &[ToolSpec]) {
    for m in messages.iter_mut() {
        let Some(obj) = m.as_object_mut() else { continue };
        match obj.get("role").and_then(Value::as_str) {
            Some("assistant") => {
                let Some(Value::Array(calls)) = obj.remove("tool_calls") else { continue };
                let mut text = obj.get("content").and_then(Value::as_str).unwrap_or("").to_owned();
                for call in &calls {
                    let f = call.get("function").unwrap_or(call);
                    let name = f.get("name").cloned().unwrap_or(Value::Null);
                    let args = match f.get("arguments") {
                        Some(Value::String(s)) => serde_json::from_str(s).unwrap_or(Value::String(s.clone())),
                        Some(v) => v.clone(),
                        None => Value::Object(Map::new()),
                    };
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str("<tool_call>\n");
                    text.push_str(&serde_json::json!({"name": name, "arguments": args}).to_string());
                    text.push_str("\n</tool_call>");
                }
                obj.insert("content".into(), Value::String(text));
            }
            Some("tool") => {
                let content = obj.get("content").and_then(Value::as_str).unwrap_or("").to_owned();
                obj.clear();
                obj.insert("role".into(), Value::from("user"));
                obj.insert("content".into(), Value::String(format!("<tool_response>\n{content}\n</tool_response>")));
            }
            _ => {}
        }
    }
    if tools.is_empty() {
        return;
    }
    let prompt = default_tool_prompt(tools);
    match messages.first_mut().and_then(Value::as_object_mut) {
        Some(first) if first.get("role").and_then(Value::as_str) == Some("system") => {
            let old = first.get("content").and_then(Value::as_str).unwrap_or("").to_owned();
            let joined = if old.is_empty() { prompt } else { format!("{old}\n\n{prompt}") };
            first.insert("content".into(), Value::String(joined));
        }
        _ => messages.insert(0, serde_json::json!({"role": "system", "content": prompt})),
    }
}

/// Text appended to the prompt that makes the reply start inside a call, for `required` (any
/// tool) or a named tool. Starting the reply there is what forces a call; the name is written
/// for the model when it is fixed.
pub fn forced_call_prefix(format: ToolFormat, choice: &ToolChoice) -> Option<String> {
    let name = match choice {
        ToolChoice::Required => None,
        ToolChoice::Named(n) => Some(n.as_str()),
        ToolChoice::Auto | ToolChoice::None => return None,
    };
    let quoted = |n: &str| Value::String(n.to_owned()).to_string();
    Some(match (format, name) {
        (ToolFormat::Hermes, None) => "<tool_call>\n{\"name\": \"".to_owned(),
        (ToolFormat::Hermes, Some(n)) => format!("<tool_call>\n{{\"name\": {}, \"arguments\": ", quoted(n)),
        (ToolFormat::Glm, None) => "<tool_call>".to_owned(),
        (ToolFormat::Glm, Some(n)) => format!("<tool_call>{n}"),
        (ToolFormat::Llama3Json, None) => "{\"name\": \"".to_owned(),
        (ToolFormat::Llama3Json, Some(n)) => format!("{{\"name\": {}, \"parameters\": ", quoted(n)),
        (ToolFormat::Mistral, None) => "[TOOL_CALLS][{\"name\": \"".to_owned(),
        (ToolFormat::Mistral, Some(n)) => format!("[TOOL_CALLS][{{\"name\": {}, \"arguments\": ", quoted(n)),
    })
}

/// Give each argument the type its schema says: a string `"42"` for an integer property becomes
/// `42`, `"true"` for a boolean becomes `true`, a JSON text for an object/array property is
/// parsed. Values the schema does not type, or that do not convert, are left as they are.
pub fn type_arguments(args: &mut Map<String, Value>, schema: Option<&Value>) {
    for (key, value) in args.iter_mut() {
        *value = type_argument(schema, key, std::mem::take(value));
    }
}

/// One argument typed as [`type_arguments`] types it.
pub fn type_argument(schema: Option<&Value>, key: &str, value: Value) -> Value {
    let Value::String(text) = &value else { return value };
    let types = property_types(schema, key);
    if keeps_strings(&types) {
        return value;
    }
    let trimmed = text.trim();
    let parsed = serde_json::from_str::<Value>(trimmed).ok().or_else(|| match trimmed {
        "True" => Some(Value::Bool(true)),
        "False" => Some(Value::Bool(false)),
        "None" => Some(Value::Null),
        _ => None,
    });
    parsed.filter(|p| types.iter().any(|t| value_has_type(p, t))).unwrap_or(value)
}

/// Whether a string written for `key` stays the same string once typed (so it can be streamed
/// as it is written).
pub fn string_stays_string(schema: Option<&Value>, key: &str) -> bool {
    keeps_strings(&property_types(schema, key))
}

fn property_types(schema: Option<&Value>, key: &str) -> Vec<String> {
    let props = schema.and_then(|s| s.get("properties")).and_then(Value::as_object);
    schema_types(props.and_then(|p| p.get(key)))
}

fn keeps_strings(types: &[String]) -> bool {
    types.is_empty() || types.iter().any(|t| t == "string")
}

fn schema_types(prop: Option<&Value>) -> Vec<String> {
    match prop.and_then(|p| p.get("type")) {
        Some(Value::String(t)) => vec![t.clone()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).map(str::to_owned).collect(),
        _ => Vec::new(),
    }
}

fn value_has_type(v: &Value, t: &str) -> bool {
    match t {
        "integer" => v.as_i64().is_some() || v.as_u64().is_some(),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        "object" => v.is_object(),
        "array" => v.is_array(),
        "null" => v.is_null(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather() -> ToolSpec {
        ToolSpec {
            name: "get_weather".into(),
            description: Some("Weather in a city".into()),
            parameters: json!({"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
                "hours": {"type": "array"}, "ratio": {"type": ["number", "null"]}}}),
        }
    }

    #[test]
    fn formats_are_detected_from_real_templates() {
        let qwen3 = include_str!("../../../tests/fixtures/chat/templates/qwen3.jinja");
        assert_eq!(TemplateTools::detect(qwen3), TemplateTools { format: ToolFormat::Hermes, native: true });
        let llama = include_str!("../../../tests/fixtures/chat/templates/llama3_1.jinja");
        assert_eq!(TemplateTools::detect(llama), TemplateTools { format: ToolFormat::Llama3Json, native: true });
        let glm = include_str!("../../../tests/fixtures/glm5/chat/chat_template.jinja");
        assert_eq!(TemplateTools::detect(glm), TemplateTools { format: ToolFormat::Hermes, native: false });
        let glm47 = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>{{ name }}<arg_key>";
        assert_eq!(TemplateTools::detect(glm47), TemplateTools { format: ToolFormat::Glm, native: true });
        let mistral = "{%- if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]";
        assert_eq!(TemplateTools::detect(mistral).format, ToolFormat::Mistral);
    }

    #[test]
    fn choices_parse_and_check() {
        assert_eq!(ToolChoice::from_openai(None).unwrap(), ToolChoice::Auto);
        assert_eq!(ToolChoice::from_openai(Some(&json!("required"))).unwrap(), ToolChoice::Required);
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        assert_eq!(ToolChoice::from_openai(Some(&named)).unwrap(), ToolChoice::Named("get_weather".into()));
        assert!(ToolChoice::from_openai(Some(&json!("sometimes"))).is_err());
        assert!(ToolChoice::from_openai(Some(&json!({"type": "function"}))).is_err());
        let tools = [weather()];
        assert!(check_choice(&ToolChoice::Named("nope".into()), &tools, "tool_choice").is_err());
        assert!(check_choice(&ToolChoice::Required, &[], "tool_choice").is_err());
        assert!(check_choice(&ToolChoice::Named("get_weather".into()), &tools, "tool_choice").is_ok());
    }

    #[test]
    fn tools_parse_with_field_names_in_errors() {
        let ok = parse_openai_tools(&[json!({"type": "function", "function": {"name": "f"}})]).unwrap();
        assert_eq!(ok[0].parameters, json!({}));
        let e = parse_openai_tools(&[json!({"type": "function", "function": {}})]).unwrap_err();
        assert_eq!(e.body().param, Some("tools[0].function.name"));
        let e = parse_openai_tools(&[json!(3)]).unwrap_err();
        assert_eq!(e.body().param, Some("tools[0]"));
    }

    #[test]
    fn arguments_take_their_schema_types() {
        let mut args = json!({"city": "42", "days": "3", "metric": "true", "hours": "[1, 2]",
                              "ratio": "0.5", "extra": "7"})
        .as_object()
        .cloned()
        .unwrap();
        type_arguments(&mut args, Some(&weather().parameters));
        assert_eq!(
            Value::Object(args),
            json!({"city": "42", "days": 3, "metric": true, "hours": [1, 2], "ratio": 0.5, "extra": "7"})
        );
        // A value that does not fit the schema is left as written.
        let mut args = json!({"days": "three"}).as_object().cloned().unwrap();
        type_arguments(&mut args, Some(&weather().parameters));
        assert_eq!(args["days"], "three");
    }

    #[test]
    fn default_prompt_rewrites_the_conversation() {
        let mut msgs = vec![
            json!({"role": "user", "content": "weather?"}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                   "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": "sunny"}),
        ];
        apply_default_prompt(&mut msgs, &[weather()]);
        assert_eq!(msgs[0]["role"], "system");
        let sys = msgs[0]["content"].as_str().unwrap();
        assert!(sys.contains("\"name\":\"get_weather\"") && sys.contains("<tool_call>"), "{sys}");
        assert_eq!(
            msgs[2]["content"],
            "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>"
        );
        assert!(msgs[2].get("tool_calls").is_none());
        assert_eq!(msgs[3], json!({"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}));
        // An existing system message is extended, not replaced.
        let mut msgs = vec![json!({"role": "system", "content": "Be brief."}), json!({"role": "user", "content": "x"})];
        apply_default_prompt(&mut msgs, &[weather()]);
        assert!(msgs[0]["content"].as_str().unwrap().starts_with("Be brief.\n\n# Tools"));
        assert_eq!(msgs.len(), 2);
    }

    #[test]
    fn forced_prefixes() {
        let named = ToolChoice::Named("get_weather".into());
        assert_eq!(
            forced_call_prefix(ToolFormat::Hermes, &named).unwrap(),
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
        );
        assert_eq!(forced_call_prefix(ToolFormat::Glm, &named).unwrap(), "<tool_call>get_weather");
        assert_eq!(forced_call_prefix(ToolFormat::Hermes, &ToolChoice::Auto), None);
    }
}
