//! The server's prefix cache as the governor sees it: how much of a
//! prompt the server probably holds already, and how far to believe that.
//!
//! A server with automatic prefix caching (vLLM, SGLang) computes only the
//! part of a prompt after its longest cached prefix. An agent's calls
//! resend a shared system prompt and the session so far, so most of their
//! prompt tokens cost the server no prefill. Charging them as new makes
//! the envelope a fraction of what the server serves (seed 000, section 7).
//!
//! - [`Record`]: the prompt blocks this governor sent recently, as
//!   chained hashes of [`BLOCK_BYTES`]-byte chunks of the prompt's text (a
//!   block's id depends on everything before it), least recently used
//!   first out, sized to the server's KV cache. This is the approximate
//!   record llm-d's prefix scorer keeps per pod; it needs no tokenizer.
//! - [`Trust`]: the share of the estimate the server is seen to honour.
//!   It is read from what the server reports: each answer's
//!   `usage.prompt_tokens_details.cached_tokens` where the server gives it,
//!   else the growth of its prefix-cache counters (vLLM's
//!   `prefix_cache_hits_total` over `prefix_cache_queries_total`) against
//!   the governor's own estimate over the same seconds. It starts at 0
//!   (cold), falls at once to a lower reading and rises halfway to a
//!   higher one, so a flushed cache, a restart, a new prompt version or a
//!   server without a prefix cache returns charges to the cold envelope at
//!   the next reading. A server that reports nothing is never credited.
//! - [`PrefixCache`]: both, per governed upstream, with a trust per tenant
//!   where answers report their cached tokens.
//!
//! What is credited (estimate x trust) is taken off the prompt for compute
//! only: the charge against the envelope and the TTFT it predicts. KV is
//! charged on the whole context.

use crate::request::Prompts;
use std::collections::VecDeque;
use std::hash::{BuildHasher, Hasher};
use std::sync::Mutex;

/// Bytes of prompt text a block spans (llm-d's default chunk).
pub const BLOCK_BYTES: usize = 64;
/// Prompt bytes per token of the server's KV cache, to size the record
/// (English through a BPE tokenizer runs 3.5 to 4.5).
const BYTES_PER_TOKEN: u64 = 4;
/// A reading from answers is taken once they estimated this many cached
/// tokens together: one short answer is not a reading.
const READING_TOKENS: u64 = 256;
/// Polls of the server's counters a reading spans: a request sent in one
/// second may be counted by the server in the next.
const POLLS_A_READING: usize = 3;
/// Tenants with a trust of their own; past this, new ones share the
/// upstream's.
const MAX_TENANTS: usize = 4096;

/// A prompt's blocks: the chained ids of its full blocks, and its bytes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PromptBlocks {
    pub ids: Vec<u64>,
    pub bytes: usize,
}

/// The chained ids of `bytes`' full blocks: a block's id hashes the id
/// before it and its own bytes, so equal ids are equal prefixes.
pub fn blocks(hasher: &impl BuildHasher, bytes: &[u8]) -> PromptBlocks {
    let mut prev = 0u64;
    let ids = bytes
        .chunks_exact(BLOCK_BYTES)
        .map(|chunk| {
            let mut h = hasher.build_hasher();
            h.write_u64(prev);
            h.write(chunk);
            prev = h.finish();
            prev
        })
        .collect();
    PromptBlocks {
        ids,
        bytes: bytes.len(),
    }
}

/// The recently sent prompt blocks, least recently used first out.
#[derive(Debug)]
pub struct Record {
    last_use: foldhash::HashMap<u64, u64>,
    /// (id, tick) in the order used; an entry whose tick is not the id's
    /// last is stale and skipped.
    order: VecDeque<(u64, u64)>,
    tick: u64,
    capacity: usize,
}

impl Record {
    pub fn new(capacity_blocks: usize) -> Record {
        Record {
            last_use: Default::default(),
            order: VecDeque::new(),
            tick: 0,
            capacity: capacity_blocks.max(1),
        }
    }

    /// Blocks a server cache of `tokens` tokens holds, in this record's
    /// units.
    pub fn blocks_for_tokens(tokens: u64) -> usize {
        ((tokens * BYTES_PER_TOKEN) / BLOCK_BYTES as u64).max(1) as usize
    }

