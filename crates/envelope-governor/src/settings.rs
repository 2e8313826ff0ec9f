//! Validated settings: the profile's limits with overrides applied, queue
//! bounds, class deadlines, tenants (shares, weights, API keys), policies.
//! A [`SettingsDraft`] is put together from the defaults, the profile, the
//! flags and the files; [`SettingsDraft::check`] refuses what the governor
//! could not enforce, naming the field, and is the only way to a
//! [`Settings`], so the governor never holds invalid ones. The tenants
//! file is TOML:
//!
//! ```toml
//! trusted_header = "x-tenant"    # optional: set by a trusted front proxy
//! default_burst = 1.0            # ceiling for tenants not listed
//! default_classes = ["interactive", "batch"]
//! [tenants.alice]
//! guaranteed = 0.5               # fractions of KV budget and concurrency
//! burst = 1.0
//! weight = 2.0                   # fair-queueing weight (default 1)
//! api_keys = ["sk-alice-1"]
//! classes = ["batch"]            # the classes alice may use (default both)
//! ```
//!
//! Identity: a request's tenant comes from the trusted header when the file
//! names one and the request carries it, else from its API key (the bearer
//! token) when any keys are configured (no key or an unknown one: 401),
//! else it is `default`. A client-chosen `x-envelope-tenant` counts for
//! nothing: without a trusted header every anonymous request is `default`.

mod groups;

pub use groups::{
    default_passthrough_paths, default_public_paths, overlay, CountingSettings, FrontSettings,
    QueueSettings, TimeoutSettings,
};

use crate::ladder::LadderSettings;
use crate::ledger::{validate_shares, Share};
use crate::queue::Class;
use envelope_profile::Limits;
use serde::Deserialize;
use std::collections::HashMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
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
pub struct TenantConfig {
    #[serde(default)]
    pub guaranteed: f64,
    #[serde(default = "one")]
    pub burst: f64,
    #[serde(default = "one")]
    pub weight: f64,
    #[serde(default)]
    pub api_keys: Vec<String>,
    /// The classes this tenant may use; the first is its default (absent: both).
    #[serde(default)]
    pub classes: Option<Vec<Class>>,
}

fn one() -> f64 {
    1.0
}

/// A tenants file as written (`--tenants`); [`TenantsSettings::from_toml`]
/// checks it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantsConfig {
    /// A header a trusted front proxy sets to the tenant's name (the
    /// governor must then be reachable only through that proxy).
    #[serde(default)]
    pub trusted_header: Option<String>,
    /// A header an endpoint picker in front sets to the request's fairness
    /// id (llm-d: `x-llm-d-inference-fairness-id`): the tenant of a request
    /// while no API keys are configured (a key says otherwise), when it
    /// names a tenant listed here; any other id is `default`, so a client
    /// that invents ids gains nothing.
    #[serde(default)]
    pub fairness_header: Option<String>,
    /// The header naming a request's objective (llm-d:
    /// `x-llm-d-inference-objective`, the default), read for
    /// `objective_classes`.
    #[serde(default)]
    pub objective_header: Option<String>,
    /// Objective name -> class, for a request without `x-envelope-class`:
    /// the picker's objectives (and so their priorities) as the governor's
    /// classes. A class the tenant may not use is not taken.
    #[serde(default)]
    pub objective_classes: HashMap<String, Class>,
    #[serde(default = "one")]
    pub default_burst: f64,
    /// The classes of tenants not listed (absent: both).
    #[serde(default)]
    pub default_classes: Option<Vec<Class>>,
    #[serde(default)]
    pub tenants: HashMap<String, TenantConfig>,
}

impl Default for TenantsConfig {
    fn default() -> Self {
        TenantsConfig {
            trusted_header: None,
            fairness_header: None,
            objective_header: None,
            objective_classes: HashMap::new(),
            default_burst: 1.0,
            default_classes: None,
            tenants: HashMap::new(),
        }
    }
}

