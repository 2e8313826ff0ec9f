//! The one mapping from failures to HTTP status and OpenAI-shaped error
//! bodies: `{"error": {"message", "type", "param", "code"}}`. Each variant
//! has a reason label ([`ApiError::reason`]), the label of
//! `envelope:request_error_total{reason}` and of the log line.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use envelope_engine::EngineError;
use serde_json::json;

#[derive(Debug, Clone, PartialEq)]
pub enum ApiError {
    /// Malformed JSON, non-UTF-8, a wrong type or value (400); `param`
    /// names the field where there is one.
    Invalid {
        param: Option<String>,
        message: String,
    },
    /// Prompt + `max_tokens` over the context or the whole KV pool (400).
    ContextLength { param: String, message: String },
    /// Another model name than the one served (404).
    ModelNotFound { model: String },
    /// An unknown path (404).
    NoRoute { path: String },
    /// A known path with the wrong method (405).
    WrongMethod { method: String, path: String },
    /// A body over the server's limit (413).
    BodyTooLarge { limit_bytes: usize },
    /// The engine stopped (503).
    ShutDown,
    /// The engine failed the request: a step that failed or panicked (500).
    Engine { message: String },
}

impl ApiError {
    pub fn invalid(param: impl Into<Option<String>>, message: impl Into<String>) -> ApiError {
        ApiError::Invalid {
            param: param.into(),
            message: message.into(),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Invalid { .. } | ApiError::ContextLength { .. } => StatusCode::BAD_REQUEST,
            ApiError::ModelNotFound { .. } | ApiError::NoRoute { .. } => StatusCode::NOT_FOUND,
            ApiError::WrongMethod { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::ShutDown => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Engine { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The reason label: the body's `code` where OpenAI defines one.
    pub fn reason(&self) -> &'static str {
        match self {
            ApiError::Invalid { .. } => "invalid_request",
            ApiError::ContextLength { .. } => "context_length_exceeded",
            ApiError::ModelNotFound { .. } => "model_not_found",
            ApiError::NoRoute { .. } => "not_found",
            ApiError::WrongMethod { .. } => "method_not_allowed",
            ApiError::BodyTooLarge { .. } => "request_too_large",
            ApiError::ShutDown => "shut_down",
            ApiError::Engine { .. } => "engine_error",
        }
    }

    /// OpenAI's error `type`.
    fn kind(&self) -> &'static str {
        match self {
            ApiError::ShutDown => "service_unavailable",
            ApiError::Engine { .. } => "internal_error",
            _ => "invalid_request_error",
        }
    }

    /// OpenAI's error `code` (null for a plain invalid request).
    fn code(&self) -> Option<&'static str> {
        match self {
            ApiError::Invalid { .. } | ApiError::ShutDown | ApiError::Engine { .. } => None,
            _ => Some(self.reason()),
        }
    }

    fn param(&self) -> Option<&str> {
        match self {
            ApiError::Invalid { param, .. } => param.as_deref(),
            ApiError::ContextLength { param, .. } => Some(param),
            ApiError::ModelNotFound { .. } => Some("model"),
            _ => None,
        }
    }

    pub fn message(&self) -> String {
        match self {
            ApiError::Invalid { message, .. }
            | ApiError::ContextLength { message, .. }
            | ApiError::Engine { message } => message.clone(),
            ApiError::ModelNotFound { model } => format!("The model `{model}` does not exist."),
            ApiError::NoRoute { path } => format!("no such endpoint: {path}"),
            ApiError::WrongMethod { method, path } => format!("{path} does not take {method}"),
            ApiError::BodyTooLarge { limit_bytes } => {
                format!("the request body is over this server's limit of {limit_bytes} bytes")
            }
            ApiError::ShutDown => EngineError::ShutDown.to_string(),
        }
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message(),
            "type": self.kind(),
            "param": self.param(),
            "code": self.code(),
        }})
    }

    /// Maps an engine error; `prompt_param` names the request field holding
    /// the prompt (`prompt` or `messages`).
    pub fn from_engine(e: EngineError, prompt_param: &str) -> ApiError {
        let message = e.to_string();
        match e {
            EngineError::ContextLengthExceeded { .. } => ApiError::ContextLength {
                param: prompt_param.into(),
                message,
            },
            EngineError::KvPoolTooSmall { .. } => ApiError::ContextLength {
                param: "max_tokens".into(),
                message,
            },
            EngineError::InvalidRequest { param, .. } => {
                let param = if param == "prompt" {
                    prompt_param
                } else {
                    param
                };
                ApiError::invalid(Some(param.to_string()), message)
            }
            EngineError::Tokenizer(_) => ApiError::invalid(Some(prompt_param.to_string()), message),
            EngineError::ChatTemplate(_) => {
                ApiError::invalid(Some("messages".to_string()), message)
            }
            EngineError::ShutDown => ApiError::ShutDown,
            _ => ApiError::Engine { message },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status(), axum::Json(self.body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_has_the_openai_shape_and_its_reason() {
        let all = [
            ApiError::invalid(Some("temperature".into()), "must be >= 0"),
            ApiError::from_engine(
                EngineError::ContextLengthExceeded {
                    prompt_tokens: 10,
                    max_tokens: 10,
                    max_model_len: 8,
                },
                "messages",
            ),
            ApiError::ModelNotFound { model: "x".into() },
            ApiError::NoRoute { path: "/v2".into() },
            ApiError::WrongMethod {
                method: "GET".into(),
                path: "/v1/completions".into(),
            },
            ApiError::ShutDown,
            ApiError::Engine {
                message: "step panicked".into(),
            },
            ApiError::BodyTooLarge { limit_bytes: 8 },
        ];
        let statuses: Vec<u16> = all.iter().map(|e| e.status().as_u16()).collect();
        assert_eq!(statuses, [400, 400, 404, 404, 405, 503, 500, 413]);
        for e in &all {
            let b = e.body();
            let b = &b["error"];
            assert!(b["message"].as_str().is_some_and(|m| !m.is_empty()), "{b}");
            assert!(b["type"].is_string(), "{b}");
            assert!(b.get("param").is_some() && b.get("code").is_some(), "{b}");
            if let Some(code) = b["code"].as_str() {
                assert_eq!(code, e.reason());
            }
        }
        assert_eq!(all[1].body()["error"]["param"], "messages");
        assert_eq!(all[1].reason(), "context_length_exceeded");
        assert_eq!(all[6].body()["error"]["type"], "internal_error");
    }
}
