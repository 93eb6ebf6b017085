//! `POST /v1/chat/completions`: validates the conversation, merges the lane's reasoning
//! defaults into `chat_template_kwargs`, renders the chat template and tokenizes (blocking pool),
//! submits one engine request per choice, and answers with a `chat.completion` or a stream of
//! `chat.completion.chunk` events.
//!
//! Message normalisation: `developer` is sent to the template as `system`; a content list of
//! `{"type":"text"}` parts becomes one string joined with `\n` (as vLLM does for templates that
//! expect string content); a tool call's `arguments` JSON string is parsed into an object, which
//! is what HF templates (`arguments | tojson`) expect. The reply is read by an `output::ReplyParser`
//! per choice: reasoning into `reasoning_content`, tool calls into `tool_calls` (streamed as
//! `delta.reasoning_content` / `delta.tool_calls`: per call a first delta with its `index`, `id`,
//! `type` and name and empty arguments, as soon as the name is known, then its arguments in
//! pieces as the model writes them; the pieces concatenate to the non-streamed `arguments`).

use std::sync::Arc;
use std::time::Instant;

use actix_web::{web, HttpRequest, HttpResponse};
use bytes::{Bytes, BytesMut};
use serde_json::{Map, Value};

use super::conversation::{self, Conversation};
use super::errors::ApiError;
use super::media;
use super::output::{ReplyParser, ReplyPiece, ReplySetup};
use super::params::{self, json_kind, Plan};
use super::reasoning::ReasoningStart;
use super::sse::{self, Choices, SseSource};
use super::structured;
use super::tokens::{finite_logprob, TokenPieces};
use super::tools::parse::{CallEvent, CallList, ToolCall};
use super::tools::{self, ToolChoice};
use super::types::{
    ChatChoice, ChatChunk, ChatChunkChoice, ChatCompletion, ChatDelta, ChatFinishReason, ChatLogprobs, ChatMessageOut,
    ChatParams, ChatTokenLogprob, ChatTopLogprob, CommonParams, FunctionDelta, FunctionOut, ToolCallDelta, ToolCallOut,
    UsageBody,
};
use super::{blocking, metrics, read_body, response_id, unix_now, LaneState};
use crate::actors::handle::{FinishReason, GenerationRequest, StreamEvent, TokenInfo, Usage};
use crate::config::engine::LaneConfig;
use crate::sampling::MAX_LOGPROBS;

/// Names the template receives separately; a kwarg may not shadow them.
const RESERVED_KWARGS: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// A validated, tokenized chat request.
struct Prepared {
    requests: Vec<GenerationRequest>,
    plan: Plan,
    prompt_len: usize,
    /// `Some` when the client asked for logprobs.
    pieces: Option<Arc<TokenPieces>>,
    reply: ReplySetup,
}

pub(crate) async fn handle(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<LaneState>,
) -> Result<HttpResponse, ApiError> {
    let start = Instant::now();
    let body = read_body(&req, payload, state.shared.opts.max_body_bytes).await?;
    state.ensure_ready()?;
    let remote = super::media_fetch::prefetch(&state, &body).await?;
    let st = state.clone().into_inner();
    let prepared = blocking(move || prepare(&st, &body, remote)).await?;
    tracing::debug!(
        lane = %state.lane.name,
        prompt_tokens = prepared.prompt_len,
        n = prepared.plan.n,
        stream = prepared.plan.stream,
        "chat completion admitted"
    );
    let receivers = state.submit(prepared.requests, "messages")?;
    let choices = Choices::new(receivers, &state.lane.name, start);
    let reply = Reply {
        id: response_id("chatcmpl"),
        created: unix_now(),
        model: state.served_name().to_owned(),
        lane: state.lane.name.clone(),
        prompt_len: prepared.prompt_len,
        pieces: prepared.pieces,
        setup: prepared.reply,
    };
    if prepared.plan.stream {
        let n = prepared.plan.n;
        let include_usage = prepared.plan.include_usage;
        return Ok(sse::sse_response(ChatStream::new(choices, reply, n, include_usage)));
    }
    reply.collect(choices, prepared.plan.n).await
}

