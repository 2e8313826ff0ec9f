//! The governor's `/metrics` as an endpoint picker (llm-d's, the Gateway
//! API Inference Extension's) reads a pod: two replicas of different
//! measured capacity, their gauges read at the picker's 50 ms, ordered by
//! what each can still take; the gauges at 1.0 exactly when the governor
//! starts queuing; the engine's own series passed through.

use crate::common;
use crate::sweep_targets::{out_dir, sweep};

use common::scrape::Scrape;
use common::{temp_dir, Governor, SlowServer};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// dummy:tiny in f32 holds 512 bytes of KV per token, in 16-token blocks.
const BLOCK_BYTES: usize = 16 * 512;
/// A step's sleep per sequence where requests must stay in flight while
/// counted: 48 tokens take at least 12 s, ample for a stalled machine.
const HOLD_MS_PER_SEQ: u64 = 250;
/// KV pools of the two replicas: 640 and 1,920 tokens.
const SMALL_BLOCKS: usize = 40;
const LARGE_BLOCKS: usize = 120;

/// The sweep both replicas' profiles come from: dummy:tiny on the
/// embedded engine, one 32x48 bucket, KV-bound (the block arithmetic, not
/// the machine's speed, sets where it stops, give or take how far the
/// workers drift apart: the tests read each safe point from its profile).
fn sweep_config(blocks: usize) -> String {
    format!(
        r#"[target]
kind = "engine"
model = "dummy:tiny"
kv_cache_bytes = "{}"

[matrix]
precisions = ["f32"]
batch_policies = ["continuous"]
max_num_seqs = 64
buckets = ["32x48"]
concurrency_max = 64

[load]
max_client_gap_ms = 1000

[slo]
itl_p95_ms = 5000
headroom = 0.2
"#,
        blocks * BLOCK_BYTES
    )
}

/// The two measured profiles (small KV, large KV), swept once for all the
/// tests here.
fn measured() -> &'static (PathBuf, PathBuf) {
    static PROFILES: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    PROFILES.get_or_init(|| {
        let one = |blocks: usize| {
            let d = out_dir(&format!("picker-{blocks}"));
            let (_, profile) = sweep(&d, &sweep_config(blocks));
            assert_eq!(
                profile["configs"][0]["buckets"][0]["binding_constraint"], "kv_cache",
                "{profile}"
            );
            d.join("out/profile.json")
        };
        (one(SMALL_BLOCKS), one(LARGE_BLOCKS))
    })
}

fn safe_concurrency(profile: &Path) -> u64 {
    let p: Value = serde_json::from_str(&std::fs::read_to_string(profile).unwrap()).unwrap();
    p["limits"]["buckets"][0]["safe_concurrency"]
        .as_u64()
        .unwrap()
}

/// A streamed completion inside the profile's bucket, left to run until
/// the task is aborted (the connection then drops, which frees its permit).
fn hold(client: &reqwest::Client, base: &str) -> tokio::task::JoinHandle<u16> {
    let (client, url) = (client.clone(), format!("{base}/v1/completions"));
    tokio::spawn(async move {
        let body = json!({"model": "tiny", "prompt": "hello there", "max_tokens": 48,
                          "ignore_eos": true, "stream": true});
        let mut resp = client.post(url).json(&body).send().await.unwrap();
        let status = resp.status().as_u16();
        while let Ok(Some(_)) = resp.chunk().await {}
        status
    })
}

