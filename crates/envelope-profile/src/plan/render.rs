//! The plan as text tables with units (`envelope plan` without `--json`):
//! every intermediate value, per class and per scenario.

use super::{replicas_for, ClassDemand, ClassSupply, Plan};

/// Thousands separators for the integer part: 3,359,232.
fn grouped(v: f64, decimals: usize) -> String {
    let s = format!("{:.decimals$}", v.abs());
    let (int, frac) = s.split_once('.').map_or((s.as_str(), ""), |(i, f)| (i, f));
    let mut out = String::new();
    for (i, c) in int.chars().enumerate() {
        if i > 0 && (int.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if !frac.is_empty() {
        out.push('.');
        out.push_str(frac);
    }
    if v < 0.0 {
        out.insert(0, '-');
    }
    out
}

/// A number as the plan's tables print it: whole numbers grouped
/// (3,359,232), others to three or four significant places.
pub fn f(v: f64) -> String {
    if v == v.trunc() && v.abs() < 1e15 {
        grouped(v, 0)
    } else if v.abs() >= 1000.0 {
        grouped(v, 1)
    } else if v.abs() >= 1.0 {
        format!("{v:.3}")
    } else {
        format!("{v:.4}")
    }
}

/// Rows of (field, unit, one value per class).
fn grid(out: &mut String, title: &str, classes: &[String], rows: &[(String, &str, Vec<String>)]) {
    out.push_str(&format!("\n{title}\n"));
    let mut widths = vec![
        rows.iter().map(|r| r.0.len()).max().unwrap_or(5).max(5),
        rows.iter().map(|r| r.1.len()).max().unwrap_or(4).max(4),
    ];
    for (i, c) in classes.iter().enumerate() {
        widths.push(
            rows.iter()
                .map(|r| r.2[i].len())
                .chain([c.len()])
                .max()
                .unwrap_or(1),
        );
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::from("  ");
        for (i, c) in cells.iter().enumerate() {
            if i < 2 {
                s.push_str(&format!("{c:<w$}  ", w = widths[i]));
            } else {
                s.push_str(&format!("{c:>w$}  ", w = widths[i]));
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut head = vec!["field", "unit"];
    head.extend(classes.iter().map(String::as_str));
    out.push_str(&line(head));
    for (name, unit, vals) in rows {
        let mut cells = vec![name.as_str(), *unit];
        cells.extend(vals.iter().map(String::as_str));
        out.push_str(&line(cells));
    }
}

fn demand_rows(d: &[ClassDemand]) -> Vec<(String, &'static str, Vec<String>)> {
    let col = |g: &dyn Fn(&ClassDemand) -> String| d.iter().map(g).collect::<Vec<_>>();
    let mut rows: Vec<(String, &'static str, Vec<String>)> = vec![
        (
            "runs_per_min".into(),
            "runs/min",
            col(&|x| f(x.runs_per_min)),
        ),
        (
            "runs_per_min_p95".into(),
            "runs/min",
            col(&|x| f(x.runs_per_min_p95)),
        ),
        (
            "model_calls_per_run".into(),
            "calls/run",
            col(&|x| f(x.model_calls_per_run)),
        ),
        (
            "retry_amplification".into(),
            "x",
            col(&|x| f(x.retry_amplification)),
        ),
        (
            "fallback_amplification".into(),
            "x",
            col(&|x| f(x.fallback_amplification)),
        ),
        (
            "amplification (retry x fallback)".into(),
            "x",
            col(&|x| f(x.amplification)),
        ),
        (
            "model_requests_per_min".into(),
            "req/min",
            col(&|x| f(x.model_requests_per_min)),
        ),
        (
            "model_requests_per_min_p95".into(),
            "req/min",
            col(&|x| f(x.model_requests_per_min_p95)),
        ),
        (
            "input_tokens_per_request p50/p95".into(),
            "tokens",
            col(&|x| {
                format!(
                    "{}/{}",
                    f(x.input_tokens_per_request_p50),
                    f(x.input_tokens_per_request_p95)
                )
            }),
        ),
        (
            "input_tokens_per_request_mean".into(),
            "tokens",
            col(&|x| f(x.input_tokens_per_request_mean)),
        ),
        (
            "output_tokens_per_request p50/p95".into(),
            "tokens",
            col(&|x| {
                format!(
                    "{}/{}",
                    f(x.output_tokens_per_request_p50),
                    f(x.output_tokens_per_request_p95)
                )
            }),
        ),
        (
            "output_tokens_per_request_mean".into(),
            "tokens",
            col(&|x| f(x.output_tokens_per_request_mean)),
        ),
        (
            "context growth per call (sessions)".into(),
            "tokens",
            col(&|x| f(x.context_growth_tokens_per_call)),
        ),
        (
            "cache hit rate planned / floor".into(),
            "",
            col(&|x| format!("{} / {}", f(x.cache_hit_rate), f(x.cache_hit_rate_floor))),
        ),
        (
            "input_tokens_per_min (req x mean)".into(),
            "tokens/min",
            col(&|x| f(x.input_tokens_per_min)),
        ),
        (
            "output_tokens_per_min (req x mean)".into(),
            "tokens/min",
            col(&|x| f(x.output_tokens_per_min)),
        ),
        (
            "concurrency_basis".into(),
            "",
            col(&|x| x.concurrency_basis.as_str().to_string()),
        ),
        (
            "arrivals_per_s mean".into(),
            "1/s",
            col(&|x| f(x.arrivals_per_s_mean)),
        ),
        (
            "arrivals_per_s p95".into(),
            "1/s",
            col(&|x| f(x.arrivals_per_s_p95)),
        ),
        (
            "time_in_system_s mean".into(),
            "s",
            col(&|x| f(x.time_in_system_s_mean)),
        ),
        (
            "time_in_system_s p95".into(),
            "s",
            col(&|x| f(x.time_in_system_s_p95)),
        ),
        (
            "in flight, Little's law (mean x mean)".into(),
            "slots",
            col(&|x| f(x.in_flight_littles_law)),
        ),
        (
            "peak-scenario slots (p95 x p95)".into(),
            "slots",
            col(&|x| f(x.peak_scenario_slots)),
        ),
        ("reserve factor".into(), "x", col(&|x| f(x.reserve_factor))),
        (
            "provisioned slots (peak x reserves)".into(),
            "slots",
            col(&|x| f(x.provisioned_slots)),
        ),
        (
            "kv_tokens_per_request (p95 in + out)".into(),
            "tokens",
            col(&|x| f(x.kv_tokens_per_request_p95)),
        ),
    ];
    let mut deps: Vec<&String> = d
        .iter()
        .flat_map(|x| x.dependencies_per_min.keys())
        .collect();
    deps.sort();
    deps.dedup();
    for k in deps {
        rows.push((
            format!("{k}_per_min"),
            "1/min",
            col(&|x| {
                x.dependencies_per_min
                    .get(k)
                    .map(|v| f(*v))
                    .unwrap_or_else(|| "-".into())
            }),
        ));
    }
    rows
}

fn supply_rows(s: &[ClassSupply]) -> Vec<(String, &'static str, Vec<String>)> {
    let col = |g: &dyn Fn(&ClassSupply) -> String| s.iter().map(g).collect::<Vec<_>>();
    vec![
        (
            "bucket (input x output)".into(),
            "tokens",
            col(&|x| format!("{}x{}", x.bucket_input_tokens, x.bucket_output_tokens)),
        ),
        (
            "bucket covers p95".into(),
            "",
            col(&|x| {
                if x.bucket_covers_p95 {
                    "yes".into()
                } else {
                    "NO".into()
                }
            }),
        ),
        (
            "safe_concurrency_per_replica".into(),
            "slots",
            col(&|x| f(x.safe_concurrency_per_replica)),
        ),
        (
            "prefill_tok_per_s_per_replica".into(),
            "tok/s",
            col(&|x| f(x.prefill_tok_per_s_per_replica)),
        ),
        (
            "decode_tok_per_s_per_replica".into(),
            "tok/s",
            col(&|x| f(x.decode_tok_per_s_per_replica)),
        ),
        (
            "output_tok_per_s_per_replica".into(),
            "tok/s",
            col(&|x| f(x.output_tok_per_s_per_replica)),
        ),
        (
            "e2e at the safe point mean/p95".into(),
            "s",
            col(&|x| format!("{}/{}", f(x.e2e_s_mean), f(x.e2e_s_p95))),
        ),
        (
            "kv_tokens_per_replica".into(),
            "tokens",
            col(&|x| f(x.kv_tokens_per_replica)),
        ),
    ]
}

/// The plan as text tables with units.
pub fn render(p: &Plan, workload: &str, profile: &str) -> String {
    let mut o = String::new();
    o.push_str(&format!(
        "envelope plan: workload `{}` ({workload}) on `{}` ({profile})\n",
        p.workload, p.config
    ));
    let r = &p.reserves;
    o.push_str(&format!(
        "reserves: 1 + burst {} + operational {} + failover {} = x{}\n",
        f(r.burst),
        f(r.operational),
        f(r.failover),
        f(r.factor)
    ));
    let s = &p.scenario_factors;
    o.push_str(&format!(
        "scenario factors: failover traffic x{}, failover retries x{}, recovery backlog x{}\n",
        f(s.failover_traffic_factor),
        f(s.failover_retry_amplification),
        f(s.recovery_backlog_factor)
    ));
    let classes: Vec<String> = p.demand.iter().map(|d| d.class.clone()).collect();
    grid(
        &mut o,
        "Demand per class",
        &classes,
        &demand_rows(&p.demand),
    );
    grid(
        &mut o,
        "Supply per replica (profile)",
        &classes,
        &supply_rows(&p.supply),
    );
    for (c, x) in p.supply.iter().zip(&p.demand) {
        o.push_str(&format!(
            "  {}: throughput from the {}; time in system from {}\n",
            c.class, c.supply_probe, x.time_in_system_source
        ));
    }
    for sc in &p.scenarios {
        o.push_str(&format!(
            "\nScenario {}: {}\n  {:<18} {:>14} {:<7} {:>16} {:>9} {:>12}\n",
            sc.scenario,
            sc.description,
            "constraint",
            "demand",
            "unit",
            "replicas (exact)",
            "replicas",
            "utilisation"
        ));
        for c in &sc.constraints {
            o.push_str(&format!(
                "  {:<18} {:>14} {:<7} {:>16} {:>9} {:>11.1}%\n",
                c.constraint.as_str(),
                f(c.demand),
                c.unit,
                format!("{:.3}", c.replicas_exact),
                c.replicas_needed,
                c.utilisation * 100.0
            ));
            if let Some(planned) = c.replicas_exact_at_planned_hit_rate {
                o.push_str(&format!(
                    "  {:<18} {:>14} {:<7} {:>16} {:>9}   (at the planned cache hit rate; sized above at the floor)\n",
                    "  at planned hits",
                    "",
                    "",
                    format!("{planned:.3}"),
                    replicas_for(planned),
                ));
            }
        }
        for l in &sc.loads {
            o.push_str(&format!(
                "    {}: {} req/s, {} input tok/s ({} uncached at the floor), {} output tok/s, {} slots ({}), {} KV tokens\n",
                l.class,
                f(l.model_requests_per_s),
                f(l.input_tokens_per_s),
                f(l.uncached_input_tokens_per_s),
                f(l.output_tokens_per_s),
                f(l.slots),
                l.slots_basis,
                f(l.kv_tokens)
            ));
        }
        o.push_str(&format!(
            "  => {} replicas; binding: {}; next: {}\n",
            sc.replicas,
            sc.binding.as_str(),
            sc.next.map(|n| n.as_str()).unwrap_or("-")
        ));
    }
    for w in &p.warnings {
        o.push_str(&format!("\nwarning: {w}\n"));
    }
    o
}
