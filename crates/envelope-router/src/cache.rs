//! Answers to deterministic calls, kept for repeats: keyed by tenant, tier,
//! model and the request's bytes, bounded in bytes, each kept for a TTL
//! (moka's cache does the bounding and expiry). Only a call that cannot
//! sample is cacheable: temperature 0, or marked cacheable by the caller
//! with no sampling setting above zero; never `n > 1`.

use bytes::Bytes;
use serde_json::{Map, Value};
use std::time::Duration;

/// The header a caller marks a call cacheable with.
pub const CACHEABLE_HEADER: &str = "x-envelope-cacheable";

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Key {
    pub tenant: String,
    pub tier: String,
    /// The model and whatever else shapes the answer (endpoint, upstreams).
    pub model: String,
    pub request: Bytes,
}

/// A whole 2xx answer.
#[derive(Debug, Clone)]
pub struct Cached {
    pub content_type: String,
    pub body: Bytes,
    /// The tier that gave the answer.
    pub tier: String,
}

pub struct AnswerCache {
    inner: moka::sync::Cache<Key, Cached>,
}

/// Whether a call with `body` (and the caller's mark) is deterministic.
pub fn cacheable(body: &Map<String, Value>, marked: bool) -> bool {
    let num = |k: &str| body.get(k).and_then(Value::as_f64);
    let int = |k: &str| body.get(k).and_then(Value::as_u64).unwrap_or(1);
    if int("n") > 1 || int("best_of") > 1 {
        return false;
    }
    match num("temperature") {
        Some(0.0) => true,
        // A positive temperature samples, whatever the mark says.
        Some(_) => false,
        // No temperature: servers default to sampling, so only the mark
        // makes it cacheable.
        None => marked,
    }
}

impl AnswerCache {
    pub fn new(max_bytes: u64, ttl: Duration) -> AnswerCache {
        AnswerCache {
            inner: moka::sync::Cache::builder()
                .max_capacity(max_bytes)
                .weigher(|k: &Key, v: &Cached| {
                    let n = k.request.len() + k.tenant.len() + k.model.len() + v.body.len() + 64;
                    u32::try_from(n).unwrap_or(u32::MAX)
                })
                .time_to_live(ttl)
                .build(),
        }
    }

    pub fn get(&self, k: &Key) -> Option<Cached> {
        self.inner.get(k)
    }

    pub fn put(&self, k: Key, v: Cached) {
        self.inner.insert(k, v);
    }

    /// Entries held now (after pending expiry and eviction work).
    pub fn entries(&self) -> u64 {
        self.inner.run_pending_tasks();
        self.inner.entry_count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn only_calls_that_cannot_sample_are_cacheable() {
        assert!(cacheable(&obj(json!({"temperature": 0})), false));
        assert!(cacheable(&obj(json!({"temperature": 0.0})), true));
        assert!(!cacheable(&obj(json!({"temperature": 0.7})), true));
        assert!(!cacheable(&obj(json!({})), false));
        assert!(cacheable(&obj(json!({})), true));
        assert!(!cacheable(&obj(json!({"temperature": 0, "n": 2})), true));
    }

    #[test]
    fn entries_are_bounded_by_bytes_and_expire() {
        let key = |i: u8| Key {
            tenant: "t".into(),
            tier: "small".into(),
            model: "m".into(),
            request: Bytes::from(vec![i; 100]),
        };
        let val = Cached {
            content_type: "application/json".into(),
            body: Bytes::from(vec![0u8; 800]),
            tier: "small".into(),
        };
        let c = AnswerCache::new(10_000, Duration::from_secs(60));
        for i in 0..50 {
            c.put(key(i), val.clone());
        }
        // About a kilobyte each: no more than ten fit.
        assert!(c.entries() <= 10, "{}", c.entries());
        let c = AnswerCache::new(10_000, Duration::from_millis(50));
        c.put(key(1), val.clone());
        assert!(c.get(&key(1)).is_some());
        assert!(c.get(&key(2)).is_none());
        std::thread::sleep(Duration::from_millis(120));
        assert!(c.get(&key(1)).is_none());
    }
}
