//! The governor's configuration in one place: every flag is also a
//! `--config` TOML field and an environment variable; a flag wins over the
//! file, the file over the default; [`GovernArgs::settings`] turns a
//! profile and the overrides into [`Settings`].

use crate::error::StartError;
use crate::settings::{self, SettingsDraft};
use crate::{live_guard, Beyond, OverBudget, OverLimit, Settings, TenantsSettings};
use clap::Args;
use envelope_profile::{Limits, Profile};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A file a setting names, or an error naming the setting and the file.
pub fn read(what: &'static str, path: &Path) -> Result<String, StartError> {
    std::fs::read_to_string(path).map_err(|cause| StartError::Read {
        what,
        path: path.to_path_buf(),
        cause,
    })
}

/// A profile as govern reads it, once per start or reload: parsed, its
/// limits checked enforceable, and the name it is shown by in messages.
pub struct ProfileFile {
    pub profile: Profile,
    /// Its enforceable limits (checked at reading).
    pub limits: Limits,
    pub shown: String,
    /// The file's text (what a reload compares).
    pub text: String,
}

impl ProfileFile {
    /// Reads and checks the profile at `path` (`what` names the flag or
    /// field in errors).
    ///
    /// # Errors
    /// It cannot be read, is not a profile, or holds no enforceable limits.
    pub fn read(what: &'static str, path: &Path) -> Result<ProfileFile, StartError> {
        let shown = path.display().to_string();
        let text = read(what, path)?;
        let profile = Profile::from_json(&text, &shown)?;
        let limits = profile
            .enforceable_limits()
            .map_err(|e| StartError::Invalid(format!("{shown}: {e}")))?
            .clone();
        Ok(ProfileFile {
            profile,
            limits,
            shown,
            text,
        })
    }
}

/// How prompt tokens are counted without `--tokenizer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum TokenCount {
    /// The upstream's `/tokenize` if it answers at start, else the estimate.
    Auto,
    /// Always the upstream's `/tokenize`.
    Upstream,
    /// The local estimate (an upper bound).
    Estimate,
}

/// What to do when the profile's fingerprint does not match the node or
/// the upstream's model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum OnMismatch {
    /// Do not start.
    Refuse,
    /// Start with half the profile's concurrency and KV budget.
    Conservative,
    /// Start with the profile as it is.
    Ignore,
}

