//! The budgets file (`--budgets budgets.toml`): limits over time per
//! tenant and per feature tag, a versioned price contract for cost units
//! (the same price shape as the model tiers' file), and what each budget
//! does when the shared store cannot be reached.
//!
//! ```toml
//! prices_version = "list-2026-12"
//! [price]
//! input_per_mtok = 0.5
//! output_per_mtok = 1.5
//!
//! [tenants.acme]
//! requests_per_minute = 600
//! input_tokens_per_minute = 200000
//! output_tokens_per_minute = 40000
//! cost_per_day = 25.0
//! on_store_error = "closed"
//!
//! [tenants."*"]          # every other tenant, each its own buckets
//! output_tokens_per_minute = 5000
//!
//! [features.search]      # requests with x-envelope-feature: search
//! output_tokens_per_minute = 20000
//! mode = "shadow"
//! ```

use crate::names::{valid_name, valid_tenant_name};
use crate::price::{Price, PriceConfig};
use envelope_profile::Profile;
use serde::Deserialize;
use std::collections::BTreeMap;

/// What a budget does when the store cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnStoreError {
    /// Admit (the budget is not counted while the store is away).
    #[default]
    Open,
    /// Refuse with 503 and a Retry-After.
    Closed,
}

/// Whether a budget refuses or only reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    #[default]
    Enforce,
    /// Refuses nothing; counts what it would have refused.
    Shadow,
}

/// What a budget measures, and over which window it refills.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Requests,
    InputTokens,
    OutputTokens,
    Cost,
}

impl Kind {
    pub const ALL: [Kind; 4] = [
        Kind::Requests,
        Kind::InputTokens,
        Kind::OutputTokens,
        Kind::Cost,
    ];

    /// The field that sets it in the budgets file.
    pub fn field(self) -> &'static str {
        match self {
            Kind::Requests => "requests_per_minute",
            Kind::InputTokens => "input_tokens_per_minute",
            Kind::OutputTokens => "output_tokens_per_minute",
            Kind::Cost => "cost_per_day",
        }
    }

    pub fn window_ms(self) -> u64 {
        match self {
            Kind::Cost => 86_400_000,
            _ => 60_000,
        }
    }

    /// Short name in store keys.
    pub fn key(self) -> &'static str {
        match self {
            Kind::Requests => "rpm",
            Kind::InputTokens => "itpm",
            Kind::OutputTokens => "otpm",
            Kind::Cost => "cpd",
        }
    }
}

/// One budget's limits as written.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitConfig {
    #[serde(default)]
    pub requests_per_minute: Option<f64>,
    #[serde(default)]
    pub input_tokens_per_minute: Option<f64>,
    #[serde(default)]
    pub output_tokens_per_minute: Option<f64>,
    #[serde(default)]
    pub cost_per_day: Option<f64>,
    #[serde(default)]
    pub on_store_error: Option<OnStoreError>,
    #[serde(default)]
    pub mode: Option<Mode>,
}

impl LimitConfig {
    pub fn limit(&self, k: Kind) -> Option<f64> {
        match k {
            Kind::Requests => self.requests_per_minute,
            Kind::InputTokens => self.input_tokens_per_minute,
            Kind::OutputTokens => self.output_tokens_per_minute,
            Kind::Cost => self.cost_per_day,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct BudgetsConfig {
    #[serde(default)]
    prices_version: Option<String>,
    #[serde(default)]
    price: Option<PriceConfig>,
    #[serde(default)]
    on_store_error: OnStoreError,
    #[serde(default)]
    mode: Mode,
    #[serde(default)]
    tenants: BTreeMap<String, LimitConfig>,
    #[serde(default)]
    features: BTreeMap<String, LimitConfig>,
}

/// Whom a budget is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Tenant,
    Feature,
}

impl Scope {
    fn label(self) -> &'static str {
        match self {
            Scope::Tenant => "tenant",
            Scope::Feature => "feature",
        }
    }
}

/// One budget, ready to apply.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    pub scope: Scope,
    /// Its name in the file (`*` for every other tenant).
    pub name: String,
    pub limits: Vec<(Kind, f64)>,
    pub on_store_error: OnStoreError,
    pub mode: Mode,
}

impl Rule {
    /// The metrics label of this budget's `kind` (bounded: names come
    /// from the file).
    pub fn label(&self, kind: Kind) -> String {
        format!("{}:{}:{}", self.scope.label(), self.name, kind.field())
    }
}