fn prepare(state: &LaneState, body: &[u8], remote: super::media::Fetched) -> Result<Prepared, ApiError> {
    let v = params::parse_body(body)?;
    let common: CommonParams = params::fields(&v)?;
    let chat: ChatParams = params::fields(&v)?;
    let model = state.shared.engine.model();
    params::check_model(common.model.as_deref(), state.served_name(), model)?;
    let logprobs = match (chat.logprobs.unwrap_or(false), chat.top_logprobs) {
        (_, Some(k)) if k > MAX_LOGPROBS as u64 => {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("`top_logprobs` = {k} must be in 0..={MAX_LOGPROBS}"),
            ))
        }
        (false, Some(k)) if k > 0 => {
            return Err(ApiError::invalid("top_logprobs", "`top_logprobs` requires `logprobs: true`"))
        }
        (true, k) => Some(k.unwrap_or(0) as usize),
        (false, _) => None,
    };
    // OpenAI renamed `max_tokens` to `max_completion_tokens`; the new name wins when both come.
    let max_tokens = chat
        .max_completion_tokens
        .map(|m| (m, "max_completion_tokens"))
        .or(common.max_tokens.map(|m| (m, "max_tokens")));
    let mut plan = params::plan(&common, max_tokens, logprobs, &state.lane, model)?;
    let constraint = structured::requested(&v)?;
    let tool_choice = ToolChoice::from_openai(chat.tool_choice.as_ref())?;
    let tools = tools::parse_openai_tools(chat.tools.as_deref().unwrap_or(&[]))?;
    tools::check_choice(&tool_choice, &tools, "tool_choice")?;
    let conversation = Conversation {
        messages: normalize_messages(chat.messages)?,
        tools,
        tool_choice,
        kwargs: template_kwargs(chat.chat_template_kwargs, chat.reasoning_effort, &state.lane)?,
        add_generation_prompt: chat.add_generation_prompt.unwrap_or(true),
        remote,
    };
    let rendered = conversation::render(state, conversation, "messages")?;
    if rendered.keep_special_tokens {
        plan.skip_special_tokens = false;
    }
    if let Some(stop) = rendered.stop_after_call {
        plan.stop_strings.push(stop.to_owned());
    }
    let ids = rendered.ids;
    let max_tokens = params::resolve_max_tokens(&plan, ids.len(), &state.lane, model, "messages")?;
    let prompt_len = ids.len();
    let mut requests = params::requests(&plan, ids, max_tokens, &state.lane);
    requests.iter_mut().for_each(|r| r.images = rendered.images.clone());
    // A forced tool call is the whole reply, so its grammar replaces any `response_format`.
    let reasoning = rendered.reply.reasoning;
    match (rendered.call_grammar, constraint) {
        (Some(call), _) => structured::attach(state, &mut requests, &call, ReasoningStart::Off)?,
        (None, Some(c)) => structured::attach(state, &mut requests, &c, reasoning)?,
        (None, None) => {}
    }
    let pieces = if logprobs.is_some() { state.shared.assets().pieces.clone() } else { None };
    Ok(Prepared { requests, plan, prompt_len, pieces, reply: rendered.reply })
}

/// Check each message and rewrite it into what templates expect (see the module doc).
pub(crate) fn normalize_messages(messages: Option<Vec<Value>>) -> Result<Vec<Value>, ApiError> {
    let messages = messages.ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "`messages` must contain at least one message"));
    }
    messages.into_iter().enumerate().map(|(i, m)| normalize_message(i, m)).collect()
}

