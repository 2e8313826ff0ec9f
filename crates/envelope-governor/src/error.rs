//! The one error enum of the governor and its one mapping to an HTTP status,
//! an OpenAI-shaped body (`{"error": {"message", "type", "param", "code"}}`)
//! and a reason label. The same label tags the rejection counter in
//! `/metrics` and the log line (TGI's router does the same with its
//! `ValidationError` -> status + `error_type`).

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GovernError {
    /// The body is not JSON, not UTF-8, or a field has the wrong type or value.
    #[error("{message}")]
    Invalid {
        param: Option<String>,
        message: String,
    },
    /// Prompt + max_tokens exceeds the context cap.
    #[error("this request needs {needed_tokens} tokens (prompt {prompt_tokens} + max_tokens {max_tokens}), over the context limit of {limit_tokens} tokens")]
    ContextLength {
        param: &'static str,
        prompt_tokens: u64,
        max_tokens: u64,
        needed_tokens: u64,
        limit_tokens: u64,
    },
    /// Prompt + max_tokens past the largest bucket the profile measured
    /// (with the `refuse` policy for requests beyond the envelope).
    #[error("this request needs {needed_tokens} tokens (prompt + max_tokens), past the largest measured bucket {bucket} ({bucket_tokens} tokens): nothing measured says it is safe on this server")]
    BeyondEnvelope {
        param: &'static str,
        needed_tokens: u64,
        bucket: String,
        bucket_tokens: u64,
    },
    /// max_tokens above the output cap with the `reject` policy.
    #[error("max_tokens {asked} exceeds the output limit of {limit} tokens")]
    OutputTooLong { asked: u64, limit: u64 },
    /// Could never be admitted, even on an idle server (so clients must not retry).
    #[error("{message}")]
    NeverFits {
        param: &'static str,
        message: String,
    },
    #[error("request body is over the limit of {limit_bytes} bytes")]
    BodyTooLarge { limit_bytes: usize },
    #[error("the request body did not arrive within {timeout_ms} ms")]
    BodyTimeout { timeout_ms: u64 },
    /// Transient overload: the queue is full, the deadline cannot be met, or
    /// the request waited too long.
    #[error("{message}")]
    Overloaded {
        reason: OverloadReason,
        retry_after_s: u64,
        message: String,
    },
    #[error("the governor is draining and admits no new requests")]
    Draining,
    #[error("upstream unreachable: {0}")]
    UpstreamUnreachable(String),
    #[error("upstream did not answer in time: {0}")]
    UpstreamTimeout(String),
    #[error("not allowed: {0}")]
    Forbidden(String),
    /// No API key, or one not known, where keys are configured.
    #[error("{0}")]
    Unauthorized(String),
    #[error("no route {0}")]
    NotFound(String),
    /// Over a budget over time (`--budgets`): retry after the refill.
    #[error("{message}")]
    OverRate {
        /// OpenAI's error type: `requests`, `tokens` or `cost`.
        kind: &'static str,
        message: String,
        retry_after_ms: u64,
        /// The `x-ratelimit-*` headers as of the refusal.
        headers: Vec<(&'static str, String)>,
    },
    /// Larger than a budget could ever hold (so clients must not retry).
    #[error("{0}")]
    OverBudgetForever(String),
    /// The budget store cannot be reached and a budget fails closed.
    #[error("the budget store cannot be reached; this request's budget fails closed")]
    BudgetStoreDown,
}

/// Why a transient refusal happened; each is its own metrics label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverloadReason {
    QueueFull,
    DeadlineUnmeetable,
    QueueTimeout,
    GuardRejectNew,
    /// Fits the profile, not the caps a live guard lowered for now.
    GuardTightened,
    /// Expected queue wait + the bucket's TTFT breaks the TTFT budget.
    TtftBudget,
    /// The prompt could not be counted in time (a busy upstream's
    /// tokenizer), and the bound its bytes give does not fit: told to come
    /// back, never refused for good on a bound.
    CountTimeout,
}

