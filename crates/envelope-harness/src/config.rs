//! `bench-configs/*.toml`: parsed, then validated into settings that cannot
//! be invalid. Every error names the file and the field.

mod agent_load;
mod bucket;
pub mod command;
mod prompts;
mod trace;

pub use agent_load::{AgentLoad, Arrival};
pub use bucket::{Bucket, MAX_CACHED_PERCENT};
use envelope_engine::{BatchPolicy, KvDtype, Precision};
use envelope_profile::Slo;
pub use prompts::Prompts;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
pub use trace::{TraceConfig, TraceLoad};

#[derive(Debug, thiserror::Error)]
#[error("{file}: {message}")]
pub struct ConfigError {
    pub file: String,
    pub message: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetConfig {
    /// `engine` (in process), `http` (a running server) or `launch` (a command per configuration).
    pub kind: String,
    /// engine: a model spec (GGUF, HF directory, `dummy:PRESET`); http and
    /// launch: the model name sent in requests (and `{model}` in the command).
    pub model: Option<String>,
    /// Engine KV pool, e.g. `256MiB` (engine; `{kv_cache_bytes}` for launch).
    pub kv_cache_bytes: Option<String>,
    /// engine: `cpu` (default), `cuda`, `cuda:N` or `auto`, as `--device`
    /// (the binary parses and resolves it).
    pub device: Option<String>,
    #[serde(default = "default_block_size")]
    pub block_size: usize,
    /// http: the server, e.g. `http://127.0.0.1:8000`; launch: where the
    /// launched server listens (default `http://127.0.0.1:{port}`).
    pub base_url: Option<String>,
    /// launch: the command template, e.g. `envelope serve --model {model} --port {port}`.
    pub command: Option<String>,
    /// http and launch: Prometheus metrics (default `{base_url}/metrics`;
    /// `""` for none). KV use and preemptions come from here.
    pub metrics_url: Option<String>,
    /// launch: the path polled until it answers 2xx (default `/health`).
    #[serde(default = "default_ready_path")]
    pub ready_path: String,
    /// launch: seconds to wait for readiness (default 300).
    #[serde(default = "default_ready_timeout")]
    pub ready_timeout_s: u64,
    /// http and launch: synthetic token ids stay below this (default 32000).
    #[serde(default = "default_vocab")]
    pub vocab_size: usize,
    /// http and launch: `tokens` (exact lengths) or `text` (approximate).
    #[serde(default = "default_prompt_format")]
    pub prompt_format: String,
    /// http and launch: extra fields merged into every request body
    /// (e.g. `{ min_tokens = 128 }` for vLLM).
    #[serde(default)]
    pub extra_body: toml::Table,
    /// http and launch: the server's KV capacity in tokens, when its metrics
    /// do not say (vLLM logs it at start as "GPU KV cache size").
    pub kv_capacity_tokens: Option<u64>,
    /// http and launch: a request taking longer is an error (default 600).
    #[serde(default = "default_request_timeout")]
    pub request_timeout_s: u64,
    /// http and launch: the served model's tokenizer (`.gguf` or
    /// `tokenizer.json`), recorded in the profile with its SHA-256 so a
    /// governor can count prompts with it (default: the model file the
    /// server reports, where it reports one, as llama.cpp's `/props` does).
    pub tokenizer: Option<PathBuf>,
    /// launch: what a matrix value becomes in the command, per placeholder
    /// (`precision`, `kv_dtype`, `batch_policy`), e.g.
    /// `[target.values.precision] fp8 = "--quantization fp8"`. A placeholder
    /// with a table must have an entry for every value of its matrix axis;
    /// one without is substituted as written.
    #[serde(default)]
    pub values: BTreeMap<String, BTreeMap<String, String>>,
}

fn default_ready_path() -> String {
    "/health".into()
}
fn default_ready_timeout() -> u64 {
    300
}
fn default_vocab() -> usize {
    32000
}
fn default_prompt_format() -> String {
    "tokens".into()
}
fn default_request_timeout() -> u64 {
    600
}

fn default_block_size() -> usize {
    16
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MatrixConfig {
    #[serde(default = "as_served")]
    pub precisions: Vec<String>,
    /// Absent: `f32`, or on a `cuda`/`auto` engine device each precision's
    /// CUDA activation dtype (`bf16` for bf16/as-stored/fp8).
    #[serde(default)]
    pub kv_dtypes: Option<Vec<String>>,
    #[serde(default = "as_served")]
    pub batch_policies: Vec<String>,
    #[serde(default = "default_seqs")]
    pub max_num_seqs: u32,
    #[serde(default = "default_batched")]
    pub max_num_batched_tokens: usize,
    /// `INPUTxOUTPUT` token buckets, e.g. `128x128` (cold: every prompt
    /// distinct), or `INPUTxOUTPUT@P%` (warm: the first P% of every prompt
    /// is a prefix the probe's requests share), e.g. `1024x32@85%`.
    pub buckets: Vec<String>,
    #[serde(default = "one")]
    pub concurrency_min: u32,
    #[serde(default = "default_seqs")]
    pub concurrency_max: u32,
}

fn as_served() -> Vec<String> {
    vec!["as-served".into()]
}
fn default_seqs() -> u32 {
    64
}
fn default_batched() -> usize {
    2048
}
fn one() -> u32 {
    1
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadConfig {
    /// `closed` (fixed concurrency, searched) or `poisson` (open-loop
    /// arrivals at a fixed rate, the rate searched).
    #[serde(default = "closed")]
    pub mode: String,
    /// closed: requests per probe = max(min_requests, concurrency x rounds).
    #[serde(default = "two")]
    pub rounds: u32,
    #[serde(default = "eight")]
    pub min_requests: u32,
    /// closed: spread the workers' starts over about one request time (the
    /// median end-to-end latency of the level below in the bucket), so
    /// that a probe measures its level's steady state, not a burst; what
    /// is sent before the last worker starts is the warm-up, kept in
    /// `requests.csv` and left out of the verdicts. Default `false` (all
    /// start together): beside vLLM the steady state's safe points were
    /// 2-5x the burst's, and a governor enforcing them let the safe count
    /// arriving at once break the TTFT SLO threefold (docs/sweep.md,
    /// *Load shape*).
    #[serde(default)]
    pub ramp: bool,
    /// The most requests a level's probes may send to decide its latency
    /// verdicts at `slo.confidence` (a probe at the bracket's ends is
    /// extended until then); a level still undecided is never passed.
    /// Default: four times the fewest that could decide them (41 requests
    /// for a p95 at 90%, 108 for a p99), at least `min_requests`.
    pub max_requests: Option<u32>,
    /// How many times the whole search runs (`envelope sweep --repeats`),
    /// every configuration once a repeat, in turn, so that drift hits
    /// all alike. Profiles keep each repeat's search per bucket.
    #[serde(default = "one")]
    pub repeats: u32,
    /// poisson: the searched rates are multiples of `rate_step_per_s`
    /// between `rate_min_per_s` and `rate_max_per_s`.
    #[serde(default = "rate_one")]
    pub rate_step_per_s: f64,
    #[serde(default = "rate_one")]
    pub rate_min_per_s: f64,
    #[serde(default = "rate_max")]
    pub rate_max_per_s: f64,
    /// poisson: requests per probe = max(min_requests, rate x duration_s).
    #[serde(default = "ten")]
    pub duration_s: f64,
    /// A dataset of prompts (one per line, or JSON lines with `prompt`)
    /// instead of synthetic token sequences.
    pub dataset: Option<String>,
    /// closed: a worker that idles between its requests for longer than this
    /// (or a quarter of the median request) was not keeping the load closed,
    /// and the probe is invalid (`client_limited`).
    #[serde(default = "gap_ms")]
    pub max_client_gap_ms: f64,
    /// poisson: an arrival sent over this long (or a fifth of the mean gap)
    /// behind its schedule is late.
    #[serde(default = "late_ms")]
    pub late_after_ms: f64,
    /// poisson: a probe that sends a larger share of its arrivals late is
    /// invalid (`client_limited`).
    #[serde(default = "late_share")]
    pub max_late_fraction: f64,
    /// Agent-shaped load: an `envelope plan` workload file. After the
    /// buckets, each configuration's safe scale of it is searched (see
    /// `envelope_harness::agents`).
    pub workload: Option<String>,
    /// workload: how runs arrive: `poisson`, `bursts` (on/off) or `ramp`.
    #[serde(default = "poisson")]
    pub arrival: String,
    /// workload, bursts: seconds on and off (the mean rate is kept).
    #[serde(default = "rate_one")]
    pub burst_on_s: f64,
    #[serde(default = "three")]
    pub burst_off_s: f64,
    /// workload: the searched scales (1.0 = the workload's mean rates) are
    /// multiples of `scale_step` in [scale_min, scale_max].
    #[serde(default = "quarter")]
    pub scale_min: f64,
    #[serde(default = "quarter")]
    pub scale_step: f64,
    #[serde(default = "scale_max")]
    pub scale_max: f64,
    /// workload: after the first breach, at most this many more probes,
    /// each at twice the scale, until goodput falls below
    /// `collapse_fraction` of its peak (the collapse); then the recovery
    /// from there to the safe scale is timed. 0: neither.
    #[serde(default = "three_u32")]
    pub collapse_probes: u32,
    #[serde(default = "half")]
    pub collapse_fraction: f64,
    /// workload and trace: seconds at the safe scale after the overload
    /// (default twice `duration_s`, or a trace probe's length).
    pub recovery_s: Option<f64>,
    /// `[load.trace]`: a recorded trace replayed after the buckets, its
    /// safe time-scale factor searched (see `envelope_harness::trace_load`).
    pub trace: Option<TraceConfig>,
}

fn three_u32() -> u32 {
    3
}
fn half() -> f64 {
    0.5
}

fn poisson() -> String {
    "poisson".into()
}
fn three() -> f64 {
    3.0
}
fn quarter() -> f64 {
    0.25
}
fn scale_max() -> f64 {
    8.0
}

fn closed() -> String {
    "closed".into()
}
fn two() -> u32 {
    2
}
fn eight() -> u32 {
    8
}
fn rate_one() -> f64 {
    1.0
}
fn rate_max() -> f64 {
    64.0
}
fn ten() -> f64 {
    10.0
}
fn gap_ms() -> f64 {
    100.0
}
fn late_ms() -> f64 {
    10.0
}
fn late_share() -> f64 {
    0.05
}

impl Default for LoadConfig {
    fn default() -> Self {
        LoadConfig {
            mode: closed(),
            rounds: 2,
            min_requests: 8,
            ramp: false,
            max_requests: None,
            repeats: 1,
            rate_step_per_s: 1.0,
            rate_min_per_s: 1.0,
            rate_max_per_s: 64.0,
            duration_s: 10.0,
            dataset: None,
            max_client_gap_ms: gap_ms(),
            late_after_ms: late_ms(),
            max_late_fraction: late_share(),
            workload: None,
            arrival: poisson(),
            burst_on_s: 1.0,
            burst_off_s: three(),
            scale_min: quarter(),
            scale_step: quarter(),
            scale_max: scale_max(),
            collapse_probes: 3,
            collapse_fraction: 0.5,
            recovery_s: None,
            trace: None,
        }
    }
}

impl LoadConfig {
    pub fn is_open_loop(&self) -> bool {
        self.mode == "poisson"
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    target: TargetConfig,
    matrix: MatrixConfig,
    #[serde(default)]
    load: LoadConfig,
    #[serde(default)]
    slo: Slo,
    quality: Option<QualityConfig>,
}

/// `[quality]` (engine target): after the sweep, score the selected
/// configuration's precision on a text (perplexity, and KL divergence and
/// top-1 agreement against `reference`) into the profile's `quality`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QualityConfig {
    #[serde(default = "default_quality_text")]
    pub text: String,
    /// A precision, or `none` for perplexity only.
    #[serde(default = "default_quality_reference")]
    pub reference: String,
    #[serde(default = "default_window")]
    pub window_tokens: usize,
    pub max_windows: Option<usize>,
}

fn default_quality_text() -> String {
    "bench-configs/quality/founding-documents.txt".into()
}
fn default_quality_reference() -> String {
    "f32".into()
}
fn default_window() -> usize {
    256
}

/// A validated `[quality]`.
#[derive(Debug, Clone)]
pub struct QualitySettings {
    pub text_set: String,
    pub text: String,
    pub reference: Option<Precision>,
    pub window_tokens: usize,
    pub max_windows: Option<usize>,
}

/// One point of the matrix. The strings name it and fill a launch
/// command's placeholders; `engine` holds them parsed for the embedded engine.
#[derive(Debug, Clone, PartialEq)]
pub struct MatrixPoint {
    pub precision: String,
    pub kv_dtype: String,
    pub policy: String,
    pub engine: Option<EnginePoint>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EnginePoint {
    pub precision: Precision,
    pub kv_dtype: KvDtype,
    pub policy: BatchPolicy,
}

impl MatrixPoint {
    pub fn name(&self) -> String {
        format!("{}-{}-{}", self.precision, self.kv_dtype, self.policy)
    }
}

/// Where the load goes.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    Engine,
    Http {
        base_url: String,
    },
    Launch {
        command: String,
        /// May hold `{port}`.
        base_url: String,
        ready_path: String,
        ready_timeout_s: u64,
        /// `target.values`: matrix values as the server's flags.
        values: BTreeMap<String, BTreeMap<String, String>>,
    },
}

/// Settings of the HTTP client (http and launch targets).
#[derive(Debug, Clone)]
pub struct HttpClientConfig {
    /// `None`: none; may hold `{base_url}`.
    pub metrics_url: Option<String>,
    pub vocab_size: usize,
    pub text_prompts: bool,
    pub extra_body: serde_json::Map<String, serde_json::Value>,
    pub request_timeout_s: u64,
    pub kv_capacity_tokens: Option<u64>,
    pub tokenizer: Option<PathBuf>,
}

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub file: PathBuf,
    pub target: Target,
    pub http: HttpClientConfig,
    pub model: String,
    /// `target.device` as written (engine target only; see [`TargetConfig`]).
    pub device: Option<String>,
    pub kv_cache_bytes: usize,
    pub block_size: usize,
    pub points: Vec<MatrixPoint>,
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: usize,
    pub buckets: Vec<Bucket>,
    pub concurrency_min: u32,
    pub concurrency_max: u32,
    pub load: LoadConfig,
    /// `load.workload`, read and validated.
    pub agents: Option<AgentLoad>,
    /// `[load.trace]`, the trace read and the settings validated.
    pub trace: Option<TraceLoad>,
    pub prompts: Prompts,
    pub quality: Option<QualitySettings>,
    pub slo: Slo,
}

pub use envelope_engine::util::parse_bytes;

impl BenchConfig {
    pub fn load(path: &Path) -> Result<BenchConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: path.display().to_string(),
            message: e.to_string(),
        })?;
        BenchConfig::parse(&text, path)
    }

    pub fn parse(text: &str, path: &Path) -> Result<BenchConfig, ConfigError> {
        let err = |m: String| ConfigError {
            file: path.display().to_string(),
            message: m,
        };
        let raw: RawConfig = toml::from_str(text).map_err(|e| err(e.to_string()))?;
        let t = &raw.target;
        let model = t.model.clone().ok_or_else(|| {
            err(format!(
                "target.model is required for the {} target",
                t.kind
            ))
        })?;
        let target = match t.kind.as_str() {
            "engine" => Target::Engine,
            "http" => Target::Http {
                base_url: t
                    .base_url
                    .clone()
                    .ok_or_else(|| err("target.base_url is required for the http target".into()))?,
            },
            "launch" => Target::Launch {
                command: t.command.clone().ok_or_else(|| {
                    err("target.command is required for the launch target".into())
                })?,
                base_url: t
                    .base_url
                    .clone()
                    .unwrap_or_else(|| "http://127.0.0.1:{port}".into()),
                ready_path: t.ready_path.clone(),
                ready_timeout_s: t.ready_timeout_s,
                values: t.values.clone(),
            },
            other => {
                return Err(err(format!(
                    "target.kind `{other}` is not one of engine, http, launch"
                )))
            }
        };
        let kv_cache_bytes = match &t.kv_cache_bytes {
            Some(s) => parse_bytes(s)
                .ok_or_else(|| err(format!("target.kv_cache_bytes `{s}` is not a byte size")))?,
            None => 256 << 20,
        };
        if t.block_size == 0 {
            return Err(err("target.block_size must be at least 1".into()));
        }
        let text_prompts = match t.prompt_format.as_str() {
            "tokens" => false,
            "text" => true,
            other => {
                return Err(err(format!(
                    "target.prompt_format `{other}` is not one of tokens, text"
                )))
            }
        };
        if t.vocab_size < 2 {
            return Err(err("target.vocab_size must be at least 2".into()));
        }
        let extra_body = match serde_json::to_value(&t.extra_body) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => return Err(err("target.extra_body must be a table".into())),
        };
        let http = HttpClientConfig {
            metrics_url: match &t.metrics_url {
                Some(u) if u.is_empty() => None,
                Some(u) => Some(u.clone()),
                None => Some("{base_url}/metrics".into()),
            },
            vocab_size: t.vocab_size,
            text_prompts,
            extra_body,
            request_timeout_s: t.request_timeout_s.max(1),
            kv_capacity_tokens: t.kv_capacity_tokens,
            tokenizer: t.tokenizer.clone(),
        };
        let m = &raw.matrix;
        let nonempty = |v: &Vec<String>, f: &str| {
            if v.is_empty() {
                Err(err(format!("matrix.{f} must not be empty")))
            } else {
                Ok(())
            }
        };
        nonempty(&m.precisions, "precisions")?;
        if let Some(k) = &m.kv_dtypes {
            nonempty(k, "kv_dtypes")?;
        }
        let on_gpu = target == Target::Engine
            && t.device.as_deref().is_some_and(|d| {
                d.parse::<envelope_engine::device::DeviceSetting>()
                    .is_ok_and(|d| d != envelope_engine::device::DeviceSetting::Cpu)
            });
        // The KV dtypes of precision `p` when the config names none.
        let default_kvs = |p: &str| -> Result<Vec<String>, ConfigError> {
            Ok(vec![if on_gpu {
                let precision = p
                    .parse()
                    .map_err(|e| err(format!("matrix.precisions: {e}")))?;
                envelope_engine::cuda::default_kv_dtype(precision).to_string()
            } else {
                "f32".to_string()
            }])
        };
        nonempty(&m.batch_policies, "batch_policies")?;
        nonempty(&m.buckets, "buckets")?;
        let mut points = vec![];
        for p in &m.precisions {
            let kvs = match &m.kv_dtypes {
                Some(k) => k.clone(),
                None => default_kvs(p)?,
            };
            for k in &kvs {
                for b in &m.batch_policies {
                    let mut point = MatrixPoint {
                        precision: p.clone(),
                        kv_dtype: k.clone(),
                        policy: b.clone(),
                        engine: None,
                    };
                    if target == Target::Engine {
                        let e = EnginePoint {
                            precision: p
                                .parse()
                                .map_err(|e| err(format!("matrix.precisions: {e}")))?,
                            kv_dtype: k
                                .parse()
                                .map_err(|e| err(format!("matrix.kv_dtypes: {e}")))?,
                            policy: b
                                .parse()
                                .map_err(|e| err(format!("matrix.batch_policies: {e}")))?,
                        };
                        point.precision = e.precision.to_string();
                        point.kv_dtype = e.kv_dtype.to_string();
                        point.policy = e.policy.to_string();
                        point.engine = Some(e);
                    }
                    points.push(point);
                }
            }
        }
        if matches!(target, Target::Http { .. }) && points.len() > 1 {
            return Err(err(format!(
                "matrix: an http target serves one configuration, but the matrix has {} \
                 (use the launch target to vary precision, KV dtype or batch policy)",
                points.len()
            )));
        }
        let buckets = m
            .buckets
            .iter()
            .map(|b| Bucket::parse(b).map_err(|e| err(format!("matrix.buckets: {e}"))))
            .collect::<Result<Vec<_>, _>>()?;
        for (i, b) in buckets.iter().enumerate() {
            if buckets[..i].contains(b) {
                return Err(err(format!(
                    "matrix.buckets: `{}` is listed twice",
                    b.label()
                )));
            }
        }
        if m.concurrency_min == 0 || m.concurrency_max < m.concurrency_min {
            return Err(err(format!(
                "matrix.concurrency_min ({}) must be >= 1 and <= matrix.concurrency_max ({})",
                m.concurrency_min, m.concurrency_max
            )));
        }
        if m.max_num_seqs == 0 || m.max_num_batched_tokens == 0 {
            return Err(err(
                "matrix.max_num_seqs and matrix.max_num_batched_tokens must be at least 1".into(),
            ));
        }
        let l = &raw.load;
        if l.mode != "closed" && l.mode != "poisson" {
            return Err(err(format!(
                "load.mode `{}` is not one of closed, poisson",
                l.mode
            )));
        }
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if l.is_open_loop()
            && !(positive(l.rate_step_per_s)
                && positive(l.rate_min_per_s)
                && positive(l.duration_s)
                && l.rate_max_per_s >= l.rate_min_per_s
                && l.rate_min_per_s >= l.rate_step_per_s)
        {
            return Err(err(format!(
                "load.rate_step_per_s ({}), load.rate_min_per_s ({}), load.rate_max_per_s ({}) \
                 and load.duration_s ({}) must be positive with step <= min <= max",
                l.rate_step_per_s, l.rate_min_per_s, l.rate_max_per_s, l.duration_s
            )));
        }
        if raw.load.rounds == 0 {
            return Err(err("load.rounds must be at least 1".into()));
        }
        if raw.load.repeats == 0 {
            return Err(err("load.repeats must be at least 1".into()));
        }
        if raw.load.max_requests == Some(0) {
            return Err(err("load.max_requests must be at least 1".into()));
        }
        if !(positive(l.max_client_gap_ms) && positive(l.late_after_ms)) {
            return Err(err(format!(
                "load.max_client_gap_ms ({}) and load.late_after_ms ({}) must be positive",
                l.max_client_gap_ms, l.late_after_ms
            )));
        }
        if !(0.0..=1.0).contains(&l.max_late_fraction) {
            return Err(err(format!(
                "load.max_late_fraction must be in [0, 1], got {}",
                l.max_late_fraction
            )));
        }
        if let (Some(_), Some(w)) = (&l.dataset, buckets.iter().find(|b| b.cached_percent > 0)) {
            return Err(err(format!(
                "matrix.buckets: the warm bucket `{}` needs synthetic prompts (its shared prefix \
                 is made of tokens), but load.dataset is set",
                w.label()
            )));
        }
        let prompts = match &l.dataset {
            None => Prompts::Synthetic,
            Some(d) => {
                Prompts::from_file(Path::new(d)).map_err(|e| err(format!("load.dataset: {e}")))?
            }
        };
        let quality = match &raw.quality {
            None => None,
            Some(_) if target != Target::Engine => {
                return Err(err(
                    "quality: [quality] needs the engine target (it loads the model here)".into(),
                ))
            }
            Some(q) => {
                let reference = match q.reference.as_str() {
                    "none" => None,
                    r => Some(
                        r.parse::<Precision>()
                            .map_err(|e| err(format!("quality.reference: {e}")))?,
                    ),
                };
                if q.window_tokens < 2 {
                    return Err(err("quality.window_tokens must be at least 2".into()));
                }
                let text = std::fs::read_to_string(&q.text)
                    .map_err(|e| err(format!("quality.text: {}: {e}", q.text)))?;
                Some(QualitySettings {
                    text_set: q.text.clone(),
                    text,
                    reference,
                    window_tokens: q.window_tokens,
                    max_windows: q.max_windows,
                })
            }
        };
        let s = &raw.slo;
        if !(0.0..1.0).contains(&s.headroom) {
            return Err(err(format!(
                "slo.headroom must be in [0, 1), got {}",
                s.headroom
            )));
        }
        if !(0.5..1.0).contains(&s.confidence) {
            return Err(err(format!(
                "slo.confidence must be in [0.5, 1), got {}",
                s.confidence
            )));
        }
        for (name, v) in [
            ("slo.max_kv_usage", s.max_kv_usage),
            ("slo.max_error_rate", s.max_error_rate),
            ("slo.max_shed_rate", s.max_shed_rate),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(err(format!("{name} must be in [0, 1], got {v}")));
            }
        }
        let decision = s.decision.unwrap_or_default();
        decision.check().map_err(err)?;
        if !t.values.is_empty() && !matches!(target, Target::Launch { .. }) {
            return Err(err("target.values is for the launch target".into()));
        }
        let cfg = BenchConfig {
            file: path.to_path_buf(),
            target,
            http,
            model,
            device: t.device.clone(),
            kv_cache_bytes,
            block_size: t.block_size,
            points,
            max_num_seqs: m.max_num_seqs,
            max_num_batched_tokens: m.max_num_batched_tokens,
            buckets,
            concurrency_min: m.concurrency_min,
            concurrency_max: m.concurrency_max,
            load: raw.load.clone(),
            agents: AgentLoad::from_load(&raw.load).map_err(err)?,
            trace: TraceLoad::from_load(&raw.load).map_err(err)?,
            prompts,
            quality,
            // The profile states the rule its verdicts were decided by.
            slo: Slo {
                decision: Some(decision),
                ..raw.slo
            },
        };
        // Every configuration's command renders (all placeholders known,
        // every matrix value mapped) before anything is launched.
        if let Target::Launch { command, .. } = &cfg.target {
            for point in &cfg.points {
                command::command_vars(&cfg, point, 0)
                    .and_then(|vars| command::render(command, &vars))
                    .map_err(|e| err(format!("target.command for {}: {e}", point.name())))?;
            }
        }
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests;
