//! Bad input (nothing forwarded, a clear 4xx in the OpenAI shape) and a bad
//! upstream (down, hanging, dying mid-stream: 502/504 or an SSE error
//! event, and the reservation released either way). Draining refuses 503.

use crate::common;

use common::*;
use futures::StreamExt;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::time::Duration;

async fn raw(g: &Gov, path: &str, body: Vec<u8>) -> (u16, Value) {
    let r = g
        .client
        .post(g.url(path))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_is_a_clear_4xx_and_never_forwarded() {
    let g = start(limits(1000, 100, 4, 4000), |s| {
        s.front.max_body_bytes = 64 << 10
    })
    .await;
    let cases: Vec<(&str, Vec<u8>, u16, Option<&str>)> = vec![
        ("/v1/completions", b"{not json".to_vec(), 400, None),
        ("/v1/completions", vec![0xff, 0xfe, 0x00], 400, None),
        ("/v1/completions", b"[]".to_vec(), 400, None),
        (
            "/v1/completions",
            br#"{"prompt": 12}"#.to_vec(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            br#"{"prompt": ""}"#.to_vec(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            br#"{"prompt": "x", "max_tokens": -1}"#.to_vec(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            br#"{"prompt": "x", "max_tokens": "many"}"#.to_vec(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            br#"{"prompt": "x", "n": 0}"#.to_vec(),
            400,
            Some("n"),
        ),
        (
            "/v1/completions",
            br#"{"prompt": "x", "stream": 1}"#.to_vec(),
            400,
            Some("stream"),
        ),
        (
            "/v1/chat/completions",
            br#"{"messages": []}"#.to_vec(),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            br#"{"messages": [{"role": 1}]}"#.to_vec(),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            br#"{"prompt": "x"}"#.to_vec(),
            400,
            Some("messages"),
        ),
    ];
    for (path, body, status, param) in cases {
        let shown = String::from_utf8_lossy(&body).to_string();
        let (s, v) = raw(&g, path, body).await;
        assert_eq!(s, status, "{shown}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{shown}: {v}");
        if let Some(p) = param {
            assert_eq!(v["error"]["param"], p, "{shown}: {v}");
        }
    }
    // Over the body limit: 413, with and without a content-length.
    let big = format!(r#"{{"prompt": "{}"}}"#, "a".repeat(100 << 10));
    let (s, v) = raw(&g, "/v1/completions", big.clone().into_bytes()).await;
    assert_eq!(s, 413, "{v}");
    assert_eq!(v["error"]["code"], "request_too_large");
    let stream = futures::stream::iter(
        big.into_bytes()
            .chunks(4096)
            .map(|c| Ok::<_, std::io::Error>(c.to_vec()))
            .collect::<Vec<_>>(),
    );
    // A fresh client: the governor closes that connection without reading the rest.
    let r = reqwest::Client::new()
        .post(g.url("/v1/completions"))
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(
        g.fake.requests.load(Ordering::SeqCst),
        0,
        "nothing was forwarded"
    );
    let m = g.metrics().await;
    assert!(
        m.contains(
            "envelope_governor_rejections_total{mode=\"single\",reason=\"invalid_request\"} 12"
        ),
        "{m}"
    );
    assert!(
        m.contains(
            "envelope_governor_rejections_total{mode=\"single\",reason=\"body_too_large\"} 2"
        ),
        "{m}"
    );
    assert_eq!(g.state().await["in_flight"]["requests"], 0);
}

/// An oversized body is read to its end before the 413: answered (and the
/// connection closed) while the client is still sending, the client would
/// get a broken pipe instead of the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_oversized_body_is_read_before_its_413() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let g = start(limits(1000, 100, 4, 4000), |s| {
        s.front.max_body_bytes = 64 << 10
    })
    .await;
    let mut c = tokio::net::TcpStream::connect(g.base.trim_start_matches("http://"))
        .await
        .unwrap();
    let len = 256usize << 10;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {len}\r\n\r\n"
    );
    c.write_all(head.as_bytes()).await.unwrap();
    c.write_all(&vec![b'a'; len / 2]).await.unwrap();
    // Half sent: no answer yet.
    let mut first = [0u8; 1];
    let early = tokio::time::timeout(Duration::from_millis(300), c.read(&mut first)).await;
    assert!(early.is_err(), "answered before the body ended: {early:?}");
    c.write_all(&vec![b'a'; len - len / 2]).await.unwrap();
    let mut answer = String::new();
    c.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    let body = &answer[answer.find("\r\n\r\n").unwrap() + 4..];
    let v: Value = serde_json::from_str(body).unwrap();
    assert_eq!(v["error"]["code"], "request_too_large", "{v}");
    assert_eq!(g.fake.requests.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_clients_time_out_with_408() {
    let g = start(limits(1000, 100, 4, 4000), |s| {
        s.front.body_timeout_ms = 200
    })
    .await;
    let stream = futures::stream::unfold(0, |i| async move {
        if i == 3 {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
        Some((Ok::<_, std::io::Error>(b"{ ".to_vec()), i + 1))
    });
    let r = g
        .client
        .post(g.url("/v1/completions"))
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 408);
    assert_eq!(g.fake.requests.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn upstream_down_is_502_and_releases() {
    // Token-id prompts need no /tokenize, so the first contact is the generation.
    let (fake, _) = fake_upstream().await;
    let g = start_with(
        fake,
        "http://127.0.0.1:9".into(),
        limits(1000, 100, 4, 4000),
        |_| {},
        Some(envelope_governor::TokenCounter::Estimate {
            bytes_per_token: 3.0,
        }),
    )
    .await;
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": [1, 2, 3], "max_tokens": 5}),
        )
        .await;
    assert_eq!(r.status(), 502);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "upstream_unreachable");
    let st = g.state().await;
    assert_eq!(st["in_flight"]["requests"], 0, "{st}");
    assert_eq!(st["in_flight"]["kv_tokens"], 0, "{st}");
    // A burst of upstream failures tightens the caps at the next reading.
    for _ in 0..2 {
        let r = g
            .post(
                "/v1/completions",
                json!({"prompt": [1, 2, 3], "max_tokens": 5}),
            )
            .await;
        assert_eq!(r.status(), 502);
    }
    let healthy = envelope_governor::Reading {
        ok: true,
        kv_usage: Some(0.1),
        ..Default::default()
    };
    assert_eq!(
        g.gov.observe(healthy),
        envelope_governor::Level::SmallContext
    );
    assert_eq!(g.state().await["ladder"]["cause"], "upstream_errors");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hanging_upstream_is_504_and_releases() {
    let g = start(limits(1000, 100, 4, 4000), |s| {
        s.timeouts.upstream_timeout_ms = 300
    })
    .await;
    g.fake.hang.store(true, Ordering::SeqCst);
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": [1, 2], "max_tokens": 5}),
        )
        .await;
    assert_eq!(r.status(), 504);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["code"],
        "upstream_timeout"
    );
    assert_eq!(g.state().await["in_flight"]["kv_tokens"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn upstream_dying_mid_stream_sends_an_sse_error_and_releases() {
    let g = start(limits(1000, 100, 4, 4000), |_| {}).await;
    g.fake.die_after_chunks.store(3, Ordering::SeqCst);
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": "hello", "max_tokens": 20, "stream": true}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let mut text = String::new();
    let mut s = r.bytes_stream();
    while let Some(Ok(c)) = s.next().await {
        text.push_str(&String::from_utf8_lossy(&c));
    }
    // The fake's last chunk before dying may be lost with its connection.
    let chunks = text.matches("\"text\":\"x\"").count();
    assert!((2..=3).contains(&chunks), "{text}");
    let last = text.trim_end().lines().last().unwrap();
    let ev: Value = serde_json::from_str(last.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(ev["error"]["code"], "upstream_stream_error", "{text}");
    let st = g.wait_state(|s| s["in_flight"]["requests"] == 0).await;
    assert_eq!(st["in_flight"]["kv_tokens"], 0);
    let m = g.metrics().await;
    assert!(
        m.contains("envelope_governor_upstream_errors_total{kind=\"upstream_stream_error\"} 1"),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn whole_answers_keep_their_length_and_a_cut_one_reads_as_broken() {
    let g = start(limits(1000, 100, 4, 4000), |_| {}).await;
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": "hello", "max_tokens": 20}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let len: usize = r.headers()["content-length"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let body = r.bytes().await.unwrap();
    assert_eq!(body.len(), len);
    serde_json::from_slice::<Value>(&body).expect("the whole answer");

    // The upstream dies half way through a whole (non-streaming) answer:
    // the client's read fails, rather than yield a short body that ends.
    g.fake.die_after_chunks.store(1, Ordering::SeqCst);
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": "hello", "max_tokens": 20}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert!(
        r.bytes().await.is_err(),
        "a cut answer must not read as whole"
    );
    let st = g.wait_state(|s| s["in_flight"]["requests"] == 0).await;
    assert_eq!(st["in_flight"]["kv_tokens"], 0);
    let m = g.metrics().await;
    assert!(
        m.contains("envelope_governor_upstream_errors_total{kind=\"upstream_stream_error\"} 1"),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn upstream_stalling_mid_stream_times_out_and_releases() {
    let g = start(limits(1000, 100, 4, 4000), |s| {
        s.timeouts.upstream_idle_timeout_ms = 300
    })
    .await;
    g.fake.stall_after_chunks.store(2, Ordering::SeqCst);
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": "hello", "max_tokens": 20, "stream": true}),
        )
        .await;
    let text = String::from_utf8_lossy(&r.bytes().await.unwrap()).to_string();
    assert!(text.contains("upstream_stream_timeout"), "{text}");
    assert_eq!(
        g.wait_state(|s| s["in_flight"]["requests"] == 0).await["in_flight"]["kv_tokens"],
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn draining_refuses_new_work_with_503_and_lets_in_flight_finish() {
    let g = start(limits(1000, 100, 4, 4000), |_| {}).await;
    g.fake.delay_per_token_ms.store(20, Ordering::SeqCst);
    let c = g.client.clone();
    let url = g.url("/v1/completions");
    let running = tokio::spawn(async move {
        let r = c
            .post(url)
            .json(&json!({"prompt": "a", "max_tokens": 10}))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.bytes().await.unwrap().len())
    });
    g.wait_state(|s| s["in_flight"]["requests"] == 1).await;
    g.gov.start_draining();
    let r = g
        .post("/v1/completions", json!({"prompt": "b", "max_tokens": 1}))
        .await;
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["code"],
        "draining"
    );
    assert!(g.gov.wait_idle(Duration::from_secs(5)).await);
    let (status, len) = running.await.unwrap();
    assert_eq!(status, 200);
    assert!(len > 0);
    assert_eq!(g.fake.requests.load(Ordering::SeqCst), 1);
}
