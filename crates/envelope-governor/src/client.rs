//! The client to the upstream: HTTP/1 connections from hyper's
//! connection API, kept alive in a pool of our own. hyper-util's pooled
//! client hashed its pool key (the URL's authority, byte by byte, with
//! SipHash) twice a request and formatted a Host header each time;
//! reqwest adds URL parsing (with IDNA), redirect and retry layers on top
//! of that (measured: docs/measurements/2026-12-06-governor-code-figures.md).
//! A governor talks to
//! one upstream or a few, so the pool is a short list searched from its
//! most recently used end.
//!
//! Connections are kept alive and reused once their answer's body has
//! been read to its end (one dropped part-way is closed), redirects are
//! never followed (the answer goes back as it is), a connect timeout
//! bounds an unreachable upstream, and a request that a reused connection
//! closed under, before taking it or after taking it but before any byte
//! of an answer came back (servers such as llama.cpp's close idle
//! kept-alive connections), is sent once more on a new one.

use axum::body::{Body, Bytes, HttpBody};
use axum::http::header::{CONTENT_TYPE, HOST};
use axum::http::uri::{Authority, Scheme};
use axum::http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Uri};
use axum::BoxError;
use futures::FutureExt;
use http_body::Frame;
use http_body_util::Full;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

/// Idle connections kept (a governor has one upstream or a few).
const MAX_IDLE: usize = 1024;

/// How long a kept connection may take to be ready for the next request.
/// It went back when its answer's body ended and is ready within
/// microseconds, unless it is stuck (say, still sending a request body
/// that the upstream answered early and stopped reading); then it is
/// dropped and another one used.
const READY_WAIT: Duration = Duration::from_millis(250);

type Sender = SendRequest<Full<Bytes>>;

#[derive(Clone)]
pub struct UpstreamClient(Arc<Pool>);

/// How requests found their connection (counters shared with the
/// governor's metrics).
#[derive(Clone, Default)]
pub struct ConnectionCounters {
    /// Requests sent on a kept connection.
    pub reused: prometheus_client::metrics::counter::Counter,
    /// Requests that needed a new connection.
    pub opened: prometheus_client::metrics::counter::Counter,
    /// Requests sent again on a new connection after a kept one closed
    /// under them with no answer.
    pub resent: prometheus_client::metrics::counter::Counter,
}

struct Pool {
    connect_timeout: Duration,
    counters: ConnectionCounters,
    /// Idle connections and where they go, the most recently used last.
    idle: Mutex<Vec<(Authority, Sender)>>,
}

impl Pool {
    /// An idle connection to `to` that is still open.
    fn take(&self, to: &Authority) -> Option<Sender> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(i) = idle.iter().rposition(|(a, _)| a == to) {
            let (_, sender) = idle.swap_remove(i);
            if !sender.is_closed() {
                return Some(sender);
            }
            // Closed by the upstream: dropped.
        }
        None
    }

    /// A connection to `to` ready for a request, and whether it was kept
    /// from an earlier one. A kept connection may still be finishing the
    /// last answer (it was put back when its body ended), so it is waited
    /// for; one that closes instead is dropped.
    async fn checkout(&self, to: &Authority) -> Result<(Sender, bool), String> {
        while let Some(mut sender) = self.take(to) {
            let ready = match sender.ready().now_or_never() {
                Some(r) => r.is_ok(),
                None => matches!(
                    tokio::time::timeout(READY_WAIT, sender.ready()).await,
                    Ok(Ok(()))
                ),
            };
            if ready {
                return Ok((sender, true));
            }
            // Closed, or stuck: dropping it ends the connection.
        }
        // Boxed: most requests find a kept connection, and would carry
        // the connect's future (a timer, a resolver) for nothing.
        Ok((Box::pin(self.connect(to)).await?, false))
    }

    /// `req` once more on a new connection (a kept one closed before it
    /// took it): the new connection and the answer's head.
    async fn resend(
        &self,
        to: &Authority,
        uri: &Uri,
        req: Request<Full<Bytes>>,
    ) -> Result<(Sender, Response<hyper::body::Incoming>), String> {
        let mut sender = self.connect(to).await.map_err(|e| format!("{uri}: {e}"))?;
        let r = sender
            .send_request(req)
            .await
            .map_err(|e| failure(uri, &e))?;
        Ok((sender, r))
    }

    fn put(&self, to: Authority, sender: Sender) {
        if sender.is_closed() {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < MAX_IDLE {
            idle.push((to, sender));
        }
    }

    /// A new connection to `to`, within the connect timeout.
    async fn connect(&self, to: &Authority) -> Result<Sender, String> {
        let port = to.port_u16().unwrap_or(80);
        let host = to.host().trim_start_matches('[').trim_end_matches(']');
        let stream = match tokio::time::timeout(
            self.connect_timeout,
            tokio::net::TcpStream::connect((host, port)),
        )
        .await
        {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(format!("tcp connect error: {e}")),
            Err(_) => {
                return Err(format!(
                    "tcp connect error: no connection in {} ms",
                    self.connect_timeout.as_millis()
                ))
            }
        };
        let _ = stream.set_nodelay(true);
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("upstream connection ended: {e}");
            }
        });
        Ok(sender)
    }
}

