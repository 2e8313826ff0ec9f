//! Gate a change (typically of precision) by comparing a candidate profile
//! with a baseline: are the two comparable (same node, same model apart from
//! precision, same buckets), what moved per bucket, and does each rule pass.
//! Pure: parsing rules, comparing and rendering Markdown; the CLI does I/O
//! and maps the verdict to an exit code (0 pass, 1 fail, 2 unusable).

use crate::plan::safe_point_probe;
use crate::{ConfigResult, Profile};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The rules used when no file is given (`bench-configs/gates/precision.toml`).
pub const DEFAULT_RULES: &str = r#"
rules = [
  "safe_concurrency >= 1.0 x baseline",
  "decode_tok_s >= 0.95 x baseline",
  "kl_divergence <= 0.02",
  "top1_agreement >= 0.97",
]
"#;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Op {
    #[serde(rename = ">=")]
    Ge,
    #[serde(rename = "<=")]
    Le,
    #[serde(rename = ">")]
    Gt,
    #[serde(rename = "<")]
    Lt,
}

impl Op {
    fn parse(s: &str) -> Option<Op> {
        Some(match s {
            ">=" => Op::Ge,
            "<=" => Op::Le,
            ">" => Op::Gt,
            "<" => Op::Lt,
            _ => return None,
        })
    }
    pub fn as_str(&self) -> &'static str {
        match self {
            Op::Ge => ">=",
            Op::Le => "<=",
            Op::Gt => ">",
            Op::Lt => "<",
        }
    }
    /// `a OP b`; `>=` and `<=` allow 1e-9 relative slack, so a threshold
    /// such as 0.95 x 100 (94.99999999999999) does not fail 95.
    pub fn holds(&self, a: f64, b: f64) -> bool {
        let eps = 1e-9 * b.abs();
        match self {
            Op::Ge => a >= b - eps,
            Op::Le => a <= b + eps,
            Op::Gt => a > b,
            Op::Lt => a < b,
        }
    }
}

/// Where a metric lives: per bucket, per configuration, or in the quality section.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    Bucket,
    Config,
    Quality,
}

/// Every metric a rule may name: (name, scope, unit).
pub const METRICS: &[(&str, Scope, &str)] = &[
    ("safe_concurrency", Scope::Bucket, "seqs"),
    ("decode_tok_s", Scope::Bucket, "tok/s"),
    ("prefill_tok_s", Scope::Bucket, "tok/s"),
    ("output_tok_s", Scope::Bucket, "tok/s"),
    ("ttft_p50_ms", Scope::Bucket, "ms"),
    ("ttft_p95_ms", Scope::Bucket, "ms"),
    ("ttft_p99_ms", Scope::Bucket, "ms"),
    ("itl_p50_ms", Scope::Bucket, "ms"),
    ("itl_p95_ms", Scope::Bucket, "ms"),
    ("itl_p99_ms", Scope::Bucket, "ms"),
    ("e2e_p95_ms", Scope::Bucket, "ms"),
    ("weight_bytes", Scope::Config, "bytes"),
    ("kv_capacity_tokens", Scope::Config, "tokens"),
    ("peak_bytes", Scope::Config, "bytes"),
    ("perplexity", Scope::Quality, ""),
    ("kl_divergence", Scope::Quality, "nats"),
    ("kl_divergence_p95", Scope::Quality, "nats"),
    ("top1_agreement", Scope::Quality, "fraction"),
];

fn metric_info(name: &str) -> Option<(Scope, &'static str)> {
    METRICS
        .iter()
        .find(|(n, _, _)| *n == name)
        .map(|(_, s, u)| (*s, *u))
}

/// `METRIC OP NUMBER` (an absolute bound on the candidate) or
/// `METRIC OP NUMBER x baseline` (a bound relative to the baseline).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Rule {
    pub text: String,
    pub metric: String,
    pub op: Op,
    pub number: f64,
    pub relative_to_baseline: bool,
}

impl Rule {
    pub fn parse(text: &str) -> Result<Rule, String> {
        let t: Vec<&str> = text.split_whitespace().collect();
        let shape = "expected `METRIC OP NUMBER` or `METRIC OP NUMBER x baseline`";
        let (metric, op, number, rel) = match t.as_slice() {
            [m, o, n] => (m, o, n, false),
            [m, o, n, x, b] if matches!(*x, "x" | "*" | "×") && *b == "baseline" => {
                (m, o, n, true)
            }
            _ => return Err(format!("`{text}`: {shape}")),
        };
        if metric_info(metric).is_none() {
            let all: Vec<&str> = METRICS.iter().map(|m| m.0).collect();
            return Err(format!(
                "`{text}`: unknown metric `{metric}` (one of {})",
                all.join(", ")
            ));
        }
        let op = Op::parse(op)
            .ok_or_else(|| format!("`{text}`: operator `{op}` is not >=, <=, > or <"))?;
        let number: f64 = number
            .parse()
            .ok()
            .filter(|v: &f64| v.is_finite())
            .ok_or_else(|| format!("`{text}`: `{number}` is not a number"))?;
        Ok(Rule {
            text: t.join(" "),
            metric: metric.to_string(),
            op,
            number,
            relative_to_baseline: rel,
        })
    }
}

