//! An answer read whole in the governor, for a caller that looks at it
//! before the client does (the model tiers' router checks an answer
//! before it goes back, or compares one in a shadow call): relayed as it would be to a client
//! ([`stream_back_with`]) and read to its end here, so it is settled by
//! the one [`Settlement`](super::Settlement) the relay makes: its usage
//! from its tail (or its events), a stream's TTFT and ITL or a body's whole
//! time for the latency guard, an upstream fault counted, the permit
//! released.

use super::relay::{stream_back_with, StreamEnd};
use super::settle::Held;
use super::GovernedUpstream;
use crate::client::Answer;
use crate::error::GovernError;
use axum::body::Bytes;
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use axum::http::{HeaderMap, StatusCode};
use std::time::Instant;

/// A whole answer, settled.
#[derive(Debug)]
pub struct Collected {
    pub status: StatusCode,
    /// The upstream's headers, less the hop-by-hop ones and the length.
    pub headers: HeaderMap,
    pub body: Bytes,
    /// It was a stream of server-sent events.
    pub sse: bool,
}

/// Reads `resp`, sent at `sent_at` for the request `held` stands for, to
/// its end (at the latest at `end`, the request's lifetime) and settles
/// it.
///
/// # Errors
/// It did not end whole: the upstream failed or went silent mid-answer
/// (502), the lifetime ran out (504), or the governor is draining (503).
/// It is settled as cut either way.
pub(crate) async fn collect(
    s: &GovernedUpstream,
    resp: Answer,
    held: Held,
    sent_at: Instant,
    end: Instant,
) -> Result<Collected, GovernError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let on_end: super::OnEnd = Box::new(move |e: StreamEnd| {
        let _ = tx.send(e);
    });
    let relayed = stream_back_with(s, resp, Some(held), Some(sent_at), end, [], Some(on_end));
    let (mut parts, body) = relayed.into_parts();
    // The relay tells how the answer ended before its last frame; a body
    // cut short errs, a stream cut short ends with an error event.
    let body = axum::body::to_bytes(body, usize::MAX).await;
    let whole = rx.await.is_ok_and(|e| e.whole);
    let (Ok(body), true) = (body, whole) else {
        return Err(if s.gov.is_draining() {
            GovernError::Draining
        } else if Instant::now() >= end {
            GovernError::UpstreamTimeout(
                "the answer did not end within the request's lifetime".into(),
            )
        } else {
            GovernError::UpstreamUnreachable("the upstream failed mid-answer".into())
        });
    };
    parts.headers.remove(CONTENT_LENGTH);
    let sse = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    Ok(Collected {
        status: parts.status,
        headers: parts.headers,
        body,
        sse,
    })
}
