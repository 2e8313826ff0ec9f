//! The reservation ledger: sequences and KV tokens in flight upstream, in
//! total and per tenant, against the profile's caps. Plain data, no I/O.
//!
//! The idea is TGI's router: each request reserves its whole KV need
//! (prompt + max_tokens, times the number of sequences) up front, so the
//! engine never has to preempt; vLLM admits lazily per step and preempts
//! when blocks run out, which is exactly what the governor keeps it from
//! reaching. Tenants get a guaranteed share (capacity others may not borrow
//! while the tenant could use it) and a burst share (their ceiling).

use std::collections::HashMap;

/// The whole node in capacity units: a sequence of a bucket whose safe
/// concurrency is `n` is charged `CAPACITY_UNITS / n` (floored, so `n` of
/// them fit and `n + 1` do not for any `n` up to 32768).
pub const CAPACITY_UNITS: u64 = 1 << 30;

/// Capacity units one sequence of a bucket safe at `safe_concurrency` costs.
pub fn units_per_sequence(safe_concurrency: u64) -> u64 {
    CAPACITY_UNITS / safe_concurrency.max(1)
}

/// The resources every admission reserves: sequences, KV tokens, and its
/// share of the measured envelope (capacity units).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Demand {
    pub seqs: u64,
    pub kv_tokens: u64,
    pub capacity: u64,
}

const RESOURCES: usize = 3;

impl Demand {
    fn get(&self, r: usize) -> u64 {
        match r {
            0 => self.seqs,
            1 => self.kv_tokens,
            _ => self.capacity,
        }
    }
    fn get_mut(&mut self, r: usize) -> &mut u64 {
        match r {
            0 => &mut self.seqs,
            1 => &mut self.kv_tokens,
            _ => &mut self.capacity,
        }
    }
    /// Component-wise sum.
    pub fn plus(self, o: Demand) -> Demand {
        Demand {
            seqs: self.seqs + o.seqs,
            kv_tokens: self.kv_tokens + o.kv_tokens,
            capacity: self.capacity + o.capacity,
        }
    }
    /// Whether every component is at most `o`'s.
    pub fn within(&self, o: &Demand) -> bool {
        (0..RESOURCES).all(|r| self.get(r) <= o.get(r))
    }
}

/// Fractions (0..=1) of the capacity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Share {
    pub guaranteed: f64,
    pub burst: f64,
}

impl Share {
    pub const OPEN: Share = Share {
        guaranteed: 0.0,
        burst: 1.0,
    };
}

/// Why a reservation does not fit now (or ever).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Bigger than the profile's whole capacity or the tenant's burst
    /// ceiling of it: no wait helps (400).
    NeverFits,
    /// Fits the profile's capacity but not the current, temporarily lowered
    /// one (live guard): retry later (429).
    Tightened,
    /// The node is full.
    Global,
    /// The tenant is at its burst ceiling.
    TenantBurst,
    /// Free capacity exists but is guaranteed to other tenants.
    OthersGuarantee,
}

#[derive(Debug, Clone, Default)]
struct TenantUse {
    share: Option<Share>,
    used: Demand,
}

#[derive(Debug, Clone)]
pub struct Ledger {
    /// The profile's capacity (with overrides).
    full: Demand,
    /// The capacity in force now (the live guards may lower it).
    cap: Demand,
    used: Demand,
    /// By name, hashed with foldhash: looked up on every reserve and
    /// release (SipHash cost more: docs/measurements/2026-12-06-governor-code-figures.md).
    tenants: foldhash::HashMap<String, TenantUse>,
    default_share: Share,
    /// The least capacity units a tenant's burst ceiling allows: one
    /// sequence of the most expensive bucket, so any tenant can run any
    /// shape the profile admits.
    min_burst_capacity: u64,
}

/// Checks a share table: each in [0, 1], burst >= guaranteed, guarantees sum to at most 1.
pub fn validate_shares(shares: &HashMap<String, Share>) -> Result<(), String> {
    let mut sum = 0.0;
    for (name, s) in shares {
        if !(0.0..=1.0).contains(&s.guaranteed) || !(0.0..=1.0).contains(&s.burst) {
            return Err(format!("tenant `{name}`: shares must be in [0, 1]"));
        }
        if s.burst < s.guaranteed {
            return Err(format!(
                "tenant `{name}`: burst share is below its guaranteed share"
            ));
        }
        sum += s.guaranteed;
    }
    if sum > 1.0 + 1e-9 {
        return Err(format!("guaranteed shares sum to {sum:.3}, over 1"));
    }
    Ok(())
}

