//! The admission queue: requests that do not fit yet wait here, bounded by
//! count and by KV tokens. Plain data, generic over the payload (the async
//! layer stores the waiter's wake-up channel in it).
//!
//! Order: priority class first (interactive before batch); within a class,
//! the tenant that has been served the fewest tokens per unit of weight
//! (token-weighted fair queueing, as in start-time fair queueing: a tenant
//! that was idle is lifted to the current minimum so it cannot bank credit),
//! then earliest deadline, then arrival. The head waits for the node to have
//! room (no skipping past it, so a large request is not starved by small
//! ones); a request blocked only by its own tenant's ceiling does not block
//! other tenants.

use crate::ledger::{Demand, Refusal};
use std::collections::HashMap;
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    Interactive,
    Batch,
}

impl Class {
    pub fn label(self) -> &'static str {
        match self {
            Class::Interactive => "interactive",
            Class::Batch => "batch",
        }
    }
    pub fn parse(s: &str) -> Option<Class> {
        match s.trim().to_ascii_lowercase().as_str() {
            "interactive" => Some(Class::Interactive),
            "batch" => Some(Class::Batch),
            _ => None,
        }
    }
}

#[derive(Debug)]
pub struct Entry<T> {
    pub id: u64,
    pub tenant: String,
    pub class: Class,
    pub deadline: Instant,
    pub enqueued: Instant,
    pub demand: Demand,
    pub payload: T,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueFull {
    Count,
    Tokens,
}

/// What one pass of [`AdmissionQueue::pump`] decided.
#[derive(Debug)]
pub struct Pumped<T> {
    pub granted: Vec<Entry<T>>,
    /// Entries that cannot fit even on an idle node any more (the profile
    /// was reloaded with smaller caps while they waited).
    pub never_fit: Vec<Entry<T>>,
    /// Entries that fit the profile but not the caps the live guards
    /// lowered while they waited (they are told to retry later).
    pub tightened: Vec<Entry<T>>,
}

#[derive(Debug)]
pub struct AdmissionQueue<T> {
    entries: Vec<Entry<T>>,
    max_len: usize,
    max_tokens: u64,
    queued_tokens: u64,
    /// Tokens served per unit of weight, by tenant.
    vtime: foldhash::HashMap<String, f64>,
    weights: foldhash::HashMap<String, f64>,
    next_id: u64,
}

impl<T> AdmissionQueue<T> {
    pub fn new(max_len: usize, max_tokens: u64, weights: HashMap<String, f64>) -> Self {
        AdmissionQueue {
            entries: Vec::new(),
            max_len,
            max_tokens,
            queued_tokens: 0,
            vtime: foldhash::HashMap::default(),
            weights: weights.into_iter().collect(),
            next_id: 1,
        }
    }

