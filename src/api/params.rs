//! Request validation shared by both generation endpoints: parsing the body with field paths
//! for error messages, the model name check, sampling fields → [`SamplingParams`], stop rules,
//! `n`, and `max_tokens` against the lane limit and the model's context. Pure functions: no I/O,
//! no engine calls, so each rule has a unit test.

use serde::de::DeserializeOwned;

use super::errors::{context_message, ApiError};
use super::types::CommonParams;
use crate::actors::handle::{GenerationRequest, ModelInfo};
use crate::config::engine::LaneConfig;
use crate::sampling::{SamplingParams, MAX_ABS_LOGIT_BIAS, MAX_LOGPROBS};

/// OpenAI documents 4 stop sequences; vLLM takes any number. Matching cost grows with the count,
/// so this server takes up to 16.
pub const MAX_STOP_STRINGS: usize = 16;
/// OpenAI's upper bound for `n`.
pub const MAX_N: usize = 128;
/// Upper bound on choices one request may create (prompts × n): each is a queued sequence.
pub const MAX_CHOICES: usize = 256;

/// Parse a request body as a JSON object.
pub fn parse_body(body: &[u8]) -> Result<serde_json::Value, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::MalformedBody("the request body is empty; expected a JSON object".into()));
    }
    let v: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::MalformedBody(format!("the request body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::MalformedBody(format!("the request body must be a JSON object, not {}", json_kind(&v))));
    }
    Ok(v)
}

/// Deserialize `T` from the parsed body; a type error names the field path (`param`).
pub fn fields<T: DeserializeOwned>(body: &serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            ApiError::MalformedBody(inner.to_string())
        } else {
            ApiError::invalid(path.clone(), format!("invalid `{path}`: {inner}"))
        }
    })
}

pub fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// `model` may be absent, empty, `default`, the served name or the engine's own id.
pub fn check_model(requested: Option<&str>, served_name: &str, model: &ModelInfo) -> Result<(), ApiError> {
    match requested {
        None | Some("") | Some("default") => Ok(()),
        Some(m) if m == served_name || m == model.id => Ok(()),
        Some(m) => Err(ApiError::ModelNotFound(m.to_owned())),
    }
}

