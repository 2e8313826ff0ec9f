//! `envelope govern` in front of a real `envelope serve` (dummy:tiny, a
//! small KV pool): the overload demonstration — driven directly
//! at 4x the profile's safe concurrency the server preempts; through the
//! governor it does not, and the excess gets 429 with Retry-After — plus
//! context-length refusals, hot reload and drain on SIGTERM.

use crate::common;

use common::{Governor, Server};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// 512 KiB of f32 KV for dummy:tiny (512 bytes/token) = 1024 tokens = 64 blocks.
const KV_POOL: &str = "512KiB";
const PROMPT_WORDS: usize = 8; // "hello " x 8 = 48 byte tokens
const MAX_TOKENS: u64 = 192; // 48 + 192 = 240 tokens = 15 blocks per sequence
const SAFE_CONCURRENCY: u64 = 4; // 4 x 15 = 60 blocks of 64

fn profile_json(seqs: u64, kv_tokens: u64, output: u64) -> Value {
    json!({
        "schema": "envelope.profile/v1",
        "created_unix_ms": 1,
        "fingerprint": {"schema": 1, "model": {"kind": "dummy", "preset": "tiny", "seed": 0},
                        "node": {"gpus": []}},
        "slo": {"ttft_p95_ms": null, "itl_p95_ms": null, "e2e_p99_ms": null},
        "configs": [],
        "selected": "dummy-tiny-512KiB",
        "limits": {"max_context_tokens": 1024, "max_output_tokens": output,
                   "max_concurrent_seqs": seqs, "max_kv_tokens_in_flight": kv_tokens},
        "probes_total": 0
    })
}

fn temp_dir(name: &str) -> PathBuf {
    common::temp_dir("envelope-govern", name)
}

fn body(prompt_words: usize, max_tokens: u64) -> Value {
    json!({"model": "dummy:tiny", "prompt": "hello ".repeat(prompt_words), "max_tokens": max_tokens,
           "temperature": 0, "ignore_eos": true})
}

