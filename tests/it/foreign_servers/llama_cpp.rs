//! llama.cpp's own `llama-server` (parallel slots, continuous batching,
//! `/tokenize`, `--metrics`) and llama-cpp-python's server (one request at
//! a time; a new request cuts the running stream; no `/metrics`), both on
//! the SmolLM2 GGUF.

use super::*;
use crate::common::{smollm2, temp_dir, Governor};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn llama_server(dir: &Path) -> Foreign {
    let args: Vec<String> = [
        "-m",
        &smollm2(),
        "--host",
        "127.0.0.1",
        "--port",
        &free_port().to_string(),
        "-np",
        "4",
        "-c",
        "4096",
        "--metrics",
    ]
    .map(String::from)
    .to_vec();
    Foreign::start(
        dir,
        "llama-server",
        &foreign("ENVELOPE_LLAMA_SERVER"),
        &args,
        ("/health", Duration::from_secs(120)),
    )
}

fn llama_cpp_python(dir: &Path) -> Foreign {
    let args: Vec<String> = [
        "-m",
        "llama_cpp.server",
        "--model",
        &smollm2(),
        "--host",
        "127.0.0.1",
        "--port",
        &free_port().to_string(),
        "--n_ctx",
        "2048",
    ]
    .map(String::from)
    .to_vec();
    Foreign::start(
        dir,
        "llama-cpp-python",
        &foreign("ENVELOPE_LLAMA_CPP_PYTHON"),
        &args,
        ("/v1/models", Duration::from_secs(120)),
    )
}

/// `body` is refused by the governor itself: 400 context_length_exceeded
/// with its reason header, and the upstream never called.
fn refused_over_the_context(g: &Governor, path: &str, body: Value) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let upstream = || {
        rt.block_on(async {
            g.metric("envelope_governor_upstream_requests_on_kept_connections_total")
                .await
                + g.metric("envelope_governor_upstream_requests_on_new_connections_total")
                    .await
        })
    };
    let before = upstream();
    let r = reqwest::blocking::Client::new()
        .post(g.url(path))
        .json(&body)
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    assert_eq!(r.headers()["x-envelope-reason"], "context_length_exceeded");
    let v: Value = r.json().unwrap();
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    assert_eq!(upstream(), before, "the upstream was called");
}

