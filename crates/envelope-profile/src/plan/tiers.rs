//! Capacity per model tier: a workload split by the share of its model
//! requests each tier serves, so each tier is sized with its own profile.
//! The mix comes from the workload's classes (`tiers = { small = 0.8,
//! large = 0.2 }`) or from a trace the governor recorded, where an escalated
//! call is an attempt on the tier it started on and on the one that
//! answered. Pure functions.

use crate::trace::Trace;
use crate::workload::Workload;
use std::collections::BTreeMap;

/// Attempts per call on each tier, from a trace the governor recorded
/// with model tiers (`envelope govern --record`: each call's `tiers`).
/// Cached answers take no attempt; an escalated call is an attempt on the
/// tier it started on and on the one that answered; a refused call is an
/// attempt on the tier it started on. Calls without `tiers` are skipped.
///
/// # Errors
/// No call with `tiers` in the trace.
pub fn mix_from_trace(trace: &Trace) -> Result<BTreeMap<String, f64>, String> {
    let mut attempts: BTreeMap<String, f64> = BTreeMap::new();
    let mut calls = 0u64;
    for t in trace.requests.iter().filter_map(|r| r.tiers.as_ref()) {
        calls += 1;
        if t.outcome == "cached" {
            continue;
        }
        *attempts.entry(t.tier.clone()).or_default() += 1.0;
        if t.escalated.is_some() && t.start_tier != t.tier {
            *attempts.entry(t.start_tier.clone()).or_default() += 1.0;
        }
    }
    if calls == 0 {
        return Err("no call in the trace has `tiers` (record it with `envelope govern --tiers FILE --record FILE`)".into());
    }
    Ok(attempts
        .into_iter()
        .map(|(t, a)| (t, a / calls as f64))
        .collect())
}

/// The part of `w` that tier `tier` serves: each class's model calls per
/// run scaled by its share on the tier (the class's own `tiers`, else
/// `mix`); classes with no share on it are left out. `None` when no class
/// sends it anything.
pub fn tier_workload(w: &Workload, tier: &str, mix: &BTreeMap<String, f64>) -> Option<Workload> {
    let classes: Vec<_> = w
        .classes
        .iter()
        .filter_map(|c| {
            let shares = if c.tiers.is_empty() { mix } else { &c.tiers };
            let share = shares.get(tier).copied().unwrap_or(0.0);
            (share > 0.0).then(|| {
                let mut c = c.clone();
                c.model_calls_per_run *= share;
                c.tiers.clear();
                c
            })
        })
        .collect();
    (!classes.is_empty()).then(|| Workload {
        name: format!("{} @ {tier}", w.name),
        classes,
        ..w.clone()
    })
}

/// Tiers named anywhere: in `mix` or in any class's own shares.
pub fn tiers_named(w: &Workload, mix: &BTreeMap<String, f64>) -> Vec<String> {
    let mut names: Vec<String> = mix.keys().cloned().collect();
    for c in &w.classes {
        names.extend(c.tiers.keys().cloned());
    }
    names.sort();
    names.dedup();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: &str = r#"
name = "agents"
[[class]]
name = "triage"
runs_per_min = 60
model_calls_per_run = 10
input_tokens_p50 = 100
input_tokens_p95 = 200
output_tokens_p50 = 10
output_tokens_p95 = 20
[[class]]
name = "review"
runs_per_min = 6
model_calls_per_run = 2
input_tokens_p50 = 1000
input_tokens_p95 = 2000
output_tokens_p50 = 100
output_tokens_p95 = 200
tiers = { large = 1.0 }
"#;

    /// A recorded call's line with its routing.
    fn routed(tier: &str, start: &str, escalated: Option<&str>, outcome: &str) -> String {
        let esc = escalated.map_or(String::new(), |e| format!(r#","escalated":"{e}""#));
        format!(
            r#"{{"t_s":0,"input_tokens":10,"output_tokens":2,"tiers":{{"start_tier":"{start}","tier":"{tier}","reason":"default","outcome":"{outcome}","cost":0.0,"tiers_version":"v1"{esc}}}}}"#
        )
    }

    #[test]
    fn the_trace_gives_attempts_per_call() {
        use crate::trace::TraceFormat;
        let log = [
            routed("small", "small", None, "ok"),
            routed("small", "small", None, "ok"),
            routed("small", "small", None, "cached"),
            routed("large", "small", Some("invalid_json"), "escalated"),
            // Not routed across tiers: skipped.
            r#"{"t_s":1,"input_tokens":10,"output_tokens":2}"#.to_string(),
        ]
        .join("\n");
        let t = Trace::parse("t", &log, TraceFormat::Envelope).unwrap();
        let m = mix_from_trace(&t).unwrap();
        // small: 2 answered + 1 escalated away = 3 of 4; large: 1 of 4.
        assert_eq!(m["small"], 0.75);
        assert_eq!(m["large"], 0.25);
        let plain = Trace::parse(
            "t",
            r#"{"t_s":1,"input_tokens":10,"output_tokens":2}"#,
            TraceFormat::Envelope,
        )
        .unwrap();
        assert!(mix_from_trace(&plain).unwrap_err().contains("--record"));
    }

    #[test]
    fn each_tier_gets_its_share_of_each_class() {
        let w = Workload::from_toml(W, "w.toml").unwrap();
        let mix: BTreeMap<String, f64> = [("small".into(), 0.8), ("large".into(), 0.25)].into();
        let small = tier_workload(&w, "small", &mix).unwrap();
        assert_eq!(small.classes.len(), 1, "review runs on large only");
        assert_eq!(small.classes[0].model_calls_per_run, 8.0);
        let large = tier_workload(&w, "large", &mix).unwrap();
        assert_eq!(large.classes.len(), 2);
        assert_eq!(large.classes[0].model_calls_per_run, 2.5);
        assert_eq!(large.classes[1].model_calls_per_run, 2.0);
        assert!(tier_workload(&w, "medium", &mix).is_none());
        assert_eq!(tiers_named(&w, &mix), ["large", "small"]);
    }
}
