//! The governor's admin endpoints (`/admin/state`, `/admin/reload`): who
//! may call them (a loopback peer, or any peer with the admin token) and
//! what they answer.

use super::GovernedUpstream;
use crate::error::GovernError;
use crate::settings::Settings;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use std::net::SocketAddr;
use std::sync::Arc;

pub const ADMIN_DENIED: &str = "admin endpoints answer loopback or a valid x-envelope-admin-token";

/// Loopback, or the admin token (compared in constant time).
pub fn admin_allowed(settings: &Settings, req: &Request) -> bool {
    let loopback = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .is_some_and(|c| c.0.ip().is_loopback());
    let given = req
        .headers()
        .get("x-envelope-admin-token")
        .map(HeaderValue::as_bytes);
    let token_ok = match (settings.admin_token.as_deref(), given) {
        (Some(t), Some(g)) => constant_time_eq::constant_time_eq(t.as_bytes(), g),
        _ => false,
    };
    loopback || token_ok
}

/// A request a browser sent (a page on any site can make the browser POST
/// to a loopback address; browsers mark such requests, scripts do not).
pub fn from_a_browser(h: &HeaderMap) -> bool {
    h.contains_key("origin")
        || h.get("sec-fetch-site")
            .is_some_and(|v| v.as_bytes() != b"none")
        || h.contains_key("sec-fetch-mode")
}

pub(super) async fn admin_state(State(s): State<Arc<GovernedUpstream>>, req: Request) -> Response {
    if !admin_allowed(&s.settings(), &req) {
        return GovernError::Forbidden(ADMIN_DENIED.into()).into_response();
    }
    axum::Json(s.gov.state_json()).into_response()
}

pub(super) async fn admin_reload(State(s): State<Arc<GovernedUpstream>>, req: Request) -> Response {
    if !admin_allowed(&s.settings(), &req) {
        return GovernError::Forbidden(ADMIN_DENIED.into()).into_response();
    }
    if from_a_browser(req.headers()) {
        return GovernError::Forbidden(
            "admin POSTs are refused from browsers (Origin or Sec-Fetch-* present)".into(),
        )
        .into_response();
    }
    match &s.reload {
        None => GovernError::NotFound("no profile file to reload".into()).into_response(),
        Some(hook) => match hook() {
            Ok(id) => axum::Json(serde_json::json!({"reloaded": true, "profile_id": id})).into_response(),
            Err(e) => (
                StatusCode::UNPROCESSABLE_ENTITY,
                axum::Json(serde_json::json!({"error": {"message": e, "type": "invalid_request_error", "param": null, "code": "invalid_profile"}})),
            )
                .into_response(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::Governor;
    use crate::settings::SettingsDraft;
    use crate::tokens::TokenCounter;
    use axum::body::Body;

    /// The admin endpoints through the router, from a peer of our choosing:
    /// loopback passes without a token, any other peer needs the token
    /// itself (a wrong one, or one differing in its last byte, is refused).
    #[tokio::test]
    async fn admin_needs_loopback_or_the_exact_token() {
        use tower::ServiceExt;
        let mut settings = SettingsDraft::new(
            envelope_profile::Limits {
                max_context_tokens: 100,
                max_output_tokens: 10,
                max_concurrent_seqs: 1,
                max_kv_tokens_in_flight: 110,
                buckets: vec![],
            },
            "p",
        );
        settings.admin_token = Some("s3cret-token".into());
        let gov = Governor::new(settings.check().unwrap());
        let state = Arc::new(GovernedUpstream::new(
            gov,
            "http://127.0.0.1:9",
            TokenCounter::Estimate {
                bytes_per_token: 1.0,
            },
        ));
        let status = |peer: &str, token: Option<&str>| {
            let mut req = Request::builder().uri("/admin/state");
            if let Some(t) = token {
                req = req.header("x-envelope-admin-token", t);
            }
            let mut req = req.body(Body::empty()).unwrap();
            req.extensions_mut()
                .insert(ConnectInfo(peer.parse::<SocketAddr>().unwrap()));
            let app = crate::proxy::app(state.clone());
            async move { app.oneshot(req).await.unwrap().status().as_u16() }
        };
        let remote = "10.1.2.3:40000";
        assert_eq!(status("127.0.0.1:40000", None).await, 200);
        assert_eq!(status(remote, None).await, 403);
        assert_eq!(status(remote, Some("wrong")).await, 403);
        assert_eq!(status(remote, Some("s3cret-tokeN")).await, 403);
        assert_eq!(status(remote, Some("")).await, 403);
        assert_eq!(status(remote, Some("s3cret-token")).await, 200);
    }

    #[test]
    fn browsers_are_told_apart_from_scripts() {
        let mut h = HeaderMap::new();
        assert!(!from_a_browser(&h));
        h.insert("sec-fetch-site", HeaderValue::from_static("none"));
        assert!(!from_a_browser(&h));
        h.insert("sec-fetch-site", HeaderValue::from_static("cross-site"));
        assert!(from_a_browser(&h));
        let mut h = HeaderMap::new();
        h.insert("origin", HeaderValue::from_static("http://example.com"));
        assert!(from_a_browser(&h));
    }
}
