//! Who a request is charged to, and in which class. The tenant comes from
//! the header a trusted front proxy sets (when the tenants file names one
//! and the request carries it), else from the API key (when any are
//! configured, a request without a known key is refused with 401), else
//! from an endpoint picker's fairness id (`fairness_header`) when it names
//! a listed tenant, else it is `default`; whatever else a client writes
//! (`x-envelope-tenant`, an invented fairness id) counts for nothing. The
//! class is the client's `x-envelope-class` if the tenant may use it (else
//! 403), else the class of the picker's objective (`objective_classes`) if
//! the tenant may use it, else the tenant's first allowed class.

use crate::error::GovernError;
use crate::queue::Class;
use crate::settings::{valid_tenant_name, TenantsSettings, MAX_TENANT_NAME};
use axum::http::header::AUTHORIZATION;
use axum::http::{HeaderMap, HeaderName};

pub const CLASS_HEADER: &str = "x-envelope-class";
/// [`CLASS_HEADER`] as a name (looking up by text parses it each time).
const CLASS_NAME: HeaderName = HeaderName::from_static(CLASS_HEADER);
/// The feature a call is for (budgets per feature, cost per feature).
pub const FEATURE_HEADER: &str = "x-envelope-feature";
/// The conversation (agent run, session) a call belongs to: model tiers
/// keep an escalated conversation on the tier up; `--record` writes it as
/// the trace's session.
pub const CONVERSATION_HEADER: &str = "x-envelope-conversation";
/// llm-d's objective header, read for `objective_classes` unless the
/// tenants file names another (`objective_header`).
pub const OBJECTIVE_HEADER: &str = "x-llm-d-inference-objective";

pub use crate::names::{valid_name, MAX_FEATURE_NAME};

/// The tenant of requests without a trusted header or an API key.
pub const DEFAULT_TENANT: &str = "default";

/// A request's tenant and class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub tenant: String,
    pub class: Class,
}

fn bearer(h: &HeaderMap) -> Option<&str> {
    let v = h.get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, key) = v.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
}

/// The tenant of a request.
///
/// # Errors
/// 401 when API keys are configured and the request has none that is
/// known; 400 when the trusted header holds no valid tenant name.
pub fn tenant(t: &TenantsSettings, h: &HeaderMap) -> Result<String, GovernError> {
    if let Some(name) = t.trusted_header.as_deref().and_then(|n| h.get(n)) {
        let name = name.to_str().unwrap_or("").trim();
        if !valid_tenant_name(name) {
            return Err(GovernError::invalid(
                None,
                format!(
                    "the tenant header must hold 1 to {MAX_TENANT_NAME} of A-Z a-z 0-9 . _ - : @"
                ),
            ));
        }
        return Ok(name.to_string());
    }
    if !t.keys_required() {
        let listed = t
            .fairness_header
            .as_deref()
            .and_then(|n| h.get(n))
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|id| t.tenants.contains_key(*id));
        return Ok(listed.unwrap_or(DEFAULT_TENANT).to_string());
    }
    match bearer(h) {
        None => Err(GovernError::Unauthorized(
            "this server needs an API key: send `Authorization: Bearer <key>`".into(),
        )),
        Some(key) => t.tenant_of_key(key).map(str::to_string).ok_or_else(|| {
            GovernError::Unauthorized("the API key given is not known to this server".into())
        }),
    }
}

