//! The reports a person reads first: `report.md` and `report.html`, made
//! from the profile alone (so they can be regenerated from a committed one).

pub mod summary;

use envelope_profile::{ConfigResult, Profile};
use std::collections::BTreeMap;

/// Text from a profile (a config's name, an error, a server's note) as one
/// Markdown table cell: a `|` or a line break would end the cell early.
fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace(['\n', '\r'], " ")
}

/// With repeats of the search: the range of the safe point over them
/// (the figure shown is the lower median's).
fn repeats_range(b: &envelope_profile::BucketResult) -> String {
    let safe = b.repeats.iter().map(|r| r.safe_concurrency);
    match (safe.clone().min(), safe.max(), b.repeats.len()) {
        (Some(lo), Some(hi), n) if n > 1 => format!(" ({lo}-{hi} over {n} repeats)"),
        _ => String::new(),
    }
}

/// The interval the safe point is known within at `slo.confidence`, when
/// a breach above it was decided and the interval is wider than the point.
fn interval(b: &envelope_profile::BucketResult) -> String {
    match (b.safe_upper, b.safe_rate_per_s) {
        (Some(u), Some(r)) if u > r + 1e-9 => format!(" [{r:.2}-{u:.2} req/s]"),
        (Some(u), None) if u as u32 > b.safe_concurrency => {
            format!(" [{}-{}]", b.safe_concurrency, u as u32)
        }
        _ => String::new(),
    }
}

fn rows(c: &ConfigResult) -> Vec<[String; 10]> {
    c.buckets
        .iter()
        .map(|b| {
            let a = b.at_feasible.as_ref();
            [
                cell(&c.name),
                b.label(),
                b.feasible_concurrency.to_string(),
                match b.safe_rate_per_s {
                    Some(r) => format!("{} ({r:.2} req/s)", b.safe_concurrency),
                    None => b.safe_concurrency.to_string(),
                } + &interval(b)
                    + &repeats_range(b),
                b.binding_constraint.as_str().to_string(),
                b.knee_concurrency.map_or("-".into(), |k| k.to_string()),
                a.map_or("-".into(), |a| format!("{:.1}", a.output_tok_per_s)),
                a.map_or("-".into(), |a| format!("{:.0}", a.ttft_ms.p95)),
                a.map_or("-".into(), |a| format!("{:.1}", a.itl_ms.p95)),
                a.and_then(|a| a.prefix_cache_hit_rate)
                    .map_or("-".into(), |h| format!("{:.0}%", h * 100.0)),
            ]
        })
        .collect()
}

const HEAD: [&str; 10] = [
    "config",
    "bucket",
    "feasible",
    "safe",
    "binding",
    "knee",
    "out tok/s",
    "TTFT p95 ms",
    "ITL p95 ms",
    "prefix-cache hits",
];

fn limits_line(p: &Profile) -> String {
    let Some(l) = &p.limits else {
        return format!(
            "none: NO SAFE OPERATING POINT ({}); the governor refuses this profile",
            p.no_safe_point.as_deref().unwrap_or("no reason recorded")
        );
    };
    format!(
        "max context {} tokens, max output {} tokens, max concurrent sequences {}, max KV tokens in flight {}",
        l.max_context_tokens, l.max_output_tokens, l.max_concurrent_seqs, l.max_kv_tokens_in_flight
    )
}

/// The governor's per-bucket table: header and one row per bucket.
fn envelope_rows(p: &Profile) -> (Vec<&'static str>, Vec<Vec<String>>) {
    let head = vec![
        "bucket",
        "safe concurrency",
        "share per sequence",
        "KV tokens",
        "TTFT p95 ms",
        "ITL p95 ms",
        "out tok/s",
        "measured at",
    ];
    let o = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.1}"));
    let rows = p
        .limits
        .iter()
        .flat_map(|l| &l.buckets)
        .map(|b| {
            vec![
                b.label(),
                b.safe_concurrency.to_string(),
                format!("1/{}", b.safe_concurrency),
                b.kv_tokens.to_string(),
                o(b.ttft_p95_ms),
                o(b.itl_p95_ms),
                o(b.output_tok_per_s),
                b.measured_at_concurrency
                    .map_or("-".into(), |c| format!("{c} concurrent")),
            ]
        })
        .collect();
    (head, rows)
}