/// `n` concurrent completions against `base`; returns (status, retry-after, completion tokens).
async fn burst(
    base: &str,
    n: usize,
    prompt_words: usize,
    max_tokens: u64,
) -> Vec<(u16, Option<u64>, u64)> {
    let client = reqwest::Client::new();
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let c = client.clone();
            let url = format!("{base}/v1/completions");
            tokio::spawn(async move {
                let r = c
                    .post(url)
                    .json(&body(prompt_words, max_tokens))
                    .send()
                    .await
                    .unwrap();
                let status = r.status().as_u16();
                let ra = r
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok()?.parse().ok());
                let v: Value = r.json().await.unwrap_or(Value::Null);
                (
                    status,
                    ra,
                    v["usage"]["completion_tokens"].as_u64().unwrap_or(0),
                )
            })
        })
        .collect();
    let mut out = vec![];
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overload_direct_preempts_governed_does_not() {
    let server = Server::start(&[
        "--model",
        "dummy:tiny",
        "--kv-cache-bytes",
        KV_POOL,
        "--max-num-seqs",
        "64",
    ]);
    let n = (4 * SAFE_CONCURRENCY) as usize;

    // Directly: 4x the safe concurrency overcommits the KV pool.
    let before = server.metric("envelope:num_preemptions_total").await;
    let direct = burst(&server.base, n, PROMPT_WORDS, MAX_TOKENS).await;
    let direct_preemptions = server.metric("envelope:num_preemptions_total").await - before;
    assert!(direct.iter().all(|r| r.0 == 200), "{direct:?}");
    assert!(
        direct_preemptions > 0.0,
        "the server never preempted; the demonstration needs a smaller pool"
    );

    // Through the governor: at most 4 in flight, 4 waiting, the rest refused.
    let dir = temp_dir("overload");
    let profile = dir.join("profile.json");
    let per_seq = PROMPT_WORDS as u64 * 6 + MAX_TOKENS;
    std::fs::write(
        &profile,
        profile_json(SAFE_CONCURRENCY, SAFE_CONCURRENCY * per_seq, 256).to_string(),
    )
    .unwrap();
    let gov = Governor::start(
        &dir,
        &profile,
        &server.base,
        &["--max-queue-len", "4", "--guard-interval-ms", "200"],
    );
    let before = server.metric("envelope:num_preemptions_total").await;
    let governed = burst(&gov.base, n, PROMPT_WORDS, MAX_TOKENS).await;
    let governed_preemptions = server.metric("envelope:num_preemptions_total").await - before;
    let ok: Vec<_> = governed.iter().filter(|r| r.0 == 200).collect();
    let refused: Vec<_> = governed.iter().filter(|r| r.0 == 429).collect();
    assert_eq!(ok.len() + refused.len(), n, "{governed:?}");
    assert!(ok.len() >= SAFE_CONCURRENCY as usize, "{governed:?}");
    assert!(!refused.is_empty(), "{governed:?}");
    for r in &refused {
        let ra = r.1.expect("429 carries Retry-After");
        assert!((1..=60).contains(&ra), "{ra}");
    }
    for r in &ok {
        assert_eq!(r.2, MAX_TOKENS, "admitted requests run to completion");
    }
    assert_eq!(
        governed_preemptions, 0.0,
        "the governor let the server preempt"
    );
    eprintln!(
        "direct: {n} requests, {direct_preemptions} preemptions; governed: {} ok, {} x 429, 0 preemptions",
        ok.len(),
        refused.len()
    );
    let m = gov.metrics_page().await;
    assert!(
        m.contains("envelope_governor_rejections_total{mode=\"single\",reason=\"queue_full\"}"),
        "{m}"
    );

    // `envelope serve` keeps no prefix cache and reports none: the
    // governor sees prompts that share their first blocks and credits
    // none of them, whatever its own record says.
    let shared = "the same long system text ".repeat(10);
    let client = reqwest::Client::new();
    for i in 0..4 {
        let r = client
            .post(gov.url("/v1/completions"))
            .json(&json!({"model": "dummy:tiny", "prompt": format!("{shared} question {i}"), "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-envelope-prompt-cached-tokens"], "0");
        // A poll of the server's metrics between calls (every 200 ms).
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let m = gov.metrics_page().await;
    let series = |name: &str| -> f64 {
        m.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} not on /metrics:\n{m}"))
    };
    assert!(series("envelope_governor_prefix_cache_estimated_tokens_total") > 0.0);
    assert_eq!(
        series("envelope_governor_prefix_cache_credited_tokens_total"),
        0.0
    );
    assert_eq!(series("envelope_governor_prefix_cache_trust"), 0.0);
    let state = gov.state().await;
    assert_eq!(state["prefix_cache"]["readings"], 0, "{state}");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn context_caps_reload_and_drain() {
    let server = Server::start(&["--model", "dummy:tiny", "--kv-cache-bytes", KV_POOL]);
    let dir = temp_dir("reload");
    let profile = dir.join("profile.json");
    std::fs::write(&profile, profile_json(4, 1000, 64).to_string()).unwrap();
    // Two worker threads (tokio's multi-thread scheduler): the other
    // tests run the default, one event loop.
    let gov = Governor::start(
        &dir,
        &profile,
        &server.base,
        &["--guard-interval-ms", "200", "--worker-threads", "2"],
    );
    let c = reqwest::Client::new();

    // Counted with the server's /tokenize: 1000 byte tokens + 64 > 1024.
    let r = c
        .post(gov.url("/v1/completions"))
        .json(&body(1000 / 6 + 1, 64))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    assert_eq!(v["error"]["param"], "prompt");
    // Missing max_tokens is injected from the profile.
    let r = c
        .post(gov.url("/v1/chat/completions"))
        .json(&json!({"messages": [{"role": "user", "content": "hi"}], "ignore_eos": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-envelope-max-tokens"], "64");
    assert_eq!(r.headers()["x-envelope-token-count"], "upstream_tokenize");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 64);
    // /v1/models passes through.
    let v: Value = c
        .get(gov.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["data"][0]["id"], "dummy:tiny");

    // Hot reload on SIGHUP: a new output cap applies...
    std::fs::write(&profile, profile_json(4, 1000, 32).to_string()).unwrap();
    gov.signal("-HUP");
    let end = Instant::now() + Duration::from_secs(10);
    let mut applied = String::new();
    while Instant::now() < end {
        let r = c
            .post(gov.url("/v1/completions"))
            .json(&json!({"prompt": "hi"}))
            .send()
            .await
            .unwrap();
        applied = r.headers()["x-envelope-max-tokens"]
            .to_str()
            .unwrap()
            .to_string();
        if applied == "32" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(applied, "32");
    // ...and an invalid profile is rejected, the last good one stays.
    // The rejection is an event the governor counts: wait for it, not
    // for a while.
    std::fs::write(&profile, "{\"schema\": \"nonsense\"}").unwrap();
    gov.signal("-HUP");
    let end = Instant::now() + Duration::from_secs(10);
    let mut m = String::new();
    while Instant::now() < end {
        m = c
            .get(gov.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if m.contains("envelope_governor_profile_reloads_total{outcome=\"rejected\"}") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        m.contains("envelope_governor_profile_reloads_total{outcome=\"rejected\"}"),
        "{m}"
    );
    let r = c
        .post(gov.url("/v1/completions"))
        .json(&json!({"prompt": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-envelope-max-tokens"], "32");
    // A change of the file alone (no signal) reloads too.
    std::fs::write(&profile, profile_json(4, 1000, 16).to_string()).unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    while Instant::now() < end {
        let r = c
            .post(gov.url("/v1/completions"))
            .json(&json!({"prompt": "hi"}))
            .send()
            .await
            .unwrap();
        applied = r.headers()["x-envelope-max-tokens"]
            .to_str()
            .unwrap()
            .to_string();
        if applied == "16" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(applied, "16");

    // Drain on SIGTERM: a stream in flight finishes, then the governor exits.
    let mut req = body(4, 32);
    req["stream"] = json!(true);
    let r = c
        .post(gov.url("/v1/completions"))
        .json(&req)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut r = r;
    let mut text = String::from_utf8(r.chunk().await.unwrap().unwrap().to_vec()).unwrap();
    gov.signal("-TERM");
    while let Some(chunk) = r.chunk().await.unwrap() {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let mut gov = gov;
    let end = Instant::now() + Duration::from_secs(30);
    while gov.child.try_wait().unwrap().is_none() && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        gov.child.try_wait().unwrap().is_some(),
        "the governor exited after draining"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Texts crafted to be many tokens per byte, and ordinary ones.
fn crafted_texts() -> Vec<String> {
    let mut seed = 0x9e3779b97f4a7c15u64;
    let mut pick = |alphabet: &str, n: usize| -> String {
        let chars: Vec<char> = alphabet.chars().collect();
        (0..n)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                chars[(seed % chars.len() as u64) as usize]
            })
            .collect()
    };
    vec![
        "a ".repeat(300),
        pick("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~", 600),
        pick("0123456789", 600),
        pick("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", 600),
        pick("abcdefghijklmnopqrstuvwxyz0123456789 \n\t", 600),
        pick("é漢字😀ñßλжأ한", 200),
        pick(" \n\t", 600),
        "The quick brown fox jumps over the lazy dog. ".repeat(12),
        "fn main() {\n    println!(\"{:?}\", (0..10).collect::<Vec<u32>>());\n}\n".repeat(6),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_estimate_errs_high_and_the_gguf_counts_exactly() {
    // The default estimate against SmolLM2's own tokenizer, on text crafted
    // to be many tokens per byte: never under.
    let model = common::smollm2();
    let tk = envelope_engine::TextTokenizer::from_path(std::path::Path::new(&model)).unwrap();
    for text in crafted_texts() {
        let real = tk.encode(&text).unwrap().len() as u64;
        let est = envelope_governor::tokens::estimate_tokens(
            &text,
            envelope_governor::tokens::BOUND_BYTES_PER_TOKEN,
        );
        assert!(est >= real, "estimate {est} < {real} tokens for {text:?}");
    }

    let server = Server::start(&["--model", "dummy:tiny", "--kv-cache-bytes", KV_POOL]);
    let dir = temp_dir("estimate");
    let profile = dir.join("profile.json");
    std::fs::write(&profile, profile_json(4, 1000, 64).to_string()).unwrap();
    let c = reqwest::Client::new();
    // "a a a ...": 600 bytes, 300 tokens of SmolLM2's; bytes / 3 said 200.
    let crafted = json!({"prompt": "a ".repeat(300), "max_tokens": 8});
    {
        let gov = Governor::start(
            &dir,
            &profile,
            &server.base,
            &["--token-count", "estimate", "--max-context-tokens", "280"],
        );
        let r = c
            .post(gov.url("/v1/completions"))
            .json(&crafted)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        assert_eq!(
            r.json::<Value>().await.unwrap()["error"]["code"],
            "context_length_exceeded"
        );
    }
    // The model's .gguf counts exactly, with no call to the upstream.
    let gov = Governor::start(
        &dir,
        &profile,
        &server.base,
        &["--tokenizer", &model, "--max-context-tokens", "400"],
    );
    let r = c
        .post(gov.url("/v1/completions"))
        .json(&crafted)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-envelope-token-count"], "tokenizer");
    let want = tk.encode(&"a ".repeat(300)).unwrap().len();
    assert_eq!(
        r.headers()["x-envelope-prompt-tokens"],
        want.to_string().as_str()
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bad_tenants_file_on_reload_changes_nothing() {
    let server = Server::start(&["--model", "dummy:tiny", "--kv-cache-bytes", KV_POOL]);
    let dir = temp_dir("tenants-reload");
    let profile = dir.join("profile.json");
    std::fs::write(&profile, profile_json(4, 1000, 64).to_string()).unwrap();
    let tenants = dir.join("tenants.toml");
    std::fs::write(&tenants, "[tenants.alice]\napi_keys = [\"sk-alice\"]\n").unwrap();
    let gov = Governor::start(
        &dir,
        &profile,
        &server.base,
        &["--tenants", tenants.to_str().unwrap()],
    );
    let c = reqwest::Client::new();
    let ask = |key: &'static str| {
        c.post(gov.url("/v1/completions"))
            .bearer_auth(key)
            .json(&json!({"prompt": "hi", "max_tokens": 2}))
            .send()
    };
    assert_eq!(ask("sk-alice").await.unwrap().status(), 200);
    assert_eq!(ask("sk-bob").await.unwrap().status(), 401);
    // A file that does not parse: the reload is refused, naming it...
    std::fs::write(
        &tenants,
        "[tenants.bob]\napi_keys = [\"sk-bob\"]\nguaranteed = 7\n",
    )
    .unwrap();
    let r = c.post(gov.url("/admin/reload")).send().await.unwrap();
    assert_eq!(r.status(), 422);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tenants.toml"),
        "{v}"
    );
    // ...and the keys in force are the old ones.
    assert_eq!(ask("sk-alice").await.unwrap().status(), 200);
    assert_eq!(ask("sk-bob").await.unwrap().status(), 401);
    // A good one applies whole.
    std::fs::write(&tenants, "[tenants.bob]\napi_keys = [\"sk-bob\"]\n").unwrap();
    let r = c.post(gov.url("/admin/reload")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = ask("sk-bob").await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-envelope-tenant"], "bob");
    assert_eq!(ask("sk-alice").await.unwrap().status(), 401);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn zero_worker_threads_stop_the_start_naming_the_flag() {
    let dir = temp_dir("threads");
    let profile = dir.join("profile.json");
    std::fs::write(&profile, profile_json(4, 1000, 64).to_string()).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_envelope"))
        .args(["govern", "--profile", profile.to_str().unwrap()])
        .args(["--upstream", "http://127.0.0.1:9", "--worker-threads", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--worker-threads") && err.contains("at least 1"),
        "{err}"
    );
}
