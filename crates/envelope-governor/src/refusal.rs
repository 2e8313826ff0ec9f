//! Every refusal the governor writes, in either mode (one upstream, or
//! model tiers), goes through [`refuse`]: counted by reason, logged (429s
//! and 5xx at info, the rest at debug), and answered as the OpenAI-shaped
//! error of [`GovernError`] with its headers. [`charged_to`] then names
//! the tenant and class on every governed answer, refused or not, so a
//! client reads the same refusal whichever mode it is behind.

use crate::error::GovernError;
use crate::identity::Identity;
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

pub const TENANT_HEADER: HeaderName = HeaderName::from_static("x-envelope-tenant");
pub const CLASS_HEADER: HeaderName = HeaderName::from_static(crate::identity::CLASS_HEADER);

/// Where refusals are counted by reason: one family,
/// `envelope_governor_rejections_total{mode, reason}`, counted by the
/// governor over one upstream (`single`) or the tiers' router (`tiers`).
pub trait RefusalCounter {
    fn count_refusal(&self, reason: &'static str);
}

impl RefusalCounter for crate::metrics::Metrics {
    fn count_refusal(&self, reason: &'static str) {
        self.reject(reason);
    }
}

/// Counts, logs and answers a refusal.
pub fn refuse(counter: &dyn RefusalCounter, e: GovernError) -> Response {
    counter.count_refusal(e.reason());
    let status = e.status();
    if status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS {
        tracing::info!(
            reason = e.reason(),
            status = status.as_u16(),
            "refused: {e}"
        );
    } else {
        tracing::debug!(
            reason = e.reason(),
            status = status.as_u16(),
            "refused: {e}"
        );
    }
    e.into_response()
}

/// The tenant's name as a header value (none for a name that is not one).
pub fn tenant_value(tenant: &str) -> Option<HeaderValue> {
    if tenant == crate::identity::DEFAULT_TENANT {
        return Some(HeaderValue::from_static(crate::identity::DEFAULT_TENANT));
    }
    HeaderValue::from_str(tenant).ok()
}

/// Names whom a governed answer was charged to: `x-envelope-tenant` and
/// `x-envelope-class`.
pub fn charged_to(r: &mut Response, who: &Identity) {
    let h = r.headers_mut();
    if let Some(v) = tenant_value(&who.tenant) {
        h.insert(TENANT_HEADER, v);
    }
    h.insert(CLASS_HEADER, HeaderValue::from_static(who.class.label()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_tenant_and_others_are_header_values() {
        assert_eq!(tenant_value("default").unwrap(), "default");
        assert_eq!(tenant_value("team-a").unwrap(), "team-a");
        assert!(tenant_value("bad\nname").is_none());
    }
}
