//! Starting the governor with model tiers: each upstream checked against
//! its profile and given its own governor, the HTTP app, hot reload of the
//! tiers file (SIGHUP, a change of it or of a profile, `POST
//! /admin/tiers/reload`) that keeps the last good version when the new one
//! is invalid, rollback to the version before (`POST
//! /admin/tiers/rollback`), and the drain at SIGTERM.

use super::call;
use super::config::{PriceConfig, TiersSettings, UpstreamConfig};
use super::cost::Price;
use super::metrics::{labels, merge};
use super::state::{Live, Tier, TierRouter, Upstream};
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use envelope_governor::config::{GovernArgs, ProfileFile};
use envelope_governor::error::{GovernError, StartError};
use envelope_governor::upstream::UpstreamSpec;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Runs the governor over the tiers in `path` until SIGTERM and its drain.
///
/// # Errors
/// An invalid tiers file, profile or setting (named), a refused
/// fingerprint mismatch, an address it cannot bind.
pub fn run(args: GovernArgs, path: PathBuf) -> Result<(), StartError> {
    if args.tokenizer.is_some() {
        return Err(StartError::Invalid(
            "--tokenizer: with --tiers each upstream names its own (`tokenizer` in the tiers file)"
                .into(),
        ));
    }
    if args.budgets.is_some() || args.budget_store.is_some() {
        return Err(StartError::Invalid(
            "--budgets: budgets over time are not kept with --tiers yet (run them on a governor without tiers)"
                .into(),
        ));
    }
    if args.engine_metrics == Some(true) {
        return Err(StartError::Invalid(
            "--engine-metrics: with --tiers each upstream is its own pod with its own metrics; an endpoint picker scrapes one governor per engine (docs/deploy.md)"
                .into(),
        ));
    }
    let rt = args.runtime()?;
    rt.block_on(run_async(args, path))
}

fn read_file(path: &Path) -> Result<(TiersSettings, String), StartError> {
    let text = envelope_governor::config::read("--tiers", path)?;
    let file = TiersSettings::from_toml(&text, path).map_err(StartError::Invalid)?;
    Ok((file, text))
}

/// The upstream's profile, and the text its settings come from (the
/// profile and the tenants file): unchanged text, unchanged settings.
fn read_profile(
    args: &GovernArgs,
    spec: &UpstreamConfig,
) -> Result<(ProfileFile, String), StartError> {
    let profile = ProfileFile::read("profile", &spec.profile)?;
    let mut text = profile.text.clone();
    if let Some(t) = &args.tenants {
        text.push_str(&envelope_governor::config::read("--tenants", t)?);
    }
    Ok((profile, text))
}

/// An upstream for `spec`: the running one when `reuse` serves the same
/// spec (its governor takes the profile as it is now), else a new one.
async fn upstream(
    args: &GovernArgs,
    field: &str,
    spec: &UpstreamConfig,
    price: Option<&PriceConfig>,
    reuse: Option<&Arc<Upstream>>,
) -> Result<(Arc<Upstream>, Option<envelope_governor::Settings>), StartError> {
    let named = |e: StartError| StartError::Invalid(format!("{field}: {e}"));
    let (profile, source) = read_profile(args, spec).map_err(named)?;
    let price = Price::new(price, &profile.profile)
        .map_err(|e| StartError::Invalid(format!("{field} price: {e}")))?;
    if let Some(u) = reuse {
        // Settings are rebuilt (and the guards' state reset) only when
        // what they come from changed.
        let settings = if u.source == source {
            None
        } else {
            Some(args.settings(&profile, u.conservative).map_err(named)?)
        };
        let up = Upstream {
            spec: spec.clone(),
            app: u.app.clone(),
            price,
            conservative: u.conservative,
            source,
            tasks: u.tasks.clone(),
        };
        return Ok((Arc::new(up), settings));
    }
    let url = spec.url.trim_end_matches('/');
    let started = envelope_governor::upstream::start(
        args,
        UpstreamSpec {
            field,
            url,
            profile: &profile,
            tokenizer: spec.tokenizer.as_deref(),
            metrics_url: format!("{url}/metrics"),
            guard_notes_waiting: true,
        },
    )
    .await?;
    let app = started.upstream;
    tracing::info!(upstream = %url, profile = %app.settings().profile_id, counter = ?app.counter, "{field}");
    let up = Upstream {
        spec: spec.clone(),
        app: Arc::new(app),
        price,
        conservative: started.conservative,
        source,
        tasks: Arc::new(started.tasks),
    };
    Ok((Arc::new(up), None))
}