impl OverloadReason {
    pub fn label(self) -> &'static str {
        match self {
            OverloadReason::QueueFull => "queue_full",
            OverloadReason::DeadlineUnmeetable => "deadline_unmeetable",
            OverloadReason::QueueTimeout => "queue_timeout",
            OverloadReason::GuardRejectNew => "guard_reject_new",
            OverloadReason::GuardTightened => "guard_tightened",
            OverloadReason::TtftBudget => "ttft_budget",
            OverloadReason::CountTimeout => "count_timeout",
        }
    }
}

impl GovernError {
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> GovernError {
        GovernError::Invalid {
            param: param.map(str::to_string),
            message: message.into(),
        }
    }

    /// The reason label used in responses' logs and in
    /// `envelope_governor_rejections_total{mode, reason}`.
    pub fn reason(&self) -> &'static str {
        match self {
            GovernError::Invalid { .. } => "invalid_request",
            GovernError::ContextLength { .. } => "context_length_exceeded",
            GovernError::BeyondEnvelope { .. } => "beyond_envelope",
            GovernError::OutputTooLong { .. } => "max_tokens_over_limit",
            GovernError::NeverFits { .. } => "never_fits",
            GovernError::BodyTooLarge { .. } => "body_too_large",
            GovernError::BodyTimeout { .. } => "body_timeout",
            GovernError::Overloaded { reason, .. } => reason.label(),
            GovernError::Draining => "draining",
            GovernError::UpstreamUnreachable(_) => "upstream_unreachable",
            GovernError::UpstreamTimeout(_) => "upstream_timeout",
            GovernError::Forbidden(_) => "forbidden",
            GovernError::Unauthorized(_) => "invalid_api_key",
            GovernError::NotFound(_) => "not_found",
            GovernError::OverRate { .. } => "budget_exceeded",
            GovernError::OverBudgetForever(_) => "budget_too_small",
            GovernError::BudgetStoreDown => "budget_store_unavailable",
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            GovernError::Invalid { .. }
            | GovernError::ContextLength { .. }
            | GovernError::BeyondEnvelope { .. }
            | GovernError::OutputTooLong { .. }
            | GovernError::NeverFits { .. }
            | GovernError::OverBudgetForever(_) => StatusCode::BAD_REQUEST,
            GovernError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            GovernError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            GovernError::Overloaded { .. } | GovernError::OverRate { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            GovernError::Draining | GovernError::BudgetStoreDown => StatusCode::SERVICE_UNAVAILABLE,
            GovernError::UpstreamUnreachable(_) => StatusCode::BAD_GATEWAY,
            GovernError::UpstreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            GovernError::Forbidden(_) => StatusCode::FORBIDDEN,
            GovernError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            GovernError::NotFound(_) => StatusCode::NOT_FOUND,
        }
    }

    /// `Retry-After` in whole seconds, for refusals a client should retry.
    pub fn retry_after_s(&self) -> Option<u64> {
        match self {
            GovernError::Overloaded { retry_after_s, .. } => Some(*retry_after_s),
            GovernError::Draining => Some(5),
            GovernError::OverRate { retry_after_ms, .. } => Some(retry_after_ms.div_ceil(1000)),
            GovernError::BudgetStoreDown => Some(1),
            _ => None,
        }
    }

