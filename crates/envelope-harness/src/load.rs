//! Closed-loop load on the in-process engine: `concurrency` workers, each
//! submitting its next request as soon as the last one finishes, until the
//! probe's request count is issued. A monitor samples KV use meanwhile.

use crate::config::Bucket;
use envelope_engine::{EngineHandle, Event, GenerateRequest, SamplingParams};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Default)]
pub struct RequestRecord {
    pub worker: u32,
    /// Seconds from the probe start to submission.
    pub start_s: f64,
    pub ttft_s: Option<f64>,
    pub e2e_s: f64,
    pub itl_s: Vec<f64>,
    pub input_tokens: u32,
    pub output_tokens: u32,
    pub preemptions: u32,
    pub error: Option<String>,
}

#[derive(Debug, Clone, Default)]
pub struct ProbeRun {
    pub records: Vec<RequestRecord>,
    pub duration_s: f64,
    pub kv_usage_max: f64,
    pub preemptions: u64,
    pub peak_rss_bytes: Option<u64>,
    /// Longest gap between a worker's request finishing and its next submission.
    pub max_client_gap_s: f64,
}

pub use envelope_engine::util::synthetic_prompt;

pub fn closed_loop(
    engine: &EngineHandle,
    bucket: Bucket,
    concurrency: u32,
    total_requests: u32,
    salt: u64,
) -> ProbeRun {
    let vocab = engine.info.model.config.vocab_size;
    let issued = Arc::new(AtomicU64::new(0));
    let records = Arc::new(Mutex::new(Vec::new()));
    let gap = Arc::new(Mutex::new(0f64));
    let stop = Arc::new(AtomicBool::new(false));
    let preempt_before = engine.metrics.preemptions_total.load(Ordering::Relaxed);
    let start = Instant::now();
    let monitor = {
        let (m, stop) = (engine.metrics.clone(), stop.clone());
        std::thread::spawn(move || {
            let (mut kv, mut rss) = (0f64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                kv = kv.max(m.kv_usage());
                rss = rss.max(
                    envelope_telemetry::host::sample(None)
                        .process_rss_bytes
                        .unwrap_or(0),
                );
                std::thread::sleep(Duration::from_millis(10));
            }
            (kv.max(m.kv_usage()), rss)
        })
    };
    let workers: Vec<_> = (0..concurrency)
        .map(|w| {
            let (engine, issued, records, gap) =
                (engine.clone(), issued.clone(), records.clone(), gap.clone());
            std::thread::spawn(move || {
                let mut last_end: Option<Instant> = None;
                loop {
                    let n = issued.fetch_add(1, Ordering::Relaxed);
                    if n >= total_requests as u64 {
                        return;
                    }
                    let t0 = Instant::now();
                    if let Some(e) = last_end {
                        let g = t0.duration_since(e).as_secs_f64();
                        let mut m = gap.lock().unwrap();
                        *m = m.max(g);
                    }
                    let mut rec = RequestRecord {
                        worker: w,
                        start_s: t0.duration_since(start).as_secs_f64(),
                        input_tokens: bucket.input_tokens,
                        ..Default::default()
                    };
                    let req = GenerateRequest {
                        prompt_tokens: synthetic_prompt(
                            bucket.input_tokens as usize,
                            vocab,
                            salt.wrapping_add(n),
                        ),
                        params: SamplingParams {
                            ignore_eos: true,
                            ..SamplingParams::greedy(bucket.output_tokens as usize)
                        },
                    };
                    match engine.submit(req) {
                        Err(e) => rec.error = Some(e.to_string()),
                        Ok(mut rx) => {
                            let mut last = t0;
                            loop {
                                match rx.blocking_recv() {
                                    Some(Event::Token { at, .. }) => {
                                        if rec.ttft_s.is_none() {
                                            rec.ttft_s = Some(at.duration_since(t0).as_secs_f64());
                                        } else {
                                            rec.itl_s.push(at.duration_since(last).as_secs_f64());
                                        }
                                        last = at;
                                        rec.output_tokens += 1;
                                    }
                                    Some(Event::Done { preemptions, .. }) => {
                                        rec.preemptions = preemptions;
                                        break;
                                    }
                                    Some(Event::Error(e)) => {
                                        rec.error = Some(e);
                                        break;
                                    }
                                    None => {
                                        rec.error = Some("the engine stopped".into());
                                        break;
                                    }
                                }
                            }
                        }
                    }
                    let end = Instant::now();
                    rec.e2e_s = end.duration_since(t0).as_secs_f64();
                    last_end = Some(end);
                    records.lock().unwrap().push(rec);
                }
            })
        })
        .collect();
    for w in workers {
        let _ = w.join();
    }
    let duration_s = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let (kv_usage_max, rss) = monitor.join().unwrap_or((0.0, 0));
    let mut records = std::mem::take(&mut *records.lock().unwrap());
    records.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
    let max_client_gap_s = *gap.lock().unwrap();
    ProbeRun {
        records,
        duration_s,
        kv_usage_max,
        preemptions: engine.metrics.preemptions_total.load(Ordering::Relaxed) - preempt_before,
        peak_rss_bytes: (rss > 0).then_some(rss),
        max_client_gap_s,
    }
}
