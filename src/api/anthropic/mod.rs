//! The Anthropic Messages API on every lane port: `POST /v1/messages` and
//! `POST /v1/messages/count_tokens`. A request is translated into the chat pipeline's
//! conversation (system prompt, turns, `tool_use` / `tool_result` blocks as OpenAI tool calls and
//! tool messages, `thinking` blocks as `reasoning_content`), rendered and submitted like a chat
//! completion; the reply is read by the same reasoning / tool parsers and written back as content
//! blocks (`reply`). Errors use Anthropic's shape: `{"type":"error","error":{"type","message"}}`.
//!
//! Owns only the translation; prompt rendering lives in `conversation`, validation of sampling
//! fields in `params`.

mod reply;

use std::time::Instant;

use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::chat::template_kwargs;
use super::conversation::{self, Conversation, RenderedPrompt};
use super::errors::ApiError;
use super::params::{self, json_kind};
use super::reasoning::ReasoningStart;
use super::sse::Choices;
use super::structured;
use super::tools::{self, ToolChoice, ToolSpec};
use super::types::CommonParams;
use super::{blocking, read_body, response_id, LaneState};
use crate::actors::handle::{EngineError, GenerationRequest};

/// The request fields this server reads.
#[derive(Deserialize, Debug, Default)]
#[serde(default)]
struct MessagesParams {
    model: Option<String>,
    messages: Option<Vec<Value>>,
    /// A string or a list of text blocks.
    system: Option<Value>,
    max_tokens: Option<u64>,
    stop_sequences: Option<Vec<String>>,
    stream: Option<bool>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    thinking: Option<Value>,
}

/// A validated, tokenized messages request.
struct Prepared {
    rendered: RenderedPrompt,
    plan: params::Plan,
    /// One per choice, a forced call's grammar attached.
    requests: Vec<GenerationRequest>,
}

pub(crate) async fn messages(req: HttpRequest, payload: web::Payload, state: web::Data<LaneState>) -> HttpResponse {
    handle_messages(req, payload, state).await.unwrap_or_else(|e| error_response(&e))
}

pub(crate) async fn count_tokens(req: HttpRequest, payload: web::Payload, state: web::Data<LaneState>) -> HttpResponse {
    let counted = async {
        let body = read_body(&req, payload, state.shared.opts.max_body_bytes).await?;
        state.ensure_ready()?;
        let remote = super::media_fetch::prefetch(&state, &body).await?;
        let st = state.clone().into_inner();
        blocking(move || {
            let v = params::parse_body(&body)?;
            let p: MessagesParams = params::fields(&v)?;
            params::check_model(p.model.as_deref(), st.served_name(), st.shared.engine.model())?;
            let conv = Conversation { remote, ..to_conversation(&st, &p)? };
            Ok(conversation::render(&st, conv, "messages")?.ids.len())
        })
        .await
    };
    match counted.await {
        Ok(n) => HttpResponse::Ok().json(serde_json::json!({"input_tokens": n})),
        Err(e) => error_response(&e),
    }
}

async fn handle_messages(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<LaneState>,
) -> Result<HttpResponse, ApiError> {
    let start = Instant::now();
    let body = read_body(&req, payload, state.shared.opts.max_body_bytes).await?;
    state.ensure_ready()?;
    let remote = super::media_fetch::prefetch(&state, &body).await?;
    let st = state.clone().into_inner();
    let Prepared { rendered, plan, requests } = blocking(move || prepare(&st, &body, remote)).await?;
    let prompt_len = rendered.ids.len();
    let receivers = state.submit(requests, "messages")?;
    let choices = Choices::new(receivers, &state.lane.name, start);
    let assets = state.shared.assets();
    let reply = reply::Reply {
        // Anthropic ids are `msg_…`.
        id: response_id("msg").replacen('-', "_", 1),
        model: state.served_name().to_owned(),
        lane: state.lane.name.clone(),
        prompt_len,
        setup: rendered.reply,
        stop_sequences: plan.stop_strings.clone(),
        end_ids: end_of_turn_ids(&state, &plan),
        tokenizer: assets.tokenizer.clone(),
    };
    if plan.stream {
        return Ok(reply::stream(choices, reply));
    }
    reply.collect(choices).await
}

fn end_of_turn_ids(state: &LaneState, plan: &params::Plan) -> Vec<u32> {
    let mut ids = state.shared.engine.model().tokenizer.as_ref().map(|t| t.eos_token_ids.clone()).unwrap_or_default();
    ids.extend(&plan.stop_token_ids);
    ids
}