/// The rules file (`bench-configs/gates/*.toml`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct RulesFile {
    rules: Vec<String>,
    #[serde(default)]
    allow_differences: Vec<String>,
    baseline_config: Option<String>,
    candidate_config: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GateRules {
    pub rules: Vec<Rule>,
    /// Fingerprint fields (prefixes, e.g. `node.host.cpu_model`) whose
    /// differences are reported but do not make the profiles incomparable.
    pub allow_differences: Vec<String>,
    /// Configurations to compare (default: each profile's `selected`).
    pub baseline_config: Option<String>,
    pub candidate_config: Option<String>,
}

#[derive(Debug, thiserror::Error)]
#[error("{path}: {message}")]
pub struct RulesError {
    pub path: String,
    pub message: String,
}

impl GateRules {
    pub fn from_toml(text: &str, path: &str) -> Result<GateRules, RulesError> {
        let bad = |m: String| RulesError {
            path: path.into(),
            message: m,
        };
        let f: RulesFile = toml::from_str(text).map_err(|e| bad(e.to_string()))?;
        if f.rules.is_empty() {
            return Err(bad("field `rules`: at least one rule is required".into()));
        }
        let rules = f
            .rules
            .iter()
            .enumerate()
            .map(|(i, r)| Rule::parse(r).map_err(|m| bad(format!("field `rules[{i}]`: {m}"))))
            .collect::<Result<_, _>>()?;
        Ok(GateRules {
            rules,
            allow_differences: f.allow_differences,
            baseline_config: f.baseline_config,
            candidate_config: f.candidate_config,
        })
    }

    pub fn default_rules() -> GateRules {
        GateRules::from_toml(DEFAULT_RULES, "default rules").expect("the default rules parse")
    }
}

/// A fingerprint field that differs, and whether it blocks the comparison.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Difference {
    pub field: String,
    pub baseline: serde_json::Value,
    pub candidate: serde_json::Value,
    /// `blocking` (not comparable), `expected` (what the gate is about,
    /// e.g. precision), or `note` (allowed or harmless).
    pub kind: String,
}

fn flatten(prefix: &str, v: &serde_json::Value, out: &mut BTreeMap<String, serde_json::Value>) {
    let join = |k: &str| {
        if prefix.is_empty() {
            k.to_string()
        } else {
            format!("{prefix}.{k}")
        }
    };
    match v {
        serde_json::Value::Object(m) if !m.is_empty() => {
            for (k, x) in m {
                flatten(&join(k), x, out);
            }
        }
        serde_json::Value::Array(a) if !a.is_empty() && prefix.starts_with("node") => {
            for (i, x) in a.iter().enumerate() {
                flatten(&join(&i.to_string()), x, out);
            }
        }
        _ => {
            out.insert(prefix.to_string(), v.clone());
        }
    }
}

/// How a differing fingerprint field counts: the node's hardware identity
/// and the model identity block; precision and KV dtype are expected; the
/// rest (driver, engine flags, RAM) are notes.
fn classify(field: &str, allow: &[String]) -> &'static str {
    if field == "precision" || field == "kv_dtype" {
        return "expected";
    }
    if allow.iter().any(|a| field.starts_with(a.as_str())) {
        return "note";
    }
    let gpu_identity = field.starts_with("node.gpus")
        && (field.ends_with(".name")
            || field.ends_with(".memory_total_bytes")
            || field.ends_with(".mig_enabled")
            || field == "node.gpus");
    let blocking = field.starts_with("model")
        || gpu_identity
        || matches!(
            field,
            "node.source"
                | "node.host.cpu_model"
                | "node.host.logical_cores"
                | "node.host.arch"
                | "engine.name"
        );
    if blocking {
        "blocking"
    } else {
        "note"
    }
}