impl UpstreamClient {
    pub fn new(connect_timeout: Duration) -> UpstreamClient {
        UpstreamClient::counted(connect_timeout, ConnectionCounters::default())
    }

    /// A client that counts its connections' use in `counters`.
    pub fn counted(connect_timeout: Duration, counters: ConnectionCounters) -> UpstreamClient {
        UpstreamClient(Arc::new(Pool {
            connect_timeout,
            counters,
            idle: Mutex::new(Vec::new()),
        }))
    }

    /// Sends one request to `url` (the upstream's base, path and query)
    /// and returns the answer's head, its body still to be read.
    ///
    /// # Errors
    /// The URL does not parse, the connection failed or timed out, or the
    /// upstream closed it before a whole head came back: what happened, for
    /// the log (it names the upstream).
    pub async fn send(
        &self,
        method: Method,
        url: &str,
        headers: HeaderMap,
        body: Bytes,
    ) -> Result<Answer, String> {
        let uri = url.parse::<Uri>().map_err(|e| format!("{url}: {e}"))?;
        self.send_to(method, uri, headers, body).await
    }

    /// [`UpstreamClient::send`] to a parsed URI, with a Host header from
    /// its authority unless `headers` has one.
    ///
    /// # Errors
    /// As [`UpstreamClient::send`], less the parse.
    pub async fn send_to(
        &self,
        method: Method,
        uri: Uri,
        mut headers: HeaderMap,
        body: Bytes,
    ) -> Result<Answer, String> {
        if !headers.contains_key(HOST) {
            let host = host_of(&uri).ok_or_else(|| format!("{uri}: no host to connect to"))?;
            headers.insert(HOST, host);
        }
        let to = match (uri.scheme(), uri.authority()) {
            (Some(s), Some(a)) if *s == Scheme::HTTP => a.clone(),
            _ => return Err(format!("{uri}: not an http:// URL")),
        };
        // The request line has the path only (origin form).
        let path = uri.path_and_query().map_or("/", |p| p.as_str());
        let origin = Uri::try_from(path).map_err(|e| format!("{uri}: {e}"))?;
        let pool = &self.0;
        let (mut sender, reused) = pool
            .checkout(&to)
            .await
            .map_err(|e| format!("{uri}: {e}"))?;
        let counters = &pool.counters;
        if reused {
            counters.reused.inc();
        } else {
            counters.opened.inc();
        }
        // On a kept connection the request is kept (its body is shared,
        // not copied) until an answer's head comes back, to send it again.
        let again = reused.then(|| (method.clone(), headers.clone(), body.clone()));
        let req = request(method, origin.clone(), headers, body);
        let resp = match sender.try_send_request(req).await {
            Ok(r) => r,
            Err(mut e) => {
                let unsent = e.take_message();
                match (unsent, again) {
                    // A kept connection closed before it took the request,
                    // or took it and closed with no answer (the upstream's
                    // keep-alive ran out): once more, anew. Boxed: rare, and
                    // its future would otherwise be carried (and moved) in
                    // every request's.
                    (Some(req), Some(_)) => {
                        counters.resent.inc();
                        let (fresh, r) = Box::pin(pool.resend(&to, &uri, req)).await?;
                        sender = fresh;
                        r
                    }
                    (None, Some((m, h, b))) if closed_with_no_answer(e.error()) => {
                        counters.resent.inc();
                        let req = request(m, origin, h, b);
                        let (fresh, r) = Box::pin(pool.resend(&to, &uri, req)).await?;
                        sender = fresh;
                        r
                    }
                    _ => return Err(failure(&uri, e.error())),
                }
            }
        };
        let (parts, body) = resp.into_parts();
        let back = Some((pool.clone(), to, sender));
        let mut body = Pooled { inner: body, back };
        if body.inner.is_end_stream() {
            body.give_back();
        }
        Ok(Answer {
            status: parts.status,
            headers: parts.headers,
            body: Body::new(body),
        })
    }

