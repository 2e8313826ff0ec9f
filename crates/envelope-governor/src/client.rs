//! The client to the upstream: hyper's pooled HTTP/1 client, used
//! directly. reqwest wraps the same client in URL parsing (with IDNA),
//! redirect and retry layers the governor does not use; measured on one
//! machine in one run, a bare proxy on reqwest spent 12.6-17.7 us of user
//! CPU a request against 7.7-9.0 us on this client (wrk, 32 connections,
//! a fixed-response nginx upstream). Connections are kept alive and
//! reused, redirects are never followed (the answer goes back as it is),
//! and a connect timeout bounds an unreachable upstream.

use axum::body::{Body, Bytes, HttpBody};
use axum::http::header::{CONTENT_TYPE, HOST};
use axum::http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Uri};
use axum::BoxError;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::error::Error as _;
use std::time::Duration;

/// Idle connections kept per upstream (a governor has one or a few).
const MAX_IDLE: usize = 1024;

#[derive(Clone)]
pub struct UpstreamClient(Client<HttpConnector, Body>);

impl UpstreamClient {
    pub fn new(connect_timeout: Duration) -> UpstreamClient {
        let mut c = HttpConnector::new();
        c.set_nodelay(true);
        c.set_connect_timeout(Some(connect_timeout));
        UpstreamClient(
            Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(MAX_IDLE)
                // `send_to` sets it, from a value the caller may have made once.
                .set_host(false)
                .build(c),
        )
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
        let url = uri.clone();
        let mut req = Request::new(Body::from(body));
        *req.method_mut() = method;
        *req.uri_mut() = uri;
        *req.headers_mut() = headers;
        match self.0.request(req).await {
            Ok(r) => Ok(Answer::from(r)),
            Err(e) => {
                // The client's own message is terse ("client error
                // (Connect)"); the causes say what happened.
                let mut detail = format!("{url}: {e}");
                let mut cause = e.source();
                while let Some(c) = cause {
                    detail.push_str(": ");
                    detail.push_str(&c.to_string());
                    cause = c.source();
                }
                Err(detail)
            }
        }
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

/// The Host header for requests to `uri`: its host and port (any user
/// information in the URL left out).
pub(crate) fn host_of(uri: &Uri) -> Option<HeaderValue> {
    let a = uri.authority()?;
    match a.port() {
        Some(p) => HeaderValue::from_str(&format!("{}:{p}", a.host())).ok(),
        None => HeaderValue::from_str(a.host()).ok(),
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
