//! From a validated request and its prompt token counts to what the governor
//! enforces: the `max_tokens` applied (kept, injected or clamped), the
//! context check, and the demand (sequences, KV tokens) to reserve. Also the
//! caps in force at each ladder level. Pure functions.

use crate::error::GovernError;
use crate::ladder::Level;
use crate::ledger::Demand;
use crate::request::{Endpoint, OutputDecision};
use crate::settings::OverLimit;
use envelope_profile::Limits;

#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub max_tokens: u64,
    pub decision: OutputDecision,
    pub demand: Demand,
    pub prompt_tokens: u64,
}

/// The caps at a ladder level: SMALL_CONTEXT multiplies context, output and
/// KV budget by `factor`; concurrency stays (it is the KV budget that binds).
pub fn effective_limits(l: &Limits, level: Level, factor: f64) -> Limits {
    if level == Level::Normal {
        return l.clone();
    }
    let f = |v: u64| ((v as f64 * factor).floor() as u64).max(1);
    Limits {
        max_context_tokens: f(l.max_context_tokens),
        max_output_tokens: f(l.max_output_tokens),
        max_concurrent_seqs: l.max_concurrent_seqs,
        max_kv_tokens_in_flight: f(l.max_kv_tokens_in_flight),
    }
}

/// Decides `max_tokens` and the reservation for a request whose prompt
/// groups count `prompt_tokens` each, asked `asked` tokens and `n` choices.
pub fn plan(
    limits: &Limits,
    over: OverLimit,
    endpoint: Endpoint,
    prompt_tokens: &[u64],
    asked: Option<u64>,
    n: u64,
) -> Result<Plan, GovernError> {
    let ctx = limits.max_context_tokens;
    let out = limits.max_output_tokens;
    let longest = prompt_tokens.iter().copied().max().unwrap_or(0);
    let too_long = |max_tokens: u64| GovernError::ContextLength {
        param: endpoint.prompt_param(),
        prompt_tokens: longest,
        max_tokens,
        needed_tokens: longest.saturating_add(max_tokens),
        limit_tokens: ctx,
    };
    if longest >= ctx {
        return Err(too_long(asked.unwrap_or(1)));
    }
    let room = ctx - longest;
    let (max_tokens, decision) = match asked {
        None => (out.min(room), OutputDecision::Injected),
        Some(a) if a > out => match over {
            OverLimit::Reject => {
                return Err(GovernError::OutputTooLong {
                    asked: a,
                    limit: out,
                })
            }
            OverLimit::Clamp => (out.min(room), OutputDecision::Clamped),
        },
        Some(a) if a > room => return Err(too_long(a)),
        Some(a) => (a, OutputDecision::Kept),
    };
    let kv_tokens = prompt_tokens
        .iter()
        .map(|p| (p + max_tokens).saturating_mul(n))
        .sum();
    Ok(Plan {
        max_tokens,
        decision,
        demand: Demand {
            seqs: prompt_tokens.len() as u64 * n,
            kv_tokens,
        },
        prompt_tokens: prompt_tokens.iter().sum(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            max_context_tokens: 100,
            max_output_tokens: 30,
            max_concurrent_seqs: 4,
            max_kv_tokens_in_flight: 1000,
        }
    }

    fn p(prompts: &[u64], asked: Option<u64>, n: u64) -> Result<Plan, GovernError> {
        plan(
            &limits(),
            OverLimit::Clamp,
            Endpoint::Chat,
            prompts,
            asked,
            n,
        )
    }

    #[test]
    fn kept_injected_clamped() {
        let k = p(&[10], Some(20), 1).unwrap();
        assert_eq!((k.max_tokens, k.decision), (20, OutputDecision::Kept));
        assert_eq!(
            k.demand,
            Demand {
                seqs: 1,
                kv_tokens: 30
            }
        );
        let i = p(&[10], None, 1).unwrap();
        assert_eq!((i.max_tokens, i.decision), (30, OutputDecision::Injected));
        // Injected never runs past the context.
        let i = p(&[90], None, 1).unwrap();
        assert_eq!((i.max_tokens, i.decision), (10, OutputDecision::Injected));
        let c = p(&[10], Some(1_000_000), 1).unwrap();
        assert_eq!((c.max_tokens, c.decision), (30, OutputDecision::Clamped));
        let c = p(&[80], Some(500), 1).unwrap();
        assert_eq!(c.max_tokens, 20);
    }

    #[test]
    fn reject_policy() {
        let e = plan(
            &limits(),
            OverLimit::Reject,
            Endpoint::Completions,
            &[5],
            Some(31),
            1,
        )
        .unwrap_err();
        assert_eq!(e.reason(), "max_tokens_over_limit");
        assert_eq!(e.status().as_u16(), 400);
        assert!(plan(
            &limits(),
            OverLimit::Reject,
            Endpoint::Completions,
            &[5],
            Some(30),
            1
        )
        .is_ok());
    }

    #[test]
    fn context_length_exceeded() {
        let e = p(&[80], Some(21), 1).unwrap_err();
        assert_eq!(e.reason(), "context_length_exceeded");
        assert_eq!(e.body()["error"]["param"], "messages");
        assert!(e.to_string().contains("101"), "{e}");
        // The prompt alone fills the context.
        assert_eq!(
            p(&[100], None, 1).unwrap_err().reason(),
            "context_length_exceeded"
        );
        assert!(p(&[80], Some(20), 1).is_ok());
        let e = plan(
            &limits(),
            OverLimit::Clamp,
            Endpoint::Completions,
            &[100],
            None,
            1,
        )
        .unwrap_err();
        assert_eq!(e.body()["error"]["param"], "prompt");
    }

    #[test]
    fn n_and_batches_multiply_the_demand() {
        let d = p(&[10, 20], Some(5), 3).unwrap().demand;
        assert_eq!(
            d,
            Demand {
                seqs: 6,
                kv_tokens: (15 + 25) * 3
            }
        );
        // The longest prompt decides the context check.
        assert!(p(&[10, 96], Some(5), 1).is_err());
    }

    #[test]
    fn small_context_tightens_caps() {
        let l = effective_limits(&limits(), Level::SmallContext, 0.5);
        assert_eq!(l.max_context_tokens, 50);
        assert_eq!(l.max_output_tokens, 15);
        assert_eq!(l.max_kv_tokens_in_flight, 500);
        assert_eq!(l.max_concurrent_seqs, 4);
        assert_eq!(effective_limits(&limits(), Level::Normal, 0.5), limits());
        assert_eq!(
            effective_limits(&limits(), Level::RejectNew, 0.001).max_output_tokens,
            1
        );
    }
}