fn normalize_message(i: usize, m: Value) -> Result<Value, ApiError> {
    let Value::Object(mut obj) = m else {
        return Err(ApiError::invalid(
            format!("messages[{i}]"),
            format!("`messages[{i}]` must be an object, not {}", json_kind(&m)),
        ));
    };
    let role_param = format!("messages[{i}].role");
    let role = match obj.get("role") {
        Some(Value::String(r)) => match r.as_str() {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            "tool" => "tool",
            other => {
                return Err(ApiError::invalid(
                    role_param,
                    format!(
                    "unknown role `{other}` in `messages[{i}]`; expected system, developer, user, assistant or tool"
                ),
                ))
            }
        },
        None | Some(Value::Null) => {
            return Err(ApiError::invalid(role_param, format!("`messages[{i}].role` is required")))
        }
        Some(other) => {
            return Err(ApiError::invalid(
                role_param,
                format!("`messages[{i}].role` must be a string, not {}", json_kind(other)),
            ))
        }
    };
    obj.insert("role".into(), Value::from(role));
    let content_param = format!("messages[{i}].content");
    match obj.get("content") {
        None | Some(Value::Null) if role == "assistant" => {}
        None | Some(Value::Null) => {
            return Err(ApiError::invalid(
                content_param,
                format!("`messages[{i}].content` is required for role `{role}`"),
            ))
        }
        Some(Value::String(_)) => {}
        Some(Value::Array(parts)) => {
            let text = join_text_parts(i, parts)?;
            // With images or video the parts stay a list (`api::media` takes them out of it).
            if !parts.iter().any(media::is_media_part) {
                obj.insert("content".into(), Value::String(text));
            }
        }
        Some(other) => {
            return Err(ApiError::invalid(
                content_param,
                format!(
                    "`messages[{i}].content` must be a string or a list of content parts, not {}",
                    json_kind(other)
                ),
            ))
        }
    }
    if let Some(Value::Array(calls)) = obj.get_mut("tool_calls") {
        for call in calls.iter_mut() {
            if let Some(args) = call.get_mut("function").and_then(|f| f.get_mut("arguments")) {
                if let Some(parsed) = args.as_str().and_then(|s| serde_json::from_str::<Value>(s).ok()) {
                    if parsed.is_object() {
                        *args = parsed;
                    }
                }
            }
        }
    }
    Ok(Value::Object(obj))
}

fn join_text_parts(i: usize, parts: &[Value]) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let param = format!("messages[{i}].content[{j}]");
        let Some(obj) = part.as_object() else {
            return Err(ApiError::invalid(
                param.clone(),
                format!("`{param}` must be a content part object, not {}", json_kind(part)),
            ));
        };
        match obj.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some("image_url" | "video_url" | "video") => continue,
            Some(other) => {
                return Err(ApiError::unsupported(
                    format!("{param}.type"),
                    format!(
                    "content part type `{other}` in `{param}` is not supported; only `text`, `image_url`, `video_url` and `video` parts are"
                ),
                ))
            }
            None => return Err(ApiError::invalid(format!("{param}.type"), format!("`{param}.type` must be a string"))),
        }
        match obj.get("text") {
            Some(Value::String(t)) => texts.push(t.as_str()),
            _ => return Err(ApiError::invalid(format!("{param}.text"), format!("`{param}.text` must be a string"))),
        }
    }
    Ok(texts.join("\n"))
}

/// The kwargs the template sees: the request's `chat_template_kwargs`, then the top-level
/// `reasoning_effort`, then the lane defaults, each only where nothing earlier set the key.
/// `thinking` and `enable_thinking` are two spellings of one switch (templates read one or the
/// other): a boolean the request sets for either is mirrored to the other, and the lane default
/// fills both only when the request set neither.
pub(crate) fn template_kwargs(
    requested: Option<Map<String, Value>>,
    reasoning_effort: Option<String>,
    lane: &LaneConfig,
) -> Result<Map<String, Value>, ApiError> {
    let mut kw = requested.unwrap_or_default();
    if let Some(k) = RESERVED_KWARGS.iter().find(|k| kw.contains_key(**k)) {
        return Err(ApiError::invalid(
            "chat_template_kwargs",
            format!("`chat_template_kwargs` may not set `{k}`: it is passed to the template separately"),
        ));
    }
    if !kw.contains_key("reasoning_effort") {
        if let Some(effort) = reasoning_effort.or_else(|| lane.reasoning_effort.clone()) {
            kw.insert("reasoning_effort".into(), Value::String(effort));
        }
    }
    match (kw.get("enable_thinking").cloned(), kw.get("thinking").cloned()) {
        (None, None) => {
            if let Some(t) = lane.thinking {
                kw.insert("enable_thinking".into(), Value::Bool(t));
                kw.insert("thinking".into(), Value::Bool(t));
            }
        }
        (Some(v @ Value::Bool(_)), None) => {
            kw.insert("thinking".into(), v);
        }
        (None, Some(v @ Value::Bool(_))) => {
            kw.insert("enable_thinking".into(), v);
        }
        _ => {}
    }
    Ok(kw)
}