#[test]
fn llama_server_four_slots_swept_at_half_confidence_then_governed_by_defaults() {
    let _serial = one_at_a_time();
    let dir = temp_dir("envelope-foreign", "llama-server");
    let server = llama_server(&dir);
    let model = smollm2();

    // A sweep that nothing passes (a TTFT SLO no server meets) exits
    // non-zero and writes `limits: null` with the reason; govern refuses it.
    let none = dir.join("nothing-safe");
    std::fs::create_dir_all(&none).unwrap();
    let impossible = first_contact_target(&server.base, "\"64x32\"", 2)
        .replace("ttft_p95_ms = 4000", "ttft_p95_ms = 0.001");
    let (status, p, err) = sweep(&none, &impossible);
    assert!(!status.success(), "{err}");
    assert!(p["limits"].is_null(), "{p}");
    let why = p["no_safe_point"].as_str().unwrap();
    assert!(why.contains("ttft_p95"), "{why}");
    assert!(err.contains("NO SAFE OPERATING POINT"), "{err}");
    let refused = Command::new(env!("CARGO_BIN_EXE_envelope"))
        .args([
            "govern",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &server.base,
        ])
        .arg("--profile")
        .arg(none.join("out/profile.json"))
        .output()
        .unwrap();
    let msg = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && msg.contains("no safe operating point"),
        "{msg}"
    );

    // The sweep with defaults: token-id prompts, parallel slots; and a
    // warm bucket, half of each prompt a prefix the probe's requests share.
    let (status, profile, err) = sweep(
        &dir,
        &first_contact_target(&server.base, "\"64x32\", \"256x32\", \"64x32@50%\"", 8),
    );
    assert!(status.success(), "{err}\n{}", server.log());
    let checks = &profile["configs"][0]["server_checks"];
    assert_eq!(checks["token_prompts"], true, "{checks}");
    assert_eq!(checks["served_models"][0], model.as_str(), "{checks}");
    assert_eq!(profile["fingerprint"]["model"]["id"], model.as_str());
    assert_eq!(profile["fingerprint"]["model"]["requested"], "smollm2");
    assert_eq!(checks["tokenizer"]["path"], model.as_str(), "{checks}");
    let bpt = checks["text_bytes_per_token"].as_f64().unwrap();
    assert!((3.0..7.0).contains(&bpt), "{bpt}");
    let safe = safe_at(&profile, "64x32");
    assert!(safe >= 2, "parallel slots: safe at {safe}\n{profile}");
    // llama.cpp has no counters, but each streamed answer's usage says what
    // its slot reused (`cached_tokens`): the warm bucket's hit rate comes
    // from those, and each slot keeps the shared half.
    let warm = &profile["configs"][0]["buckets"][2]["cached_prefix"];
    let hits = warm["observed_hit_rate"].as_f64();
    assert!(
        hits.is_some_and(|h| h >= 0.25) && warm["held"] == true,
        "{warm}"
    );
    assert_eq!(
        profile["limits"]["buckets"].as_array().unwrap().len(),
        2,
        "the warm bucket is no row of the envelope"
    );

    // govern with default flags: no mismatch, llama.cpp's /tokenize.
    let gdir = dir.join("govern");
    std::fs::create_dir_all(&gdir).unwrap();
    let g = Governor::start_with_defaults(&gdir, &dir.join("out/profile.json"), &server.base);
    let log = g.log();
    assert!(log.contains("llama.cpp /tokenize"), "{log}");
    assert!(!log.contains("MISMATCH"), "{log}");

    // English prompts that fit are admitted and counted within 5% of the
    // server's usage; one 10% over the context limit is the governor's 400.
    let count = |t: &str| server_count(&server.base, "/tokenize", json!({"content": t}));
    let context = profile["limits"]["max_context_tokens"].as_u64().unwrap();
    for tokens in [40, context / 2] {
        for (counted, usage) in counted_against_usage(&g, &english(tokens, &count)) {
            assert!(
                (counted - usage).abs() <= 0.05 * usage,
                "counted {counted}, the server's usage {usage}"
            );
        }
    }
    let over = english(context * 11 / 10, &count);
    refused_over_the_context(
        &g,
        "/v1/completions",
        json!({"model": "smollm2", "prompt": over, "max_tokens": 4}),
    );

    // Calls that share a long system prompt, one after another: llama.cpp
    // keeps each slot's last prompt and reports what it reused
    // (`cached_tokens`). The governor credits what its own record of sent
    // prefixes estimates only as far as those reports confirm it: never
    // more than the server found, and nothing before it said anything.
    let system = english(context / 3, &count);
    let (mut credited, mut reported) = (vec![], vec![]);
    for i in 0..6 {
        let r = reqwest::blocking::Client::new()
            .post(g.url("/v1/chat/completions"))
            .json(&json!({"model": "smollm2", "max_tokens": 4, "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": format!("Question {i}: what is this about?")}]}))
            .send()
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let header = &r.headers()["x-envelope-prompt-cached-tokens"];
        credited.push(header.to_str().unwrap().parse::<u64>().unwrap());
        let v: Value = r.json().unwrap();
        let cached = &v["usage"]["prompt_tokens_details"]["cached_tokens"];
        reported.push(
            cached
                .as_u64()
                .unwrap_or_else(|| panic!("no cached_tokens: {v}")),
        );
    }
    let state = reqwest::blocking::get(g.url("/admin/state"))
        .unwrap()
        .json::<Value>()
        .unwrap();
    eprintln!(
        "llama-server, shared system prompt: credited {credited:?}, reported cached {reported:?}; {}",
        state["prefix_cache"]
    );
    assert_eq!(credited[0], 0, "credited before the server said anything");
    assert!(
        credited.iter().sum::<u64>() <= reported.iter().sum::<u64>(),
        "credited {credited:?} past what llama-server reported {reported:?}"
    );
    // It did reuse the prompt, and the governor came to believe it.
    assert!(reported[1..].iter().all(|&c| c > 0), "{reported:?}");
    assert!(credited[5] > 0, "{credited:?} {reported:?}");

    // 4x the safe concurrency, straight and governed, streaming. This
    // server closes the connection after every streamed answer (while its
    // headers say keep-alive): the governor's next request on it gets no
    // answer and is sent again on a new connection, never a 502.
    let prompt = english(48, &count);
    let clients = 4 * safe as usize;
    // Its metrics as the adapter reads them, polled while it is overloaded.
    let watch = {
        let url = format!("{}/metrics", server.base);
        std::thread::spawn(move || {
            let until = Instant::now() + Duration::from_secs(10);
            let mut seen = vec![];
            while Instant::now() < until {
                let text = reqwest::blocking::get(&url).unwrap().text().unwrap();
                seen.push(envelope_telemetry::engine_state::parse_engine_state(&text).unwrap());
                std::thread::sleep(Duration::from_millis(200));
            }
            seen
        })
    };
    let direct = overload(&server.base, clients, 12, &prompt, true);
    tally("llama-server direct, streaming", &direct, 12);
    let seen = watch.join().unwrap();
    let most = |f: &dyn Fn(&envelope_telemetry::EngineState) -> Option<f64>| {
        seen.iter().filter_map(f).fold(0.0, f64::max)
    };
    assert!(seen
        .iter()
        .all(|s| s.engine == envelope_telemetry::engine_state::EngineKind::LlamaCpp));
    // Four slots: at most 4 processing, the rest deferred; no KV gauge.
    assert_eq!(most(&|s| s.running), 4.0, "{seen:?}");
    assert!(most(&|s| s.waiting) >= 1.0, "{seen:?}");
    assert!(most(&|s| s.generation_tokens_total) > 0.0, "{seen:?}");
    assert!(seen.iter().all(|s| s.kv_usage.is_none()));
    let governed = overload(&g.base, clients, 12, &prompt, true);
    assert_governed("llama-server governed, streaming", &governed, 12, &g);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let connections = |g: &Governor| {
        rt.block_on(async {
            [
                g.metric("envelope_governor_upstream_requests_on_kept_connections_total")
                    .await,
                g.metric("envelope_governor_upstream_requests_on_new_connections_total")
                    .await,
                g.metric("envelope_governor_upstream_resent_total").await,
            ]
        })
    };
    let [kept0, new0, _] = connections(&g);
    eprintln!("streaming: upstream requests on {kept0} kept and {new0} new connections");
    // Whole answers keep their connection: a new one is opened only while
    // the pool has none idle (at most one per client at once, as the
    // pool fills after the streams above), and every later request reuses
    // one. So after 3 s of filling it, over 90% of the upstream requests
    // go on kept connections.
    let filling = overload(&g.base, clients, 3, &prompt, false);
    assert_governed(
        "llama-server governed, whole answers, filling the pool",
        &filling,
        3,
        &g,
    );
    let [kept0, new0, resent0] = connections(&g);
    let governed = overload(&g.base, clients, 8, &prompt, false);
    assert_governed("llama-server governed, whole answers", &governed, 8, &g);
    let [kept, new, resent] = connections(&g);
    let (kept, new) = (kept - kept0, new - new0);
    eprintln!(
        "whole answers: upstream requests on {kept} kept and {new} new connections, {} resent",
        resent - resent0
    );
    assert!(
        new <= clients as f64 && kept >= 0.9 * (kept + new),
        "{kept} kept, {new} new"
    );
    // The governor's live guard reads the same metrics, and says what it
    // guards on without a KV gauge.
    let log = g.log();
    assert!(
        log.contains("LlamaCpp metrics") && log.contains("lack kv_usage"),
        "{log}"
    );

    // A sweep through the governor: refusals are shed load, not failures,
    // and the report says the target was governed.
    let gsweep = dir.join("through-govern");
    std::fs::create_dir_all(&gsweep).unwrap();
    let (status, governed_profile, err) = sweep(
        &gsweep,
        &first_contact_target(&g.base, "\"64x32\"", 4 * safe as u32),
    );
    assert!(status.success(), "{err}");
    assert_eq!(
        governed_profile["configs"][0]["server_checks"]["governed"],
        true
    );
    for p in governed_profile["configs"][0]["buckets"][0]["probes"]
        .as_array()
        .unwrap()
    {
        assert_eq!(p["errors"], 0, "{p}");
    }
    let report = std::fs::read_to_string(gsweep.join("out/report.md")).unwrap();
    assert!(report.contains("**yes** (envelope govern)"), "{report}");
    drop(g);

    // A profile of another model is still a mismatch, naming both sides.
    let mut other = profile.clone();
    other["fingerprint"]["model"]["id"] = json!("another-model");
    let odir = dir.join("other");
    std::fs::create_dir_all(&odir).unwrap();
    std::fs::write(odir.join("profile.json"), other.to_string()).unwrap();
    let g = Governor::start_with_defaults(&odir, &odir.join("profile.json"), &server.base);
    let log = g.log();
    assert!(
        log.contains("PROFILE MISMATCH") && log.contains("another-model") && log.contains(&model),
        "{log}"
    );
}

