//! The one place that turns failures into HTTP: every error the API layer can produce
//! (malformed bodies, invalid fields, auth, routing, size limits, and [`EngineError`]s from the
//! engine boundary) becomes an [`ApiError`], whose status code and OpenAI-shaped body
//! (`{"error":{"message","type","param","code"}}`) are decided here and nowhere else. The same body
//! is what a stream carries as `data: {"error":…}` when the engine fails mid-generation.

use actix_web::http::{Method, StatusCode};
use actix_web::{HttpResponse, ResponseError};
use serde::Serialize;

use crate::actors::handle::EngineError;

/// An API failure. `param` names the request field at fault (OpenAI's `error.param`), as a JSON
/// path such as `messages[0].content` when the fault is nested.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// The body is not JSON, or not the JSON object the endpoint expects.
    #[error("{0}")]
    MalformedBody(String),
    /// A field has the wrong type or an invalid value.
    #[error("{message}")]
    InvalidField { param: String, message: String },
    /// A feature the request asks for that this server does not implement.
    #[error("{message}")]
    Unsupported { param: String, message: String },
    /// The prompt (plus the requested completion) does not fit the model's context.
    #[error("{message}")]
    ContextLength { param: &'static str, message: String },
    #[error("missing or invalid API key: send `Authorization: Bearer <key>`")]
    Unauthorized,
    #[error("the model `{0}` does not exist; see GET /v1/models")]
    ModelNotFound(String),
    #[error("no route for {method} {path}")]
    RouteNotFound { method: String, path: String },
    /// `allow` goes out as the `Allow` header.
    #[error("method {method} is not allowed on {path}")]
    MethodNotAllowed { method: String, path: String, allow: &'static [Method] },
    #[error("{}", media_type_message(.sent.as_deref()))]
    UnsupportedMediaType { sent: Option<String> },
    #[error("the request body did not arrive within {secs} s")]
    BodyTimeout { secs: f64 },
    #[error("the request body exceeds the {limit}-byte limit")]
    PayloadTooLarge { limit: usize },
    /// The server cannot serve this request for a reason that is not the client's fault and is
    /// not an engine failure (e.g. the model's chat template does not compile).
    #[error("{0}")]
    Internal(String),
    /// An engine error; `param` is the request field to blame for `TooLong` / `Invalid`.
    #[error("{err}")]
    Engine { err: EngineError, param: Option<&'static str> },
}

#[derive(Serialize, Debug)]
struct ErrorEnvelope<'a> {
    error: ErrorBody<'a>,
}

/// OpenAI's error object.
#[derive(Serialize, Debug)]
pub struct ErrorBody<'a> {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<&'a str>,
    pub code: Option<&'static str>,
}

const INVALID_REQUEST: &str = "invalid_request_error";
const SERVER_ERROR: &str = "server_error";