/// Response fields shared by the streaming and non-streaming paths.
struct Reply {
    id: String,
    created: u64,
    model: String,
    lane: String,
    prompt_len: usize,
    pieces: Option<Arc<TokenPieces>>,
    setup: ReplySetup,
}

impl Reply {
    fn logprobs(&self, tokens: &[TokenInfo]) -> Option<ChatLogprobs> {
        let pieces = self.pieces.as_ref()?;
        Some(ChatLogprobs { content: tokens.iter().map(|t| token_logprob(pieces, t)).collect() })
    }

    fn usage(&self, completion_tokens: usize, cached: usize) -> UsageBody {
        UsageBody::new(self.prompt_len, completion_tokens, cached)
    }

    async fn collect(self, mut choices: Choices, n: usize) -> Result<HttpResponse, ApiError> {
        let mut acc: Vec<Acc> = (0..n).map(|_| Acc::new(&self.setup)).collect();
        while let Some((i, event)) = choices.next().await {
            match event {
                StreamEvent::Delta { text, tokens } => {
                    let pieces = acc[i].parser.push(&text);
                    acc[i].add(pieces);
                    acc[i].tokens.extend(tokens);
                }
                StreamEvent::Finished { reason, usage } => {
                    let pieces = acc[i].parser.finish();
                    acc[i].add(pieces);
                    acc[i].finish = Some((reason, usage));
                }
                StreamEvent::Error(e) => {
                    choices.cancel_all();
                    metrics::request_error(&self.lane, e.kind());
                    return Err(ApiError::engine(e, Some("messages")));
                }
            }
        }
        let completion_tokens = acc.iter().map(Acc::completion_tokens).sum();
        let cached = acc.first().and_then(|a| a.finish).map_or(0, |(_, u)| u.cached_tokens);
        let choices = acc
            .into_iter()
            .enumerate()
            .map(|(index, a)| {
                let made_calls = !a.calls.calls.is_empty();
                let finish_reason = a.finish.map(|(r, _)| ChatFinishReason::new(r, a.calls.whole > 0));
                ChatChoice {
                    index,
                    logprobs: self.logprobs(&a.tokens),
                    message: ChatMessageOut {
                        role: "assistant",
                        content: (!made_calls || !a.content.is_empty()).then_some(a.content),
                        reasoning_content: a.reasoning,
                        tool_calls: a.calls.calls.into_iter().map(tool_call_out).collect(),
                    },
                    finish_reason,
                }
            })
            .collect();
        let body = ChatCompletion {
            id: &self.id,
            object: "chat.completion",
            created: self.created,
            model: &self.model,
            choices,
            usage: self.usage(completion_tokens, cached),
        };
        Ok(HttpResponse::Ok().json(body))
    }
}

/// One choice of a non-streamed reply, as it accumulates.
struct Acc {
    parser: ReplyParser,
    content: String,
    reasoning: Option<String>,
    calls: CallList,
    tokens: Vec<TokenInfo>,
    finish: Option<(FinishReason, Usage)>,
}

impl Acc {
    fn new(setup: &ReplySetup) -> Self {
        Self {
            parser: setup.parser(),
            content: String::new(),
            reasoning: None,
            calls: CallList::default(),
            tokens: Vec::new(),
            finish: None,
        }
    }

    fn add(&mut self, pieces: Vec<ReplyPiece>) {
        for piece in pieces {
            match piece {
                ReplyPiece::Reasoning(t) => self.reasoning.get_or_insert_with(String::new).push_str(&t),
                ReplyPiece::Content(t) => self.content.push_str(&t),
                ReplyPiece::Call(e) => self.calls.add(e),
            }
        }
    }

