//! `envelope govern` enforcing the whole measured envelope in front of real
//! `envelope serve` upstreams (dummy:tiny): each request is charged its
//! bucket's share of the node, so short requests get the concurrency
//! measured for them and a mix stays inside the envelope; a server without
//! `/metrics` is served, not bricked; a server slower than its profile is
//! held to the SLOs by the latency guard, the excess getting 429 with
//! Retry-After.

use crate::common;

use common::{Governor, Server, SlowServer};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// dummy:tiny counts a byte per token: "hello " is 6 tokens.
const SHORT_WORDS: usize = 8; // 48 tokens
const SHORT_OUT: u64 = 16; // 48 + 16 = 64: the 48x16 bucket
const LONG_WORDS: usize = 33; // 198 tokens
const LONG_OUT: u64 = 56; // 198 + 56 = 254: the 200x56 bucket

/// A v2 profile: `rows` are (input, output, safe concurrency, TTFT p95 ms).
fn profile(rows: &[(u64, u64, u64, f64)], kv_tokens: u64, slo: Value) -> Value {
    let buckets: Vec<Value> = rows
        .iter()
        .map(|&(i, o, safe, ttft)| {
            json!({"input_tokens": i, "output_tokens": o, "safe_concurrency": safe,
                   "kv_tokens": safe * (i + o), "ttft_p95_ms": ttft})
        })
        .collect();
    let largest = rows.iter().map(|r| r.0 + r.1).max().unwrap();
    let out = rows.iter().map(|r| r.1).max().unwrap();
    let most = rows.iter().map(|r| r.2).max().unwrap();
    json!({
        "schema": "envelope.profile/v2",
        "created_unix_ms": 1,
        "fingerprint": {"schema": 1, "model": {"kind": "dummy", "preset": "tiny", "seed": 0},
                        "node": {"gpus": []}},
        "slo": slo,
        "configs": [],
        "selected": "dummy-tiny",
        "limits": {"max_context_tokens": largest, "max_output_tokens": out,
                   "max_concurrent_seqs": most, "max_kv_tokens_in_flight": kv_tokens,
                   "buckets": buckets},
        "probes_total": 0
    })
}

fn no_slo() -> Value {
    json!({"ttft_p95_ms": null, "itl_p95_ms": null, "e2e_p99_ms": null})
}

fn temp_dir(name: &str) -> PathBuf {
    common::temp_dir("envelope-genv", name)
}

/// The governor in front of `upstream` with profile `p`, written into `dir`.
fn govern(dir: &Path, p: &Value, upstream: &str, extra: &[&str]) -> Governor {
    let path = dir.join("profile.json");
    std::fs::write(&path, p.to_string()).unwrap();
    Governor::start(dir, &path, upstream, extra)
}

/// One request as the client saw it.
#[derive(Debug, Clone, Default)]
struct Outcome {
    status: u16,
    retry_after: Option<u64>,
    reason: String,
    ttft_ms: f64,
    /// Mean gap between events after the first.
    itl_ms: f64,
    tokens: u64,
    started: Duration,
}

/// A streamed completion of `words` "hello "s and `max_tokens`.
async fn stream(
    client: &reqwest::Client,
    base: &str,
    words: usize,
    max_tokens: u64,
    t0: Instant,
) -> Outcome {
    let started = t0.elapsed();
    let sent = Instant::now();
    let body = json!({"model": "dummy:tiny", "prompt": "hello ".repeat(words), "max_tokens": max_tokens,
                      "temperature": 0, "ignore_eos": true, "stream": true});
    let mut r = match client
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
    {
        Ok(r) => r,
        Err(_) => {
            return Outcome {
                status: 599,
                started,
                ..Default::default()
            }
        }
    };
    let mut o = Outcome {
        status: r.status().as_u16(),
        retry_after: r
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()?.parse().ok()),
        reason: r
            .headers()
            .get("x-envelope-reason")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string(),
        started,
        ..Default::default()
    };
    let (mut first, mut last, mut events) = (None, None, 0u64);
    let mut pending = String::new();
    while let Ok(Some(chunk)) = r.chunk().await {
        let now = Instant::now();
        pending.push_str(&String::from_utf8_lossy(&chunk));
        // Whole SSE lines only; a token is an event whose choice has text.
        while let Some(end) = pending.find('\n') {
            let line: String = pending.drain(..=end).collect();
            let Some(data) = line.trim().strip_prefix("data: ") else {
                continue;
            };
            let v: Value = serde_json::from_str(data).unwrap_or(Value::Null);
            let has_text = v["choices"][0]["text"]
                .as_str()
                .is_some_and(|t| !t.is_empty());
            if has_text {
                first.get_or_insert(now);
                last = Some(now);
                events += 1;
            }
        }
    }
    if let (Some(a), Some(b)) = (first, last) {
        o.ttft_ms = (a - sent).as_secs_f64() * 1000.0;
        if events > 1 {
            o.itl_ms = (b - a).as_secs_f64() * 1000.0 / (events - 1) as f64;
        }
    }
    o.tokens = events;
    o
}

