//! Request traces: what a node was asked, one request a record, with no
//! prompt text. The project's own format is JSON lines of [`TraceRequest`]
//! (`envelope govern --record` writes it; its JSON Schema is committed as
//! `profiles/schema/trace.schema.json`). Readers take it and the two public
//! formats the peers replay: Mooncake's JSON lines (`timestamp` in ms,
//! `input_length`, `output_length`, `hash_ids` of 512-token blocks) and
//! BurstGPT's CSV (`Timestamp` in s, `Request tokens`, `Response tokens`,
//! ...). Every reader gives a [`Trace`]: requests sorted by arrival, the
//! first at 0 s. Errors name the file, the line and the field.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TraceRequest {
    /// Arrival, in seconds on any clock (the governor writes Unix time);
    /// readers shift the trace so its first request arrives at 0.
    pub t_s: f64,
    /// Prompt tokens (as counted where the trace was taken).
    pub input_tokens: u32,
    /// Output tokens the answer had; for a request refused or failed
    /// before an answer, the client's limit (`max_tokens`; 0 when it set
    /// none).
    pub output_tokens: u32,
    /// The session (conversation, agent run) the request belongs to: a
    /// session's requests are sent in order, each after the one before
    /// it has ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// One id per block of the prompt from its start, each a salted hash
    /// of the block and every block before it: equal ids at the same place
    /// are the same prefix. Empty: nothing known of shared prefixes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prefix_blocks: Vec<u64>,
    /// Prompt tokens a block spans (512 in Mooncake's traces); required
    /// with `prefix_blocks`. The last block may be partial.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_tokens: Option<u32>,
    /// The priority class, tenant and feature the governor placed it in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feature: Option<String>,
    /// The model asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The client asked for a stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// What the client got: HTTP status, time to the first token and to
    /// the end, in ms (taken where the trace was recorded; a replay
    /// measures its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e2e_ms: Option<f64>,
    /// Model tiers: how the call was routed (`envelope govern --tiers`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tiers: Option<TierCall>,
}

/// A call routed across model tiers: where it started, which tier
/// answered, why, and what it cost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TierCall {
    pub start_tier: String,
    /// The tier that answered (or refused last).
    pub tier: String,
    /// The routing rule or hint that chose the start tier.
    pub reason: String,
    /// `ok`, `cached`, `refused` or `error`.
    pub outcome: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_from: Option<String>,
    /// The check that escalated the call, if one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub escalated: Option<String>,
    pub cost: f64,
    pub tiers_version: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prices_version: Option<String>,
}

/// A trace: requests sorted by arrival, the first at 0 s.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Trace {
    /// A name for reports: the file's stem.
    pub name: String,
    pub requests: Vec<TraceRequest>,
}

/// The formats read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceFormat {
    /// JSON lines of [`TraceRequest`].
    Envelope,
    /// Mooncake's JSON lines.
    Mooncake,
    /// BurstGPT's CSV.
    BurstGpt,
}

impl TraceFormat {
    /// `envelope`, `mooncake` or `burstgpt`.
    ///
    /// # Errors
    /// Any other name.
    pub fn parse(s: &str) -> Result<TraceFormat, String> {
        match s {
            "envelope" => Ok(TraceFormat::Envelope),
            "mooncake" => Ok(TraceFormat::Mooncake),
            "burstgpt" => Ok(TraceFormat::BurstGpt),
            o => Err(format!(
                "trace format `{o}` is not one of envelope, mooncake, burstgpt"
            )),
        }
    }

    /// The format of `text` read from `path`: CSV by its extension; JSON
    /// lines by the keys of the first record (`input_length` is
    /// Mooncake's, `input_tokens` ours).
    pub fn detect(path: &str, text: &str) -> Option<TraceFormat> {
        if path.to_ascii_lowercase().ends_with(".csv") {
            return Some(TraceFormat::BurstGpt);
        }
        let first = text.lines().find(|l| !l.trim().is_empty())?;
        let v: serde_json::Value = serde_json::from_str(first).ok()?;
        if v.get("input_length").is_some() {
            Some(TraceFormat::Mooncake)
        } else if v.get("input_tokens").is_some() {
            Some(TraceFormat::Envelope)
        } else {
            None
        }
    }
}

/// Mooncake's block size: prompt tokens per hash id.
pub const MOONCAKE_BLOCK_TOKENS: u32 = 512;

#[derive(Deserialize)]
struct MooncakeLine {
    timestamp: f64,
    input_length: u32,
    output_length: u32,
    #[serde(default)]
    hash_ids: Vec<u64>,
}