fn slo_line(p: &Profile) -> String {
    let s = &p.slo;
    let o = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x} ms"));
    format!(
        "TTFT p95 {}, ITL p95 {}, e2e p99 {}, error rate <= {}, KV use <= {}, zero preemptions: {}, headroom {}",
        o(s.ttft_p95_ms),
        o(s.itl_p95_ms),
        o(s.e2e_p99_ms),
        s.max_error_rate,
        s.max_kv_usage,
        s.zero_preemptions,
        s.headroom
    ) + &decision_line(s)
}

/// How the probes loaded the server.
fn load_line(l: &envelope_profile::LoadShape) -> String {
    let budget = l
        .max_requests
        .map_or("four times the fewest that can decide".to_string(), |m| {
            m.to_string()
        });
    let shape = if l.mode != "closed" {
        format!("{} arrivals", l.mode)
    } else if l.ramp {
        "closed loop, workers ramped in over the level below's median end-to-end latency; what they sent before the last one started (the warm-up) counts in throughput, not in the verdicts".to_string()
    } else {
        "closed loop, workers started together".to_string()
    };
    format!(
        "{shape}; screens of max(concurrency x {}, {}) requests, levels decided within {budget} requests",
        l.rounds, l.min_requests
    )
}

/// How the verdicts were decided: the sequential test's zones and
/// confidence, or the exceedance bound for a profile that states none.
fn decision_line(s: &envelope_profile::Slo) -> String {
    match s.decision {
        Some(d) => format!(
            "; verdicts by a sequential test at confidence {}: a p95 holds at {}% over its limit and is breached at {}%, a p99 at {}% and {}%",
            s.confidence,
            d.p95.p0 * 100.0,
            d.p95.p1 * 100.0,
            d.p99.p0 * 100.0,
            d.p99.p1 * 100.0
        ),
        None => format!(
            "; verdicts by the exceedance bound at confidence {}",
            s.confidence
        ),
    }
}

