//! The two [`Driver`]s: the embedded engine in this process, and any
//! OpenAI-compatible server over HTTP (streaming `/v1/completions`, timed per
//! SSE chunk, with the server's `/metrics` read through envelope-telemetry).

use crate::record::{Driver, LoadRequest, RequestRecord, Snapshot};
use crate::truth::{error, reason};
use envelope_engine::{EngineHandle, Event, GenerateRequest, SamplingParams};
use std::io::{BufRead, BufReader};
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// After a `/metrics` answer that says the server exports none (404, or
/// llama.cpp's 501 without `--metrics`), the next ask waits this long: a
/// monitor polling every 50 ms asked llama-cpp-python's server 3,408
/// times in 3 minutes.
pub const METRICS_ABSENT_RETRY: Duration = Duration::from_secs(30);

/// The embedded engine, in process.
pub struct EngineDriver {
    pub engine: EngineHandle,
}

impl Driver for EngineDriver {
    fn in_process(&self) -> bool {
        true
    }

    fn vocab_size(&self) -> usize {
        self.engine.info.model.config.vocab_size
    }

    fn tokenize(&self, text: &str) -> Option<Vec<u32>> {
        self.engine.tokenizer.encode(text).ok()
    }

    fn send(&self, req: &LoadRequest, t0: Instant, rec: &mut RequestRecord) {
        let g = GenerateRequest {
            prompt_tokens: req.prompt_tokens.clone(),
            params: SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(req.output_tokens as usize)
            },
        };
        let mut rx = match self.engine.submit(g) {
            Ok(rx) => rx,
            Err(e) => {
                rec.error = Some(error(reason::ENGINE_ERROR, e));
                return;
            }
        };
        let mut last = t0;
        loop {
            match rx.blocking_recv() {
                Some(Event::Token { at, .. }) => {
                    note_token(rec, t0, &mut last, at);
                }
                Some(Event::Done {
                    preemptions,
                    reason,
                    ..
                }) => {
                    rec.preemptions = preemptions;
                    rec.finish_reason = Some(reason.as_str().to_string());
                    return;
                }
                Some(Event::Error(e)) => {
                    rec.error = Some(error(reason::ENGINE_ERROR, e));
                    return;
                }
                None => {
                    rec.error = Some(error(reason::ENGINE_ERROR, "the engine stopped"));
                    return;
                }
            }
        }
    }

    fn snapshot(&self) -> Snapshot {
        let m = &self.engine.metrics;
        Snapshot {
            kv_usage: Some(m.kv_usage()),
            preemptions_total: Some(m.preemptions_total.load(Ordering::Relaxed)),
            memory_bytes: envelope_telemetry::host::sample(None).process_rss_bytes,
            // The embedded engine shares no KV blocks between prompts.
            prefix_cache: None,
        }
    }
}

fn note_token(rec: &mut RequestRecord, t0: Instant, last: &mut Instant, at: Instant) {
    if rec.ttft_s.is_none() {
        rec.ttft_s = Some(at.duration_since(t0).as_secs_f64());
    } else {
        rec.itl_s.push(at.duration_since(*last).as_secs_f64());
    }
    *last = at;
    rec.output_tokens += 1;
}

/// How prompts travel to an HTTP server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptFormat {
    /// Token ids (`"prompt": [1, 2, ...]`): exact lengths (vLLM, SGLang,
    /// llama.cpp, envelope serve).
    Tokens,
    /// Text of one short word per token: lengths approximate, for servers
    /// that take only text.
    Text,
}

/// An OpenAI-compatible server.
pub struct HttpDriver {
    client: reqwest::blocking::Client,
    base_url: String,
    completions_url: String,
    metrics_url: Option<String>,
    model: String,
    vocab_size: usize,
    prompt_format: PromptFormat,
    extra_body: serde_json::Map<String, serde_json::Value>,
    /// Whether an answer short of the asked length is an error (the server
    /// honours `ignore_eos`); see [`crate::truth::check_server`].
    exact_output: bool,
    /// The server's process, when the harness launched it (for its RSS).
    pub pid: Option<u32>,
    nvml: Option<envelope_telemetry::gpu::Nvml>,
    metrics_absent: Mutex<Option<MetricsAbsent>>,
}

/// The server said it has no `/metrics`.
#[derive(Debug, Clone)]
struct MetricsAbsent {
    status: u16,
    retry_at: Instant,
}

