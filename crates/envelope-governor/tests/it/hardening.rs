//! Ways around the envelope, each tried from outside: a client
//! that names another tenant or class, hides prompt or output tokens in
//! fields the governor did not read, makes the governor work before
//! admission, holds connections or requests open, reaches the upstream's
//! other paths, or outlives a reload or a drain.

use crate::common;

use common::*;
use envelope_governor::{TenantsSettings, TokenCounter};
use futures::StreamExt;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn tenants(text: &str) -> TenantsSettings {
    TenantsSettings::from_toml(text, "tenants.toml").unwrap()
}

fn estimate() -> Option<TokenCounter> {
    Some(TokenCounter::Estimate {
        bytes_per_token: 3.0,
    })
}

async fn code(r: reqwest::Response) -> (u16, Value) {
    let s = r.status().as_u16();
    (s, r.json().await.unwrap_or(Value::Null))
}

/// `n` slow requests sent at once with `auth` (a bearer key) and `headers`.
fn spawn_many(
    g: &Gov,
    n: usize,
    auth: Option<&str>,
    headers: &[(&'static str, String)],
) -> Vec<tokio::task::JoinHandle<(u16, String)>> {
    (0..n)
        .map(|i| {
            let mut req = g
                .client
                .post(g.url("/v1/completions"))
                .json(&json!({"prompt": "a", "max_tokens": 10}));
            if let Some(k) = auth {
                req = req.bearer_auth(k);
            }
            for (k, v) in headers {
                req = req.header(*k, format!("{v}{i}"));
            }
            tokio::spawn(async move {
                let r = req.send().await.unwrap();
                let tenant = r
                    .headers()
                    .get("x-envelope-tenant")
                    .map(|v| v.to_str().unwrap().to_string())
                    .unwrap_or_default();
                let s = r.status().as_u16();
                let _ = r.bytes().await;
                (s, tenant)
            })
        })
        .collect()
}

mod admin;
mod before_admission;
mod counting;
mod identity;
mod paths;
mod reload_drain;
mod timeouts;
