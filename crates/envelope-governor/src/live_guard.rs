//! The world outside: the live-guard poller (upstream `/metrics` through
//! `envelope_telemetry::fetch_engine_state`, GPU free memory through NVML
//! when present) feeding the ladder, and the start-up profile check (the
//! profile's fingerprint against the live node and the upstream's model id).

use crate::admission::Governor;
use crate::ladder::Reading;
use envelope_profile::Profile;
use envelope_telemetry::Nvml;
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;

/// Reduces one poll to a ladder reading.
pub fn reading(
    state: Result<envelope_telemetry::EngineState, envelope_telemetry::MetricsError>,
    gpu_free_bytes: Option<u64>,
) -> Reading {
    match state {
        Ok(s) => Reading {
            now_ms: 0,
            ok: true,
            kv_usage: s.kv_usage,
            preemptions_total: s.preemptions_total,
            gpu_free_bytes,
            upstream_errors: 0,
        },
        Err(_) => Reading {
            now_ms: 0,
            ok: false,
            kv_usage: None,
            preemptions_total: None,
            gpu_free_bytes,
            upstream_errors: 0,
        },
    }
}

/// Whether the upstream's metrics endpoint is a signal at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricsSignal {
    /// Nothing polled yet.
    Unknown,
    /// Never answered with usable metrics (404, refused, not Prometheus,
    /// no known engine): the guard runs without it, on what the governor
    /// observes itself (proxied latency, upstream errors) and NVML.
    Absent,
    /// Answered at least once: from then on a failed poll is a stale
    /// reading, which counts as unhealthy.
    Present,
}

/// Tells an endpoint that was never there from one that went quiet, so a
/// server without Prometheus metrics does not read as a server in trouble.
/// Plain data: feed it each poll's outcome.
#[derive(Debug, Clone)]
pub struct MetricsWatch {
    pub signal: MetricsSignal,
    url: String,
}

impl MetricsWatch {
    pub fn new(url: &str) -> MetricsWatch {
        MetricsWatch {
            signal: MetricsSignal::Unknown,
            url: url.to_string(),
        }
    }

    /// The ladder reading for one poll, and a line to log when what the
    /// guard can see changed.
    pub fn reading(
        &mut self,
        state: Result<envelope_telemetry::EngineState, envelope_telemetry::MetricsError>,
        gpu_free_bytes: Option<u64>,
    ) -> (Reading, Option<String>) {
        let url = &self.url;
        match (&state, self.signal) {
            (Ok(s), before) => {
                self.signal = MetricsSignal::Present;
                let mut lacking = vec![];
                if s.kv_usage.is_none() {
                    lacking.push("kv_usage");
                }
                if s.preemptions_total.is_none() {
                    lacking.push("preemptions");
                }
                let line = (before != MetricsSignal::Present).then(|| {
                    let has = format!("{:?} metrics at {url}", s.engine);
                    if lacking.is_empty() {
                        format!("live guard: {has}: guarding on kv_usage and preemptions, proxied latency and upstream errors")
                    } else {
                        format!(
                            "live guard: {has} lack {}: guarding on what they have, proxied latency and upstream errors",
                            lacking.join(" and ")
                        )
                    }
                });
                (reading(state, gpu_free_bytes), line)
            }
            (Err(e), MetricsSignal::Unknown | MetricsSignal::Absent) => {
                let line = (self.signal == MetricsSignal::Unknown).then(|| {
                    format!(
                        "live guard: no usable metrics at {url} ({e}): missing signals kv_usage and preemptions; guarding on proxied latency, upstream errors{} only",
                        if gpu_free_bytes.is_some() { " and GPU free memory" } else { "" }
                    )
                });
                self.signal = MetricsSignal::Absent;
                // Not a stale reading: there was never anything to go stale.
                let r = Reading {
                    now_ms: 0,
                    ok: true,
                    kv_usage: None,
                    preemptions_total: None,
                    gpu_free_bytes,
                    upstream_errors: 0,
                };
                (r, line)
            }
            (Err(_), MetricsSignal::Present) => (reading(state, gpu_free_bytes), None),
        }
    }
}

/// Least free memory over the GPUs NVML sees (None without NVML).
pub fn gpu_free_bytes(nvml: Option<&Nvml>) -> Option<u64> {
    let n = nvml?;
    (0..n.device_count())
        .filter_map(|i| n.sample(i, None).memory_free_bytes)
        .min()
}

