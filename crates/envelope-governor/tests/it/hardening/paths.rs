//! The upstream's other paths: only allowlisted GETs reach it, with keys
//! every forwarded route needs one, no dot segments, no redirects.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn only_allowlisted_get_paths_reach_the_upstream() {
    let g = start(limits(1000, 10, 4, 4000), |_| {}).await;
    for path in ["/metrics/", "/debug/pprof", "/v1/../admin", "/server-info"] {
        let r = g.client.get(g.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 404, "{path}");
    }
    assert_eq!(g.fake.other_hits.load(Ordering::SeqCst), 0);
    let r = g.client.get(g.url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

/// The status of a GET of `path` through `g`, with `key` as the bearer.
async fn status_of_get(g: &Gov, path: &str, key: Option<&str>) -> u16 {
    let mut r = g.client.get(g.url(path));
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    r.send().await.unwrap().status().as_u16()
}

/// With API keys configured, every route the governor forwards needs a
/// known key, not only the completion endpoints; health, readiness and
/// metrics stay public (a kubelet and Prometheus send no key) unless the
/// public paths say otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_keys_every_forwarded_route_needs_one() {
    let t = tenants("[tenants.alice]\napi_keys = [\"sk-alice\"]\n");
    let g = start(limits(1000, 10, 4, 4000), move |s| s.tenants = t).await;
    let get = |path: &'static str, key: Option<&'static str>| status_of_get(&g, path, key);
    for key in [None, Some("sk-mallory")] {
        assert_eq!(get("/v1/models", key).await, 401, "{key:?}");
        assert_eq!(get("/version", key).await, 401, "{key:?}");
        let r = g.client.post(g.url("/tokenize"));
        let r = match key {
            Some(k) => r.bearer_auth(k),
            None => r,
        };
        let r = r.json(&json!({"prompt": "a"})).send().await.unwrap();
        assert_eq!(r.status(), 401, "{key:?}");
    }
    assert_eq!(g.fake.tokenize_calls.load(Ordering::SeqCst), 0);
    assert_eq!(g.fake.other_hits.load(Ordering::SeqCst), 0);
    assert_eq!(get("/v1/models", Some("sk-alice")).await, 200);
    // Public by default: probes and the scrape, without a key.
    for path in ["/health", "/healthz", "/ready", "/metrics"] {
        assert_eq!(get(path, None).await, 200, "{path}");
    }
    assert_eq!(g.fake.other_hits.load(Ordering::SeqCst), 3);

    // Public paths narrowed: /metrics then needs a key too.
    let t = tenants("[tenants.alice]\napi_keys = [\"sk-alice\"]\n");
    let g = start(limits(1000, 10, 4, 4000), move |s| {
        s.tenants = t;
        s.front.public_paths = vec!["/health".into()];
    })
    .await;
    let get = |path: &'static str, key: Option<&'static str>| status_of_get(&g, path, key);
    assert_eq!(get("/metrics", None).await, 401);
    assert_eq!(get("/ready", None).await, 401);
    assert_eq!(get("/metrics", Some("sk-alice")).await, 200);
    assert_eq!(get("/health", None).await, 200);
}

/// A GET on raw bytes (reqwest would normalise dot segments away first).
async fn raw_get(base: &str, path: &str) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = base.trim_start_matches("http://");
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
    c.write_all(head.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    c.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8_lossy(&out);
    text.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("{text}"))
}

/// A path is decoded before it is judged: `/v1/models/%2e%2e/%2e%2e/x`
/// matches `/v1/models/*` as written but is `/x` to a server that decodes
/// it, so a `.` or `..` segment, encoded or not, is refused; a model name
/// with an encoded slash still passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dot_segments_are_refused_after_decoding() {
    let g = start(limits(1000, 10, 4, 4000), |_| {}).await;
    for path in [
        "/v1/models/%2e%2e/%2e%2e/debug",
        "/v1/models/%2E%2E/x",
        "/v1/models/../../debug",
        "/v1/models/./x",
        "/v1/models/%2e/x",
    ] {
        assert_eq!(raw_get(&g.base, path).await, 400, "{path}");
    }
    assert_eq!(g.fake.other_hits.load(Ordering::SeqCst), 0);
    assert_eq!(raw_get(&g.base, "/v1/models/org%2Fname").await, 200);
    assert_eq!(g.fake.other_hits.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redirects_are_not_followed() {
    let g = start(limits(1000, 10, 4, 4000), |_| {}).await;
    g.fake.redirect.store(true, Ordering::SeqCst);
    // A client that does not follow redirects either, to see what came back.
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let r = client
        .post(g.url("/v1/completions"))
        .json(&json!({"prompt": "a", "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 307);
    assert_eq!(g.fake.elsewhere_hits.load(Ordering::SeqCst), 0);
}
