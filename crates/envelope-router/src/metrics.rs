//! `/metrics` with model tiers: the router's own families
//! (`envelope_tier_*`: calls, tokens, cost, escalations, fallbacks, cache,
//! shadow agreement, per feature and tier) and every upstream's governor
//! families, merged into one exposition with `tier` and `upstream` labels
//! (each family once, its samples together, as OpenMetrics requires).

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

pub type Labels = Vec<(String, String)>;

pub fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

pub struct TierMetrics {
    registry: Registry,
    /// {tier, feature, outcome}: ok, escalated, cached, error.
    pub calls: Family<Labels, Counter>,
    /// {tier, feature, kind}: input, cached_input, output.
    pub tokens: Family<Labels, Counter>,
    /// {tier, feature, tenant}.
    pub cost: Family<Labels, Counter<f64, AtomicU64>>,
    /// {from, to, check}.
    pub escalations: Family<Labels, Counter>,
    /// {from, to}.
    pub fallbacks: Family<Labels, Counter>,
    /// {tier, reason}: where calls started and which rule put them there.
    pub routes: Family<Labels, Counter>,
    /// {result}: hit, miss.
    pub cache: Family<Labels, Counter>,
    /// {tier, feature, agreed}: shadow comparisons with the next tier up.
    pub shadow: Family<Labels, Counter>,
    /// {tier, feature}: what shadow calls cost (calibration spend).
    pub shadow_cost: Family<Labels, Counter<f64, AtomicU64>>,
    /// {mode = tiers, reason}: calls the router refused (the governor
    /// error's label), in the governor's one family of refusals.
    pub refusals: Family<Labels, Counter>,
    /// {feature}: 1 while its mean cost per call is over its allowance.
    pub over_budget: Family<Labels, Gauge>,
    /// {version}: the routing in force (value 1).
    pub version: Family<Labels, Gauge>,
    /// {outcome}: reloads and rollbacks of the tiers file.
    pub reloads: Family<Labels, Counter>,
    /// `--record`: calls written, and calls dropped with the writer behind.
    pub records_written: Counter,
    pub records_dropped: Counter,
}

impl TierMetrics {
    pub fn new() -> TierMetrics {
        let mut m = TierMetrics {
            registry: Registry::default(),
            calls: Family::default(),
            tokens: Family::default(),
            cost: Family::default(),
            escalations: Family::default(),
            fallbacks: Family::default(),
            routes: Family::default(),
            cache: Family::default(),
            shadow: Family::default(),
            shadow_cost: Family::default(),
            refusals: Family::default(),
            over_budget: Family::default(),
            version: Family::default(),
            reloads: Family::default(),
            records_written: Counter::default(),
            records_dropped: Counter::default(),
        };
        let r = &mut m.registry;
        r.register(
            "envelope_tier_calls",
            "Calls answered, by tier (the one that answered), feature and outcome",
            m.calls.clone(),
        );
        r.register(
            "envelope_tier_tokens",
            "Tokens of every attempt, by tier, feature and kind",
            m.tokens.clone(),
        );
        r.register(
            "envelope_tier_cost",
            "Cost units of every attempt under the price contract, by tier, feature and tenant",
            m.cost.clone(),
        );
        r.register(
            "envelope_tier_escalations",
            "Calls retried a tier up, by the check their answer failed",
            m.escalations.clone(),
        );
        r.register(
            "envelope_tier_fallbacks",
            "Calls placed on another tier because theirs had no room",
            m.fallbacks.clone(),
        );
        r.register(
            "envelope_tier_routes",
            "Calls by starting tier and the rule that chose it",
            m.routes.clone(),
        );
        r.register(
            "envelope_tier_cache",
            "Deterministic calls looked up in the answer cache",
            m.cache.clone(),
        );
        r.register(
            "envelope_tier_shadow",
            "Shadow comparisons with the next tier up, by agreement",
            m.shadow.clone(),
        );
        r.register(
            "envelope_tier_shadow_cost",
            "Cost units of shadow calls, by the tier that served them and feature",
            m.shadow_cost.clone(),
        );
        let (name, help) = envelope_governor::metrics::REJECTIONS;
        r.register(name, help, m.refusals.clone());
        r.register(
            "envelope_tier_feature_over_budget",
            "1 while a feature's mean cost per call is over its allowance",
            m.over_budget.clone(),
        );
        r.register(
            "envelope_tier_config",
            "The tiers file version in force (value 1)",
            m.version.clone(),
        );
        r.register(
            "envelope_tier_reloads",
            "Reloads and rollbacks of the tiers file, by outcome",
            m.reloads.clone(),
        );
        r.register(
            "envelope_tier_records_written",
            "Calls written by --record",
            m.records_written.clone(),
        );
        r.register(
            "envelope_tier_records_dropped",
            "Calls --record dropped because its writer was behind",
            m.records_dropped.clone(),
        );
        m
    }

    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = encode(&mut s, &self.registry);
        s
    }
}