impl Ledger {
    /// `shares` must pass [`validate_shares`]; tenants not in it get
    /// `default_share` with no guarantee.
    pub fn new(cap: Demand, shares: &HashMap<String, Share>, default_burst: f64) -> Ledger {
        let tenants = shares
            .iter()
            .map(|(k, s)| {
                (
                    k.clone(),
                    TenantUse {
                        share: Some(*s),
                        used: Demand::default(),
                    },
                )
            })
            .collect();
        Ledger {
            full: cap,
            cap,
            used: Demand::default(),
            tenants,
            default_share: Share {
                guaranteed: 0.0,
                burst: default_burst.clamp(0.0, 1.0),
            },
            min_burst_capacity: 1,
        }
    }

    /// The capacity in force now (ladder, latency guard), at most the
    /// profile's. Reservations in flight stay; when they exceed the new
    /// caps nothing more is admitted until they drain.
    pub fn set_capacity(&mut self, cap: Demand) {
        self.cap = Demand {
            seqs: cap.seqs.min(self.full.seqs),
            kv_tokens: cap.kv_tokens.min(self.full.kv_tokens),
            capacity: cap.capacity.min(self.full.capacity),
        };
    }

    /// New tenant shares (hot reload). Reservations in flight stay with
    /// their tenants; a tenant no longer listed keeps only what it holds
    /// and its guarantee is no longer set aside for it.
    pub fn set_shares(&mut self, shares: &HashMap<String, Share>, default_burst: f64) {
        self.default_share = Share {
            guaranteed: 0.0,
            burst: default_burst.clamp(0.0, 1.0),
        };
        self.tenants.retain(|name, t| {
            t.share = shares.get(name).copied();
            t.share.is_some() || t.used != Demand::default()
        });
        for (name, s) in shares {
            self.tenants.entry(name.clone()).or_default().share = Some(*s);
        }
    }

    /// A new profile capacity (hot reload); the current one follows it.
    pub fn set_full_capacity(&mut self, full: Demand) {
        self.full = full;
        self.cap = full;
    }

    pub fn full_capacity(&self) -> Demand {
        self.full
    }

    pub fn capacity(&self) -> Demand {
        self.cap
    }

    pub fn used(&self) -> Demand {
        self.used
    }

    pub fn tenant_used(&self, tenant: &str) -> Demand {
        self.tenants.get(tenant).map(|t| t.used).unwrap_or_default()
    }

    /// The tenant's share and what it holds: one map lookup, which the
    /// checks below then reuse (one lookup a check cost more:
    /// docs/measurements/2026-12-06-governor-code-figures.md).
    fn tenant(&self, tenant: &str) -> (Share, Demand) {
        match self.tenants.get(tenant) {
            Some(t) => (t.share.unwrap_or(self.default_share), t.used),
            None => (self.default_share, Demand::default()),
        }
    }

    fn limit(cap: u64, frac: f64) -> u64 {
        ((cap as f64) * frac).floor() as u64
    }

    /// The burst ceiling of `cap` for share `s`; at least one sequence's
    /// worth so a tenant with a tiny share can still run something.
    fn burst_limit(&self, cap: &Demand, s: Share, r: usize) -> u64 {
        if s.burst <= 0.0 {
            return 0;
        }
        let least = if r == 2 { self.min_burst_capacity } else { 1 };
        Self::limit(cap.get(r), s.burst).max(least)
    }

    /// See `min_burst_capacity`.
    pub fn set_min_burst_capacity(&mut self, units: u64) {
        self.min_burst_capacity = units.max(1);
    }

    /// Capacity guaranteed to tenants other than `tenant` that they are not using.
    fn others_unused_guarantee(&self, tenant: &str, r: usize) -> u64 {
        self.tenants
            .iter()
            .filter(|(k, _)| k.as_str() != tenant)
            .filter_map(|(_, t)| {
                t.share.map(|s| {
                    Self::limit(self.cap.get(r), s.guaranteed).saturating_sub(t.used.get(r))
                })
            })
            .sum()
    }

    /// Whether `d` fits under `cap` and share `s`'s burst ceiling of it.
    fn fits_idle(&self, cap: &Demand, s: Share, d: Demand) -> bool {
        (0..RESOURCES).all(|r| d.get(r) <= cap.get(r) && d.get(r) <= self.burst_limit(cap, s, r))
    }

