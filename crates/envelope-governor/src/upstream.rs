//! Reaching an upstream at start: its model list (for the profile's
//! fingerprint), how its prompt tokens are counted, and the node's GPUs;
//! and [`start`], which builds a [`GovernedUpstream`] from one spec for
//! both front ends.

use crate::admission::Governor;
use crate::client::{Answer, UpstreamClient};
use crate::config::ProfileFile;
use crate::config::{GovernArgs, OnMismatch, TokenCount};
use crate::error::StartError;
use crate::request::ChatText;
use crate::upstream_tokenize::{joined_text, ChatOverhead, Dialect};
use crate::{live_guard, GovernedUpstream, TokenCounter};
use axum::http::{HeaderMap, Method};
use envelope_profile::Profile;
use serde_json::{json, Value};
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

/// How prompt tokens are counted, from the best source there is:
/// `--tokenizer`; else the upstream's tokenize endpoint in its own dialect
/// (found by asking it; a chat template it does not apply is measured
/// from its own usage); else the tokenizer file the profile names, when
/// that file is here with the same SHA-256; else the estimate (one token
/// per byte, an upper bound). The log says which.
pub(crate) async fn pick_counter(
    args: &GovernArgs,
    tokenizer: Option<&Path>,
    client: &UpstreamClient,
    upstream: &str,
    connect_timeout: Duration,
    profile: &Profile,
) -> Result<TokenCounter, StartError> {
    if let Some(p) = tokenizer {
        tracing::info!(
            "counting prompt tokens with the tokenizer in {} (--tokenizer)",
            p.display()
        );
        let local = TokenCounter::from_tokenizer_file(p).map_err(StartError::Invalid)?;
        return Ok(with_measured_chat(local, client, upstream).await);
    }
    let bytes_per_token = args.estimate_bytes_per_token();
    let estimate = TokenCounter::Estimate { bytes_per_token };
    let counter = |dialect: Dialect| TokenCounter::Upstream {
        client: UpstreamClient::new(connect_timeout),
        url: format!("{upstream}{}", dialect.path()),
        timeout: Duration::from_secs(10),
        dialect,
        chat: ChatOverhead::default(),
    };
    let chosen = match args.token_count() {
        TokenCount::Estimate => {
            tracing::warn!("prompt tokens are ESTIMATED (bytes / {bytes_per_token}, rounded up; --token-count estimate)");
            return Ok(estimate);
        }
        TokenCount::Upstream => {
            let dialect = detect_dialect(client, upstream)
                .await
                .unwrap_or(Dialect::Vllm);
            tracing::info!(
                "counting prompt tokens with the upstream's {} (--token-count upstream)",
                dialect.name()
            );
            counter(dialect)
        }
        TokenCount::Auto => match detect_dialect(client, upstream).await {
            Some(d) if d.safe_beside_streams() => {
                tracing::info!("counting prompt tokens with the upstream's {}", d.name());
                counter(d)
            }
            found => {
                if let Some(d) = found {
                    tracing::warn!("the upstream has {}, but a call to it while a stream runs cuts that stream (llama-cpp-python's --interrupt_requests): not used", d.name());
                }
                if let Some(t) = profile_tokenizer(profile) {
                    t
                } else if found.is_none()
                    && get_json(client, &format!("{upstream}/v1/models"))
                        .await
                        .is_none()
                {
                    // Not up yet: ask it again once it is (requests get 502
                    // while it is down, as they would from the upstream).
                    tracing::warn!("{upstream} is not reachable yet; counting with its vLLM-style /tokenize once it is");
                    return Ok(counter(Dialect::Vllm));
                } else {
                    let tried = Dialect::ALL.map(|d| d.name()).join(", ");
                    if args.estimate_bytes_per_token.is_some() {
                        tracing::warn!("no --tokenizer, no tokenize endpoint on {upstream} to use (tried: {tried}), and no tokenizer file from the profile here: prompt tokens are ESTIMATED (bytes / {bytes_per_token}, rounded up; --estimate-bytes-per-token); responses say so in x-envelope-token-count");
                        return Ok(estimate);
                    }
                    let start = profile
                        .selected_checks()
                        .and_then(|c| c.text_bytes_per_token)
                        .unwrap_or(crate::tokens::BOUND_BYTES_PER_TOKEN);
                    let learnt = crate::learnt_estimate::LearntEstimate::new(start);
                    tracing::warn!("no --tokenizer, no tokenize endpoint on {upstream} to use (tried: {tried}), and no tokenizer file from the profile here: prompt tokens are ESTIMATED, from {:.2} bytes per token (the profile's English text, else the 1-byte bound), then learnt from the upstream's usage (the 5th percentile of the last {} answers, at least 1); responses say so in x-envelope-token-count", learnt.bytes_per_token(), crate::learnt_estimate::WINDOW);
                    return Ok(TokenCounter::Learnt(std::sync::Arc::new(learnt)));
                }
            }
        },
    };
    Ok(with_measured_chat(chosen, client, upstream).await)
}

