//! `POST /v1/completions` (OpenAI's legacy text completions): prompts as a string, a list of
//! strings, a list of token ids or a list of lists; one choice per prompt × `n` (choice index
//! `prompt * n + i`); `echo`; legacy `logprobs` (an integer: top alternatives per token).
//!
//! Known gap: with `echo` and `logprobs`, the echoed prompt tokens carry `null` logprobs (the
//! engine does not compute prompt logprobs yet). `text_offset` counts characters of each token's
//! own text, which can drift from the choice text for tokenizers whose pieces do not concatenate
//! to the decoded text (SentencePiece's leading-space strip).

use std::sync::Arc;
use std::time::Instant;

use actix_web::{web, HttpRequest, HttpResponse};
use bytes::{Bytes, BytesMut};
use serde_json::Value;

use super::errors::ApiError;
use super::params::{self, json_kind, Plan, MAX_CHOICES};
use super::sse::{self, Choices, SseSource};
use super::tokens::{finite_logprob, TokenPieces};
use super::types::{CommonParams, Completion, CompletionChoice, CompletionLogprobs, CompletionParams, UsageBody};
use super::{blocking, metrics, read_body, response_id, unix_now, LaneState};
use crate::actors::handle::{FinishReason, GenerationRequest, ModelInfo, StreamEvent, TokenInfo, Usage};
use crate::sampling::MAX_LOGPROBS;
use crate::tokenizer::bounded::proves_over;

enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

/// One prompt after tokenization.
struct PromptPlan {
    len: usize,
    /// What `echo` prepends (the prompt as text), when asked.
    echo_text: Option<String>,
    /// The prompt's ids, kept for echoed logprobs.
    echo_ids: Vec<u32>,
}

struct Prepared {
    requests: Vec<GenerationRequest>,
    plan: Plan,
    prompts: Vec<PromptPlan>,
    /// `Some` when the client asked for logprobs.
    pieces: Option<Arc<TokenPieces>>,
}

pub(crate) async fn handle(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<LaneState>,
) -> Result<HttpResponse, ApiError> {
    let start = Instant::now();
    let body = read_body(&req, payload, state.shared.opts.max_body_bytes).await?;
    state.ensure_ready()?;
    let st = state.clone().into_inner();
    let prepared = blocking(move || prepare(&st, &body)).await?;
    tracing::debug!(
        lane = %state.lane.name,
        prompts = prepared.prompts.len(),
        n = prepared.plan.n,
        stream = prepared.plan.stream,
        "completion admitted"
    );
    let receivers = state.submit(prepared.requests, "prompt")?;
    let choices = Choices::new(receivers, &state.lane.name, start);
    let reply = Reply {
        id: response_id("cmpl"),
        created: unix_now(),
        model: state.served_name().to_owned(),
        lane: state.lane.name.clone(),
        n: prepared.plan.n,
        prompts: prepared.prompts,
        pieces: prepared.pieces,
    };
    if prepared.plan.stream {
        let include_usage = prepared.plan.include_usage;
        return Ok(sse::sse_response(CompletionStream::new(choices, reply, include_usage)));
    }
    reply.collect(choices).await
}

