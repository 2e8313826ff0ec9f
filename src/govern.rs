//! `envelope govern`: flags (every one also a `--config` TOML field and an
//! environment variable), the start-up checks (profile fingerprint against
//! the live node and the upstream's model), token-counter selection, hot
//! reload (SIGHUP, file change, `POST /admin/reload`) and drain on SIGTERM.
//! The governor itself lives in `crates/envelope-governor`.

use anyhow::{bail, Context, Result};
use clap::Args;
use envelope_governor::{
    live, AppState, Beyond, Governor, LadderConfig, OverBudget, OverLimit, Settings, TenantsFile,
    TokenCounter,
};
use envelope_profile::Profile;
use serde::Deserialize;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// One struct for flags and the TOML config (mistral.rs does the same);
/// a flag wins over the file, the file over the default.
#[derive(Args, Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GovernArgs {
    /// A TOML file with any of these fields (snake_case names).
    #[arg(long, env = "ENVELOPE_GOVERN_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// The profile to enforce (written by `envelope sweep`).
    #[arg(long, env = "ENVELOPE_GOVERN_PROFILE")]
    pub profile: Option<PathBuf>,
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
    pub token_count: Option<String>,
    /// Bytes per token of the estimate (default 1: an upper bound for byte-level tokenizers; above 1, crafted text can be under-counted).
    #[arg(long, env = "ENVELOPE_GOVERN_ESTIMATE_BYTES_PER_TOKEN")]
    pub estimate_bytes_per_token: Option<f64>,
    /// Tenants file (TOML: shares, weights, API keys; see the README).
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
    pub on_mismatch: Option<String>,
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
}

macro_rules! merge {
    ($a:ident, $b:ident, $($f:ident),*) => { $( if $a.$f.is_none() { $a.$f = $b.$f.clone(); } )* };
}

impl GovernArgs {
    /// Flags over the config file's fields.
    fn with_config(mut self) -> Result<GovernArgs> {
        let Some(path) = self.config.clone() else {
            return Ok(self);
        };
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading --config {}", path.display()))?;
        let f: GovernArgs = envelope_governor::toml::from_str(&text)
            .with_context(|| format!("parsing --config {}", path.display()))?;
        merge!(
            self,
            f,
            profile,
            upstream,
            listen,
            max_context_tokens,
            max_output_tokens,
            max_concurrent_seqs,
            max_kv_tokens_in_flight,
            over_limit,
            max_queue_len,
            max_queue_tokens,
            max_queue_age_ms,
            interactive_deadline_ms,
            batch_deadline_ms,
            max_body_bytes,
            upstream_timeout_ms,
            upstream_idle_timeout_ms,
            tokenizer,
            token_count,
            estimate_bytes_per_token,
            tenants,
            guard,
            guard_interval_ms,
            guard_metrics_url,
            guard_small_kv,
            guard_reject_kv,
            guard_min_gpu_free_bytes,
            on_mismatch,
            drain_timeout_ms,
            admin_token,
            beyond_envelope,
            interactive_ttft_budget_ms,
            batch_ttft_budget_ms,
            over_budget,
            latency_guard,
            header_read_timeout_ms,
            max_connections,
            connect_timeout_ms,
            max_request_ms,
            passthrough_paths,
            count_timeout_ms,
            max_counting,
            image_part_tokens,
            audio_part_tokens
        );
        Ok(self)
    }