/// `workers` closed-loop clients for `secs` seconds; worker i sends long
/// requests when `long(i)`, else short ones.
async fn closed_loop(
    base: &str,
    workers: usize,
    secs: u64,
    long: impl Fn(usize) -> bool,
) -> Vec<Outcome> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()
        .unwrap();
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs(secs);
    let tasks: Vec<_> = (0..workers)
        .map(|i| {
            let (client, base, is_long) = (client.clone(), base.to_string(), long(i));
            tokio::spawn(async move {
                let mut out = vec![];
                while Instant::now() < end {
                    let o = if is_long {
                        stream(&client, &base, LONG_WORDS, LONG_OUT, t0).await
                    } else {
                        stream(&client, &base, SHORT_WORDS, SHORT_OUT, t0).await
                    };
                    if let Some(ra) = o.retry_after.filter(|_| o.status == 429) {
                        // Back off as a client honouring Retry-After would,
                        // but no longer than the run has left.
                        let wait = Duration::from_secs(ra)
                            .min(end.saturating_duration_since(Instant::now()));
                        tokio::time::sleep(wait.min(Duration::from_millis(500))).await;
                    }
                    out.push(o);
                }
                out
            })
        })
        .collect();
    let mut all = vec![];
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

/// Polls /admin/state until `stop`; returns the samples.
fn sample_state(base: String, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Vec<Value>> {
    tokio::spawn(async move {
        let client = reqwest::Client::new();
        let mut out = vec![];
        while !stop.load(Ordering::SeqCst) {
            if let Ok(r) = client.get(format!("{base}/admin/state")).send().await {
                if let Ok(v) = r.json::<Value>().await {
                    out.push(v);
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        out
    })
}

fn bucket_seqs(state: &Value, label: &str) -> u64 {
    state["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["bucket"] == label)
        .map(|b| b["sequences"].as_u64().unwrap())
        .unwrap_or(0)
}

fn p95(mut v: Vec<f64>) -> f64 {
    envelope_profile::stats::nearest_rank(&mut v, 0.95).expect("samples")
}

/// 1024 tokens of f32 KV for dummy:tiny (512 bytes a token).
const KV_POOL: &str = "512KiB";
const KV_POOL_BYTES: usize = 512 << 10;

/// Short requests reach the concurrency measured for their bucket (not the
/// long bucket's), a 50/50 mix stays inside the envelope, and the server
/// never preempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_request_gets_its_buckets_share_of_the_envelope() {
    let server = Server::start(&[
        "--model",
        "dummy:tiny",
        "--kv-cache-bytes",
        KV_POOL,
        "--max-num-seqs",
        "64",
    ]);
    let dir = temp_dir("shares");
    // Short safe at 12, long at 3: 4x apart. 12 x 64 = 3 x 256 = 768 KV
    // tokens. SLOs a hundred times what dummy:tiny needs: they must hold.
    let (ttft_slo, itl_slo) = (5000.0, 1000.0);
    let slo = json!({"ttft_p95_ms": ttft_slo, "itl_p95_ms": itl_slo, "e2e_p99_ms": null});
    let p = profile(&[(48, 16, 12, 50.0), (200, 56, 3, 80.0)], 1000, slo);
    let gov = govern(&dir, &p, &server.base, &["--guard-interval-ms", "200"]);
    let preempted = server.metric("envelope:num_preemptions_total").await;

    // Short only: 16 closed-loop workers, more than the 12 the bucket allows.
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample_state(gov.base.clone(), stop.clone());
    let short = closed_loop(&gov.base, 16, 3, |_| false).await;
    stop.store(true, Ordering::SeqCst);
    let states = sampler.await.unwrap();
    let most = states
        .iter()
        .map(|s| bucket_seqs(s, "48x16"))
        .max()
        .unwrap_or(0);
    let ok = short.iter().filter(|o| o.status == 200).count();
    assert!(ok > 16, "{short:?}");
    for o in short.iter().filter(|o| o.status == 200) {
        assert_eq!(o.tokens, SHORT_OUT, "{o:?}");
    }
    // At least 90% of the short bucket's safe concurrency in flight (the
    // old single limit, the long bucket's 3, would cap it at 3), never more.
    assert!(most >= 11, "at most {most} short sequences in flight");
    assert!(states.iter().all(|s| bucket_seqs(s, "48x16") <= 12));
    assert!(states
        .iter()
        .all(|s| s["in_flight"]["envelope_share"].as_f64().unwrap() <= 1.0 + 1e-9));

    // A 50/50 mix: both shapes in flight together, the sum of their shares
    // within the envelope, every admitted answer whole.
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample_state(gov.base.clone(), stop.clone());
    let mixed = closed_loop(&gov.base, 16, 4, |i| i % 2 == 1).await;
    stop.store(true, Ordering::SeqCst);
    let states = sampler.await.unwrap();
    assert!(
        states
            .iter()
            .any(|s| bucket_seqs(s, "48x16") > 0 && bucket_seqs(s, "200x56") > 0),
        "the two shapes never shared the node"
    );
    for s in &states {
        let (short, long) = (
            bucket_seqs(s, "48x16") as f64,
            bucket_seqs(s, "200x56") as f64,
        );
        assert!(short / 12.0 + long / 3.0 <= 1.0 + 1e-9, "{s}");
    }
    for o in mixed.iter().filter(|o| o.status == 200) {
        assert!(o.tokens == SHORT_OUT || o.tokens == LONG_OUT, "{o:?}");
    }
    let admitted: Vec<&Outcome> = mixed.iter().filter(|o| o.status == 200).collect();
    let ttft = p95(admitted.iter().map(|o| o.ttft_ms).collect());
    let itl = p95(admitted.iter().map(|o| o.itl_ms).collect());
    assert!(
        ttft <= ttft_slo && itl <= itl_slo,
        "TTFT p95 {ttft} ms, ITL p95 {itl} ms"
    );
    let longs = mixed
        .iter()
        .filter(|o| o.status == 200 && o.tokens == LONG_OUT)
        .count();
    assert!(longs > 0, "{mixed:?}");
    // No refusals for good: anything not admitted was told to retry.
    assert!(
        mixed
            .iter()
            .chain(&short)
            .all(|o| o.status == 200 || o.status == 429),
        "{mixed:?}"
    );
    assert_eq!(
        server.metric("envelope:num_preemptions_total").await - preempted,
        0.0,
        "the governed server preempted"
    );
    let m = reqwest::get(format!("{}/metrics", gov.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        m.contains("envelope_governor_bucket_sequences{bucket=\"48x16\"}"),
        "{m}"
    );
    drop(gov);
    let _ = std::fs::remove_dir_all(dir);
}

/// A server without Prometheus metrics: the governor says so at start and
/// serves every request (no 4xx or 429 from the guard) well past the
/// staleness limits that would have fired before.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upstream_without_metrics_is_served() {
    let server = Server::start(&["--model", "dummy:tiny", "--kv-cache-bytes", KV_POOL]);
    let dir = temp_dir("nometrics");
    let p = profile(&[(48, 16, 4, 50.0), (200, 56, 2, 80.0)], 1000, no_slo());
    // The upstream's 404 path stands for its missing /metrics.
    let url = format!("{}/no-metrics-here", server.base);
    let gov = govern(
        &dir,
        &p,
        &server.base,
        &["--guard-interval-ms", "100", "--guard-metrics-url", &url],
    );
    let client = reqwest::Client::new();
    let t0 = Instant::now();
    let mut statuses = vec![];
    // 6 s: past the ladder's 5 s staleness limit.
    while t0.elapsed() < Duration::from_secs(6) {
        let o = stream(&client, &gov.base, SHORT_WORDS, SHORT_OUT, t0).await;
        statuses.push(o.status);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    let st = gov.state().await;
    assert_eq!(st["ladder"]["level"], "normal", "{st}");
    let log = gov.log();
    assert!(
        log.contains("no usable metrics at")
            && log.contains("missing signals kv_usage and preemptions"),
        "{log}"
    );
    drop(gov);
    let _ = std::fs::remove_dir_all(dir);
}

/// A server slower than the one its profile was measured on (each step
/// sleeps 8 ms per sequence, so latency grows with the batch) governed with
/// the fast one's profile: the latency guard lowers the admitted share
/// until admitted requests meet the ITL and TTFT SLOs, and the excess gets
/// 429 with Retry-After.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_latency_guard_holds_a_slow_upstream_to_the_slos() {
    let server = SlowServer::start(KV_POOL_BYTES, 64, 8).await;
    let dir = temp_dir("slow");
    // Measured "fast": short requests safe at 12. Here 12 in flight make
    // every step ~96 ms, 5 make ~40 ms.
    let (ttft_slo, itl_slo) = (1500.0, 45.0);
    let slo = json!({"ttft_p95_ms": ttft_slo, "itl_p95_ms": itl_slo, "e2e_p99_ms": null});
    let p = profile(&[(48, 16, 12, 100.0)], 1000, slo);
    let gov = govern(&dir, &p, &server.base, &["--guard-interval-ms", "200"]);
    let run = closed_loop(&gov.base, 24, 16, |_| false).await;
    let st = gov.state().await;
    let share = st["latency_guard"]["share"].as_f64().unwrap();
    assert!(share < 0.7, "the guard did not lower the share: {st}");
    let cause = st["latency_guard"]["cause"].as_str().unwrap();
    assert!(
        ["itl_p95", "ttft_p95", "recovering", "slo_met"].contains(&cause),
        "{st}"
    );
    // Requests started in the last half, after the guard settled.
    let late: Vec<&Outcome> = run
        .iter()
        .filter(|o| o.started >= Duration::from_secs(8))
        .collect();
    let ok: Vec<&Outcome> = late.iter().copied().filter(|o| o.status == 200).collect();
    assert!(ok.len() >= 10, "{late:?}");
    let itl = p95(ok.iter().map(|o| o.itl_ms).collect());
    let ttft = p95(ok.iter().map(|o| o.ttft_ms).collect());
    eprintln!(
        "slow upstream: share {share:.2}, admitted {} of {} late requests, ITL p95 {itl:.1} ms (SLO {itl_slo}), TTFT p95 {ttft:.0} ms (SLO {ttft_slo})",
        ok.len(),
        late.len()
    );
    assert!(itl <= itl_slo, "ITL p95 {itl:.1} ms over the SLO");
    assert!(ttft <= ttft_slo, "TTFT p95 {ttft:.0} ms over the SLO");
    // The excess was told to come back, never refused for good.
    let refused: Vec<&Outcome> = run.iter().filter(|o| o.status != 200).collect();
    assert!(!refused.is_empty(), "nothing was shed");
    for o in &refused {
        assert_eq!(o.status, 429, "{o:?}");
        assert!(
            o.retry_after.is_some_and(|r| (1..=60).contains(&r)),
            "{o:?}"
        );
        assert!(
            [
                "ttft_budget",
                "queue_timeout",
                "queue_full",
                "guard_tightened"
            ]
            .contains(&o.reason.as_str()),
            "{o:?}"
        );
    }
    drop(gov);
    let _ = std::fs::remove_dir_all(dir);
}

/// The ladder, from a real server's KV use: while another client's long
/// request holds over 90% of the server's KV pool, a request that fits the
/// profile but not the halved caps gets 429 with Retry-After (a temporary
/// refusal, not a 400); what can never fit the profile is still a 400; once
/// the pool frees, the same request is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ladder_tightening_from_a_real_servers_kv_answers_429() {
    // 64 blocks of 16 tokens; each step sleeps 100 ms, so the long request
    // below holds its blocks for seconds on any machine.
    let server = SlowServer::start(KV_POOL_BYTES, 64, 100).await;
    let dir = temp_dir("ladder");
    let p = profile(&[(48, 16, 4, 50.0), (200, 56, 2, 80.0)], 1000, no_slo());
    let gov = govern(&dir, &p, &server.base, &["--guard-interval-ms", "100"]);
    let client = reqwest::Client::new();
    let t0 = Instant::now();
    // Straight at the server (past the governor, as another client of the
    // node would): 930 prompt tokens + 40 = 61 of 64 blocks by the end,
    // 59 (92%) from the prefill on.
    let direct = {
        let (client, base) = (client.clone(), server.base.clone());
        tokio::spawn(async move { stream(&client, &base, 155, 40, t0).await })
    };
    let st = gov
        .wait_state(Duration::from_secs(120), |s| {
            s["ladder"]["level"] == "small_context"
        })
        .await;
    assert_eq!(st["ladder"]["cause"], "kv_usage", "{st}");
    // 198 + 56 fits the profile's 254, not today's halved 127.
    let o = stream(&client, &gov.base, LONG_WORDS, LONG_OUT, t0).await;
    assert_eq!(o.status, 429, "{o:?}");
    assert_eq!(o.reason, "guard_tightened");
    assert!(matches!(o.retry_after, Some(1..=60)), "{o:?}");
    // Beyond the profile itself (300 prompt tokens of 254): 400, whatever
    // the ladder says.
    let r = client
        .post(gov.url("/v1/completions"))
        .json(&json!({"prompt": "hello ".repeat(50), "max_tokens": 8}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    let d = direct.await.unwrap();
    assert_eq!((d.status, d.tokens), (200, 40), "{d:?}");
    gov.wait_state(Duration::from_secs(120), |s| {
        s["ladder"]["level"] == "normal"
    })
    .await;
    let o = stream(&client, &gov.base, LONG_WORDS, LONG_OUT, t0).await;
    assert_eq!((o.status, o.tokens), (200, LONG_OUT), "{o:?}");
    drop(gov);
    let _ = std::fs::remove_dir_all(dir);
}
