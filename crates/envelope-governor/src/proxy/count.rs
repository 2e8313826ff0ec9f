//! A request's prompt tokens before admission: at once on the default
//! path, or with a wait (an upstream `/tokenize` call, a long prompt
//! encoded off the event loop) bounded by a timeout and a cap.

use super::AppState;
use crate::error::GovernError;
use crate::request::{ParsedRequest, Prompts};
use crate::settings::Settings;
use crate::tokens::{self, CountSource};
use std::time::Duration;

/// Prompt tokens per group, within the count timeout and the cap on
/// requests counted at once; past the timeout, the bound estimate. Media
/// parts of a chat add their configured cost.
pub(crate) async fn count(
    s: &AppState,
    settings: &Settings,
    parsed: &ParsedRequest,
) -> Result<(Vec<u64>, CountSource), GovernError> {
    // Counts that take no waiting skip the timeout and the cap (a timer
    // and a semaphore a request on the default path). The waiting one is
    // boxed: its future (an upstream call, a timer) was 2.9 KB of the
    // 3.3 KB of `place`'s, which every request's future carries and
    // moves whole (rustc -Zprint-type-sizes).
    let (mut counts, source) = match s.counter.count_now(parsed) {
        Some(now) => now,
        None => Box::pin(count_waiting(s, settings, parsed)).await?,
    };
    if let Prompts::Messages(c) = &parsed.prompts {
        let media = c.media.images * settings.image_part_tokens
            + c.media.audio * settings.audio_part_tokens;
        if let Some(first) = counts.first_mut() {
            *first += media;
        }
    }
    Ok((counts, source))
}

/// The count that waits: an upstream `/tokenize` call or a long prompt
/// encoded off the event loop, within the count timeout and the cap on
/// requests counted at once; past the timeout, the bound estimate.
async fn count_waiting(
    s: &AppState,
    settings: &Settings,
    parsed: &ParsedRequest,
) -> Result<(Vec<u64>, CountSource), GovernError> {
    let timeout = Duration::from_millis(settings.count_timeout_ms);
    let counted = tokio::time::timeout(timeout, async {
        let _slot = s.counting.acquire().await;
        s.counter.count(parsed).await
    })
    .await;
    match counted {
        Ok(r) => r,
        Err(_) => {
            tracing::info!(
                "counting took over {} ms: the bound estimate counts",
                timeout.as_millis()
            );
            Ok((
                tokens::estimate(parsed, tokens::BOUND_BYTES_PER_TOKEN),
                CountSource::EstimateAfterTimeout,
            ))
        }
    }
}