/// Everything about a request except its prompt, validated.
#[derive(Clone, Debug)]
pub struct Plan {
    /// `seed` is the base seed; choice `i` uses `seed + i`.
    pub sampling: SamplingParams,
    pub n: usize,
    pub stop_strings: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub skip_special_tokens: bool,
    /// The client's `max_tokens` and the field it came in (None: lane default).
    pub explicit_max_tokens: Option<(usize, &'static str)>,
    pub stream: bool,
    pub include_usage: bool,
}

/// Validate the common fields. `max_tokens` is `(value, field name)` as the endpoint read it;
/// `logprobs` is the number of top alternatives requested (None: no logprobs).
pub fn plan(
    c: &CommonParams,
    max_tokens: Option<(u64, &'static str)>,
    logprobs: Option<usize>,
    lane: &LaneConfig,
    model: &ModelInfo,
) -> Result<Plan, ApiError> {
    let n = match c.n {
        None => 1,
        Some(n) if n >= 1 && n <= MAX_N as u64 => n as usize,
        Some(n) => return Err(ApiError::invalid("n", format!("`n` = {n} must be between 1 and {MAX_N}"))),
    };
    let explicit_max_tokens = match max_tokens {
        None => None,
        Some((0, field)) => return Err(ApiError::invalid(field, format!("`{field}` must be at least 1"))),
        Some((m, field)) if m > lane.max_tokens_limit as u64 => {
            return Err(ApiError::invalid(
                field,
                format!(
                    "`{field}` = {m} exceeds the maximum of {} allowed on the `{}` lane",
                    lane.max_tokens_limit, lane.name
                ),
            ))
        }
        Some((m, field)) => Some((m as usize, field)),
    };
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => return Err(ApiError::invalid("top_k", format!("`top_k` = {k} must be -1 (off) or positive"))),
    };
    let mut logit_bias = Vec::new();
    for (key, &bias) in c.logit_bias.iter().flatten() {
        let id: u32 = key
            .trim()
            .parse()
            .map_err(|_| ApiError::invalid("logit_bias", format!("`logit_bias` key `{key}` is not a token id")))?;
        if id as usize >= model.vocab_size {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("`logit_bias` token id {id} is outside the vocabulary (size {})", model.vocab_size),
            ));
        }
        if bias.is_nan() || bias.abs() > MAX_ABS_LOGIT_BIAS {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("`logit_bias` for token {id} is {bias}; it must be in [-100, 100]"),
            ));
        }
        logit_bias.push((id, bias));
    }
    if let Some(k) = logprobs {
        if k > MAX_LOGPROBS {
            // Callers name their own field before this; this is the backstop.
            return Err(ApiError::invalid("logprobs", format!("at most {MAX_LOGPROBS} logprobs per token")));
        }
    }
    let sampling = SamplingParams {
        // OpenAI's default temperature is 1 (sampling); clients ask for 0 to get greedy.
        temperature: c.temperature.unwrap_or(1.0),
        top_k,
        top_p: c.top_p.unwrap_or(1.0),
        min_p: c.min_p.unwrap_or(0.0),
        repetition_penalty: c.repetition_penalty.unwrap_or(1.0),
        presence_penalty: c.presence_penalty.unwrap_or(0.0),
        frequency_penalty: c.frequency_penalty.unwrap_or(0.0),
        logit_bias,
        // Reinterpreting a negative seed's bits keeps every i64 a distinct, reproducible seed.
        seed: c.seed.map(|s| s as u64).unwrap_or_else(rand::random),
        logprobs,
    };
    sampling.validate().map_err(|e| ApiError::invalid(e.field, e.to_string()))?;
    let stop_strings = stop_strings(c.stop.as_ref())?;
    let stop_token_ids = c.stop_token_ids.clone().unwrap_or_default();
    if let Some(&bad) = stop_token_ids.iter().find(|&&id| id as usize >= model.vocab_size) {
        return Err(ApiError::invalid(
            "stop_token_ids",
            format!("`stop_token_ids` contains {bad}, outside the vocabulary (size {})", model.vocab_size),
        ));
    }
    Ok(Plan {
        sampling,
        n,
        stop_strings,
        stop_token_ids,
        ignore_eos: c.ignore_eos.unwrap_or(false),
        skip_special_tokens: c.skip_special_tokens.unwrap_or(true),
        explicit_max_tokens,
        stream: c.stream.unwrap_or(false),
        include_usage: c.stream_options.and_then(|o| o.include_usage).unwrap_or(false),
    })
}

fn stop_strings(v: Option<&serde_json::Value>) -> Result<Vec<String>, ApiError> {
    let list = match v {
        None | Some(serde_json::Value::Null) => return Ok(Vec::new()),
        Some(serde_json::Value::String(s)) => vec![s.clone()],
        Some(serde_json::Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, s)| {
                s.as_str().map(str::to_owned).ok_or_else(|| {
                    ApiError::invalid(
                        format!("stop[{i}]"),
                        format!("`stop[{i}]` must be a string, not {}", json_kind(s)),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(other) => {
            return Err(ApiError::invalid(
                "stop",
                format!("`stop` must be a string or a list of strings, not {}", json_kind(other)),
            ))
        }
    };
    if list.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            "stop",
            format!("`stop` has {} strings; at most {MAX_STOP_STRINGS} are allowed", list.len()),
        ));
    }
    if list.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop", "`stop` strings must not be empty"));
    }
    Ok(list)
}

