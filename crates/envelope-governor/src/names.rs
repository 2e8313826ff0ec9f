//! The names clients and files give: tenants and feature tags (bounded,
//! so they are safe as metric labels and store keys). A leaf module.

pub const MAX_TENANT_NAME: usize = 64;

/// A tenant name from a trusted header: 1 to 64 of `A-Z a-z 0-9 . _ - : @`.
pub fn valid_tenant_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_TENANT_NAME
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-:@".contains(&b))
}

/// Feature names in headers and labels.
pub const MAX_FEATURE_NAME: usize = 64;

pub fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_FEATURE_NAME
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-:@/".contains(&b))
}
