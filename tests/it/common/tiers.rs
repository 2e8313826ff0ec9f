//! Helpers for the model-tier tests: upstreams, profiles, a governor over
//! a tiers file, and calls as the client sees them.

use super::{Governor, Server};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// dummy:<preset>@seed served as `name`.
pub fn dummy(seed: u32, name: &str) -> Server {
    Server::start(&[
        "--model",
        &format!("dummy:tiny@{seed}"),
        "--served-model-name",
        name,
        "--kv-cache-bytes",
        "4MiB",
    ])
}

pub fn smollm2(name: &str) -> Server {
    Server::start(&[
        "--model",
        &super::smollm2(),
        "--served-model-name",
        name,
        "--kv-cache-bytes",
        "64MiB",
        "--max-model-len",
        "2048",
    ])
}

/// A one-bucket profile: prompts up to `input`, outputs up to `output`,
/// `seqs` sequences at once.
pub fn profile(dir: &Path, name: &str, input: u64, output: u64, seqs: u64) -> PathBuf {
    let p = json!({
        "schema": "envelope.profile/v2",
        "created_unix_ms": 1,
        "fingerprint": {"schema": 1, "model": {"kind": "dummy", "preset": "tiny", "seed": 0},
                        "node": {"gpus": []}},
        "slo": {"ttft_p95_ms": null, "itl_p95_ms": null, "e2e_p99_ms": null},
        "configs": [],
        "selected": name,
        "limits": {"max_context_tokens": input + output, "max_output_tokens": output,
                   "max_concurrent_seqs": seqs, "max_kv_tokens_in_flight": seqs * (input + output),
                   "buckets": [{"input_tokens": input, "output_tokens": output,
                                "safe_concurrency": seqs, "kv_tokens": seqs * (input + output)}]},
        "probes_total": 0
    });
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, p.to_string()).unwrap();
    path
}

pub fn temp_dir(name: &str) -> PathBuf {
    super::temp_dir("envelope-tiers", name)
}

pub fn govern(dir: &Path, tiers: &str) -> Governor {
    let path = dir.join("tiers.toml");
    std::fs::write(&path, tiers).unwrap();
    Governor::launch(
        dir,
        &["--tiers", path.to_str().unwrap(), "--guard", "false"],
    )
}

/// A call's answer as the client saw it.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Value,
}

impl Answer {
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }
    pub fn tier(&self) -> &str {
        self.header("x-envelope-tier")
    }
    pub fn reason(&self) -> &str {
        self.header("x-envelope-route-reason")
    }
    pub fn usage(&self) -> (u64, u64) {
        let u = &self.body["usage"];
        (
            u["prompt_tokens"].as_u64().unwrap_or(0),
            u["completion_tokens"].as_u64().unwrap_or(0),
        )
    }
}

pub async fn chat(gov: &Governor, body: Value, headers: &[(&str, &str)]) -> Answer {
    let mut r = reqwest::Client::new()
        .post(gov.url("/v1/chat/completions"))
        .json(&body);
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    let resp = r.send().await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.json().await.unwrap_or(Value::Null);
    Answer {
        status,
        headers,
        body,
    }
}

pub fn ask(text: &str, max_tokens: u64) -> Value {
    json!({"model": "any", "messages": [{"role": "user", "content": text}],
           "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

pub async fn admin(gov: &Governor) -> Value {
    reqwest::get(gov.url("/admin/tiers"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

pub async fn post(gov: &Governor, path: &str) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(gov.url(path))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// The book's row for (feature, tier).
pub fn row<'a>(state: &'a Value, feature: &str, tier: &str) -> &'a Value {
    state["costs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["feature"] == feature && r["tier"] == tier)
        .map(|r| &r["row"])
        .unwrap_or_else(|| panic!("no row for {feature} on {tier}: {state}"))
}

pub fn three_tiers(dir: &Path, a: &Server, b: &Server, c: &Server, extra: &str) -> String {
    let (ps, pm, pl) = (
        profile(dir, "small", 1024, 64, 8),
        profile(dir, "standard", 1024, 64, 8),
        profile(dir, "large", 1024, 64, 8),
    );
    format!(
        r#"
version = "v1"
order = ["small", "standard", "large"]
[tiers.small]
upstreams = [{{ url = "{}", profile = "{}", model = "tiny-a" }}]
[tiers.standard]
upstreams = [{{ url = "{}", profile = "{}", model = "tiny-b" }}]
[tiers.large]
upstreams = [{{ url = "{}", profile = "{}", model = "tiny-c" }}]
{extra}
"#,
        a.base,
        ps.display(),
        b.base,
        pm.display(),
        c.base,
        pl.display()
    )
}