/// One struct for flags and the TOML config (mistral.rs does the same);
/// a flag wins over the file, the file over the default.
#[derive(Args, Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct GovernArgs {
    /// A TOML file with any of these fields (snake_case names).
    #[arg(long, env = "ENVELOPE_GOVERN_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// The profile to enforce (written by `envelope sweep`).
    #[arg(long, env = "ENVELOPE_GOVERN_PROFILE")]
    pub profile: Option<PathBuf>,
    /// Model tiers: a TOML file of tiers, each with its upstreams and their profiles, and the rules that route calls between them (instead of --profile and --upstream; see docs/tiers.md).
    #[arg(long, env = "ENVELOPE_GOVERN_TIERS", conflicts_with_all = ["profile", "upstream"])]
    pub tiers: Option<PathBuf>,
    /// The OpenAI-compatible server to protect.
    #[arg(long, env = "ENVELOPE_GOVERN_UPSTREAM")]
    pub upstream: Option<String>,
    /// Address to listen on (port 0 picks one; the URL is printed on stdout).
    #[arg(long, env = "ENVELOPE_GOVERN_LISTEN")]
    pub listen: Option<String>,
    /// Override the profile's limits.max_context_tokens (prompt + max_tokens).
    #[arg(long, env = "ENVELOPE_GOVERN_MAX_CONTEXT_TOKENS")]
    pub max_context_tokens: Option<u64>,
    /// Override the profile's limits.max_output_tokens.
    #[arg(long, env = "ENVELOPE_GOVERN_MAX_OUTPUT_TOKENS")]
    pub max_output_tokens: Option<u64>,
    /// Override the profile's limits.max_concurrent_seqs (n > 1 counts n).
    #[arg(long, env = "ENVELOPE_GOVERN_MAX_CONCURRENT_SEQS")]
    pub max_concurrent_seqs: Option<u64>,
    /// Override the profile's limits.max_kv_tokens_in_flight (sum of prompt + max_tokens reserved).
    #[arg(long, env = "ENVELOPE_GOVERN_MAX_KV_TOKENS_IN_FLIGHT")]
    pub max_kv_tokens_in_flight: Option<u64>,
    /// max_tokens over the output cap: clamp (default) or reject.
    #[arg(long, env = "ENVELOPE_GOVERN_OVER_LIMIT")]
    pub over_limit: Option<OverLimit>,
    /// Most requests waiting (default 256).
    #[arg(long, env = "ENVELOPE_GOVERN_MAX_QUEUE_LEN")]
    pub max_queue_len: Option<usize>,
    /// Most KV tokens waiting (default 4 x the KV budget).
    #[arg(long, env = "ENVELOPE_GOVERN_MAX_QUEUE_TOKENS")]
    pub max_queue_tokens: Option<u64>,
    /// Longest wait in the queue, ms (default 30000).
    #[arg(long, env = "ENVELOPE_GOVERN_MAX_QUEUE_AGE_MS")]
    pub max_queue_age_ms: Option<u64>,
    /// Deadline of interactive requests without X-Request-Deadline-Ms, ms (default 30000).
    #[arg(long, env = "ENVELOPE_GOVERN_INTERACTIVE_DEADLINE_MS")]
    pub interactive_deadline_ms: Option<u64>,
    /// Deadline of batch requests (x-envelope-class: batch), ms (default 300000).
    #[arg(long, env = "ENVELOPE_GOVERN_BATCH_DEADLINE_MS")]
    pub batch_deadline_ms: Option<u64>,
    /// Largest request body, bytes (default 8 MiB).
    #[arg(long, env = "ENVELOPE_GOVERN_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Time to the upstream's response headers, ms (default 600000; bounds a whole non-streaming generation).
    #[arg(long, env = "ENVELOPE_GOVERN_UPSTREAM_TIMEOUT_MS")]
    pub upstream_timeout_ms: Option<u64>,
    /// Longest silence inside an upstream response, ms (default 60000).
    #[arg(long, env = "ENVELOPE_GOVERN_UPSTREAM_IDLE_TIMEOUT_MS")]
    pub upstream_idle_timeout_ms: Option<u64>,
    /// The served model's .gguf file or tokenizer.json: exact counts without a round trip to the upstream.
    #[arg(long, env = "ENVELOPE_GOVERN_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// Token counting without --tokenizer: auto (upstream /tokenize if it answers, else estimate), upstream, estimate.
    #[arg(long, env = "ENVELOPE_GOVERN_TOKEN_COUNT")]
    pub token_count: Option<TokenCount>,
    /// Bytes per token of the estimate (default 1: an upper bound for byte-level tokenizers; above 1, crafted text can be under-counted).
    #[arg(long, env = "ENVELOPE_GOVERN_ESTIMATE_BYTES_PER_TOKEN")]
    pub estimate_bytes_per_token: Option<f64>,
    /// Tenants file (TOML: shares, weights, API keys; see docs/govern.md).
    #[arg(long, env = "ENVELOPE_GOVERN_TENANTS")]
    pub tenants: Option<PathBuf>,
    /// Live guard polling the upstream's /metrics (default true).
    #[arg(long, env = "ENVELOPE_GOVERN_GUARD")]
    pub guard: Option<bool>,
    /// Live guard interval, ms (default 1000).
    #[arg(long, env = "ENVELOPE_GOVERN_GUARD_INTERVAL_MS")]
    pub guard_interval_ms: Option<u64>,
    /// Metrics URL for the live guard (default: upstream + /metrics).
    #[arg(long, env = "ENVELOPE_GOVERN_GUARD_METRICS_URL")]
    pub guard_metrics_url: Option<String>,
    /// Upstream KV use (0..1) at which caps tighten (default 0.90).
    #[arg(long, env = "ENVELOPE_GOVERN_GUARD_SMALL_KV")]
    pub guard_small_kv: Option<f64>,
    /// Upstream KV use (0..1) at which new requests are refused (default 0.98).
    #[arg(long, env = "ENVELOPE_GOVERN_GUARD_REJECT_KV")]
    pub guard_reject_kv: Option<f64>,
    /// GPU free memory floor for REJECT_NEW, bytes (NVML only).
    #[arg(long, env = "ENVELOPE_GOVERN_GUARD_MIN_GPU_FREE_BYTES")]
    pub guard_min_gpu_free_bytes: Option<u64>,
    /// Profile fingerprint differs from the node: refuse, conservative (half the capacity, default), ignore.
    #[arg(long, env = "ENVELOPE_GOVERN_ON_MISMATCH")]
    pub on_mismatch: Option<OnMismatch>,
    /// A request past the profile's largest measured bucket: refuse (400 naming the bucket, default) or alone (admitted by itself, charged the whole node).
    #[arg(long, env = "ENVELOPE_GOVERN_BEYOND_ENVELOPE")]
    pub beyond_envelope: Option<Beyond>,
    /// TTFT budget of interactive requests (queue wait + the bucket's measured TTFT), ms (default: the profile's TTFT SLO).
    #[arg(long, env = "ENVELOPE_GOVERN_INTERACTIVE_TTFT_BUDGET_MS")]
    pub interactive_ttft_budget_ms: Option<f64>,
    /// TTFT budget of batch requests, ms (default: none, only the deadline).
    #[arg(long, env = "ENVELOPE_GOVERN_BATCH_TTFT_BUDGET_MS")]
    pub batch_ttft_budget_ms: Option<f64>,
    /// Over the TTFT budget: shed (429 with Retry-After, default) or queue (until the deadline).
    #[arg(long, env = "ENVELOPE_GOVERN_OVER_BUDGET")]
    pub over_budget: Option<OverBudget>,
    /// Latency guard: lower the admitted share of the envelope while proxied TTFT/ITL p95 break the profile's SLOs (default true).
    #[arg(long, env = "ENVELOPE_GOVERN_LATENCY_GUARD")]
    pub latency_guard: Option<bool>,
    /// Time in-flight requests get to finish after SIGTERM, ms (default 30000).
    #[arg(long, env = "ENVELOPE_GOVERN_DRAIN_TIMEOUT_MS")]
    pub drain_timeout_ms: Option<u64>,
    /// Token for /admin/* from other hosts (loopback needs none).
    #[arg(long, env = "ENVELOPE_GOVERN_ADMIN_TOKEN")]
    pub admin_token: Option<String>,
    /// A client's request headers must arrive within this, ms (default 10000).
    #[arg(long, env = "ENVELOPE_GOVERN_HEADER_READ_TIMEOUT_MS")]
    pub header_read_timeout_ms: Option<u64>,
    /// Most client connections open at once; more wait to be accepted (default 4096).
    #[arg(long, env = "ENVELOPE_GOVERN_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// TCP connect to the upstream, ms (default 5000).
    #[arg(long, env = "ENVELOPE_GOVERN_CONNECT_TIMEOUT_MS")]
    pub connect_timeout_ms: Option<u64>,
    /// A request's whole lifetime, queue and answer, ms; a stream still running then ends with an SSE error event (default 900000).
    #[arg(long, env = "ENVELOPE_GOVERN_MAX_REQUEST_MS")]
    pub max_request_ms: Option<u64>,
    /// GET paths forwarded to the upstream, comma-separated; `prefix*` matches a prefix (default /v1/models,/v1/models/*,/health,/healthz,/ready,/version).
    #[arg(long, env = "ENVELOPE_GOVERN_PASSTHROUGH_PATHS", value_delimiter = ',')]
    pub passthrough_paths: Option<Vec<String>>,
    /// Paths answered without an API key when keys are configured, comma-separated; `prefix*` matches a prefix; every other route needs a known key (default /health,/healthz,/ready,/metrics).
    #[arg(long, env = "ENVELOPE_GOVERN_PUBLIC_PATHS", value_delimiter = ',')]
    pub public_paths: Option<Vec<String>>,
    /// Counting one request's prompt tokens, ms; past it the bound estimate counts (default 2000).
    #[arg(long, env = "ENVELOPE_GOVERN_COUNT_TIMEOUT_MS")]
    pub count_timeout_ms: Option<u64>,
    /// Requests being counted at once; more wait within the count timeout (default 64).
    #[arg(long, env = "ENVELOPE_GOVERN_MAX_COUNTING")]
    pub max_counting: Option<usize>,
    /// Prompt tokens charged per image part of a chat message (default 2048).
    #[arg(long, env = "ENVELOPE_GOVERN_IMAGE_PART_TOKENS")]
    pub image_part_tokens: Option<u64>,
    /// Prompt tokens charged per audio part of a chat message (default 2048).
    #[arg(long, env = "ENVELOPE_GOVERN_AUDIO_PART_TOKENS")]
    pub audio_part_tokens: Option<u64>,
    /// Budgets over time (TOML: requests, input and output tokens per minute, cost per day, per tenant and feature; see docs/budgets.md).
    #[arg(long, env = "ENVELOPE_GOVERN_BUDGETS", conflicts_with = "tiers")]
    pub budgets: Option<PathBuf>,
    /// Where budget buckets live: redis://host:port shares them between governor replicas (default: in this process).
    #[arg(long, env = "ENVELOPE_GOVERN_BUDGET_STORE")]
    pub budget_store: Option<String>,
    /// One budget decision with --budget-store, ms; past it the budget's on_store_error applies (default 50).
    #[arg(long, env = "ENVELOPE_GOVERN_BUDGET_STORE_TIMEOUT_MS")]
    pub budget_store_timeout_ms: Option<u64>,
    /// Threads serving connections: 1 (default) runs one event loop, as one nginx worker does (counting with a tokenizer runs on threads of its own either way); more share the connections between that many threads.
    #[arg(long, env = "ENVELOPE_GOVERN_WORKER_THREADS")]
    pub worker_threads: Option<usize>,
    /// Append one line per finished request to this file, in the trace format (docs/govern.md#recording-traffic; no prompt text), for `envelope sweep`'s [load.trace] and `envelope plan --workload-from`. Written off the request path: when the writer falls behind, records are dropped and counted, never waited for. Prefix ids are salted with ENVELOPE_RECORD_SALT.
    #[arg(long, env = "ENVELOPE_GOVERN_RECORD")]
    pub record: Option<PathBuf>,
    /// --record: rotate the file past this many MiB (default 256), to FILE.1, FILE.2 ...
    #[arg(long, env = "ENVELOPE_GOVERN_RECORD_MAX_MIB")]
    pub record_max_mib: Option<u64>,
    /// --record: rotated files kept (default 4).
    #[arg(long, env = "ENVELOPE_GOVERN_RECORD_KEEP")]
    pub record_keep: Option<u32>,
    /// --record: finished requests that may wait for the writer (default 65536); past it they are dropped and counted.
    #[arg(long, env = "ENVELOPE_GOVERN_RECORD_QUEUE")]
    pub record_queue: Option<usize>,
    /// Serve the upstream's own /metrics on the governor's /metrics, after the governor's series, in the classic text format (default false): for an endpoint picker that scrapes the pod's port. Fetched from --guard-metrics-url (default: upstream + /metrics) every --engine-metrics-interval-ms.
    #[arg(long, env = "ENVELOPE_GOVERN_ENGINE_METRICS")]
    pub engine_metrics: Option<bool>,
    /// --engine-metrics: how often the upstream's /metrics is fetched, ms (default 50, an endpoint picker's scrape interval).
    #[arg(long, env = "ENVELOPE_GOVERN_ENGINE_METRICS_INTERVAL_MS")]
    pub engine_metrics_interval_ms: Option<u64>,
}