/// The tenants the governor runs on: a tenants file that passed every
/// check, with its API keys indexed (none: everyone is `default`). Read
/// through `Deref`.
#[derive(Debug, Clone, Default)]
pub struct TenantsSettings {
    config: TenantsConfig,
    /// API key -> tenant.
    keys: HashMap<String, String>,
}

impl std::ops::Deref for TenantsSettings {
    type Target = TenantsConfig;
    fn deref(&self) -> &TenantsConfig {
        &self.config
    }
}

/// The longest tenant name a trusted header may carry.
pub use crate::names::{valid_tenant_name, MAX_TENANT_NAME};

impl TenantsSettings {
    /// Parses and checks a tenants file (`path` names it in errors).
    ///
    /// # Errors
    /// Not TOML of these fields, shares that do not fit together, a weight
    /// not positive, a bad tenant, objective or header name, an empty or
    /// shared API key, an empty class list.
    pub fn from_toml(text: &str, path: &str) -> Result<TenantsSettings, String> {
        let mut t: TenantsConfig = toml::from_str(text).map_err(|e| format!("{path}: {e}"))?;
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
            if !valid_tenant_name(name) {
                return Err(format!(
                    "{path}: tenant `{name}`: names are 1 to {MAX_TENANT_NAME} of A-Z a-z 0-9 . _ - : @"
                ));
            }
            if spec.classes.as_ref().is_some_and(Vec::is_empty) {
                return Err(format!(
                    "{path}: tenant `{name}`: `classes` is empty (leave it out for both)"
                ));
            }
            for k in &spec.api_keys {
                if k.trim().is_empty() {
                    return Err(format!("{path}: tenant `{name}`: an API key is empty"));
                }
                if let Some(other) = seen.insert(k.clone(), name.clone()) {
                    return Err(format!(
                        "{path}: an API key is listed for both `{other}` and `{name}`"
                    ));
                }
            }
        }
        if t.default_classes.as_ref().is_some_and(Vec::is_empty) {
            return Err(format!(
                "{path}: `default_classes` is empty (leave it out for both)"
            ));
        }
        for (field, h) in [
            ("trusted_header", &mut t.trusted_header),
            ("fairness_header", &mut t.fairness_header),
            ("objective_header", &mut t.objective_header),
        ] {
            if let Some(name) = h {
                if axum::http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                    return Err(format!(
                        "{path}: `{field}` `{name}` is not a valid header name"
                    ));
                }
                *h = Some(name.to_ascii_lowercase());
            }
        }
        if let Some(o) = t
            .objective_classes
            .keys()
            .find(|o| !crate::names::valid_name(o))
        {
            return Err(format!(
                "{path}: `objective_classes`: `{o}` is not a valid objective name (1 to 64 of A-Z a-z 0-9 . _ - : @ /)"
            ));
        }
        let keys = t
            .tenants
            .iter()
            .flat_map(|(name, spec)| spec.api_keys.iter().map(move |k| (k.clone(), name.clone())))
            .collect();
        Ok(TenantsSettings { config: t, keys })
    }

    /// Whether any tenant has API keys (then every request needs one).
    pub fn keys_required(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Tenant of an API key (the bearer token), if mapped. A hash lookup:
    /// its time does not depend on how much of a key matches.
    pub fn tenant_of_key(&self, key: &str) -> Option<&str> {
        self.keys.get(key).map(String::as_str)
    }
}

