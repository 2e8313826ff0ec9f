//! The router's state: one version of the tiers file running ([`Live`]:
//! each tier's upstreams with their governors and prices), the versions
//! before it (for rollback), the cost book, the answer cache, the
//! conversations that escalated, shadow agreement and the recorder.

use super::cache::AnswerCache;
use super::config::{TiersSettings, UpstreamConfig};
use super::cost::{Book, Price};
use super::metrics::{labels, TierMetrics};
use envelope_governor::config::GovernArgs;
use envelope_governor::request::ParsedRequest;
use envelope_governor::upstream::Tasks;
use envelope_governor::GovernedUpstream;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

/// One upstream of a tier, with its governor (profile, ledger, queue,
/// guards) and price.
pub struct Upstream {
    pub spec: UpstreamConfig,
    pub app: Arc<GovernedUpstream>,
    pub price: Price,
    /// Whether it runs at half its profile (fingerprint mismatch).
    pub conservative: bool,
    /// The text its settings were built from (profile and tenants file).
    pub source: String,
    /// Its background tasks: they end when the last version that uses
    /// the upstream is gone.
    pub tasks: Arc<Tasks>,
}

impl Upstream {
    /// The body this upstream is sent: its `model` when the tier names one.
    pub fn body_for(&self, parsed: &ParsedRequest) -> ParsedRequest {
        let mut p = parsed.clone();
        if let Some(model) = &self.spec.model {
            p.set_field("model", serde_json::Value::String(model.clone()));
        }
        p
    }

    /// The model this upstream is asked for.
    pub fn model_for(&self, parsed: &ParsedRequest) -> String {
        self.spec.model.clone().unwrap_or_else(|| {
            parsed
                .body()
                .get("model")
                .and_then(|m| m.as_str())
                .unwrap_or("")
                .to_string()
        })
    }
}

pub struct Tier {
    pub name: String,
    pub upstreams: Vec<Arc<Upstream>>,
    pub latency_budget_ms: Option<u64>,
}

/// One version of the tiers file, running.
pub struct Live {
    pub file: TiersSettings,
    /// The file as read (a reload of the same text is no new version).
    pub text: String,
    /// In the file's `order`, cheapest first.
    pub tiers: Vec<Tier>,
}

impl Live {
    /// Tier `i`'s upstreams, the one with the most room first.
    pub fn by_room(&self, i: usize) -> Vec<Arc<Upstream>> {
        let mut v: Vec<(f64, Arc<Upstream>)> = self.tiers[i]
            .upstreams
            .iter()
            .map(|u| (u.app.fullness(), u.clone()))
            .collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v.into_iter().map(|(_, u)| u).collect()
    }

    /// The tiers a call starting on `i` may be placed on when `i` has no
    /// room now, in the file's order.
    pub fn fallbacks(&self, i: usize) -> Vec<usize> {
        self.file
            .fallback
            .get(&self.tiers[i].name)
            .into_iter()
            .flatten()
            .filter_map(|t| self.file.index(t))
            .collect()
    }

    /// The front end's settings (how a call is read, who callers are, the
    /// admin token, connection limits): made from the flags and the
    /// tenants file alone, so every upstream's settings hold the same;
    /// taken from the first tier's first upstream, which counts and
    /// routes every call.
    pub fn front(&self) -> Arc<envelope_governor::Settings> {
        self.tiers[0].upstreams[0].app.settings()
    }

    pub fn all_upstreams(&self) -> impl Iterator<Item = (&Tier, usize, &Arc<Upstream>)> {
        self.tiers
            .iter()
            .flat_map(|t| t.upstreams.iter().enumerate().map(move |(i, u)| (t, i, u)))
    }
}

/// Shadow agreement per (tier, feature, reason).
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct Agreement {
    pub compared: u64,
    pub agreed: u64,
    /// Skipped: the tier up had no room, or too many shadows in flight.
    pub skipped: u64,
}

/// Previous versions kept for rollback.
const HISTORY: usize = 8;

