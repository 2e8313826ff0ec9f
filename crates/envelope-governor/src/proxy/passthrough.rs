//! What the governor answers without governing: its own `/metrics`, and
//! the paths it forwards to the upstream as they are (allowlisted GETs,
//! `/tokenize`), each to a caller with a known key where keys are
//! configured, the public paths excepted.

use super::{reject, GovernedUpstream};
use crate::engine_metrics::{combined_page, CLASSIC_TEXT};
use crate::error::GovernError;
use crate::identity;
use crate::request_path::{forward_headers, stream_back_with, upstream_error};
use crate::settings::{path_allowed, Settings};
use axum::extract::{Request, State};
use axum::http::Method;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(super) async fn metrics(State(s): State<Arc<GovernedUpstream>>, req: Request) -> Response {
    let settings = s.gov.settings();
    if !public(&settings, "/metrics") {
        if let Err(e) = identity::tenant(&settings.tenants, req.headers()) {
            return reject(&s, e);
        }
    }
    let own = s.gov.render_metrics();
    match &s.engine_metrics {
        Some(engine) => (
            [(axum::http::header::CONTENT_TYPE, CLASSIC_TEXT)],
            combined_page(&own, engine.fresh().as_deref()),
        )
            .into_response(),
        None => (
            [(
                axum::http::header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            own,
        )
            .into_response(),
    }
}

/// Whether `path` may be answered without an API key: always when no keys
/// are configured, else when it is one of `public_paths`.
fn public(settings: &Settings, path: &str) -> bool {
    !settings.tenants.keys_required() || path_allowed(&settings.front.public_paths, path)
}

/// A path whose segments, percent-decoded, hold `.` or `..`: many servers
/// resolve those (`/v1/models/%2e%2e/%2e%2e/admin` reaches `/admin`), so
/// the allowlist would not say what is reached. A `%2F` inside a segment
/// (a model name with a slash) stays allowed.
fn dot_segment(path: &str) -> bool {
    path.split('/').any(|seg| {
        let d = percent_encoding::percent_decode_str(seg).collect::<Vec<u8>>();
        d == b"." || d == b".."
    })
}

/// Allowlisted GET paths (and the tokenizer endpoints) go to the upstream
/// as they are, to a caller with a known key where keys are configured
/// (the public paths excepted).
pub(super) async fn passthrough(State(s): State<Arc<GovernedUpstream>>, req: Request) -> Response {
    let settings = s.gov.settings();
    let path = req.uri().path().to_string();
    if dot_segment(&path) {
        return reject(
            &s,
            GovernError::invalid(None, format!("{path}: a path segment is `.` or `..`")),
        );
    }
    let allowed = (matches!(*req.method(), Method::GET | Method::HEAD)
        && path_allowed(&settings.front.passthrough_paths, &path))
        || (req.method() == Method::POST && matches!(path.as_str(), "/tokenize" | "/detokenize"));
    if !allowed {
        let e = GovernError::NotFound(format!(
            "{} {path}: the governor forwards the two completion endpoints, /tokenize and the GET paths it is configured to pass ({})",
            req.method(),
            settings.front.passthrough_paths.join(", ")
        ));
        return reject(&s, e);
    }
    if !public(&settings, &path) {
        if let Err(e) = identity::tenant(&settings.tenants, req.headers()) {
            return reject(&s, e);
        }
    }
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or(path);
    let url = format!("{}{pq}", s.upstream);
    let method = req.method().clone();
    let headers = forward_headers(req.headers());
    let body = match axum::body::to_bytes(req.into_body(), 1 << 20).await {
        Ok(b) => b,
        Err(_) => {
            return GovernError::BodyTooLarge {
                limit_bytes: 1 << 20,
            }
            .into_response()
        }
    };
    let timeout = Duration::from_millis(
        settings
            .timeouts
            .upstream_timeout_ms
            .min(settings.timeouts.max_request_ms),
    );
    let end = Instant::now() + Duration::from_millis(settings.timeouts.max_request_ms);
    let send = s.client.send(method, &url, headers, body);
    match tokio::time::timeout(timeout, send).await {
        Ok(Ok(resp)) => stream_back_with(&s, resp, None, None, end, [], None),
        Ok(Err(e)) => upstream_error(&s, e, false).into_response(),
        Err(_) => upstream_error(
            &s,
            format!("{url}: no answer in {} ms", timeout.as_millis()),
            true,
        )
        .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_segments_are_found_after_decoding() {
        for p in [
            "/v1/models/..",
            "/v1/models/%2e%2e/%2E%2E/admin",
            "/v1/models/%2e/x",
            "/v1/models/.%2e/x",
        ] {
            assert!(dot_segment(p), "{p}");
        }
        for p in [
            "/v1/models/org%2Fname",
            "/v1/models/a..b",
            "/v1/models/...",
            "/health",
        ] {
            assert!(!dot_segment(p), "{p}");
        }
    }
}
