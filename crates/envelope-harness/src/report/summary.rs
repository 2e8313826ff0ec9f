//! The lines `envelope sweep` ends with: a row per configuration and
//! bucket, then the envelope the governor will enforce.

use envelope_profile::{Limits, Profile};
use std::fmt::Write;

/// A row per configuration and bucket: feasible and safe concurrency, what
/// bound it, and the output rate and latencies at the feasible level.
pub fn configs_table(p: &Profile) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<28} {:>13} {:>8} {:>10} {:>14} {:>12} {:>12} {:>11}",
        "config", "bucket", "feasible", "safe", "binding", "out tok/s", "ttft p95 ms", "itl p95 ms"
    );
    for c in &p.configs {
        if let Some(e) = &c.error {
            let _ = writeln!(o, "{:<28} error: {e}", c.name);
            continue;
        }
        for b in &c.buckets {
            let at = b.at_feasible.as_ref();
            let _ = writeln!(
                o,
                "{:<28} {:>13} {:>8} {:>10} {:>14} {:>12.1} {:>12.1} {:>11.1}{}",
                c.name,
                b.label(),
                b.feasible_concurrency,
                match b.safe_rate_per_s {
                    Some(r) => format!("{}@{r:.1}/s", b.safe_concurrency),
                    None => b.safe_concurrency.to_string(),
                },
                b.binding_constraint.as_str(),
                at.map_or(0.0, |a| a.output_tok_per_s),
                at.map_or(0.0, |a| a.ttft_ms.p95),
                at.map_or(0.0, |a| a.itl_ms.p95),
                match &b.cached_prefix {
                    None => String::new(),
                    Some(p) => format!(
                        "  {} (server hits {})",
                        if p.held {
                            "warm"
                        } else {
                            "COLD: the cache did not hold"
                        },
                        p.observed_hit_rate
                            .map_or("not reported".into(), |h| format!("{:.0}%", h * 100.0))
                    ),
                },
            );
        }
    }
    o
}

/// The envelope per bucket, and the quality measured (when it was).
pub fn envelope_lines(p: &Profile, limits: &Limits) -> String {
    let mut o = String::new();
    let table: Vec<String> = limits
        .buckets
        .iter()
        .map(|b| format!("{} safe at {}", b.label(), b.safe_concurrency))
        .collect();
    let _ = writeln!(o,
        "envelope per bucket (the governor charges a sequence 1 / safe concurrency, on the straight line in prompt + max_tokens between the buckets around it): {}",
        table.join(", ")
    );
    if let Some(q) = &p.quality {
        let _ = writeln!(
            o,
            "quality of {} on {} ({} tokens scored): perplexity {:.3}{}",
            q.precision,
            q.text_set,
            q.tokens_scored,
            q.perplexity,
            match (
                &q.reference_precision,
                q.kl_divergence_mean,
                q.top1_agreement
            ) {
                (Some(r), Some(kl), Some(t1)) =>
                    format!(", against {r}: KL {kl:.5} nats, top-1 agreement {t1:.4}"),
                _ => String::new(),
            }
        );
    }
    o
}