fn prepare(state: &LaneState, body: &[u8]) -> Result<Prepared, ApiError> {
    let v = params::parse_body(body)?;
    let common: CommonParams = params::fields(&v)?;
    let cp: CompletionParams = params::fields(&v)?;
    let model = state.shared.engine.model();
    params::check_model(common.model.as_deref(), state.served_name(), model)?;
    if cp.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported("suffix", "`suffix` (fill-in-the-middle) is not supported"));
    }
    let logprobs = match cp.logprobs {
        Some(k) if k > MAX_LOGPROBS as u64 => {
            return Err(ApiError::invalid("logprobs", format!("`logprobs` = {k} must be in 0..={MAX_LOGPROBS}")))
        }
        k => k.map(|k| k as usize),
    };
    let plan = params::plan(&common, common.max_tokens.map(|m| (m, "max_tokens")), logprobs, &state.lane, model)?;
    if let Some(b) = cp.best_of {
        if b != plan.n as u64 {
            return Err(ApiError::unsupported("best_of", "`best_of` other than `n` is not supported"));
        }
    }
    let inputs = parse_prompt(cp.prompt.as_ref(), model)?;
    if inputs.len() * plan.n > MAX_CHOICES {
        return Err(ApiError::invalid(
            "n",
            format!("{} prompts × n = {} choices; at most {MAX_CHOICES} per request", inputs.len(), plan.n),
        ));
    }
    let echo = cp.echo.unwrap_or(false);
    let assets = state.shared.assets();
    let no_tokenizer = |param: &str| {
        ApiError::unsupported(
            param,
            "this model has no tokenizer, so only token-id prompts without `echo` or `logprobs` work",
        )
    };
    let tokenizer = assets.tokenizer.as_ref();
    if tokenizer.is_none() && logprobs.is_some() {
        return Err(no_tokenizer("logprobs"));
    }
    let mut requests = Vec::with_capacity(inputs.len() * plan.n);
    let mut prompts = Vec::with_capacity(inputs.len());
    for (p, input) in inputs.into_iter().enumerate() {
        let (ids, text) = match input {
            PromptInput::Text(t) => {
                let tok = tokenizer.ok_or_else(|| no_tokenizer("prompt"))?;
                let internal = |e: crate::tokenizer::TokenizerError| ApiError::Internal(e.to_string());
                if let Some(at_least) = proves_over(tok, &t, model.max_context).map_err(internal)? {
                    return Err(ApiError::prompt_over_context(model.max_context, at_least, "prompt"));
                }
                // A raw prompt is not a conversation: special-token text in it is encoded as
                // special tokens, as llama.cpp and vLLM do (chat messages never are).
                (tok.encode(&t, true).map_err(internal)?, Some(t))
            }
            PromptInput::Tokens(ids) => (ids, None),
        };
        if ids.is_empty() {
            return Err(ApiError::invalid(prompt_param(p), "the prompt is empty"));
        }
        let max_tokens = params::resolve_max_tokens(&plan, ids.len(), &state.lane, model, "prompt")?;
        let echo_text = match (echo, text) {
            (false, _) => None,
            (true, Some(t)) => Some(t),
            (true, None) => {
                let tok = tokenizer.ok_or_else(|| no_tokenizer("echo"))?;
                Some(tok.decode(&ids, plan.skip_special_tokens).map_err(|e| ApiError::Internal(e.to_string()))?)
            }
        };
        let echo_ids = if echo && logprobs.is_some() { ids.clone() } else { Vec::new() };
        prompts.push(PromptPlan { len: ids.len(), echo_text, echo_ids });
        requests.extend(params::requests(&plan, ids, max_tokens, &state.lane));
    }
    let pieces = if logprobs.is_some() { assets.pieces.clone() } else { None };
    Ok(Prepared { requests, plan, prompts, pieces })
}

fn prompt_param(p: usize) -> String {
    if p == 0 {
        "prompt".into()
    } else {
        format!("prompt[{p}]")
    }
}

const PROMPT_SHAPES: &str =
    "`prompt` must be a string, a list of strings, a list of token ids, or a list of lists of token ids";

