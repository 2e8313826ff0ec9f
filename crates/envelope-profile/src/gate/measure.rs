//! What each side measured, metric by metric: per configuration (memory),
//! per profile (quality) and per bucket (at each side's safe point), and
//! every rule evaluated on those figures.

use super::rules::{evaluate, metric_info, GateRules, Op, Rule, Scope, METRICS};
use super::{bucket_name, BucketComparison, MetricDelta, RuleResult, RuleStatus};
use crate::confidence::{compare_repeats, Decision};
use crate::plan::safe_point_probe;
use crate::{BucketResult, ConfigResult, ProbeSummary, Profile};

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
    let b = bucket_of(c, key)?;
    if metric == "safe_concurrency" {
        return Some(b.safe_concurrency as f64);
    }
    // Rates scale with the concurrency (a feasible probe's figures scaled
    // down to the safe point); latencies do not.
    let (p, scale, _) = safe_point_probe(b)?;
    let v = probe_metric(p, metric)?;
    Some(if metric.ends_with("_tok_s") {
        v * scale
    } else {
        v
    })
}

/// A probe's figure for a per-bucket metric (not `safe_concurrency`).
fn probe_metric(p: &ProbeSummary, metric: &str) -> Option<f64> {
    Some(match metric {
        "decode_tok_s" => p.decode_tok_per_s,
        "prefill_tok_s" => p.prefill_tok_per_s,
        "output_tok_s" => p.output_tok_per_s,
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

fn bucket_of(c: &ConfigResult, key: (u32, u32)) -> Option<&BucketResult> {
    c.buckets
        .iter()
        .find(|b| b.is_cold() && (b.input_tokens, b.output_tokens) == key)
}

/// Each repeat's figure for `metric` in a bucket: its safe concurrency,
/// or its figure at concurrency `at`, from its valid probes inside the
/// SLOs: the one at `at`, else the line between the nearest below and
/// above it, else (nothing above) the nearest below with rates scaled by
/// `at` over its concurrency, as a single search's safe point is. Empty
/// without repeats.
fn repeat_values(b: &BucketResult, metric: &str, at: u32) -> Vec<f64> {
    b.repeats
        .iter()
        .filter_map(|r| {
            if metric == "safe_concurrency" {
                return Some(r.safe_concurrency as f64);
            }
            let ok = r.probes.iter().filter(|p| p.valid && p.breaches.is_empty());
            let below = ok
                .clone()
                .filter(|p| p.concurrency <= at)
                .max_by_key(|p| p.concurrency)?;
            let above = ok
                .filter(|p| p.concurrency > at)
                .min_by_key(|p| p.concurrency);
            let v = probe_metric(below, metric)?;
            if below.concurrency == at {
                return Some(v);
            }
            let (c0, x) = (below.concurrency as f64, at as f64);
            Some(
                match above.and_then(|p| Some((p.concurrency as f64, probe_metric(p, metric)?))) {
                    Some((c1, v1)) => v + (v1 - v) * (x - c0) / (c1 - c0),
                    None if metric.ends_with("_tok_s") && c0 > 0.0 => v * x / c0,
                    None => v,
                },
            )
        })
        .collect()
}

/// A relative rule on per-repeat figures of both sides, compared at the
/// lower of the two safe concurrencies; `None` where a side has none (the
/// point rule then applies).
fn repeat_rule(
    rules: &GateRules,
    r: &Rule,
    bc: &ConfigResult,
    cc: &ConfigResult,
    key: (u32, u32),
) -> Option<(
    RuleStatus,
    crate::confidence::RepeatComparison,
    (usize, usize),
)> {
    let (b, c) = (bucket_of(bc, key)?, bucket_of(cc, key)?);
    let at = b.safe_concurrency.min(c.safe_concurrency);
    let (bv, cv) = (
        repeat_values(b, &r.metric, at),
        repeat_values(c, &r.metric, at),
    );
    let higher_is_better = matches!(r.op, Op::Ge | Op::Gt);
    let cmp = compare_repeats(
        &bv,
        &cv,
        r.number,
        higher_is_better,
        rules.confidence,
        rules.noise_floor,
    )?;
    let status = match cmp.decision {
        Decision::Holds => RuleStatus::Pass,
        Decision::Breached => RuleStatus::Fail,
        Decision::Undecided => RuleStatus::Inconclusive,
    };
    Some((status, cmp, (bv.len(), cv.len())))
}

/// A bucket's safe concurrency as the interval the sweep decided it
/// within (`safe_concurrency` to `safe_upper`; a search that stopped at
/// its cap measured no higher, so its interval is the point; `None` above
/// when no breach above was decided). `None` for profiles from before
/// decided verdicts.
fn safe_interval(b: &BucketResult) -> Option<(f64, Option<f64>)> {
    let decided = b.feasible_upper.is_some() || b.probes.iter().any(|p| !p.slo_checks.is_empty());
    let lo = b.safe_concurrency as f64;
    let hi = match b.safe_upper {
        Some(u) => Some(u),
        None if b.binding_constraint == crate::Constraint::SearchCap => Some(lo),
        None => None,
    };
    decided.then_some((lo, hi))
}

/// A rule decided on the safe intervals: its status, the ratio of the
/// safe points to the threshold, and that ratio's interval.
type IntervalDecision = (RuleStatus, f64, Option<(f64, f64)>);

/// `safe_concurrency >= F x baseline` on the two sides' decided intervals
/// (one search a side): it fails when even the candidate's upper end is
/// under F x the baseline's safe point, passes when the candidate's safe
/// point is within the noise floor of F x the baseline's upper end, and
/// is inconclusive between. Returns the status, the ratio of the safe
/// points to the threshold and the interval of that ratio.
fn safe_interval_rule(
    rules: &GateRules,
    r: &Rule,
    b: &BucketResult,
    c: &BucketResult,
) -> Option<IntervalDecision> {
    if r.metric != "safe_concurrency" || !matches!(r.op, Op::Ge | Op::Gt) {
        return None;
    }
    let ((b_lo, b_hi), (c_lo, c_hi)) = (safe_interval(b)?, safe_interval(c)?);
    let t = r.number * b_lo;
    if t <= 0.0 {
        return None;
    }
    let status = if c_hi.is_some_and(|h| !r.op.holds(h, t)) {
        RuleStatus::Fail
    } else if b_hi.is_some_and(|h| r.op.holds(c_lo, r.number * h * (1.0 - rules.noise_floor))) {
        RuleStatus::Pass
    } else {
        RuleStatus::Inconclusive
    };
    let interval = b_hi
        .zip(c_hi)
        .map(|(bh, ch)| (c_lo / (r.number * bh), ch / t));
    Some((status, c_lo / t, interval))
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
            .find(|b| b.is_cold() && (b.input_tokens, b.output_tokens) == k)
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
    let point = |r: &Rule, bucket: Option<String>, b: Option<f64>, c: Option<f64>| {
        let (threshold, status) = evaluate(r, b, c);
        RuleResult {
            rule: r.text.clone(),
            bucket,
            baseline: b,
            candidate: c,
            threshold,
            status,
            method: "point",
            ratio: None,
            interval: None,
            repeats: None,
            repeats_needed: None,
        }
    };
    let mut out = vec![];
    for r in &rules.rules {
        let scope = metric_info(&r.metric).map(|m| m.0).unwrap_or(Scope::Config);
        match scope {
            Scope::Bucket => {
                for b in &measured.buckets {
                    let m = b.metrics.iter().find(|m| m.metric == r.metric);
                    let mut result = point(
                        r,
                        Some(b.bucket.clone()),
                        m.and_then(|m| m.baseline),
                        m.and_then(|m| m.candidate),
                    );
                    // Per-repeat figures on both sides decide a relative
                    // rule instead of the one figure a side.
                    let key = b
                        .bucket
                        .split_once('x')
                        .and_then(|(i, o)| Some((i.parse().ok()?, o.parse().ok()?)));
                    let repeats = key
                        .filter(|_| r.relative_to_baseline)
                        .and_then(|k| repeat_rule(rules, r, bc, cc, k));
                    if let Some((status, cmp, n)) = repeats {
                        result.status = status;
                        result.method = cmp.method;
                        result.ratio = Some(cmp.ratio);
                        result.interval = cmp.interval;
                        result.repeats = Some(n);
                        result.repeats_needed = cmp.repeats_needed;
                    } else if let Some((status, ratio, interval)) = key
                        .filter(|_| r.relative_to_baseline)
                        .and_then(|k| Some((bucket_of(bc, k)?, bucket_of(cc, k)?)))
                        .and_then(|(b, c)| safe_interval_rule(rules, r, b, c))
                    {
                        // One decided search a side: the safe points'
                        // intervals.
                        result.status = status;
                        result.method = "safe_interval";
                        result.ratio = Some(ratio);
                        result.interval = interval;
                    }
                    out.push(result);
                }
            }
            Scope::Config => out.push(point(
                r,
                None,
                config_metric(bc, &r.metric),
                config_metric(cc, &r.metric),
            )),
            Scope::Quality => out.push(point(
                r,
                None,
                quality_metric(baseline, &r.metric),
                quality_metric(candidate, &r.metric),
            )),
        }
    }
    out
}
