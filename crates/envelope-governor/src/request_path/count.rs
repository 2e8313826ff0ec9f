//! The counted stage: a request's prompt tokens before admission, at once
//! on the default path, or with a wait (an upstream `/tokenize` call, a
//! long prompt encoded off the event loop) bounded by a timeout and a cap.
//! Counted once: upstreams that count the same way reuse the count
//! ([`GovernedUpstream::counts_like`]).

use super::GovernedUpstream;
use crate::error::GovernError;
use crate::request::{ParsedRequest, Prompts};
use crate::settings::Settings;
use crate::tokens::{self, CountSource};
use std::time::Duration;

/// A request's prompt tokens per group, and how they were counted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Counted {
    pub counts: Vec<u64>,
    pub source: CountSource,
}

/// Prompt tokens per group, within the count timeout and the cap on
/// requests counted at once; past the timeout, the bound estimate. Media
/// parts of a chat add their configured cost.
pub(crate) async fn count(
    s: &GovernedUpstream,
    settings: &Settings,
    parsed: &ParsedRequest,
) -> Result<Counted, GovernError> {
    // Counts that take no waiting skip the timeout and the cap (a timer
    // and a semaphore a request on the default path). The waiting one is
    // boxed: its future (an upstream call, a timer) was most of
    // `place`'s, which every request's future carries and moves whole
    // (docs/measurements/2026-12-06-governor-code-figures.md).
    let (mut counts, source) = match s.counter.count_now(parsed) {
        Some(now) => now,
        None => Box::pin(count_waiting(s, settings, parsed)).await?,
    };
    if let Prompts::Messages(c) = &parsed.prompts {
        let media = c.media.images * settings.counting.image_part_tokens
            + c.media.audio * settings.counting.audio_part_tokens;
        if let Some(first) = counts.first_mut() {
            *first += media;
        }
    }
    Ok(Counted { counts, source })
}

/// The count that waits: an upstream `/tokenize` call or a long prompt
/// encoded off the event loop, within the count timeout and the cap on
/// requests counted at once; past the timeout, the bound estimate.
async fn count_waiting(
    s: &GovernedUpstream,
    settings: &Settings,
    parsed: &ParsedRequest,
) -> Result<(Vec<u64>, CountSource), GovernError> {
    let timeout = Duration::from_millis(settings.counting.count_timeout_ms);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::Governor;
    use crate::learnt_estimate::LearntEstimate;
    use crate::request::{parse, Endpoint};
    use crate::tokens::TokenCounter;
    use envelope_profile::Limits;
    use std::sync::Arc;

    fn upstream(
        counter: TokenCounter,
        image_part_tokens: u64,
    ) -> (GovernedUpstream, Arc<Settings>) {
        let mut l = Limits {
            max_context_tokens: 4096,
            max_output_tokens: 256,
            max_concurrent_seqs: 4,
            max_kv_tokens_in_flight: 16_384,
            buckets: vec![],
        };
        l.buckets = vec![l.single_row()];
        let mut settings = crate::settings::SettingsDraft::new(l, "p");
        settings.counting.image_part_tokens = image_part_tokens;
        let gov = Governor::new(settings.check().unwrap());
        let settings = gov.settings();
        (
            GovernedUpstream::new(gov, "http://127.0.0.1:9", counter),
            settings,
        )
    }

    fn estimate(bytes_per_token: f64) -> TokenCounter {
        TokenCounter::Estimate { bytes_per_token }
    }

    #[tokio::test]
    async fn an_upstream_that_counts_the_same_way_takes_the_count() {
        let text = parse(
            Endpoint::Completions,
            br#"{"prompt": "abcdefghijklmnopqrstuvwx"}"#,
        )
        .unwrap();
        let (first, fs) = upstream(estimate(4.0), 85);
        let counted = count(&first, &fs, &text).await.unwrap();
        let by = (&first, &*fs);
        // The same estimate: the count holds.
        let (same, ss) = upstream(estimate(4.0), 85);
        assert!(same.counts_like(&ss, &counted, by));
        // Another estimate: it does not, and its own count differs.
        let (other, os) = upstream(estimate(2.0), 85);
        assert!(!other.counts_like(&os, &counted, by));
        assert_ne!(count(&other, &os, &text).await.unwrap(), counted);
        // The same counter but another cost for an image part.
        let (media, ms) = upstream(estimate(4.0), 10);
        assert!(!media.counts_like(&ms, &counted, by));
        // Token ids count the same for everyone.
        let ids = parse(Endpoint::Completions, br#"{"prompt": [1, 2, 3]}"#).unwrap();
        let counted = count(&first, &fs, &ids).await.unwrap();
        assert!(other.counts_like(&os, &counted, by));
        assert_eq!(count(&other, &os, &ids).await.unwrap().counts, [3]);
    }

    #[test]
    fn counters_count_alike_only_when_they_are_the_same() {
        let learnt = Arc::new(LearntEstimate::new(4.0));
        let a = TokenCounter::Learnt(learnt.clone());
        assert!(a.counts_as(&TokenCounter::Learnt(learnt)));
        assert!(!a.counts_as(&TokenCounter::Learnt(Arc::new(LearntEstimate::new(4.0)))));
        assert!(!a.counts_as(&estimate(4.0)));
        assert!(estimate(3.5).counts_as(&estimate(3.5)));
        assert!(!estimate(3.5).counts_as(&estimate(3.0)));
    }

    #[test]
    fn one_tokenizer_file_loaded_twice_is_one_counter() {
        let dir = std::env::temp_dir().join(format!("envelope-count-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |name: &str, vocab: &str| {
            let p = dir.join(name);
            let json = format!(
                r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,"pre_tokenizer":{{"type":"Whitespace"}},"post_processor":null,"decoder":null,"model":{{"type":"WordLevel","vocab":{vocab},"unk_token":"[UNK]"}}}}"#
            );
            std::fs::write(&p, json).unwrap();
            p
        };
        let a = write("a.json", r#"{"a":0,"b":1,"[UNK]":2}"#);
        let b = write("b.json", r#"{"a":0,"c":1,"[UNK]":2}"#);
        let first = TokenCounter::from_tokenizer_file(&a).unwrap();
        assert!(first.counts_as(&TokenCounter::from_tokenizer_file(&a).unwrap()));
        assert!(!first.counts_as(&TokenCounter::from_tokenizer_file(&b).unwrap()));
        // Another chat template's tokens: not the same count.
        let chat = crate::upstream_tokenize::ChatOverhead {
            per_message: 3,
            ..Default::default()
        };
        let other = TokenCounter::from_tokenizer_file(&a)
            .unwrap()
            .with_chat_overhead(chat);
        assert!(!first.counts_as(&other));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