fn parse_prompt(v: Option<&Value>, model: &ModelInfo) -> Result<Vec<PromptInput>, ApiError> {
    let token = |v: &Value, param: String| -> Result<u32, ApiError> {
        match v.as_u64() {
            Some(id) if id < model.vocab_size as u64 => Ok(id as u32),
            Some(id) => Err(ApiError::invalid(
                param,
                format!("token id {id} is outside the vocabulary (size {})", model.vocab_size),
            )),
            None => Err(ApiError::invalid(param, format!("{PROMPT_SHAPES}; found {v}"))),
        }
    };
    match v {
        None | Some(Value::Null) => Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(Value::String(s)) => Ok(vec![PromptInput::Text(s.clone())]),
        Some(Value::Array(items)) if items.is_empty() => Err(ApiError::invalid("prompt", "`prompt` must not be empty")),
        Some(Value::Array(items)) => match &items[0] {
            Value::String(_) => items
                .iter()
                .enumerate()
                .map(|(i, s)| match s {
                    Value::String(s) => Ok(PromptInput::Text(s.clone())),
                    other => Err(ApiError::invalid(
                        format!("prompt[{i}]"),
                        format!("{PROMPT_SHAPES}; found {}", json_kind(other)),
                    )),
                })
                .collect(),
            Value::Number(_) => {
                let ids = items
                    .iter()
                    .enumerate()
                    .map(|(i, t)| token(t, format!("prompt[{i}]")))
                    .collect::<Result<_, _>>()?;
                Ok(vec![PromptInput::Tokens(ids)])
            }
            Value::Array(_) => items
                .iter()
                .enumerate()
                .map(|(i, list)| match list {
                    Value::Array(ids) if ids.is_empty() => {
                        Err(ApiError::invalid(format!("prompt[{i}]"), "token-id prompts must not be empty"))
                    }
                    Value::Array(ids) => Ok(PromptInput::Tokens(
                        ids.iter()
                            .enumerate()
                            .map(|(j, t)| token(t, format!("prompt[{i}][{j}]")))
                            .collect::<Result<_, _>>()?,
                    )),
                    other => Err(ApiError::invalid(
                        format!("prompt[{i}]"),
                        format!("{PROMPT_SHAPES}; found {}", json_kind(other)),
                    )),
                })
                .collect(),
            other => Err(ApiError::invalid("prompt[0]", format!("{PROMPT_SHAPES}; found {}", json_kind(other)))),
        },
        Some(other) => Err(ApiError::invalid("prompt", format!("{PROMPT_SHAPES}; found {}", json_kind(other)))),
    }
}

struct Reply {
    id: String,
    created: u64,
    model: String,
    lane: String,
    n: usize,
    prompts: Vec<PromptPlan>,
    pieces: Option<Arc<TokenPieces>>,
}

impl Reply {
    fn prompt_of(&self, choice: usize) -> &PromptPlan {
        &self.prompts[choice / self.n]
    }

    /// The echoed prompt (and its `null`-logprob tokens) that opens choice `index`, and the
    /// character offset where generated text starts.
    fn opening(&self, index: usize) -> (String, Option<CompletionLogprobs>, usize) {
        let prompt = self.prompt_of(index);
        let text = prompt.echo_text.clone().unwrap_or_default();
        let start = text.chars().count();
        let logprobs = self.pieces.as_ref().map(|pieces| {
            let mut lp = CompletionLogprobs::default();
            let mut offset = 0;
            for &id in &prompt.echo_ids {
                let (token, _) = pieces.piece(id);
                lp.text_offset.push(offset);
                offset += token.chars().count();
                lp.tokens.push(token);
                lp.token_logprobs.push(None);
                lp.top_logprobs.push(None);
            }
            lp
        });
        (text, logprobs, start)
    }

    /// Legacy logprobs for generated `tokens`, whose text starts at character `*offset`.
    fn logprobs(&self, tokens: &[TokenInfo], offset: &mut usize) -> Option<CompletionLogprobs> {
        let pieces = self.pieces.as_ref()?;
        let mut lp = CompletionLogprobs::default();
        for t in tokens {
            let (token, _) = pieces.piece(t.id);
            let chosen = finite_logprob(t.logprob.unwrap_or(f32::NEG_INFINITY));
            let mut top = serde_json::Map::new();
            for &(id, alt) in &t.top_logprobs {
                top.entry(pieces.piece(id).0).or_insert_with(|| json_f32(finite_logprob(alt)));
            }
            // Like vLLM: the sampled token is always listed, even outside the top k.
            top.entry(token.clone()).or_insert_with(|| json_f32(chosen));
            lp.text_offset.push(*offset);
            *offset += token.chars().count();
            lp.tokens.push(token);
            lp.token_logprobs.push(Some(chosen));
            lp.top_logprobs.push(Some(top));
        }
        Some(lp)
    }

    /// Prompt tokens count once per prompt, cached tokens as reported for its first choice.
    fn usage(&self, completion_tokens: usize, first_choice_usage: &[Option<Usage>]) -> UsageBody {
        let prompt_tokens = self.prompts.iter().map(|p| p.len).sum();
        let cached = first_choice_usage.iter().flatten().map(|u| u.cached_tokens).sum();
        UsageBody::new(prompt_tokens, completion_tokens, cached)
    }

