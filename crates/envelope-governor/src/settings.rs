//! Validated settings: the profile's limits with overrides applied, queue
//! bounds, class deadlines, tenants (shares, weights, API keys), policies.
//! Parse, then validate: [`Settings::validate`] refuses what the governor
//! could not enforce and names the field. The tenants file is TOML:
//!
//! ```toml
//! header = "x-envelope-tenant"   # optional; where a tenant name may be given
//! default_burst = 1.0            # ceiling for tenants not listed
//! [tenants.alice]
//! guaranteed = 0.5               # fractions of KV budget and concurrency
//! burst = 1.0
//! weight = 2.0                   # fair-queueing weight (default 1)
//! api_keys = ["sk-alice-1"]
//! ```

use crate::ladder::LadderConfig;
use crate::ledger::{validate_shares, Share};
use envelope_profile::Limits;
use serde::Deserialize;
use std::collections::HashMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OverLimit {
    /// Lower max_tokens to the cap.
    Clamp,
    /// Refuse with 400.
    Reject,
}

impl std::str::FromStr for OverLimit {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "clamp" => Ok(OverLimit::Clamp),
            "reject" => Ok(OverLimit::Reject),
            _ => Err(format!("`{s}`: expected clamp or reject")),
        }
    }
}

/// A request past the largest measured bucket of the profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Beyond {
    /// Refuse with 400, naming the largest bucket (nothing measured says it is safe).
    Refuse,
    /// Admit it alone: it is charged the whole node.
    Alone,
}

impl std::str::FromStr for Beyond {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "refuse" => Ok(Beyond::Refuse),
            "alone" => Ok(Beyond::Alone),
            _ => Err(format!("`{s}`: expected refuse or alone")),
        }
    }
}

/// A request whose expected queue wait plus its bucket's TTFT would break
/// its TTFT budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OverBudget {
    /// 429 with Retry-After now, and out of the queue once the budget is spent.
    Shed,
    /// Queue it anyway (until its deadline).
    Queue,
}

impl std::str::FromStr for OverBudget {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "shed" => Ok(OverBudget::Shed),
            "queue" => Ok(OverBudget::Queue),
            _ => Err(format!("`{s}`: expected shed or queue")),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    #[serde(default)]
    pub guaranteed: f64,
    #[serde(default = "one")]
    pub burst: f64,
    #[serde(default = "one")]
    pub weight: f64,
    #[serde(default)]
    pub api_keys: Vec<String>,
}

fn one() -> f64 {
    1.0
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantsFile {
    #[serde(default = "default_header")]
    pub header: String,
    #[serde(default = "one")]
    pub default_burst: f64,
    #[serde(default)]
    pub tenants: HashMap<String, TenantSpec>,
}

fn default_header() -> String {
    "x-envelope-tenant".into()
}

impl Default for TenantsFile {
    fn default() -> Self {
        TenantsFile {
            header: default_header(),
            default_burst: 1.0,
            tenants: HashMap::new(),
        }
    }
}

impl TenantsFile {
    pub fn from_toml(text: &str, path: &str) -> Result<TenantsFile, String> {
        let t: TenantsFile = toml::from_str(text).map_err(|e| format!("{path}: {e}"))?;
        t.shares()
            .and_then(|s| validate_shares(&s))
            .map_err(|e| format!("{path}: {e}"))?;
        if !(0.0..=1.0).contains(&t.default_burst) {
            return Err(format!("{path}: `default_burst` must be in [0, 1]"));
        }
        let mut seen = HashMap::new();
        for (name, spec) in &t.tenants {
            if spec.weight <= 0.0 {
                return Err(format!(
                    "{path}: tenant `{name}`: `weight` must be positive"
                ));
            }
            for k in &spec.api_keys {
                if let Some(other) = seen.insert(k.clone(), name.clone()) {
                    return Err(format!(
                        "{path}: an API key is listed for both `{other}` and `{name}`"
                    ));
                }
            }
        }
        Ok(t)
    }

    pub fn shares(&self) -> Result<HashMap<String, Share>, String> {
        Ok(self
            .tenants
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    Share {
                        guaranteed: v.guaranteed,
                        burst: v.burst,
                    },
                )
            })
            .collect())
    }

    pub fn weights(&self) -> HashMap<String, f64> {
        self.tenants
            .iter()
            .map(|(k, v)| (k.clone(), v.weight))
            .collect()
    }

    /// Tenant of an API key (the bearer token), if mapped.
    pub fn tenant_of_key(&self, key: &str) -> Option<&str> {
        self.tenants
            .iter()
            .find(|(_, v)| v.api_keys.iter().any(|k| k == key))
            .map(|(name, _)| name.as_str())
    }
}