impl Default for TierMetrics {
    fn default() -> Self {
        TierMetrics::new()
    }
}

/// `name{extra,labels} value` from `name{labels} value` or `name value`.
fn with_labels(sample: &str, extra: &str) -> String {
    match sample.find(['{', ' ']) {
        Some(i) if sample.as_bytes()[i] == b'{' => {
            let rest = &sample[i + 1..];
            let sep = if rest.starts_with('}') { "" } else { "," };
            format!("{}{{{extra}{sep}{rest}", &sample[..i])
        }
        Some(i) => format!("{}{{{extra}}}{}", &sample[..i], &sample[i..]),
        None => sample.to_string(),
    }
}

/// One exposition from several: `parts` are (labels to add, text). Each
/// family's `# HELP`/`# TYPE`/`# UNIT` is written once, followed by its
/// samples from every part; one `# EOF` ends it.
pub fn merge(parts: &[(Labels, String)]) -> String {
    // family -> (descriptor lines, samples), in first-seen order.
    let mut order: Vec<String> = Vec::new();
    let mut families: std::collections::HashMap<String, (Vec<String>, Vec<String>)> =
        std::collections::HashMap::new();
    for (labels, text) in parts {
        let extra = labels
            .iter()
            .map(|(k, v)| format!("{k}=\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\"")))
            .collect::<Vec<_>>()
            .join(",");
        let mut current = String::new();
        for line in text.lines() {
            if line == "# EOF" || line.is_empty() {
                continue;
            }
            if let Some(rest) = line.strip_prefix("# ") {
                let mut words = rest.splitn(3, ' ');
                let (_kind, name) = (words.next(), words.next().unwrap_or(""));
                current = name.to_string();
                let e = families.entry(current.clone()).or_insert_with(|| {
                    order.push(current.clone());
                    (Vec::new(), Vec::new())
                });
                if !e.0.iter().any(|l| l == line) {
                    e.0.push(line.to_string());
                }
                continue;
            }
            let sample = if extra.is_empty() {
                line.to_string()
            } else {
                with_labels(line, &extra)
            };
            families
                .entry(current.clone())
                .or_insert_with(|| {
                    order.push(current.clone());
                    (Vec::new(), Vec::new())
                })
                .1
                .push(sample);
        }
    }
    let mut out = String::new();
    for name in order {
        let (desc, samples) = &families[&name];
        for l in desc.iter().chain(samples) {
            out.push_str(l);
            out.push('\n');
        }
    }
    out.push_str("# EOF\n");
    out
}

impl envelope_governor::refusal::RefusalCounter for TierMetrics {
    fn count_refusal(&self, reason: &'static str) {
        self.refusals
            .get_or_create(&labels(&[("mode", "tiers"), ("reason", reason)]))
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_are_merged_with_each_parts_labels() {
        let a = envelope_governor::metrics::Metrics::new();
        a.reject("queue_full");
        a.in_flight_sequences.set(2);
        let b = envelope_governor::metrics::Metrics::new();
        b.reject("queue_full");
        b.in_flight_sequences.set(5);
        let t = TierMetrics::new();
        t.calls
            .get_or_create(&labels(&[
                ("tier", "small"),
                ("feature", "f"),
                ("outcome", "ok"),
            ]))
            .inc();
        // The router's own refusal, in the same family.
        envelope_governor::refusal::RefusalCounter::count_refusal(&t, "queue_full");
        let text = merge(&[
            (vec![], t.render()),
            (labels(&[("tier", "small"), ("upstream", "0")]), a.render()),
            (labels(&[("tier", "large"), ("upstream", "0")]), b.render()),
        ]);
        assert_eq!(
            text.matches("# TYPE envelope_governor_rejections ").count(),
            1,
            "{text}"
        );
        assert_eq!(text.matches("# EOF").count(), 1);
        assert!(text.contains(
            "envelope_governor_rejections_total{tier=\"small\",upstream=\"0\",mode=\"single\",reason=\"queue_full\"} 1"
        ));
        assert!(
            text.contains(
                "envelope_governor_rejections_total{mode=\"tiers\",reason=\"queue_full\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("envelope_governor_in_flight_sequences{tier=\"large\",upstream=\"0\"} 5")
        );
        assert!(text
            .contains("envelope_tier_calls_total{tier=\"small\",feature=\"f\",outcome=\"ok\"} 1"));
        // Each family's samples follow its own descriptor, together.
        let lines: Vec<&str> = text.lines().collect();
        let at = |s: &str| lines.iter().position(|l| l.starts_with(s)).unwrap();
        let small = at("envelope_governor_in_flight_sequences{tier=\"small\"");
        let large = at("envelope_governor_in_flight_sequences{tier=\"large\"");
        assert_eq!(large, small + 1);
        assert!(at("# TYPE envelope_governor_in_flight_sequences") < small);
    }
}