    async fn collect(self, mut choices: Choices) -> Result<HttpResponse, ApiError> {
        let total = self.prompts.len() * self.n;
        let mut acc: Vec<Acc> = (0..total)
            .map(|i| {
                let (text, logprobs, offset) = self.opening(i);
                Acc { text, logprobs, offset, tokens: 0, finish: None }
            })
            .collect();
        while let Some((i, event)) = choices.next().await {
            match event {
                StreamEvent::Delta { text, tokens } => {
                    let a = &mut acc[i];
                    a.tokens += tokens.len();
                    a.text.push_str(&text);
                    if let Some(more) = self.logprobs(&tokens, &mut a.offset) {
                        a.logprobs.get_or_insert_with(Default::default).append(more);
                    }
                }
                StreamEvent::Finished { reason, usage } => acc[i].finish = Some((reason, usage)),
                StreamEvent::Error(e) => {
                    choices.cancel_all();
                    metrics::request_error(&self.lane, e.kind());
                    return Err(ApiError::engine(e, Some("prompt")));
                }
            }
        }
        let completion_tokens = acc.iter().map(|a| a.finish.map_or(a.tokens, |(_, u)| u.completion_tokens)).sum();
        let firsts: Vec<Option<Usage>> = acc.iter().step_by(self.n).map(|a| a.finish.map(|(_, u)| u)).collect();
        let usage = self.usage(completion_tokens, &firsts);
        let choices = acc
            .into_iter()
            .enumerate()
            .map(|(index, a)| CompletionChoice {
                index,
                text: a.text,
                logprobs: a.logprobs,
                finish_reason: a.finish.map(|(r, _)| r),
            })
            .collect();
        let body = Completion {
            id: &self.id,
            object: "text_completion",
            created: self.created,
            model: &self.model,
            choices,
            usage: Some(usage),
        };
        Ok(HttpResponse::Ok().json(body))
    }
}

/// An f32 as the JSON number with its shortest decimal form (`-0.1`, not the widened
/// `-0.10000000149011612` that `Value::from(f32)` gives), matching how struct fields serialize.
fn json_f32(x: f32) -> Value {
    x.to_string().parse::<f64>().ok().and_then(serde_json::Number::from_f64).map_or(Value::Null, Value::Number)
}

struct Acc {
    text: String,
    logprobs: Option<CompletionLogprobs>,
    /// Character offset of the next generated token (legacy `text_offset`).
    offset: usize,
    tokens: usize,
    finish: Option<(FinishReason, Usage)>,
}

/// SSE body: per choice an opening chunk when echoing, text chunks as generated, a
/// `finish_reason` chunk; then the optional usage chunk and `[DONE]`.
struct CompletionStream {
    choices: Choices,
    reply: Reply,
    include_usage: bool,
    offsets: Vec<usize>,
    completion_tokens: usize,
    firsts: Vec<Option<Usage>>,
    started: bool,
    done: bool,
}

impl CompletionStream {
    fn new(choices: Choices, reply: Reply, include_usage: bool) -> Self {
        let total = reply.prompts.len() * reply.n;
        let firsts = vec![None; reply.prompts.len()];
        Self {
            choices,
            reply,
            include_usage,
            offsets: vec![0; total],
            completion_tokens: 0,
            firsts,
            started: false,
            done: false,
        }
    }

    fn chunk(&self, choices: Vec<CompletionChoice>, usage: Option<UsageBody>) -> Bytes {
        sse::event(&Completion {
            id: &self.reply.id,
            object: "text_completion",
            created: self.reply.created,
            model: &self.reply.model,
            choices,
            usage,
        })
    }

    fn one(
        &self,
        index: usize,
        text: String,
        logprobs: Option<CompletionLogprobs>,
        finish: Option<FinishReason>,
    ) -> Bytes {
        self.chunk(vec![CompletionChoice { index, text, logprobs, finish_reason: finish }], None)
    }
}