impl TenantsConfig {
    /// The classes `tenant` may use, its default first.
    pub fn classes_of(&self, tenant: &str) -> &[Class] {
        const BOTH: &[Class] = &[Class::Interactive, Class::Batch];
        self.tenants
            .get(tenant)
            .and_then(|t| t.classes.as_deref())
            .or(self.default_classes.as_deref())
            .unwrap_or(BOTH)
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
}

/// Everything the governor enforces, not yet checked: defaults from
/// [`SettingsDraft::new`], then what the profile, the flags and the files
/// set; [`SettingsDraft::check`] makes it [`Settings`].
#[derive(Debug, Clone)]
pub struct SettingsDraft {
    pub limits: Limits,
    pub over_limit: OverLimit,
    /// Clients: bodies, headers, connections, open and forwarded paths.
    pub front: FrontSettings,
    /// What may wait, how long, and the classes' deadlines.
    pub queue: QueueSettings,
    /// The upstream call's and the whole request's time.
    pub timeouts: TimeoutSettings,
    /// Counting prompt tokens.
    pub counting: CountingSettings,
    pub tenants: TenantsSettings,
    pub ladder: LadderSettings,
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
    pub latency: crate::latency::LatencySettings,
    /// Budgets over time per tenant and feature (`--budgets`).
    pub budgets: Option<std::sync::Arc<crate::budget::Budgets>>,
}

/// Whether `path` is in an allowlist of exact paths and `prefix*` entries.
pub fn path_allowed(list: &[String], path: &str) -> bool {
    list.iter().any(|p| match p.strip_suffix('*') {
        Some(prefix) => path.starts_with(prefix) && !path[prefix.len()..].contains(".."),
        None => p == path,
    })
}

/// Settings that passed [`SettingsDraft::check`]: the only kind the
/// governor takes. Read through `Deref`; to change one, take
/// [`Settings::draft`], change it, and check it again.
#[derive(Debug, Clone)]
pub struct Settings {
    draft: SettingsDraft,
    /// The tenants' shares, checked to fit together.
    shares: HashMap<String, Share>,
}

impl std::ops::Deref for Settings {
    type Target = SettingsDraft;
    fn deref(&self) -> &SettingsDraft {
        &self.draft
    }
}

impl Settings {
    /// A copy to change and check again (a reload, a test).
    pub fn draft(&self) -> SettingsDraft {
        self.draft.clone()
    }

    /// The tenants' guaranteed and burst shares of the envelope.
    pub fn shares(&self) -> &HashMap<String, Share> {
        &self.shares
    }
}

impl SettingsDraft {
    /// Defaults around a profile's limits (a table-less `limits` stands
    /// for one bucket of its scalar caps).
    pub fn new(mut limits: Limits, profile_id: impl Into<String>) -> SettingsDraft {
        if limits.buckets.is_empty() {
            limits.buckets = vec![limits.single_row()];
        }
        SettingsDraft {
            front: FrontSettings::default(),
            queue: QueueSettings::for_kv_tokens(limits.max_kv_tokens_in_flight),
            timeouts: TimeoutSettings::default(),
            counting: CountingSettings::default(),
            limits,
            over_limit: OverLimit::Clamp,
            tenants: TenantsSettings::default(),
            ladder: LadderSettings::default(),
            admin_token: None,
            profile_id: profile_id.into(),
            drain_window_ms: 10_000,
            beyond: Beyond::Refuse,
            interactive_ttft_budget_ms: None,
            batch_ttft_budget_ms: None,
            over_budget: OverBudget::Shed,
            latency: crate::latency::LatencySettings::default(),
            budgets: None,
        }
    }

    /// Defaults around a whole profile: its limits, its TTFT SLO as the
    /// interactive TTFT budget, and its SLOs for the latency guard.
    pub fn from_profile(p: &envelope_profile::Profile, limits: Limits) -> SettingsDraft {
        let id = format!("{}@{}", p.selected, p.created_unix_ms);
        let mut s = SettingsDraft::new(limits, id);
        s.interactive_ttft_budget_ms = p.slo.ttft_p95_ms;
        s.latency = crate::latency::LatencySettings::from_slo(&p.slo);
        s
    }

    pub fn ttft_budget_ms(&self, class: crate::queue::Class) -> Option<f64> {
        match class {
            crate::queue::Class::Interactive => self.interactive_ttft_budget_ms,
            crate::queue::Class::Batch => self.batch_ttft_budget_ms,
        }
    }