/// Polls `metrics_url` every `interval` until the task is aborted; with
/// `note_waiting`, its readings are also the engine's waiting count (else a
/// faster poller, `--engine-metrics`, gives that).
pub fn spawn_guard(
    gov: Arc<Governor>,
    metrics_url: String,
    interval: Duration,
    note_waiting: bool,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let nvml = tokio::task::spawn_blocking(|| Nvml::init().ok())
            .await
            .ok()
            .flatten();
        let nvml = nvml.map(Arc::new);
        let mut last_err: Option<String> = None;
        let mut watch = MetricsWatch::new(&metrics_url);
        loop {
            let state = envelope_telemetry::fetch_engine_state(
                &metrics_url,
                interval.max(Duration::from_millis(500)),
            )
            .await;
            match &state {
                Err(e)
                    if watch.signal == MetricsSignal::Present
                        && last_err.as_deref() != Some(&e.to_string()) =>
                {
                    tracing::warn!(
                        "live guard: {e} (metrics that worked went stale: counts as unhealthy)"
                    );
                    last_err = Some(e.to_string());
                }
                Ok(_) => last_err = None,
                _ => {}
            }
            let free = match nvml.clone() {
                Some(n) => tokio::task::spawn_blocking(move || gpu_free_bytes(Some(&n)))
                    .await
                    .ok()
                    .flatten(),
                None => None,
            };
            if note_waiting {
                gov.note_engine_waiting(state.as_ref().ok().and_then(|s| s.waiting));
            }
            // What the server says of its prefix cache checks the
            // governor's estimate of it (crate::prefix_cache).
            if let Ok(s) = &state {
                gov.prefix.polled(&crate::prefix_cache::ServerReport {
                    caching: s.prefix_caching,
                    counters: s.prefix_cache_queries_total.zip(s.prefix_cache_hits_total),
                    kv_capacity_tokens: s.kv_capacity_tokens,
                    block_size: s.kv_block_size,
                });
            }
            let (r, line) = watch.reading(state, free);
            if let Some(line) = line {
                match watch.signal {
                    MetricsSignal::Absent => tracing::warn!("{line}"),
                    _ => tracing::info!("{line}"),
                }
            }
            gov.observe(r);
            tokio::time::sleep(interval).await;
        }
    })
}

