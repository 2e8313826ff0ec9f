//! The one mapping from failures to HTTP status and OpenAI-shaped error
//! bodies: `{"error": {"message", "type", "param", "code"}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use envelope_engine::EngineError;
use serde_json::json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(param: impl Into<Option<String>>, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.into(),
            code: None,
        }
    }

    pub fn not_found(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: Some("model_not_found"),
        }
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }

    /// Maps an engine error; `prompt_param` names the request field holding
    /// the prompt (`prompt` or `messages`).
    pub fn from_engine(e: EngineError, prompt_param: &str) -> ApiError {
        match e {
            EngineError::ContextLengthExceeded { .. } => ApiError {
                code: Some("context_length_exceeded"),
                ..ApiError::invalid(Some(prompt_param.to_string()), e.to_string())
            },
            EngineError::KvPoolTooSmall { .. } => ApiError {
                code: Some("context_length_exceeded"),
                ..ApiError::invalid(Some("max_tokens".to_string()), e.to_string())
            },
            EngineError::InvalidRequest { param, .. } => {
                let param = if param == "prompt" {
                    prompt_param
                } else {
                    param
                };
                ApiError::invalid(Some(param.to_string()), e.to_string())
            }
            EngineError::Tokenizer(_) => {
                ApiError::invalid(Some(prompt_param.to_string()), e.to_string())
            }
            EngineError::ChatTemplate(_) => {
                ApiError::invalid(Some("messages".to_string()), e.to_string())
            }
            EngineError::ShutDown => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: e.to_string(),
                kind: "service_unavailable",
                param: None,
                code: None,
            },
            other => ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                message: other.to_string(),
                kind: "internal_error",
                param: None,
                code: None,
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}