    /// The settings, or what is wrong with them, naming the field.
    ///
    /// # Errors
    /// A limit, timeout or count of 0, an output cap over the context, a
    /// path not starting with `/`, guard thresholds out of order, an empty
    /// bucket table, a TTFT budget not positive, latency settings out of
    /// range, tenants' shares that do not fit together.
    pub fn check(self) -> Result<Settings, String> {
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
        if self.queue.max_queue_age_ms == 0 || self.front.max_body_bytes == 0 {
            return Err("`max_queue_age_ms` and `max_body_bytes` must be at least 1".into());
        }
        for (name, v) in [
            ("header_read_timeout_ms", self.front.header_read_timeout_ms),
            ("max_connections", self.front.max_connections as u64),
            ("connect_timeout_ms", self.timeouts.connect_timeout_ms),
            ("max_request_ms", self.timeouts.max_request_ms),
            ("count_timeout_ms", self.counting.count_timeout_ms),
            ("max_counting", self.counting.max_counting as u64),
        ] {
            if v == 0 {
                return Err(format!("`{name}` must be at least 1"));
            }
        }
        for (name, list) in [
            ("passthrough_paths", &self.front.passthrough_paths),
            ("public_paths", &self.front.public_paths),
        ] {
            if let Some(p) = list.iter().find(|p| !p.starts_with('/')) {
                return Err(format!("`{name}`: `{p}` must start with /"));
            }
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
        let shares = self.tenants.shares()?;
        validate_shares(&shares)?;
        Ok(Settings {
            draft: self,
            shares,
        })
    }

    pub fn class_deadline_ms(&self, class: crate::queue::Class) -> u64 {
        match class {
            crate::queue::Class::Interactive => self.queue.interactive_deadline_ms,
            crate::queue::Class::Batch => self.queue.batch_deadline_ms,
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
        let t = TenantsSettings::from_toml(
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
        assert_eq!(t.trusted_header, None);
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
            let e = TenantsSettings::from_toml(bad, "t.toml").unwrap_err();
            assert!(e.starts_with("t.toml"), "{e}");
        }
    }

    #[test]
    fn settings_validation() {
        let s = SettingsDraft::new(limits(), "p").check().unwrap();
        assert_eq!(s.queue.max_queue_tokens, 4 * 8192);
        let mut s = s.draft();
        s.limits.max_output_tokens = 4096;
        assert!(s.check().unwrap_err().contains("max_output_tokens"));
        let mut s = SettingsDraft::new(limits(), "p");
        s.limits.max_concurrent_seqs = 0;
        assert!(s.check().unwrap_err().contains("max_concurrent_seqs"));
        let mut s = SettingsDraft::new(limits(), "p");
        s.ladder.small_context_factor = 0.0;
        assert!(s.check().is_err());
        let mut s = SettingsDraft::new(limits(), "p");
        s.ladder.small_kv_usage = 0.99;
        assert!(s.check().unwrap_err().contains("small_kv"));
        let mut s = SettingsDraft::new(limits(), "p");
        s.limits.buckets.clear();
        assert!(s.check().unwrap_err().contains("buckets"));
        let mut s = SettingsDraft::new(limits(), "p");
        s.interactive_ttft_budget_ms = Some(0.0);
        assert!(s
            .check()
            .unwrap_err()
            .contains("interactive_ttft_budget_ms"));
        assert_eq!("reject".parse::<OverLimit>(), Ok(OverLimit::Reject));
        assert_eq!("alone".parse::<Beyond>(), Ok(Beyond::Alone));
        assert_eq!("shed".parse::<OverBudget>(), Ok(OverBudget::Shed));
        assert!("drop".parse::<OverBudget>().is_err());
        assert!("maybe".parse::<OverLimit>().is_err());
    }
}