/// `counter` with the chat template's tokens measured on the upstream,
/// where the count applies no template (a local tokenizer, or an endpoint
/// that takes text only); the local constants where it cannot be measured.
async fn with_measured_chat(
    counter: TokenCounter,
    client: &UpstreamClient,
    upstream: &str,
) -> TokenCounter {
    if matches!(&counter, TokenCounter::Upstream { dialect, .. } if dialect.takes_chats()) {
        return counter;
    }
    let model = get_json(client, &format!("{upstream}/v1/models"))
        .await
        .and_then(|m| m.pointer("/data/0/id")?.as_str().map(str::to_string));
    let measured = match &model {
        Some(m) => calibrate_chat(client, upstream, m, &counter).await,
        None => None,
    };
    match measured {
        Some(o) => {
            tracing::info!("chat template: {} tokens per message plus {} ({} after a system message), measured on the upstream", o.per_message, o.fixed, o.fixed_with_system);
            counter.with_chat_overhead(o)
        }
        None => {
            let o = ChatOverhead::default();
            tracing::warn!("chat template not measured (the upstream did not answer a small chat with usage): counted as {} tokens per message plus {}", o.per_message, o.fixed);
            counter
        }
    }
}

/// The count of `text` from `base`'s endpoint in `dialect`; `None` on any
/// failure.
async fn dialect_count(
    client: &UpstreamClient,
    base: &str,
    dialect: Dialect,
    text: &str,
) -> Option<u64> {
    let url = format!("{base}{}", dialect.path());
    let v = post(client, &url, &dialect.text_body(text)).await?;
    dialect.count_in(&v)
}

/// The first dialect whose endpoint answers a probe text with a count of
/// its shape.
pub(crate) async fn detect_dialect(client: &UpstreamClient, base: &str) -> Option<Dialect> {
    for d in Dialect::ALL {
        if dialect_count(client, base, d, "probe")
            .await
            .is_some_and(|n| n > 0)
        {
            return Some(d);
        }
    }
    None
}

/// The JSON a 2xx answer to a POST of `body` to `url` holds, within
/// [`CHECK_TIMEOUT`].
async fn post(client: &UpstreamClient, url: &str, body: &Value) -> Option<Value> {
    let call = async {
        let r = client.post_json(url, body).await.ok()?;
        if !r.status().is_success() {
            return None;
        }
        let bytes = r.bytes().await.ok()?;
        serde_json::from_slice::<Value>(&bytes).ok()
    };
    tokio::time::timeout(CHECK_TIMEOUT, call)
        .await
        .ok()
        .flatten()
}

/// Measures the chat template's overhead on `base`: three small chats sent
/// to `/v1/chat/completions` (one output token each), their
/// `usage.prompt_tokens` less `counter`'s count of their joined text.
/// `None` when the server does not answer them with usage.
async fn calibrate_chat(
    client: &UpstreamClient,
    base: &str,
    model: &str,
    counter: &crate::TokenCounter,
) -> Option<ChatOverhead> {
    let word = "hello";
    let chat = |roles: &[&str]| ChatText {
        messages: roles
            .iter()
            .map(|r| (r.to_string(), word.to_string()))
            .collect(),
        media: Default::default(),
    };
    // (template tokens) = usage - count(joined text), for each chat.
    let mut overhead = vec![];
    for roles in [
        &["user"][..],
        &["user", "assistant", "user"][..],
        &["system", "user"][..],
    ] {
        let c = chat(roles);
        let body = json!({
            "model": model,
            "messages": c.as_messages(),
            "max_tokens": 1,
            "temperature": 0,
        });
        let answer = post(client, &format!("{base}/v1/chat/completions"), &body).await?;
        let usage = answer.pointer("/usage/prompt_tokens")?.as_u64()?;
        let text = counter.count_text(&joined_text(&c)).await?;
        overhead.push(usage as i64 - text as i64);
    }
    let per_message = ((overhead[1] - overhead[0]) / 2).max(0);
    Some(ChatOverhead {
        fixed: (overhead[0] - per_message).max(0) as u64,
        fixed_with_system: (overhead[2] - 2 * per_message).max(0) as u64,
        per_message: per_message as u64,
    })
}