#[test]
fn llama_cpp_python_swept_at_half_confidence_then_governed_by_defaults() {
    let _serial = one_at_a_time();
    let dir = temp_dir("envelope-foreign", "llama-cpp-python");
    let server = llama_cpp_python(&dir);
    let model = smollm2();

    // Token ids get a 500 here: the sweep falls back to text and is truthful
    // (one at a time; two at a time the server cuts the running stream).
    let t0 = Instant::now();
    let (status, profile, err) = sweep(&dir, &first_contact_target(&server.base, "\"64x32\"", 4));
    assert!(status.success(), "{err}\n{}", server.log());
    // No /metrics here (404): asked again at most every 30 s (the
    // monitor reads every 50 ms), and said once in the report.
    let log = server.log();
    assert!(
        log.contains("GET /v1/models"),
        "no access log to count in:\n{log}"
    );
    let asked = log.matches("GET /metrics").count() as f64;
    assert!(
        asked <= 2.0 + t0.elapsed().as_secs_f64() / 30.0,
        "/metrics asked {asked} times in {:.0} s",
        t0.elapsed().as_secs_f64()
    );
    let checks = &profile["configs"][0]["server_checks"];
    assert_eq!(checks["token_prompts"], false, "{checks}");
    assert!(checks["notes"].to_string().contains("HTTP 500"), "{checks}");
    assert!(
        checks["notes"].to_string().contains("exports no metrics"),
        "{checks}"
    );
    assert_eq!(checks["tokenizer"]["path"], model.as_str(), "{checks}");
    let bucket = &profile["configs"][0]["buckets"][0];
    assert_eq!(bucket["feasible_concurrency"], 1, "{bucket}");
    assert_eq!(bucket["binding_constraint"], "errors", "{bucket}");
    assert!(profile["limits"].is_object());

    // govern with default flags: the tokenizer the profile names (the
    // server's own tokenize endpoint would cut running streams).
    let gdir = dir.join("govern");
    std::fs::create_dir_all(&gdir).unwrap();
    let g = Governor::start_with_defaults(&gdir, &dir.join("out/profile.json"), &server.base);
    let log = g.log();
    assert!(log.contains("the tokenizer the profile names"), "{log}");
    assert!(log.contains("not used"), "{log}");
    assert!(!log.contains("MISMATCH"), "{log}");

    let client = reqwest::blocking::Client::new();
    let count = |t: &str| server_count(&server.base, "/extras/tokenize/count", json!({"input": t}));
    for (counted, usage) in counted_against_usage(&g, &english(40, &count)) {
        assert!(
            (counted - usage).abs() <= 0.05 * usage,
            "counted {counted}, the server's usage {usage}"
        );
    }
    // This server answers an over-long prompt with its own 400
    // context_length_exceeded: the refusal must be the governor's.
    let context = profile["limits"]["max_context_tokens"].as_u64().unwrap();
    refused_over_the_context(
        &g,
        "/v1/chat/completions",
        json!({"model": "smollm2", "messages": [{"role": "user", "content": english(context * 11 / 10, &count)}], "max_tokens": 4}),
    );

    let prompt = english(48, &count);
    let direct = overload(&server.base, 4, 10, &prompt, true);
    tally("llama-cpp-python direct", &direct, 10);
    let governed = overload(&g.base, 4, 10, &prompt, true);
    assert_governed("llama-cpp-python governed", &governed, 10, &g);

    drop(g);

    // Without the tokenizer file (moved, or another machine), the estimate
    // starts from the profile's bytes per token and learns the server's
    // own count from its usage.
    let mut moved = profile.clone();
    moved["configs"][0]["server_checks"]["tokenizer"]["path"] = json!("/nonexistent/model.gguf");
    let edir = dir.join("estimate");
    std::fs::create_dir_all(&edir).unwrap();
    std::fs::write(edir.join("profile.json"), moved.to_string()).unwrap();
    let g = Governor::start_with_defaults(&edir, &edir.join("profile.json"), &server.base);
    let log = g.log();
    assert!(log.contains("learnt from the upstream's usage"), "{log}");
    // It learns from English prompts of varied length and order, and is
    // checked on a passage it never saw: never under (its ratio is the
    // 5th percentile of what it saw), over by 10% here (53 for 48).
    for n in 0..envelope_governor::learnt_estimate::MIN_SAMPLES {
        let text = SENTENCES
            .iter()
            .cycle()
            .skip(n % SENTENCES.len())
            .take(2 + n % 3)
            .copied()
            .collect::<Vec<_>>()
            .join(" ");
        let r = client
            .post(g.url("/v1/completions"))
            .json(&json!({"model": "smollm2", "prompt": text, "max_tokens": 2}))
            .send()
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        r.bytes().unwrap();
    }
    let unseen = "Every morning the baker opens her shop before sunrise, and the smell of warm bread drifts along the quiet street. Neighbours stop for coffee, talk about the weather and the harvest, and carry their loaves home under their arms.";
    let (counted, usage) = counted_against_usage_estimated(&g, unseen);
    assert!(
        counted >= usage && counted - usage <= 0.15 * usage,
        "learnt, on text it did not learn from: counted {counted}, the server's usage {usage}"
    );
}