/// `file` running: every upstream built or reused from `current`. Nothing
/// changes in force until all of it is valid.
async fn build(
    args: &GovernArgs,
    (file, text): (TiersSettings, String),
    current: Option<&Live>,
) -> Result<Live, StartError> {
    let mut tiers = vec![];
    let mut reloads = vec![];
    for name in &file.order {
        let spec = &file.tiers[name];
        let mut ups = vec![];
        for (i, u) in spec.upstreams.iter().enumerate() {
            let field = format!("tiers.{name}.upstreams[{i}]");
            let reuse =
                current.and_then(|c| c.all_upstreams().map(|(_, _, x)| x).find(|x| x.spec == *u));
            let (up, settings) = upstream(args, &field, u, spec.price.as_ref(), reuse).await?;
            if let Some(s) = settings {
                reloads.push((up.clone(), s));
            }
            ups.push(up);
        }
        tiers.push(Tier {
            name: name.clone(),
            upstreams: ups,
            latency_budget_ms: spec.latency_budget_ms,
        });
    }
    for (up, s) in reloads {
        up.app.gov.reload(s);
    }
    Ok(Live { file, text, tiers })
}

/// Reloads the tiers file; the version in force stays when it is invalid.
async fn reload(r: &Arc<TierRouter>) -> Result<String, String> {
    // One change at a time: two builds from one snapshot would start two
    // governors for one new upstream.
    let _one = r.changes.lock().await;
    let result = async {
        let read = read_file(&r.path)?;
        let live = build(&r.args, read, Some(&r.live())).await?;
        let v = live.file.version.clone();
        r.swap(live);
        Ok::<_, StartError>(v)
    }
    .await
    .map_err(|e| e.to_string());
    let outcome = if result.is_ok() { "ok" } else { "rejected" };
    r.metrics
        .reloads
        .get_or_create(&labels(&[("outcome", outcome)]))
        .inc();
    match &result {
        Ok(v) => tracing::info!("tiers reloaded: version {v}"),
        Err(e) => tracing::error!("tiers reload REJECTED, keeping the last good version: {e}"),
    }
    result
}

fn admin_refusal(r: &TierRouter, req: &Request, post: bool) -> Option<Response> {
    if !envelope_governor::proxy::admin_allowed(&r.live().front(), req) {
        return Some(
            GovernError::Forbidden(envelope_governor::proxy::ADMIN_DENIED.into()).into_response(),
        );
    }
    if post && envelope_governor::proxy::from_a_browser(req.headers()) {
        return Some(
            GovernError::Forbidden(
                "admin POSTs are refused from browsers (Origin or Sec-Fetch-* present)".into(),
            )
            .into_response(),
        );
    }
    None
}

async fn metrics(State(r): State<Arc<TierRouter>>) -> Response {
    let live = r.live();
    let mut parts = vec![(vec![], r.metrics.render())];
    for (t, i, u) in live.all_upstreams() {
        parts.push((
            labels(&[("tier", &t.name), ("upstream", &i.to_string())]),
            u.app.gov.render_metrics(),
        ));
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        merge(&parts),
    )
        .into_response()
}

async fn models(State(r): State<Arc<TierRouter>>) -> Response {
    let live = r.live();
    let data: Vec<_> = live
        .tiers
        .iter()
        .map(|t| json!({"id": t.name, "object": "model", "owned_by": "envelope-tiers"}))
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

fn state_json(r: &TierRouter) -> serde_json::Value {
    let live = r.live();
    let tiers: Vec<_> = live
        .tiers
        .iter()
        .map(|t| {
            let ups: Vec<_> = t
                .upstreams
                .iter()
                .map(|u| {
                    json!({"url": u.spec.url, "model": u.spec.model,
                           "profile": u.spec.profile.display().to_string(),
                           "conservative": u.conservative,
                           "fullness": u.app.gov.fullness(),
                           "state": u.app.gov.state_json()})
                })
                .collect();
            json!({"name": t.name, "latency_budget_ms": t.latency_budget_ms, "upstreams": ups})
        })
        .collect();
    let book = r.book.lock().unwrap_or_else(|e| e.into_inner());
    let costs: Vec<_> = book
        .rows()
        .map(|((f, t), row)| json!({"feature": f, "tier": t, "row": row}))
        .collect();
    let over: Vec<_> = book
        .over_budget(&live.file.features)
        .into_iter()
        .map(|(f, c, a)| json!({"feature": f, "cost_per_call": c, "allowed": a}))
        .collect();
    let per_call = book.cost_per_call();
    drop(book);
    let shadow: Vec<_> = r
        .shadow
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|((t, f, why), a)| {
            let rate = (a.compared > 0).then(|| a.agreed as f64 / a.compared as f64);
            json!({"tier": t, "feature": f, "reason": why, "compared": a.compared,
                   "agreed": a.agreed, "agreement": rate, "skipped": a.skipped})
        })
        .collect();
    json!({
        "version": live.file.version,
        "prices_version": live.file.prices_version,
        "restorable": r.history(),
        "tiers": tiers,
        "costs": costs,
        "cost_per_call": per_call,
        "over_budget": over,
        "shadow": shadow,
        "cache": {"enabled": r.cache().is_some(), "entries": r.cache().map(|c| c.entries())},
    })
}

async fn admin_state(State(r): State<Arc<TierRouter>>, req: Request) -> Response {
    if let Some(no) = admin_refusal(&r, &req, false) {
        return no;
    }
    axum::Json(state_json(&r)).into_response()
}