    fn completion_tokens(&self) -> usize {
        self.finish.map_or(self.tokens.len(), |(_, u)| u.completion_tokens)
    }
}

fn tool_call_out(c: ToolCall) -> ToolCallOut {
    ToolCallOut { id: c.id, kind: "function", function: FunctionOut { name: c.name, arguments: c.arguments } }
}

fn token_logprob(pieces: &TokenPieces, t: &TokenInfo) -> ChatTokenLogprob {
    let (token, bytes) = pieces.piece(t.id);
    ChatTokenLogprob {
        token,
        logprob: finite_logprob(t.logprob.unwrap_or(f32::NEG_INFINITY)),
        bytes,
        top_logprobs: t
            .top_logprobs
            .iter()
            .map(|&(id, lp)| {
                let (token, bytes) = pieces.piece(id);
                ChatTopLogprob { token, logprob: finite_logprob(lp), bytes }
            })
            .collect(),
    }
}

/// The delta one parsed piece becomes: reasoning and content as text deltas; a call as OpenAI
/// streams it: its start as `{index, id, type, function: {name, arguments: ""}}`, each piece of
/// its arguments as `{index, function: {arguments}}`; its end sends nothing.
fn piece_delta(piece: ReplyPiece) -> Option<ChatDelta> {
    let call = |d: ToolCallDelta| Some(ChatDelta { tool_calls: Some(vec![d]), ..ChatDelta::default() });
    match piece {
        ReplyPiece::Reasoning(t) => Some(ChatDelta { reasoning_content: Some(t), ..ChatDelta::default() }),
        ReplyPiece::Content(t) => Some(ChatDelta { content: Some(t), ..ChatDelta::default() }),
        ReplyPiece::Call(CallEvent::Start { index, id, name }) => call(ToolCallDelta {
            index,
            id: Some(id),
            kind: Some("function"),
            function: FunctionDelta { name: Some(name), arguments: String::new() },
        }),
        ReplyPiece::Call(CallEvent::Arguments { index, text }) => {
            call(ToolCallDelta { index, id: None, kind: None, function: FunctionDelta { name: None, arguments: text } })
        }
        ReplyPiece::Call(CallEvent::End { .. }) => None,
    }
}

/// One choice of a streamed reply.
struct StreamChoice {
    parser: ReplyParser,
    /// Calls that ended whole (they make the finish reason `tool_calls`).
    whole_calls: usize,
}

/// The SSE body: role chunks, reasoning / content / tool-call chunks as the engine produces them
/// (interleaved across choices, each tagged with its `index`), a `finish_reason` chunk per
/// choice, the optional usage chunk, then `[DONE]`. An engine error ends the stream with an error
/// event and `[DONE]`.
struct ChatStream {
    choices: Choices,
    reply: Reply,
    parsers: Vec<StreamChoice>,
    include_usage: bool,
    completion_tokens: usize,
    cached: Option<usize>,
    started: bool,
    done: bool,
}

impl ChatStream {
    fn new(choices: Choices, reply: Reply, n: usize, include_usage: bool) -> Self {
        let parsers = (0..n).map(|_| StreamChoice { parser: reply.setup.parser(), whole_calls: 0 }).collect();
        Self { choices, reply, parsers, include_usage, completion_tokens: 0, cached: None, started: false, done: false }
    }

    fn chunk(&self, choices: Vec<ChatChunkChoice>, usage: Option<UsageBody>) -> Bytes {
        sse::event(&ChatChunk {
            id: &self.reply.id,
            object: "chat.completion.chunk",
            created: self.reply.created,
            model: &self.reply.model,
            choices,
            usage,
        })
    }

    fn one(
        &self,
        index: usize,
        delta: ChatDelta,
        logprobs: Option<ChatLogprobs>,
        finish: Option<ChatFinishReason>,
    ) -> Bytes {
        self.chunk(vec![ChatChunkChoice { index, delta, logprobs, finish_reason: finish }], None)
    }