#[test]
fn llama_server_through_the_launch_template() {
    let _serial = one_at_a_time();
    let dir = temp_dir("envelope-foreign", "launch-llama-server");
    let bin = foreign("ENVELOPE_LLAMA_SERVER");
    let path = format!(
        "{}:{}",
        bin.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let cfg = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("bench-configs/launch-llama-server.toml"),
    )
    .unwrap()
    .replace("models/SmolLM2-135M-Instruct.Q4_1.gguf", &smollm2())
    // As in `config` above: a p99 at 0.9 would decide each level on 108
    // requests; the template's launch is under test here.
    .replace("e2e_p99_ms = 30000", "confidence = 0.5");
    let (status, p, err) = sweep_with_path(&dir, &cfg, &path);
    assert!(status.success(), "{err}");
    let c = &p["configs"][0];
    assert!(c["error"].is_null(), "{c}");
    assert!(c["time_to_ready_s"].as_f64().unwrap() > 0.0);
    assert_eq!(c["server_checks"]["token_prompts"], true);
    // Four slots of 1,024 tokens: the short bucket is safe at more than one
    // at a time (its level 4 reads a TTFT p95 near a third of the SLO on
    // CI's machine). The long one's level 2 sits within 1.5x of the SLO
    // there and is decided at 1 or 2 by that machine's speed, so what is
    // asserted of it is the template's: every level it ran, two or more at
    // a time included, was answered without an error.
    assert!(safe_at(&p, "64x32") >= 2, "{}", probes_of(&p));
    let long = bucket_of(&p, "256x32");
    assert!(
        long["feasible_concurrency"].as_u64().unwrap() >= 1,
        "{}",
        probes_of(&p)
    );
    let probes = long["probes"].as_array().unwrap();
    assert!(
        probes
            .iter()
            .any(|q| q["concurrency"].as_u64().unwrap() >= 2)
            && probes.iter().all(|q| q["errors"] == 0),
        "{}",
        probes_of(&p)
    );
}