    /// The OpenAI error body.
    pub fn body(&self) -> serde_json::Value {
        let (kind, param, code): (&str, Option<String>, Option<&str>) = match self {
            GovernError::Invalid { param, .. } => ("invalid_request_error", param.clone(), None),
            GovernError::ContextLength { param, .. } => (
                "invalid_request_error",
                Some(param.to_string()),
                Some("context_length_exceeded"),
            ),
            GovernError::BeyondEnvelope { param, .. } => (
                "invalid_request_error",
                Some(param.to_string()),
                Some("context_length_exceeded"),
            ),
            GovernError::OutputTooLong { .. } => (
                "invalid_request_error",
                Some("max_tokens".into()),
                Some("max_tokens_over_limit"),
            ),
            GovernError::NeverFits { param, .. } => (
                "invalid_request_error",
                Some(param.to_string()),
                Some("context_length_exceeded"),
            ),
            GovernError::BodyTooLarge { .. } => {
                ("invalid_request_error", None, Some("request_too_large"))
            }
            GovernError::BodyTimeout { .. } => {
                ("invalid_request_error", None, Some("request_timeout"))
            }
            GovernError::Overloaded { .. } => {
                ("rate_limit_error", None, Some("rate_limit_exceeded"))
            }
            GovernError::Draining => ("server_error", None, Some("draining")),
            GovernError::UpstreamUnreachable(_) => {
                ("server_error", None, Some("upstream_unreachable"))
            }
            GovernError::UpstreamTimeout(_) => ("server_error", None, Some("upstream_timeout")),
            GovernError::Forbidden(_) => ("invalid_request_error", None, Some("forbidden")),
            GovernError::Unauthorized(_) => {
                ("invalid_request_error", None, Some("invalid_api_key"))
            }
            GovernError::NotFound(_) => ("invalid_request_error", None, Some("not_found")),
            GovernError::OverRate { kind, .. } => (kind, None, Some("rate_limit_exceeded")),
            GovernError::OverBudgetForever(_) => (
                "invalid_request_error",
                Some("max_tokens".into()),
                Some("budget_too_small"),
            ),
            GovernError::BudgetStoreDown => {
                ("server_error", None, Some("budget_store_unavailable"))
            }
        };
        json!({"error": {"message": self.to_string(), "type": kind, "param": param, "code": code}})
    }
}

