//! Inference-server metrics: fetch `/metrics`, parse the Prometheus (or
//! OpenMetrics) text with `openmetrics-parser`, detect the engine from its
//! metric names, and map them to one [`EngineState`]. A field the engine
//! does not expose is `None`, never zero; a NaN, negative or out-of-range
//! value is dropped and named in `rejected`.

use openmetrics_parser::{MetricNumber, OpenMetricsValue, PrometheusValue};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    Vllm,
    Sglang,
    Tgi,
    LlamaCpp,
    Envelope,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineState {
    pub engine: EngineKind,
    /// When the text was fetched (or parsed), ms since the Unix epoch.
    pub fetched_unix_ms: u64,
    pub running: Option<f64>,
    pub waiting: Option<f64>,
    /// KV-cache use, 0..1.
    pub kv_usage: Option<f64>,
    pub preemptions_total: Option<f64>,
    pub prompt_tokens_total: Option<f64>,
    pub generation_tokens_total: Option<f64>,
    /// Tokens the KV cache holds, where the engine exports it (envelope,
    /// TGI as a gauge; vLLM as labels of `vllm:cache_config_info`).
    #[serde(default)]
    pub kv_capacity_tokens: Option<f64>,
    /// Bytes of KV cache per token (vLLM: `kv_cache_memory_bytes` over
    /// `kv_cache_size_tokens` of `cache_config_info`).
    #[serde(default)]
    pub kv_bytes_per_token: Option<f64>,
    /// Whether the server shares KV blocks between prompts with a common
    /// prefix (vLLM's `enable_prefix_caching`).
    #[serde(default)]
    pub prefix_caching: Option<bool>,
    /// Tokens a KV block holds (vLLM's `block_size`): a prefix is found in
    /// the cache in whole blocks.
    #[serde(default)]
    pub kv_block_size: Option<f64>,
    /// Prompt tokens looked up in the prefix cache, and of those found
    /// there, since the server started (vLLM's
    /// `prefix_cache_queries_total` / `prefix_cache_hits_total`; SGLang
    /// exports only a ratio). A hit rate is the hits' growth over the
    /// queries' growth between two readings.
    #[serde(default)]
    pub prefix_cache_queries_total: Option<f64>,
    #[serde(default)]
    pub prefix_cache_hits_total: Option<f64>,
    /// Metrics present but unusable (NaN, negative, out of range), by name.
    pub rejected: Vec<String>,
}

impl EngineState {
    pub fn age_ms(&self) -> u64 {
        crate::unix_ms().saturating_sub(self.fetched_unix_ms)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("cannot reach {url}: {message}")]
    Unreachable { url: String, message: String },
    /// `said` is what the answer's body said, as `: message` (empty when
    /// it said nothing readable): llama.cpp's server started without
    /// `--metrics` says so in its 501.
    #[error("{url} answered HTTP {status}{said}")]
    Http {
        url: String,
        status: u16,
        said: String,
    },
    #[error("not Prometheus text: {0}")]
    NotPrometheus(String),
    #[error("no known engine metrics (vllm:, sglang:, tgi_, llamacpp:, envelope:) in the text")]
    UnknownEngine,
}

/// Every sample value of each family, keyed by family name (counters also
/// under their `_total` name) and histogram sums under `<name>_sum`; and
/// the labels of `*_info` families, whose values are in their labels.
#[derive(Default)]
struct Families(
    HashMap<String, Vec<f64>>,
    HashMap<String, HashMap<String, String>>,
);