pub struct TierRouter {
    pub path: PathBuf,
    pub args: GovernArgs,
    current: RwLock<Arc<Live>>,
    history: Mutex<Vec<Arc<Live>>>,
    pub book: Mutex<Book>,
    cache: RwLock<Option<Arc<AnswerCache>>>,
    /// Conversations that escalated before (`x-envelope-conversation`).
    pub escalated: moka::sync::Cache<String, ()>,
    pub shadow: Mutex<BTreeMap<(String, String, String), Agreement>>,
    /// Shadow calls in flight: (the bound, its permits).
    shadow_slots: RwLock<(usize, Arc<tokio::sync::Semaphore>)>,
    pub metrics: TierMetrics,
    /// `--record`: every call's line (set once at start).
    pub recorder: std::sync::OnceLock<Arc<envelope_governor::recorder::Recorder>>,
    draining: AtomicBool,
    /// Held by a reload or a rollback: one change at a time.
    pub changes: tokio::sync::Mutex<()>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl TierRouter {
    pub fn new(path: PathBuf, args: GovernArgs, live: Live) -> Arc<TierRouter> {
        let r = TierRouter {
            path,
            args,
            current: RwLock::new(Arc::new(Live {
                file: live.file.clone(),
                text: String::new(),
                tiers: vec![],
            })),
            history: Mutex::new(vec![]),
            book: Mutex::new(Book::default()),
            cache: RwLock::new(None),
            escalated: moka::sync::Cache::builder()
                .max_capacity(100_000)
                .time_to_live(Duration::from_secs(3600))
                .build(),
            shadow: Mutex::new(BTreeMap::new()),
            shadow_slots: RwLock::new((0, Arc::new(tokio::sync::Semaphore::new(0)))),
            metrics: TierMetrics::new(),
            recorder: std::sync::OnceLock::new(),
            draining: AtomicBool::new(false),
            changes: tokio::sync::Mutex::new(()),
        };
        r.install(Arc::new(live));
        Arc::new(r)
    }

    pub fn live(&self) -> Arc<Live> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn cache(&self) -> Option<Arc<AnswerCache>> {
        self.cache.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Puts `live` in force: the cache follows its settings (a new one when
    /// they change), the version gauge its label.
    fn install(&self, live: Arc<Live>) {
        let old = self.live();
        let c = &live.file.cache;
        let same_cache = old.file.cache.enabled == c.enabled
            && old.file.cache.max_bytes == c.max_bytes
            && old.file.cache.ttl_s == c.ttl_s
            && self.cache().is_some() == c.enabled;
        if !same_cache {
            *self.cache.write().unwrap_or_else(|e| e.into_inner()) = c
                .enabled
                .then(|| Arc::new(AnswerCache::new(c.max_bytes, Duration::from_secs(c.ttl_s))));
        }
        {
            let n = live.file.shadow.max_in_flight.max(1);
            let mut slots = self.shadow_slots.write().unwrap_or_else(|e| e.into_inner());
            if slots.0 != n {
                *slots = (n, Arc::new(tokio::sync::Semaphore::new(n)));
            }
        }
        self.metrics.version.clear();
        self.metrics
            .version
            .get_or_create(&labels(&[("version", &live.file.version)]))
            .set(1);
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = live;
    }

    /// Puts a new version in force, keeping the one before for rollback
    /// (unless it is the same text: profiles and tenants may have changed,
    /// the routing has not).
    pub fn swap(&self, live: Live) {
        let old = self.live();
        if old.text != live.text {
            let mut h = lock(&self.history);
            h.push(old);
            let extra = h.len().saturating_sub(HISTORY);
            h.drain(..extra);
        }
        self.install(Arc::new(live));
    }

    /// Restores the version before the one in force.
    ///
    /// # Errors
    /// There is none.
    pub fn rollback(&self) -> Result<String, String> {
        let prev = lock(&self.history)
            .pop()
            .ok_or("no earlier version of the tiers file to restore")?;
        let v = prev.file.version.clone();
        self.install(prev);
        Ok(v)
    }

    /// A slot for one shadow call, if fewer than the bound are in flight.
    pub fn shadow_slot(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let slots = self.shadow_slots.read().unwrap_or_else(|e| e.into_inner());
        slots.1.clone().try_acquire_owned().ok()
    }

    /// Versions that can be restored, the newest last.
    pub fn history(&self) -> Vec<String> {
        lock(&self.history)
            .iter()
            .map(|l| l.file.version.clone())
            .collect()
    }

    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
        for (_, _, u) in self.live().all_upstreams() {
            u.app.gov.start_draining();
        }
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }
}