impl IntoResponse for GovernError {
    fn into_response(self) -> Response {
        let mut r = (self.status(), axum::Json(self.body())).into_response();
        let h = r.headers_mut();
        // Every refusal to retry says when twice: Retry-After in whole
        // seconds and retry-after-ms, which the official OpenAI clients
        // read first (a budget's exact wait; else the same seconds).
        if let Some(s) = self.retry_after_s() {
            h.insert("retry-after", HeaderValue::from(s));
            h.insert("retry-after-ms", HeaderValue::from(s * 1000));
        }
        h.insert("x-envelope-reason", HeaderValue::from_static(self.reason()));
        if let GovernError::OverRate {
            retry_after_ms,
            headers,
            ..
        } = &self
        {
            h.insert("retry-after-ms", HeaderValue::from(*retry_after_ms));
            for (k, v) in headers {
                if let Ok(v) = HeaderValue::from_str(v) {
                    h.insert(axum::http::HeaderName::from_static(k), v);
                }
            }
        }
        // A request that can never fit must not be retried by clients that
        // honour x-should-retry (the official OpenAI clients do).
        if self.status().is_client_error() && self.status() != StatusCode::TOO_MANY_REQUESTS {
            h.insert("x-should-retry", HeaderValue::from_static("false"));
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<GovernError> {
        vec![
            GovernError::invalid(Some("max_tokens"), "bad"),
            GovernError::ContextLength {
                param: "messages",
                prompt_tokens: 10,
                max_tokens: 5,
                needed_tokens: 15,
                limit_tokens: 12,
            },
            GovernError::OutputTooLong { asked: 9, limit: 4 },
            GovernError::NeverFits {
                param: "n",
                message: "x".into(),
            },
            GovernError::BodyTooLarge { limit_bytes: 8 },
            GovernError::BodyTimeout { timeout_ms: 1 },
            GovernError::Overloaded {
                reason: OverloadReason::QueueFull,
                retry_after_s: 3,
                message: "busy".into(),
            },
            GovernError::Draining,
            GovernError::UpstreamUnreachable("x".into()),
            GovernError::UpstreamTimeout("x".into()),
            GovernError::Forbidden("x".into()),
            GovernError::NotFound("x".into()),
            GovernError::BeyondEnvelope {
                param: "prompt",
                needed_tokens: 300,
                bucket: "256x32".into(),
                bucket_tokens: 288,
            },
            GovernError::Unauthorized("x".into()),
            GovernError::OverRate {
                kind: "tokens",
                message: "over".into(),
                retry_after_ms: 1500,
                headers: vec![("x-ratelimit-remaining-tokens", "3".into())],
            },
            GovernError::OverBudgetForever("x".into()),
            GovernError::BudgetStoreDown,
        ]
    }

    #[test]
    fn every_error_maps_to_status_body_and_label() {
        let statuses: Vec<u16> = all().iter().map(|e| e.status().as_u16()).collect();
        assert_eq!(
            statuses,
            [400, 400, 400, 400, 413, 408, 429, 503, 502, 504, 403, 404, 400, 401, 429, 400, 503]
        );
        for e in all() {
            let b = e.body();
            assert!(!b["error"]["message"].as_str().unwrap().is_empty(), "{e:?}");
            assert!(b["error"]["type"].is_string());
            assert!(!e.reason().is_empty());
        }
    }

    #[test]
    fn context_length_names_param_and_code() {
        let e = &all()[1];
        assert_eq!(e.body()["error"]["code"], "context_length_exceeded");
        assert_eq!(e.body()["error"]["param"], "messages");
        assert!(e.to_string().contains("12"));
    }

    #[test]
    fn only_overload_and_draining_carry_retry_after() {
        for e in all() {
            let want = matches!(
                e,
                GovernError::Overloaded { .. }
                    | GovernError::Draining
                    | GovernError::OverRate { .. }
                    | GovernError::BudgetStoreDown
            );
            assert_eq!(e.retry_after_s().is_some(), want, "{e:?}");
        }
        let r = all()[6].clone().into_response();
        assert_eq!(r.headers()["retry-after"], "3");
        assert_eq!(r.headers()["retry-after-ms"], "3000");
        assert_eq!(r.headers()["x-envelope-reason"], "queue_full");
        let r = all()[7].clone().into_response();
        assert_eq!(r.headers()["retry-after"], "5");
        assert_eq!(r.headers()["retry-after-ms"], "5000");
        let r = all()[0].clone().into_response();
        assert_eq!(r.headers()["x-should-retry"], "false");
        // Over a budget: whole seconds rounded up, the exact ms, and the
        // budget's headers.
        let r = all()[14].clone().into_response();
        assert_eq!(r.headers()["retry-after"], "2");
        assert_eq!(r.headers()["retry-after-ms"], "1500");
        assert_eq!(r.headers()["x-ratelimit-remaining-tokens"], "3");
        assert_eq!(r.headers()["x-envelope-reason"], "budget_exceeded");
        let r = all()[15].clone().into_response();
        assert_eq!(r.headers()["x-should-retry"], "false");
    }
}

/// What stops the governor from starting (or reloading): each names the
/// setting or file at fault.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A required setting is absent from the flags, the environment and
    /// the config file.
    #[error("--{flag} is required (flag, ENVELOPE_GOVERN_{env} or `{field}` in --config)", flag = .0.replace('_', "-"), env = .0.to_uppercase(), field = .0)]
    Missing(&'static str),
    #[error("reading {what} {}: {cause}", path.display())]
    Read {
        what: &'static str,
        path: std::path::PathBuf,
        cause: std::io::Error,
    },
    #[error("parsing --config {}: {message}", path.display())]
    ConfigFile {
        path: std::path::PathBuf,
        message: String,
    },
    #[error(transparent)]
    Profile(#[from] envelope_profile::ProfileError),
    /// An invalid setting, tenants file or tokenizer, said in full.
    #[error("{0}")]
    Invalid(String),
    #[error("the profile {profile} does not match this node: {list} (--on-mismatch refuse)")]
    Mismatch { profile: String, list: String },
    #[error("binding --listen {listen}: {cause}")]
    Bind {
        listen: String,
        cause: std::io::Error,
    },
    #[error(transparent)]
    Io(#[from] std::io::Error),
}