pub fn markdown(p: &Profile) -> String {
    let mut s = String::from("# envelope sweep report\n\n");
    s += &format!(
        "Schema `{}`; {} probes. SLOs: {}.\n\n",
        p.schema,
        p.probes_total,
        slo_line(p)
    );
    if let Some(l) = &p.load {
        s += &format!("Load: {}.\n\n", load_line(l));
    }
    s += &format!(
        "**Selected `{}`**, limits for the governor: {}.\n\n",
        p.selected,
        limits_line(p)
    );
    s += "## The envelope the governor enforces\n\nEach admitted sequence is counted in the smallest bucket whose input + output tokens cover its prompt + max_tokens, and charged `1 / safe concurrency` of the node, interpolated by its tokens between that bucket and the one below.\n\n";
    let (head, table) = envelope_rows(p);
    s += &format!("| {} |\n|{}\n", head.join(" | "), "---|".repeat(head.len()));
    for r in table {
        s += &format!("| {} |\n", r.join(" | "));
    }
    s += "\n## Safe operating points\n\n";
    s += &format!("| {} |\n|{}\n", HEAD.join(" | "), "---|".repeat(HEAD.len()));
    for c in &p.configs {
        if let Some(e) = &c.error {
            s += &format!(
                "| {} | error: {} |{}\n",
                cell(&c.name),
                cell(e),
                " |".repeat(HEAD.len() - 2)
            );
        }
        for r in rows(c) {
            s += &format!("| {} |\n", r.join(" | "));
        }
    }
    s += &warm_section(p);
    s += "\n## Memory\n\n| config | weights MiB | analytic MiB | resident after load MiB | KV bytes/token | KV capacity tokens | peak MiB | source |\n|---|---|---|---|---|---|---|---|\n";
    let mib = |b: u64| format!("{:.1}", b as f64 / 1048576.0);
    // 0 in these fields is "not known" (a server's weights cannot be told
    // from its other memory; a server that states no KV figures): a dash,
    // never a 0 that reads as a measurement.
    let known = |v: u64| (v > 0).then_some(v);
    let dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    for c in &p.configs {
        let m = &c.memory;
        s += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
            cell(&c.name),
            dash(known(m.weight_bytes).map(mib)),
            dash(known(m.weight_bytes_analytic).map(mib)),
            m.resident_after_load_bytes.map_or("-".into(), mib),
            dash(known(m.kv_bytes_per_token).map(|v| v.to_string())),
            dash(known(m.kv_capacity_tokens).map(|v| v.to_string())),
            m.peak_bytes.map_or("-".into(), mib),
            cell(m.source.as_deref().unwrap_or("-"))
        );
    }
    s += &workload_section(p);
    s += &server_section(p);
    s += "\n## Plots\n\n";
    for c in p.configs.iter().filter(|c| !c.buckets.is_empty()) {
        s += &format!("![{}]({})\n\n", c.name, crate::plots::file_name(c));
    }
    s += "Raw data: `probes.csv` (one row per probe), `requests.csv` (one row per request), `telemetry.csv` (KV use, memory and requests in flight every 100 ms of each probe), `profile.json`.\n";
    s
}

/// Warm buckets (`INPUTxOUTPUT@P%`) beside the cold bucket of their shape:
/// the capacity a prefix cache gives, and whether the server gave it.
fn warm_section(p: &Profile) -> String {
    let mut s = String::new();
    for c in &p.configs {
        for w in &c.buckets {
            let Some(prefix) = &w.cached_prefix else {
                continue;
            };
            if s.is_empty() {
                s += "\n## Warm and cold capacity\n\nA warm bucket's probes share the first part of every prompt (sent once before each probe); the server's hit rate says whether its prefix cache held it. The governor enforces the cold buckets, and credits cached prefixes only as the server confirms them (docs/govern.md).\n\n| config | shape | cold safe | warm bucket | warm safe | warm / cold | prefix intended | server's hit rate | measured as |\n|---|---|---|---|---|---|---|---|---|\n";
            }
            let cold = c.buckets.iter().find(|b| {
                b.is_cold()
                    && (b.input_tokens, b.output_tokens) == (w.input_tokens, w.output_tokens)
            });
            let verdict = match (prefix.held, prefix.observed_hit_rate) {
                (true, _) => "warm".to_string(),
                (false, Some(h)) => format!(
                    "cold: the server found {:.0}% of prompt tokens, under {:.0}% of the intended share",
                    h * 100.0,
                    envelope_profile::CachedPrefix::HELD_FRACTION * 100.0
                ),
                (false, None) => {
                    "cold: the server reports no prefix-cache hits (no counters, no cached_tokens)"
                        .to_string()
                }
            };
            s += &format!(
                "| {} | {}x{} | {} | {} | {} | {} | {:.0}% | {} | {} |\n",
                cell(&c.name),
                w.input_tokens,
                w.output_tokens,
                cold.map_or("-".into(), |b| b.safe_concurrency.to_string()),
                w.label(),
                w.safe_concurrency,
                cold.filter(|b| b.safe_concurrency > 0)
                    .map_or("-".into(), |b| format!(
                        "{:.2}",
                        f64::from(w.safe_concurrency) / f64::from(b.safe_concurrency)
                    )),
                prefix.intended_share * 100.0,
                prefix
                    .observed_hit_rate
                    .map_or("-".into(), |h| format!("{:.0}%", h * 100.0)),
                verdict
            );
        }
    }
    s
}