/// What an unset flag or config field of `envelope govern` means, for the
/// settings the start-up reads (the request path's settings keep theirs in
/// [`SettingsDraft::new`], the guard's in `LadderSettings::default` and the
/// latency guard's in `LatencySettings::default`). The one place these
/// defaults are written; `--help` states them.
pub struct StartDefaults {
    pub listen: &'static str,
    pub worker_threads: usize,
    pub guard: bool,
    pub guard_interval_ms: u64,
    pub drain_timeout_ms: u64,
    pub budget_store_timeout_ms: u64,
    pub engine_metrics: bool,
    pub engine_metrics_interval_ms: u64,
    pub token_count: TokenCount,
    pub estimate_bytes_per_token: f64,
    pub on_mismatch: OnMismatch,
    pub record_max_mib: u64,
    pub record_keep: u32,
    pub record_queue: usize,
}

pub const START_DEFAULTS: StartDefaults = StartDefaults {
    listen: "127.0.0.1:9000",
    worker_threads: 1,
    guard: true,
    guard_interval_ms: 1000,
    drain_timeout_ms: 30_000,
    budget_store_timeout_ms: 50,
    engine_metrics: false,
    engine_metrics_interval_ms: 50,
    token_count: TokenCount::Auto,
    estimate_bytes_per_token: crate::tokens::BOUND_BYTES_PER_TOKEN,
    on_mismatch: OnMismatch::Conservative,
    record_max_mib: 256,
    record_keep: 4,
    record_queue: 65_536,
};