    /// Profile (read and validated) plus overrides -> settings.
    fn settings(&self, profile_path: &Path, conservative: bool) -> Result<Settings> {
        let shown = profile_path.display().to_string();
        let text =
            std::fs::read_to_string(profile_path).with_context(|| format!("reading {shown}"))?;
        let profile = Profile::from_json(&text, &shown)?;
        let mut limits = profile.limits.clone();
        if conservative {
            limits = live::conservative(&limits);
        }
        if let Some(v) = self.max_context_tokens {
            limits.max_context_tokens = v;
        }
        if let Some(v) = self.max_output_tokens {
            limits.max_output_tokens = v;
        }
        if let Some(v) = self.max_concurrent_seqs {
            limits.max_concurrent_seqs = v;
        }
        if let Some(v) = self.max_kv_tokens_in_flight {
            limits.max_kv_tokens_in_flight = v;
        }
        let mut s = Settings::from_profile(&profile, limits);
        s.over_limit = self.over_limit.unwrap_or(OverLimit::Clamp);
        s.beyond = self.beyond_envelope.unwrap_or(Beyond::Refuse);
        if self.interactive_ttft_budget_ms.is_some() {
            s.interactive_ttft_budget_ms = self.interactive_ttft_budget_ms;
        }
        s.batch_ttft_budget_ms = self.batch_ttft_budget_ms;
        s.over_budget = self.over_budget.unwrap_or(OverBudget::Shed);
        s.latency.enabled = self.latency_guard.unwrap_or(true);
        macro_rules! set {
            ($($f:ident),*) => { $( if let Some(v) = self.$f { s.$f = v; } )* };
        }
        set!(
            max_queue_len,
            max_queue_tokens,
            max_queue_age_ms,
            interactive_deadline_ms,
            batch_deadline_ms,
            max_body_bytes,
            upstream_timeout_ms,
            upstream_idle_timeout_ms,
            header_read_timeout_ms,
            max_connections,
            connect_timeout_ms,
            max_request_ms,
            count_timeout_ms,
            max_counting,
            image_part_tokens,
            audio_part_tokens
        );
        if let Some(p) = &self.passthrough_paths {
            s.passthrough_paths = p.clone();
        }
        if let Some(p) = &self.tenants {
            let t = std::fs::read_to_string(p)
                .with_context(|| format!("reading --tenants {}", p.display()))?;
            s.tenants =
                TenantsFile::from_toml(&t, &p.display().to_string()).map_err(anyhow::Error::msg)?;
        }
        s.ladder = LadderConfig {
            small_kv_usage: self.guard_small_kv.unwrap_or(0.90),
            reject_kv_usage: self.guard_reject_kv.unwrap_or(0.98),
            min_gpu_free_bytes: self.guard_min_gpu_free_bytes,
            ..LadderConfig::default()
        };
        s.admin_token = self.admin_token.clone();
        s.validate()
            .map_err(|e| anyhow::anyhow!("{shown} with overrides: {e}"))?;
        Ok(s)
    }
}

fn mtime(p: &Path) -> Option<SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

async fn get_json(
    client: &envelope_governor::reqwest::Client,
    url: &str,
) -> Option<serde_json::Value> {
    let r = client
        .get(url)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?;
    r.json().await.ok()
}

