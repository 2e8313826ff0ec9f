//! The accept loop: at most `max_connections` client connections at once
//! (more wait in the listen backlog until one closes), request headers
//! within `header_read_timeout_ms`, HTTP/1.1, the peer address
//! for the admin check, and a graceful end: when `shutdown` resolves (after
//! the governor drained) no connection is accepted and open ones close once
//! their responses are done, within a bound.
//!
//! The two governed endpoints go straight to their handler; every other
//! request goes through the router. Routing, its extensions and its
//! boxed futures were about 5% of the governor's instructions a request
//! (callgrind, one machine), for a choice a method and a path comparison
//! make.

use super::timer::ReusingTimer;
use super::{app, governed, AppState};
use crate::request::Endpoint;
use axum::extract::{ConnectInfo, State};
use axum::http::Method;
use hyper_util::rt::TokioIo;
use std::sync::Arc;
use std::time::Duration;
use tower::ServiceExt;

/// How long open connections get to close after shutdown.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// Serves `app` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let settings = state.gov.settings();
    let limits = (
        settings.max_connections,
        Duration::from_millis(settings.header_read_timeout_ms),
    );
    serve_routes(listener, app(state.clone()), Some(state), limits, shutdown).await
}

/// The governed endpoint `req` asks for, if it is one.
fn governed_endpoint<B>(req: &hyper::Request<B>) -> Option<Endpoint> {
    if req.method() != Method::POST {
        return None;
    }
    Endpoint::at(req.uri().path())
}

/// Serves `router` with (most connections, header read timeout).
pub(crate) async fn serve_router(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    limits: (usize, Duration),
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_routes(listener, router, None, limits, shutdown).await
}

/// [`serve_router`], with the governed endpoints of `direct` (when given)
/// answered without the router.
async fn serve_routes(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    direct: Option<Arc<AppState>>,
    (max_connections, header_timeout): (usize, Duration),
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let slots = Arc::new(tokio::sync::Semaphore::new(max_connections));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(ReusingTimer::default())
        .header_read_timeout(header_timeout)
        // An answer's head and body in one buffer, one write: hyper's
        // queue of slices for a vectored write cost about 400 more
        // instructions a request here than copying a small body (answers
        // are small; a stream's chunks are copied as they come). The
        // upstream side keeps vectored writes: flattened there, the pool
        // handed out a connection still stuck sending a large body
        // (client::tests::a_connection_stuck_sending_is_not_waited_on).
        .writev(false);
    tokio::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => s.expect("the semaphore is never closed"),
            _ = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // Out of file descriptors and the like: wait, do not spin.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        let direct = direct.clone();
        let service =
            hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                let to = direct
                    .as_ref()
                    .and_then(|s| Some((s.clone(), governed_endpoint(&req)?)));
                let router = router.clone();
                async move {
                    let req_body =
                        |r: hyper::Request<hyper::body::Incoming>| r.map(axum::body::Body::new);
                    match to {
                        Some((s, endpoint)) => {
                            Ok(governed(State(s), endpoint, req_body(req)).await)
                        }
                        None => {
                            req.extensions_mut().insert(ConnectInfo(peer));
                            // Boxed: the governed path's future is the one
                            // every request's carries and moves.
                            Box::pin(router.oneshot(req_body(req))).await
                        }
                    }
                }
            });
        let conn = builder.serve_connection(TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(slot);
        });
    }
    drop(listener);
    if tokio::time::timeout(CLOSE_GRACE, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            "connections still open {} s after shutdown are dropped",
            CLOSE_GRACE.as_secs()
        );
    }
    Ok(())
}
