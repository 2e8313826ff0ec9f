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

/// Least free memory over the GPUs NVML sees (None without NVML).
pub fn gpu_free_bytes(nvml: Option<&Nvml>) -> Option<u64> {
    let n = nvml?;
    (0..n.device_count())
        .filter_map(|i| n.sample(i, None).memory_free_bytes)
        .min()
}

/// Polls `metrics_url` every `interval` until the task is aborted.
pub fn spawn_guard(
    gov: Arc<Governor>,
    metrics_url: String,
    interval: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let nvml = tokio::task::spawn_blocking(|| Nvml::init().ok())
            .await
            .ok()
            .flatten();
        let nvml = nvml.map(Arc::new);
        let mut last_err: Option<String> = None;
        loop {
            let state = envelope_telemetry::fetch_engine_state(
                &metrics_url,
                interval.max(Duration::from_millis(500)),
            )
            .await;
            match &state {
                Err(e) if last_err.as_deref() != Some(&e.to_string()) => {
                    tracing::warn!("live guard: {e} (counts as unhealthy)");
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
            gov.observe(reading(state, free));
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

/// Limits halved (at least 1), for a profile that does not match the node.
pub fn conservative(l: &envelope_profile::Limits) -> envelope_profile::Limits {
    let h = |v: u64| (v / 2).max(1);
    envelope_profile::Limits {
        max_context_tokens: l.max_context_tokens,
        max_output_tokens: l.max_output_tokens,
        max_concurrent_seqs: h(l.max_concurrent_seqs),
        max_kv_tokens_in_flight: h(l.max_kv_tokens_in_flight),
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
        let l = conservative(&profile(json!({})).limits);
        assert_eq!((l.max_concurrent_seqs, l.max_kv_tokens_in_flight), (2, 50));
        assert_eq!(l.max_context_tokens, 100);
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
