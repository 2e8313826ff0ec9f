//! The tiers file (`envelope govern --tiers tiers.toml`): tiers by role,
//! cheapest first, each mapped to upstreams with their own profiles; the
//! routing rules; escalation, fallback, cache, prices, feature budgets and
//! shadow calibration. It is versioned (`version`), reloadable, and an
//! invalid one is refused with the file and the field named (the last good
//! one stays). A model swap changes only a tier's upstreams.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The whole file, as written; [`TiersSettings::from_toml`] checks it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TiersConfig {
    /// The operator's label for this version of the routing (shown in
    /// responses' `x-envelope-tiers-version`, `/metrics` and `/admin/tiers`).
    pub version: String,
    /// Tier names, cheapest first: a call below every rule's threshold
    /// starts on the first; escalation climbs this list.
    pub order: Vec<String>,
    pub tiers: BTreeMap<String, TierConfig>,
    #[serde(default)]
    pub rules: Vec<RuleConfig>,
    #[serde(default)]
    pub escalation: EscalationConfig,
    /// Per tier, the tiers (in order) a call may be placed on instead when
    /// this one has no room for it now: up or down, as the operator says.
    #[serde(default)]
    pub fallback: BTreeMap<String, Vec<String>>,
    #[serde(default)]
    pub cache: CacheConfig,
    /// The price contract's version (required when any tier has a price).
    #[serde(default)]
    pub prices_version: Option<String>,
    /// Allowed cost per call, per feature (`x-envelope-feature`).
    #[serde(default)]
    pub features: BTreeMap<String, FeatureConfig>,
    #[serde(default)]
    pub shadow: ShadowConfig,
    /// Replaced by `envelope govern --record FILE`; kept only to say so.
    #[serde(default)]
    pub calls_log: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierConfig {
    pub upstreams: Vec<UpstreamConfig>,
    /// The most a call on this tier may take, ms: its deadline when the
    /// client's is longer (or absent).
    #[serde(default)]
    pub latency_budget_ms: Option<u64>,
    #[serde(default)]
    pub price: Option<PriceConfig>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    /// The OpenAI-compatible server.
    pub url: String,
    /// Its measured profile (relative to the tiers file).
    pub profile: PathBuf,
    /// The `model` field sent to it (the client's is kept when absent).
    #[serde(default)]
    pub model: Option<String>,
    /// Its tokenizer (a .gguf or tokenizer.json); else its `/tokenize` or
    /// the estimate.
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
}

pub use envelope_governor::price::PriceConfig;

/// A rule: when every condition it sets holds, the call starts on `tier`
/// (the most capable tier any matching rule names wins).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleConfig {
    pub name: String,
    pub tier: String,
    /// The call stays on this tier: no escalation, no fallback (tool-calling
    /// steps that must see one model).
    #[serde(default)]
    pub pin: bool,
    #[serde(default)]
    pub prompt_tokens_over: Option<u64>,
    #[serde(default)]
    pub max_tokens_over: Option<u64>,
    #[serde(default)]
    pub messages_over: Option<u64>,
    #[serde(default)]
    pub documents_over: Option<u64>,
    #[serde(default)]
    pub tools: Option<bool>,
    /// `response_format` asks for JSON (an object or a schema).
    #[serde(default)]
    pub json: Option<bool>,
    /// The `x-envelope-tier-hint` header's value.
    #[serde(default)]
    pub hint: Option<String>,
    /// The `x-envelope-feature` header is one of these.
    #[serde(default)]
    pub features: Option<Vec<String>>,
    /// The conversation (`x-envelope-conversation`) escalated before.
    #[serde(default)]
    pub escalated_before: Option<bool>,
}

/// What makes an answer fail, so the call is retried once a tier up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Check {
    /// Not JSON though `response_format` asks for it.
    InvalidJson,
    /// `tool_choice` requires a tool call and there is none, or a tool
    /// call names no given tool or has arguments that are not JSON.
    ToolCall,
    /// `finish_reason` is `length` and the caller forbids truncation
    /// (`x-envelope-no-truncation: true`).
    Truncated,
    /// The upstream failed: unreachable, timed out, or a 5xx.
    UpstreamError,
}