/// Each start-up setting as set, else its [`START_DEFAULTS`] value.
impl GovernArgs {
    pub fn listen(&self) -> String {
        let d = START_DEFAULTS.listen;
        self.listen.clone().unwrap_or_else(|| d.to_string())
    }

    pub fn guard(&self) -> bool {
        self.guard.unwrap_or(START_DEFAULTS.guard)
    }

    pub fn guard_interval(&self) -> Duration {
        let ms = self.guard_interval_ms;
        Duration::from_millis(ms.unwrap_or(START_DEFAULTS.guard_interval_ms))
    }

    /// The upstream's metrics: `--guard-metrics-url`, else its `/metrics`.
    pub fn guard_metrics_url(&self, upstream: &str) -> String {
        let url = self.guard_metrics_url.clone();
        url.unwrap_or_else(|| format!("{upstream}/metrics"))
    }

    pub fn drain_timeout(&self) -> Duration {
        let ms = self.drain_timeout_ms;
        Duration::from_millis(ms.unwrap_or(START_DEFAULTS.drain_timeout_ms))
    }

    pub fn budget_store_timeout(&self) -> Duration {
        let ms = self.budget_store_timeout_ms;
        Duration::from_millis(ms.unwrap_or(START_DEFAULTS.budget_store_timeout_ms))
    }

