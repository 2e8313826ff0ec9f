//! Budgets over time (`--budgets`), black-box: requests and
//! tokens per minute reserved at admission and settled at the end, 429
//! with Retry-After from the refill time, `x-ratelimit-*` headers; shared
//! by three governor replicas through a real `redis-server`; Redis stopped
//! mid-run (fail open or closed per budget, then recovery); shadow mode.

use crate::common;

use common::redis::Redis;
use common::tiers::{chat, dummy, profile, Answer};
use common::{temp_dir, Governor};
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

/// The Redis tests start several processes each: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `n` governors, each in its own directory under `root`, sharing the
/// budgets in the Redis at `url`. These tests check the decisions, not
/// the store's deadline: the default 50 ms is shorter than a busy 2-core
/// CI machine can promise, and a decision past it fails open (every call
/// admitted), so they allow 5 s and [`no_store_errors`] says if one ran out.
fn replicas(n: usize, root: &Path, upstream: &str, budgets: &str, url: &str) -> Vec<Governor> {
    (0..n)
        .map(|i| {
            let dir = root.join(format!("g{i}"));
            let args = ["--budget-store", url, "--budget-store-timeout-ms", "5000"];
            govern(&dir, upstream, budgets, &args)
        })
        .collect()
}

/// Fails naming the store when a replica's budget decision did not reach
/// Redis (it then failed open, and the counts below it mean nothing).
async fn no_store_errors(gs: &[Governor]) {
    for g in gs {
        let text = g.metrics_page().await;
        let errors: f64 = text
            .lines()
            .filter(|l| l.starts_with("envelope_governor_budget_store_errors_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        assert_eq!(errors, 0.0, "a budget decision missed Redis: {}", g.log());
    }
}

fn govern(dir: &Path, upstream: &str, budgets: &str, extra: &[&str]) -> Governor {
    std::fs::create_dir_all(dir).unwrap();
    let p = profile(dir, "p", 256, 64, 8);
    let b = dir.join("budgets.toml");
    std::fs::write(&b, budgets).unwrap();
    let mut args = vec!["--budgets", b.to_str().unwrap(), "--guard", "false"];
    args.extend_from_slice(extra);
    Governor::start(dir, &p, upstream, &args)
}

/// A call to the `tiny` upstream of `max_tokens` (all of them generated).
fn ask(text: &str, max_tokens: u64) -> Value {
    let mut b = common::tiers::ask(text, max_tokens);
    b["model"] = json!("tiny");
    b
}

/// Output tokens the upstream generated for the client (`usage`, at the
/// end of a body or of a stream).
async fn call(g: &Governor, stream: bool, key: Option<&str>) -> (u16, u64, Answer) {
    let mut body = ask("count to ten", 16);
    body["stream"] = json!(stream);
    body["stream_options"] = json!({"include_usage": stream});
    let mut r = reqwest::Client::new()
        .post(g.url("/v1/chat/completions"))
        .json(&body);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let resp = r.send().await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = resp.text().await.unwrap_or_default();
    let (tokens, body) = if stream && status == 200 {
        // The upstream's own count, in the last event before `[DONE]`.
        let n = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .find_map(|v| v["usage"]["completion_tokens"].as_u64())
            .expect("the stream ends with its usage");
        (n, Value::Null)
    } else {
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        (v["usage"]["completion_tokens"].as_u64().unwrap_or(0), v)
    };
    (
        status,
        tokens,
        Answer {
            status,
            headers,
            body,
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_process_budgets_refuse_with_the_refill_time_and_refund_failures() {
    let up = dummy(0, "tiny");
    let dir = temp_dir("envelope-budgets", "local");
    let g = govern(
        &dir,
        &up.base,
        r#"
[tenants.default]
requests_per_minute = 3
output_tokens_per_minute = 1000
[features.tiny]
output_tokens_per_minute = 10
[features.small]
output_tokens_per_minute = 40
"#,
        &[],
    );
    // The upstream refuses this one (logprobs): the request counts, its
    // 16 output tokens go back.
    let mut bad = ask("hello", 16);
    bad["logprobs"] = json!(true);
    let a = chat(&g, bad, &[]).await;
    assert_eq!(a.status, 400, "{:?}", a.body);
    let (status, tokens, a) = call(&g, false, None).await;
    assert_eq!(status, 200, "{:?}", a.body);
    assert_eq!(tokens, 16);
    assert_eq!(a.header("x-ratelimit-limit-requests"), "3");
    assert_eq!(a.header("x-ratelimit-remaining-requests"), "1");
    let out_left: f64 = a
        .header("x-ratelimit-remaining-output-tokens")
        .parse()
        .unwrap();
    assert!((984.0..990.0).contains(&out_left), "{out_left}");
    // Without max_tokens the governor would inject the profile's 64: the
    // feature's budget holds 40 a minute, so 40 are asked instead of a 400.
    let mut open = ask("hello", 1);
    open.as_object_mut().unwrap().remove("max_tokens");
    let a = chat(&g, open, &[("x-envelope-feature", "small")]).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(a.header("x-envelope-max-tokens"), "40");
    assert_eq!(a.header("x-envelope-max-tokens-decision"), "injected");
    assert_eq!(a.header("x-ratelimit-remaining-requests"), "0");
    // The fourth waits for one request to refill: 20 s at 3 a minute.
    let (status, _, a) = call(&g, false, None).await;
    assert_eq!(status, 429, "{:?}", a.body);
    assert_eq!(a.header("x-envelope-reason"), "budget_exceeded");
    assert_eq!(a.body["error"]["code"], "rate_limit_exceeded");
    assert_eq!(a.body["error"]["type"], "requests");
    let ms: u64 = a.header("retry-after-ms").parse().unwrap();
    assert!((15_000..=20_000).contains(&ms), "{ms}");
    assert_eq!(a.header("retry-after"), ms.div_ceil(1000).to_string());
    assert_eq!(a.header("x-ratelimit-remaining-requests"), "0");
    assert!(
        g.metric("envelope_governor_budget_refusals_total{budget=\"tenant:default:requests_per_minute\"}"
        )
        .await
            >= 1.0
    );
    // Larger than a budget can ever hold: 400, not to be retried.
    let a = chat(&g, ask("hi", 16), &[("x-envelope-feature", "tiny")]).await;
    assert_eq!(a.status, 400, "{:?}", a.body);
    assert_eq!(a.header("x-envelope-reason"), "budget_too_small");
    assert_eq!(a.header("x-should-retry"), "false");
    let msg = a.body["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("feature:tiny:output_tokens_per_minute"),
        "{msg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_share_a_budget_through_redis_and_never_overrun_it() {
    let _one = SERIAL.lock().await;
    let redis = Redis::start();
    let up = dummy(0, "tiny");
    let root = temp_dir("envelope-budgets", "replicas");
    // 160 output tokens a minute: ten calls of 16, for all replicas together.
    let budgets = "[tenants.default]\noutput_tokens_per_minute = 160\n";
    let gs = replicas(3, &root, &up.base, budgets, &redis.url());
    let start = Instant::now();
    // 45 calls at once, 15 on each replica, every other one streaming.
    let calls = (0..45).map(|i| call(&gs[i % 3], i % 2 == 0, None));
    let answers = futures::future::join_all(calls).await;
    let elapsed = start.elapsed().as_secs_f64();
    no_store_errors(&gs).await;
    let spent: u64 = answers.iter().map(|(_, t, _)| t).sum();
    let ok = answers.iter().filter(|(s, _, _)| *s == 200).count();
    let refused: Vec<&Answer> = answers
        .iter()
        .filter(|(s, _, _)| *s == 429)
        .map(|(_, _, a)| a)
        .collect();
    // The budget plus what refilled while the calls ran, to the token:
    // every decision is one atomic script in Redis (no leases).
    let bound = 160.0 + 160.0 / 60.0 * elapsed;
    assert!(
        (spent as f64) <= bound,
        "{spent} output tokens over {elapsed:.1} s against a bound of {bound:.1} ({ok} answered)"
    );
    assert!(ok >= 10 && ok + refused.len() == 45, "{ok} answered");
    for a in &refused {
        assert_eq!(a.header("x-envelope-reason"), "budget_exceeded");
        assert!(a.header("retry-after").parse::<u64>().unwrap() >= 1);
    }
    // Every replica both admitted and refused: the budget is one.
    for g in &gs {
        let r = g.metric("envelope_governor_budget_refusals_total{budget=\"tenant:default:output_tokens_per_minute\"}",
        )
        .await;
        assert!(r >= 1.0, "a replica refused nothing: {}", g.log());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_stopped_fails_open_or_closed_per_budget_then_recovers() {
    let _one = SERIAL.lock().await;
    let mut redis = Redis::start();
    let up = dummy(0, "tiny");
    let dir = temp_dir("envelope-budgets", "down");
    std::fs::create_dir_all(&dir).unwrap();
    let tenants = dir.join("tenants.toml");
    std::fs::write(
        &tenants,
        "[tenants.open]\napi_keys = [\"k-open\"]\n[tenants.shut]\napi_keys = [\"k-shut\"]\n",
    )
    .unwrap();
    let url = redis.url();
    let g = govern(
        &dir,
        &up.base,
        r#"
[tenants.open]
requests_per_minute = 1000
on_store_error = "open"
[tenants.shut]
requests_per_minute = 1000
on_store_error = "closed"
"#,
        &[
            "--budget-store",
            &url,
            "--tenants",
            tenants.to_str().unwrap(),
        ],
    );
    for k in ["k-open", "k-shut"] {
        assert_eq!(call(&g, false, Some(k)).await.0, 200);
    }
    redis.stop();
    let (status, _, _) = call(&g, false, Some("k-open")).await;
    assert_eq!(status, 200, "fails open: admitted");
    let (status, _, a) = call(&g, false, Some("k-shut")).await;
    assert_eq!(status, 503, "fails closed: {:?}", a.body);
    assert_eq!(a.header("x-envelope-reason"), "budget_store_unavailable");
    assert_eq!(a.header("retry-after"), "1");
    let errors = g
        .metric("envelope_governor_budget_store_errors_total{op=\"decide\"}")
        .await;
    assert!(errors >= 2.0, "{errors}");
    assert!(g.log().contains("unreachable"), "{}", g.log());
    // Back: the closed budget admits again once the connection is remade.
    redis.restart();
    let start = Instant::now();
    loop {
        let (status, _, _) = call(&g, false, Some("k-shut")).await;
        if status == 200 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "still {status} 30 s after Redis came back"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // And it counts there again: the bucket is in Redis.
    let (_, _, a) = call(&g, false, Some("k-shut")).await;
    let left: f64 = a.header("x-ratelimit-remaining-requests").parse().unwrap();
    assert!(left < 1000.0, "{left}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shadow_budgets_refuse_nothing_and_count_what_they_would_have() {
    let _one = SERIAL.lock().await;
    let redis = Redis::start();
    let up = dummy(0, "tiny");
    let root = temp_dir("envelope-budgets", "shadow");
    let budgets = "[tenants.default]\nrequests_per_minute = 2\nmode = \"shadow\"\n";
    let gs = replicas(2, &root, &up.base, budgets, &redis.url());
    for i in 0..5 {
        let (status, _, a) = call(&gs[i % 2], false, None).await;
        assert_eq!(status, 200, "{:?}", a.body);
    }
    no_store_errors(&gs).await;
    let series = "envelope_governor_budget_shadow_refusals_total{budget=\"tenant:default:requests_per_minute\"}";
    let mut would = 0.0;
    for g in &gs {
        would += g.metric(series).await;
        assert_eq!(
            g.metric(
                "envelope_governor_rejections_total{mode=\"single\",reason=\"budget_exceeded\"}"
            )
            .await,
            0.0
        );
    }
    // Two fit the minute across both replicas; three would have been refused.
    assert_eq!(would, 3.0);
}