async fn pick_counter(
    args: &GovernArgs,
    client: &envelope_governor::reqwest::Client,
    upstream: &str,
) -> Result<TokenCounter> {
    if let Some(p) = &args.tokenizer {
        return TokenCounter::from_tokenizer_file(p).map_err(anyhow::Error::msg);
    }
    let estimate = TokenCounter::Estimate {
        bytes_per_token: args
            .estimate_bytes_per_token
            .unwrap_or(envelope_governor::tokens::BOUND_BYTES_PER_TOKEN),
    };
    let url = format!("{upstream}/tokenize");
    let upstream_counter = TokenCounter::Upstream {
        client: client.clone(),
        url: url.clone(),
        timeout: Duration::from_secs(10),
    };
    match args.token_count.as_deref().unwrap_or("auto") {
        "estimate" => Ok(estimate),
        "upstream" => Ok(upstream_counter),
        "auto" => {
            let probe = client
                .post(&url)
                .json(&serde_json::json!({"prompt": "probe"}))
                .timeout(Duration::from_secs(5))
                .send()
                .await;
            match probe {
                Ok(r) if r.status().is_success() => Ok(upstream_counter),
                Ok(r) => {
                    tracing::warn!("no --tokenizer and {url} answers HTTP {}: prompt tokens are ESTIMATED (bytes / {}, rounded up); responses say so in x-envelope-token-count", r.status().as_u16(), args.estimate_bytes_per_token.unwrap_or(envelope_governor::tokens::BOUND_BYTES_PER_TOKEN));
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
        other => bail!("--token-count `{other}`: expected auto, upstream or estimate"),
    }
}

fn gpus() -> Vec<(Option<String>, Option<u64>)> {
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

pub fn run(args: GovernArgs) -> Result<()> {
    let args = args.with_config()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(run_async(args))
}

async fn run_async(args: GovernArgs) -> Result<()> {
    let Some(profile_path) = args.profile.clone() else {
        bail!("--profile is required (flag, ENVELOPE_GOVERN_PROFILE or `profile` in --config)");
    };
    let Some(upstream) = args.upstream.clone() else {
        bail!("--upstream is required (flag, ENVELOPE_GOVERN_UPSTREAM or `upstream` in --config)");
    };
    let upstream = upstream.trim_end_matches('/').to_string();
    let listen = args
        .listen
        .clone()
        .unwrap_or_else(|| "127.0.0.1:9000".into());
    let client = envelope_governor::reqwest::Client::builder()
        .redirect(envelope_governor::reqwest::redirect::Policy::none())
        .build()?;

    // Profile checks: the node and the upstream's model against the fingerprint.
    let shown = profile_path.display().to_string();
    let profile = Profile::from_json(
        &std::fs::read_to_string(&profile_path).with_context(|| format!("reading {shown}"))?,
        &shown,
    )?;
    let models = get_json(&client, &format!("{upstream}/v1/models")).await;
    if models.is_none() {
        tracing::warn!("{upstream}/v1/models did not answer; the model id is not checked");
    }
    let mismatches = live::fingerprint_mismatches(&profile, models.as_ref(), &gpus());
    let policy = args
        .on_mismatch
        .clone()
        .unwrap_or_else(|| "conservative".into());
    let mut conservative = false;
    if !mismatches.is_empty() {
        let list = mismatches.join("; ");
        match policy.as_str() {
            "refuse" => {
                bail!("the profile {shown} does not match this node: {list} (--on-mismatch refuse)")
            }
            "conservative" => {
                conservative = true;
                tracing::warn!("!!! PROFILE MISMATCH: {list}. Running with HALF the profile's concurrency and KV budget (--on-mismatch conservative). Measure this node with `envelope sweep`. !!!");
            }
            "ignore" => tracing::warn!("profile mismatch ignored (--on-mismatch ignore): {list}"),
            other => bail!("--on-mismatch `{other}`: expected refuse, conservative or ignore"),
        }
    }
    let settings = args.settings(&profile_path, conservative)?;
    let counter = pick_counter(&args, &client, &upstream).await?;
    let l = &settings.limits;
    tracing::info!(
        profile = %settings.profile_id, max_context_tokens = l.max_context_tokens,
        max_output_tokens = l.max_output_tokens, max_concurrent_seqs = l.max_concurrent_seqs,
        max_kv_tokens_in_flight = l.max_kv_tokens_in_flight, counter = ?counter, "enforcing"
    );
    let table: Vec<String> = l
        .buckets
        .iter()
        .map(|b| format!("{} safe at {}", b.label(), b.safe_concurrency))
        .collect();
    tracing::info!("envelope per bucket (each sequence charged 1 / safe concurrency of the smallest bucket covering prompt + max_tokens): {}", table.join(", "));
    let lat = &settings.latency;
    let least_safe = l
        .buckets
        .iter()
        .map(|b| b.safe_concurrency)
        .min()
        .unwrap_or(1);
    if lat.active() && least_safe <= 1 {
        tracing::warn!("latency guard: on, but it cannot lower anything: its floor is one sequence of the costliest bucket, which is safe at 1 (the whole node)");
    } else if lat.active() {
        tracing::info!(
            ttft_p95_ms = ?lat.ttft_slo_ms, itl_p95_ms = ?lat.itl_slo_ms, e2e_ms = ?lat.e2e_slo_ms,
            "latency guard: on (proxied TTFT, inter-token gaps and non-streaming e2e against the profile's SLOs)"
        );
    } else if lat.enabled {
        tracing::warn!("latency guard: off, the profile has no latency SLO to hold");
    }
    if !args.guard.unwrap_or(true) {
        tracing::warn!("live guard: off (--guard false): upstream metrics are not polled");
    }
    let gov = Governor::new(settings);
    // The latency guard climbs back in time when traffic is too thin to judge.
    {
        let gov = gov.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                gov.tick_latency();
            }
        });
    }
    let mut state = AppState::new(gov.clone(), &upstream, counter);
    let reload: envelope_governor::ReloadHook = {
        let gov = gov.clone();
        let args = args.clone();
        let path = profile_path.clone();
        Arc::new(move || {
            let r = args
                .settings(&path, conservative)
                .map_err(|e| format!("{e:#}"))
                .and_then(|s| {
                    let id = s.profile_id.clone();
                    gov.reload(s).map(|_| id)
                });
            let outcome = if r.is_ok() { "ok" } else { "rejected" };
            gov.metrics
                .reloads
                .get_or_create(&envelope_governor::metrics::label("outcome", outcome))
                .inc();
            match &r {
                Ok(id) => tracing::info!("profile reloaded: {id}"),
                Err(e) => {
                    tracing::error!("profile reload REJECTED, keeping the last good one: {e}")
                }
            }
            r
        })
    };
    state.reload = Some(reload.clone());
    if args.guard.unwrap_or(true) {
        let url = args
            .guard_metrics_url
            .clone()
            .unwrap_or_else(|| format!("{upstream}/metrics"));
        live::spawn_guard(
            gov.clone(),
            url,
            Duration::from_millis(args.guard_interval_ms.unwrap_or(1000)),
        );
    }
    // Hot reload: SIGHUP and a change of the profile or the tenants file.
    {
        let reload = reload.clone();
        let paths: Vec<PathBuf> = std::iter::once(profile_path.clone())
            .chain(args.tenants.clone())
            .collect();
        let mtimes = move || paths.iter().map(|p| mtime(p)).collect::<Vec<_>>();
        tokio::spawn(async move {
            let mut last = mtimes();
            let mut hup =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
            loop {
                let tick = tokio::time::sleep(Duration::from_secs(1));
                let hupped = match hup.as_mut() {
                    Some(h) => tokio::select! { _ = h.recv() => true, _ = tick => false },
                    None => {
                        tick.await;
                        false
                    }
                };
                let now = mtimes();
                if hupped || now != last {
                    last = now;
                    let _ = reload();
                }
            }
        });
    }
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .with_context(|| format!("binding --listen {listen}"))?;
    let addr = listener.local_addr()?;
    println!("envelope govern listening on http://{addr}");
    std::io::stdout().flush()?;
    let drain_timeout = Duration::from_millis(args.drain_timeout_ms.unwrap_or(30_000));
    let g = gov.clone();
    let shutdown = async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = term.recv() => {},
            _ = tokio::signal::ctrl_c() => {},
        }
        tracing::info!(
            "draining: new and queued requests get 503; waiting up to {} ms for {} in flight",
            drain_timeout.as_millis(),
            g.requests_in_flight()
        );
        // Queued requests get 503 now; in-flight ones get until the drain
        // timeout, then an SSE error event (or a cut connection).
        if g.drain(drain_timeout).await {
            tracing::info!("drained: nothing in flight");
        }
    };
    envelope_governor::serve(listener, Arc::new(state), shutdown).await?;
    Ok(())
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
        std::fs::write(&cfg, "nonsense_field = 1\n").unwrap();
        let t = T::try_parse_from(["t", "--config", cfg.to_str().unwrap()]).unwrap();
        assert!(t.a.with_config().is_err());
        let _ = std::fs::remove_dir_all(dir);
    }
}