    pub fn engine_metrics(&self) -> bool {
        self.engine_metrics.unwrap_or(START_DEFAULTS.engine_metrics)
    }

    pub fn engine_metrics_interval(&self) -> Duration {
        let ms = self.engine_metrics_interval_ms;
        Duration::from_millis(ms.unwrap_or(START_DEFAULTS.engine_metrics_interval_ms))
    }

    pub fn token_count(&self) -> TokenCount {
        self.token_count.unwrap_or(START_DEFAULTS.token_count)
    }

    pub fn estimate_bytes_per_token(&self) -> f64 {
        let d = START_DEFAULTS.estimate_bytes_per_token;
        self.estimate_bytes_per_token.unwrap_or(d)
    }

    pub fn on_mismatch(&self) -> OnMismatch {
        self.on_mismatch.unwrap_or(START_DEFAULTS.on_mismatch)
    }
}

impl GovernArgs {
    /// `--record`'s settings, or None without it.
    ///
    /// # Errors
    /// A zero queue or size.
    pub fn record_settings(&self) -> Result<Option<crate::recorder::RecordSettings>, StartError> {
        let Some(path) = self.record.clone() else {
            return Ok(None);
        };
        let d = &START_DEFAULTS;
        let mib = self.record_max_mib.unwrap_or(d.record_max_mib);
        let capacity = self.record_queue.unwrap_or(d.record_queue);
        if mib == 0 || capacity == 0 {
            return Err(StartError::Invalid(
                "--record-max-mib (record_max_mib) and --record-queue (record_queue) must be at least 1".into(),
            ));
        }
        Ok(Some(crate::recorder::RecordSettings {
            path,
            max_bytes: mib << 20,
            keep: self.record_keep.unwrap_or(d.record_keep),
            capacity,
            salt: crate::recorder::salt_from_env(),
        }))
    }