    /// POSTs `body` as JSON to `url` (the /tokenize counter and the start
    /// checks); as [`UpstreamClient::send`].
    ///
    /// # Errors
    /// As [`UpstreamClient::send`].
    pub async fn post_json(&self, url: &str, body: &serde_json::Value) -> Result<Answer, String> {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        self.send(Method::POST, url, headers, body.to_string().into())
            .await
    }
}

fn request(method: Method, origin: Uri, headers: HeaderMap, body: Bytes) -> Request<Full<Bytes>> {
    let mut req = Request::new(Full::new(body));
    *req.method_mut() = method;
    *req.uri_mut() = origin;
    *req.headers_mut() = headers;
    req
}

/// Whether a sent request's connection ended before any of its answer
/// came back: hyper's incomplete message, or the connection reset or
/// broken under it.
fn closed_with_no_answer(e: &hyper::Error) -> bool {
    use std::error::Error as _;
    if e.is_incomplete_message() {
        return true;
    }
    let mut cause = e.source();
    while let Some(c) = cause {
        if let Some(io) = c.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
            );
        }
        cause = c.source();
    }
    false
}

/// What went wrong, with its causes (hyper's own message is terse).
fn failure(uri: &Uri, e: &hyper::Error) -> String {
    use std::error::Error as _;
    let mut detail = format!("{uri}: {e}");
    let mut cause = e.source();
    while let Some(c) = cause {
        detail.push_str(": ");
        detail.push_str(&c.to_string());
        cause = c.source();
    }
    detail
}

/// An answer's body that puts its connection back in the pool at its end.
struct Pooled {
    inner: hyper::body::Incoming,
    back: Option<(Arc<Pool>, Authority, Sender)>,
}

impl Pooled {
    fn give_back(&mut self) {
        if let Some((pool, to, sender)) = self.back.take() {
            pool.put(to, sender);
        }
    }
}

impl HttpBody for Pooled {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        match &r {
            Poll::Ready(None) => self.give_back(),
            Poll::Ready(Some(Ok(_))) if self.inner.is_end_stream() => self.give_back(),
            // An error: the connection is not put back.
            Poll::Ready(Some(Err(_))) => self.back = None,
            _ => {}
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

/// The Host header for requests to `uri`: its host, and its port unless
/// that is 80, http's default (any user information in the URL left out).
pub(crate) fn host_of(uri: &Uri) -> Option<HeaderValue> {
    let a = uri.authority()?;
    match a.port_u16() {
        Some(p) if p != 80 => HeaderValue::from_str(&format!("{}:{p}", a.host())).ok(),
        _ => HeaderValue::from_str(a.host()).ok(),
    }
}

/// An upstream's answer: its status, headers and body (not yet read).
pub struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Body,
}

impl Answer {
    pub fn status(&self) -> StatusCode {
        self.status
    }

    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The whole body.
    ///
    /// # Errors
    /// The upstream failed or closed the connection mid-body.
    pub async fn bytes(self) -> Result<Bytes, axum::Error> {
        axum::body::to_bytes(self.body, usize::MAX).await
    }

