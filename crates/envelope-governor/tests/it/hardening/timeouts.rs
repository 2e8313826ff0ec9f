//! Connections, headers and requests held open: each is cut at its
//! timeout or waits behind the connection cap.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn headers_that_never_finish_are_cut() {
    let g = start(limits(1000, 10, 4, 4000), |s| {
        s.front.header_read_timeout_ms = 300
    })
    .await;
    let addr = g.base.trim_start_matches("http://").to_string();
    let mut sock = tokio::net::TcpStream::connect(&addr).await.unwrap();
    sock.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    let t0 = Instant::now();
    let mut buf = vec![0u8; 1024];
    let read = tokio::time::timeout(Duration::from_secs(5), async {
        // Until the governor closes the connection (a 408, then EOF).
        loop {
            match sock.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(read.is_ok(), "the connection is still open after 5 s");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connections_past_the_cap_wait() {
    let g = start(limits(1000, 10, 4, 4000), |s| s.front.max_connections = 1).await;
    let addr = g.base.trim_start_matches("http://").to_string();
    // One client holds the only connection open (keep-alive, idle).
    let mut held = tokio::net::TcpStream::connect(&addr).await.unwrap();
    held.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    assert!(held.read(&mut buf).await.unwrap() > 0);
    let quick = reqwest::Client::builder()
        .timeout(Duration::from_millis(700))
        .build()
        .unwrap();
    assert!(quick.get(g.url("/metrics")).send().await.is_err());
    drop(held);
    let r = reqwest::Client::new()
        .get(g.url("/metrics"))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// A listener whose accept queue is full: connecting to it hangs.
async fn unconnectable() -> (tokio::net::TcpListener, Vec<tokio::net::TcpStream>, String) {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let l = sock.listen(1).unwrap();
    let addr = l.local_addr().unwrap();
    let mut held = vec![];
    for _ in 0..16 {
        match tokio::time::timeout(
            Duration::from_millis(300),
            tokio::net::TcpStream::connect(addr),
        )
        .await
        {
            Ok(Ok(s)) => held.push(s),
            _ => break,
        }
    }
    (l, held, format!("http://{addr}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upstream_that_never_accepts_fails_at_the_connect_timeout() {
    let (_l, _held, upstream) = unconnectable().await;
    let (fake, _) = fake_upstream().await;
    let g = start_with(
        fake,
        upstream.clone(),
        limits(1000, 10, 4, 4000),
        |s| {
            s.timeouts.connect_timeout_ms = 300;
            s.timeouts.upstream_timeout_ms = 20_000;
        },
        estimate(),
    )
    .await;
    let t0 = Instant::now();
    let r = g
        .post("/v1/completions", json!({"prompt": "a", "max_tokens": 1}))
        .await;
    assert_eq!(r.status(), 502);
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    // The client's body does not name the upstream.
    let text = r.text().await.unwrap();
    let port = upstream.rsplit(':').next().unwrap();
    assert!(
        !text.contains(port) && !text.contains("127.0.0.1"),
        "{text}"
    );
    assert_eq!(g.state().await["in_flight"]["requests"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_ends_at_its_lifetime() {
    let g = start(limits(1000, 100, 4, 4000), |s| {
        s.timeouts.max_request_ms = 800
    })
    .await;
    g.fake.delay_per_token_ms.store(100, Ordering::SeqCst);
    let t0 = Instant::now();
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 40, "stream": true}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(text.contains("request_lifetime"), "{text}");
    assert!(
        t0.elapsed() < Duration::from_millis(2500),
        "{:?}",
        t0.elapsed()
    );
    let st = g.wait_state(|s| s["in_flight"]["requests"] == 0).await;
    assert_eq!(st["in_flight"]["requests"], 0, "{st}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_lifetime_ends_a_relay_whose_upstream_never_waits() {
    // An upstream body that always has its next chunk at hand: the relay
    // never waits on it (so never on its timer), and must still end the
    // answer at the request's lifetime.
    let g = start(limits(1000, 100, 4, 4000), |s| {
        s.timeouts.max_request_ms = 300
    })
    .await;
    let state =
        envelope_governor::GovernedUpstream::new(g.gov.clone(), &g.upstream, estimate().unwrap());
    let endless = futures::stream::repeat_with(|| {
        Ok::<_, std::io::Error>(axum::body::Bytes::from_static(b"x"))
    });
    let upstream = axum::http::Response::builder()
        .header("content-type", "application/json")
        .body(axum::body::Body::from_stream(endless))
        .unwrap();
    let answer = envelope_governor::relay(&state, envelope_governor::Answer::from(upstream), None);
    let mut body = answer.into_body().into_data_stream();
    let t0 = Instant::now();
    let mut ended = false;
    while t0.elapsed() < Duration::from_secs(10) {
        match body.next().await {
            Some(Ok(_)) => {}
            // A whole body cut short ends in an error.
            Some(Err(_)) | None => {
                ended = true;
                break;
            }
        }
    }
    assert!(ended, "still relaying after {:?}", t0.elapsed());
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}