/// Everything the governor enforces; built by the CLI (or a test).
#[derive(Debug, Clone)]
pub struct Settings {
    pub limits: Limits,
    pub over_limit: OverLimit,
    pub max_queue_len: usize,
    pub max_queue_tokens: u64,
    pub max_queue_age_ms: u64,
    pub interactive_deadline_ms: u64,
    pub batch_deadline_ms: u64,
    pub max_body_bytes: usize,
    pub body_timeout_ms: u64,
    /// Upstream: time to response headers (a non-streaming answer sends them
    /// when it is done, so this bounds its whole generation).
    pub upstream_timeout_ms: u64,
    /// Longest gap between chunks of an upstream response before it counts as hung.
    pub upstream_idle_timeout_ms: u64,
    pub tenants: TenantsFile,
    pub ladder: LadderConfig,
    pub admin_token: Option<String>,
    pub profile_id: String,
    pub drain_window_ms: u64,
    /// Requests past the largest measured bucket.
    pub beyond: Beyond,
    /// TTFT budget (queue wait + the bucket's TTFT) per class, ms; None: no budget.
    pub interactive_ttft_budget_ms: Option<f64>,
    pub batch_ttft_budget_ms: Option<f64>,
    pub over_budget: OverBudget,
    /// The latency guard (proxied TTFT/ITL/e2e against the profile's SLOs).
    pub latency: crate::latency::LatencyConfig,
}

impl Settings {
    /// Defaults around a profile's limits (a table-less `limits` stands
    /// for one bucket of its scalar caps).
    pub fn new(mut limits: Limits, profile_id: impl Into<String>) -> Settings {
        if limits.buckets.is_empty() {
            limits.buckets = vec![limits.single_row()];
        }
        Settings {
            max_queue_len: 256,
            max_queue_tokens: limits.max_kv_tokens_in_flight.saturating_mul(4),
            limits,
            over_limit: OverLimit::Clamp,
            max_queue_age_ms: 30_000,
            interactive_deadline_ms: 30_000,
            batch_deadline_ms: 300_000,
            max_body_bytes: 8 << 20,
            body_timeout_ms: 30_000,
            upstream_timeout_ms: 600_000,
            upstream_idle_timeout_ms: 60_000,
            tenants: TenantsFile::default(),
            ladder: LadderConfig::default(),
            admin_token: None,
            profile_id: profile_id.into(),
            drain_window_ms: 10_000,
            beyond: Beyond::Refuse,
            interactive_ttft_budget_ms: None,
            batch_ttft_budget_ms: None,
            over_budget: OverBudget::Shed,
            latency: crate::latency::LatencyConfig::default(),
        }
    }

    /// Defaults around a whole profile: its limits, its TTFT SLO as the
    /// interactive TTFT budget, and its SLOs for the latency guard.
    pub fn from_profile(p: &envelope_profile::Profile, limits: Limits) -> Settings {
        let id = format!("{}@{}", p.selected, p.created_unix_ms);
        let mut s = Settings::new(limits, id);
        s.interactive_ttft_budget_ms = p.slo.ttft_p95_ms;
        s.latency = crate::latency::LatencyConfig::from_slo(&p.slo);
        s
    }