    pub(crate) fn into_parts(self) -> (StatusCode, HeaderMap, Body) {
        (self.status, self.headers, self.body)
    }
}

/// Any HTTP response as an upstream's answer (the fuzz targets and tests
/// relay bodies they make up).
impl<B> From<Response<B>> for Answer
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    fn from(r: Response<B>) -> Answer {
        let (parts, body) = r.into_parts();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body: Body::new(body),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// How a test upstream answers on each connection.
    #[derive(Clone, Copy)]
    enum Serve {
        /// Keep-alive: every request on the connection gets "ok".
        KeepAlive,
        /// One answer, then the socket closes (no `Connection: close`).
        OneThenClose,
        /// One answer; the next request on the connection is read and the
        /// socket closed with no answer (llama.cpp's server after a stream).
        OneThenCloseOnNext,
        /// A head promising 100 bytes, 10 of them, then nothing.
        Stall,
        /// "ok" as soon as the head is in, the request's body never read,
        /// the socket kept open.
        EarlyAnswer,
    }

    /// A raw HTTP/1.1 upstream on loopback; returns its base URL and how
    /// many connections it accepted.
    async fn upstream(serve: Serve) -> (String, Arc<AtomicUsize>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let accepted = Arc::new(AtomicUsize::new(0));
        let n = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                n.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    let mut answered = 0;
                    loop {
                        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                            match s.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(k) => buf.extend_from_slice(&chunk[..k]),
                            }
                        }
                        buf.clear();
                        if matches!(serve, Serve::OneThenCloseOnNext) && answered == 1 {
                            return;
                        }
                        answered += 1;
                        match serve {
                            Serve::EarlyAnswer => {
                                let _ = s
                                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                                    .await;
                                tokio::time::sleep(Duration::from_secs(3600)).await;
                            }
                            Serve::Stall => {
                                let _ = s
                                    .write_all(
                                        b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789",
                                    )
                                    .await;
                                tokio::time::sleep(Duration::from_secs(3600)).await;
                            }
                            _ => {
                                let _ = s
                                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                                    .await;
                                if matches!(serve, Serve::OneThenClose) {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        });
        (url, accepted)
    }

    /// GET `/x` of `url`: the answer, its body not yet read.
    async fn get_x(c: &UpstreamClient, url: &str) -> Result<Answer, String> {
        let path = format!("{url}/x");
        c.send(Method::GET, &path, HeaderMap::new(), Bytes::new())
            .await
    }

    async fn get(c: &UpstreamClient, url: &str) -> Result<Bytes, String> {
        let a = get_x(c, url).await?;
        assert_eq!(a.status(), StatusCode::OK);
        a.bytes().await.map_err(|e| e.to_string())
    }

    #[tokio::test]
    async fn a_connection_is_reused_once_its_body_is_read() {
        let (url, accepted) = upstream(Serve::KeepAlive).await;
        let c = UpstreamClient::new(Duration::from_secs(2));
        for _ in 0..5 {
            assert_eq!(get(&c, &url).await.unwrap(), "ok");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        // Two at once need two connections; both are kept after.
        let (a, b) = tokio::join!(get(&c, &url), get(&c, &url));
        assert_eq!(
            (a.unwrap(), b.unwrap()),
            (Bytes::from("ok"), Bytes::from("ok"))
        );
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        get(&c, &url).await.unwrap();
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn connections_the_upstream_closed_are_replaced() {
        let (url, accepted) = upstream(Serve::OneThenClose).await;
        let c = UpstreamClient::new(Duration::from_secs(2));
        for i in 1..=4 {
            assert_eq!(get(&c, &url).await.unwrap(), "ok", "request {i}");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 4);
    }

    #[tokio::test]
    async fn a_request_a_kept_connection_closed_under_unanswered_is_sent_again() {
        let (url, accepted) = upstream(Serve::OneThenCloseOnNext).await;
        let counters = ConnectionCounters::default();
        let c = UpstreamClient::counted(Duration::from_secs(2), counters.clone());
        for i in 1..=4 {
            assert_eq!(get(&c, &url).await.unwrap(), "ok", "request {i}");
        }
        // Requests 2-4 went out on the kept connection, got no answer and
        // were sent again on a new one.
        assert_eq!(accepted.load(Ordering::SeqCst), 4);
        assert_eq!(
            (
                counters.reused.get(),
                counters.opened.get(),
                counters.resent.get()
            ),
            (3, 1, 3)
        );
    }

    #[tokio::test]
    async fn a_body_dropped_part_way_does_not_go_back_to_the_pool() {
        let (url, accepted) = upstream(Serve::Stall).await;
        let c = UpstreamClient::new(Duration::from_secs(2));
        for _ in 0..2 {
            let a = get_x(&c, &url).await.unwrap();
            let mut body = a.body;
            let first = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(first.into_data().unwrap(), "0123456789");
            drop(body);
        }
        // The second request did not wait on the first's stalled connection.
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn only_http_urls_are_sent() {
        let c = UpstreamClient::new(Duration::from_secs(2));
        let e = get(&c, "https://127.0.0.1:9").await.unwrap_err();
        assert!(e.contains("not an http:// URL"), "{e}");
    }

    #[tokio::test]
    async fn a_connection_stuck_sending_is_not_waited_on() {
        let (url, accepted) = upstream(Serve::EarlyAnswer).await;
        let c = UpstreamClient::new(Duration::from_secs(2));
        // More than the sockets buffer: the request's body is still being
        // sent when the answer has come and been read.
        let body = Bytes::from(vec![b'a'; 32 << 20]);
        let a = c
            .send(Method::POST, &format!("{url}/x"), HeaderMap::new(), body)
            .await
            .unwrap();
        assert_eq!(a.bytes().await.unwrap(), "ok");
        let second = tokio::time::timeout(Duration::from_secs(10), get(&c, &url)).await;
        assert_eq!(
            second.expect("waited on the stuck connection").unwrap(),
            "ok"
        );
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn the_host_header_leaves_out_http_s_default_port() {
        let host = |u: &str| host_of(&u.parse().unwrap()).unwrap();
        assert_eq!(host("http://up:80/v1"), "up");
        assert_eq!(host("http://up:8000/v1"), "up:8000");
        assert_eq!(host("http://user:pw@[::1]:9/x"), "[::1]:9");
    }
}
