//! Added latency of one budget decision: the time of `Store::decide` (the
//! call the proxy awaits before admission) for a request charged to four
//! buckets (requests, input and output tokens per minute, cost per day),
//! in process and in the Redis at `REDIS_URL`, with 1 and 16 callers at
//! once. Each admitted decision is settled (off the timed path, as the
//! proxy does). Prints p50/p99 in microseconds and decisions per second.
//!
//! `cargo run --release -p envelope-governor --example budget_latency -- [REDIS_URL] [DECISIONS]`
//! (scripts/budget-latency.sh starts a redis-server and runs it).

use envelope_governor::budget::bucket::Withdrawal;
use envelope_governor::budget::store::{Slot, Store};
use hdrhistogram::Histogram;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn slots(tenant: usize) -> Vec<Slot> {
    // Large budgets: every decision admits, so each is a full take.
    [
        ("rpm", 1e9, 60_000, 1.0),
        ("itpm", 1e12, 60_000, 300.0),
        ("otpm", 1e12, 60_000, 64.0),
        ("cpd", 1e9, 86_400_000, 0.0004),
    ]
    .iter()
    .map(|&(k, capacity, window_ms, amount)| Slot {
        key: format!("t/bench-{tenant}:{k}"),
        ask: Withdrawal {
            capacity,
            window_ms,
            amount,
            shadow: false,
        },
    })
    .collect()
}

async fn run(store: Arc<Store>, callers: usize, decisions: usize) -> (Histogram<u64>, f64) {
    let hist = Arc::new(Mutex::new(Histogram::<u64>::new(3).unwrap()));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..callers {
        let (store, hist) = (store.clone(), hist.clone());
        tasks.push(tokio::spawn(async move {
            let s = slots(c % 4);
            for _ in 0..decisions / callers {
                let t0 = Instant::now();
                let o = store.decide(&s).await.expect("the store answers");
                let us = t0.elapsed().as_micros() as u64;
                hist.lock().unwrap().record(us.max(1)).unwrap();
                assert!(o.admitted);
                let back: Vec<(Slot, f64)> = s.iter().map(|x| (x.clone(), 0.5)).collect();
                let st = store.clone();
                tokio::spawn(async move { st.settle(&back).await });
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let rate = decisions as f64 / start.elapsed().as_secs_f64();
    let h = hist.lock().unwrap().clone();
    (h, rate)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let url = args
        .first()
        .cloned()
        .unwrap_or_else(|| "redis://127.0.0.1:6379".into());
    let decisions: usize = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(20_000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        println!(
            "| store | callers | decisions | p50 us | p99 us | decisions/s |\n|---|---|---|---|---|---|"
        );
        let stores = [
            ("in process", Arc::new(Store::local())),
            (
                "redis (loopback)",
                Arc::new(Store::redis(&url, Duration::from_secs(1)).expect("a redis:// URL")),
            ),
        ];
        for (name, store) in stores {
            // Warm up: the connection, the script cached in Redis.
            run(store.clone(), 1, 200).await;
            for callers in [1, 16] {
                let (h, rate) = run(store.clone(), callers, decisions).await;
                println!(
                    "| {name} | {callers} | {} | {} | {} | {rate:.0} |",
                    h.len(),
                    h.value_at_quantile(0.5),
                    h.value_at_quantile(0.99)
                );
            }
        }
    });
}