impl Families {
    fn push(&mut self, name: &str, v: f64) {
        self.0.entry(name.to_string()).or_default().push(v);
    }
    fn keep_info(
        &mut self,
        name: &str,
        labels: &[String],
        set: Option<openmetrics_parser::LabelSet<'_>>,
    ) {
        let Some(set) = set.filter(|_| name.ends_with("_info")) else {
            return;
        };
        let kept = self.1.entry(name.to_string()).or_default();
        for l in labels {
            if let Some(v) = set.get_label_value(l) {
                kept.insert(l.clone(), v.to_string());
            }
        }
    }
    /// A label of an `*_info` family, as a number.
    fn info_number(&self, family: &str, label: &str) -> Option<f64> {
        let v: f64 = self.1.get(family)?.get(label)?.parse().ok()?;
        (v.is_finite() && v > 0.0).then_some(v)
    }
    fn info_bool(&self, family: &str, label: &str) -> Option<bool> {
        match self
            .1
            .get(family)?
            .get(label)?
            .to_ascii_lowercase()
            .as_str()
        {
            "true" | "1" => Some(true),
            "false" | "0" => Some(false),
            _ => None,
        }
    }
    fn get(&self, name: &str) -> Option<&Vec<f64>> {
        self.0
            .get(name)
            .or_else(|| self.0.get(&format!("{name}_total")))
            .or_else(|| name.strip_suffix("_total").and_then(|n| self.0.get(n)))
    }
}

fn num(n: &MetricNumber) -> f64 {
    n.as_f64()
}

fn parse_families(text: &str) -> Result<Families, MetricsError> {
    let mut f = Families::default();
    let is_openmetrics = text.lines().any(|l| l.trim() == "# EOF");
    if is_openmetrics {
        let exp = openmetrics_parser::openmetrics::parse_openmetrics(text)
            .map_err(|e| MetricsError::NotPrometheus(e.to_string()))?;
        for (name, fam) in exp.families {
            let labels = fam.get_label_names().to_vec();
            for s in fam.iter_samples() {
                f.keep_info(&name, &labels, s.get_labelset().ok());
                match &s.value {
                    OpenMetricsValue::Gauge(n)
                    | OpenMetricsValue::Unknown(n)
                    | OpenMetricsValue::StateSet(n) => f.push(&name, num(n)),
                    OpenMetricsValue::Counter(c) => {
                        f.push(&name, num(&c.value));
                        f.push(&format!("{name}_total"), num(&c.value));
                    }
                    OpenMetricsValue::Histogram(h) | OpenMetricsValue::GaugeHistogram(h) => {
                        if let Some(sum) = &h.sum {
                            f.push(&format!("{name}_sum"), num(sum));
                        }
                    }
                    OpenMetricsValue::Summary(sv) => {
                        if let Some(sum) = &sv.sum {
                            f.push(&format!("{name}_sum"), num(sum));
                        }
                    }
                    OpenMetricsValue::Info => {}
                }
            }
        }
    } else {
        let exp = openmetrics_parser::prometheus::parse_prometheus(text)
            .map_err(|e| MetricsError::NotPrometheus(e.to_string()))?;
        for (name, fam) in exp.families {
            let labels = fam.get_label_names().to_vec();
            for s in fam.iter_samples() {
                f.keep_info(&name, &labels, s.get_labelset().ok());
                match &s.value {
                    PrometheusValue::Gauge(n) | PrometheusValue::Unknown(n) => {
                        f.push(&name, num(n))
                    }
                    PrometheusValue::Counter(c) => f.push(&name, num(&c.value)),
                    PrometheusValue::Histogram(h) => {
                        if let Some(sum) = &h.sum {
                            f.push(&format!("{name}_sum"), num(sum));
                        }
                    }
                    PrometheusValue::Summary(sv) => {
                        if let Some(sum) = &sv.sum {
                            f.push(&format!("{name}_sum"), num(sum));
                        }
                    }
                }
            }
        }
    }
    Ok(f)
}

fn detect(f: &Families) -> Option<EngineKind> {
    let has = |p: &str| f.0.keys().any(|k| k.starts_with(p));
    [
        ("vllm:", EngineKind::Vllm),
        ("sglang:", EngineKind::Sglang),
        ("tgi_", EngineKind::Tgi),
        ("llamacpp:", EngineKind::LlamaCpp),
        ("envelope:", EngineKind::Envelope),
    ]
    .into_iter()
    .find(|(p, _)| has(p))
    .map(|(_, k)| k)
}

