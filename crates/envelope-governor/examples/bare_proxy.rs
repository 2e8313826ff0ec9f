//! The floor under the governor's overhead: a reverse proxy on the
//! governor's stack (tokio's current-thread runtime, hyper's HTTP/1
//! server and client connections, kept upstream connections, each
//! upstream connection driven by a task of its own, the request body
//! read whole, the answer's body relayed) with none of the governor's
//! work: no parsing, counting, admission, headers or timers.
//! `scripts/govern-vs-nginx.sh` runs it beside nginx and the governor, so
//! one run shows how much of the governor's cost is the stack's.
//!
//! `cargo run --release -p envelope-governor --example bare_proxy -- LISTEN UPSTREAM`
//! (both `127.0.0.1:PORT`: loopback addresses only). A request the
//! upstream cannot take closes its client connection; this is a
//! measuring tool, not a proxy to run.

use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

type Sender = SendRequest<Full<Bytes>>;
type Error = Box<dyn std::error::Error + Send + Sync>;

struct Pool {
    upstream: SocketAddr,
    idle: Mutex<Vec<Sender>>,
}

impl Pool {
    /// A kept connection that is free, or a new one.
    async fn checkout(&self) -> Result<Sender, Error> {
        loop {
            let kept = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
            let Some(mut s) = kept else { break };
            if s.ready().await.is_ok() {
                return Ok(s);
            }
        }
        let stream = tokio::net::TcpStream::connect(self.upstream).await?;
        let _ = stream.set_nodelay(true);
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        Ok(sender)
    }
}

/// The upstream's body, relayed; its connection goes back to the pool
/// when the body ends, as the governor's does.
struct Relay {
    inner: Incoming,
    sender: Option<Sender>,
    pool: Arc<Pool>,
}

impl Body for Relay {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        // At the end (hyper does not ask again after the last byte of a
        // body of known length).
        let end = match &r {
            Poll::Ready(None) => true,
            Poll::Ready(Some(Ok(_))) => self.inner.is_end_stream(),
            _ => false,
        };
        if end {
            if let Some(s) = self.sender.take() {
                self.pool
                    .idle
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(s);
            }
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

async fn proxy(pool: Arc<Pool>, req: Request<Incoming>) -> Result<Response<Relay>, Error> {
    let (parts, body) = req.into_parts();
    let body = body.collect().await?.to_bytes();
    let mut sender = pool.checkout().await?;
    let answer = sender
        .send_request(Request::from_parts(parts, Full::new(body)))
        .await?;
    let (parts, inner) = answer.into_parts();
    Ok(Response::from_parts(
        parts,
        Relay {
            inner,
            sender: Some(sender),
            pool,
        },
    ))
}

fn loopback(arg: Option<String>, what: &str) -> Result<SocketAddr, String> {
    let a: SocketAddr = arg
        .ok_or_else(|| format!("usage: bare_proxy LISTEN UPSTREAM (missing {what})"))?
        .parse()
        .map_err(|e| format!("{what}: {e}"))?;
    if a.ip().is_loopback() {
        Ok(a)
    } else {
        Err(format!("{what}: {a} is not a loopback address"))
    }
}

fn main() -> Result<(), Error> {
    let mut args = std::env::args().skip(1);
    let listen = loopback(args.next(), "LISTEN")?;
    let upstream = loopback(args.next(), "UPSTREAM")?;
    let pool = Arc::new(Pool {
        upstream,
        idle: Mutex::new(Vec::new()),
    });
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(async move {
            let listener = tokio::net::TcpListener::bind(listen).await?;
            // As the governor's server: one buffer a write.
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.writev(false);
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let pool = pool.clone();
                let service = hyper::service::service_fn(move |req| proxy(pool.clone(), req));
                let conn = builder.serve_connection(TokioIo::new(stream), service);
                tokio::spawn(async move {
                    let _ = conn.await;
                });
            }
        })
}
