//! From a validated request and its prompt token counts to what the governor
//! enforces: the `max_tokens` applied (kept, injected or clamped), the
//! context check, the bucket of the measured envelope each sequence falls
//! in, what it is charged there, and the demand (sequences, KV tokens,
//! capacity units) to reserve. Also the caps in force at each ladder level.
//! Pure functions.

use crate::error::GovernError;
use crate::ladder::Level;
use crate::ledger::{units_per_sequence, Demand, CAPACITY_UNITS};
use crate::request::{Endpoint, OutputDecision};
use crate::settings::{Beyond, OverLimit};
use envelope_profile::Limits;

/// What one request costs in one bucket of the envelope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketCharge {
    /// Index into `limits.buckets`; `limits.buckets.len()` for a sequence
    /// past the largest bucket admitted alone.
    pub bucket: usize,
    pub seqs: u64,
    pub capacity: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub max_tokens: u64,
    pub decision: OutputDecision,
    pub demand: Demand,
    pub prompt_tokens: u64,
    /// Prompt tokens charged as already in the upstream's prefix cache
    /// (taken off the compute charge, not the KV).
    pub cached_tokens: u64,
    /// The longest prompt group, which decides the context check.
    pub longest_prompt_tokens: u64,
    pub charges: Vec<BucketCharge>,
}

impl Plan {
    /// Whether the request fits caps lowered by the live guards. It fits
    /// the profile (the plan was made against it), so when it does not it
    /// must be deferred (429), not refused for good.
    pub fn fits(&self, current: &Limits) -> bool {
        self.longest_prompt_tokens + self.max_tokens <= current.max_context_tokens
            && self.max_tokens <= current.max_output_tokens
    }
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
        buckets: l.buckets.clone(),
    }
}

/// Capacity units one sequence of `total_tokens` (prompt + max_tokens) is
/// charged, and the bucket it is counted in; `None` past the largest bucket.
///
/// A sequence is charged by what it costs, not by the next bucket up:
/// between two measured buckets the charge (`1 / safe_concurrency` of the
/// node) is interpolated linearly by total tokens, from the largest bucket
/// under it to the smallest covering it (the bucket it is counted in). Where
/// KV binds, a sequence's cost is its tokens over the cache, linear in total
/// tokens, so the line is exact there; where compute binds it is the
/// straight line between two measured points. Under the smallest bucket the
/// smallest's charge holds (nothing is extrapolated below what was
/// measured). Rounded up, so a share is never under the line.
pub fn charge_for(limits: &Limits, total_tokens: u64) -> Option<(usize, u64)> {
    let (i, upper) = limits.bucket_for(total_tokens)?;
    let hi = units_of(upper);
    // The largest bucket under this one; of two that size, the stricter
    // (the buckets are sorted by total, then by safe concurrency).
    let lower = limits.buckets[..i]
        .iter()
        .filter(|b| b.total_tokens() < upper.total_tokens())
        .min_by_key(|b| (std::cmp::Reverse(b.total_tokens()), b.safe_concurrency));
    let Some(lower) = lower.filter(|b| b.total_tokens() < total_tokens) else {
        return Some((i, hi));
    };
    let lo = units_of(lower);
    let (t0, t1) = (lower.total_tokens() as u128, upper.total_tokens() as u128);
    let t = total_tokens as u128;
    // lo + (hi - lo) * (t - t0) / (t1 - t0), in one exact weighted sum.
    let sum = lo as u128 * (t1 - t) + hi as u128 * (t - t0);
    Some((i, sum.div_ceil(t1 - t0) as u64))
}

/// One sequence's share of the node in a bucket: `1 /` its concurrency
/// after the headroom, unrounded where the profile states it (1.8 admits
/// one, as the rounded 1 does, but the line to the next bucket starts at
/// 1.8), else its safe concurrency.
pub(crate) fn units_of(b: &envelope_profile::BucketLimit) -> u64 {
    match b.concurrency_after_headroom {
        Some(c) if c.is_finite() && c >= 1.0 => (CAPACITY_UNITS as f64 / c).floor() as u64,
        _ => units_per_sequence(b.safe_concurrency),
    }
}

/// The most sequences of one shape the envelope admits at once: the node's
/// capacity over [`charge_for`]'s charge. What a load test beside the
/// governor calls the safe concurrency of a shape between two buckets.
pub fn safe_concurrency_for(
    limits: &Limits,
    prompt_tokens: u64,
    output_tokens: u64,
) -> Option<u64> {
    charge_for(limits, prompt_tokens + output_tokens)
        .map(|(_, units)| (CAPACITY_UNITS / units.max(1)).min(limits.max_concurrent_seqs))
}