/// The budgets file, checked and priced.
#[derive(Debug, Clone, PartialEq)]
pub struct Budgets {
    pub prices_version: Option<String>,
    pub price: Price,
    tenants: BTreeMap<String, Rule>,
    features: BTreeMap<String, Rule>,
}

/// Every other tenant's budget.
pub const ANY_TENANT: &str = "*";

impl Budgets {
    /// Parses and checks a budgets file; `profile` prices GPU-seconds.
    ///
    /// # Errors
    /// Not TOML of this shape, a limit that is not a positive number, a
    /// name that is not valid, a price without its contract's version.
    pub fn from_toml(text: &str, path: &str, profile: &Profile) -> Result<Budgets, String> {
        let f: BudgetsConfig = toml::from_str(text).map_err(|e| format!("{path}: {e}"))?;
        if let Some(p) = &f.price {
            p.check(&format!("{path}: price"))?;
        }
        let price = Price::new(f.price.as_ref(), profile).map_err(|e| format!("{path}: {e}"))?;
        if f.price.is_some()
            && f.prices_version
                .as_deref()
                .is_none_or(|v| v.trim().is_empty())
        {
            return Err(format!(
                "{path}: prices_version: required with a price (the price contract's version)"
            ));
        }
        let rules = |scope: Scope, specs: &BTreeMap<String, LimitConfig>| {
            let mut out = BTreeMap::new();
            for (name, spec) in specs {
                let at = format!("{path}: {}s.{name}", scope.label());
                let any = scope == Scope::Tenant && name == ANY_TENANT;
                let valid = match scope {
                    Scope::Tenant => valid_tenant_name(name),
                    Scope::Feature => valid_name(name),
                };
                if !any && !valid {
                    return Err(format!("{at}: not a valid name (A-Z a-z 0-9 . _ - : @)"));
                }
                let mut limits = Vec::new();
                for k in Kind::ALL {
                    if let Some(v) = spec.limit(k) {
                        let least = if k == Kind::Cost {
                            f64::MIN_POSITIVE
                        } else {
                            1.0
                        };
                        if !(v.is_finite() && v >= least) {
                            let want = if k == Kind::Cost { "> 0" } else { ">= 1" };
                            return Err(format!("{at}.{}: must be a number {want}", k.field()));
                        }
                        limits.push((k, v));
                    }
                }
                if limits.is_empty() {
                    return Err(format!(
                        "{at}: sets no limit (requests_per_minute, input_tokens_per_minute, output_tokens_per_minute or cost_per_day)"
                    ));
                }
                if limits.iter().any(|(k, _)| *k == Kind::Cost) && price == Price::Free {
                    return Err(format!("{at}.cost_per_day: needs a [price]"));
                }
                out.insert(
                    name.clone(),
                    Rule {
                        scope,
                        name: name.clone(),
                        limits,
                        on_store_error: spec.on_store_error.unwrap_or(f.on_store_error),
                        mode: spec.mode.unwrap_or(f.mode),
                    },
                );
            }
            Ok(out)
        };
        let tenants = rules(Scope::Tenant, &f.tenants)?;
        let features = rules(Scope::Feature, &f.features)?;
        Ok(Budgets {
            prices_version: f.prices_version,
            price,
            tenants,
            features,
        })
    }

    /// The least output tokens per minute an enforced budget of `tenant`
    /// and `feature` holds.
    pub fn output_capacity(&self, tenant: &str, feature: Option<&str>) -> Option<f64> {
        self.rules_for(tenant, feature)
            .into_iter()
            .filter(|(r, _)| r.mode == Mode::Enforce)
            .flat_map(|(r, _)| r.limits.iter().copied())
            .filter(|(k, _)| *k == Kind::OutputTokens)
            .map(|(_, v)| v)
            .reduce(f64::min)
    }

    /// The most output tokens each of `seqs` sequences may be given when
    /// the governor chooses a request's max_tokens: the tightest enforced
    /// output budget shared among them (`None`: no output budget, or less
    /// than one token each).
    pub fn output_per_seq(&self, tenant: &str, feature: Option<&str>, seqs: u64) -> Option<u64> {
        let cap = self.output_capacity(tenant, feature)?;
        let per_seq = (cap / seqs.max(1) as f64).floor() as u64;
        (per_seq >= 1).then_some(per_seq)
    }

