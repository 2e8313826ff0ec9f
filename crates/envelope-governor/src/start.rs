//! Starting `envelope govern` over one upstream: the governed upstream
//! ([`crate::upstream::start`]: the checks, the counter, the
//! latency tick and live guard), then what this front end adds (the
//! recorder, the budget store, the engine's metrics page, hot reload on
//! SIGHUP or a file change) and the drain on SIGTERM.

use crate::config::{GovernArgs, ProfileFile};
use crate::error::StartError;
use crate::upstream::UpstreamSpec;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Runs the governor over one upstream until SIGTERM (or Ctrl-C) and its
/// drain; `args` already merged with its `--config` file
/// ([`GovernArgs::with_config`]). (`--tiers` is the router's front end,
/// the `envelope-router` crate.)
///
/// # Errors
/// What stops it from starting: a missing or invalid setting, profile or
/// tenants file, a refused fingerprint mismatch, an address it cannot bind.
pub fn run(args: GovernArgs) -> Result<(), StartError> {
    let rt = args.runtime()?;
    rt.block_on(run_async(args))
}

async fn run_async(args: GovernArgs) -> Result<(), StartError> {
    let Some(profile_path) = args.profile.clone() else {
        return Err(StartError::Missing("profile"));
    };
    let Some(upstream) = args.upstream.clone() else {
        return Err(StartError::Missing("upstream"));
    };
    let upstream = upstream.trim_end_matches('/').to_string();
    let listen = args.listen();
    let profile_file = ProfileFile::read("--profile", &profile_path)?;
    let metrics_url = args.guard_metrics_url(&upstream);
    let engine_metrics = args.engine_metrics();
    let started = crate::upstream::start(
        &args,
        UpstreamSpec {
            field: "",
            url: &upstream,
            profile: &profile_file,
            tokenizer: args.tokenizer.as_deref(),
            metrics_url: metrics_url.clone(),
            guard_notes_waiting: !engine_metrics,
        },
    )
    .await?;
    // Ended (aborted) when the governor ends.
    let _tasks = started.tasks;
    let (mut state, conservative) = (started.upstream, started.conservative);
    let gov = state.gov.clone();
    let settings = gov.settings();
    let l = &settings.limits;
    tracing::info!(
        profile = %settings.profile_id, max_context_tokens = l.max_context_tokens,
        max_output_tokens = l.max_output_tokens, max_concurrent_seqs = l.max_concurrent_seqs,
        max_kv_tokens_in_flight = l.max_kv_tokens_in_flight, counter = ?state.counter, "enforcing"
    );
    let table: Vec<String> = l
        .buckets
        .iter()
        .map(|b| format!("{} safe at {}", b.label(), b.safe_concurrency))
        .collect();
    tracing::info!("envelope per bucket (a sequence is charged 1 / safe concurrency, on the straight line in prompt + max_tokens between the buckets around it): {}", table.join(", "));
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
    if !args.guard() {
        tracing::warn!("live guard: off (--guard false): upstream metrics are not polled");
    }
    let recorder = crate::recorder::Recorder::start_if(
        args.record_settings()?,
        &gov.metrics.records_written,
        &gov.metrics.records_dropped,
    )?;
    state.recorder = recorder.clone();
    if let Some(url) = &args.budget_store {
        let timeout = args.budget_store_timeout();
        state.budget_store =
            Arc::new(crate::budget::Store::redis(url, timeout).map_err(StartError::Invalid)?);
    }
    match (&args.budgets, &args.budget_store) {
        (Some(b), _) => tracing::info!(
            "budgets over time from {}: buckets {}",
            b.display(),
            state.budget_store.describe()
        ),
        (None, Some(_)) => {
            tracing::warn!("--budget-store without --budgets: no budget to keep there")
        }
        (None, None) => {}
    }
    let reload: crate::ReloadHook = {
        let gov = gov.clone();
        let args = args.clone();
        let path = profile_path.clone();
        Arc::new(move || {
            let r = ProfileFile::read("--profile", &path)
                .and_then(|p| args.settings(&p, conservative))
                .map_err(|e| e.to_string())
                .map(|s| {
                    let id = s.profile_id.clone();
                    gov.reload(s);
                    id
                });
            let outcome = if r.is_ok() { "ok" } else { "rejected" };
            gov.metrics
                .reloads
                .get_or_create(&crate::metrics::label("outcome", outcome))
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
    if engine_metrics {
        let every = args.engine_metrics_interval();
        if every.is_zero() {
            return Err(StartError::Invalid(
                "--engine-metrics-interval-ms (engine_metrics_interval_ms) must be at least 1"
                    .into(),
            ));
        }
        state.engine_metrics = Some(crate::engine_metrics::EngineMetrics::spawn(
            gov.clone(),
            &metrics_url,
            every,
        ));
    }
    // Hot reload: SIGHUP and a change of the profile, tenants or budgets file.
    {
        let reload = reload.clone();
        let paths: Vec<PathBuf> = std::iter::once(profile_path.clone())
            .chain(args.tenants.clone())
            .chain(args.budgets.clone())
            .collect();
        tokio::spawn(crate::signals::reload_on_change(
            move || paths.clone(),
            move || {
                let _ = reload();
                std::future::ready(())
            },
        ));
    }
    let listener = crate::proxy::bind_and_announce(&listen).await?;
    let drain_timeout = args.drain_timeout();
    let g = gov.clone();
    let shutdown = async move {
        crate::signals::shutdown_requested().await;
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
    crate::serve(listener, Arc::new(state), shutdown).await?;
    if let Some(r) = recorder {
        r.flush(Duration::from_secs(5));
    }
    Ok(())
}