/// Differences between the profile's fingerprint and what is live, as
/// human-readable lines (empty when everything checked matches). `models`
/// is the upstream's `/v1/models` answer; `gpus` the live (name, memory).
pub fn fingerprint_mismatches(
    profile: &Profile,
    models: Option<&Value>,
    gpus: &[(Option<String>, Option<u64>)],
) -> Vec<String> {
    let mut out = vec![];
    let fp = &profile.fingerprint;
    if let Some(models) = models {
        let ids: Vec<&str> = models
            .get("data")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|m| m.get("id").and_then(Value::as_str))
                    .collect()
            })
            .unwrap_or_default();
        let want = fp
            .pointer("/model/id")
            .or_else(|| fp.pointer("/model/name"))
            .or_else(|| fp.pointer("/model/preset"))
            .and_then(Value::as_str);
        if let Some(want) = want {
            let stem = want.trim_end_matches(".gguf");
            if !ids
                .iter()
                .any(|id| *id == want || id.contains(stem) || stem.contains(*id))
            {
                out.push(format!(
                    "model: the profile was measured on `{want}`, the upstream serves {ids:?}"
                ));
            }
        }
    }
    let want_gpus: Vec<(Option<String>, Option<u64>)> = fp
        .pointer("/node/gpus")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .map(|g| {
                    (
                        g.get("name").and_then(Value::as_str).map(str::to_string),
                        g.get("memory_total_bytes").and_then(Value::as_u64),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    if want_gpus.len() != gpus.len() {
        out.push(format!(
            "GPUs: the profile has {}, this node has {}",
            want_gpus.len(),
            gpus.len()
        ));
    } else {
        for (i, (w, h)) in want_gpus.iter().zip(gpus).enumerate() {
            if w.0.is_some() && h.0.is_some() && w.0 != h.0 {
                out.push(format!("GPU {i}: profile {:?}, live {:?}", w.0, h.0));
            }
            if let (Some(a), Some(b)) = (w.1, h.1) {
                if a != b {
                    out.push(format!("GPU {i} memory: profile {a} bytes, live {b} bytes"));
                }
            }
        }
    }
    out
}

/// Limits halved (at least 1), for a profile that does not match the node:
/// concurrency, KV budget, and each bucket's safe concurrency.
pub fn conservative(l: &envelope_profile::Limits) -> envelope_profile::Limits {
    let h = |v: u64| (v / 2).max(1);
    let buckets = l
        .buckets
        .iter()
        .map(|b| envelope_profile::BucketLimit {
            safe_concurrency: h(b.safe_concurrency),
            concurrency_after_headroom: b.concurrency_after_headroom.map(|c| (c / 2.0).max(1.0)),
            kv_tokens: h(b.safe_concurrency) * b.total_tokens(),
            ..b.clone()
        })
        .collect();
    envelope_profile::Limits {
        max_context_tokens: l.max_context_tokens,
        max_output_tokens: l.max_output_tokens,
        max_concurrent_seqs: h(l.max_concurrent_seqs),
        max_kv_tokens_in_flight: h(l.max_kv_tokens_in_flight),
        buckets,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envelope_profile::PROFILE_SCHEMA;
    use serde_json::json;

    fn profile(fp: Value) -> Profile {
        let text = json!({"schema": PROFILE_SCHEMA, "created_unix_ms": 0, "fingerprint": fp,
            "slo": {"ttft_p95_ms": null, "itl_p95_ms": null, "e2e_p99_ms": null},
            "configs": [], "selected": "x", "probes_total": 0,
            "limits": {"max_context_tokens": 100, "max_output_tokens": 10,
                       "max_concurrent_seqs": 5, "max_kv_tokens_in_flight": 101}});
        Profile::from_json(&text.to_string(), "test").unwrap()
    }

    #[test]
    fn model_and_gpu_mismatches_are_named() {
        let p = profile(json!({"model": {"kind": "file", "name": "SmolLM2.gguf"},
            "node": {"gpus": [{"name": "NVIDIA H200", "memory_total_bytes": 100}]}}));
        let models = json!({"data": [{"id": "SmolLM2.gguf"}]});
        let live = [(Some("NVIDIA H200".to_string()), Some(100))];
        assert!(fingerprint_mismatches(&p, Some(&models), &live).is_empty());
        let other = json!({"data": [{"id": "llama"}]});
        let m = fingerprint_mismatches(&p, Some(&other), &[]);
        assert_eq!(m.len(), 2, "{m:?}");
        assert!(m[0].contains("llama") && m[1].contains("GPUs"));
        let live = [(Some("NVIDIA A100".to_string()), Some(80))];
        assert_eq!(fingerprint_mismatches(&p, None, &live).len(), 2);
    }

    #[test]
    fn conservative_halves_capacity() {
        let l = conservative(profile(json!({})).limits.as_ref().unwrap());
        assert_eq!((l.max_concurrent_seqs, l.max_kv_tokens_in_flight), (2, 50));
        assert_eq!(l.max_context_tokens, 100);
        assert_eq!(l.buckets[0].safe_concurrency, 2);
    }

    fn envelope_metrics(
    ) -> Result<envelope_telemetry::EngineState, envelope_telemetry::MetricsError> {
        envelope_telemetry::parse_engine_state(
            "# TYPE envelope:kv_cache_usage_perc gauge\nenvelope:kv_cache_usage_perc 0.5\n",
        )
    }

    fn missing() -> Result<envelope_telemetry::EngineState, envelope_telemetry::MetricsError> {
        Err(envelope_telemetry::MetricsError::Http {
            url: "http://u/metrics".into(),
            status: 404,
            said: String::new(),
        })
    }

    #[test]
    fn metrics_absent_from_the_start_are_not_unhealthy() {
        let mut w = MetricsWatch::new("http://u/metrics");
        let (r, line) = w.reading(missing(), None);
        assert!(r.ok, "an endpoint that never answered is not a stale one");
        assert_eq!(w.signal, MetricsSignal::Absent);
        let line = line.unwrap();
        assert!(line.contains("404") && line.contains("kv_usage"), "{line}");
        // Said once, not every poll.
        let (r, line) = w.reading(missing(), None);
        assert!(r.ok && line.is_none());
        // It appears: from then on it is a signal, and going quiet is stale.
        let (r, line) = w.reading(envelope_metrics(), None);
        assert!(r.ok && r.kv_usage == Some(0.5));
        assert!(line.unwrap().contains("preemptions"));
        let (r, _) = w.reading(missing(), None);
        assert!(!r.ok);
        assert_eq!(w.signal, MetricsSignal::Present);
    }

    #[test]
    fn absent_metrics_keep_the_ladder_normal() {
        use crate::ladder::{Ladder, LadderSettings, Level};
        let mut ladder = Ladder::new(LadderSettings::default(), 0);
        let mut w = MetricsWatch::new("http://u/metrics");
        for t in 0..60u64 {
            let (r, _) = w.reading(missing(), None);
            ladder.observe(Reading {
                now_ms: t * 1000,
                ..r
            });
        }
        assert_eq!(ladder.level(), Level::Normal);
        // The same failures after metrics worked: stale, then reject.
        let mut ladder = Ladder::new(LadderSettings::default(), 0);
        let mut w = MetricsWatch::new("http://u/metrics");
        let (r, _) = w.reading(envelope_metrics(), None);
        ladder.observe(Reading { now_ms: 0, ..r });
        for t in 1..60u64 {
            let (r, _) = w.reading(missing(), None);
            ladder.observe(Reading {
                now_ms: t * 1000,
                ..r
            });
        }
        assert_eq!(ladder.level(), Level::RejectNew);
    }

    #[test]
    fn failed_poll_is_an_unhealthy_reading() {
        let r = reading(
            Err(envelope_telemetry::MetricsError::UnknownEngine),
            Some(5),
        );
        assert!(!r.ok);
        assert_eq!(r.gpu_free_bytes, Some(5));
        let s = envelope_telemetry::parse_engine_state(
            "# TYPE envelope:kv_cache_usage_perc gauge\nenvelope:kv_cache_usage_perc 0.5\n# TYPE envelope:num_preemptions_total counter\nenvelope:num_preemptions_total 3\n",
        );
        let r = reading(s, None);
        assert!(r.ok);
        assert_eq!(r.kv_usage, Some(0.5));
    }
}