/// The class of a request of `tenant`.
///
/// # Errors
/// 400 for a class header that is neither `interactive` nor `batch`; 403
/// for a class the tenant may not use.
pub fn class(t: &TenantsSettings, tenant: &str, h: &HeaderMap) -> Result<Class, GovernError> {
    let allowed = t.classes_of(tenant);
    let Some(v) = h.get(CLASS_NAME) else {
        // Most requests: no class header and no objectives configured; a
        // lookup by text parses the name, so none is made then.
        if t.objective_classes.is_empty() {
            return Ok(allowed[0]);
        }
        let objective = t.objective_header.as_deref().unwrap_or(OBJECTIVE_HEADER);
        let picked = h
            .get(objective)
            .and_then(|v| v.to_str().ok())
            .and_then(|o| t.objective_classes.get(o.trim()))
            .filter(|c| allowed.contains(c));
        return Ok(picked.copied().unwrap_or(allowed[0]));
    };
    let c = v.to_str().ok().and_then(Class::parse).ok_or_else(|| {
        GovernError::invalid(
            None,
            format!("header {CLASS_HEADER} must be interactive or batch"),
        )
    })?;
    if !allowed.contains(&c) {
        let list: Vec<&str> = allowed.iter().map(|c| c.label()).collect();
        return Err(GovernError::Forbidden(format!(
            "tenant `{tenant}` may not use class `{}` (allowed: {})",
            c.label(),
            list.join(", ")
        )));
    }
    Ok(c)
}

/// Both, for a request's headers.
pub fn identify(t: &TenantsSettings, h: &HeaderMap) -> Result<Identity, GovernError> {
    let tenant = tenant(t, h)?;
    let class = class(t, &tenant, h)?;
    Ok(Identity { tenant, class })
}

