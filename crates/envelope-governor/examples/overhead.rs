//! Governor overhead: open-loop load (requests scheduled at a fixed rate,
//! latency measured from the scheduled send time, so a stalled client
//! cannot hide queueing) against a fast loopback upstream, directly and
//! through the governor, at each rate. Prints added latency p50/p99 and
//! the throughput ratio governed/direct, with units and the machine.
//!
//! `cargo run --release -p envelope-governor --example overhead -- [SECONDS] [RATE...]`
//! (`ENVELOPE_OVERHEAD_REPS`, default 3, alternating runs per path; medians reported;
//! `ENVELOPE_OVERHEAD_RECORD=1` adds a third path, a second governor with
//! `--record` to a temporary file, and reports what recording adds;
//! `ENVELOPE_OVERHEAD_SCRAPE=1` scrapes the governed path's `/metrics` every
//! 50 ms during its runs, as an endpoint picker does, and reports how long a
//! page takes under that load)
//! (scripts/govern-overhead.sh runs it). Upstream, governor and load
//! generator each get their own runtime thread(s) in this process.

use axum::routing::post;
use axum::{Json, Router};
use envelope_governor::{GovernedUpstream, Governor, SettingsDraft, TokenCounter};
use envelope_profile::Limits;
use hdrhistogram::Histogram;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn runtime(threads: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .unwrap()
}

