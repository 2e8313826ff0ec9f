//! envelope beside servers it did not write: llama.cpp's own `llama-server`
//! (parallel slots, continuous batching, `/tokenize`, `--metrics`) and
//! llama-cpp-python's server (one request at a time; a new request cuts
//! the running stream), both built from registry packages by
//! `scripts/foreign-servers.sh` (which `scripts/test.sh` runs first), both
//! on the SmolLM2 GGUF, on loopback.
//!
//! The whole chain with default settings, as a new user runs it: a sweep
//! of an `http` target given only `base_url` and `model` -> a profile ->
//! `envelope govern` with default flags -> English prompts on chat and
//! completions, and a closed loop at 4x the safe concurrency, straight at
//! the server and through the governor.
//!
//! These tests measure the servers, so they run alone: beside another
//! busy test llama.cpp's threads, which spin while they wait for each
//! other, lose their cores, and a 256-token prefill that takes 0.9 s alone
//! took up to 2.7 s (one sequence) and 3.6 s (four). `scripts/test.sh`
//! runs this module after the rest (`cargo test --test it foreign_servers::`),
//! one test at a time.

use crate::common;

use common::{smollm2, temp_dir, Governor};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// One test at a time, also when the module runs beside the others: each
/// measures a server on a 2-core machine, and two at once would measure
/// each other.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// A path from `scripts/foreign-servers.sh`'s output.
fn foreign(var: &str) -> PathBuf {
    let p = std::env::var(var).unwrap_or_else(|_| {
        panic!("{var} is not set: run `eval \"$(scripts/foreign-servers.sh)\"` first (scripts/test.sh does)")
    });
    PathBuf::from(p)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A server process on loopback, its output in a log; stopped on drop.
struct Foreign {
    child: Child,
    base: String,
    log: PathBuf,
}

impl Foreign {
    fn start(dir: &Path, name: &str, program: &Path, args: &[String], ready: &str) -> Foreign {
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).unwrap();
        let port = args
            .iter()
            .position(|a| a == "--port")
            .map(|i| args[i + 1].clone())
            .unwrap();
        let child = Command::new(program)
            .args(args)
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", program.display()));
        let s = Foreign {
            child,
            base: format!("http://127.0.0.1:{port}"),
            log,
        };
        let start = Instant::now();
        let client = reqwest::blocking::Client::new();
        loop {
            let up = client
                .get(format!("{}{ready}", s.base))
                .timeout(Duration::from_secs(2))
                .send()
                .is_ok_and(|r| r.status().is_success());
            if up {
                return s;
            }
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "{name} not ready in 120 s:\n{}",
                s.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Foreign {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

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
        "/health",
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
        "/v1/models",
    )
}

/// `envelope sweep --config` of `toml` into `dir/out`: its exit status,
/// the profile it wrote and its stderr.
fn sweep(dir: &Path, toml: &str) -> (std::process::ExitStatus, Value, String) {
    sweep_with_path(dir, toml, &std::env::var("PATH").unwrap_or_default())
}

/// [`sweep`] with `path` as the PATH its launched servers are found on.
fn sweep_with_path(
    dir: &Path,
    toml: &str,
    path: &str,
) -> (std::process::ExitStatus, Value, String) {
    let cfg = dir.join("bench.toml");
    std::fs::write(&cfg, toml).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_envelope"))
        .args(["sweep", "--config"])
        .arg(&cfg)
        .arg("--out")
        .arg(dir.join("out"))
        .env("ENVELOPE_LOG", "warn")
        .env("PATH", path)
        .output()
        .unwrap();
    let stderr =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    let text = std::fs::read_to_string(dir.join("out/profile.json"))
        .unwrap_or_else(|e| panic!("no profile.json ({e}):\n{stderr}"));
    (out.status, serde_json::from_str(&text).unwrap(), stderr)
}

/// The sweep of an `http` target given only its server and a model name.
fn default_target(base: &str, buckets: &str, concurrency_max: u32) -> String {
    format!(
        r#"[target]
kind = "http"
base_url = "{base}"
model = "smollm2"

[matrix]
buckets = [{buckets}]
concurrency_max = {concurrency_max}

[load]
rounds = 2
max_client_gap_ms = 1000

[slo]
ttft_p95_ms = 4000
# First contact with a server is under test, not the statistics (the
# sweep tests cover those): at 0.5 a p95 is decided on 14 requests, not
# the default 0.9's 45, which on llama.cpp's threads here cost minutes.
confidence = 0.5
"#
    )
}

const SENTENCES: [&str; 8] = [
    "The river runs past the old mill and under the stone bridge.",
    "Children stop there on their way home from school to watch the water.",
    "In spring the fields on both banks turn green and the farmers plant corn.",
    "A small road follows the river to the next town, which has a market.",
    "Most people who live here have known each other for many years.",
    "Visitors come in summer to walk in the hills and to swim in the lake.",
    "The library opens at nine and closes early on Saturday afternoons.",
    "When the evening comes, the square fills with music and conversation.",
];

/// English text of at least `tokens` tokens as `count` measures them.
fn english(tokens: u64, count: &dyn Fn(&str) -> u64) -> String {
    let mut text = String::new();
    let mut i = 0;
    while text.is_empty() || count(&text) < tokens {
        if !text.is_empty() {
            text.push(' ');
        }
        text.push_str(SENTENCES[i % SENTENCES.len()]);
        i += 1;
    }
    text
}

/// The server's own count of a text: `POST path` with `body`, answered
/// with `{"tokens": [...]}` (llama.cpp) or `{"count"}` (llama-cpp-python).
fn server_count(base: &str, path: &str, body: Value) -> u64 {
    let v: Value = reqwest::blocking::Client::new()
        .post(format!("{base}{path}"))
        .json(&body)
        .send()
        .unwrap()
        .json()
        .unwrap();
    v["count"]
        .as_u64()
        .or_else(|| v["tokens"].as_array().map(|t| t.len() as u64))
        .unwrap_or_else(|| panic!("no count in {v}"))
}

/// The governor's count of a prompt against the server's own, for one
/// completion and one chat of `text` (both must be admitted).
fn counted_against_usage(g: &Governor, text: &str) -> Vec<(f64, f64)> {
    let client = reqwest::blocking::Client::new();
    let bodies = [
        (
            "/v1/completions",
            json!({"model": "smollm2", "prompt": text, "max_tokens": 4}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "smollm2", "messages": [{"role": "user", "content": text}], "max_tokens": 4}),
        ),
    ];
    bodies
        .iter()
        .map(|(path, body)| {
            let r = client.post(g.url(path)).json(body).send().unwrap();
            let status = r.status().as_u16();
            let counted = r
                .headers()
                .get("x-envelope-prompt-tokens")
                .and_then(|v| v.to_str().ok()?.parse::<f64>().ok());
            let source = r
                .headers()
                .get("x-envelope-token-count")
                .map(|v| v.to_str().unwrap_or("").to_string());
            let v: Value = r.json().unwrap();
            assert_eq!(status, 200, "{path}: {v}\n{}", g.log());
            let usage = v["usage"]["prompt_tokens"].as_f64().unwrap();
            let counted = counted.unwrap_or_else(|| panic!("{path}: no x-envelope-prompt-tokens"));
            assert_ne!(source.as_deref(), Some("estimate"), "{path}");
            (counted, usage)
        })
        .collect()
}

/// The governor's estimate of a completion's prompt against the server's
/// own count.
fn counted_against_usage_estimated(g: &Governor, text: &str) -> (f64, f64) {
    let r = reqwest::blocking::Client::new()
        .post(g.url("/v1/completions"))
        .json(&json!({"model": "smollm2", "prompt": text, "max_tokens": 2}))
        .send()
        .unwrap();
    assert_eq!(r.headers()["x-envelope-token-count"], "estimate");
    let counted: f64 = r.headers()["x-envelope-prompt-tokens"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let v: Value = r.json().unwrap();
    (counted, v["usage"]["prompt_tokens"].as_f64().unwrap())
}

/// What one request of the overload loop got.
#[derive(Debug, Default)]
struct Outcome {
    status: u16,
    retry_after: bool,
    /// A 200 stream that ended with `[DONE]` after a finish reason.
    whole: bool,
    /// Seconds from sending to the answer's end.
    e2e_s: f64,
}

/// `clients` closed-loop clients (streaming or not) for `secs` against
/// `base`; a refused client waits its Retry-After (at most 2 s) before
/// its next request.
fn overload(base: &str, clients: usize, secs: u64, prompt: &str, stream: bool) -> Vec<Outcome> {
    let stop = Instant::now() + Duration::from_secs(secs);
    let body = json!({"model": "smollm2", "prompt": prompt, "max_tokens": 16, "stream": stream});
    let threads: Vec<_> = (0..clients)
        .map(|_| {
            let (base, body) = (base.to_string(), body.clone());
            std::thread::spawn(move || {
                let client = reqwest::blocking::Client::builder()
                    .timeout(Duration::from_secs(60))
                    .build()
                    .unwrap();
                let mut out = vec![];
                while Instant::now() < stop && out.len() < 500 {
                    let mut o = Outcome::default();
                    let t0 = Instant::now();
                    match client
                        .post(format!("{base}/v1/completions"))
                        .json(&body)
                        .send()
                    {
                        Ok(r) => {
                            o.status = r.status().as_u16();
                            let wait = r
                                .headers()
                                .get("retry-after")
                                .and_then(|v| v.to_str().ok()?.parse::<f64>().ok());
                            o.retry_after = wait.is_some();
                            if o.status == 200 && !stream {
                                let v: Value = r.json().unwrap_or_default();
                                o.whole = v["choices"][0]["finish_reason"].is_string();
                            } else if o.status == 200 {
                                let (mut finish, mut done) = (false, false);
                                for line in BufReader::new(r).lines() {
                                    let Ok(line) = line else { break };
                                    let Some(d) = line.strip_prefix("data:").map(str::trim) else {
                                        continue;
                                    };
                                    if d == "[DONE]" {
                                        done = true;
                                        break;
                                    }
                                    let v: Value = serde_json::from_str(d).unwrap_or_default();
                                    finish |= v["choices"][0]["finish_reason"].is_string();
                                }
                                o.whole = finish && done;
                            } else {
                                let _ = r.bytes();
                            }
                            o.e2e_s = t0.elapsed().as_secs_f64();
                            if let Some(w) = wait {
                                std::thread::sleep(Duration::from_secs_f64(w.min(2.0)));
                            }
                        }
                        Err(_) => o.status = 0,
                    }
                    out.push(o);
                }
                out
            })
        })
        .collect();
    threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect()
}

fn tally(label: &str, outcomes: &[Outcome], secs: u64) -> String {
    let n = outcomes.len();
    let whole = outcomes.iter().filter(|o| o.whole).count();
    let mut e2e: Vec<f64> = outcomes
        .iter()
        .filter(|o| o.whole)
        .map(|o| o.e2e_s)
        .collect();
    e2e.sort_by(f64::total_cmp);
    let p = |q: f64| {
        e2e.get(((e2e.len() as f64 * q) as usize).min(e2e.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0.0)
    };
    let refused = outcomes.iter().filter(|o| o.status == 429).count();
    let other = n - outcomes
        .iter()
        .filter(|o| o.status == 200 || o.status == 429)
        .count();
    let line = format!(
        "{label}: {n} requests, {whole} whole answers ({:.2}/s; e2e p50 {:.2} s, p95 {:.2} s), {} answers not whole, {refused} refused (429), {other} other statuses",
        whole as f64 / secs as f64,
        p(0.5),
        p(0.95),
        outcomes.iter().filter(|o| o.status == 200 && !o.whole).count()
    );
    eprintln!("{line}");
    line
}

/// Every admitted answer whole, every refusal a 429 with Retry-After,
/// nothing else.
fn assert_governed(label: &str, outcomes: &[Outcome], secs: u64, g: &Governor) {
    let line = tally(label, outcomes, secs);
    assert!(outcomes.iter().any(|o| o.whole), "{line}");
    for o in outcomes {
        match o.status {
            200 => assert!(o.whole, "an admitted answer was cut: {line}\n{}", g.log()),
            429 => assert!(o.retry_after, "a 429 without Retry-After: {line}"),
            s => panic!("status {s} through the governor: {line}\n{}", g.log()),
        }
    }
}

/// The profile's safe concurrency for `bucket`.
fn safe_at(profile: &Value, bucket: &str) -> u64 {
    let rows = profile["limits"]["buckets"].as_array().unwrap();
    rows.iter()
        .find(|b| format!("{}x{}", b["input_tokens"], b["output_tokens"]) == bucket)
        .unwrap_or_else(|| panic!("no {bucket} in {profile}"))["safe_concurrency"]
        .as_u64()
        .unwrap()
}

/// Each bucket's search in a line per probe (a whole profile is longer
/// than what CI keeps of a failure).
fn probes_of(profile: &Value) -> String {
    let mut out = String::new();
    for c in profile["configs"].as_array().into_iter().flatten() {
        for b in c["buckets"].as_array().into_iter().flatten() {
            out += &format!(
                "{}x{}: feasible {}, bound by {}\n",
                b["input_tokens"],
                b["output_tokens"],
                b["feasible_concurrency"],
                b["binding_constraint"]
            );
            for p in b["probes"].as_array().into_iter().flatten() {
                out += &format!(
                    "  concurrency {}: {} requests, {} errors, TTFT p95 {} ms, e2e p99 {} ms, breaches {}\n",
                    p["concurrency"], p["requests"], p["errors"], p["ttft_ms"]["p95"], p["e2e_ms"]["p99"], p["breaches"]
                );
            }
        }
    }
    out
}

#[test]
fn llama_server_defaults_from_sweep_to_governed_overload() {
    let _serial = one_at_a_time();
    let dir = temp_dir("envelope-foreign", "llama-server");
    let server = llama_server(&dir);
    let model = smollm2();

    // A sweep that nothing passes (a TTFT SLO no server meets) exits
    // non-zero and writes `limits: null` with the reason; govern refuses it.
    let none = dir.join("nothing-safe");
    std::fs::create_dir_all(&none).unwrap();
    let impossible = default_target(&server.base, "\"64x32\"", 2)
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

    // The sweep with defaults: token-id prompts, parallel slots.
    let (status, profile, err) = sweep(
        &dir,
        &default_target(&server.base, "\"64x32\", \"256x32\"", 8),
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

    // govern with default flags: no mismatch, llama.cpp's /tokenize.
    let gdir = dir.join("govern");
    std::fs::create_dir_all(&gdir).unwrap();
    let g = Governor::start_with_defaults(&gdir, &dir.join("out/profile.json"), &server.base);
    let log = g.log();
    assert!(log.contains("llama.cpp /tokenize"), "{log}");
    assert!(!log.contains("MISMATCH"), "{log}");

    // English prompts that fit are admitted and counted within 5% of the
    // server's usage; one 10% over the context limit is a 400.
    let client = reqwest::blocking::Client::new();
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
    let r = client
        .post(g.url("/v1/completions"))
        .json(&json!({"model": "smollm2", "prompt": over, "max_tokens": 4}))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let v: Value = r.json().unwrap();
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");

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
    let [kept0, new0, resent0] = connections(&g);
    eprintln!(
        "streaming: upstream requests on {kept0} kept and {new0} new connections, {resent0} resent"
    );
    // Whole answers keep their connection: a new one is opened only while
    // the pool has none idle (at most one per client at once), and every
    // later request reuses one. (A share of all requests would depend on
    // how many were refused.)
    let governed = overload(&g.base, clients, 8, &prompt, false);
    assert_governed("llama-server governed, whole answers", &governed, 8, &g);
    let [kept, new, resent] = connections(&g);
    let (kept, new) = (kept - kept0, new - new0);
    eprintln!(
        "whole answers: upstream requests on {kept} kept and {new} new connections, {} resent",
        resent - resent0
    );
    assert!(
        new <= clients as f64 && kept > 2.0 * new,
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
        &default_target(&g.base, "\"64x32\"", 4 * safe as u32),
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
fn llama_cpp_python_defaults_from_sweep_to_governed_overload() {
    let _serial = one_at_a_time();
    let dir = temp_dir("envelope-foreign", "llama-cpp-python");
    let server = llama_cpp_python(&dir);
    let model = smollm2();

    // Token ids get a 500 here: the sweep falls back to text and is truthful
    // (one at a time; two at a time the server cuts the running stream).
    let (status, profile, err) = sweep(&dir, &default_target(&server.base, "\"64x32\"", 4));
    assert!(status.success(), "{err}\n{}", server.log());
    let checks = &profile["configs"][0]["server_checks"];
    assert_eq!(checks["token_prompts"], false, "{checks}");
    assert!(checks["notes"].to_string().contains("HTTP 500"), "{checks}");
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
    let context = profile["limits"]["max_context_tokens"].as_u64().unwrap();
    let r = client
        .post(g.url("/v1/chat/completions"))
        .json(&json!({"model": "smollm2", "messages": [{"role": "user", "content": english(context * 11 / 10, &count)}], "max_tokens": 4}))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);

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
    let text = english(70, &count);
    for _ in 0..envelope_governor::learnt_estimate::MIN_SAMPLES {
        let r = client
            .post(g.url("/v1/completions"))
            .json(&json!({"model": "smollm2", "prompt": text, "max_tokens": 2}))
            .send()
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        r.bytes().unwrap();
    }
    let (counted, usage) = counted_against_usage_estimated(&g, &text);
    assert!(
        counted >= usage && counted - usage <= 0.05 * usage,
        "learnt: counted {counted}, the server's usage {usage}"
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
    // As in `config` above: a p99 at 0.9 would decide each level on 230
    // requests; the template's launch is under test here.
    .replace("e2e_p99_ms = 30000", "confidence = 0.5");
    let (status, p, err) = sweep_with_path(&dir, &cfg, &path);
    assert!(status.success(), "{err}");
    let c = &p["configs"][0];
    assert!(c["error"].is_null(), "{c}");
    assert!(c["time_to_ready_s"].as_f64().unwrap() > 0.0);
    assert_eq!(c["server_checks"]["token_prompts"], true);
    // Four slots of 1,024 tokens: both buckets run more than one at a time.
    assert!(safe_at(&p, "64x32") >= 2, "{}", probes_of(&p));
    assert!(safe_at(&p, "256x32") >= 2, "{}", probes_of(&p));
}