    /// Flags over the config file's fields.
    ///
    /// # Errors
    /// The file cannot be read, or is not TOML with these fields.
    pub fn with_config(self) -> Result<GovernArgs, StartError> {
        let Some(path) = self.config.clone() else {
            return Ok(self);
        };
        let text = read("--config", &path)?;
        let bad = |e: &dyn std::fmt::Display| StartError::ConfigFile {
            path: path.clone(),
            message: e.to_string(),
        };
        // The file, checked as written (unknown fields and bad values
        // refused), then merged field by field as TOML tables: what the
        // flags set wins, the rest comes from the file.
        let file: GovernArgs = toml::from_str(&text).map_err(|e| bad(&e))?;
        let mut merged = toml::Table::try_from(&self).map_err(|e| bad(&e))?;
        for (k, v) in toml::Table::try_from(&file).map_err(|e| bad(&e))? {
            merged.entry(k).or_insert(v);
        }
        let mut args: GovernArgs = merged.try_into().map_err(|e| bad(&e))?;
        args.config = Some(path);
        Ok(args)
    }

    /// The runtime that serves the governor: for one worker thread, one
    /// event loop on this thread (beside nginx it carried more requests/s
    /// than tokio's multi-thread scheduler, whose workers hand each other
    /// tasks and wake each other: docs/govern.md), else the multi-thread
    /// scheduler with that many workers.
    ///
    /// # Errors
    /// `worker_threads` is 0, or the runtime cannot start.
    pub fn runtime(&self) -> Result<tokio::runtime::Runtime, StartError> {
        let mut b = match self.worker_threads.unwrap_or(START_DEFAULTS.worker_threads) {
            0 => {
                return Err(StartError::Invalid(
                    "--worker-threads (worker_threads): must be at least 1".into(),
                ))
            }
            1 => tokio::runtime::Builder::new_current_thread(),
            n => {
                let mut b = tokio::runtime::Builder::new_multi_thread();
                b.worker_threads(n);
                b
            }
        };
        Ok(b.enable_all().build()?)
    }

