//! Reaching an upstream at start: its model list (for the profile's
//! fingerprint), how its prompt tokens are counted, and the node's GPUs.

use crate::client::{Answer, UpstreamClient};
use crate::config::{GovernArgs, OnMismatch, TokenCount};
use crate::error::StartError;
use crate::{live, TokenCounter};
use axum::http::{HeaderMap, Method};
use envelope_profile::Profile;
use std::path::Path;
use std::time::Duration;

/// How long a check at start waits for the upstream (connect and answer).
pub(crate) const CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// The upstream's answer to a GET of `url`, or a POST of `body` as JSON,
/// its head within [`CHECK_TIMEOUT`].
async fn call(
    client: &UpstreamClient,
    url: &str,
    body: Option<serde_json::Value>,
) -> Result<Answer, String> {
    let send = async {
        match body {
            Some(b) => client.post_json(url, &b).await,
            None => {
                client
                    .send(Method::GET, url, HeaderMap::new(), Default::default())
                    .await
            }
        }
    };
    match tokio::time::timeout(CHECK_TIMEOUT, send).await {
        Ok(r) => r,
        Err(_) => Err(format!("{url}: no answer in {} s", CHECK_TIMEOUT.as_secs())),
    }
}

pub(crate) async fn get_json(client: &UpstreamClient, url: &str) -> Option<serde_json::Value> {
    let r = call(client, url, None).await.ok()?;
    let body = tokio::time::timeout(CHECK_TIMEOUT, r.bytes())
        .await
        .ok()?
        .ok()?;
    serde_json::from_slice(&body).ok()
}

pub(crate) async fn pick_counter(
    args: &GovernArgs,
    tokenizer: Option<&Path>,
    client: &UpstreamClient,
    upstream: &str,
    connect_timeout: Duration,
) -> Result<TokenCounter, StartError> {
    if let Some(p) = tokenizer {
        return TokenCounter::from_tokenizer_file(p).map_err(StartError::Invalid);
    }
    let estimate = TokenCounter::Estimate {
        bytes_per_token: args
            .estimate_bytes_per_token
            .unwrap_or(crate::tokens::BOUND_BYTES_PER_TOKEN),
    };
    let url = format!("{upstream}/tokenize");
    let upstream_counter = TokenCounter::Upstream {
        client: UpstreamClient::new(connect_timeout),
        url: url.clone(),
        timeout: Duration::from_secs(10),
    };
    match args.token_count.unwrap_or(TokenCount::Auto) {
        TokenCount::Estimate => Ok(estimate),
        TokenCount::Upstream => Ok(upstream_counter),
        TokenCount::Auto => {
            let probe = call(client, &url, Some(serde_json::json!({"prompt": "probe"}))).await;
            match probe {
                Ok(r) if r.status().is_success() => Ok(upstream_counter),
                Ok(r) => {
                    tracing::warn!("no --tokenizer and {url} answers HTTP {}: prompt tokens are ESTIMATED (bytes / {}, rounded up); responses say so in x-envelope-token-count", r.status().as_u16(), args.estimate_bytes_per_token.unwrap_or(crate::tokens::BOUND_BYTES_PER_TOKEN));
                    Ok(estimate)
                }
                // Not up yet: count with it once it is (requests get 502 while
                // it is down, as they would from the upstream itself).
                Err(e) => {
                    tracing::warn!("{url} is not reachable yet ({e}); counting with it once it is");
                    Ok(upstream_counter)
                }
            }
        }
    }
}

pub(crate) fn gpus() -> Vec<(Option<String>, Option<u64>)> {
    match envelope_telemetry::Nvml::init() {
        Ok(n) => (0..n.device_count())
            .map(|i| {
                let info = n.info(i);
                (info.name, info.memory_total_bytes)
            })
            .collect(),
        Err(_) => vec![],
    }
}

/// Checks `profile` (shown as `shown`) against the node and the model
/// `upstream` serves. Returns whether to run conservatively (half the
/// profile's concurrency and KV budget).
///
/// # Errors
/// A mismatch with `--on-mismatch refuse`.
pub(crate) async fn check_profile(
    args: &GovernArgs,
    client: &UpstreamClient,
    upstream: &str,
    profile: &Profile,
    shown: &str,
) -> Result<bool, StartError> {
    let models = get_json(client, &format!("{upstream}/v1/models")).await;
    if models.is_none() {
        tracing::warn!("{upstream}/v1/models did not answer; the model id is not checked");
    }
    let mismatches = live::fingerprint_mismatches(profile, models.as_ref(), &gpus());
    if mismatches.is_empty() {
        return Ok(false);
    }
    let list = mismatches.join("; ");
    match args.on_mismatch.unwrap_or(OnMismatch::Conservative) {
        OnMismatch::Refuse => Err(StartError::Mismatch {
            profile: shown.to_string(),
            list,
        }),
        OnMismatch::Conservative => {
            tracing::warn!("!!! PROFILE MISMATCH ({shown} for {upstream}): {list}. Running with HALF the profile's concurrency and KV budget (--on-mismatch conservative). Measure this node with `envelope sweep`. !!!");
            Ok(true)
        }
        OnMismatch::Ignore => {
            tracing::warn!("profile mismatch ignored (--on-mismatch ignore): {list}");
            Ok(false)
        }
    }
}