impl ApiError {
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::InvalidField { param: param.into(), message: message.into() }
    }

    pub fn unsupported(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::Unsupported { param: param.into(), message: message.into() }
    }

    /// A prompt proven to hold at least `at_least >= limit` tokens before it was fully tokenized.
    pub fn prompt_over_context(limit: usize, at_least: usize, param: &'static str) -> Self {
        ApiError::ContextLength {
            param,
            message: format!(
                "This model's maximum context length is {limit} tokens. However, the prompt has at least \
                 {at_least} tokens, which leaves no room for a completion. Please reduce the prompt."
            ),
        }
    }

    pub fn engine(err: EngineError, param: Option<&'static str>) -> Self {
        ApiError::Engine { err, param }
    }

    /// A stable label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::MalformedBody(_) => "malformed_body",
            ApiError::InvalidField { .. } => "invalid_field",
            ApiError::Unsupported { .. } => "unsupported",
            ApiError::ContextLength { .. } => "context_length_exceeded",
            ApiError::Unauthorized => "unauthorized",
            ApiError::ModelNotFound(_) => "model_not_found",
            ApiError::RouteNotFound { .. } => "route_not_found",
            ApiError::MethodNotAllowed { .. } => "method_not_allowed",
            ApiError::UnsupportedMediaType { .. } => "unsupported_media_type",
            ApiError::BodyTimeout { .. } => "request_timeout",
            ApiError::PayloadTooLarge { .. } => "payload_too_large",
            ApiError::Internal(_) => "internal",
            ApiError::Engine { err, .. } => err.kind(),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::MalformedBody(_)
            | ApiError::InvalidField { .. }
            | ApiError::Unsupported { .. }
            | ApiError::ContextLength { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::ModelNotFound(_) | ApiError::RouteNotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::UnsupportedMediaType { .. } => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Engine { err, .. } => match err {
                EngineError::QueueFull { .. } => StatusCode::TOO_MANY_REQUESTS,
                EngineError::NotReady(_) | EngineError::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
                EngineError::TooLong { .. } | EngineError::Invalid(_) => StatusCode::BAD_REQUEST,
                // An unknown lane is a wiring bug between the server and the engine, not the
                // client's fault.
                EngineError::UnknownLane(_) | EngineError::Executor(_) => StatusCode::INTERNAL_SERVER_ERROR,
            },
        }
    }

    /// The OpenAI error object for this error.
    pub fn body(&self) -> ErrorBody<'_> {
        let (kind, code, param): (&'static str, Option<&'static str>, Option<&str>) = match self {
            ApiError::MalformedBody(_) => (INVALID_REQUEST, Some("invalid_json"), None),
            ApiError::InvalidField { param, .. } => (INVALID_REQUEST, Some("invalid_value"), Some(param)),
            ApiError::Unsupported { param, .. } => (INVALID_REQUEST, Some("unsupported_parameter"), Some(param)),
            ApiError::ContextLength { param, .. } => (INVALID_REQUEST, Some("context_length_exceeded"), Some(*param)),
            ApiError::Unauthorized => (INVALID_REQUEST, Some("invalid_api_key"), None),
            ApiError::ModelNotFound(_) => (INVALID_REQUEST, Some("model_not_found"), Some("model")),
            ApiError::RouteNotFound { .. } => (INVALID_REQUEST, Some("not_found"), None),
            ApiError::MethodNotAllowed { .. } => (INVALID_REQUEST, Some("method_not_allowed"), None),
            ApiError::UnsupportedMediaType { .. } => (INVALID_REQUEST, Some("unsupported_media_type"), None),
            ApiError::BodyTimeout { .. } => (INVALID_REQUEST, Some("request_timeout"), None),
            ApiError::PayloadTooLarge { .. } => (INVALID_REQUEST, Some("request_too_large"), None),
            ApiError::Internal(_) => (SERVER_ERROR, Some("internal_error"), None),
            ApiError::Engine { err, param } => match err {
                EngineError::QueueFull { .. } => ("rate_limit_error", Some(err.kind()), None),
                EngineError::NotReady(_) | EngineError::ShuttingDown => ("service_unavailable", Some(err.kind()), None),
                EngineError::TooLong { .. } | EngineError::Invalid(_) => (INVALID_REQUEST, Some(err.kind()), *param),
                EngineError::UnknownLane(_) | EngineError::Executor(_) => (SERVER_ERROR, Some(err.kind()), None),
            },
        };
        let message = match self {
            ApiError::Engine { err: EngineError::TooLong { needed, prompt, max_tokens, limit }, .. } => {
                context_message(*limit, *prompt, Some(*max_tokens), *needed)
            }
            other => other.to_string(),
        };
        ErrorBody { message, kind, param, code }
    }

    /// `{"error":{…}}` as JSON text (for SSE error events and responses).
    pub fn to_json(&self) -> String {
        // Serializing plain strings and options cannot fail; the fallback keeps the shape anyway.
        serde_json::to_string(&ErrorEnvelope { error: self.body() }).unwrap_or_else(|_| {
            r#"{"error":{"message":"internal error","type":"server_error","param":null,"code":null}}"#.into()
        })
    }
}

fn media_type_message(sent: Option<&str>) -> String {
    match sent {
        Some(ct) => format!("unsupported Content-Type `{ct}`: send the body as `Content-Type: application/json`"),
        None => "missing Content-Type: send the body as `Content-Type: application/json`".into(),
    }
}

