//! What each side measured, metric by metric: per configuration (memory),
//! per profile (quality) and per bucket (at each side's safe point), and
//! every rule evaluated on those figures.

use super::rules::{evaluate, metric_info, GateRules, Scope, METRICS};
use super::{bucket_name, BucketComparison, MetricDelta, RuleResult};
use crate::plan::safe_point_probe;
use crate::{ConfigResult, Profile};

fn delta(metric: &str, baseline: Option<f64>, candidate: Option<f64>) -> MetricDelta {
    MetricDelta {
        metric: metric.into(),
        unit: metric_info(metric).map(|m| m.1).unwrap_or("").into(),
        baseline,
        candidate,
        delta_pct: match (baseline, candidate) {
            (Some(b), Some(c)) if b != 0.0 => Some((c - b) / b * 100.0),
            _ => None,
        },
    }
}

fn bucket_metric(c: &ConfigResult, key: (u32, u32), metric: &str) -> Option<f64> {
    let b = c
        .buckets
        .iter()
        .find(|b| (b.input_tokens, b.output_tokens) == key)?;
    if metric == "safe_concurrency" {
        return Some(b.safe_concurrency as f64);
    }
    let (p, scale, _) = safe_point_probe(b)?;
    Some(match metric {
        "decode_tok_s" => p.decode_tok_per_s * scale,
        "prefill_tok_s" => p.prefill_tok_per_s * scale,
        "output_tok_s" => p.output_tok_per_s * scale,
        "ttft_p50_ms" => p.ttft_ms.p50,
        "ttft_p95_ms" => p.ttft_ms.p95,
        "ttft_p99_ms" => p.ttft_ms.p99,
        "itl_p50_ms" => p.itl_ms.p50,
        "itl_p95_ms" => p.itl_ms.p95,
        "itl_p99_ms" => p.itl_ms.p99,
        "e2e_p95_ms" => p.e2e_ms.p95,
        _ => return None,
    })
}

fn config_metric(c: &ConfigResult, metric: &str) -> Option<f64> {
    let m = &c.memory;
    match metric {
        "weight_bytes" => Some(m.weight_bytes as f64),
        "kv_capacity_tokens" => Some(m.kv_capacity_tokens as f64),
        "peak_bytes" => m.peak_bytes.map(|v| v as f64),
        _ => None,
    }
}

fn quality_metric(p: &Profile, metric: &str) -> Option<f64> {
    let q = p.quality.as_ref()?;
    match metric {
        "perplexity" => Some(q.perplexity),
        "kl_divergence" => q.kl_divergence_mean,
        "kl_divergence_p95" => q.kl_divergence_p95,
        "top1_agreement" => q.top1_agreement,
        _ => None,
    }
}

/// Both sides' figures, in `METRICS` order: configuration metrics, quality
/// metrics, and per bucket both configurations have.
pub(super) struct Measured {
    pub config: Vec<MetricDelta>,
    pub quality: Vec<MetricDelta>,
    pub buckets: Vec<BucketComparison>,
}

pub(super) fn compare(
    baseline: &Profile,
    candidate: &Profile,
    bc: &ConfigResult,
    cc: &ConfigResult,
) -> Measured {
    let mut out = Measured {
        config: vec![],
        quality: vec![],
        buckets: vec![],
    };
    for (m, scope, _) in METRICS {
        match scope {
            Scope::Config => out
                .config
                .push(delta(m, config_metric(bc, m), config_metric(cc, m))),
            Scope::Quality => out.quality.push(delta(
                m,
                quality_metric(baseline, m),
                quality_metric(candidate, m),
            )),
            Scope::Bucket => {}
        }
    }
    let probe_of = |c: &ConfigResult, k: (u32, u32)| {
        c.buckets
            .iter()
            .find(|b| (b.input_tokens, b.output_tokens) == k)
            .and_then(|b| safe_point_probe(b).map(|p| p.2))
            .unwrap_or_else(|| "no safe point".into())
    };
    let ck = super::comparable::bucket_keys(cc);
    for k in super::comparable::bucket_keys(bc)
        .into_iter()
        .filter(|k| ck.contains(k))
    {
        out.buckets.push(BucketComparison {
            bucket: bucket_name(k),
            baseline_probe: probe_of(bc, k),
            candidate_probe: probe_of(cc, k),
            metrics: METRICS
                .iter()
                .filter(|m| m.1 == Scope::Bucket)
                .map(|(m, _, _)| delta(m, bucket_metric(bc, k, m), bucket_metric(cc, k, m)))
                .collect(),
        });
    }
    out
}

/// Every rule on the measured figures: a per-bucket metric once per
/// compared bucket, the others once.
pub(super) fn rule_results(
    rules: &GateRules,
    measured: &Measured,
    baseline: &Profile,
    candidate: &Profile,
    bc: &ConfigResult,
    cc: &ConfigResult,
) -> Vec<RuleResult> {
    let mut out = vec![];
    for r in &rules.rules {
        let scope = metric_info(&r.metric).map(|m| m.0).unwrap_or(Scope::Config);
        let mut push = |bucket: Option<String>, b: Option<f64>, c: Option<f64>| {
            let (threshold, status) = evaluate(r, b, c);
            out.push(RuleResult {
                rule: r.text.clone(),
                bucket,
                baseline: b,
                candidate: c,
                threshold,
                status,
            });
        };
        match scope {
            Scope::Bucket => {
                for b in &measured.buckets {
                    let m = b.metrics.iter().find(|m| m.metric == r.metric);
                    push(
                        Some(b.bucket.clone()),
                        m.and_then(|m| m.baseline),
                        m.and_then(|m| m.candidate),
                    );
                }
            }
            Scope::Config => push(
                None,
                config_metric(bc, &r.metric),
                config_metric(cc, &r.metric),
            ),
            Scope::Quality => push(
                None,
                quality_metric(baseline, &r.metric),
                quality_metric(candidate, &r.metric),
            ),
        }
    }
    out
}
