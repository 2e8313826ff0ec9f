//! `--engine-metrics`: the upstream engine's own `/metrics`, fetched every
//! interval and served on the governor's `/metrics` after the governor's
//! series. An endpoint picker that scrapes the pod's port (the governor's)
//! then still finds the engine's series it reads besides load (vLLM's LoRA
//! and cache-config info), and the engine's waiting count feeds
//! `envelope_governor_pod_queued_requests` at the poller's pace rather than
//! the live guard's.
//!
//! The page is Prometheus' classic text format (0.0.4), which engines
//! serve and pickers parse: the governor's own OpenMetrics part is
//! rewritten to it ([`to_classic_text`]).

use crate::admission::Governor;
use envelope_telemetry::MetricsClient;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// The content type of a page in the classic text format.
pub const CLASSIC_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The latest page the poller fetched.
pub struct EngineMetrics {
    latest: RwLock<Option<(Arc<str>, Instant)>>,
    /// Older than this, a page is not served (a picker must not route on
    /// an engine's old numbers as if they were current).
    stale_after: Duration,
}

impl EngineMetrics {
    /// Starts a poller of `url` every `interval`, until the runtime ends.
    pub fn spawn(gov: Arc<Governor>, url: &str, interval: Duration) -> Arc<EngineMetrics> {
        let me = Arc::new(EngineMetrics {
            latest: RwLock::new(None),
            stale_after: (interval * 10).max(Duration::from_secs(1)),
        });
        let timeout = (interval * 4).max(Duration::from_millis(500));
        let client = match MetricsClient::new(url, timeout) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("--engine-metrics: {e}; the engine's series are not served");
                return me;
            }
        };
        let poller = me.clone();
        tokio::spawn(async move {
            let mut failing: Option<String> = None;
            loop {
                let page = client.text().await;
                // A page that is not Prometheus text (an error page with a
                // 200) is not passed on: appended to the governor's, it
                // would make the picker reject the whole page and read the
                // pod as stale, hence saturated.
                let parsed =
                    page.and_then(|text| match envelope_telemetry::parse_engine_state(&text) {
                        Ok(state) => Ok((text, state.waiting)),
                        Err(envelope_telemetry::MetricsError::UnknownEngine) => Ok((text, None)),
                        Err(e) => Err(e),
                    });
                match parsed {
                    Ok((text, waiting)) => {
                        gov.note_engine_waiting(waiting);
                        poller.store(text);
                        if failing.take().is_some() {
                            tracing::info!("--engine-metrics: {} answers again", client.url());
                        }
                    }
                    Err(e) => {
                        // The last count holds while its page is served;
                        // past that it is unknown, as the page is.
                        if poller.fresh().is_none() {
                            gov.note_engine_waiting(None);
                        }
                        let e = e.to_string();
                        if failing.as_deref() != Some(&e) {
                            tracing::warn!(
                                "--engine-metrics: {e}; the engine's series are left out once its last page is {} ms old",
                                poller.stale_after.as_millis()
                            );
                            failing = Some(e);
                        }
                    }
                }
                tokio::time::sleep(interval).await;
            }
        });
        me
    }

    fn store(&self, text: String) {
        *self.latest.write().unwrap_or_else(|e| e.into_inner()) =
            Some((text.into(), Instant::now()));
    }

    /// The latest page, unless it is older than the staleness bound.
    pub fn fresh(&self) -> Option<Arc<str>> {
        let latest = self.latest.read().unwrap_or_else(|e| e.into_inner());
        match &*latest {
            Some((text, at)) if at.elapsed() <= self.stale_after => Some(text.clone()),
            _ => None,
        }
    }
}

/// The governor's page and the engine's, as one page in the classic text
/// format (an engine that serves OpenMetrics, as `envelope serve` does, is
/// rewritten too; one that serves the classic format is kept as it is).
pub fn combined_page(governor_openmetrics: &str, engine: Option<&str>) -> String {
    let mut out = to_classic_text(governor_openmetrics);
    match engine {
        Some(e) if e.lines().any(|l| l.trim() == "# EOF") => out.push_str(&to_classic_text(e)),
        Some(e) => {
            out.push_str(e);
            if !e.is_empty() && !e.ends_with('\n') {
                out.push('\n');
            }
        }
        None => {}
    }
    out
}