/// Scrapes until `f` holds of a page (or 20 s pass, then panics).
async fn wait_for(
    client: &reqwest::Client,
    base: &str,
    what: &str,
    f: impl Fn(&Scrape) -> bool,
) -> Scrape {
    let t0 = Instant::now();
    loop {
        let s = Scrape::get(client, base).await;
        if f(&s) {
            return s;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "{what}: {s:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The gauges a picker routes on, from one page.
#[derive(Debug, Clone, Copy)]
struct PodGauges {
    /// Requests at the pod, queued + running: the governor's queue and its
    /// requests in flight, from the same reading of the bookkeeping as the
    /// gauges below (`envelope_governor_in_flight_requests` is set apart
    /// from them, and may be a request ahead); where the governor's queue
    /// is empty, the requests in flight.
    in_flight: f64,
    saturation: f64,
    headroom: f64,
    kv_ratio: f64,
    envelope_used: f64,
}

impl PodGauges {
    fn of(s: &Scrape) -> PodGauges {
        let g = PodGauges {
            in_flight: at_pod(s),
            saturation: s.value("envelope_governor_saturation"),
            headroom: s.value("envelope_governor_admission_headroom"),
            kv_ratio: s.value("envelope_governor_kv_reserved_ratio"),
            envelope_used: s.value("envelope_governor_envelope_used"),
        };
        for v in [g.saturation, g.headroom, g.kv_ratio] {
            assert!((0.0..=1.0).contains(&v), "{g:?}");
        }
        assert!((g.saturation + g.headroom - 1.0).abs() < 1e-9, "{g:?}");
        g
    }
}

/// Requests at the pod in one page's pod gauges: queued and running.
fn at_pod(s: &Scrape) -> f64 {
    s.value("envelope_governor_pod_queued_requests")
        + s.value("envelope_governor_pod_running_requests")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_gauges_reach_one_exactly_when_the_governor_starts_queuing() {
    let (small, _) = measured();
    let c = safe_concurrency(small);
    assert!(c >= 3, "{c}");
    let server =
        SlowServer::start_named("tiny", SMALL_BLOCKS * BLOCK_BYTES, 64, HOLD_MS_PER_SEQ).await;
    let dir = temp_dir("envelope-picker", "ramp");
    let g = Governor::start(&dir, small, &server.base, &["--engine-metrics", "true"]);
    let client = reqwest::Client::new();
    let idle = PodGauges::of(&Scrape::get(&client, &g.base).await);
    assert_eq!((idle.saturation, idle.headroom), (0.0, 1.0), "{idle:?}");
    let mut held = vec![];
    let mut last = idle;
    for k in 1..=c {
        held.push(hold(&client, &g.base));
        let s = wait_for(&client, &g.base, "admitted", |s| at_pod(s) == k as f64).await;
        let now = PodGauges::of(&s);
        assert!(now.kv_ratio > last.kv_ratio, "{last:?} then {now:?}");
        if k < c {
            // Short of the limit: the share held, never 1.
            assert!(now.saturation < 1.0, "{k} of {c}: {now:?}");
            assert!(
                (now.saturation - k as f64 / c as f64).abs() < 1e-6,
                "{k}: {now:?}"
            );
        } else {
            // At it: exactly 1, though the shares add up to under the
            // whole envelope (each is 1 / the bucket's concurrency after
            // the headroom, unrounded: c of them hold c / that).
            assert_eq!(now.saturation, 1.0, "{k} of {c}: {now:?}");
            assert_eq!(now.headroom, 0.0);
            assert!(
                now.envelope_used < 1.0 && now.envelope_used > c as f64 / (c + 1) as f64,
                "{now:?}"
            );
        }
        last = now;
    }
    // One more waits in the governor's queue, and the pod's queue shows it.
    held.push(hold(&client, &g.base));
    let s = wait_for(&client, &g.base, "queued", |s| {
        s.value("envelope_governor_queued_requests") == 1.0 && at_pod(s) > c as f64
    })
    .await;
    assert_eq!(s.value("envelope_governor_in_flight_requests"), c as f64);
    assert!(s.value("envelope_governor_pod_queued_requests") >= 1.0);
    assert_eq!(PodGauges::of(&s).saturation, 1.0);
    for h in &held {
        h.abort();
    }
    let s = wait_for(&client, &g.base, "released", |s| at_pod(s) == 0.0).await;
    assert_eq!(PodGauges::of(&s).saturation, 0.0);
}

/// `workers` closed-loop clients on `base` until `end`.
fn closed_loop(
    client: &reqwest::Client,
    base: &str,
    workers: usize,
    end: Instant,
) -> Vec<tokio::task::JoinHandle<Vec<u16>>> {
    (0..workers)
        .map(|_| {
            let (client, url) = (client.clone(), format!("{base}/v1/completions"));
            tokio::spawn(async move {
                let mut statuses = vec![];
                while Instant::now() < end {
                    let body = json!({"model": "tiny", "prompt": "hello there", "max_tokens": 48,
                                      "ignore_eos": true, "stream": true});
                    let mut resp = client.post(&url).json(&body).send().await.unwrap();
                    statuses.push(resp.status().as_u16());
                    while let Ok(Some(_)) = resp.chunk().await {}
                }
                statuses
            })
        })
        .collect()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_of_different_measured_capacity_order_by_what_they_can_still_take() {
    let (small, large) = measured();
    let (cs, cl) = (safe_concurrency(small), safe_concurrency(large));
    assert!(cs < cl, "{cs} vs {cl}");
    let workers = cs as usize - 1;
    let up_small = SlowServer::start_named("tiny", SMALL_BLOCKS * BLOCK_BYTES, 64, 2).await;
    let up_large = SlowServer::start_named("tiny", LARGE_BLOCKS * BLOCK_BYTES, 64, 2).await;
    let root = temp_dir("envelope-picker", "pair");
    let args = ["--engine-metrics", "true"];
    let (ds, dl) = (root.join("small"), root.join("large"));
    std::fs::create_dir_all(&ds).unwrap();
    std::fs::create_dir_all(&dl).unwrap();
    let gs = Governor::start(&ds, small, &up_small.base, &args);
    let gl = Governor::start(&dl, large, &up_large.base, &args);
    // The same load on both, fewer clients than the smaller takes.
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()
        .unwrap();
    let end = Instant::now() + Duration::from_secs(5);
    let mut load = closed_loop(&client, &gs.base, workers, end);
    load.extend(closed_loop(&client, &gl.base, workers, end));
    // The picker's view: both pods scraped every 50 ms.
    let scraper = reqwest::Client::new();
    let (mut seen_small, mut seen_large, mut took) = (vec![], vec![], vec![]);
    let mut engine_series = 0;
    while Instant::now() < end {
        for (g, seen) in [(&gs, &mut seen_small), (&gl, &mut seen_large)] {
            let s = Scrape::get(&scraper, &g.base).await;
            assert!(
                s.content_type.starts_with("text/plain; version=0.0.4"),
                "{}",
                s.content_type
            );
            took.push(s.took.as_secs_f64() * 1000.0);
            engine_series += s.samples.contains_key("envelope:num_requests_running") as usize;
            seen.push(PodGauges::of(&s));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for t in load {
        let statuses = t.await.unwrap();
        assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    }
    // The engine's own page came through on nearly every scrape (the
    // first may precede the poller's first fetch).
    assert!(
        engine_series + 2 >= took.len(),
        "{engine_series} of {}",
        took.len()
    );
    // At the same requests in flight the smaller replica reads fuller, on
    // every gauge, in every pair of pages.
    let mut compared = 0;
    for k in 1..=workers {
        let at = |seen: &[PodGauges]| -> Vec<PodGauges> {
            seen.iter()
                .copied()
                .filter(|p| p.in_flight == k as f64)
                .collect()
        };
        let (s, l) = (at(&seen_small), at(&seen_large));
        for a in &s {
            for b in &l {
                assert!(
                    a.saturation > b.saturation,
                    "{k} in flight: small {a:?}, large {b:?}"
                );
                assert!(a.headroom < b.headroom, "{k}: small {a:?}, large {b:?}");
                assert!(a.kv_ratio > b.kv_ratio, "{k}: small {a:?}, large {b:?}");
                assert!(
                    a.envelope_used > b.envelope_used,
                    "{k}: small {a:?}, large {b:?}"
                );
                compared += 1;
            }
        }
    }
    assert!(
        compared >= 10,
        "only {compared} pairs of pages at equal load"
    );
    let mean =
        |seen: &[PodGauges]| seen.iter().map(|p| p.saturation).sum::<f64>() / seen.len() as f64;
    let (ms, ml) = (mean(&seen_small), mean(&seen_large));
    assert!(ms > ml, "mean saturation: small {ms:.3}, large {ml:.3}");
    took.sort_by(f64::total_cmp);
    eprintln!(
        "/metrics under load ({} scrapes, governor + engine page): p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; mean saturation small {ms:.3} (safe {cs}), large {ml:.3} (safe {cl})",
        took.len(),
        percentile(&took, 0.5),
        percentile(&took, 0.99),
        took[took.len() - 1]
    );
}

/// The committed picker config (`deploy/llm-d/epp-config.yaml`).
fn picker_config() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/llm-d/epp-config.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    serde_norway::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The plugin of `kind` in a picker config.
fn plugin<'a>(cfg: &'a Value, kind: &str) -> &'a Value {
    cfg["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["type"] == kind)
        .unwrap_or_else(|| panic!("no {kind} plugin"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_committed_picker_config_reads_a_governors_page() {
    let cfg = picker_config();
    let engines = plugin(&cfg, "core-metrics-extractor")["parameters"]["engineConfigs"]
        .as_array()
        .unwrap();
    let engine = engines
        .iter()
        .find(|e| e["name"] == "envelope-governor")
        .expect("an engineConfigs entry for governed pods");
    let threshold = plugin(&cfg, "utilization-detector")["parameters"]["kvCacheUtilThreshold"]
        .as_f64()
        .unwrap();
    let spec = |field: &str| engine[field].as_str().unwrap().to_string();
    let headroom_spec = engine["customMetrics"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["attributeKey"] == "envelope-headroom")
        .map(|c| c["metricSpec"].as_str().unwrap().to_string())
        .expect("the headroom custom metric");

    let (small, _) = measured();
    let c = safe_concurrency(small);
    let server =
        SlowServer::start_named("tiny", SMALL_BLOCKS * BLOCK_BYTES, 64, HOLD_MS_PER_SEQ).await;
    let dir = temp_dir("envelope-picker", "config");
    let g = Governor::start(&dir, small, &server.base, &["--engine-metrics", "true"]);
    let client = reqwest::Client::new();
    let mut held = vec![];
    for k in 1..=c {
        held.push(hold(&client, &g.base));
        let page = wait_for(&client, &g.base, "admitted", |s| at_pod(s) == k as f64).await;
        // Each spec the picker reads of the governor: a gauge it can parse,
        // in its range. vLLM's own series (LoRA, cache config) come through
        // --engine-metrics from vLLM; the upstream here is envelope serve,
        // whose own series come through in their place.
        let read = |spec: &str| -> Option<f64> {
            if spec.starts_with("vllm:") {
                assert!(
                    page.samples.contains_key("envelope:num_requests_running"),
                    "{spec}"
                );
                return None;
            }
            let (v, kind) = page.select(spec).unwrap();
            assert_eq!(
                kind, "Gauge",
                "{spec}: a {kind}, not a gauge of the pod's state now"
            );
            Some(v)
        };
        let queued = read(&spec("queuedRequestsSpec")).unwrap();
        let running = read(&spec("runningRequestsSpec")).unwrap();
        let usage = read(&spec("kvUsageSpec")).unwrap();
        let headroom = read(&headroom_spec).unwrap();
        for f in ["loraSpec", "cacheInfoSpec"] {
            if engine[f].is_string() {
                assert_eq!(
                    read(&spec(f)),
                    None,
                    "{f}: only vLLM's series are passed through by name"
                );
            }
        }
        // Nothing waits in the governor: what the engine has not yet
        // scheduled (a request arriving mid-step) moves from running to
        // queued, and each request is counted once.
        assert_eq!(
            queued + running,
            k as f64,
            "{k}: queued {queued}, running {running}"
        );
        assert!((0.0..=1.0).contains(&usage) && (0.0..=1.0).contains(&headroom));
        assert!((usage + headroom - 1.0).abs() < 1e-9, "{usage} {headroom}");
        // The detector's threshold is this pod's own limit: crossed exactly
        // when the governor would queue the next request.
        assert_eq!(
            usage >= threshold,
            k == c,
            "{k} of {c}: usage {usage}, threshold {threshold}"
        );
    }
    for h in &held {
        h.abort();
    }
}