async fn completion(Json(v): Json<Value>) -> Json<Value> {
    let n = v["max_tokens"].as_u64().unwrap_or(1);
    Json(
        json!({"id": "cmpl", "object": "text_completion", "model": "fast",
        "choices": [{"index": 0, "text": "x".repeat(n as usize), "finish_reason": "length"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}}),
    )
}

struct Run {
    sent: u64,
    ok: u64,
    wall_s: f64,
    hist: Histogram<u64>,
}

async fn open_loop(url: String, rate: f64, secs: f64) -> Run {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(4096)
        .tcp_nodelay(true)
        .build()
        .unwrap();
    let hist = Arc::new(Mutex::new(Histogram::<u64>::new(3).unwrap()));
    let ok = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let total = (rate * secs) as u64;
    let body = json!({"model": "fast", "prompt": "The quick brown fox jumps", "max_tokens": 16});
    let start = Instant::now() + Duration::from_millis(50);
    let mut tasks = Vec::with_capacity(total as usize);
    for i in 0..total {
        let at = start + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(at.into()).await;
        let (c, u, b, h, ok) = (
            client.clone(),
            url.clone(),
            body.clone(),
            hist.clone(),
            ok.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let r = c.post(&u).json(&b).send().await;
            if let Ok(r) = r {
                if r.status().is_success() && r.bytes().await.is_ok() {
                    let us = at.elapsed().as_micros() as u64;
                    h.lock().unwrap().record(us.max(1)).unwrap();
                    ok.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let wall_s = start.elapsed().as_secs_f64();
    let hist = hist.lock().unwrap().clone();
    Run {
        sent: total,
        ok: ok.load(std::sync::atomic::Ordering::Relaxed),
        wall_s,
        hist,
    }
}

/// GETs `url` every 50 ms until `stop`, timing each page (request sent to
/// body read), in microseconds.
async fn scrape_every_50ms(
    url: String,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> Histogram<u64> {
    let client = reqwest::Client::new();
    let mut hist = Histogram::<u64>::new(3).unwrap();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let t0 = Instant::now();
        if let Ok(r) = client.get(&url).send().await {
            if r.status().is_success() && r.bytes().await.is_ok() {
                hist.record((t0.elapsed().as_micros() as u64).max(1))
                    .unwrap();
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    hist
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let secs: f64 = args.first().and_then(|s| s.parse().ok()).unwrap_or(5.0);
    let reps: usize = std::env::var("ENVELOPE_OVERHEAD_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .max(1);
    let rates: Vec<f64> = if args.len() > 1 {
        args[1..].iter().filter_map(|s| s.parse().ok()).collect()
    } else {
        vec![500.0, 2000.0]
    };

    // The fast upstream.
    let up_rt = runtime(1);
    let upstream = up_rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let app = Router::new().route("/v1/completions", post(completion));
        tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
        format!("http://{addr}")
    });
    // The governor, with limits that never bind (overhead only), counting
    // tokens by the labelled estimate (no extra round trip).
    let record = std::env::var_os("ENVELOPE_OVERHEAD_RECORD").is_some();
    let scrape = std::env::var_os("ENVELOPE_OVERHEAD_SCRAPE").is_some();
    let gov_rt = runtime(1);
    let start_governor = |recorder: Option<Arc<envelope_governor::recorder::Recorder>>| {
        gov_rt.block_on(async {
            let limits = Limits {
                max_context_tokens: 4096,
                max_output_tokens: 1024,
                max_concurrent_seqs: 100_000,
                max_kv_tokens_in_flight: 100_000_000,
                buckets: vec![],
            };
            let mut s = SettingsDraft::new(limits, "overhead");
            s.queue.max_queue_len = 100_000;
            let gov = Governor::new(s.check().expect("valid settings"));
            let mut state = GovernedUpstream::new(
                gov.clone(),
                &upstream,
                TokenCounter::Estimate {
                    bytes_per_token: 3.0,
                },
            );
            state.recorder = recorder;
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            tokio::spawn(envelope_governor::serve(
                l,
                Arc::new(state),
                std::future::pending(),
            ));
            (format!("http://{addr}"), gov)
        })
    };
    let (governed, gov) = start_governor(None);
    let record_file =
        std::env::temp_dir().join(format!("envelope-overhead-{}.jsonl", std::process::id()));
    let recorder = record.then(|| {
        envelope_governor::recorder::Recorder::start(
            envelope_governor::recorder::RecordSettings {
                path: record_file.clone(),
                max_bytes: 256 << 20,
                keep: 1,
                capacity: 65_536,
                salt: b"overhead".to_vec(),
            },
            Default::default(),
            Default::default(),
        )
        .unwrap()
    });
    let recorded = recorder.as_ref().map(|r| start_governor(Some(r.clone())).0);
    let client_rt = runtime(2);
    let cpu = envelope_telemetry::host::cpu_model().unwrap_or_else(|| "unknown CPU".into());
    let cores = envelope_telemetry::host::logical_cores();
    println!("machine: {cpu}, {cores} logical cores; {secs} s per run, open loop, loopback, non-streaming completions (16 tokens)");
    println!(
        "{:>10} | {:>8} | {:>7} | {:>7} | {:>12} | {:>8} | {:>8} | {:>8}",
        "rate req/s", "path", "sent", "ok", "thrpt req/s", "p50 ms", "p99 ms", "max ms"
    );
    let mut summary = vec![];
    let mut recorded_summary = vec![];
    let mut scrapes = vec![];
    for &rate in &rates {
        let mut paths = vec![("direct", upstream.clone()), ("governed", governed.clone())];
        if let Some(r) = &recorded {
            paths.push(("recorded", r.clone()));
        }
        // Warm the connection pools.
        for (_, base) in &paths {
            client_rt.block_on(open_loop(
                format!("{base}/v1/completions"),
                rate.min(200.0),
                0.5,
            ));
        }
        // Rotate the order over `reps` repetitions; report medians, so
        // one noisy run (other processes, timer jitter) does not decide.
        let mut per_path: Vec<Vec<(f64, f64, f64)>> = vec![vec![]; paths.len()];
        for rep in 0..reps {
            for j in 0..paths.len() {
                let k = (j + rep) % paths.len();
                let (name, base) = &paths[k];
                let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
                let scraper = (scrape && *name == "governed").then(|| {
                    client_rt.spawn(scrape_every_50ms(format!("{base}/metrics"), stop.clone()))
                });
                let r = client_rt.block_on(open_loop(format!("{base}/v1/completions"), rate, secs));
                if let Some(t) = scraper {
                    stop.store(true, std::sync::atomic::Ordering::Relaxed);
                    scrapes.push((rate, client_rt.block_on(t).unwrap()));
                }
                let thr = r.ok as f64 / r.wall_s;
                println!(
                    "{:>10.0} | {:>8} | {:>7} | {:>7} | {:>12.1} | {:>8.3} | {:>8.3} | {:>8.3}",
                    rate,
                    name,
                    r.sent,
                    r.ok,
                    thr,
                    ms(r.hist.value_at_quantile(0.5)),
                    ms(r.hist.value_at_quantile(0.99)),
                    ms(r.hist.max())
                );
                per_path[k].push((
                    ms(r.hist.value_at_quantile(0.5)),
                    ms(r.hist.value_at_quantile(0.99)),
                    thr,
                ));
            }
        }
        let med = |v: &Vec<(f64, f64, f64)>, f: fn(&(f64, f64, f64)) -> f64| {
            let mut x: Vec<f64> = v.iter().map(f).collect();
            x.sort_by(f64::total_cmp);
            x[x.len() / 2]
        };
        let (d, g) = (&per_path[0], &per_path[1]);
        summary.push((
            rate,
            med(d, |x| x.0),
            med(g, |x| x.0),
            med(d, |x| x.1),
            med(g, |x| x.1),
            med(g, |x| x.2) / med(d, |x| x.2),
        ));
        if let Some(rec) = per_path.get(2) {
            recorded_summary.push((
                rate,
                med(g, |x| x.1) - med(d, |x| x.1),
                med(rec, |x| x.1) - med(d, |x| x.1),
            ));
        }
    }
    println!();
    println!("medians over {reps} alternating runs per path:");
    println!(
        "{:>10} | {:>10} | {:>10} | {:>12} | {:>10} | {:>10} | {:>12} | {:>12}",
        "rate req/s",
        "p50 direct",
        "p50 gov",
        "added p50 ms",
        "p99 direct",
        "p99 gov",
        "added p99 ms",
        "thrpt gov/dir"
    );
    for (rate, d50, g50, d99, g99, ratio) in summary {
        println!(
            "{rate:>10.0} | {d50:>10.3} | {g50:>10.3} | {:>12.3} | {d99:>10.3} | {g99:>10.3} | {:>12.3} | {ratio:>12.3}",
            g50 - d50,
            g99 - d99
        );
    }
    if let Some(r) = &recorder {
        r.flush(Duration::from_secs(10));
        println!();
        println!(
            "recording: {} lines written, {} dropped ({})",
            r.written(),
            r.dropped(),
            record_file.display()
        );
        println!(
            "{:>10} | {:>18} | {:>18} | {:>14}",
            "rate req/s", "added p99 gov ms", "added p99 rec ms", "rec - gov ms"
        );
        for (rate, g, rec) in &recorded_summary {
            println!("{rate:>10.0} | {g:>18.3} | {rec:>18.3} | {:>14.3}", rec - g);
        }
        let _ = std::fs::remove_file(&record_file);
    }
    if !scrapes.is_empty() {
        println!();
        println!("/metrics of the governed path, scraped every 50 ms during its runs:");
        println!(
            "{:>10} | {:>8} | {:>8} | {:>8} | {:>8}",
            "rate req/s", "pages", "p50 ms", "p99 ms", "max ms"
        );
        for &rate in &rates {
            let mut all = Histogram::<u64>::new(3).unwrap();
            for (_, h) in scrapes.iter().filter(|(r, _)| *r == rate) {
                all.add(h).unwrap();
            }
            println!(
                "{rate:>10.0} | {:>8} | {:>8.3} | {:>8.3} | {:>8.3}",
                all.len(),
                ms(all.value_at_quantile(0.5)),
                ms(all.value_at_quantile(0.99)),
                ms(all.max())
            );
        }
    }
    let own = &gov.state_json()["added_latency_us"];
    println!();
    println!(
        "governor's own time, arrival to upstream send (HDR over all {} governed requests incl. warm-up): p50 {} us, p99 {} us, max {} us",
        own["count"], own["p50"], own["p99"], own["max"]
    );
    drop(client_rt);
    drop(gov_rt);
    drop(up_rt);
}
