//! The gate report as Markdown (what the CLI prints and writes as gate.md).

use super::{GateReport, MetricDelta, RuleResult, RuleStatus, Side, Verdict};

fn num(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(v) if v == v.trunc() && v.abs() < 1e15 => format!("{v:.0}"),
        Some(v) if v.abs() >= 100.0 => format!("{v:.1}"),
        Some(v) if v.abs() >= 1.0 => format!("{v:.3}"),
        Some(v) => format!("{v:.5}"),
    }
}

fn pct(v: Option<f64>) -> String {
    v.map(|v| format!("{v:+.1}%")).unwrap_or_else(|| "-".into())
}

fn table(out: &mut String, rows: &[MetricDelta]) {
    out.push_str("| metric | unit | baseline | candidate | delta |\n|---|---|---:|---:|---:|\n");
    for m in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} |\n",
            m.metric,
            m.unit,
            num(m.baseline),
            num(m.candidate),
            pct(m.delta_pct)
        ));
    }
}

/// How a rule was decided, for the table: the point figures, or the
/// ratio to the threshold with its interval and the repeats compared.
fn decided_by(x: &RuleResult) -> String {
    let n = x
        .repeats
        .map(|(b, c)| format!(", {b} / {c} repeats"))
        .unwrap_or_default();
    match (x.method, x.ratio, x.interval) {
        ("point", _, _) => "one figure a side".into(),
        ("safe_interval", Some(ratio), Some((lo, hi))) => {
            format!("safe intervals, ratio {ratio:.3} ({lo:.3}-{hi:.3})")
        }
        (_, Some(ratio), Some((lo, hi))) => {
            format!("ratio {ratio:.3} ({lo:.3}-{hi:.3}){n}")
        }
        (m, Some(ratio), None) => format!("ratio {ratio:.3}, {}{n}", m.replace('_', " ")),
        (m, _, _) => m.replace('_', " "),
    }
}

/// The report as Markdown (also what the CLI prints).
pub fn markdown(r: &GateReport) -> String {
    let mut o = String::new();
    let verdict = match r.verdict {
        Verdict::Pass => "PASS",
        Verdict::Fail => "FAIL",
        Verdict::Unusable => "UNUSABLE INPUT",
        Verdict::Inconclusive => "INCONCLUSIVE",
    };
    o.push_str(&format!("# Gate: {verdict}\n\n"));
    let side = |s: &Option<Side>| {
        s.as_ref()
            .map(|s| {
                format!(
                    "`{}` (precision {}, KV {}, {}; quality against {})",
                    s.config,
                    s.precision,
                    s.kv_dtype,
                    s.batch_policy,
                    s.quality_reference.as_deref().unwrap_or("-")
                )
            })
            .unwrap_or_else(|| "-".into())
    };
    o.push_str(&format!(
        "- baseline: {}\n- candidate: {}\n\n",
        side(&r.baseline),
        side(&r.candidate)
    ));
    if !r.unusable_reasons.is_empty() {
        o.push_str("## Not comparable\n\n");
        for u in &r.unusable_reasons {
            o.push_str(&format!("- {u}\n"));
        }
        o.push('\n');
    }
    if !r.differences.is_empty() {
        o.push_str(
            "## What differs\n\n| field | baseline | candidate | counts as |\n|---|---|---|---|\n",
        );
        for d in &r.differences {
            o.push_str(&format!(
                "| `{}` | {} | {} | {} |\n",
                d.field, d.baseline, d.candidate, d.kind
            ));
        }
        o.push('\n');
    }
    if !r.rules.is_empty() {
        o.push_str("## Rules\n\n| rule | bucket | baseline | candidate | threshold | decided by | result |\n|---|---|---:|---:|---:|---|---|\n");
        for x in &r.rules {
            let s = match x.status {
                RuleStatus::Pass => "pass".to_string(),
                RuleStatus::Fail => "**FAIL**".into(),
                RuleStatus::Missing => "**FAIL** (not measured)".into(),
                RuleStatus::Inconclusive => match x.repeats_needed {
                    Some(n) => format!("inconclusive (about {n} repeats a side would decide it)"),
                    None => "inconclusive".into(),
                },
            };
            o.push_str(&format!(
                "| `{}` | {} | {} | {} | {} | {} | {} |\n",
                x.rule,
                x.bucket.as_deref().unwrap_or("-"),
                num(x.baseline),
                num(x.candidate),
                num(x.threshold),
                decided_by(x),
                s
            ));
        }
        o.push_str(&format!(
            "Per-repeat rules are decided at {:.0}% confidence; with one repeat a side, only past the noise floor of {:.0}%. The ratio is the candidate over the threshold.\n\n",
            r.confidence * 100.0,
            r.noise_floor * 100.0
        ));
    }
    if !r.config_metrics.is_empty() {
        o.push_str("## Memory\n\n");
        table(&mut o, &r.config_metrics);
        o.push_str("\n## Quality\n\n");
        table(&mut o, &r.quality_metrics);
        o.push('\n');
    }
    for b in &r.buckets {
        o.push_str(&format!(
            "## Bucket {} (input x output tokens)\n\nbaseline: {}; candidate: {}\n\n",
            b.bucket, b.baseline_probe, b.candidate_probe
        ));
        table(&mut o, &b.metrics);
        o.push('\n');
    }
    o
}