    /// Whether `d` fits now, and why not.
    pub fn check(&self, tenant: &str, d: Demand) -> Result<(), Refusal> {
        let (share, mine) = self.tenant(tenant);
        if !self.fits_idle(&self.full, share, d) {
            return Err(Refusal::NeverFits);
        }
        if !self.fits_idle(&self.cap, share, d) {
            return Err(Refusal::Tightened);
        }
        for r in 0..RESOURCES {
            let after = self.used.get(r) + d.get(r);
            if after > self.cap.get(r) {
                return Err(Refusal::Global);
            }
            let mine_after = mine.get(r) + d.get(r);
            if mine_after > self.burst_limit(&self.cap, share, r) {
                return Err(Refusal::TenantBurst);
            }
            // Every tenant may hold one sequence of the costliest bucket
            // whatever others are guaranteed, or such shapes could never run.
            let guaranteed = Self::limit(self.cap.get(r), share.guaranteed);
            let floor = if r == 2 { self.min_burst_capacity } else { 0 };
            if mine_after > guaranteed.max(floor)
                && after + self.others_unused_guarantee(tenant, r) > self.cap.get(r)
            {
                return Err(Refusal::OthersGuarantee);
            }
        }
        Ok(())
    }

    pub fn reserve(&mut self, tenant: &str, d: Demand) -> Result<(), Refusal> {
        self.check(tenant, d)?;
        self.commit(tenant, d);
        Ok(())
    }

    /// Reserves `d` for `tenant` without checking: only after
    /// [`Ledger::check`] said it fits, with nothing changed between.
    pub fn commit(&mut self, tenant: &str, d: Demand) {
        match self.tenants.get_mut(tenant) {
            Some(t) => (0..RESOURCES).for_each(|r| *t.used.get_mut(r) += d.get(r)),
            // A tenant with no share and nothing held has no entry.
            None => {
                let t = TenantUse {
                    share: None,
                    used: d,
                };
                self.tenants.insert(tenant.to_string(), t);
            }
        }
        for r in 0..RESOURCES {
            *self.used.get_mut(r) += d.get(r);
        }
    }

    /// Returns a reservation. Saturates, so a double release cannot
    /// underflow (it is a bug, but not one that should stop the proxy).
    pub fn release(&mut self, tenant: &str, d: Demand) {
        if let Some(t) = self.tenants.get_mut(tenant) {
            for r in 0..RESOURCES {
                *t.used.get_mut(r) = t.used.get(r).saturating_sub(d.get(r));
            }
            if t.share.is_none() && t.used == Demand::default() {
                self.tenants.remove(tenant);
            }
        }
        for r in 0..RESOURCES {
            *self.used.get_mut(r) = self.used.get(r).saturating_sub(d.get(r));
        }
    }

