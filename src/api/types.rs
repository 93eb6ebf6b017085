//! OpenAI wire types: the request fields this server reads (everything else a client sends is
//! ignored) and the response / stream-chunk bodies it writes. Requests are deserialized from a
//! parsed JSON value with the field path tracked, so a wrong type is a 400 naming the field;
//! fields whose JSON shape varies (`stop`, `prompt`, `messages`, `tool_choice`) stay
//! `serde_json::Value` here and are checked by hand in `params`, `chat` and `completions`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::actors::handle::FinishReason;

/// Fields shared by `/v1/chat/completions` and `/v1/completions`.
#[derive(Deserialize, Debug, Default)]
#[serde(default)]
pub struct CommonParams {
    pub model: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<u64>,
    /// A string or a list of strings.
    pub stop: Option<serde_json::Value>,
    pub max_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// vLLM's convention: -1 (or 0) disables.
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// Token id (as a string key) → bias in [-100, 100].
    pub logit_bias: Option<BTreeMap<String, f32>>,
    /// vLLM extensions, cheap to honour.
    pub ignore_eos: Option<bool>,
    pub skip_special_tokens: Option<bool>,
    pub stop_token_ids: Option<Vec<u32>>,
}

#[derive(Deserialize, Debug, Default, Clone, Copy)]
#[serde(default)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// Fields only `/v1/chat/completions` reads.
#[derive(Deserialize, Debug, Default)]
#[serde(default)]
pub struct ChatParams {
    pub messages: Option<Vec<serde_json::Value>>,
    pub tools: Option<Vec<serde_json::Value>>,
    pub tool_choice: Option<serde_json::Value>,
    pub max_completion_tokens: Option<u64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u64>,
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    pub reasoning_effort: Option<String>,
    pub add_generation_prompt: Option<bool>,
    pub response_format: Option<serde_json::Value>,
}

/// Fields only `/v1/completions` reads.
#[derive(Deserialize, Debug, Default)]
#[serde(default)]
pub struct CompletionParams {
    /// A string, a list of strings, a list of token ids, or a list of lists of token ids.
    pub prompt: Option<serde_json::Value>,
    pub echo: Option<bool>,
    /// Legacy: how many top alternatives to return per token (0..=20).
    pub logprobs: Option<u64>,
    pub suffix: Option<String>,
    pub best_of: Option<u64>,
}

/// `usage` in responses and in the `include_usage` stream chunk.
#[derive(Serialize, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UsageBody {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Serialize, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

impl UsageBody {
    pub fn new(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

// ---- chat ----

#[derive(Serialize, Debug)]
pub struct ChatCompletion<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<ChatChoice>,
    pub usage: UsageBody,
}

#[derive(Serialize, Debug)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ChatMessageOut,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<ChatFinishReason>,
}

/// A chat choice's `finish_reason`: the engine's reason, or `tool_calls` when the reply ended
/// with calls.
#[derive(Serialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ChatFinishReason {
    Stop,
    Length,
    ToolCalls,
    /// The loop guard stopped a reply that kept repeating itself.
    Repetition,
}

impl ChatFinishReason {
    /// A reply with calls reports `tool_calls` even when cut by max tokens after them, as vLLM
    /// does. `made_calls` counts only calls that ended whole: one cut off or malformed after its
    /// header was streamed is closed as valid JSON and its raw text follows as content
    /// (`api::tools::parse`), so it does not make the reply a tool-call reply.
    pub fn new(reason: FinishReason, made_calls: bool) -> Self {
        match reason {
            _ if made_calls => Self::ToolCalls,
            FinishReason::Stop => Self::Stop,
            FinishReason::Length => Self::Length,
            FinishReason::Repetition => Self::Repetition,
        }
    }
}

#[derive(Serialize, Debug)]
pub struct ChatMessageOut {
    pub role: &'static str,
    /// `null` when the reply is only tool calls.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct ToolCallOut {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionOut,
}

#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct FunctionOut {
    pub name: String,
    /// The arguments as a JSON text.
    pub arguments: String,
}

/// One entry of a streamed `delta.tool_calls`: the first for a call carries `id`, `type` and the
/// name; later ones carry pieces of `arguments` under the same `index`.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct ToolCallDelta {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

#[derive(Serialize, Debug, Default)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Serialize, Debug)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatTopLogprob>,
}

#[derive(Serialize, Debug)]
pub struct ChatTopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Serialize, Debug)]
pub struct ChatChunk<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageBody>,
}

#[derive(Serialize, Debug)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<ChatFinishReason>,
}

#[derive(Serialize, Debug, Default)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

// ---- legacy completions ----

#[derive(Serialize, Debug)]
pub struct Completion<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageBody>,
}

#[derive(Serialize, Debug)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<FinishReason>,
}

/// OpenAI's legacy logprobs: parallel lists, one entry per token. Prompt tokens echoed back carry
/// `null` logprobs (this server does not compute prompt logprobs yet).
#[derive(Serialize, Debug, Default)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<serde_json::Map<String, serde_json::Value>>>,
    pub text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    pub fn append(&mut self, other: CompletionLogprobs) {
        self.tokens.extend(other.tokens);
        self.token_logprobs.extend(other.token_logprobs);
        self.top_logprobs.extend(other.top_logprobs);
        self.text_offset.extend(other.text_offset);
    }
}

// ---- models ----

#[derive(Serialize, Debug)]
pub struct ModelList<'a> {
    pub object: &'static str,
    pub data: Vec<ModelCard<'a>>,
}

#[derive(Serialize, Debug)]
pub struct ModelCard<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// The engine's model id (often a path or file name).
    pub root: &'a str,
    pub max_model_len: usize,
}
