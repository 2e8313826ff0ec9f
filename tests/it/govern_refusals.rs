//! One refusal for both front doors: the same request refused by a
//! governor over one upstream and by one over a tier of that upstream
//! reads the same on the wire: each 4xx the profile or the request
//! decides, byte for byte; a 429 of a full envelope and the 503 of a
//! drain alike but for the waits they state (when each is asked), both
//! with `Retry-After` and `retry-after-ms`.

use crate::common;

use common::tiers::*;
use serde_json::json;
use std::time::Duration;

/// A call as sent on the wire: its status, its headers but `date`, and its
/// body's bytes.
async fn raw_call(
    base: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let mut r = reqwest::Client::new()
        .post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body.to_string());
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    let resp = r.send().await.unwrap();
    let status = resp.status().as_u16();
    let mut h: Vec<(String, String)> = resp
        .headers()
        .iter()
        .filter(|(k, _)| k.as_str() != "date")
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("?").to_string()))
        .collect();
    h.sort();
    (status, h, resp.bytes().await.unwrap().to_vec())
}

/// The two front doors over one upstream: `envelope govern --upstream`
/// and `envelope govern --tiers` with one tier of it, the same profile.
fn both_doors(
    dir: &std::path::Path,
    upstream: &str,
    model: &str,
    profile: &std::path::Path,
) -> (common::Governor, common::Governor) {
    let single_dir = dir.join("single");
    std::fs::create_dir_all(&single_dir).unwrap();
    let single = common::Governor::start(&single_dir, profile, upstream, &["--guard", "false"]);
    let tiers = govern(
        dir,
        &format!(
            "version = \"v1\"\norder = [\"only\"]\n[tiers.only]\nupstreams = [{{ url = \"{upstream}\", profile = \"{}\", model = \"{model}\" }}]\n",
            profile.display()
        ),
    );
    (single, tiers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_error_reads_the_same_byte_for_byte() {
    let dir = temp_dir("same-refusal");
    let up = dummy(1, "tiny-a");
    let p = profile(&dir, "only", 64, 16, 2);
    let (single, tiers) = both_doors(&dir, &up.base, "tiny-a", &p);
    let long = ask(&"many words in a prompt ".repeat(60), 8).to_string();
    // What each case is, its body, and its headers.
    type Case<'a> = (&'a str, String, &'a [(&'a str, &'a str)]);
    let cases: [Case; 5] = [
        ("a prompt over the context", long, &[]),
        ("max_tokens 0", ask("hello", 0).to_string(), &[]),
        ("a body that is not JSON", "{not json".into(), &[]),
        (
            "an unknown class",
            ask("hello", 4).to_string(),
            &[("x-envelope-class", "urgent")],
        ),
        (
            "a deadline that is not a number",
            ask("hello", 4).to_string(),
            &[("x-request-deadline-ms", "soon")],
        ),
    ];
    for (what, body, headers) in &cases {
        let a = raw_call(&single.base, body, headers).await;
        let b = raw_call(&tiers.base, body, headers).await;
        assert!((400..500).contains(&a.0), "{what}: {a:?}");
        assert_eq!(a.0, b.0, "{what}");
        assert_eq!(a.1, b.1, "{what}: headers");
        assert_eq!(
            String::from_utf8_lossy(&a.2),
            String::from_utf8_lossy(&b.2),
            "{what}: body"
        );
        // Past identity, both name whom the refusal was charged to.
        let charged = a.1.iter().any(|(k, _)| k == "x-envelope-class");
        assert_eq!(charged, *what != "an unknown class", "{what}: {a:?}");
    }
    drop((single, tiers));
    let _ = std::fs::remove_dir_all(dir);
}

/// A refusal with a wait in it, as two front doors answered it: the same
/// status, the same headers but the waits (each in 1..=60 s, and
/// `retry-after-ms` the same wait as `Retry-After`), and the same body
/// once its numbers are masked (the wait is in the message).
fn same_but_the_wait(
    what: &str,
    a: &(u16, Vec<(String, String)>, Vec<u8>),
    b: &(u16, Vec<(String, String)>, Vec<u8>),
) {
    assert_eq!(a.0, b.0, "{what}: {a:?} / {b:?}");
    let waits = |h: &[(String, String)]| {
        let get = |k: &str| {
            h.iter()
                .find(|(n, _)| n == k)
                .unwrap_or_else(|| panic!("{what}: no {k} in {h:?}"))
                .1
                .parse::<u64>()
                .unwrap()
        };
        let (s, ms) = (get("retry-after"), get("retry-after-ms"));
        assert!((1..=60).contains(&s), "{what}: Retry-After {s}");
        assert_eq!(ms, s * 1000, "{what}: retry-after-ms {ms} for {s} s");
        h.iter()
            .filter(|(n, _)| n != "retry-after" && n != "retry-after-ms")
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(waits(&a.1), waits(&b.1), "{what}: headers");
    let masked = |body: &[u8]| {
        let text = String::from_utf8_lossy(body);
        let mut out = String::new();
        for c in text.chars() {
            if c.is_ascii_digit() {
                if !out.ends_with('N') {
                    out.push('N');
                }
            } else {
                out.push(c);
            }
        }
        out
    };
    assert_eq!(masked(&a.2), masked(&b.2), "{what}: body");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_envelope_and_a_drain_read_the_same_but_for_the_wait() {
    let dir = temp_dir("same-429-503");
    let up = smollm2("smollm2");
    // One sequence at a time: a long stream takes it.
    let p = profile(&dir, "only", 1024, 256, 1);
    let (single, tiers) = both_doors(&dir, &up.base, "smollm2", &p);
    let hold = |base: String| async move {
        let body = json!({"model": "smollm2", "messages": [{"role": "user", "content": "Count."}],
                          "max_tokens": 200, "temperature": 0, "ignore_eos": true, "stream": true});
        let mut r = reqwest::Client::new()
            .post(format!("{base}/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.chunk().await.unwrap().is_some());
        r
    };
    let held = (
        hold(single.base.clone()).await,
        hold(tiers.base.clone()).await,
    );
    // A call that cannot wait for the sequence held: 429.
    let body = ask("hi", 4).to_string();
    let deadline = [("x-request-deadline-ms", "300")];
    let a = raw_call(&single.base, &body, &deadline).await;
    let b = raw_call(&tiers.base, &body, &deadline).await;
    assert_eq!(a.0, 429, "{a:?}");
    same_but_the_wait("a full envelope", &a, &b);
    // Each counts it in the one family of refusals, under its mode.
    let counted = |page: String, mode: &str| {
        let series = format!("envelope_governor_rejections_total{{mode=\"{mode}\",reason=\"");
        page.lines()
            .find_map(|l| l.strip_prefix(series.as_str()).map(str::to_string))
    };
    let (in_single, in_tiers) = (
        counted(single.metrics_page().await, "single"),
        counted(tiers.metrics_page().await, "tiers"),
    );
    assert!(
        in_single.as_deref().is_some_and(|s| s.ends_with("\"} 1")) && in_single == in_tiers,
        "{in_single:?} {in_tiers:?}"
    );
    // A drain: new calls get 503 while the held streams finish.
    single.signal("-TERM");
    tiers.signal("-TERM");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let a = raw_call(&single.base, &body, &[]).await;
    let b = raw_call(&tiers.base, &body, &[]).await;
    assert_eq!(a.0, 503, "{a:?}\n{}", single.log());
    same_but_the_wait("a drain", &a, &b);
    drop(held);
    drop((single, tiers));
    let _ = std::fs::remove_dir_all(dir);
}