    /// A new size (the server's KV capacity as it reports it); the least
    /// recently used go first.
    pub fn set_capacity(&mut self, capacity_blocks: usize) {
        self.capacity = capacity_blocks.max(1);
        self.evict();
    }

    pub fn len(&self) -> usize {
        self.last_use.len()
    }

    pub fn is_empty(&self) -> bool {
        self.last_use.is_empty()
    }

    /// How many of `ids`' leading blocks the record holds.
    pub fn matched(&self, ids: &[u64]) -> usize {
        ids.iter()
            .take_while(|id| self.last_use.contains_key(id))
            .count()
    }

    /// `ids` were sent: they are the most recently used now.
    pub fn insert(&mut self, ids: &[u64]) {
        for &id in ids {
            self.tick += 1;
            self.last_use.insert(id, self.tick);
            self.order.push_back((id, self.tick));
        }
        self.evict();
        if self.order.len() > 4 * self.capacity + 64 {
            let last_use = &self.last_use;
            self.order.retain(|(id, t)| last_use.get(id) == Some(t));
        }
    }

    fn evict(&mut self) {
        while self.last_use.len() > self.capacity {
            let Some((id, t)) = self.order.pop_front() else {
                break;
            };
            if self.last_use.get(&id) == Some(&t) {
                self.last_use.remove(&id);
            }
        }
    }
}

/// Tokens of a prompt of `tokens` tokens and `bytes` bytes whose first
/// `matched_bytes` the server holds: that share of its tokens, rounded
/// down, and never the whole prompt (a server computes at least its last
/// token). [`PrefixCache::estimate`] rounds it down to the server's
/// blocks.
pub fn cached_tokens(tokens: u64, bytes: usize, matched_bytes: usize) -> u64 {
    if bytes == 0 || tokens == 0 {
        return 0;
    }
    let share = (tokens as u128 * matched_bytes.min(bytes) as u128) / bytes as u128;
    (share as u64).min(tokens - 1)
}

/// The share (0..=1) of the governor's estimate the server is seen to
/// honour: 0 until a reading says otherwise; falls at once, rises halfway.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Trust {
    pub value: f64,
    pub readings: u64,
}

impl Trust {
    /// One reading: the server's cached tokens over the governor's
    /// estimate (clamped to 0..=1: a server that caches more than the
    /// estimate earns no credit beyond it).
    pub fn read(&mut self, ratio: f64) {
        let r = if ratio.is_finite() {
            ratio.clamp(0.0, 1.0)
        } else {
            0.0
        };
        self.value = if r <= self.value {
            r
        } else {
            self.value + 0.5 * (r - self.value)
        };
        self.readings += 1;
    }
}

/// Estimated and reported cached tokens of answers not yet read.
#[derive(Debug, Clone, Copy, Default)]
struct Pending {
    estimated: u64,
    reported: u64,
    prompt: u64,
}

impl Pending {
    /// Adds an answer; a reading once enough was estimated.
    fn add(&mut self, estimated: u64, reported: u64, prompt: u64) -> Option<Pending> {
        self.estimated += estimated;
        self.reported += reported;
        self.prompt += prompt;
        (self.estimated >= READING_TOKENS).then(|| std::mem::take(self))
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct TenantTrust {
    trust: Trust,
    pending: Pending,
}

/// One poll's growth of the server's counters, and what the governor sent
/// since the poll before.
#[derive(Debug, Clone, Copy, Default)]
struct Poll {
    queries: f64,
    hits: f64,
    estimated: u64,
    prompt: u64,
}

/// What one poll of the server's metrics says of its cache: whether it
/// caches prefixes at all (`None`: not said), its prefix-cache counters
/// (tokens queried and found since it started), its KV capacity in tokens
/// and the tokens a block holds (a prefix is found in whole blocks).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ServerReport {
    pub caching: Option<bool>,
    pub counters: Option<(f64, f64)>,
    pub kv_capacity_tokens: Option<f64>,
    pub block_size: Option<f64>,
}

/// The hit rates of the last reading, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HitRates {
    /// What the governor estimated of the prompts it sent.
    pub estimated: Option<f64>,
    /// What the server reported.
    pub observed: Option<f64>,
}