pub struct HttpSettings {
    pub base_url: String,
    pub model: String,
    pub metrics_url: Option<String>,
    pub vocab_size: usize,
    pub prompt_format: PromptFormat,
    pub extra_body: serde_json::Map<String, serde_json::Value>,
    pub request_timeout: Duration,
}

impl HttpDriver {
    pub fn new(s: HttpSettings) -> Result<HttpDriver, String> {
        let client = reqwest::blocking::Client::builder()
            .timeout(s.request_timeout)
            .pool_max_idle_per_host(1024)
            .build()
            .map_err(|e| format!("HTTP client: {e}"))?;
        Ok(HttpDriver {
            client,
            base_url: s.base_url.trim_end_matches('/').to_string(),
            completions_url: format!("{}/v1/completions", s.base_url.trim_end_matches('/')),
            metrics_url: s.metrics_url,
            model: s.model,
            vocab_size: s.vocab_size,
            prompt_format: s.prompt_format,
            extra_body: s.extra_body,
            exact_output: true,
            pid: None,
            nvml: envelope_telemetry::gpu::Nvml::init().ok(),
            metrics_absent: Mutex::new(None),
        })
    }

    pub fn prompt_format(&self) -> PromptFormat {
        self.prompt_format
    }

    pub fn set_prompt_format(&mut self, f: PromptFormat) {
        self.prompt_format = f;
    }

    pub fn set_exact_output(&mut self, exact: bool) {
        self.exact_output = exact;
    }

    fn body(&self, req: &LoadRequest) -> serde_json::Value {
        let prompt = match (&req.prompt_text, self.prompt_format) {
            (Some(text), _) => serde_json::json!(text),
            (None, PromptFormat::Tokens) => serde_json::json!(req.prompt_tokens),
            (None, PromptFormat::Text) => serde_json::json!(req
                .prompt_tokens
                .iter()
                .map(|t| WORDS[*t as usize % WORDS.len()])
                .collect::<Vec<_>>()
                .join(" ")),
        };
        let mut body = serde_json::json!({
            "model": self.model,
            "prompt": prompt,
            "max_tokens": req.output_tokens,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
            "ignore_eos": true,
        });
        if let Some(obj) = body.as_object_mut() {
            for (k, v) in &self.extra_body {
                obj.insert(k.clone(), v.clone());
            }
        }
        body
    }

    fn stream(
        &self,
        req: &LoadRequest,
        t0: Instant,
        rec: &mut RequestRecord,
    ) -> Result<(), String> {
        let body = self.body(req);
        let resp = send(|| self.client.post(&self.completions_url).json(&body))
            .map_err(|e| error(reason::REQUEST_FAILED, e))?;
        let status = resp.status();
        rec.governed = resp
            .headers()
            .keys()
            .any(|k| k.as_str().starts_with("x-envelope-"));
        if !status.is_success() {
            let retry_after = retry_after_s(resp.headers());
            let text = resp.text().unwrap_or_default();
            if let (429, Some(s)) = (status.as_u16(), retry_after) {
                rec.retry_after_s = Some(s);
                return Err(error(
                    reason::REFUSED,
                    format!("HTTP 429, retry after {s} s: {}", first_line(&text)),
                ));
            }
            return Err(error(
                &format!("http_{}", status.as_u16()),
                format!("HTTP {}: {}", status.as_u16(), first_line(&text)),
            ));
        }
        let mut last = t0;
        let mut usage_tokens = None;
        let mut done = false;
        for line in BufReader::new(resp).lines() {
            let line = line.map_err(|e| error(reason::STREAM_CUT, format!("stream broke: {e}")))?;
            let Some(data) = line.strip_prefix("data:").map(str::trim) else {
                continue;
            };
            if data == "[DONE]" {
                done = true;
                break;
            }
            let v: serde_json::Value =
                serde_json::from_str(data).map_err(|e| error(reason::BAD_SSE, e))?;
            if let Some(e) = v.get("error") {
                return Err(error(reason::SERVER_ERROR, format!("mid-stream: {e}")));
            }
            if let Some(f) = v
                .pointer("/choices/0/finish_reason")
                .and_then(|f| f.as_str())
            {
                rec.finish_reason = Some(f.to_string());
            }
            if let Some(n) = v
                .pointer("/usage/completion_tokens")
                .and_then(|n| n.as_u64())
            {
                usage_tokens = Some(n as u32);
            }
            if let Some(n) = v.pointer("/usage/prompt_tokens").and_then(|n| n.as_u64()) {
                rec.input_tokens = n as u32;
            }
            if let Some(n) = v
                .pointer("/usage/prompt_tokens_details/cached_tokens")
                .and_then(|n| n.as_u64())
            {
                rec.cached_tokens = Some(n as u32);
            }
            let has_text = v
                .pointer("/choices/0/text")
                .and_then(|t| t.as_str())
                .is_some_and(|t| !t.is_empty());
            if has_text {
                note_token(rec, t0, &mut last, Instant::now());
            }
        }
        if !done {
            return Err(error(
                reason::STREAM_CUT,
                format!("ended without [DONE] after {} tokens", rec.output_tokens),
            ));
        }
        // A chunk can carry several tokens; the usage count is the truth.
        if let Some(n) = usage_tokens {
            rec.output_tokens = n;
        }
        Ok(())
    }