/// The sequences a request asks for: `n` per prompt group.
pub fn sequences(prompt_groups: usize, n: u64) -> u64 {
    prompt_groups as u64 * n
}

/// Decides `max_tokens` and the reservation for a request whose prompt
/// groups count `prompt_tokens` each, asked `asked` tokens and `n` choices.
pub fn plan(
    limits: &Limits,
    over: OverLimit,
    beyond: Beyond,
    endpoint: Endpoint,
    prompt_tokens: &[u64],
    asked: Option<u64>,
    n: u64,
) -> Result<Plan, GovernError> {
    plan_cached(limits, over, beyond, endpoint, prompt_tokens, &[], asked, n)
}

/// [`plan`] for prompts of which the upstream holds `cached[i]` tokens of
/// group `i` in its prefix cache (missing: none). What is cached costs no
/// prefill: a sequence is charged against the envelope, and its TTFT
/// predicted, by its uncached prompt and its output. Its KV, the context
/// check and the envelope's edge (`beyond`) stay on the whole prompt.
#[allow(clippy::too_many_arguments)]
pub fn plan_cached(
    limits: &Limits,
    over: OverLimit,
    beyond: Beyond,
    endpoint: Endpoint,
    prompt_tokens: &[u64],
    cached: &[u64],
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
    let mut charges: Vec<BucketCharge> = vec![];
    let mut credited = 0;
    for (i, &p) in prompt_tokens.iter().enumerate() {
        let total = p + max_tokens;
        let c = cached.get(i).copied().unwrap_or(0).min(p.saturating_sub(1));
        let (bucket, units) = match charge_for(limits, total) {
            Some(whole) => {
                credited += c * n;
                // A smaller total is inside the envelope too.
                charge_for(limits, total - c).unwrap_or(whole)
            }
            None => match (beyond, limits.largest_bucket()) {
                (Beyond::Alone, _) | (_, None) => (limits.buckets.len(), CAPACITY_UNITS),
                (Beyond::Refuse, Some(b)) => {
                    return Err(GovernError::BeyondEnvelope {
                        param: endpoint.prompt_param(),
                        needed_tokens: total,
                        bucket: b.label(),
                        bucket_tokens: b.total_tokens(),
                    })
                }
            },
        };
        match charges.iter_mut().find(|c| c.bucket == bucket) {
            Some(c) => {
                c.seqs += n;
                c.capacity += units.saturating_mul(n);
            }
            None => charges.push(BucketCharge {
                bucket,
                seqs: n,
                capacity: units.saturating_mul(n),
            }),
        }
    }
    let kv_tokens = prompt_tokens
        .iter()
        .map(|p| (p + max_tokens).saturating_mul(n))
        .sum();
    Ok(Plan {
        max_tokens,
        decision,
        demand: Demand {
            seqs: sequences(prompt_tokens.len(), n),
            kv_tokens,
            capacity: charges.iter().map(|c| c.capacity).sum(),
        },
        prompt_tokens: prompt_tokens.iter().sum(),
        cached_tokens: credited,
        longest_prompt_tokens: longest,
        charges,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        let mut l = Limits {
            max_context_tokens: 100,
            max_output_tokens: 30,
            max_concurrent_seqs: 4,
            max_kv_tokens_in_flight: 1000,
            buckets: vec![],
        };
        l.buckets = vec![l.single_row()];
        l
    }

    /// 40x10 safe at 12, 70x30 safe at 4 (context cap 100).
    fn table() -> Limits {
        let mut l = limits();
        let mut short = l.single_row();
        (
            short.input_tokens,
            short.output_tokens,
            short.safe_concurrency,
        ) = (40, 10, 12);
        let mut long = l.single_row();
        (long.input_tokens, long.output_tokens, long.safe_concurrency) = (70, 30, 4);
        l.buckets = vec![short, long];
        l.max_concurrent_seqs = 12;
        l
    }

    fn p(prompts: &[u64], asked: Option<u64>, n: u64) -> Result<Plan, GovernError> {
        plan(
            &limits(),
            OverLimit::Clamp,
            Beyond::Refuse,
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
                kv_tokens: 30,
                capacity: units_per_sequence(4),
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
            Beyond::Refuse,
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
            Beyond::Refuse,
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
            Beyond::Refuse,
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
                kv_tokens: (15 + 25) * 3,
                capacity: 6 * units_per_sequence(4),
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

    #[test]
    fn each_sequence_is_charged_its_bucket_share() {
        let t = table();
        let q = |prompts: &[u64], asked, beyond| {
            plan(
                &t,
                OverLimit::Clamp,
                beyond,
                Endpoint::Chat,
                prompts,
                asked,
                1,
            )
        };
        // 30 + 10 = 40 <= 50: the short bucket, 1/12 of the node.
        let s = q(&[30], Some(10), Beyond::Refuse).unwrap();
        assert_eq!(s.demand.capacity, units_per_sequence(12));
        assert_eq!(
            s.charges,
            [BucketCharge {
                bucket: 0,
                seqs: 1,
                capacity: units_per_sequence(12)
            }]
        );
        // 70 + 30 = 100: the long bucket itself, 1/4.
        let l = q(&[70], Some(30), Beyond::Refuse).unwrap();
        assert_eq!(l.demand.capacity, units_per_sequence(4));
        // 45 + 10 = 55: counted in the long bucket, charged a tenth of the
        // way from the short bucket's share to the long one's.
        let m = q(&[45], Some(10), Beyond::Refuse).unwrap();
        assert_eq!(m.charges[0].bucket, 1);
        let tenth = units_per_sequence(12) + (units_per_sequence(4) - units_per_sequence(12)) / 10;
        assert!(m.demand.capacity.abs_diff(tenth) <= 1, "{m:?}");
        // A batch of both is charged per prompt.
        let b = q(&[30, 60], Some(10), Beyond::Refuse).unwrap();
        assert_eq!(
            b.demand.capacity,
            units_per_sequence(12) + charge_for(&t, 70).unwrap().1
        );
        assert_eq!(b.charges.len(), 2);
        // Past the largest bucket (100): refused naming it, or alone.
        let mut wide = t.clone();
        wide.max_context_tokens = 200;
        wide.max_output_tokens = 100;
        let e = plan(
            &wide,
            OverLimit::Clamp,
            Beyond::Refuse,
            Endpoint::Chat,
            &[90],
            Some(50),
            1,
        )
        .unwrap_err();
        assert_eq!(e.status().as_u16(), 400);
        assert!(e.to_string().contains("70x30"), "{e}");
        let a = plan(
            &wide,
            OverLimit::Clamp,
            Beyond::Alone,
            Endpoint::Chat,
            &[90],
            Some(50),
            1,
        )
        .unwrap();
        assert_eq!(a.demand.capacity, CAPACITY_UNITS);
        assert_eq!(a.charges[0].bucket, 2);
    }

    /// Worked numbers beside vLLM (2026-12-06): 64x32 safe at 14, 256x32
    /// safe at 4. A 100-token chat prompt with 32 out (132 tokens) was
    /// charged as 256x32, a quarter of the node, so 4 ran where vLLM served
    /// 16 inside its SLOs.
    #[test]
    fn between_two_buckets_a_sequence_is_charged_by_its_tokens() {
        let mut t = limits();
        let mut short = t.single_row();
        (
            short.input_tokens,
            short.output_tokens,
            short.safe_concurrency,
        ) = (64, 32, 14);
        let mut long = t.single_row();
        (long.input_tokens, long.output_tokens, long.safe_concurrency) = (256, 32, 4);
        t.buckets = vec![short, long];
        (
            t.max_context_tokens,
            t.max_output_tokens,
            t.max_concurrent_seqs,
        ) = (288, 32, 14);
        // (132 - 96) / (288 - 96) = 0.1875 of the way: 1/14 + 0.1875 (1/4 - 1/14)
        // = 0.1049 of the node, 9 at once (the next bucket up allowed 4).
        let (bucket, units) = charge_for(&t, 132).unwrap();
        assert_eq!(bucket, 1);
        let share = units as f64 / CAPACITY_UNITS as f64;
        assert!((share - 0.104_91).abs() < 1e-4, "{share}");
        assert_eq!(safe_concurrency_for(&t, 100, 32), Some(9));
        // At each measured bucket, its own figure; under the smallest, the
        // smallest's; past the largest, none (the caller's rule applies).
        assert_eq!(safe_concurrency_for(&t, 64, 32), Some(14));
        assert_eq!(safe_concurrency_for(&t, 256, 32), Some(4));
        assert_eq!(safe_concurrency_for(&t, 10, 5), Some(14));
        assert_eq!(charge_for(&t, 289), None);
        // Monotone in tokens, and never under the line between the buckets.
        let mut last = 0;
        for total in 96..=288u64 {
            let (_, u) = charge_for(&t, total).unwrap();
            assert!(u >= last, "{total}");
            last = u;
        }
        // Where the profile states each bucket's concurrency before it was
        // rounded down (6.3 and 1.8 here), each bucket still admits its
        // rounded figure, and the line between runs on the unrounded ones:
        // 139 tokens, 0.224 of the way, 1/6.3 + 0.224 (1/1.8 - 1/6.3) of
        // the node, 4 at once (on the rounded 6 and 1: 2).
        let mut unrounded = t.clone();
        for (b, (safe, after)) in unrounded.buckets.iter_mut().zip([(6, 6.3), (1, 1.8)]) {
            (b.safe_concurrency, b.concurrency_after_headroom) = (safe, Some(after));
        }
        unrounded.max_concurrent_seqs = 6;
        assert_eq!(safe_concurrency_for(&unrounded, 64, 32), Some(6));
        assert_eq!(safe_concurrency_for(&unrounded, 256, 32), Some(1));
        assert_eq!(safe_concurrency_for(&unrounded, 107, 32), Some(4));
        let mut rounded = unrounded.clone();
        for b in &mut rounded.buckets {
            b.concurrency_after_headroom = None;
        }
        assert_eq!(safe_concurrency_for(&rounded, 107, 32), Some(2));
        // Equal-sized buckets under this one: the stricter is the lower end.
        let mut twin = t.buckets[0].clone();
        twin.safe_concurrency = 7;
        t.buckets.insert(0, twin);
        assert_eq!(safe_concurrency_for(&t, 64, 32), Some(7));
        assert!(safe_concurrency_for(&t, 100, 32).unwrap() < 9);
    }

    #[test]
    fn a_plan_that_fits_the_profile_may_not_fit_tightened_caps() {
        let pl = p(&[60], Some(30), 1).unwrap();
        assert!(pl.fits(&limits()));
        let small = effective_limits(&limits(), Level::SmallContext, 0.5);
        assert!(!pl.fits(&small));
        assert!(p(&[10], Some(10), 1).unwrap().fits(&small));
    }

    #[test]
    fn cached_prompt_tokens_are_taken_off_the_compute_charge_not_the_kv() {
        let t = table();
        let plan = |prompts: &[u64], cached: &[u64], n| {
            plan_cached(
                &t,
                OverLimit::Clamp,
                Beyond::Refuse,
                Endpoint::Chat,
                prompts,
                cached,
                Some(10),
                n,
            )
            .unwrap()
        };
        // 60 + 10 = 70 tokens: between 40x10 (50, safe 12) and 70x30 (100,
        // safe 4), charged on the line between them.
        let cold = plan(&[60], &[], 1);
        assert_eq!(cold.charges[0].capacity, charge_for(&t, 70).unwrap().1);
        assert_eq!(cold.cached_tokens, 0);
        // 30 of its prompt cached: 30 + 10 = 40, under the smallest bucket,
        // charged as 40x10; KV still the whole 70; counted in 40x10.
        let warm = plan(&[60], &[30], 1);
        assert_eq!(warm.charges[0].capacity, units_per_sequence(12));
        assert_eq!(warm.charges[0].bucket, 0);
        assert_eq!(warm.demand.kv_tokens, 70);
        assert_eq!(warm.demand.seqs, 1);
        assert_eq!(warm.cached_tokens, 30);
        assert!(warm.demand.capacity < cold.demand.capacity);
        // Never the whole prompt: at most all but its last token.
        let all = plan(&[60], &[500], 1);
        assert_eq!(all.cached_tokens, 59);
        assert_eq!(all.charges[0].capacity, charge_for(&t, 11).unwrap().1);
        // Per group, and per sequence of each: two groups, one cached.
        let two = plan(&[60, 60], &[30], 2);
        assert_eq!(two.cached_tokens, 60);
        assert_eq!(
            two.demand.capacity,
            2 * units_per_sequence(12) + 2 * charge_for(&t, 70).unwrap().1
        );
        assert_eq!(two.demand.kv_tokens, 4 * 70);
        // The envelope's edge is the whole prompt's: cached tokens do not
        // bring a prompt past the largest bucket inside it.
        let mut wide = t.clone();
        wide.max_context_tokens = 200;
        let past = plan_cached(
            &wide,
            OverLimit::Clamp,
            Beyond::Refuse,
            Endpoint::Chat,
            &[120],
            &[110],
            Some(10),
            1,
        );
        assert!(
            matches!(past, Err(GovernError::BeyondEnvelope { .. })),
            "{past:?}"
        );
    }
}