fn prepare(state: &LaneState, body: &[u8], remote: super::media::Fetched) -> Result<Prepared, ApiError> {
    let v = params::parse_body(body)?;
    let p: MessagesParams = params::fields(&v)?;
    let model = state.shared.engine.model();
    params::check_model(p.model.as_deref(), state.served_name(), model)?;
    let Some(max_tokens) = p.max_tokens else {
        return Err(ApiError::invalid("max_tokens", "`max_tokens` is required"));
    };
    let common = CommonParams {
        model: p.model.clone(),
        stream: p.stream,
        stop: p.stop_sequences.clone().map(|s| Value::Array(s.into_iter().map(Value::String).collect())),
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: p.top_k,
        ..CommonParams::default()
    };
    let mut plan = params::plan(&common, Some((max_tokens, "max_tokens")), None, &state.lane, model)?;
    let conv = Conversation { remote, ..to_conversation(state, &p)? };
    let rendered = conversation::render(state, conv, "messages")?;
    if rendered.keep_special_tokens {
        plan.skip_special_tokens = false;
    }
    if let Some(stop) = rendered.stop_after_call {
        plan.stop_strings.push(stop.to_owned());
    }
    let max_tokens = params::resolve_max_tokens(&plan, rendered.ids.len(), &state.lane, model, "messages")?;
    let mut requests = params::requests(&plan, rendered.ids.clone(), max_tokens, &state.lane);
    requests.iter_mut().for_each(|r| r.images = rendered.images.clone());
    if let Some(call) = &rendered.call_grammar {
        // A forced call closed any reasoning block in the prompt: the grammar starts at once.
        structured::attach(state, &mut requests, call, ReasoningStart::Off)?;
    }
    Ok(Prepared { rendered, plan, requests })
}

/// Anthropic request → the chat pipeline's conversation.
fn to_conversation(state: &LaneState, p: &MessagesParams) -> Result<Conversation, ApiError> {
    let mut messages = Vec::new();
    match &p.system {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(serde_json::json!({"role": "system", "content": s})),
        Some(Value::Array(blocks)) => {
            let text = text_of_blocks(blocks, "system")?;
            messages.push(serde_json::json!({"role": "system", "content": text}));
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "system",
                format!("`system` must be a string or a list of text blocks, not {}", json_kind(other)),
            ))
        }
    }
    let turns = p.messages.as_ref().ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
    if turns.is_empty() {
        return Err(ApiError::invalid("messages", "`messages` must contain at least one message"));
    }
    for (i, m) in turns.iter().enumerate() {
        convert_turn(i, m, &mut messages)?;
    }
    let tools = parse_tools(p.tools.as_deref().unwrap_or(&[]))?;
    let tool_choice = parse_tool_choice(p.tool_choice.as_ref())?;
    tools::check_choice(&tool_choice, &tools, "tool_choice")?;
    let mut requested = Map::new();
    match p.thinking.as_ref().map(|t| t.get("type").and_then(Value::as_str)) {
        None => {}
        Some(Some("enabled")) => {
            requested.insert("enable_thinking".into(), Value::Bool(true));
        }
        Some(Some("disabled")) => {
            requested.insert("enable_thinking".into(), Value::Bool(false));
        }
        Some(_) => return Err(ApiError::invalid("thinking.type", "`thinking.type` must be `enabled` or `disabled`")),
    }
    let kwargs = template_kwargs(Some(requested), None, &state.lane)?;
    Ok(Conversation { messages, tools, tool_choice, kwargs, add_generation_prompt: true, remote: Default::default() })
}

fn text_of_blocks(blocks: &[Value], param: &str) -> Result<String, ApiError> {
    let mut texts = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        match (b.get("type").and_then(Value::as_str), b.get("text").and_then(Value::as_str)) {
            (Some("text"), Some(t)) => texts.push(t),
            _ => {
                return Err(ApiError::invalid(
                    format!("{param}[{j}]"),
                    format!("`{param}[{j}]` must be a text block {{\"type\": \"text\", \"text\": …}}"),
                ))
            }
        }
    }
    Ok(texts.join("\n"))
}