/// Reads one field: counts are summed over label sets, ratios take the
/// largest (the most loaded engine of a data-parallel group).
struct Reader<'a> {
    f: &'a Families,
    rejected: Vec<String>,
}

impl Reader<'_> {
    fn valid(&mut self, name: &str, vs: &[f64], max: Option<f64>) -> bool {
        let ok = vs
            .iter()
            .all(|v| v.is_finite() && *v >= 0.0 && max.is_none_or(|m| *v <= m + 1e-9));
        if !ok {
            self.rejected.push(name.to_string());
        }
        ok
    }
    fn sum(&mut self, names: &[&str]) -> Option<f64> {
        let (name, vs) = names
            .iter()
            .find_map(|n| self.f.get(n).map(|v| (*n, v.clone())))?;
        self.valid(name, &vs, None).then(|| vs.iter().sum())
    }
    fn ratio(&mut self, names: &[&str]) -> Option<f64> {
        let (name, vs) = names
            .iter()
            .find_map(|n| self.f.get(n).map(|v| (*n, v.clone())))?;
        self.valid(name, &vs, Some(1.0))
            .then(|| vs.iter().copied().fold(0.0, f64::max))
    }
}

/// Maps Prometheus text from a known engine to an [`EngineState`].
pub fn parse_engine_state(text: &str) -> Result<EngineState, MetricsError> {
    let f = parse_families(text)?;
    let engine = detect(&f).ok_or(MetricsError::UnknownEngine)?;
    let mut r = Reader {
        f: &f,
        rejected: vec![],
    };
    let (
        running,
        waiting,
        kv_usage,
        preemptions_total,
        prompt_tokens_total,
        generation_tokens_total,
    ) = match engine {
        EngineKind::Vllm | EngineKind::Envelope => {
            let p = if engine == EngineKind::Vllm {
                "vllm"
            } else {
                "envelope"
            };
            let n = |s: &str| format!("{p}:{s}");
            (
                r.sum(&[&n("num_requests_running")]),
                r.sum(&[&n("num_requests_waiting")]),
                r.ratio(&[&n("kv_cache_usage_perc"), &n("gpu_cache_usage_perc")]),
                r.sum(&[&n("num_preemptions_total")]),
                r.sum(&[&n("prompt_tokens_total")]),
                r.sum(&[&n("generation_tokens_total")]),
            )
        }
        EngineKind::Sglang => (
            r.sum(&["sglang:num_running_reqs"]),
            r.sum(&["sglang:num_queue_reqs"]),
            r.ratio(&["sglang:token_usage"]),
            None,
            r.sum(&["sglang:prompt_tokens_total"]),
            r.sum(&["sglang:generation_tokens_total"]),
        ),
        EngineKind::Tgi => {
            let used = r.sum(&["tgi_batch_current_max_tokens"]);
            let total = r.sum(&["tgi_batch_max_total_tokens"]);
            let kv = match (used, total) {
                (Some(u), Some(t)) if t > 0.0 && u <= t => Some(u / t),
                (Some(_), Some(_)) => {
                    r.rejected.push("tgi_batch_current_max_tokens".into());
                    None
                }
                _ => None,
            };
            (
                r.sum(&["tgi_batch_current_size"]),
                r.sum(&["tgi_queue_size"]),
                kv,
                None,
                r.sum(&["tgi_request_input_length_sum"]),
                r.sum(&["tgi_request_generated_tokens_sum"]),
            )
        }
        EngineKind::LlamaCpp => (
            r.sum(&["llamacpp:requests_processing"]),
            r.sum(&["llamacpp:requests_deferred"]),
            r.ratio(&["llamacpp:kv_cache_usage_ratio"]),
            None,
            r.sum(&["llamacpp:prompt_tokens_total"]),
            r.sum(&["llamacpp:tokens_predicted_total"]),
        ),
    };
    // vLLM states its cache in the labels of cache_config_info: the size in
    // tokens where it says so, else blocks x block size.
    let info = "vllm:cache_config_info";
    let vllm_tokens = || {
        f.info_number(info, "kv_cache_size_tokens").or_else(|| {
            Some(f.info_number(info, "num_gpu_blocks")? * f.info_number(info, "block_size")?)
        })
    };
    let kv_capacity_tokens = match engine {
        EngineKind::Envelope => r.sum(&["envelope:kv_cache_capacity_tokens"]),
        EngineKind::Tgi => r.sum(&["tgi_batch_max_total_tokens"]),
        EngineKind::Vllm => vllm_tokens(),
        _ => None,
    };
    let (kv_bytes_per_token, prefix_caching, prefix_cache_queries_total, prefix_cache_hits_total) =
        match engine {
            // With --num-gpu-blocks-override the memory label is still the
            // space configured, not what the overridden blocks hold: then
            // bytes a token are not stated.
            EngineKind::Vllm if f.info_number(info, "num_gpu_blocks_override").is_none() => (
                f.info_number(info, "kv_cache_memory_bytes")
                    .zip(kv_capacity_tokens)
                    .map(|(b, t)| b / t),
                f.info_bool(info, "enable_prefix_caching"),
                r.sum(&["vllm:prefix_cache_queries_total"]),
                r.sum(&["vllm:prefix_cache_hits_total"]),
            ),
            EngineKind::Vllm => (
                None,
                f.info_bool(info, "enable_prefix_caching"),
                r.sum(&["vllm:prefix_cache_queries_total"]),
                r.sum(&["vllm:prefix_cache_hits_total"]),
            ),
            _ => (None, None, None, None),
        };
    let kv_block_size = match engine {
        EngineKind::Vllm => f.info_number(info, "block_size"),
        _ => None,
    };
    Ok(EngineState {
        kv_capacity_tokens,
        kv_block_size,
        kv_bytes_per_token,
        prefix_caching,
        prefix_cache_queries_total,
        prefix_cache_hits_total,
        engine,
        fetched_unix_ms: crate::unix_ms(),
        running,
        waiting,
        kv_usage,
        preemptions_total,
        prompt_tokens_total,
        generation_tokens_total,
        rejected: r.rejected,
    })
}