    /// The chunks for `pieces` of choice `i`; `logprobs` ride on the first (or on an empty
    /// content delta when the tokens released no text yet).
    fn pieces(&mut self, i: usize, pieces: Vec<ReplyPiece>, mut logprobs: Option<ChatLogprobs>) -> BytesMut {
        let mut deltas = Vec::new();
        for piece in pieces {
            if let ReplyPiece::Call(CallEvent::End { whole: true, .. }) = piece {
                self.parsers[i].whole_calls += 1;
            }
            deltas.extend(piece_delta(piece));
        }
        if deltas.is_empty() && logprobs.is_some() {
            deltas.push(ChatDelta { content: Some(String::new()), ..ChatDelta::default() });
        }
        let mut out = BytesMut::new();
        for delta in deltas {
            out.extend_from_slice(&self.one(i, delta, logprobs.take(), None));
        }
        out
    }
}

impl SseSource for ChatStream {
    async fn next_chunk(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        if !self.started {
            self.started = true;
            let mut out = BytesMut::new();
            for i in 0..self.parsers.len() {
                let delta = ChatDelta { role: Some("assistant"), content: Some(String::new()), ..ChatDelta::default() };
                out.extend_from_slice(&self.one(i, delta, None, None));
            }
            return Some(out.freeze());
        }
        loop {
            match self.choices.next().await {
                Some((i, StreamEvent::Delta { text, tokens })) => {
                    let logprobs = if tokens.is_empty() { None } else { self.reply.logprobs(&tokens) };
                    let pieces = self.parsers[i].parser.push(&text);
                    let out = self.pieces(i, pieces, logprobs);
                    if out.is_empty() {
                        continue;
                    }
                    return Some(out.freeze());
                }
                Some((i, StreamEvent::Finished { reason, usage })) => {
                    self.completion_tokens += usage.completion_tokens;
                    if i == 0 {
                        self.cached = Some(usage.cached_tokens);
                    }
                    let pieces = self.parsers[i].parser.finish();
                    let mut out = self.pieces(i, pieces, None);
                    let finish = ChatFinishReason::new(reason, self.parsers[i].whole_calls > 0);
                    out.extend_from_slice(&self.one(i, ChatDelta::default(), None, Some(finish)));
                    return Some(out.freeze());
                }
                Some((_, StreamEvent::Error(e))) => {
                    self.choices.cancel_all();
                    self.done = true;
                    metrics::request_error(&self.reply.lane, e.kind());
                    let mut out = BytesMut::from(&sse::error_event(&ApiError::engine(e, Some("messages")))[..]);
                    out.extend_from_slice(&sse::done_event());
                    return Some(out.freeze());
                }
                None => {
                    self.done = true;
                    let mut out = BytesMut::new();
                    if self.include_usage {
                        let usage = self.reply.usage(self.completion_tokens, self.cached.unwrap_or(0));
                        out.extend_from_slice(&self.chunk(Vec::new(), Some(usage)));
                    }
                    out.extend_from_slice(&sse::done_event());
                    return Some(out.freeze());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn lane(effort: Option<&str>, thinking: Option<bool>) -> LaneConfig {
        LaneConfig {
            name: "agent".into(),
            port: 0,
            priority: 0,
            reasoning_effort: effort.map(str::to_owned),
            thinking,
            default_max_tokens: 16,
            max_tokens_limit: 64,
            max_queue: 4,
            speculative: Default::default(),
            num_speculative_tokens: 7,
            speculative_row_cost: None,
            speculative_draft_cost: None,
            loop_guard: Default::default(),
            target_ttft_ms: None,
            target_itl_ms: None,
        }
    }

    fn kw(requested: Value, effort: Option<&str>, l: &LaneConfig) -> Value {
        let requested = requested.as_object().cloned();
        Value::Object(template_kwargs(requested, effort.map(str::to_owned), l).unwrap())
    }

    #[test]
    fn lane_defaults_fill_only_what_the_request_left_unset() {
        let l = lane(Some("high"), Some(true));
        assert_eq!(
            kw(json!(null), None, &l),
            json!({"reasoning_effort": "high", "enable_thinking": true, "thinking": true})
        );
        // Top-level reasoning_effort counts as the request setting it.
        assert_eq!(kw(json!(null), Some("low"), &l)["reasoning_effort"], "low");
        // chat_template_kwargs is the most specific and wins over the top-level field.
        assert_eq!(kw(json!({"reasoning_effort": "medium"}), Some("low"), &l)["reasoning_effort"], "medium");
        // Setting one spelling of the switch sets both; the lane default does not sneak back in.
        let k = kw(json!({"enable_thinking": false}), None, &l);
        assert_eq!((k["enable_thinking"].clone(), k["thinking"].clone()), (json!(false), json!(false)));
        let k = kw(json!({"thinking": false}), None, &l);
        assert_eq!((k["enable_thinking"].clone(), k["thinking"].clone()), (json!(false), json!(false)));
        // Other kwargs pass through untouched.
        assert_eq!(kw(json!({"custom": [1]}), None, &l)["custom"], json!([1]));
        // A lane without defaults adds nothing: never a silent "max".
        assert_eq!(kw(json!(null), None, &lane(None, None)), json!({}));
    }

    #[test]
    fn call_events_stream_in_openai_shape() {
        let delta = |e: CallEvent| piece_delta(ReplyPiece::Call(e)).map(|d| serde_json::to_value(d).unwrap());
        assert_eq!(
            delta(CallEvent::Start { index: 1, id: "call_1".into(), name: "get_weather".into() }),
            Some(json!({"tool_calls": [{"index": 1, "id": "call_1", "type": "function",
                                        "function": {"name": "get_weather", "arguments": ""}}]}))
        );
        assert_eq!(
            delta(CallEvent::Arguments { index: 1, text: "{\"city\":\"Oslo\"".into() }),
            Some(json!({"tool_calls": [{"index": 1, "function": {"arguments": "{\"city\":\"Oslo\""}}]}))
        );
        assert_eq!(delta(CallEvent::End { index: 1, whole: true }), None);
    }

    #[test]
    fn reserved_kwargs_are_refused() {
        let e = template_kwargs(json!({"messages": []}).as_object().cloned(), None, &lane(None, None)).unwrap_err();
        assert_eq!(e.body().param, Some("chat_template_kwargs"));
    }

    #[test]
    fn messages_are_normalised() {
        let out = normalize_messages(Some(vec![
            json!({"role": "developer", "content": "be brief"}),
            json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "x"}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                   "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": "42"}),
        ]))
        .unwrap();
        assert_eq!(out[0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(out[1], json!({"role": "user", "content": "a\nb", "name": "x"}));
        assert_eq!(out[2]["tool_calls"][0]["function"]["arguments"], json!({"x": 1}));
        assert_eq!(out[3]["tool_call_id"], "c1");
    }

    #[test]
    fn bad_messages_name_the_field() {
        let cases = [
            (json!({"role": "wizard", "content": "x"}), "messages[0].role"),
            (json!({"content": "x"}), "messages[0].role"),
            (json!({"role": 3, "content": "x"}), "messages[0].role"),
            (json!({"role": "user"}), "messages[0].content"),
            (json!({"role": "user", "content": 5}), "messages[0].content"),
            (
                json!({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}),
                "messages[0].content[0].type",
            ),
            (json!({"role": "user", "content": [{"type": "text", "text": 1}]}), "messages[0].content[0].text"),
            (json!({"role": "user", "content": ["x"]}), "messages[0].content[0]"),
            (json!("hello"), "messages[0]"),
        ];
        for (m, param) in cases {
            let e = normalize_messages(Some(vec![m.clone()])).unwrap_err();
            assert_eq!(e.body().param, Some(param), "{m}");
            assert_eq!(e.status().as_u16(), 400);
        }
        assert_eq!(normalize_messages(Some(vec![])).unwrap_err().body().param, Some("messages"));
        assert_eq!(normalize_messages(None).unwrap_err().body().param, Some("messages"));
    }
}