/// OpenAI's wording for a context overflow, with every number the client needs.
pub fn context_message(limit: usize, prompt: usize, max_tokens: Option<usize>, needed: usize) -> String {
    match max_tokens {
        Some(m) => format!(
            "This model's maximum context length is {limit} tokens. However, you requested {needed} tokens \
             ({prompt} in the prompt, {m} for the completion). Please reduce the prompt or max_tokens."
        ),
        None => format!(
            "This model's maximum context length is {limit} tokens. However, the prompt has {prompt} tokens, \
             which leaves no room for a completion. Please reduce the prompt."
        ),
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status()
    }

    fn error_response(&self) -> HttpResponse {
        let status = self.status();
        // A 503 while the model loads or the engine drains is the expected answer (health
        // probes poll for it), not a failure worth a warning.
        let expected = matches!(self.kind(), "not_ready" | "shutting_down");
        if status.is_server_error() && !expected {
            tracing::warn!(kind = self.kind(), status = status.as_u16(), "request failed: {self}");
        } else {
            tracing::debug!(kind = self.kind(), status = status.as_u16(), "request rejected: {self}");
        }
        let mut resp = HttpResponse::build(status);
        match self {
            ApiError::Unauthorized => {
                resp.insert_header(("WWW-Authenticate", "Bearer"));
            }
            ApiError::MethodNotAllowed { allow, .. } => {
                let methods: Vec<&str> = allow.iter().map(Method::as_str).collect();
                resp.insert_header((actix_web::http::header::ALLOW, methods.join(", ")));
            }
            _ => {}
        }
        if matches!(self, ApiError::Engine { err: EngineError::QueueFull { .. }, .. }) {
            // Every slot and the lane's queue are taken: a running request ends within seconds.
            resp.insert_header(("Retry-After", "1"));
        }
        resp.content_type("application/json").body(self.to_json())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(e: &ApiError) -> serde_json::Value {
        serde_json::from_str(&e.to_json()).unwrap()
    }

    #[test]
    fn engine_errors_map_to_their_statuses() {
        let cases = [
            (EngineError::QueueFull { lane: "voice".into(), capacity: 4 }, 429),
            (EngineError::NotReady("loading".into()), 503),
            (EngineError::ShuttingDown, 503),
            (EngineError::TooLong { needed: 10, prompt: 6, max_tokens: 4, limit: 8 }, 400),
            (EngineError::Invalid("x".into()), 400),
            (EngineError::Executor("boom".into()), 500),
            (EngineError::UnknownLane("x".into()), 500),
        ];
        for (err, status) in cases {
            let e = ApiError::engine(err.clone(), Some("prompt"));
            assert_eq!(e.status().as_u16(), status, "{err:?}");
            let v = json(&e);
            assert_eq!(v["error"]["code"], err.kind(), "{v}");
        }
    }

    #[test]
    fn a_full_queue_tells_the_client_when_to_retry() {
        let full = ApiError::engine(EngineError::QueueFull { lane: "voice".into(), capacity: 4 }, None);
        assert_eq!(full.error_response().headers().get("Retry-After").map(|v| v.to_str().unwrap()), Some("1"));
        let other = ApiError::engine(EngineError::ShuttingDown, None);
        assert!(other.error_response().headers().get("Retry-After").is_none());
    }

    #[test]
    fn too_long_names_every_number_and_the_field() {
        let e = ApiError::engine(
            EngineError::TooLong { needed: 130, prompt: 100, max_tokens: 30, limit: 128 },
            Some("messages"),
        );
        let v = json(&e);
        let msg = v["error"]["message"].as_str().unwrap();
        for n in ["128", "130", "100", "30"] {
            assert!(msg.contains(n), "{msg}");
        }
        assert_eq!(v["error"]["param"], "messages");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }

    #[test]
    fn strict_http_errors() {
        let e = ApiError::MethodNotAllowed { method: "PUT".into(), path: "/v1/models".into(), allow: &[Method::GET] };
        let resp = e.error_response();
        assert_eq!(resp.status().as_u16(), 405);
        assert_eq!(resp.headers().get("allow").unwrap(), "GET");
        let e = ApiError::UnsupportedMediaType { sent: Some("text/plain".into()) };
        assert_eq!(e.status().as_u16(), 415);
        assert!(json(&e)["error"]["message"].as_str().unwrap().contains("text/plain"));
        assert_eq!(ApiError::BodyTimeout { secs: 2.0 }.status().as_u16(), 408);
    }

    #[test]
    fn body_has_all_four_keys_even_when_null() {
        let v = json(&ApiError::Unauthorized);
        let obj = v["error"].as_object().unwrap();
        let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        assert_eq!(keys, ["message", "type", "param", "code"]);
        assert!(obj["param"].is_null());
    }
}