    /// The JSON a GET of `path` on the server answers; `None` for anything
    /// else (an error status, no answer within 10 s, not JSON).
    pub fn get_json(&self, path: &str) -> Option<serde_json::Value> {
        let url = format!("{}{path}", self.base_url);
        let resp = send(|| self.client.get(&url).timeout(Duration::from_secs(10))).ok()?;
        if !resp.status().is_success() {
            return None;
        }
        resp.json().ok()
    }

    /// The server's `usage.prompt_tokens` for `text` sent as the prompt of a
    /// one-token, non-streaming completion.
    pub fn count_prompt(&self, text: &str) -> Result<u32, String> {
        let body = serde_json::json!({
            "model": self.model,
            "prompt": text,
            "max_tokens": 1,
            "temperature": 0,
        });
        let resp = send(|| self.client.post(&self.completions_url).json(&body))
            .map_err(|e| e.to_string())?;
        let status = resp.status();
        let v: serde_json::Value = resp.json().map_err(|e| e.to_string())?;
        if !status.is_success() {
            return Err(format!("HTTP {}: {v}", status.as_u16()));
        }
        v.pointer("/usage/prompt_tokens")
            .and_then(serde_json::Value::as_u64)
            .map(|n| n as u32)
            .ok_or_else(|| "the answer has no usage.prompt_tokens".into())
    }

    /// The server's metrics now; `None` when it has none, cannot be
    /// reached, or said within [`METRICS_ABSENT_RETRY`] that it exports
    /// none (then it is not asked again before).
    pub fn metrics(&self) -> Option<envelope_telemetry::EngineState> {
        let url = self.metrics_url.as_ref()?;
        let lock = || {
            self.metrics_absent
                .lock()
                .unwrap_or_else(|e| e.into_inner())
        };
        if lock().as_ref().is_some_and(|a| Instant::now() < a.retry_at) {
            return None;
        }
        let resp = send(|| self.client.get(url).timeout(Duration::from_secs(2))).ok()?;
        let status = resp.status().as_u16();
        if matches!(status, 404 | 501) {
            *lock() = Some(MetricsAbsent {
                status,
                retry_at: Instant::now() + METRICS_ABSENT_RETRY,
            });
            return None;
        }
        let text = resp.text().ok()?;
        envelope_telemetry::engine_state::parse_engine_state(&text).ok()
    }

    /// Where the server said it exports no metrics, in words (for the log
    /// and the report, once).
    pub fn metrics_absent(&self) -> Option<String> {
        let a = self
            .metrics_absent
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let (url, a) = (self.metrics_url.as_deref()?, a.as_ref()?);
        Some(format!(
            "the server exports no metrics ({url} answered HTTP {}): KV use, preemptions and prefix-cache hits are not measured; asked again at most every {} s",
            a.status,
            METRICS_ABSENT_RETRY.as_secs()
        ))
    }
}

/// Sends the request `build` makes; once more if it failed with no answer
/// and no timeout: a kept-alive connection the server closed as the
/// request went out (llama.cpp's server closes every connection after a
/// streamed answer, though its headers say keep-alive).
fn send(
    build: impl Fn() -> reqwest::blocking::RequestBuilder,
) -> reqwest::Result<reqwest::blocking::Response> {
    match build().send() {
        Err(e) if !e.is_timeout() => build().send(),
        r => r,
    }
}

/// The wait a refusal asks for: `retry-after-ms`, else `Retry-After` in
/// seconds (the forms the OpenAI clients honour).
fn retry_after_s(h: &reqwest::header::HeaderMap) -> Option<f64> {
    let num = |name: &str| h.get(name)?.to_str().ok()?.trim().parse::<f64>().ok();
    num("retry-after-ms")
        .map(|ms| ms / 1e3)
        .or_else(|| num("retry-after"))
        .filter(|s| s.is_finite() && *s >= 0.0)
}