/// The tokenizer file the profile names (`server_checks.tokenizer` of its
/// selected configuration), when it is here with the recorded SHA-256.
fn profile_tokenizer(profile: &Profile) -> Option<TokenCounter> {
    let t = profile.selected_checks()?.tokenizer.as_ref()?;
    let path = Path::new(&t.path);
    match envelope_telemetry::fingerprint::file_sha256(path) {
        Ok(sha) if sha == t.sha256 => match TokenCounter::from_tokenizer_file(path) {
            Ok(c) => {
                tracing::info!(
                    "counting prompt tokens with the tokenizer the profile names: {}",
                    t.path
                );
                Some(c)
            }
            Err(e) => {
                tracing::warn!("the profile's tokenizer does not load: {e}");
                None
            }
        },
        Ok(_) => {
            tracing::warn!(
                "the profile's tokenizer {} has changed (SHA-256 differs); not used",
                t.path
            );
            None
        }
        Err(_) => None,
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
    let mismatches = live_guard::fingerprint_mismatches(profile, models.as_ref(), &gpus());
    if mismatches.is_empty() {
        return Ok(false);
    }
    let list = mismatches.join("; ");
    match args.on_mismatch() {
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

/// What a governed upstream is built from.
pub struct UpstreamSpec<'a> {
    /// The file field it comes from, naming its settings' errors (empty
    /// for the flags of one upstream).
    pub field: &'a str,
    /// Its base URL.
    pub url: &'a str,
    pub profile: &'a ProfileFile,
    /// A tokenizer file to count with (else one is picked: docs/govern.md).
    pub tokenizer: Option<&'a Path>,
    /// The metrics page its live guard reads.
    pub metrics_url: String,
    /// Whether the live guard's readings are also the engine's waiting
    /// count (else a faster poller, `--engine-metrics`, gives that).
    pub guard_notes_waiting: bool,
}

/// A governed upstream as started, with whether it runs at half its
/// profile (a fingerprint mismatch) and its background tasks.
pub struct Started {
    pub upstream: GovernedUpstream,
    pub conservative: bool,
    pub tasks: Tasks,
}

/// An upstream's background tasks (latency tick, live guard), ended when
/// this is dropped.
pub struct Tasks(pub Vec<tokio::task::JoinHandle<()>>);

impl Drop for Tasks {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// Starts a governed upstream: the profile's fingerprint checked against
/// the node and the upstream's model, the settings made from the profile
/// and `args`, the token counter picked, the latency tick and (unless
/// `--guard false`) the live guard started.
///
/// # Errors
/// A refused fingerprint mismatch, or an invalid setting or tokenizer
/// (named with `spec.field`).
pub async fn start(args: &GovernArgs, spec: UpstreamSpec<'_>) -> Result<Started, StartError> {
    let url = spec.url.trim_end_matches('/');
    let named = |e: StartError| match spec.field {
        "" => e,
        field => StartError::Invalid(format!("{field}: {e}")),
    };
    // For the checks at start (the governed requests get their own).
    let client = UpstreamClient::new(crate::upstream::CHECK_TIMEOUT);
    let (profile, shown) = (&spec.profile.profile, &spec.profile.shown);
    let conservative = crate::upstream::check_profile(args, &client, url, profile, shown).await?;
    let settings = args.settings(spec.profile, conservative).map_err(named)?;
    let counter = crate::upstream::pick_counter(
        args,
        spec.tokenizer,
        &client,
        url,
        Duration::from_millis(settings.timeouts.connect_timeout_ms),
        profile,
    )
    .await?;
    let gov = Governor::new(settings);
    let mut tasks = vec![];
    // The latency guard climbs back in time when traffic is too thin to judge.
    {
        let gov = gov.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                gov.tick_latency();
            }
        }));
    }
    if args.guard() {
        tasks.push(crate::live_guard::spawn_guard(
            gov.clone(),
            spec.metrics_url,
            args.guard_interval(),
            spec.guard_notes_waiting,
        ));
    }
    Ok(Started {
        upstream: GovernedUpstream::new(gov, url, counter),
        conservative,
        tasks: Tasks(tasks),
    })
}