    pub fn ttft_budget_ms(&self, class: crate::queue::Class) -> Option<f64> {
        match class {
            crate::queue::Class::Interactive => self.interactive_ttft_budget_ms,
            crate::queue::Class::Batch => self.batch_ttft_budget_ms,
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        let l = &self.limits;
        for (name, v) in [
            ("max_context_tokens", l.max_context_tokens),
            ("max_output_tokens", l.max_output_tokens),
            ("max_concurrent_seqs", l.max_concurrent_seqs),
            ("max_kv_tokens_in_flight", l.max_kv_tokens_in_flight),
        ] {
            if v == 0 {
                return Err(format!("`{name}` must be at least 1"));
            }
        }
        if l.max_output_tokens > l.max_context_tokens {
            return Err("`max_output_tokens` exceeds `max_context_tokens`".into());
        }
        if self.max_queue_age_ms == 0 || self.max_body_bytes == 0 {
            return Err("`max_queue_age_ms` and `max_body_bytes` must be at least 1".into());
        }
        let (small, reject) = (self.ladder.small_kv_usage, self.ladder.reject_kv_usage);
        if !(0.0 < small && small <= reject && reject <= 1.0) {
            return Err(format!(
                "guard thresholds must satisfy 0 < small_kv ({small}) <= reject_kv ({reject}) <= 1"
            ));
        }
        let f = self.ladder.small_context_factor;
        if !(f > 0.0 && f <= 1.0) {
            return Err(format!("`small_context_factor` must be in (0, 1], got {f}"));
        }
        if self.limits.buckets.is_empty() {
            return Err("the profile's `limits.buckets` table is empty".into());
        }
        for (name, v) in [
            (
                "interactive_ttft_budget_ms",
                self.interactive_ttft_budget_ms,
            ),
            ("batch_ttft_budget_ms", self.batch_ttft_budget_ms),
        ] {
            if v.is_some_and(|v| v.is_nan() || v <= 0.0) {
                return Err(format!("`{name}` must be positive"));
            }
        }
        self.latency.validate()?;
        validate_shares(&self.tenants.shares()?)
    }

    pub fn class_deadline_ms(&self, class: crate::queue::Class) -> u64 {
        match class {
            crate::queue::Class::Interactive => self.interactive_deadline_ms,
            crate::queue::Class::Batch => self.batch_deadline_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub fn limits() -> Limits {
        let mut l = Limits {
            max_context_tokens: 2048,
            max_output_tokens: 256,
            max_concurrent_seqs: 8,
            max_kv_tokens_in_flight: 8192,
            buckets: vec![],
        };
        l.buckets = vec![l.single_row()];
        l
    }

    #[test]
    fn tenants_file_parses_and_validates() {
        let t = TenantsFile::from_toml(
            r#"
            [tenants.alice]
            guaranteed = 0.5
            api_keys = ["k1", "k2"]
            [tenants.bob]
            guaranteed = 0.25
            burst = 0.5
            weight = 2.0
            "#,
            "t.toml",
        )
        .unwrap();
        assert_eq!(t.header, "x-envelope-tenant");
        assert_eq!(t.tenant_of_key("k2"), Some("alice"));
        assert_eq!(t.tenant_of_key("k3"), None);
        assert_eq!(t.weights()["bob"], 2.0);
        for bad in [
            "[tenants.a]\nguaranteed = 0.7\n[tenants.b]\nguaranteed = 0.7",
            "[tenants.a]\nguaranteed = 0.7\nburst = 0.5",
            "[tenants.a]\nweight = 0",
            "[tenants.a]\napi_keys=[\"k\"]\n[tenants.b]\napi_keys=[\"k\"]",
            "[tenants.a]\nguarantee = 0.1",
            "default_burst = 2.0",
        ] {
            let e = TenantsFile::from_toml(bad, "t.toml").unwrap_err();
            assert!(e.starts_with("t.toml"), "{e}");
        }
    }

    #[test]
    fn settings_validation() {
        let mut s = Settings::new(limits(), "p");
        s.validate().unwrap();
        assert_eq!(s.max_queue_tokens, 4 * 8192);
        s.limits.max_output_tokens = 4096;
        assert!(s.validate().unwrap_err().contains("max_output_tokens"));
        let mut s = Settings::new(limits(), "p");
        s.limits.max_concurrent_seqs = 0;
        assert!(s.validate().unwrap_err().contains("max_concurrent_seqs"));
        let mut s = Settings::new(limits(), "p");
        s.ladder.small_context_factor = 0.0;
        assert!(s.validate().is_err());
        let mut s = Settings::new(limits(), "p");
        s.ladder.small_kv_usage = 0.99;
        assert!(s.validate().unwrap_err().contains("small_kv"));
        let mut s = Settings::new(limits(), "p");
        s.limits.buckets.clear();
        assert!(s.validate().unwrap_err().contains("buckets"));
        let mut s = Settings::new(limits(), "p");
        s.interactive_ttft_budget_ms = Some(0.0);
        assert!(s
            .validate()
            .unwrap_err()
            .contains("interactive_ttft_budget_ms"));
        assert_eq!("reject".parse::<OverLimit>(), Ok(OverLimit::Reject));
        assert_eq!("alone".parse::<Beyond>(), Ok(Beyond::Alone));
        assert_eq!("shed".parse::<OverBudget>(), Ok(OverBudget::Shed));
        assert!("drop".parse::<OverBudget>().is_err());
        assert!("maybe".parse::<OverLimit>().is_err());
    }
}