/// Fields of two fingerprints that differ, classified.
pub fn fingerprint_differences(
    baseline: &serde_json::Value,
    candidate: &serde_json::Value,
    allow: &[String],
) -> Vec<Difference> {
    let (mut a, mut b) = (BTreeMap::new(), BTreeMap::new());
    flatten("", baseline, &mut a);
    flatten("", candidate, &mut b);
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    keys.into_iter()
        .filter_map(|k| {
            let (x, y) = (
                a.get(k).cloned().unwrap_or_default(),
                b.get(k).cloned().unwrap_or_default(),
            );
            (x != y).then(|| Difference {
                kind: classify(k, allow).into(),
                field: k.clone(),
                baseline: x,
                candidate: y,
            })
        })
        .collect()
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MetricDelta {
    pub metric: String,
    pub unit: String,
    pub baseline: Option<f64>,
    pub candidate: Option<f64>,
    /// (candidate - baseline) / baseline, percent.
    pub delta_pct: Option<f64>,
}

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

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BucketComparison {
    pub bucket: String,
    /// Which probe each side's figures come from.
    pub baseline_probe: String,
    pub candidate_probe: String,
    pub metrics: Vec<MetricDelta>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RuleStatus {
    Pass,
    Fail,
    /// The metric was not measured on one side: counts as a failure.
    Missing,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RuleResult {
    pub rule: String,
    /// The bucket (`INPUTxOUTPUT`) for per-bucket metrics.
    pub bucket: Option<String>,
    pub baseline: Option<f64>,
    pub candidate: Option<f64>,
    pub threshold: Option<f64>,
    pub status: RuleStatus,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Pass,
    Fail,
    Unusable,
}

impl Verdict {
    pub fn exit_code(&self) -> i32 {
        match self {
            Verdict::Pass => 0,
            Verdict::Fail => 1,
            Verdict::Unusable => 2,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Side {
    pub config: String,
    pub precision: String,
    pub kv_dtype: String,
    pub batch_policy: String,
    pub quality_reference: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GateReport {
    pub verdict: Verdict,
    pub comparable: bool,
    /// Why the inputs cannot be gated (empty when comparable).
    pub unusable_reasons: Vec<String>,
    pub baseline: Option<Side>,
    pub candidate: Option<Side>,
    pub differences: Vec<Difference>,
    pub config_metrics: Vec<MetricDelta>,
    pub quality_metrics: Vec<MetricDelta>,
    pub buckets: Vec<BucketComparison>,
    pub rules: Vec<RuleResult>,
}

fn config<'a>(p: &'a Profile, name: Option<&str>) -> Result<&'a ConfigResult, String> {
    let name = name.unwrap_or(&p.selected);
    let c = p
        .configs
        .iter()
        .find(|c| c.name == name)
        .ok_or_else(|| format!("no configuration `{name}`"))?;
    match &c.error {
        Some(e) => Err(format!("configuration `{name}` failed in its sweep: {e}")),
        None => Ok(c),
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

/// Evaluates one rule on one pair of measured values.
pub fn evaluate(
    rule: &Rule,
    baseline: Option<f64>,
    candidate: Option<f64>,
) -> (Option<f64>, RuleStatus) {
    let threshold = if rule.relative_to_baseline {
        baseline.map(|b| rule.number * b)
    } else {
        Some(rule.number)
    };
    match (threshold, candidate) {
        (Some(t), Some(c)) if c.is_finite() => (
            Some(t),
            if rule.op.holds(c, t) {
                RuleStatus::Pass
            } else {
                RuleStatus::Fail
            },
        ),
        _ => (threshold, RuleStatus::Missing),
    }
}

fn bucket_name(k: (u32, u32)) -> String {
    format!("{}x{}", k.0, k.1)
}

/// Compares `candidate` with `baseline` under `rules`.
pub fn gate(baseline: &Profile, candidate: &Profile, rules: &GateRules) -> GateReport {
    let mut unusable = vec![];
    let differences = fingerprint_differences(
        &baseline.fingerprint,
        &candidate.fingerprint,
        &rules.allow_differences,
    );
    for d in differences.iter().filter(|d| d.kind == "blocking") {
        unusable.push(format!(
            "fingerprint field `{}` differs: baseline {}, candidate {}",
            d.field, d.baseline, d.candidate
        ));
    }
    let bc =
        config(baseline, rules.baseline_config.as_deref()).map_err(|e| format!("baseline: {e}"));
    let cc =
        config(candidate, rules.candidate_config.as_deref()).map_err(|e| format!("candidate: {e}"));
    let side = |p: &Profile, c: &ConfigResult| Side {
        config: c.name.clone(),
        precision: c.precision.clone(),
        kv_dtype: c.kv_dtype.clone(),
        batch_policy: c.batch_policy.clone(),
        quality_reference: p
            .quality
            .as_ref()
            .and_then(|q| q.reference_precision.clone()),
    };
    let mut report = GateReport {
        verdict: Verdict::Unusable,
        comparable: false,
        unusable_reasons: vec![],
        baseline: bc.as_ref().ok().map(|c| side(baseline, c)),
        candidate: cc.as_ref().ok().map(|c| side(candidate, c)),
        differences,
        config_metrics: vec![],
        quality_metrics: vec![],
        buckets: vec![],
        rules: vec![],
    };
    let (bc, cc) = match (bc, cc) {
        (Ok(b), Ok(c)) => (b, c),
        (b, c) => {
            unusable.extend(b.err());
            unusable.extend(c.err());
            report.unusable_reasons = unusable;
            return report;
        }
    };
    let keys = |c: &ConfigResult| -> Vec<(u32, u32)> {
        let mut k: Vec<_> = c
            .buckets
            .iter()
            .map(|b| (b.input_tokens, b.output_tokens))
            .collect();
        k.sort();
        k
    };
    let (bk, ck) = (keys(bc), keys(cc));
    if bk != ck {
        let names = |k: &[(u32, u32)]| {
            k.iter()
                .map(|&k| bucket_name(k))
                .collect::<Vec<_>>()
                .join(", ")
        };
        unusable.push(format!(
            "buckets differ: baseline [{}], candidate [{}]",
            names(&bk),
            names(&ck)
        ));
    }
    // The same engine on another backend (cuBLAS or envelope's GEMM
    // kernels, graphs on or off) measures other tok/s: said, not hidden.
    if let (Some(a), Some(b)) = (&bc.backend, &cc.backend) {
        if a != b {
            report.differences.push(Difference {
                field: "config.backend".into(),
                baseline: a.clone().into(),
                candidate: b.clone().into(),
                kind: "note".into(),
            });
        }
    }
    if bc.batch_policy != cc.batch_policy {
        report.differences.push(Difference {
            field: "config.batch_policy".into(),
            baseline: bc.batch_policy.clone().into(),
            candidate: cc.batch_policy.clone().into(),
            kind: "note".into(),
        });
    }
    if let (Some(a), Some(b)) = (&baseline.quality, &candidate.quality) {
        if a.reference_precision != b.reference_precision || a.text_set != b.text_set {
            unusable.push(format!(
                "quality measured differently: baseline against {:?} on {}, candidate against {:?} on {}",
                a.reference_precision, a.text_set, b.reference_precision, b.text_set
            ));
        }
    }
    for (m, scope, _) in METRICS {
        match scope {
            Scope::Config => {
                report
                    .config_metrics
                    .push(delta(m, config_metric(bc, m), config_metric(cc, m)))
            }
            Scope::Quality => report.quality_metrics.push(delta(
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
    for &k in bk.iter().filter(|k| ck.contains(k)) {
        report.buckets.push(BucketComparison {
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
    for r in &rules.rules {
        let scope = metric_info(&r.metric).map(|m| m.0).unwrap_or(Scope::Config);
        let mut push = |bucket: Option<String>, b: Option<f64>, c: Option<f64>| {
            let (threshold, status) = evaluate(r, b, c);
            report.rules.push(RuleResult {
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
                for b in report.buckets.clone() {
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
    report.comparable = unusable.is_empty();
    report.verdict = if !unusable.is_empty() {
        Verdict::Unusable
    } else if report.rules.iter().all(|r| r.status == RuleStatus::Pass) {
        Verdict::Pass
    } else {
        Verdict::Fail
    };
    report.unusable_reasons = unusable;
    report
}

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

/// The report as Markdown (also what the CLI prints).
pub fn markdown(r: &GateReport) -> String {
    let mut o = String::new();
    let verdict = match r.verdict {
        Verdict::Pass => "PASS",
        Verdict::Fail => "FAIL",
        Verdict::Unusable => "UNUSABLE INPUT",
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
        o.push_str("## Rules\n\n| rule | bucket | baseline | candidate | threshold | result |\n|---|---|---:|---:|---:|---|\n");
        for x in &r.rules {
            let s = match x.status {
                RuleStatus::Pass => "pass",
                RuleStatus::Fail => "**FAIL**",
                RuleStatus::Missing => "**FAIL** (not measured)",
            };
            o.push_str(&format!(
                "| `{}` | {} | {} | {} | {} | {} |\n",
                x.rule,
                x.bucket.as_deref().unwrap_or("-"),
                num(x.baseline),
                num(x.candidate),
                num(x.threshold),
                s
            ));
        }
        o.push('\n');
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

#[cfg(test)]
mod tests;