/// One Anthropic turn → OpenAI-shaped messages: `tool_result` blocks become `tool` messages (in
/// front of the turn's text), `tool_use` blocks become the assistant's `tool_calls`, `thinking`
/// blocks its `reasoning_content`.
fn convert_turn(i: usize, m: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let role = match m.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        _ => {
            return Err(ApiError::invalid(
                format!("messages[{i}].role"),
                format!("`messages[{i}].role` must be `user` or `assistant`"),
            ))
        }
    };
    let blocks = match m.get("content") {
        Some(Value::String(s)) => {
            out.push(serde_json::json!({"role": role, "content": s}));
            return Ok(());
        }
        Some(Value::Array(blocks)) => blocks,
        _ => {
            return Err(ApiError::invalid(
                format!("messages[{i}].content"),
                format!("`messages[{i}].content` must be a string or a list of content blocks"),
            ))
        }
    };
    let mut text = Vec::new();
    // With images, the user turn's content is a list of text and image parts (in block order).
    let mut parts = Vec::new();
    let mut reasoning = Vec::new();
    let mut calls = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let param = format!("messages[{i}].content[{j}]");
        let str_field = |k: &str| str_field(b, &param, k);
        match b.get("type").and_then(Value::as_str) {
            Some("text") => {
                text.push(str_field("text")?.to_owned());
                parts.push(serde_json::json!({"type": "text", "text": text[text.len() - 1]}));
            }
            Some("image") if role == "user" => parts.push(b.clone()),
            Some("thinking") if role == "assistant" => reasoning.push(str_field("thinking")?.to_owned()),
            Some("redacted_thinking") => {}
            Some("tool_use") if role == "assistant" => {
                let input = b.get("input").cloned().unwrap_or_else(|| Value::Object(Map::new()));
                calls.push(serde_json::json!({"id": str_field("id")?, "type": "function",
                    "function": {"name": str_field("name")?, "arguments": input}}));
            }
            Some("tool_result") if role == "user" => {
                let content = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => text_of_blocks(parts, &format!("{param}.content"))?,
                    Some(_) => {
                        return Err(ApiError::invalid(
                            format!("{param}.content"),
                            format!("`{param}.content` must be a string or a list of text blocks"),
                        ))
                    }
                };
                let content = if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                    format!("Error: {content}")
                } else {
                    content
                };
                out.push(
                    serde_json::json!({"role": "tool", "tool_call_id": str_field("tool_use_id")?, "content": content}),
                );
            }
            Some(other) => {
                return Err(ApiError::unsupported(
                    format!("{param}.type"),
                    format!("content block type `{other}` is not supported in a `{role}` message"),
                ))
            }
            None => return Err(ApiError::invalid(format!("{param}.type"), format!("`{param}.type` is required"))),
        }
    }
    if role == "user" && parts.iter().any(super::media::is_image_part) {
        out.push(serde_json::json!({"role": role, "content": parts}));
        return Ok(());
    }
    if role == "user" && text.is_empty() {
        return Ok(());
    }
    let mut msg = Map::new();
    msg.insert("role".into(), Value::from(role));
    msg.insert(
        "content".into(),
        if text.is_empty() && !calls.is_empty() { Value::Null } else { Value::String(text.join("\n")) },
    );
    if !reasoning.is_empty() {
        msg.insert("reasoning_content".into(), Value::String(reasoning.join("\n")));
    }
    if !calls.is_empty() {
        msg.insert("tool_calls".into(), Value::Array(calls));
    }
    out.push(Value::Object(msg));
    Ok(())
}

/// `block[key]` as a string, or a 400 naming `param.key`.
fn str_field<'a>(block: &'a Value, param: &str, key: &str) -> Result<&'a str, ApiError> {
    block
        .get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::invalid(format!("{param}.{key}"), format!("`{param}.{key}` must be a string")))
}

/// Anthropic tools: `[{"name", "description", "input_schema"}]`.
fn parse_tools(tools: &[Value]) -> Result<Vec<ToolSpec>, ApiError> {
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let name = t.get("name").and_then(Value::as_str).filter(|n| !n.is_empty()).ok_or_else(|| {
                ApiError::invalid(format!("tools[{i}].name"), format!("`tools[{i}].name` is required"))
            })?;
            let schema = t.get("input_schema").cloned().unwrap_or_else(|| serde_json::json!({"type": "object"}));
            if !schema.is_object() {
                return Err(ApiError::invalid(
                    format!("tools[{i}].input_schema"),
                    format!("`tools[{i}].input_schema` must be a JSON schema object"),
                ));
            }
            Ok(ToolSpec {
                name: name.to_owned(),
                description: t.get("description").and_then(Value::as_str).map(str::to_owned),
                parameters: schema,
            })
        })
        .collect()
}