/// An OpenMetrics page (as `prometheus-client` writes it) in the classic
/// text format: a counter family `x` is named `x_total` as its samples are,
/// `info` becomes a gauge named `x_info`, types the classic format lacks
/// become `untyped`, and `# UNIT` and `# EOF` go.
pub fn to_classic_text(openmetrics: &str) -> String {
    // The family named by a `# TYPE` line comes after its `# HELP`, so the
    // types are read first.
    let mut renamed: Vec<(&str, String, &str)> = vec![];
    for line in openmetrics.lines() {
        let mut words = line.splitn(4, ' ');
        if let (Some("#"), Some("TYPE"), Some(name), Some(kind)) =
            (words.next(), words.next(), words.next(), words.next())
        {
            let (new_name, new_kind) = match kind {
                "counter" => (format!("{name}_total"), "counter"),
                "info" => (format!("{name}_info"), "gauge"),
                "gauge" | "histogram" | "summary" => (name.to_string(), kind),
                _ => (name.to_string(), "untyped"),
            };
            renamed.push((name, new_name, new_kind));
        }
    }
    let family = |name: &str| renamed.iter().find(|(n, _, _)| *n == name);
    let mut out = String::with_capacity(openmetrics.len() + 64 * renamed.len());
    for line in openmetrics.lines() {
        let mut words = line.splitn(4, ' ');
        match (words.next(), words.next(), words.next(), words.next()) {
            (Some("#"), Some("EOF" | "UNIT"), _, _) => continue,
            (Some("#"), Some("TYPE"), Some(name), _) => {
                if let Some((_, n, k)) = family(name) {
                    out.push_str(&format!("# TYPE {n} {k}\n"));
                    continue;
                }
            }
            (Some("#"), Some("HELP"), Some(name), rest) => {
                if let Some((_, n, _)) = family(name) {
                    out.push_str(&format!("# HELP {n} {}\n", rest.unwrap_or("")));
                    continue;
                }
            }
            _ => {}
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const OM: &str = "# HELP envelope_governor_rejections Requests refused, by reason.
# TYPE envelope_governor_rejections counter
envelope_governor_rejections_total{reason=\"queue_full\"} 3
# HELP envelope_governor_saturation How full.
# TYPE envelope_governor_saturation gauge
envelope_governor_saturation 0.5
# HELP envelope_governor_build Build.
# TYPE envelope_governor_build info
envelope_governor_build_info{version=\"1\"} 1
# HELP envelope_governor_queue_age Seconds queued.
# TYPE envelope_governor_queue_age histogram
# UNIT envelope_governor_queue_age seconds
envelope_governor_queue_age_sum 0.0
envelope_governor_queue_age_count 0
envelope_governor_queue_age_bucket{le=\"+Inf\"} 0
# TYPE envelope_governor_odd stateset
envelope_governor_odd{envelope_governor_odd=\"a\"} 1
# EOF
";

    /// Every sample line belongs to the family its last `# TYPE` named.
    fn samples_follow_their_type(page: &str) {
        let mut family = "";
        for line in page.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                family = rest.split(' ').next().unwrap();
            } else if !line.starts_with('#') {
                assert!(line.starts_with(family), "{line} after TYPE {family}");
            }
        }
    }

    #[test]
    fn each_family_is_named_as_its_samples_in_the_classic_format() {
        let t = to_classic_text(OM);
        assert!(!t.contains("# EOF") && !t.contains("# UNIT"), "{t}");
        assert!(t.contains("# HELP envelope_governor_rejections_total Requests refused, by reason.\n# TYPE envelope_governor_rejections_total counter\nenvelope_governor_rejections_total{reason=\"queue_full\"} 3\n"), "{t}");
        assert!(t.contains(
            "# TYPE envelope_governor_saturation gauge\nenvelope_governor_saturation 0.5\n"
        ));
        assert!(
            t.contains("# TYPE envelope_governor_build_info gauge\nenvelope_governor_build_info{")
        );
        assert!(t.contains(
            "# TYPE envelope_governor_queue_age histogram\nenvelope_governor_queue_age_sum"
        ));
        assert!(t.contains("# TYPE envelope_governor_odd untyped\n"));
        samples_follow_their_type(&t);
    }

    #[test]
    fn the_governors_own_page_converts_whole() {
        // The real registry: every sample under its family's TYPE, and no
        // exemplar (` # {...}` after a value), which the classic format
        // lacks and a picker's parser would reject the page for.
        let m = crate::metrics::Metrics::new();
        m.reject("queue_full");
        let page = m.render();
        // Without --engine-metrics the OpenMetrics page itself is served,
        // and llm-d's picker reads it with expfmt's classic parser, which
        // takes `# EOF`/`# UNIT` as comments and a counter's `_total`
        // samples as a family of their own, but refuses a type it does not
        // know: no `info` or `stateset` family may appear.
        for kind in ["info", "stateset"] {
            assert!(
                !page
                    .lines()
                    .any(|l| l.starts_with("# TYPE ") && l.ends_with(&format!(" {kind}"))),
                "{page}"
            );
        }
        let t = to_classic_text(&page);
        assert!(!t.contains(" # {"), "{t}");
        assert!(
            t.contains("# TYPE envelope_governor_rejections_total counter\n"),
            "{t}"
        );
        assert!(
            t.contains("# TYPE envelope_governor_saturation gauge\n"),
            "{t}"
        );
        samples_follow_their_type(&t);
    }

    #[test]
    fn the_engines_page_follows_without_its_eof() {
        // vLLM serves the classic format: kept as it is.
        let engine = "# TYPE vllm:request_success_total counter\nvllm:request_success_total{model_name=\"m\"} 2.0";
        let page = combined_page(OM, Some(engine));
        assert!(page.ends_with(&format!("{engine}\n")), "{page}");
        // An OpenMetrics engine is rewritten as the governor's part is.
        let om_engine = "# TYPE envelope:requests counter\nenvelope:requests_total 2\n# EOF\n";
        let page = combined_page(OM, Some(om_engine));
        assert!(
            page.ends_with("# TYPE envelope:requests_total counter\nenvelope:requests_total 2\n"),
            "{page}"
        );
        assert!(!page.contains("# EOF"));
        assert_eq!(combined_page(OM, None), to_classic_text(OM));
    }
}