impl Trace {
    /// Reads `path` in `format` (detected when `None`).
    ///
    /// # Errors
    /// The file unreadable, its format unknown, a bad record (by line and
    /// field), or no requests.
    pub fn read(path: &str, format: Option<TraceFormat>) -> Result<Trace, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
        let format = match format.or_else(|| TraceFormat::detect(path, &text)) {
            Some(f) => f,
            None => {
                return Err(format!(
                "{path}: the trace format is neither BurstGPT's CSV (by extension) nor JSON lines with `input_tokens` (ours) or `input_length` (Mooncake's); name it"
            ))
            }
        };
        let name = std::path::Path::new(path)
            .file_stem()
            .map_or_else(|| "trace".into(), |s| s.to_string_lossy().into_owned());
        Trace::parse(&name, &text, format).map_err(|e| format!("{path}: {e}"))
    }

    /// Reads `text` in `format`.
    ///
    /// # Errors
    /// As [`Trace::read`], without the path.
    pub fn parse(name: &str, text: &str, format: TraceFormat) -> Result<Trace, String> {
        let requests = match format {
            TraceFormat::Envelope => json_lines::<TraceRequest>(text)?,
            TraceFormat::Mooncake => json_lines::<MooncakeLine>(text)?
                .into_iter()
                .map(|m| TraceRequest {
                    block_tokens: (!m.hash_ids.is_empty()).then_some(MOONCAKE_BLOCK_TOKENS),
                    prefix_blocks: m.hash_ids,
                    ..TraceRequest::new(m.timestamp / 1e3, m.input_length, m.output_length)
                })
                .collect(),
            TraceFormat::BurstGpt => burstgpt(text)?,
        };
        Trace::new(name, requests)
    }

    /// A trace of `requests`, validated, sorted and shifted to start at 0.
    ///
    /// # Errors
    /// No requests; a time that is not finite; prefix blocks without a
    /// block size.
    pub fn new(name: &str, mut requests: Vec<TraceRequest>) -> Result<Trace, String> {
        if requests.is_empty() {
            return Err("the trace has no requests".into());
        }
        for (i, r) in requests.iter().enumerate() {
            if !r.t_s.is_finite() {
                return Err(format!("request {}: t_s is not a number", i + 1));
            }
            if !r.prefix_blocks.is_empty() && r.block_tokens.is_none_or(|b| b == 0) {
                return Err(format!(
                    "request {}: prefix_blocks need block_tokens (> 0)",
                    i + 1
                ));
            }
        }
        requests.sort_by(|a, b| a.t_s.total_cmp(&b.t_s));
        let t0 = requests[0].t_s;
        for r in &mut requests {
            r.t_s -= t0;
        }
        Ok(Trace {
            name: name.into(),
            requests,
        })
    }

    /// Seconds from the first arrival to the last.
    pub fn span_s(&self) -> f64 {
        self.requests.last().map_or(0.0, |r| r.t_s)
    }

    /// Requests per session, in arrival order (`None` for requests of no
    /// session, each on its own).
    pub fn sessions(&self) -> BTreeMap<&str, Vec<usize>> {
        let mut out: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, r) in self.requests.iter().enumerate() {
            if let Some(s) = &r.session {
                out.entry(s.as_str()).or_default().push(i);
            }
        }
        out
    }
}

impl TraceRequest {
    /// A request with only its time and sizes.
    pub fn new(t_s: f64, input_tokens: u32, output_tokens: u32) -> TraceRequest {
        TraceRequest {
            t_s,
            input_tokens,
            output_tokens,
            session: None,
            prefix_blocks: vec![],
            block_tokens: None,
            class: None,
            tenant: None,
            feature: None,
            model: None,
            stream: None,
            status: None,
            ttft_ms: None,
            e2e_ms: None,
            tiers: None,
        }
    }
}

/// Records of JSON lines, blank lines skipped; errors name the line. A
/// last line cut short with no newline after it (a record the governor was
/// still writing when the file was read) is left out; cut short anywhere
/// else, or malformed, a line is an error.
fn json_lines<T: serde::de::DeserializeOwned>(text: &str) -> Result<Vec<T>, String> {
    let last = text.lines().count();
    let unterminated = !text.ends_with('\n');
    let mut out = vec![];
    for (i, l) in text.lines().enumerate() {
        if l.trim().is_empty() {
            continue;
        }
        match serde_json::from_str(l) {
            Ok(r) => out.push(r),
            Err(e) if e.is_eof() && unterminated && i + 1 == last => {}
            Err(e) => return Err(format!("line {}: {e}", i + 1)),
        }
    }
    Ok(out)
}

/// BurstGPT's CSV: `Timestamp` (s), `Request tokens`, `Response tokens`,
/// with `Model` and `Log Type` kept as the model and class. Rows with 0
/// response tokens are the failures of the files "with fails": kept, with
/// status 500, so a replay sends them (they were offered load).
fn burstgpt(text: &str) -> Result<Vec<TraceRequest>, String> {
    let mut rd = csv::ReaderBuilder::new()
        .trim(csv::Trim::All)
        .from_reader(text.as_bytes());
    let headers = rd.headers().map_err(|e| format!("line 1: {e}"))?.clone();
    let col = |name: &str| {
        headers
            .iter()
            .position(|h| h == name)
            .ok_or_else(|| format!("line 1: no `{name}` column"))
    };
    let (t, req, resp) = (
        col("Timestamp")?,
        col("Request tokens")?,
        col("Response tokens")?,
    );
    let (model, log_type) = (col("Model").ok(), col("Log Type").ok());
    let mut out = vec![];
    for (i, row) in rd.records().enumerate() {
        let line = i + 2;
        let row = row.map_err(|e| format!("line {line}: {e}"))?;
        let field = |c: usize, name: &str| -> Result<f64, String> {
            row.get(c)
                .unwrap_or("")
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 0.0)
                .ok_or_else(|| format!("line {line}: `{name}` is not a number >= 0"))
        };
        let mut r = TraceRequest::new(
            field(t, "Timestamp")?,
            field(req, "Request tokens")? as u32,
            field(resp, "Response tokens")? as u32,
        );
        r.model = model.and_then(|c| row.get(c)).map(str::to_string);
        r.class = log_type.and_then(|c| row.get(c)).map(str::to_string);
        if r.output_tokens == 0 {
            r.status = Some(500);
        }
        out.push(r);
    }
    Ok(out)
}

/// The JSON Schema of one trace record (committed as
/// `profiles/schema/trace.schema.json`).
pub fn json_schema() -> serde_json::Value {
    serde_json::to_value(schemars::schema_for!(TraceRequest)).unwrap_or_default()
}

mod workload;
pub use workload::{workload_from_trace, workload_toml};

#[cfg(test)]
mod tests;
