//! `POST /tokenize` and `POST /detokenize` (vLLM's shapes): text or a chat conversation → ids,
//! ids → text, with the served model's tokenizer. Runs on the blocking pool.
//!
//! `/tokenize` takes `prompt` (a string; `add_special_tokens` defaults to true) or `messages`
//! (rendered with the chat template exactly as `/v1/chat/completions` would, tools included) and
//! answers `{"count", "max_model_len", "tokens"}`. `/detokenize` takes `tokens` and answers
//! `{"prompt"}`.

use actix_web::{web, HttpRequest, HttpResponse};
use serde::Deserialize;
use serde_json::Value;

use super::chat::{normalize_messages, template_kwargs};
use super::conversation::{self, Conversation};
use super::errors::ApiError;
use super::params;
use super::tools::{self, ToolChoice};
use super::{blocking, read_body, LaneState};

#[derive(Deserialize, Debug, Default)]
#[serde(default)]
struct TokenizeParams {
    model: Option<String>,
    prompt: Option<String>,
    add_special_tokens: Option<bool>,
    messages: Option<Vec<Value>>,
    tools: Option<Vec<Value>>,
    add_generation_prompt: Option<bool>,
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
}

#[derive(Deserialize, Debug, Default)]
#[serde(default)]
struct DetokenizeParams {
    model: Option<String>,
    tokens: Option<Vec<u32>>,
}

pub(crate) async fn tokenize(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<LaneState>,
) -> Result<HttpResponse, ApiError> {
    let body = read_body(&req, payload, state.shared.opts.max_body_bytes).await?;
    state.ensure_ready()?;
    let remote = super::media_fetch::prefetch(&state, &body).await?;
    let st = state.clone().into_inner();
    let ids = blocking(move || {
        let v = params::parse_body(&body)?;
        let p: TokenizeParams = params::fields(&v)?;
        params::check_model(p.model.as_deref(), st.served_name(), st.shared.engine.model())?;
        match (p.prompt, p.messages) {
            (Some(prompt), None) => {
                let tok = st.shared.assets().tokenizer.clone().ok_or_else(no_tokenizer)?;
                tok.encode(&prompt, p.add_special_tokens.unwrap_or(true)).map_err(|e| ApiError::Internal(e.to_string()))
            }
            (None, Some(messages)) => {
                let conv = Conversation {
                    messages: normalize_messages(Some(messages))?,
                    tools: tools::parse_openai_tools(p.tools.as_deref().unwrap_or(&[]))?,
                    tool_choice: ToolChoice::Auto,
                    kwargs: template_kwargs(p.chat_template_kwargs, None, &st.lane)?,
                    add_generation_prompt: p.add_generation_prompt.unwrap_or(true),
                    remote,
                };
                Ok(conversation::render(&st, conv, "messages")?.ids)
            }
            _ => Err(ApiError::invalid("prompt", "send exactly one of `prompt` (a string) and `messages`")),
        }
    })
    .await?;
    let max_model_len = state.shared.engine.model().max_context;
    Ok(HttpResponse::Ok().json(serde_json::json!({"count": ids.len(), "max_model_len": max_model_len, "tokens": ids})))
}

pub(crate) async fn detokenize(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<LaneState>,
) -> Result<HttpResponse, ApiError> {
    let body = read_body(&req, payload, state.shared.opts.max_body_bytes).await?;
    state.ensure_ready()?;
    let st = state.clone().into_inner();
    let text = blocking(move || {
        let v = params::parse_body(&body)?;
        let p: DetokenizeParams = params::fields(&v)?;
        let model = st.shared.engine.model();
        params::check_model(p.model.as_deref(), st.served_name(), model)?;
        let ids = p.tokens.ok_or_else(|| ApiError::invalid("tokens", "`tokens` is required"))?;
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= model.vocab_size) {
            return Err(ApiError::invalid(
                "tokens",
                format!("`tokens` contains {bad}, outside the vocabulary (size {})", model.vocab_size),
            ));
        }
        let tok = st.shared.assets().tokenizer.clone().ok_or_else(no_tokenizer)?;
        tok.decode(&ids, false).map_err(|e| ApiError::Internal(e.to_string()))
    })
    .await?;
    Ok(HttpResponse::Ok().json(serde_json::json!({"prompt": text})))
}

fn no_tokenizer() -> ApiError {
    ApiError::unsupported("prompt", "this model has no tokenizer")
}