/// Agent-shaped load (`load.workload`) and replayed traces
/// (`[load.trace]`): the safe scale per configuration and every probe's
/// prefix-cache hit rate (the server's, where it tells) and per-class
/// (and per-tenant) latencies.
fn workload_section(p: &Profile) -> String {
    use crate::plots::Scaled;
    let mut s = String::new();
    for (c, which) in p
        .configs
        .iter()
        .flat_map(|c| [(c, Scaled::Workload), (c, Scaled::Trace)])
    {
        let Some(w) = which.of(c) else { continue };
        let title = match which {
            Scaled::Workload => format!(
                "Workload `{}` on `{}` ({} arrivals)",
                w.name, c.name, w.arrival
            ),
            Scaled::Trace => format!("Trace `{}` replayed on `{}`", w.name, c.name),
        };
        let upper = w.feasible_upper_scale.map_or(String::new(), |u| {
            format!(" [{:.2}-{u:.2}]", w.feasible_scale)
        });
        s += &format!(
            "\n## {title}\n\nSafe scale **{:.2}** {} (feasible {:.2}{upper}, binding `{}`). {}\n\n![saturation]({})\n\n| scale | requests | errors | goodput req/s | prefix-cache hits | class or tenant | runs | calls | mean input | TTFT p95 ms | e2e p95 ms | run e2e p95 ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
            w.safe_scale,
            which.unit(),
            w.feasible_scale,
            w.binding_constraint.as_str(),
            saturation_line(w),
            crate::plots::workload_file_name(c, which)
        );
        for probe in &w.probes {
            let sm = &probe.summary;
            let groups = probe.classes.iter().map(|(k, v)| (k.clone(), v)).chain(
                probe
                    .tenants
                    .iter()
                    .map(|(k, v)| (format!("tenant {k}"), v)),
            );
            for (i, (class, cs)) in groups.enumerate() {
                let head = if i == 0 {
                    let mark = if sm.breaches.is_empty() {
                        ""
                    } else {
                        " (breach)"
                    };
                    format!(
                        "{:.2}{mark} | {} | {} | {:.2} | {}",
                        probe.scale,
                        sm.requests,
                        sm.errors,
                        sm.goodput_req_per_s,
                        sm.prefix_cache_hit_rate
                            .map_or("-".into(), |h| format!("{:.0}%", h * 100.0))
                    )
                } else {
                    " | | | |".into()
                };
                s += &format!(
                    "| {head} | {class} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} |\n",
                    cs.runs,
                    cs.requests,
                    cs.input_tokens_mean,
                    cs.ttft_ms.p95,
                    cs.e2e_ms.p95,
                    cs.run_e2e_ms.p95
                );
            }
        }
    }
    s
}

/// Knee, collapse and recovery in words.
fn saturation_line(w: &envelope_profile::WorkloadResult) -> String {
    let f = |v: Option<f64>| v.map_or("not reached".into(), |v| format!("{v:.2}"));
    let mut s = format!(
        "Saturation: knee at scale {}, collapse (goodput under its peak's fraction) at {}",
        f(w.knee_scale),
        f(w.collapse_scale)
    );
    if let Some(r) = &w.recovery {
        s += &format!(
            "; after {:.0} s at scale {:.2}, back at {:.2}: {} ({} of {} requests after the switch missed the SLOs)",
            r.overload_s,
            r.from_scale,
            r.to_scale,
            r.recovery_s.map_or(format!("not recovered within {:.0} s", r.window_s), |t| format!("SLOs held again after {t:.1} s")),
            r.missed_after,
            r.requests_after
        );
    }
    s + "."
}