impl SseSource for CompletionStream {
    async fn next_chunk(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        if !self.started {
            self.started = true;
            let mut out = BytesMut::new();
            for i in 0..self.offsets.len() {
                let (text, logprobs, start) = self.reply.opening(i);
                self.offsets[i] = start;
                if !text.is_empty() || logprobs.as_ref().is_some_and(|l| !l.tokens.is_empty()) {
                    out.extend_from_slice(&self.one(i, text, logprobs, None));
                }
            }
            if !out.is_empty() {
                return Some(out.freeze());
            }
        }
        loop {
            match self.choices.next().await {
                Some((i, StreamEvent::Delta { text, tokens })) => {
                    let mut offset = self.offsets[i];
                    let logprobs = if tokens.is_empty() { None } else { self.reply.logprobs(&tokens, &mut offset) };
                    self.offsets[i] = offset;
                    if text.is_empty() && logprobs.is_none() {
                        continue;
                    }
                    return Some(self.one(i, text, logprobs, None));
                }
                Some((i, StreamEvent::Finished { reason, usage })) => {
                    self.completion_tokens += usage.completion_tokens;
                    if i % self.reply.n == 0 {
                        self.firsts[i / self.reply.n] = Some(usage);
                    }
                    return Some(self.one(i, String::new(), None, Some(reason)));
                }
                Some((_, StreamEvent::Error(e))) => {
                    self.choices.cancel_all();
                    self.done = true;
                    metrics::request_error(&self.reply.lane, e.kind());
                    let mut out = BytesMut::from(&sse::error_event(&ApiError::engine(e, Some("prompt")))[..]);
                    out.extend_from_slice(&sse::done_event());
                    return Some(out.freeze());
                }
                None => {
                    self.done = true;
                    let mut out = BytesMut::new();
                    if self.include_usage {
                        let usage = self.reply.usage(self.completion_tokens, &self.firsts);
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

    fn model() -> ModelInfo {
        ModelInfo {
            id: "m".into(),
            max_context: 64,
            vocab_size: 100,
            tokenizer: None,
            eos_token_ids: vec![],
            vision: None,
        }
    }

    fn shapes(v: Value) -> Result<Vec<String>, String> {
        parse_prompt(Some(&v), &model())
            .map(|ps| {
                ps.into_iter()
                    .map(|p| match p {
                        PromptInput::Text(t) => format!("text:{t}"),
                        PromptInput::Tokens(ids) => format!("ids:{ids:?}"),
                    })
                    .collect()
            })
            .map_err(|e| e.body().param.unwrap_or("").to_owned())
    }

    #[test]
    fn logprob_numbers_keep_their_short_form() {
        assert_eq!(json_f32(-0.1).to_string(), "-0.1");
        assert_eq!(json_f32(-9999.0).to_string(), "-9999.0");
    }

    #[test]
    fn prompt_forms() {
        assert_eq!(shapes(json!("hi")).unwrap(), ["text:hi"]);
        assert_eq!(shapes(json!(["a", "b"])).unwrap(), ["text:a", "text:b"]);
        assert_eq!(shapes(json!([1, 2])).unwrap(), ["ids:[1, 2]"]);
        assert_eq!(shapes(json!([[1], [2, 3]])).unwrap(), ["ids:[1]", "ids:[2, 3]"]);
    }

    #[test]
    fn bad_prompts_name_the_element() {
        assert_eq!(shapes(json!(null)).unwrap_err(), "prompt");
        assert_eq!(shapes(json!([])).unwrap_err(), "prompt");
        assert_eq!(shapes(json!(5)).unwrap_err(), "prompt");
        assert_eq!(shapes(json!([1, "a"])).unwrap_err(), "prompt[1]");
        assert_eq!(shapes(json!(["a", 1])).unwrap_err(), "prompt[1]");
        assert_eq!(shapes(json!([1, 100])).unwrap_err(), "prompt[1]");
        assert_eq!(shapes(json!([1, -1])).unwrap_err(), "prompt[1]");
        assert_eq!(shapes(json!([1.5])).unwrap_err(), "prompt[0]");
        assert_eq!(shapes(json!([[1], []])).unwrap_err(), "prompt[1]");
        assert_eq!(shapes(json!([[1], [2, 100]])).unwrap_err(), "prompt[1][1]");
        assert_eq!(shapes(json!([{}])).unwrap_err(), "prompt[0]");
    }
}