/// A header's value as a name (feature, hint, conversation).
pub fn named(h: &HeaderMap, header: &str) -> Result<Option<String>, GovernError> {
    match h.get(header) {
        None => Ok(None),
        Some(v) => {
            let s = v.to_str().unwrap_or("").trim();
            if valid_name(s) {
                Ok(Some(s.to_string()))
            } else {
                Err(GovernError::invalid(
                    None,
                    format!("header {header} must hold 1 to 64 of A-Z a-z 0-9 . _ - : @ /"),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    fn file(text: &str) -> TenantsSettings {
        TenantsSettings::from_toml(text, "t.toml").unwrap()
    }

    #[test]
    fn a_client_named_tenant_counts_for_nothing() {
        let t = TenantsSettings::default();
        let h = headers(&[("x-envelope-tenant", "alice")]);
        assert_eq!(tenant(&t, &h).unwrap(), DEFAULT_TENANT);
    }

    #[test]
    fn a_pickers_fairness_id_names_a_listed_tenant_unless_a_key_does() {
        let fair = "fairness_header = \"x-llm-d-inference-fairness-id\"\n";
        let t = file(&format!("{fair}[tenants.team-a]\nguaranteed = 0.5\n"));
        let id = |v: &str| headers(&[("x-llm-d-inference-fairness-id", v)]);
        assert_eq!(tenant(&t, &id("team-a")).unwrap(), "team-a");
        assert_eq!(tenant(&t, &id(" team-a ")).unwrap(), "team-a");
        // An id no tenant has (the picker's own `default-flow`, or one a
        // client made up) is charged to `default`, not refused.
        for other in ["default-flow", "team-b", "", "a b"] {
            assert_eq!(tenant(&t, &id(other)).unwrap(), DEFAULT_TENANT, "{other}");
        }
        // With API keys the key decides, and the id is no credential.
        let keyed = file(&format!(
            "{fair}[tenants.team-a]\napi_keys = [\"sk-a\"]\n[tenants.team-b]\napi_keys = [\"sk-b\"]\n"
        ));
        let mut h = id("team-b");
        h.insert("authorization", HeaderValue::from_static("Bearer sk-a"));
        assert_eq!(tenant(&keyed, &h).unwrap(), "team-a");
        assert_eq!(
            tenant(&keyed, &id("team-b")).unwrap_err().status().as_u16(),
            401
        );
        // Without `fairness_header` the header is nothing.
        let plain = file("[tenants.team-a]\nguaranteed = 0.5\n");
        assert_eq!(tenant(&plain, &id("team-a")).unwrap(), DEFAULT_TENANT);
    }

    #[test]
    fn an_objective_gives_the_class_a_tenant_may_use() {
        let t = file(
            "[objective_classes]\nnightly-summaries = \"batch\"\nchat = \"interactive\"\n[tenants.batchy]\nclasses = [\"batch\"]\n",
        );
        let obj = |v: &str| headers(&[("x-llm-d-inference-objective", v)]);
        assert_eq!(
            class(&t, "default", &obj("nightly-summaries")).unwrap(),
            Class::Batch
        );
        assert_eq!(
            class(&t, "default", &obj("chat")).unwrap(),
            Class::Interactive
        );
        assert_eq!(
            class(&t, "default", &obj("unknown")).unwrap(),
            Class::Interactive
        );
        // Not a class this tenant may use: its own first, not a 403 (the
        // objective is the gateway's word, not the client's).
        assert_eq!(class(&t, "batchy", &obj("chat")).unwrap(), Class::Batch);
        // The client's own class header comes first.
        let mut h = obj("nightly-summaries");
        h.insert("x-envelope-class", HeaderValue::from_static("interactive"));
        assert_eq!(class(&t, "default", &h).unwrap(), Class::Interactive);
        // Another header name, when the tenants file says so.
        let named =
            file("objective_header = \"X-Objective\"\n[objective_classes]\nnightly = \"batch\"\n");
        let h = headers(&[("x-objective", "nightly")]);
        assert_eq!(class(&named, "default", &h).unwrap(), Class::Batch);
        assert!(
            TenantsSettings::from_toml("[objective_classes]\n\"a b\" = \"batch\"\n", "t.toml")
                .unwrap_err()
                .contains("objective_classes")
        );
        assert!(
            TenantsSettings::from_toml("fairness_header = \"a b\"\n", "t.toml")
                .unwrap_err()
                .contains("fairness_header")
        );
    }

    #[test]
    fn keys_when_configured_are_required() {
        let t = file("[tenants.alice]\napi_keys = [\"sk-a\"]\n");
        assert_eq!(
            tenant(&t, &headers(&[("authorization", "Bearer sk-a")])).unwrap(),
            "alice"
        );
        assert_eq!(
            tenant(&t, &headers(&[("authorization", "bearer  sk-a ")])).unwrap(),
            "alice"
        );
        for h in [
            headers(&[]),
            headers(&[("authorization", "Bearer sk-b")]),
            headers(&[("authorization", "sk-a")]),
            headers(&[("x-envelope-tenant", "alice")]),
        ] {
            assert_eq!(tenant(&t, &h).unwrap_err().status().as_u16(), 401);
        }
    }

    #[test]
    fn a_trusted_header_names_the_tenant() {
        let t = file("trusted_header = \"X-Tenant\"\n[tenants.alice]\napi_keys = [\"sk-a\"]\n");
        assert_eq!(tenant(&t, &headers(&[("x-tenant", "bob")])).unwrap(), "bob");
        let e = tenant(&t, &headers(&[("x-tenant", "bad name!")])).unwrap_err();
        assert_eq!(e.status().as_u16(), 400);
        // Without it, the key decides.
        assert_eq!(
            tenant(&t, &headers(&[("authorization", "Bearer sk-a")])).unwrap(),
            "alice"
        );
    }

    #[test]
    fn classes_are_the_tenants() {
        let t = file("default_classes = [\"batch\"]\n[tenants.alice]\nclasses = [\"interactive\", \"batch\"]\n");
        assert_eq!(class(&t, "default", &headers(&[])).unwrap(), Class::Batch);
        let e = class(&t, "default", &headers(&[(CLASS_HEADER, "interactive")])).unwrap_err();
        assert_eq!(e.status().as_u16(), 403);
        assert_eq!(
            class(&t, "alice", &headers(&[(CLASS_HEADER, "batch")])).unwrap(),
            Class::Batch
        );
        assert_eq!(
            class(&t, "alice", &headers(&[])).unwrap(),
            Class::Interactive
        );
        let e = class(&t, "alice", &headers(&[(CLASS_HEADER, "urgent")])).unwrap_err();
        assert_eq!(e.status().as_u16(), 400);
    }
}