    /// Free KV tokens (capacity minus reserved; zero when over a lowered cap).
    pub fn kv_headroom(&self) -> u64 {
        self.cap.kv_tokens.saturating_sub(self.used.kv_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(seqs: u64, kv_tokens: u64) -> Demand {
        Demand {
            seqs,
            kv_tokens,
            capacity: 0,
        }
    }

    fn c(seqs: u64, kv_tokens: u64, capacity: u64) -> Demand {
        Demand {
            seqs,
            kv_tokens,
            capacity,
        }
    }

    fn open(cap: Demand) -> Ledger {
        Ledger::new(cap, &HashMap::new(), 1.0)
    }

    fn shared() -> Ledger {
        let mut s = HashMap::new();
        s.insert(
            "a".to_string(),
            Share {
                guaranteed: 0.5,
                burst: 1.0,
            },
        );
        s.insert(
            "b".to_string(),
            Share {
                guaranteed: 0.25,
                burst: 0.5,
            },
        );
        validate_shares(&s).unwrap();
        Ledger::new(d(8, 1000), &s, 0.25)
    }

    #[test]
    fn reserves_up_to_both_caps_and_releases() {
        let mut l = open(d(2, 100));
        l.reserve("x", d(1, 60)).unwrap();
        assert_eq!(l.check("x", d(1, 41)), Err(Refusal::Global));
        l.reserve("x", d(1, 40)).unwrap();
        assert_eq!(l.check("x", d(1, 1)), Err(Refusal::Global));
        assert_eq!(l.kv_headroom(), 0);
        l.release("x", d(1, 60));
        assert_eq!(l.used(), d(1, 40));
        assert_eq!(l.check("y", d(1, 61)), Err(Refusal::Global));
        l.reserve("y", d(1, 60)).unwrap();
        l.release("x", d(1, 40));
        l.release("y", d(1, 60));
        assert_eq!(l.used(), d(0, 0));
        // Released unknown tenants are forgotten; double release saturates.
        l.release("y", d(1, 60));
        assert_eq!(l.used(), d(0, 0));
        assert!(l.tenants.is_empty());
    }

    #[test]
    fn concurrency_cap_binds_independently_of_tokens() {
        let mut l = open(d(3, 1_000_000));
        for _ in 0..3 {
            l.reserve("x", d(1, 1)).unwrap();
        }
        assert_eq!(l.reserve("x", d(1, 1)), Err(Refusal::Global));
        // n > 1 counts n sequences.
        let mut l = open(d(3, 1_000_000));
        assert_eq!(l.check("x", d(4, 4)), Err(Refusal::NeverFits));
        l.reserve("x", d(2, 2)).unwrap();
        assert_eq!(l.check("x", d(2, 2)), Err(Refusal::Global));
    }

    #[test]
    fn never_fits_is_distinguished_from_busy() {
        let l = open(d(4, 100));
        assert_eq!(l.check("x", d(1, 101)), Err(Refusal::NeverFits));
        assert_eq!(l.check("x", d(4, 100)), Ok(()));
        // Over the burst ceiling of the default share is never-fits too.
        let l = shared();
        assert_eq!(l.check("stranger", d(1, 251)), Err(Refusal::NeverFits));
        assert_ne!(l.check("stranger", d(1, 250)), Err(Refusal::NeverFits));
    }

    #[test]
    fn burst_ceiling_per_tenant() {
        let mut l = shared();
        l.reserve("b", d(1, 300)).unwrap();
        assert_eq!(l.check("b", d(1, 201)), Err(Refusal::TenantBurst));
        l.reserve("b", d(1, 200)).unwrap();
        assert_eq!(l.tenant_used("b"), d(2, 500));
    }

    #[test]
    fn guarantees_are_not_borrowed_while_unused() {
        let mut l = shared();
        // a: 500 guaranteed; b: 250 guaranteed; free for anyone: 250.
        l.reserve("stranger", d(1, 250)).unwrap();
        // The stranger is at its 0.25 ceiling anyway; b bursting past its
        // 250 guarantee would eat a's unused guarantee.
        l.reserve("b", d(1, 250)).unwrap();
        assert_eq!(l.check("b", d(1, 1)), Err(Refusal::OthersGuarantee));
        // a can still use all of its guarantee.
        l.reserve("a", d(1, 500)).unwrap();
        assert_eq!(l.used(), d(3, 1000));
    }

    #[test]
    fn a_tenant_may_burst_into_unguaranteed_and_used_guarantees() {
        let mut l = shared();
        l.reserve("a", d(1, 700)).unwrap(); // 200 past its guarantee, from the free pool
        assert_eq!(l.check("a", d(1, 51)), Err(Refusal::OthersGuarantee)); // b's 250 stays
        l.reserve("a", d(1, 50)).unwrap();
        l.reserve("b", d(1, 250)).unwrap();
        assert_eq!(l.used(), d(3, 1000));
    }

    #[test]
    fn within_guarantee_waits_only_for_the_node() {
        let mut l = shared();
        l.reserve("stranger", d(1, 250)).unwrap();
        l.reserve("a", d(1, 500)).unwrap();
        l.reserve("b", d(1, 250)).unwrap();
        assert_eq!(l.check("b", d(1, 1)), Err(Refusal::Global));
        l.release("stranger", d(1, 250));
        // b has used its guarantee; going beyond needs a's unused (none) ->
        // fits in the freed pool.
        l.reserve("b", d(1, 250)).unwrap();
    }

    #[test]
    fn lowered_capacity_blocks_until_drained() {
        let mut l = open(d(4, 100));
        l.reserve("x", d(2, 80)).unwrap();
        l.set_capacity(d(1, 50));
        assert_eq!(l.kv_headroom(), 0);
        assert_eq!(l.check("x", d(1, 10)), Err(Refusal::Global));
        // Fits the profile, not the lowered cap: temporary, not never.
        assert_eq!(l.check("x", d(1, 60)), Err(Refusal::Tightened));
        assert_eq!(l.check("x", d(1, 101)), Err(Refusal::NeverFits));
        l.release("x", d(2, 80));
        l.reserve("x", d(1, 50)).unwrap();
        // The current cap never exceeds the profile's.
        l.set_capacity(d(9, 900));
        assert_eq!(l.capacity(), d(4, 100));
    }

    #[test]
    fn capacity_units_bound_a_mix_of_bucket_shapes() {
        // Short sequences safe at 12, long ones at 4: 12 short fit, or 4
        // long, or 6 short + 2 long, never more.
        let short = c(1, 96, units_per_sequence(12));
        let long = c(1, 288, units_per_sequence(4));
        let mut l = open(c(12, 1_000_000, CAPACITY_UNITS));
        for _ in 0..12 {
            l.reserve("x", short).unwrap();
        }
        assert_eq!(l.check("x", short), Err(Refusal::Global));
        let mut l = open(c(12, 1_000_000, CAPACITY_UNITS));
        for _ in 0..4 {
            l.reserve("x", long).unwrap();
        }
        assert_eq!(l.check("x", short), Err(Refusal::Global));
        let mut l = open(c(12, 1_000_000, CAPACITY_UNITS));
        for _ in 0..2 {
            l.reserve("x", long).unwrap();
        }
        for _ in 0..6 {
            l.reserve("x", short).unwrap();
        }
        assert_eq!(l.check("x", short), Err(Refusal::Global));
        // A tenant whose burst share is under one long sequence's cost can
        // still run one (never-fits only past the profile itself).
        let mut shares = HashMap::new();
        shares.insert(
            "small".to_string(),
            Share {
                guaranteed: 0.0,
                burst: 0.2,
            },
        );
        let mut l = Ledger::new(c(12, 1_000_000, CAPACITY_UNITS), &shares, 1.0);
        assert_eq!(l.check("small", long), Err(Refusal::NeverFits));
        l.set_min_burst_capacity(units_per_sequence(4));
        l.reserve("small", long).unwrap();
        assert_eq!(l.check("small", short), Err(Refusal::TenantBurst));
        // Others' unused guarantees do not keep a tenant from its one
        // costliest sequence either (a: 0.5, b: 0.25 guaranteed, long 1/3).
        let mut shares = HashMap::new();
        for (t, g) in [("a", 0.5), ("b", 0.25)] {
            shares.insert(
                t.to_string(),
                Share {
                    guaranteed: g,
                    burst: 1.0,
                },
            );
        }
        let long3 = c(1, 288, units_per_sequence(3));
        let mut l = Ledger::new(c(12, 1_000_000, CAPACITY_UNITS), &shares, 1.0);
        assert_eq!(l.check("stranger", long3), Err(Refusal::OthersGuarantee));
        l.set_min_burst_capacity(units_per_sequence(3));
        l.reserve("stranger", long3).unwrap();
        assert_eq!(l.check("stranger", long3), Err(Refusal::OthersGuarantee));
        // For every n, n sequences of a bucket safe at n fit and n + 1 do not.
        for n in [1u64, 2, 3, 7, 13, 100, 999, 32768] {
            let u = units_per_sequence(n);
            assert!(
                n * u <= CAPACITY_UNITS && (n + 1) * u > CAPACITY_UNITS,
                "{n}"
            );
        }
    }

    #[test]
    fn share_validation() {
        let mut s = HashMap::new();
        s.insert(
            "a".to_string(),
            Share {
                guaranteed: 0.7,
                burst: 0.6,
            },
        );
        assert!(validate_shares(&s).unwrap_err().contains("below"));
        s.insert(
            "a".to_string(),
            Share {
                guaranteed: 0.7,
                burst: 1.0,
            },
        );
        s.insert(
            "b".to_string(),
            Share {
                guaranteed: 0.4,
                burst: 1.0,
            },
        );
        assert!(validate_shares(&s).unwrap_err().contains("sum"));
        s.insert(
            "b".to_string(),
            Share {
                guaranteed: 1.5,
                burst: 2.0,
            },
        );
        assert!(validate_shares(&s).is_err());
    }

    #[test]
    fn exhaustive_small_model_never_exceeds_caps() {
        // Every sequence of reserve/release over a tiny domain keeps used
        // within the caps and equal to the sum of live reservations.
        let tenants = ["a", "b", "stranger"];
        let demands = [d(1, 100), d(2, 300), d(1, 600)];
        for seed in 0..500u64 {
            let mut l = shared();
            let mut live: Vec<(&str, Demand)> = vec![];
            let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            for _ in 0..40 {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let pick = (x >> 33) as usize;
                if pick.is_multiple_of(3) && !live.is_empty() {
                    let (t, dd) = live.remove(pick % live.len());
                    l.release(t, dd);
                } else {
                    let t = tenants[pick % 3];
                    let dd = demands[(pick / 3) % 3];
                    if l.reserve(t, dd).is_ok() {
                        live.push((t, dd));
                    }
                }
                let sum = live.iter().fold(d(0, 0), |a, (_, x)| a.plus(*x));
                assert_eq!(l.used(), sum);
                assert!(sum.seqs <= 8 && sum.kv_tokens <= 1000);
                assert!(l.tenant_used("b").kv_tokens <= 500);
            }
        }
    }
}