impl Check {
    pub fn label(self) -> &'static str {
        match self {
            Check::InvalidJson => "invalid_json",
            Check::ToolCall => "tool_call",
            Check::Truncated => "truncated",
            Check::UpstreamError => "upstream_error",
        }
    }
}

/// When the escalated attempt cannot be made in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutOfTime {
    /// Return the lower tier's answer (marked `x-envelope-escalation: failed`).
    #[default]
    LowerAnswer,
    /// Return the error that stopped the escalation.
    Error,
}

/// Streams need the whole answer to be checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamMode {
    /// Stream through as it comes: a stream is never escalated.
    #[default]
    Pass,
    /// Hold the whole stream, check it, then send it (or the escalated one).
    Buffer,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EscalationConfig {
    #[serde(default = "all_checks")]
    pub on: Vec<Check>,
    #[serde(default)]
    pub out_of_time: OutOfTime,
    #[serde(default)]
    pub streams: StreamMode,
}

fn all_checks() -> Vec<Check> {
    vec![
        Check::InvalidJson,
        Check::ToolCall,
        Check::Truncated,
        Check::UpstreamError,
    ]
}

impl Default for EscalationConfig {
    fn default() -> Self {
        EscalationConfig {
            on: all_checks(),
            out_of_time: OutOfTime::default(),
            streams: StreamMode::default(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheConfig {
    #[serde(default)]
    pub enabled: bool,
    /// Bound on the bytes held (requests and answers).
    #[serde(default = "default_cache_bytes")]
    pub max_bytes: u64,
    #[serde(default = "default_cache_ttl")]
    pub ttl_s: u64,
}

fn default_cache_bytes() -> u64 {
    64 << 20
}
fn default_cache_ttl() -> u64 {
    300
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            enabled: false,
            max_bytes: default_cache_bytes(),
            ttl_s: default_cache_ttl(),
        }
    }
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FeatureConfig {
    pub max_cost_per_call: f64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShadowConfig {
    /// The share of calls answered by a tier below the top that are also
    /// sent, off the request path, to the next tier up (0..1).
    #[serde(default)]
    pub sample: f64,
    /// Shadow calls in flight at most; more are skipped.
    #[serde(default = "default_shadow_in_flight")]
    pub max_in_flight: usize,
}

fn default_shadow_in_flight() -> usize {
    4
}

impl Default for ShadowConfig {
    fn default() -> Self {
        ShadowConfig {
            sample: 0.0,
            max_in_flight: default_shadow_in_flight(),
        }
    }
}

pub use envelope_governor::identity::{valid_name, MAX_FEATURE_NAME};

/// The tiers the router runs on: a tiers file that passed every check,
/// its relative paths made relative to its folder. Read through `Deref`.
#[derive(Debug, Clone)]
pub struct TiersSettings(TiersConfig);

impl std::ops::Deref for TiersSettings {
    type Target = TiersConfig;
    fn deref(&self) -> &TiersConfig {
        &self.0
    }
}

impl TiersSettings {
    /// Parses and checks `text`, read from `path`; relative paths in it
    /// are made relative to the file's folder.
    ///
    /// # Errors
    /// `path: field: what is wrong`, for the first thing wrong.
    pub fn from_toml(text: &str, path: &Path) -> Result<TiersSettings, String> {
        let shown = path.display();
        let mut f: TiersConfig = toml::from_str(text).map_err(|e| format!("{shown}: {e}"))?;
        f.check().map_err(|e| format!("{shown}: {e}"))?;
        let base = path.parent().unwrap_or(Path::new("."));
        for t in f.tiers.values_mut() {
            for u in &mut t.upstreams {
                u.profile = base.join(&u.profile);
                if let Some(tk) = &u.tokenizer {
                    u.tokenizer = Some(base.join(tk));
                }
            }
        }
        if f.calls_log.is_some() {
            return Err(format!(
                "{shown}: calls_log is replaced by `envelope govern --record FILE`: one line per call in the trace format, the routing under `tiers` (docs/govern.md#recording-traffic)"
            ));
        }
        Ok(TiersSettings(f))
    }
}

impl TiersConfig {
    /// The index of tier `name` in `order`.
    pub fn index(&self, name: &str) -> Option<usize> {
        self.order.iter().position(|t| t == name)
    }

    fn known(&self, field: String, name: &str) -> Result<usize, String> {
        self.index(name).ok_or_else(|| {
            format!(
                "{field}: no tier named `{name}` in `order` ({})",
                self.order.join(", ")
            )
        })
    }

    /// Everything that would make routing wrong, named by field.
    fn check(&self) -> Result<(), String> {
        if self.version.trim().is_empty() {
            return Err("version: must not be empty".into());
        }
        if self.order.is_empty() {
            return Err("order: name at least one tier, cheapest first".into());
        }
        for (i, name) in self.order.iter().enumerate() {
            if !valid_name(name) {
                return Err(format!("order[{i}]: `{name}` is not a valid tier name"));
            }
            if self.order[..i].contains(name) {
                return Err(format!("order[{i}]: `{name}` is listed twice"));
            }
            if !self.tiers.contains_key(name) {
                return Err(format!("order[{i}]: no [tiers.{name}] table"));
            }
        }
        let mut priced = false;
        for (name, t) in &self.tiers {
            if self.index(name).is_none() {
                return Err(format!("tiers.{name}: not listed in `order`"));
            }
            if t.upstreams.is_empty() {
                return Err(format!("tiers.{name}.upstreams: give at least one"));
            }
            for (i, u) in t.upstreams.iter().enumerate() {
                let f = format!("tiers.{name}.upstreams[{i}]");
                let url = u.url.trim_end_matches('/');
                if !(url.starts_with("http://") || url.starts_with("https://")) || url.len() < 9 {
                    return Err(format!("{f}.url: `{}` is not an http(s) URL", u.url));
                }
                if u.model.as_deref().is_some_and(str::is_empty) {
                    return Err(format!("{f}.model: must not be empty"));
                }
            }
            if t.latency_budget_ms == Some(0) {
                return Err(format!("tiers.{name}.latency_budget_ms: must be positive"));
            }
            if let Some(p) = &t.price {
                priced = true;
                p.check(&format!("tiers.{name}.price"))?;
            }
        }
        if priced
            && self
                .prices_version
                .as_deref()
                .is_none_or(|v| v.trim().is_empty())
        {
            return Err(
                "prices_version: required when a tier has a price (the contract's version)".into(),
            );
        }
        for (i, r) in self.rules.iter().enumerate() {
            let f = format!("rules[{i}]");
            if !valid_name(&r.name) {
                return Err(format!("{f}.name: `{}` is not a valid rule name", r.name));
            }
            self.known(format!("{f}.tier"), &r.tier)?;
            let conditions = [
                r.prompt_tokens_over.is_some(),
                r.max_tokens_over.is_some(),
                r.messages_over.is_some(),
                r.documents_over.is_some(),
                r.tools.is_some(),
                r.json.is_some(),
                r.hint.is_some(),
                r.features.is_some(),
                r.escalated_before.is_some(),
            ];
            if !conditions.contains(&true) {
                return Err(format!(
                    "{f}: sets no condition, so it would match every call (the first tier in `order` is the default)"
                ));
            }
            if let Some(fs) = &r.features {
                if let Some(bad) = fs.iter().find(|n| !valid_name(n)) {
                    return Err(format!("{f}.features: `{bad}` is not a valid feature name"));
                }
            }
        }
        for (from, to) in &self.fallback {
            let a = self.known(format!("fallback.{from}"), from)?;
            for (i, t) in to.iter().enumerate() {
                let b = self.known(format!("fallback.{from}[{i}]"), t)?;
                if a == b {
                    return Err(format!(
                        "fallback.{from}[{i}]: a tier cannot fall back to itself"
                    ));
                }
            }
        }
        if self.cache.enabled && (self.cache.max_bytes == 0 || self.cache.ttl_s == 0) {
            return Err("cache: max_bytes and ttl_s must be positive when enabled".into());
        }
        for (name, fs) in &self.features {
            if !valid_name(name) {
                return Err(format!("features.{name}: not a valid feature name"));
            }
            if !fs.max_cost_per_call.is_finite() || fs.max_cost_per_call < 0.0 {
                return Err(format!(
                    "features.{name}.max_cost_per_call: must be a finite number >= 0"
                ));
            }
        }
        if !(0.0..=1.0).contains(&self.shadow.sample) {
            return Err(format!(
                "shadow.sample: {} is not a share between 0 and 1",
                self.shadow.sample
            ));
        }
        if self.shadow.sample > 0.0 && self.order.len() < 2 {
            return Err("shadow.sample: shadow calls go a tier up, and there is one tier".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
version = "v1"
order = ["small", "large"]
prices_version = "list-1"

[tiers.small]
upstreams = [{ url = "http://127.0.0.1:1", profile = "s.json" }]
price = { input_per_mtok = 0.1, output_per_mtok = 0.4 }

[tiers.large]
upstreams = [{ url = "http://127.0.0.1:2", profile = "l.json", model = "big" }]
price = { gpu_second = 0.002 }

[[rules]]
name = "long"
tier = "large"
prompt_tokens_over = 1000

[fallback]
small = ["large"]
"#;

    fn parse(text: &str) -> Result<TiersSettings, String> {
        TiersSettings::from_toml(text, Path::new("/etc/envelope/tiers.toml"))
    }

    #[test]
    fn a_good_file_parses_with_paths_beside_it() {
        let f = parse(GOOD).unwrap();
        assert_eq!(f.order, ["small", "large"]);
        assert_eq!(
            f.tiers["small"].upstreams[0].profile,
            Path::new("/etc/envelope/s.json")
        );
        assert_eq!(f.index("large"), Some(1));
        assert_eq!(f.escalation.on.len(), 4);
    }

    #[test]
    fn the_example_in_the_docs_is_valid() {
        let doc = include_str!("../../../docs/tiers.md");
        let start = doc.find("```toml\n").expect("a toml block") + 8;
        let len = doc[start..].find("```").unwrap();
        let f = parse(&doc[start..start + len]).unwrap();
        assert_eq!(f.order, ["small", "large"]);
        assert_eq!(f.rules.len(), 3);
        assert!(f.cache.enabled && f.shadow.sample > 0.0);
    }

    #[test]
    fn each_mistake_names_the_file_and_the_field() {
        let cases = [
            (
                GOOD.replace("tier = \"large\"", "tier = \"huge\""),
                "rules[0].tier: no tier named `huge`",
            ),
            (
                GOOD.replace("small = [\"large\"]", "small = [\"small\"]"),
                "fallback.small[0]",
            ),
            (
                GOOD.replace("prompt_tokens_over = 1000", ""),
                "rules[0]: sets no condition",
            ),
            (
                GOOD.replace("prices_version = \"list-1\"", ""),
                "prices_version: required",
            ),
            (
                GOOD.replace(
                    "{ gpu_second = 0.002 }",
                    "{ gpu_second = 0.002, input_per_mtok = 1.0 }",
                ),
                "tiers.large.price: per-token prices and gpu_second",
            ),
            (
                GOOD.replace("order = [\"small\", \"large\"]", "order = [\"small\"]"),
                "tiers.large: not listed in `order`",
            ),
            (
                GOOD.replace("http://127.0.0.1:2", "127.0.0.1:2"),
                "tiers.large.upstreams[0].url",
            ),
            (
                GOOD.replace("version = \"v1\"", "version = \"v1\"\nsurprise = 1"),
                "unknown field `surprise`",
            ),
            (format!("{GOOD}\n[shadow]\nsample = 1.5\n"), "shadow.sample"),
            (
                format!("{GOOD}\n[features.summary]\nmax_cost_per_call = -1\n"),
                "features.summary.max_cost_per_call",
            ),
        ];
        for (text, want) in cases {
            let e = parse(&text).unwrap_err();
            assert!(e.starts_with("/etc/envelope/tiers.toml: "), "{e}");
            assert!(e.contains(want), "wanted `{want}` in: {e}");
        }
    }
}