/// The `max_tokens` a prompt of `prompt_len` tokens gets: the client's value (which must fit the
/// context with the prompt) or the lane default (capped to what the context leaves).
pub fn resolve_max_tokens(
    plan: &Plan,
    prompt_len: usize,
    lane: &LaneConfig,
    model: &ModelInfo,
    prompt_param: &'static str,
) -> Result<usize, ApiError> {
    let limit = model.max_context;
    if prompt_len >= limit {
        return Err(ApiError::ContextLength {
            param: prompt_param,
            message: context_message(limit, prompt_len, None, prompt_len),
        });
    }
    match plan.explicit_max_tokens {
        Some((m, _)) if prompt_len + m > limit => Err(ApiError::ContextLength {
            param: prompt_param,
            message: context_message(limit, prompt_len, Some(m), prompt_len + m),
        }),
        Some((m, _)) => Ok(m),
        None => Ok(lane.default_max_tokens.min(limit - prompt_len)),
    }
}

/// One engine request per choice; choice `i` samples with `seed + i` so `n` samples differ but
/// each is reproducible.
pub fn requests(plan: &Plan, prompt: Vec<u32>, max_tokens: usize, lane: &LaneConfig) -> Vec<GenerationRequest> {
    (0..plan.n)
        .map(|i| {
            let mut sampling = plan.sampling.clone();
            sampling.seed = plan.sampling.seed.wrapping_add(i as u64);
            GenerationRequest {
                lane: lane.name.clone(),
                prompt: prompt.clone(),
                sampling,
                max_tokens,
                stop_strings: plan.stop_strings.clone(),
                stop_token_ids: plan.stop_token_ids.clone(),
                ignore_eos: plan.ignore_eos,
                skip_special_tokens: plan.skip_special_tokens,
                loop_guard: lane.loop_guard,
                grammar: None,
                images: Vec::new(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn lane() -> LaneConfig {
        LaneConfig {
            name: "voice".into(),
            port: 0,
            priority: 10,
            reasoning_effort: Some("low".into()),
            thinking: Some(false),
            default_max_tokens: 64,
            max_tokens_limit: 100,
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

    fn model() -> ModelInfo {
        ModelInfo {
            id: "m".into(),
            max_context: 128,
            vocab_size: 1000,
            tokenizer: None,
            eos_token_ids: vec![2],
            vision: None,
        }
    }

    fn plan_of(body: serde_json::Value) -> Result<Plan, ApiError> {
        let c: CommonParams = fields(&body)?;
        let mt = c.max_tokens.map(|m| (m, "max_tokens"));
        plan(&c, mt, None, &lane(), &model())
    }

    fn param(e: ApiError) -> String {
        e.body().param.unwrap_or("<none>").to_owned()
    }

    #[test]
    fn type_errors_name_the_field_path() {
        let e = fields::<CommonParams>(&json!({"temperature": "hot"})).unwrap_err();
        assert_eq!(param(e), "temperature");
        let e = fields::<CommonParams>(&json!({"logit_bias": {"5": "x"}})).unwrap_err();
        assert_eq!(param(e), "logit_bias.5");
        let e = fields::<CommonParams>(&json!({"stream_options": {"include_usage": 1}})).unwrap_err();
        assert_eq!(param(e), "stream_options.include_usage");
    }

    #[test]
    fn malformed_bodies_are_reported_with_position() {
        let e = parse_body(b"{\"a\": ").unwrap_err();
        assert!(matches!(e, ApiError::MalformedBody(ref m) if m.contains("line 1")), "{e:?}");
        assert!(matches!(parse_body(b"  "), Err(ApiError::MalformedBody(_))));
        assert!(matches!(parse_body(b"[1]"), Err(ApiError::MalformedBody(ref m)) if m.contains("an array")));
    }

    #[test]
    fn ranges_and_limits() {
        assert_eq!(param(plan_of(json!({"n": 0})).unwrap_err()), "n");
        assert_eq!(param(plan_of(json!({"n": 129})).unwrap_err()), "n");
        assert_eq!(param(plan_of(json!({"top_k": -2})).unwrap_err()), "top_k");
        assert_eq!(plan_of(json!({"top_k": -1})).unwrap().sampling.top_k, 0);
        assert_eq!(param(plan_of(json!({"top_p": 0})).unwrap_err()), "top_p");
        assert_eq!(param(plan_of(json!({"max_tokens": 0})).unwrap_err()), "max_tokens");
        let e = plan_of(json!({"max_tokens": 101})).unwrap_err();
        assert!(e.to_string().contains("101") && e.to_string().contains("100"), "{e}");
        assert_eq!(param(plan_of(json!({"logit_bias": {"1000": 1}})).unwrap_err()), "logit_bias");
        assert_eq!(param(plan_of(json!({"logit_bias": {"x": 1}})).unwrap_err()), "logit_bias");
        assert_eq!(param(plan_of(json!({"logit_bias": {"7": 100.5}})).unwrap_err()), "logit_bias");
        assert_eq!(plan_of(json!({"logit_bias": {"7": -100}})).unwrap().sampling.logit_bias, vec![(7, -100.0)]);
        assert_eq!(param(plan_of(json!({"stop_token_ids": [1000]})).unwrap_err()), "stop_token_ids");
    }

    #[test]
    fn stop_field_forms() {
        assert_eq!(plan_of(json!({"stop": "x"})).unwrap().stop_strings, ["x"]);
        assert_eq!(plan_of(json!({"stop": ["a", "b"]})).unwrap().stop_strings, ["a", "b"]);
        assert!(plan_of(json!({"stop": null})).unwrap().stop_strings.is_empty());
        assert_eq!(param(plan_of(json!({"stop": 3})).unwrap_err()), "stop");
        assert_eq!(param(plan_of(json!({"stop": ["a", 3]})).unwrap_err()), "stop[1]");
        assert_eq!(param(plan_of(json!({"stop": [""]})).unwrap_err()), "stop");
        let many: Vec<String> = (0..17).map(|i| i.to_string()).collect();
        assert_eq!(param(plan_of(json!({ "stop": many })).unwrap_err()), "stop");
        let ok: Vec<String> = (0..16).map(|i| i.to_string()).collect();
        assert_eq!(plan_of(json!({ "stop": ok })).unwrap().stop_strings.len(), 16);
    }

    #[test]
    fn max_tokens_against_context() {
        let (l, m) = (lane(), model());
        let p = plan_of(json!({})).unwrap();
        assert_eq!(resolve_max_tokens(&p, 10, &l, &m, "prompt").unwrap(), 64);
        // The default shrinks to what the context leaves; an explicit value never does.
        assert_eq!(resolve_max_tokens(&p, 100, &l, &m, "prompt").unwrap(), 28);
        let e = resolve_max_tokens(&p, 128, &l, &m, "prompt").unwrap_err();
        assert!(e.to_string().contains("128"), "{e}");
        let p = plan_of(json!({"max_tokens": 50})).unwrap();
        let e = resolve_max_tokens(&p, 100, &l, &m, "messages").unwrap_err();
        let msg = e.to_string();
        for n in ["128", "150", "100", "50"] {
            assert!(msg.contains(n), "{msg}");
        }
        assert_eq!(e.body().param, Some("messages"));
        assert_eq!(e.body().code, Some("context_length_exceeded"));
    }

    #[test]
    fn n_requests_get_consecutive_seeds() {
        let p = plan_of(json!({"n": 3, "seed": -1})).unwrap();
        let reqs = requests(&p, vec![1, 2], 5, &lane());
        let seeds: Vec<u64> = reqs.iter().map(|r| r.sampling.seed).collect();
        assert_eq!(seeds, [u64::MAX, 0, 1]);
        assert!(reqs.iter().all(|r| r.lane == "voice" && r.max_tokens == 5 && r.prompt == [1, 2]));
    }

    #[test]
    fn model_names() {
        let m = model();
        assert!(check_model(None, "served", &m).is_ok());
        assert!(check_model(Some("default"), "served", &m).is_ok());
        assert!(check_model(Some("served"), "served", &m).is_ok());
        assert!(check_model(Some("m"), "served", &m).is_ok());
        assert_eq!(check_model(Some("gpt-4"), "served", &m).unwrap_err().status().as_u16(), 404);
    }
}