async fn admin_costs(State(r): State<Arc<TierRouter>>, req: Request) -> Response {
    if let Some(no) = admin_refusal(&r, &req, false) {
        return no;
    }
    let csv = r.book.lock().unwrap_or_else(|e| e.into_inner()).csv();
    ([(axum::http::header::CONTENT_TYPE, "text/csv")], csv).into_response()
}

fn refused_change(message: String, code: &str) -> Response {
    (
        StatusCode::UNPROCESSABLE_ENTITY,
        axum::Json(
            json!({"error": {"message": message, "type": "invalid_request_error",
                                    "param": null, "code": code}}),
        ),
    )
        .into_response()
}

async fn admin_reload(State(r): State<Arc<TierRouter>>, req: Request) -> Response {
    if let Some(no) = admin_refusal(&r, &req, true) {
        return no;
    }
    match reload(&r).await {
        Ok(v) => axum::Json(json!({"reloaded": true, "version": v})).into_response(),
        Err(e) => refused_change(e, "invalid_tiers"),
    }
}

async fn admin_rollback(State(r): State<Arc<TierRouter>>, req: Request) -> Response {
    if let Some(no) = admin_refusal(&r, &req, true) {
        return no;
    }
    let result = {
        let _one = r.changes.lock().await;
        r.rollback()
    };
    let outcome = if result.is_ok() {
        "rollback"
    } else {
        "rollback_refused"
    };
    r.metrics
        .reloads
        .get_or_create(&labels(&[("outcome", outcome)]))
        .inc();
    match result {
        Ok(v) => {
            tracing::warn!("tiers rolled back to version {v}");
            axum::Json(json!({"rolled_back": true, "version": v})).into_response()
        }
        Err(e) => refused_change(e, "nothing_to_restore"),
    }
}

async fn not_found(State(r): State<Arc<TierRouter>>, req: Request) -> Response {
    let e = GovernError::NotFound(format!(
        "{} {}: with model tiers the governor answers the two completion endpoints, /v1/models, /metrics and /admin/tiers",
        req.method(),
        req.uri().path()
    ));
    call::refuse(&r, e)
}

pub(super) fn app(r: Arc<TierRouter>) -> axum::Router {
    envelope_governor::front_door::governed_routes::<TierRouter>()
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/admin/tiers", get(admin_state))
        .route("/admin/tiers/costs", get(admin_costs))
        .route("/admin/tiers/reload", post(admin_reload))
        .route("/admin/tiers/rollback", post(admin_rollback))
        .fallback(not_found)
        .with_state(r)
}

/// The files whose change reloads: the tiers file, every profile, the
/// tenants file.
fn watched(r: &TierRouter) -> Vec<PathBuf> {
    let live = r.live();
    std::iter::once(r.path.clone())
        .chain(live.all_upstreams().map(|(_, _, u)| u.spec.profile.clone()))
        .chain(r.args.tenants.clone())
        .collect()
}

async fn run_async(args: GovernArgs, path: PathBuf) -> Result<(), StartError> {
    let read = read_file(&path)?;
    let listen = args.listen();
    let live = build(&args, read, None).await?;
    for t in &live.tiers {
        let ups: Vec<String> = t
            .upstreams
            .iter()
            .map(|u| format!("{} ({})", u.spec.url, u.app.gov.settings().profile_id))
            .collect();
        tracing::info!("tier {}: {}", t.name, ups.join(", "));
    }
    let drain_timeout = args.drain_timeout();
    let router = TierRouter::new(path, args, live);
    tracing::info!("model tiers: version {}", router.live().file.version);
    let recorder = envelope_governor::recorder::Recorder::start_if(
        router.args.record_settings()?,
        &router.metrics.records_written,
        &router.metrics.records_dropped,
    )?;
    if let Some(rec) = &recorder {
        let _ = router.recorder.set(rec.clone());
    }
    {
        let r = router.clone();
        let w = router.clone();
        tokio::spawn(envelope_governor::signals::reload_on_change(
            move || watched(&w),
            move || {
                let r = r.clone();
                async move {
                    let _ = reload(&r).await;
                }
            },
        ));
    }
    let listener = envelope_governor::proxy::bind_and_announce(&listen).await?;
    let s = router.live().front();
    let limits = (
        s.front.max_connections,
        Duration::from_millis(s.front.header_read_timeout_ms),
    );
    let r = router.clone();
    let shutdown = async move {
        envelope_governor::signals::shutdown_requested().await;
        r.start_draining();
        let live = r.live();
        let drains = live
            .all_upstreams()
            .map(|(_, _, u)| u.app.gov.clone())
            .map(|g| async move { g.drain(drain_timeout).await });
        futures::future::join_all(drains).await;
        tracing::info!("drained");
    };
    envelope_governor::proxy::serve_router(listener, app(router.clone()), router, limits, shutdown)
        .await?;
    if let Some(rec) = recorder {
        rec.flush(Duration::from_secs(5));
    }
    Ok(())
}
