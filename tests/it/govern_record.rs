//! `envelope govern --record`: a line for every finished request, written
//! off the request path. At 2,000 requests/s for 30 s against a fast
//! loopback upstream none is lost; sessions and shared prefixes are kept
//! as ids, the prompt text never.

use crate::common::{self, tiers::profile, Governor};
use axum::routing::post;
use axum::{Json, Router};
use envelope_profile::trace::{Trace, TraceFormat};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

async fn completion(Json(v): Json<Value>) -> Json<Value> {
    let n = v["max_tokens"].as_u64().unwrap_or(1);
    Json(
        json!({"id": "c", "object": "chat.completion", "model": "fast",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x".repeat(n as usize)},
                     "finish_reason": "length"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}}),
    )
}

/// A fast OpenAI-shaped upstream in this process.
async fn fast_upstream() -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let app = Router::new()
        .route("/v1/completions", post(completion))
        .route("/v1/chat/completions", post(completion));
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    format!("http://{addr}")
}

/// A governor recording to `dir/record.jsonl` (removed first) in front of
/// `upstream`, with a one-bucket profile of `input` prompt tokens and
/// `seqs` sequences.
fn recording(
    dir: &std::path::Path,
    upstream: &str,
    input: u64,
    seqs: u64,
) -> (Governor, std::path::PathBuf) {
    let prof = profile(dir, "fast", input, 64, seqs);
    let path = dir.join("record.jsonl");
    let _ = std::fs::remove_file(&path);
    let gov = Governor::start(
        dir,
        &prof,
        upstream,
        &["--guard", "false", "--record", path.to_str().unwrap()],
    );
    (gov, path)
}

fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recording_at_2000_requests_a_second_for_30_s_loses_no_record() {
    let dir = common::temp_dir("envelope-record", "rate");
    let upstream = fast_upstream().await;
    let (gov, path) = recording(&dir, &upstream, 1024, 100_000);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(4096)
        .tcp_nodelay(true)
        .build()
        .unwrap();
    let url = gov.url("/v1/chat/completions");
    let (rate, secs) = (2000.0, 30.0);
    let total = (rate * secs) as u64;
    let answered = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(total as usize);
    for i in 0..total {
        let at = start + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(at.into()).await;
        let (c, u, a) = (client.clone(), url.clone(), answered.clone());
        let body = json!({"model": "fast", "max_tokens": 4,
            "messages": [{"role": "user", "content": format!("question {i}")}]});
        tasks.push(tokio::spawn(async move {
            if let Ok(r) = c.post(&u).json(&body).send().await {
                if r.bytes().await.is_ok() {
                    a.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let answered = answered.load(Ordering::Relaxed);
    assert!(
        answered as f64 >= 0.99 * total as f64,
        "{answered} of {total} answered"
    );
    let lines = common::lines_when(&path, answered as usize).await;
    let m = gov.metrics_page().await;
    assert_eq!(metric(&m, "envelope_governor_records_dropped_total"), 0);
    assert_eq!(
        metric(&m, "envelope_governor_records_written_total"),
        answered
    );
    assert_eq!(lines.len() as u64, answered, "a line per answered request");
    let trace = Trace::parse("r", &lines.join("\n"), TraceFormat::Envelope).unwrap();
    assert!(trace
        .requests
        .iter()
        .all(|r| r.status == Some(200) && r.output_tokens == 4));
    // The load was offered at the rate, as the governor saw it arrive (its
    // own arrival times, not the client's clock): a stalled client, whose
    // requests bunch up late, would stretch the span.
    assert!(
        trace.span_s() < secs * 1.2 && trace.requests.len() as f64 / trace.span_s() > rate / 1.2,
        "{} requests over {:.1} s",
        trace.requests.len(),
        trace.span_s()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_prefixes_and_refusals_are_recorded_without_text() {
    let dir = common::temp_dir("envelope-record", "sessions");
    let upstream = fast_upstream().await;
    // Prompts up to 16,384 tokens: the long one is refused (400) after
    // counting.
    let (gov, path) = recording(&dir, &upstream, 16_384, 8);
    let system = "Follow the house style guide to the letter. ".repeat(60);
    let client = reqwest::Client::new();
    let mut statuses = vec![];
    for (i, user) in ["first", "second", "third"].iter().enumerate() {
        let r = client
            .post(gov.url("/v1/chat/completions"))
            .header("x-envelope-conversation", "run-7")
            .header("x-envelope-feature", "agent")
            .json(&json!({"model": "fast", "max_tokens": 3 + i,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": format!("{user} secret-{i}")}]}))
            .send()
            .await
            .unwrap();
        statuses.push(r.status().as_u16());
    }
    let long = "word ".repeat(40_000);
    let r = client
        .post(gov.url("/v1/chat/completions"))
        .json(&json!({"model": "fast", "max_tokens": 7,
            "messages": [{"role": "user", "content": long}]}))
        .send()
        .await
        .unwrap();
    statuses.push(r.status().as_u16());
    assert_eq!(statuses[..3], [200, 200, 200]);
    assert!(statuses[3] >= 400, "{statuses:?}");
    let lines = common::lines_when(&path, 4).await;
    assert_eq!(lines.len(), 4, "{lines:?}");
    let text = lines.join("\n");
    assert!(!text.contains("secret") && !text.contains("house style"));
    let t = Trace::parse("r", &text, TraceFormat::Envelope).unwrap();
    let run: Vec<_> = t
        .requests
        .iter()
        .filter(|r| r.session.as_deref() == Some("run-7"))
        .collect();
    assert_eq!(run.len(), 3);
    // The system prompt's whole blocks are one shared prefix; the block
    // holding the user's words differs.
    let first = &run[0].prefix_blocks;
    assert!(first.len() >= 2, "{first:?}");
    for r in &run[1..] {
        assert_eq!(r.prefix_blocks[0], first[0]);
        assert_ne!(r.prefix_blocks.last(), first.last());
        assert_eq!(r.feature.as_deref(), Some("agent"));
    }
    assert_eq!(
        run.iter().map(|r| r.output_tokens).collect::<Vec<_>>(),
        [3, 4, 5]
    );
    // The refused one: its status, and the output it asked for.
    let refused = t.requests.iter().find(|r| r.session.is_none()).unwrap();
    assert_eq!(refused.status, Some(statuses[3]));
    assert_eq!(refused.output_tokens, 7);
    assert!(refused.input_tokens > 16_384);
}