/// The servers as the harness found them (http and launch targets): their
/// cold start, whether they honour `ignore_eos` and token-id prompts, and
/// the failed requests by reason.
fn server_section(p: &Profile) -> String {
    let servers: Vec<&ConfigResult> = p
        .configs
        .iter()
        .filter(|c| c.server_checks.is_some() || c.time_to_ready_s.is_some())
        .collect();
    let mut failed: BTreeMap<&str, u64> = BTreeMap::new();
    for c in &p.configs {
        for (r, n) in c
            .buckets
            .iter()
            .flat_map(|b| &b.probes)
            .flat_map(|p| &p.error_reasons)
        {
            *failed.entry(r.as_str()).or_insert(0) += n;
        }
    }
    let refused: u64 = p
        .configs
        .iter()
        .flat_map(|c| &c.buckets)
        .flat_map(|b| &b.probes)
        .map(|p| p.refused)
        .sum();
    let mut s = String::new();
    if !servers.is_empty() {
        s += "\n## Servers\n\n| config | time to ready (s) | governed | ignore_eos honoured | token-id prompts | notes |\n|---|---|---|---|---|---|\n";
        for c in servers {
            let ch = c.server_checks.as_ref();
            s += &format!(
                "| {} | {} | {} | {} | {} | {} |\n",
                cell(&c.name),
                c.time_to_ready_s.map_or("-".into(), |t| format!("{t:.1}")),
                ch.map_or("-", |c| if c.governed {
                    "**yes** (envelope govern)"
                } else {
                    "no"
                }),
                ch.map_or("-", |c| if c.ignore_eos { "yes" } else { "**no**" }),
                ch.map_or("-", |c| if c.token_prompts {
                    "yes"
                } else {
                    "**no** (text)"
                }),
                ch.map_or(String::new(), |c| cell(&c.notes.join("; ")))
            );
        }
    }
    if refused > 0 {
        s += &format!("\nRefused requests (429 with Retry-After: shed by a governed target, not failures; `shed` breaches past `slo.max_shed_rate` {}): {refused}.\n", p.slo.max_shed_rate);
    }
    if !failed.is_empty() {
        s += "\nFailed requests by reason (a request succeeds only when the whole asked output arrived with a finish reason): ";
        s += &failed
            .iter()
            .map(|(r, n)| format!("`{r}` {n}"))
            .collect::<Vec<_>>()
            .join(", ");
        s += ".\n";
    }
    s
}

/// `report.html`: the Markdown report rendered (tables, images, code), so
/// the two cannot drift apart; raw HTML in it (a config name or a server's
/// note could hold some) is shown as text, never run.
pub fn html(p: &Profile) -> String {
    use pulldown_cmark::{html::push_html, Event, Options, Parser};
    let md = markdown(p);
    let events = Parser::new_ext(&md, Options::ENABLE_TABLES).map(|e| match e {
        Event::Html(t) | Event::InlineHtml(t) => Event::Text(t),
        e => e,
    });
    let mut body = String::new();
    push_html(&mut body, events);
    format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>envelope sweep report</title>\
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}th{{background:#eee}}img{{max-width:100%}}</style>\
</head><body>\n{body}</body></html>\n"
    )
}

/// Writes `report.md`, `report.html` and `plots/*.svg` for `p` into `dir`.
pub fn write_all(p: &Profile, dir: &std::path::Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir.join("plots"))?;
    std::fs::write(dir.join("report.md"), markdown(p))?;
    std::fs::write(dir.join("report.html"), html(p))?;
    for c in p.configs.iter().filter(|c| !c.buckets.is_empty()) {
        let svg = crate::plots::config_svg(c, &p.slo).map_err(std::io::Error::other)?;
        std::fs::write(dir.join(crate::plots::file_name(c)), svg)?;
        for which in [crate::plots::Scaled::Workload, crate::plots::Scaled::Trace] {
            if let Some(svg) =
                crate::plots::workload_svg(c, &p.slo, which).map_err(std::io::Error::other)?
            {
                std::fs::write(dir.join(crate::plots::workload_file_name(c, which)), svg)?;
            }
        }
    }
    Ok(())
}