fn first_line(s: &str) -> &str {
    let l = s.lines().next().unwrap_or("");
    &l[..l.len().min(300)]
}

/// Words that most BPE vocabularies keep whole, for text prompts.
const WORDS: [&str; 16] = [
    "the", "house", "river", "green", "table", "light", "water", "stone", "music", "paper",
    "north", "horse", "bread", "glass", "cloud", "field",
];

impl Driver for HttpDriver {
    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn send(&self, req: &LoadRequest, t0: Instant, rec: &mut RequestRecord) {
        if let Err(e) = self.stream(req, t0, rec) {
            rec.error = Some(e);
        }
    }

    fn snapshot(&self) -> Snapshot {
        let state = self.metrics();
        let memory_bytes = match (&self.nvml, self.pid) {
            (Some(n), _) if n.device_count() > 0 => n.sample(0, None).memory_used_bytes,
            (_, Some(pid)) => envelope_telemetry::host::sample(Some(pid)).process_rss_bytes,
            _ => None,
        };
        Snapshot {
            kv_usage: state.as_ref().and_then(|s| s.kv_usage),
            preemptions_total: state
                .as_ref()
                .and_then(|s| s.preemptions_total)
                .map(|p| p as u64),
            memory_bytes,
            prefix_cache: state.as_ref().and_then(|s| {
                Some(crate::record::PrefixCache {
                    queries: s.prefix_cache_queries_total?,
                    hits: s.prefix_cache_hits_total?,
                })
            }),
        }
    }

    fn monitor_interval(&self) -> Duration {
        Duration::from_millis(50)
    }

    fn exact_output(&self) -> bool {
        self.exact_output
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::{HeaderMap, HeaderValue};
    use std::sync::Arc;

    /// A loopback server that answers every request with `status`,
    /// counting them.
    fn answering(status: u16) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let h = hits.clone();
        std::thread::spawn(move || {
            for mut conn in listener.incoming().flatten() {
                let mut buf = [0u8; 4096];
                let _ = conn.read(&mut buf);
                h.fetch_add(1, Ordering::SeqCst);
                let _ = write!(
                    conn,
                    "HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                );
            }
        });
        (format!("http://{addr}"), hits)
    }

    fn driver_for(base_url: &str) -> HttpDriver {
        HttpDriver::new(HttpSettings {
            base_url: base_url.into(),
            model: "m".into(),
            metrics_url: Some(format!("{base_url}/metrics")),
            vocab_size: 100,
            prompt_format: PromptFormat::Tokens,
            extra_body: Default::default(),
            request_timeout: Duration::from_secs(5),
        })
        .unwrap()
    }

    #[test]
    fn a_server_without_metrics_is_asked_once_per_30_seconds_and_said_once() {
        for status in [404, 501] {
            let (url, hits) = answering(status);
            let d = driver_for(&url);
            for _ in 0..50 {
                assert!(d.snapshot().kv_usage.is_none());
            }
            assert_eq!(hits.load(Ordering::SeqCst), 1, "HTTP {status}");
            let said = d.metrics_absent().unwrap();
            assert!(said.contains(&format!("HTTP {status}")), "{said}");
            assert!(said.contains("every 30 s"), "{said}");
        }
        // Any other failure (a 500, say) is asked again at once: it may pass.
        let (url, hits) = answering(500);
        let d = driver_for(&url);
        for _ in 0..5 {
            assert!(d.snapshot().kv_usage.is_none());
        }
        assert_eq!(hits.load(Ordering::SeqCst), 5);
        assert!(d.metrics_absent().is_none());
    }

    #[test]
    fn a_refusal_asks_for_its_wait_in_either_header() {
        let mut h = HeaderMap::new();
        assert_eq!(retry_after_s(&h), None);
        h.insert("retry-after", HeaderValue::from_static("2"));
        assert_eq!(retry_after_s(&h), Some(2.0));
        // The OpenAI clients read retry-after-ms first.
        h.insert("retry-after-ms", HeaderValue::from_static("250"));
        assert_eq!(retry_after_s(&h), Some(0.25));
        h.clear();
        // An HTTP date or garbage is no number of seconds.
        h.insert("retry-after", HeaderValue::from_static("soon"));
        assert_eq!(retry_after_s(&h), None);
    }
}