/// `{"type": "auto" | "any" | "none" | "tool", "name"?}`.
fn parse_tool_choice(v: Option<&Value>) -> Result<ToolChoice, ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(ToolChoice::Auto) };
    match v.get("type").and_then(Value::as_str) {
        Some("auto") => Ok(ToolChoice::Auto),
        Some("any") => Ok(ToolChoice::Required),
        Some("none") => Ok(ToolChoice::None),
        Some("tool") => match v.get("name").and_then(Value::as_str) {
            Some(n) => Ok(ToolChoice::Named(n.to_owned())),
            None => {
                Err(ApiError::invalid("tool_choice.name", "`tool_choice.name` is required when the type is `tool`"))
            }
        },
        _ => Err(ApiError::invalid("tool_choice.type", "`tool_choice.type` must be `auto`, `any`, `tool` or `none`")),
    }
}

/// Routes answered in Anthropic's error shape (also when the API-key gate refuses them).
pub(crate) fn is_anthropic_path(path: &str) -> bool {
    path.trim_end_matches('/').starts_with("/v1/messages")
}

/// Anthropic's error type for a status.
fn error_type(err: &ApiError) -> &'static str {
    match err {
        ApiError::Engine { err: EngineError::NotReady(_) | EngineError::ShuttingDown, .. } => "overloaded_error",
        _ => match err.status() {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::FORBIDDEN => "permission_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_client_error() => "invalid_request_error",
            _ => "api_error",
        },
    }
}

/// `{"type":"error","error":{"type","message"}}` for `err`.
pub(crate) fn error_json(err: &ApiError) -> Value {
    let message = err.body().message;
    serde_json::json!({"type": "error", "error": {"type": error_type(err), "message": message}})
}

pub(crate) fn error_response(err: &ApiError) -> HttpResponse {
    HttpResponse::build(err.status()).json(error_json(err))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn turns_become_chat_messages() {
        let mut out = Vec::new();
        convert_turn(0, &json!({"role": "user", "content": "What's the weather in Paris?"}), &mut out).unwrap();
        convert_turn(
            1,
            &json!({"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Need the tool.", "signature": "x"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]}),
            &mut out,
        )
        .unwrap();
        convert_turn(
            2,
            &json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                {"type": "text", "text": "Thanks"}]}),
            &mut out,
        )
        .unwrap();
        assert_eq!(
            out,
            vec![
                json!({"role": "user", "content": "What's the weather in Paris?"}),
                json!({"role": "assistant", "content": "Checking.", "reasoning_content": "Need the tool.",
                       "tool_calls": [{"id": "toolu_1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}),
                json!({"role": "tool", "tool_call_id": "toolu_1", "content": "18C"}),
                json!({"role": "user", "content": "Thanks"}),
            ]
        );
    }

    #[test]
    fn bad_blocks_name_the_field() {
        let e = convert_turn(0, &json!({"role": "system", "content": "x"}), &mut Vec::new()).unwrap_err();
        assert_eq!(e.body().param, Some("messages[0].role"));
        let e =
            convert_turn(0, &json!({"role": "user", "content": [{"type": "document", "source": {}}]}), &mut Vec::new())
                .unwrap_err();
        assert_eq!(e.body().param, Some("messages[0].content[0].type"));
        let e = convert_turn(0, &json!({"role": "user", "content": [{"type": "text"}]}), &mut Vec::new()).unwrap_err();
        assert_eq!(e.body().param, Some("messages[0].content[0].text"));
    }

    #[test]
    fn tool_choice_and_errors() {
        assert_eq!(parse_tool_choice(Some(&json!({"type": "any"}))).unwrap(), ToolChoice::Required);
        assert_eq!(
            parse_tool_choice(Some(&json!({"type": "tool", "name": "f"}))).unwrap(),
            ToolChoice::Named("f".into())
        );
        assert!(parse_tool_choice(Some(&json!({"type": "tool"}))).is_err());
        let e = ApiError::invalid("max_tokens", "`max_tokens` is required");
        assert_eq!(
            error_json(&e),
            json!({"type": "error", "error": {"type": "invalid_request_error", "message": "`max_tokens` is required"}})
        );
        assert_eq!(error_json(&ApiError::Unauthorized)["error"]["type"], "authentication_error");
        let busy = ApiError::engine(EngineError::QueueFull { lane: "agent".into(), capacity: 1 }, None);
        assert_eq!(error_json(&busy)["error"]["type"], "rate_limit_error");
    }
}
