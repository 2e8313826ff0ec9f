//! Warm buckets: the shared prefix a sweep's bucket meant the server to
//! cache, and what the server made of it.

use super::BucketResult;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A warm bucket's prefix (`INPUTxOUTPUT@P%` in the sweep's buckets): the
/// share of every prompt its probes shared, and what the server made of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CachedPrefix {
    /// The share of each prompt that was the shared prefix (0..1).
    pub intended_share: f64,
    /// Prompt tokens the server found in its prefix cache over those it
    /// looked up, over the bucket's probes (weighted by their requests);
    /// `None` where the server told neither by counters nor in its answers.
    pub observed_hit_rate: Option<f64>,
    /// The server's hits reached at least [`CachedPrefix::HELD_FRACTION`]
    /// of the intended share: the bucket was measured warm. False: it was
    /// measured all the same, and is said to be cold (a server without a
    /// prefix cache, or one that does not say), never counted as warm.
    pub held: bool,
}

impl CachedPrefix {
    /// The share of the intended hits a server must reach for the bucket to
    /// count as warm: a server caches whole blocks (vLLM's CPU build 128
    /// tokens), so a 75% prefix of 256 tokens is found as 50%.
    pub const HELD_FRACTION: f64 = 0.5;

    /// The check of a bucket meant to be `intended_share` cached, whose
    /// server reported `observed` (`None`: nothing).
    pub fn judged(intended_share: f64, observed: Option<f64>) -> CachedPrefix {
        CachedPrefix {
            intended_share,
            observed_hit_rate: observed,
            held: observed.is_some_and(|o| o >= Self::HELD_FRACTION * intended_share),
        }
    }

    /// The share as a whole percent, as the bucket was written.
    pub fn percent(&self) -> u8 {
        (self.intended_share * 100.0).round().clamp(0.0, 100.0) as u8
    }
}

impl BucketResult {
    /// `1024x32`, or `1024x32@85%` for a warm bucket.
    pub fn label(&self) -> String {
        match &self.cached_prefix {
            None => format!("{}x{}", self.input_tokens, self.output_tokens),
            Some(c) => format!(
                "{}x{}@{}%",
                self.input_tokens,
                self.output_tokens,
                c.percent()
            ),
        }
    }

    /// A cold bucket: every prompt distinct. Only these make the limits
    /// the governor enforces and the figures the gate compares.
    pub fn is_cold(&self) -> bool {
        self.cached_prefix.is_none()
    }
}