    /// The budgets a request of `tenant` with `feature` is charged to, each
    /// with the store key of its buckets' owner.
    pub fn rules_for<'a>(&'a self, tenant: &str, feature: Option<&str>) -> Vec<(&'a Rule, String)> {
        let mut out = Vec::new();
        if let Some(r) = self
            .tenants
            .get(tenant)
            .or_else(|| self.tenants.get(ANY_TENANT))
        {
            out.push((r, format!("t/{tenant}")));
        }
        if let Some(f) = feature {
            if let Some(r) = self.features.get(f) {
                out.push((r, format!("f/{f}")));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> Profile {
        Profile::from_json(
            &serde_json::json!({
                "schema": "envelope.profile/v2", "created_unix_ms": 1,
                "fingerprint": {"schema": 1, "model": {"kind": "dummy", "preset": "tiny", "seed": 0},
                                "node": {"gpus": []}},
                "slo": {"ttft_p95_ms": null, "itl_p95_ms": null, "e2e_p99_ms": null},
                "configs": [], "selected": "x",
                "limits": {"max_context_tokens": 100, "max_output_tokens": 10,
                           "max_concurrent_seqs": 1, "max_kv_tokens_in_flight": 100, "buckets": []},
                "probes_total": 0
            })
            .to_string(),
            "p.json",
        )
        .unwrap()
    }

    const GOOD: &str = r#"
prices_version = "list-1"
on_store_error = "closed"
[price]
input_per_mtok = 1.0
output_per_mtok = 2.0
[tenants.acme]
requests_per_minute = 60
cost_per_day = 5.0
on_store_error = "open"
[tenants."*"]
output_tokens_per_minute = 100
[features.search]
input_tokens_per_minute = 1000
mode = "shadow"
"#;

    #[test]
    fn a_good_file_names_whom_each_request_is_charged_to() {
        let b = Budgets::from_toml(GOOD, "b.toml", &profile()).unwrap();
        let acme = b.rules_for("acme", Some("search"));
        assert_eq!(acme.len(), 2);
        assert_eq!(acme[0].1, "t/acme");
        assert_eq!(acme[0].0.on_store_error, OnStoreError::Open);
        assert_eq!(
            acme[0].0.limits,
            vec![(Kind::Requests, 60.0), (Kind::Cost, 5.0)]
        );
        assert_eq!(acme[1].1, "f/search");
        assert_eq!(acme[1].0.mode, Mode::Shadow);
        // Every other tenant gets its own buckets under the `*` rule.
        let other = b.rules_for("bob", Some("unknown"));
        assert_eq!(other.len(), 1);
        assert_eq!(other[0].1, "t/bob");
        assert_eq!(other[0].0.on_store_error, OnStoreError::Closed);
        assert_eq!(
            other[0].0.label(Kind::OutputTokens),
            "tenant:*:output_tokens_per_minute"
        );
    }

    #[test]
    fn bad_files_say_which_field_is_wrong() {
        for (text, want) in [
            (
                GOOD.replace("prices_version = \"list-1\"", ""),
                "prices_version",
            ),
            (
                GOOD.replace("requests_per_minute = 60", "requests_per_minute = 0"),
                "tenants.acme.requests_per_minute",
            ),
            (
                GOOD.replace("[features.search]", "[features.\"se arch\"]"),
                "features.se arch",
            ),
            (
                GOOD.replace("mode = \"shadow\"", "mode = \"loud\""),
                "unknown variant",
            ),
            (
                format!("{GOOD}\n[tenants.empty]\n"),
                "tenants.empty: sets no limit",
            ),
            (
                "[tenants.a]\ncost_per_day = 1.0\n".to_string(),
                "cost_per_day: needs a [price]",
            ),
            (format!("{GOOD}\nsurprise = 1\n"), "unknown field"),
            (
                GOOD.replace("requests_per_minute = 60", "requests_per_minute = 0.5"),
                "requests_per_minute: must be a number >= 1",
            ),
            (
                GOOD.replace("output_per_mtok = 2.0", "output_per_mtok = nan"),
                "price.output_per_mtok",
            ),
            (
                GOOD.replace("input_per_mtok = 1.0\noutput_per_mtok = 2.0", ""),
                "price: sets no price",
            ),
            (
                GOOD.replace(
                    "output_per_mtok = 2.0",
                    "output_per_mtok = 2.0\ngpu_second = 1.0",
                ),
                "price: per-token prices and gpu_second are two contracts",
            ),
        ] {
            let e = Budgets::from_toml(&text, "b.toml", &profile()).unwrap_err();
            assert!(e.contains(want) && e.contains("b.toml"), "{want}: {e}");
        }
    }
}