#[derive(Debug)]
struct State {
    record: Record,
    global: Trust,
    pending: Pending,
    tenants: foldhash::HashMap<String, TenantTrust>,
    /// The server's counters at the last poll.
    last_counters: Option<(f64, f64)>,
    /// Sent since the last poll.
    sent: Poll,
    polls: VecDeque<Poll>,
    rates: HitRates,
    /// Tokens a server KV block holds (1 until the server says).
    block_size: u64,
}

/// A request's prompt against the record: per prompt group, the tokens
/// estimated cached and those credited (estimate x trust).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Estimate {
    pub blocks: Vec<PromptBlocks>,
    pub estimated: Vec<u64>,
    pub credited: Vec<u64>,
}

impl Estimate {
    pub fn estimated_total(&self) -> u64 {
        self.estimated.iter().sum()
    }
}

/// The record and the trust of one governed upstream.
#[derive(Debug)]
pub struct PrefixCache {
    /// Seeded per process: ids are not comparable across processes, and
    /// no client can aim a collision.
    hasher: foldhash::quality::RandomState,
    state: Mutex<State>,
}

impl PrefixCache {
    pub fn new(record_blocks: usize) -> PrefixCache {
        PrefixCache {
            hasher: Default::default(),
            state: Mutex::new(State {
                record: Record::new(record_blocks),
                global: Trust::default(),
                pending: Pending::default(),
                tenants: Default::default(),
                last_counters: None,
                sent: Poll::default(),
                polls: VecDeque::new(),
                rates: HitRates::default(),
                block_size: 1,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What `tenant`'s prompts (`counts` tokens per group) find in the
    /// record, and what is credited at the trust in force: the tenant's own
    /// where its answers were read, and never more than the upstream's.
    pub fn estimate(&self, tenant: &str, prompts: &Prompts, counts: &[u64]) -> Estimate {
        // Hashed outside the lock.
        let blocks: Vec<PromptBlocks> = prompts
            .group_bytes()
            .iter()
            .map(|b| blocks(&self.hasher, b))
            .collect();
        let s = self.lock();
        let trust = s.trust_of(tenant);
        let estimated: Vec<u64> = blocks
            .iter()
            .zip(counts)
            .map(|(b, &tokens)| {
                let matched = s.record.matched(&b.ids) * BLOCK_BYTES;
                let c = cached_tokens(tokens, b.bytes, matched);
                c - c % s.block_size
            })
            .collect();
        let credited = estimated
            .iter()
            .map(|&e| (e as f64 * trust).floor() as u64)
            .collect();
        Estimate {
            blocks,
            estimated,
            credited,
        }
    }

    /// The request estimated as `e` (prompts of `prompt_tokens` in all) was
    /// sent: its blocks are in the server's cache from now on, as far as
    /// the governor knows.
    pub fn sent(&self, e: &Estimate, prompt_tokens: u64) {
        let mut s = self.lock();
        for b in &e.blocks {
            s.record.insert(&b.ids);
        }
        s.sent.estimated += e.estimated_total();
        s.sent.prompt += prompt_tokens;
    }

    /// An answer reported `reported` cached tokens of a prompt of
    /// `prompt_tokens`, for which the governor estimated `estimated`.
    pub fn answered(&self, tenant: &str, estimated: u64, reported: u64, prompt_tokens: u64) {
        let mut s = self.lock();
        if let Some(p) = s.pending.add(estimated, reported, prompt_tokens) {
            s.global.read(p.reported as f64 / p.estimated as f64);
            s.rates = HitRates {
                estimated: Some(p.estimated as f64 / p.prompt.max(1) as f64),
                observed: Some(p.reported as f64 / p.prompt.max(1) as f64),
            };
        }
        if !s.tenants.contains_key(tenant) && s.tenants.len() >= MAX_TENANTS {
            return;
        }
        let t = s.tenants.entry(tenant.to_string()).or_default();
        if let Some(p) = t.pending.add(estimated, reported, prompt_tokens) {
            t.trust.read(p.reported as f64 / p.estimated as f64);
        }
    }

    /// One poll of what the server says of its cache.
    pub fn polled(&self, report: &ServerReport) {
        let mut s = self.lock();
        if let Some(t) = report
            .kv_capacity_tokens
            .filter(|t| t.is_finite() && *t >= 1.0)
        {
            s.record.set_capacity(Record::blocks_for_tokens(t as u64));
        }
        if let Some(b) = report.block_size.filter(|b| b.is_finite() && *b >= 1.0) {
            s.block_size = b as u64;
        }
        let (caching, counters) = (report.caching, report.counters);
        let mut poll = std::mem::take(&mut s.sent);
        if caching == Some(false) {
            // The server says it keeps no prefix: nothing is credited.
            s.global.read(0.0);
            for t in s.tenants.values_mut() {
                t.trust.read(0.0);
            }
            s.rates.observed = Some(0.0);
            s.polls.clear();
            return;
        }
        let Some((queries, hits)) = counters else {
            return;
        };
        // A counter that went down is a restarted server: it counted from
        // 0, and what it found before is gone with its cache.
        let (dq, dh) = match s.last_counters {
            Some((q0, h0)) if queries >= q0 && hits >= h0 => (queries - q0, hits - h0),
            Some(_) => {
                s.polls.clear();
                (queries, hits)
            }
            None => (0.0, 0.0),
        };
        s.last_counters = Some((queries, hits));
        (poll.queries, poll.hits) = (dq, dh);
        s.polls.push_back(poll);
        while s.polls.len() > POLLS_A_READING {
            s.polls.pop_front();
        }
        let sum = s.polls.iter().fold(Poll::default(), |a, p| Poll {
            queries: a.queries + p.queries,
            hits: a.hits + p.hits,
            estimated: a.estimated + p.estimated,
            prompt: a.prompt + p.prompt,
        });
        if sum.queries < 1.0 || sum.prompt == 0 {
            return;
        }
        let observed = (sum.hits / sum.queries).clamp(0.0, 1.0);
        let estimated = sum.estimated as f64 / sum.prompt as f64;
        s.rates = HitRates {
            estimated: Some(estimated),
            observed: Some(observed),
        };
        if estimated > 0.0 {
            s.global.read(observed / estimated);
        }
    }

    /// The upstream's trust, and the last reading's hit rates.
    pub fn trust(&self) -> (Trust, HitRates) {
        let s = self.lock();
        (s.global, s.rates)
    }

    /// `tenant`'s trust where its answers were read.
    pub fn tenant_trust(&self, tenant: &str) -> Option<Trust> {
        let s = self.lock();
        s.tenants
            .get(tenant)
            .map(|t| t.trust)
            .filter(|t| t.readings > 0)
    }

    /// `/admin/state`'s view: the upstream's trust and hit rates, the
    /// record's size, and each tenant's trust where its answers were read.
    pub fn state_json(&self) -> serde_json::Value {
        let s = self.lock();
        let tenants: serde_json::Map<String, serde_json::Value> = s
            .tenants
            .iter()
            .filter(|(_, t)| t.trust.readings > 0)
            .map(|(k, t)| {
                (
                    k.clone(),
                    serde_json::json!({"trust": t.trust.value, "readings": t.trust.readings}),
                )
            })
            .collect();
        serde_json::json!({
            "trust": s.global.value,
            "readings": s.global.readings,
            "estimated_hit_rate": s.rates.estimated,
            "observed_hit_rate": s.rates.observed,
            "recorded_blocks": s.record.len(),
            "record_capacity_blocks": s.record.capacity,
            "server_block_tokens": s.block_size,
            "tenants": tenants,
        })
    }

    /// Blocks the record holds now.
    pub fn recorded_blocks(&self) -> usize {
        self.lock().record.len()
    }
}

impl State {
    fn trust_of(&self, tenant: &str) -> f64 {
        let own = self
            .tenants
            .get(tenant)
            .filter(|t| t.trust.readings > 0)
            .map_or(1.0, |t| t.trust.value);
        self.global.value.min(own)
    }
}

#[cfg(test)]
mod tests;