/// GETs `url` (a `/metrics` endpoint) and parses it.
pub async fn fetch_engine_state(url: &str, timeout: Duration) -> Result<EngineState, MetricsError> {
    parse_engine_state(&MetricsClient::new(url, timeout)?.text().await?)
}

/// One `/metrics` endpoint fetched again and again on one connection pool
/// (a poller at 50 ms should not open a connection per scrape).
#[derive(Debug, Clone)]
pub struct MetricsClient {
    client: reqwest::Client,
    url: String,
}

impl MetricsClient {
    /// Each fetch gives up after `timeout`.
    pub fn new(url: &str, timeout: Duration) -> Result<MetricsClient, MetricsError> {
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| MetricsError::Unreachable {
                url: url.to_string(),
                message: e.to_string(),
            })?;
        Ok(MetricsClient {
            client,
            url: url.to_string(),
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// The page as it is, for a caller that passes it on or parses it.
    pub async fn text(&self) -> Result<String, MetricsError> {
        let url = &self.url;
        let unreachable = |e: reqwest::Error| MetricsError::Unreachable {
            url: url.to_string(),
            message: e.to_string(),
        };
        let resp = self.client.get(url).send().await.map_err(unreachable)?;
        let status = resp.status().as_u16();
        if status != 200 {
            let body = resp.text().await.unwrap_or_default();
            return Err(MetricsError::Http {
                url: url.to_string(),
                status,
                said: what_it_said(&body),
            });
        }
        resp.text().await.map_err(unreachable)
    }
}

/// The message of an error answer, as `: message`: an OpenAI-shaped
/// `error.message` (or a top-level `message`), else the body's first line;
/// at most 200 characters, and empty when there is none.
fn what_it_said(body: &str) -> String {
    let json: Option<serde_json::Value> = serde_json::from_str(body).ok();
    let message = json
        .as_ref()
        .and_then(|v| v["error"]["message"].as_str().or(v["message"].as_str()))
        .map(str::to_string)
        .or_else(|| {
            body.lines()
                .map(str::trim)
                .find(|l| !l.is_empty())
                .map(str::to_string)
        })
        .unwrap_or_default();
    let message: String = message.chars().take(200).collect();
    if message.is_empty() {
        message
    } else {
        format!(": {message}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM 0.32.0's CPU build, 2026-12-06: what it says of its cache and
    /// its prefix cache (labels trimmed to those read).
    const VLLM_CACHE: &str = r#"# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.25
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="smollm2"} 37.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="smollm2"} 5.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",enable_prefix_caching="True",engine="0",kv_cache_memory_bytes="1073741824",kv_cache_size_tokens="23296",num_gpu_blocks="182",num_gpu_blocks_override="None"} 1.0
"#;

    #[test]
    fn vllm_states_its_cache_in_labels_and_its_prefix_hits_in_counters() {
        let s = parse_engine_state(VLLM_CACHE).unwrap();
        assert_eq!(s.engine, EngineKind::Vllm);
        assert_eq!(s.kv_capacity_tokens, Some(23296.0));
        assert_eq!(s.kv_block_size, Some(128.0));
        // 1 GiB over 23,296 tokens: 30 layers x 3 KV heads x 64 dims x 2 x 4 bytes, rounded up by the blocks.
        assert!(
            (s.kv_bytes_per_token.unwrap() - 46_091.0).abs() < 1.0,
            "{s:?}"
        );
        assert_eq!(s.prefix_caching, Some(true));
        assert_eq!(s.prefix_cache_queries_total, Some(37.0));
        assert_eq!(s.prefix_cache_hits_total, Some(5.0));
        // Blocks overridden: the size holds, the memory label does not.
        let overridden = VLLM_CACHE
            .replace(
                "kv_cache_size_tokens=\"23296\"",
                "kv_cache_size_tokens=\"2048\"",
            )
            .replace(
                "num_gpu_blocks_override=\"None\"",
                "num_gpu_blocks_override=\"16\"",
            );
        let s = parse_engine_state(&overridden).unwrap();
        assert_eq!(
            (s.kv_capacity_tokens, s.kv_bytes_per_token),
            (Some(2048.0), None)
        );
        // An older vLLM without kv_cache_size_tokens: blocks x block size.
        let older = VLLM_CACHE.replace("kv_cache_size_tokens=\"23296\",", "");
        assert_eq!(
            parse_engine_state(&older).unwrap().kv_capacity_tokens,
            Some(23296.0)
        );
        // Other engines state none of it.
        let s = parse_engine_state("llamacpp:requests_processing 1\n").unwrap();
        assert_eq!(
            (s.kv_capacity_tokens, s.prefix_cache_hits_total),
            (None, None)
        );
    }

    use super::what_it_said;

    #[test]
    fn what_an_error_body_said() {
        assert_eq!(
            what_it_said(r#"{"error":{"code":404,"message":"File Not Found"}}"#),
            ": File Not Found"
        );
        assert_eq!(what_it_said(r#"{"message":"no"}"#), ": no");
        assert_eq!(
            what_it_said("\n  404 page not found\nmore"),
            ": 404 page not found"
        );
        assert_eq!(what_it_said(""), "");
        assert_eq!(what_it_said(&"x".repeat(500)).len(), 2 + 200);
    }
}
