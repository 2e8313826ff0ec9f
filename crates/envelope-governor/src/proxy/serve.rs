//! The accept loop: at most `max_connections` client connections at once
//! (more wait in the listen backlog until one closes), request headers
//! within `header_read_timeout_ms`, HTTP/1.1, the peer address
//! for the admin check, and a graceful end: when `shutdown` resolves (after
//! the governor drained) no connection is accepted and open ones close once
//! their responses are done, within a bound.
//!
//! The two governed endpoints go straight to their front door; every other
//! request goes through the router. Routing, its extensions and its
//! boxed futures cost more than the choice a method and a path comparison
//! make (measured: docs/measurements/2026-12-06-governor-code-figures.md).

use super::{app, GovernedUpstream};
use crate::front_door::{governed, FrontDoor};
use crate::request::Endpoint;
use crate::request_path::timer::ReusingTimer;
use axum::extract::{ConnectInfo, State};
use axum::http::Method;
use hyper_util::rt::TokioIo;
use std::sync::Arc;
use std::time::Duration;
use tower::ServiceExt;

/// Binds `listen` and says where it listens on stdout (the line a
/// supervisor or test waits for), for either front end.
///
/// # Errors
/// The address cannot be bound, or stdout is gone.
pub async fn bind_and_announce(
    listen: &str,
) -> Result<tokio::net::TcpListener, crate::error::StartError> {
    use std::io::Write;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|cause| crate::error::StartError::Bind {
            listen: listen.to_string(),
            cause,
        })?;
    let addr = listener.local_addr()?;
    println!("envelope govern listening on http://{addr}");
    std::io::stdout().flush()?;
    Ok(listener)
}

/// How long open connections get to close after shutdown.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// Serves `app` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<GovernedUpstream>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let settings = state.gov.settings();
    let limits = (
        settings.front.max_connections,
        Duration::from_millis(settings.front.header_read_timeout_ms),
    );
    serve_router(listener, app(state.clone()), state, limits, shutdown).await
}

/// The governed endpoint `req` asks for, if it is one.
fn governed_endpoint<B>(req: &hyper::Request<B>) -> Option<Endpoint> {
    if req.method() != Method::POST {
        return None;
    }
    Endpoint::at(req.uri().path())
}

/// Serves `router` with (most connections, header read timeout), the
/// governed endpoints answered through `door`'s front door without the
/// router.
pub async fn serve_router<D: FrontDoor>(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    door: Arc<D>,
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
        // queue of slices for a vectored write cost more than copying a
        // small body (docs/measurements/2026-12-06-governor-code-figures.md; answers
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
        let door = door.clone();
        let service =
            hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                let to = governed_endpoint(&req).map(|e| (door.clone(), e));
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