    pub fn set_bounds(&mut self, max_len: usize, max_tokens: u64) {
        self.max_len = max_len;
        self.max_tokens = max_tokens;
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn queued_tokens(&self) -> u64 {
        self.queued_tokens
    }

    /// What is queued that would be served before a new request of
    /// `class`: its sequences, KV tokens and capacity units.
    pub fn demand_ahead_of(&self, class: Class) -> Demand {
        self.entries
            .iter()
            .filter(|e| e.class <= class)
            .fold(Demand::default(), |sum, e| sum.plus(e.demand))
    }

    pub fn oldest_age_ms(&self, now: Instant) -> u64 {
        self.entries
            .iter()
            .map(|e| now.saturating_duration_since(e.enqueued).as_millis() as u64)
            .max()
            .unwrap_or(0)
    }

    fn weight(&self, tenant: &str) -> f64 {
        self.weights.get(tenant).copied().unwrap_or(1.0).max(1e-3)
    }

    fn min_active_vtime(&self) -> Option<f64> {
        self.entries
            .iter()
            .map(|e| self.vtime.get(&e.tenant).copied().unwrap_or(0.0))
            .reduce(f64::min)
    }

    pub fn push(
        &mut self,
        tenant: &str,
        class: Class,
        deadline: Instant,
        now: Instant,
        demand: Demand,
        payload: T,
    ) -> Result<u64, (QueueFull, T)> {
        if self.entries.len() >= self.max_len {
            return Err((QueueFull::Count, payload));
        }
        if self.queued_tokens + demand.kv_tokens > self.max_tokens {
            return Err((QueueFull::Tokens, payload));
        }
        if self.vtime.len() > 4 * self.max_len.max(16) {
            // Bounded memory under many tenant names: forget idle tenants.
            let active: Vec<String> = self.entries.iter().map(|e| e.tenant.clone()).collect();
            self.vtime.retain(|k, _| active.contains(k));
        }
        if !self.entries.iter().any(|e| e.tenant == tenant) {
            // Lift a returning tenant to the current minimum.
            let floor = self.min_active_vtime().unwrap_or(0.0);
            let v = self.vtime.entry(tenant.to_string()).or_insert(0.0);
            *v = v.max(floor);
        }
        let id = self.next_id;
        self.next_id += 1;
        self.queued_tokens += demand.kv_tokens;
        self.entries.push(Entry {
            id,
            tenant: tenant.to_string(),
            class,
            deadline,
            enqueued: now,
            demand,
            payload,
        });
        Ok(id)
    }

    pub fn remove(&mut self, id: u64) -> Option<Entry<T>> {
        let i = self.entries.iter().position(|e| e.id == id)?;
        let e = self.entries.swap_remove(i);
        self.queued_tokens -= e.demand.kv_tokens;
        Some(e)
    }

    /// Removes and returns every entry (drain).
    pub fn take_all(&mut self) -> Vec<Entry<T>> {
        self.queued_tokens = 0;
        std::mem::take(&mut self.entries)
    }

    /// New fair-queueing weights (hot reload); virtual times stay.
    pub fn set_weights(&mut self, weights: HashMap<String, f64>) {
        self.weights = weights.into_iter().collect();
    }

    /// Removes and returns the entries whose deadline has passed.
    pub fn expire(&mut self, now: Instant) -> Vec<Entry<T>> {
        let ids: Vec<u64> = self
            .entries
            .iter()
            .filter(|e| e.deadline <= now)
            .map(|e| e.id)
            .collect();
        ids.into_iter().filter_map(|id| self.remove(id)).collect()
    }

    /// Ids in service order.
    pub fn order(&self) -> Vec<u64> {
        let mut keys: Vec<(Class, f64, Instant, u64)> = self
            .entries
            .iter()
            .map(|e| {
                (
                    e.class,
                    self.vtime.get(&e.tenant).copied().unwrap_or(0.0),
                    e.deadline,
                    e.id,
                )
            })
            .collect();
        keys.sort_by(|a, b| {
            a.0.cmp(&b.0)
                .then(a.1.total_cmp(&b.1))
                .then(a.2.cmp(&b.2))
                .then(a.3.cmp(&b.3))
        });
        keys.into_iter().map(|k| k.3).collect()
    }

    /// Grants entries in order while `reserve` accepts them. `reserve`
    /// performs the reservation (on the ledger) and says why not otherwise.
    pub fn pump(&mut self, mut reserve: impl FnMut(&Entry<T>) -> Result<(), Refusal>) -> Pumped<T> {
        let mut out = Pumped {
            granted: vec![],
            never_fit: vec![],
            tightened: vec![],
        };
        'outer: loop {
            let mut blocked_tenants: Vec<String> = vec![];
            for id in self.order() {
                let Some(e) = self.entries.iter().find(|e| e.id == id) else {
                    continue;
                };
                if blocked_tenants.contains(&e.tenant) {
                    continue;
                }
                match reserve(e) {
                    Ok(()) => {
                        let e = self.remove(id).expect("present");
                        let w = self.weight(&e.tenant);
                        *self.vtime.entry(e.tenant.clone()).or_insert(0.0) +=
                            e.demand.kv_tokens as f64 / w;
                        out.granted.push(e);
                        continue 'outer;
                    }
                    Err(Refusal::NeverFits) => {
                        out.never_fit.push(self.remove(id).expect("present"));
                        continue 'outer;
                    }
                    Err(Refusal::Tightened) => {
                        out.tightened.push(self.remove(id).expect("present"));
                        continue 'outer;
                    }
                    Err(Refusal::TenantBurst) | Err(Refusal::OthersGuarantee) => {
                        blocked_tenants.push(e.tenant.clone());
                    }
                    Err(Refusal::Global) => break 'outer,
                }
            }
            break;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::Ledger;
    use std::time::Duration;

    fn d(kv: u64) -> Demand {
        Demand {
            seqs: 1,
            kv_tokens: kv,
            capacity: 0,
        }
    }

    fn mk() -> AdmissionQueue<&'static str> {
        AdmissionQueue::new(10, 1000, HashMap::new())
    }

    #[test]
    fn bounded_by_count_and_tokens() {
        let now = Instant::now();
        let mut q = AdmissionQueue::new(2, 100, HashMap::new());
        q.push("a", Class::Batch, now, now, d(60), "1").unwrap();
        assert_eq!(
            q.push("a", Class::Batch, now, now, d(41), "2")
                .unwrap_err()
                .0,
            QueueFull::Tokens
        );
        q.push("a", Class::Batch, now, now, d(40), "2").unwrap();
        assert_eq!(
            q.push("a", Class::Batch, now, now, d(0), "3")
                .unwrap_err()
                .0,
            QueueFull::Count
        );
        assert_eq!(q.queued_tokens(), 100);
        let first = q.order()[0];
        assert_eq!(q.remove(first).unwrap().payload, "1");
        assert_eq!(q.queued_tokens(), 40);
        assert!(q.remove(first).is_none());
    }

    #[test]
    fn interactive_before_batch_then_deadline_then_arrival() {
        let now = Instant::now();
        let later = now + Duration::from_secs(10);
        let mut q = mk();
        q.push("t", Class::Batch, now, now, d(1), "batch-early")
            .unwrap();
        q.push("t", Class::Interactive, later, now, d(1), "inter-late")
            .unwrap();
        q.push("t", Class::Interactive, now, now, d(1), "inter-early")
            .unwrap();
        q.push("t", Class::Interactive, now, now, d(1), "inter-early-2")
            .unwrap();
        let order: Vec<&str> = q
            .order()
            .into_iter()
            .map(|id| q.entries.iter().find(|e| e.id == id).unwrap().payload)
            .collect();
        assert_eq!(
            order,
            ["inter-early", "inter-early-2", "inter-late", "batch-early"]
        );
        // Three interactive requests of one token each; the batch one after.
        assert_eq!(
            q.demand_ahead_of(Class::Interactive),
            Demand {
                seqs: 3,
                kv_tokens: 3,
                capacity: 0
            }
        );
        assert_eq!(q.demand_ahead_of(Class::Batch).kv_tokens, 4);
    }

    #[test]
    fn token_weighted_fairness_alternates_tenants() {
        // Tenant "big" sends 400-token requests, "small" 100-token ones; with
        // a node that fits 400 tokens at a time, small gets served ~4 times
        // per big request, so big cannot starve small.
        let now = Instant::now();
        let mut q = AdmissionQueue::new(100, 100_000, HashMap::new());
        for i in 0..10 {
            q.push("big", Class::Interactive, now, now, d(400), "big")
                .unwrap();
            let _ = i;
        }
        for _ in 0..40 {
            q.push("small", Class::Interactive, now, now, d(100), "small")
                .unwrap();
        }
        let mut served = vec![];
        for _ in 0..20 {
            let mut budget = 400u64;
            let p = q.pump(|e| {
                if e.demand.kv_tokens <= budget {
                    budget -= e.demand.kv_tokens;
                    Ok(())
                } else {
                    Err(Refusal::Global)
                }
            });
            served.extend(
                p.granted
                    .into_iter()
                    .map(|e| (e.payload, e.demand.kv_tokens)),
            );
        }
        let tokens = |who| {
            served
                .iter()
                .filter(|s| s.0 == who)
                .map(|s| s.1)
                .sum::<u64>()
        };
        let (b, s) = (tokens("big"), tokens("small"));
        assert!(b > 0 && s > 0);
        let ratio = b as f64 / s as f64;
        assert!((0.6..1.6).contains(&ratio), "big {b} small {s}");
    }

    #[test]
    fn weights_skew_the_share() {
        let now = Instant::now();
        let mut w = HashMap::new();
        w.insert("gold".to_string(), 3.0);
        let mut q = AdmissionQueue::new(100, 100_000, w);
        for _ in 0..40 {
            q.push("gold", Class::Batch, now, now, d(10), "gold")
                .unwrap();
            q.push("tin", Class::Batch, now, now, d(10), "tin").unwrap();
        }
        let mut n = 0;
        let p = q.pump(|_| {
            n += 1;
            if n <= 20 {
                Ok(())
            } else {
                Err(Refusal::Global)
            }
        });
        let gold = p.granted.iter().filter(|e| e.payload == "gold").count();
        assert_eq!(gold, 15, "3:1 weights serve 15 of 20 to gold");
    }

    #[test]
    fn idle_tenant_cannot_bank_credit() {
        let now = Instant::now();
        let mut q = AdmissionQueue::new(100, 100_000, HashMap::new());
        for _ in 0..5 {
            q.push("a", Class::Batch, now, now, d(100), "a").unwrap();
        }
        let _ = q.pump(|_| Ok(()));
        // a has 500 served; b arrives now with a queue holding a again.
        q.push("a", Class::Batch, now, now, d(100), "a").unwrap();
        q.push("b", Class::Batch, now, now, d(100), "b").unwrap();
        // b is lifted to a's vtime (500): both equal, arrival breaks the tie -> a first.
        let first = q.order()[0];
        assert_eq!(
            q.entries.iter().find(|e| e.id == first).unwrap().payload,
            "a"
        );
    }

    #[test]
    fn head_of_line_blocks_on_global_but_not_on_tenant_ceiling() {
        let now = Instant::now();
        let mut ledger = Ledger::new(
            Demand {
                seqs: 10,
                kv_tokens: 100,
                capacity: 0,
            },
            &HashMap::new(),
            0.5,
        );
        ledger
            .reserve(
                "a",
                Demand {
                    seqs: 1,
                    kv_tokens: 40,
                    capacity: 0,
                },
            )
            .unwrap();
        let mut q = mk();
        q.push("a", Class::Interactive, now, now, d(20), "a-over-ceiling")
            .unwrap();
        q.push("b", Class::Interactive, now, now, d(30), "b-fits")
            .unwrap();
        let p = q.pump(|e| ledger.reserve(&e.tenant, e.demand));
        assert_eq!(p.granted.len(), 1);
        assert_eq!(p.granted[0].payload, "b-fits");
        // Global: a big head blocks a small one behind it.
        let mut ledger = Ledger::new(
            Demand {
                seqs: 10,
                kv_tokens: 100,
                capacity: 0,
            },
            &HashMap::new(),
            1.0,
        );
        ledger.reserve("x", d(50)).unwrap();
        let mut q = mk();
        q.push("t", Class::Interactive, now, now, d(60), "big")
            .unwrap();
        q.push(
            "t",
            Class::Interactive,
            now + Duration::from_secs(1),
            now,
            d(10),
            "small",
        )
        .unwrap();
        let p = q.pump(|e| ledger.reserve(&e.tenant, e.demand));
        assert!(p.granted.is_empty());
        ledger.release("x", d(50));
        let p = q.pump(|e| ledger.reserve(&e.tenant, e.demand));
        assert_eq!(p.granted.len(), 2);
    }

    #[test]
    fn tenant_bookkeeping_stays_bounded() {
        let now = Instant::now();
        let mut q = AdmissionQueue::new(2, 1_000_000, HashMap::new());
        for i in 0..1000 {
            let name = format!("t{i}");
            q.push(&name, Class::Batch, now, now, d(1), "x").unwrap();
            let _ = q.pump(|_| Ok(()));
        }
        assert!(q.vtime.len() <= 4 * 16 + 1, "{}", q.vtime.len());
    }

    #[test]
    fn never_fit_entries_are_returned_not_kept() {
        let now = Instant::now();
        let mut q = mk();
        q.push("t", Class::Batch, now, now, d(500), "huge").unwrap();
        q.push("t", Class::Batch, now, now, d(5), "ok").unwrap();
        let p = q.pump(|e| {
            if e.demand.kv_tokens > 100 {
                Err(Refusal::NeverFits)
            } else {
                Ok(())
            }
        });
        assert_eq!(p.never_fit.len(), 1);
        assert_eq!(p.granted.len(), 1);
        assert!(q.is_empty());
        assert_eq!(q.queued_tokens(), 0);
    }

    #[test]
    fn expiry_by_deadline() {
        let now = Instant::now();
        let mut q = mk();
        q.push(
            "t",
            Class::Batch,
            now + Duration::from_millis(5),
            now,
            d(5),
            "soon",
        )
        .unwrap();
        q.push(
            "t",
            Class::Batch,
            now + Duration::from_secs(60),
            now,
            d(5),
            "late",
        )
        .unwrap();
        assert!(q.expire(now).is_empty());
        let gone = q.expire(now + Duration::from_millis(10));
        assert_eq!(gone.len(), 1);
        assert_eq!(gone[0].payload, "soon");
        assert_eq!(q.len(), 1);
        assert_eq!(q.oldest_age_ms(now + Duration::from_millis(10)), 10);
        assert_eq!(Class::parse("Batch"), Some(Class::Batch));
        assert_eq!(Class::parse("x"), None);
    }
}