    /// The profile plus overrides -> settings.
    ///
    /// # Errors
    /// The tenants or budgets file cannot be read or is invalid, or the
    /// overrides make invalid settings.
    pub fn settings(
        &self,
        profile_file: &ProfileFile,
        conservative: bool,
    ) -> Result<Settings, StartError> {
        let ProfileFile {
            profile,
            shown,
            limits,
            ..
        } = profile_file;
        let mut limits = limits.clone();
        if conservative {
            limits = live_guard::conservative(&limits);
        }
        // Every settings field that a flag of the same name sets takes the
        // flag's (or the config file's) value; the rest keep their default.
        let written = match serde_json::to_value(self) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => return Err(StartError::Invalid("flags do not serialize".into())),
        };
        let set = |e: String| StartError::Invalid(format!("{shown} with overrides: {e}"));
        // The bucket table is the profile's, never a flag's: kept out of
        // the overlay, so its figures do not go through text.
        let buckets = std::mem::take(&mut limits.buckets);
        let mut limits = settings::overlay(&limits, &written).map_err(set)?;
        limits.buckets = buckets;
        let mut s = SettingsDraft::from_profile(profile, limits);
        s.front = settings::overlay(&s.front, &written).map_err(set)?;
        s.queue = settings::overlay(&s.queue, &written).map_err(set)?;
        s.timeouts = settings::overlay(&s.timeouts, &written).map_err(set)?;
        s.counting = settings::overlay(&s.counting, &written).map_err(set)?;
        if let Some(v) = self.over_limit {
            s.over_limit = v;
        }
        if let Some(v) = self.beyond_envelope {
            s.beyond = v;
        }
        if self.interactive_ttft_budget_ms.is_some() {
            s.interactive_ttft_budget_ms = self.interactive_ttft_budget_ms;
        }
        s.batch_ttft_budget_ms = self.batch_ttft_budget_ms;
        if let Some(v) = self.over_budget {
            s.over_budget = v;
        }
        if let Some(v) = self.latency_guard {
            s.latency.enabled = v;
        }
        if let Some(p) = &self.tenants {
            let t = read("--tenants", p)?;
            s.tenants = TenantsSettings::from_toml(&t, &p.display().to_string())
                .map_err(StartError::Invalid)?;
        }
        if let Some(v) = self.guard_small_kv {
            s.ladder.small_kv_usage = v;
        }
        if let Some(v) = self.guard_reject_kv {
            s.ladder.reject_kv_usage = v;
        }
        s.ladder.min_gpu_free_bytes = self.guard_min_gpu_free_bytes;
        s.admin_token = self.admin_token.clone();
        if let Some(p) = &self.budgets {
            let t = read("--budgets", p)?;
            let b = crate::budget::Budgets::from_toml(&t, &p.display().to_string(), profile)
                .map_err(StartError::Invalid)?;
            s.budgets = Some(std::sync::Arc::new(b));
        }
        s.check()
            .map_err(|e| StartError::Invalid(format!("{shown} with overrides: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: GovernArgs,
    }

    #[test]
    fn flags_win_over_the_config_file() {
        let dir = std::env::temp_dir().join(format!("envelope-govern-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("g.toml");
        std::fs::write(
            &cfg,
            "profile = \"p.json\"\nupstream = \"http://u\"\nmax_concurrent_seqs = 3\nover_limit = \"reject\"\n",
        )
        .unwrap();
        let t = T::try_parse_from([
            "t",
            "--config",
            cfg.to_str().unwrap(),
            "--upstream",
            "http://flag",
        ])
        .unwrap();
        let a = t.a.with_config().unwrap();
        assert_eq!(a.upstream.as_deref(), Some("http://flag"));
        assert_eq!(a.profile.as_deref(), Some(Path::new("p.json")));
        assert_eq!(a.max_concurrent_seqs, Some(3));
        assert_eq!(a.over_limit, Some(OverLimit::Reject));
        std::fs::write(
            &cfg,
            "token_count = \"estimate\"\non_mismatch = \"refuse\"\n",
        )
        .unwrap();
        let t = T::try_parse_from(["t", "--config", cfg.to_str().unwrap()]).unwrap();
        let a = t.a.with_config().unwrap();
        assert_eq!(a.token_count, Some(TokenCount::Estimate));
        assert_eq!(a.on_mismatch, Some(OnMismatch::Refuse));
        // Every kind of field comes through the merge: a bool, a float, a
        // list, a path; a flag of the same field wins; what neither sets is
        // the one default.
        std::fs::write(
            &cfg,
            "guard = false\nguard_small_kv = 0.8\npassthrough_paths = [\"/x\"]\nrecord = \"r.jsonl\"\nlisten = \"127.0.0.1:1\"\n",
        )
        .unwrap();
        let t = T::try_parse_from([
            "t",
            "--config",
            cfg.to_str().unwrap(),
            "--listen",
            "127.0.0.1:2",
        ])
        .unwrap();
        let a = t.a.with_config().unwrap();
        assert!(!a.guard());
        assert_eq!(a.guard_small_kv, Some(0.8));
        assert_eq!(a.passthrough_paths, Some(vec!["/x".to_string()]));
        assert_eq!(a.record.as_deref(), Some(Path::new("r.jsonl")));
        assert_eq!(a.listen(), "127.0.0.1:2");
        assert_eq!(a.config.as_deref(), Some(cfg.as_path()));
        assert_eq!(a.drain_timeout().as_millis(), 30_000);
        assert_eq!(a.guard_metrics_url("http://u"), "http://u/metrics");
        std::fs::write(&cfg, "on_mismatch = \"maybe\"\n").unwrap();
        let t = T::try_parse_from(["t", "--config", cfg.to_str().unwrap()]).unwrap();
        assert!(t.a.with_config().is_err());
        assert!(T::try_parse_from(["t", "--token-count", "guess"]).is_err());
        std::fs::write(&cfg, "nonsense_field = 1\n").unwrap();
        let t = T::try_parse_from(["t", "--config", cfg.to_str().unwrap()]).unwrap();
        assert!(t.a.with_config().is_err());
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Every setting of the four groups and every scalar limit that a flag
    /// of its name exists for is set by that flag, with no list of them
    /// kept anywhere; the only one without a flag is the body's time.
    #[test]
    fn a_flag_sets_the_setting_of_its_name() {
        use clap::CommandFactory;
        let profile = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../profiles/cpu-2core-smollm2-135m-q4_1-quickstart/profile.json");
        let file = ProfileFile::read("--profile", &profile).unwrap();
        let defaults = T::try_parse_from(["t"])
            .unwrap()
            .a
            .settings(&file, false)
            .unwrap();
        let flags: Vec<String> = T::command()
            .get_arguments()
            .map(|a| a.get_id().to_string())
            .collect();
        let mut limits = serde_json::to_value(&defaults.limits).unwrap();
        limits.as_object_mut().unwrap().remove("buckets");
        let groups = [
            ("limits", limits),
            ("front", serde_json::to_value(&defaults.front).unwrap()),
            ("queue", serde_json::to_value(&defaults.queue).unwrap()),
            (
                "timeouts",
                serde_json::to_value(&defaults.timeouts).unwrap(),
            ),
            (
                "counting",
                serde_json::to_value(&defaults.counting).unwrap(),
            ),
        ];
        let mut without_a_flag = vec![];
        for (group, fields) in &groups {
            for (name, default) in fields.as_object().unwrap() {
                if !flags.contains(name) {
                    without_a_flag.push(name.clone());
                    continue;
                }
                // A value other than the default, of the field's type.
                let (given, expected) = match default {
                    serde_json::Value::Array(_) => ("/z".to_string(), serde_json::json!(["/z"])),
                    v => {
                        let n = v.as_u64().unwrap() / 2 + 1;
                        (n.to_string(), serde_json::json!(n))
                    }
                };
                let flag = format!("--{}", name.replace('_', "-"));
                let t = T::try_parse_from(["t", flag.as_str(), given.as_str()]).unwrap();
                let s = t.a.settings(&file, false).unwrap();
                let now = match *group {
                    "limits" => serde_json::to_value(&s.limits).unwrap(),
                    "front" => serde_json::to_value(&s.front).unwrap(),
                    "queue" => serde_json::to_value(&s.queue).unwrap(),
                    "timeouts" => serde_json::to_value(&s.timeouts).unwrap(),
                    _ => serde_json::to_value(&s.counting).unwrap(),
                };
                assert_eq!(now[name], expected, "{flag} {given} sets {group}.{name}");
            }
        }
        assert_eq!(without_a_flag, ["body_timeout_ms"]);
    }
}
