//! Where budget buckets live: in this process (exact, the default) or in
//! Redis (`--budget-store redis://...`), shared by every governor replica.
//! With Redis each decision is one Lua script run atomically on the server
//! with the server's clock: the request takes from every bucket or from
//! none, so concurrent requests on any number of replicas cannot pass a
//! check together and overshoot the budget (LiteLLM's per-replica counters
//! synced every few seconds can: BerriAI/litellm#6288, #18730).
//!
//! Keys are `envelope:budget:<t|f>/<name>:<kind>`, hashes of the level and
//! the time it was written; each expires when its bucket would be full
//! again, so an idle tenant costs Redis nothing.

use super::bucket::{self, Outcome, State, Withdrawal};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One bucket in a decision: its key and what is asked of it.
#[derive(Debug, Clone, PartialEq)]
pub struct Slot {
    pub key: String,
    pub ask: Withdrawal,
}

/// Buckets kept in memory past this are dropped when full (a full bucket
/// and a missing one are the same), so many tenants stay bounded.
const MAX_LOCAL_BUCKETS: usize = 100_000;

const KEY_PREFIX: &str = "envelope:budget:";

/// Takes from every bucket or none (see `bucket::decide`); returns the
/// admission, the wait, the refusing bucket, then each bucket's level and
/// whether a shadow bucket would have refused. Numbers go back as strings
/// (Redis truncates Lua numbers to integers).
const DECIDE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = #KEYS
local lv, cap, win, amt, sh = {}, {}, {}, {}, {}
local wait, refusing = 0, 0
for i = 1, n do
  cap[i] = tonumber(ARGV[4*i-3]); win[i] = tonumber(ARGV[4*i-2])
  amt[i] = tonumber(ARGV[4*i-1]); sh[i] = ARGV[4*i] == '1'
  local s = redis.call('HMGET', KEYS[i], 'l', 't')
  local l = cap[i]
  if s[1] then
    local dt = now - tonumber(s[2])
    if dt < 0 then dt = 0 end
    l = math.min(cap[i], tonumber(s[1]) + dt * cap[i] / win[i])
  end
  lv[i] = l
  if (not sh[i]) and l < amt[i] then
    local w = math.max(1, math.ceil((amt[i] - l) * win[i] / cap[i]))
    if w > wait then wait = w; refusing = i end
  end
end
local out = {refusing == 0 and '1' or '0', tostring(wait), tostring(refusing)}
for i = 1, n do
  local would = '0'
  if refusing == 0 then
    if lv[i] >= amt[i] then lv[i] = lv[i] - amt[i] else would = '1' end
    redis.call('HSET', KEYS[i], 'l', tostring(lv[i]), 't', tostring(now))
    redis.call('PEXPIRE', KEYS[i], math.ceil((cap[i] - lv[i]) * win[i] / cap[i]) + 1000)
  end
  out[#out + 1] = tostring(lv[i])
  out[#out + 1] = would
end
return out
";

/// Gives `delta` back to each bucket (negative takes more), refilled to now.
const SETTLE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 1, #KEYS do
  local cap = tonumber(ARGV[3*i-2]); local win = tonumber(ARGV[3*i-1])
  local d = tonumber(ARGV[3*i])
  local s = redis.call('HMGET', KEYS[i], 'l', 't')
  local l = cap
  if s[1] then
    local dt = now - tonumber(s[2])
    if dt < 0 then dt = 0 end
    l = math.min(cap, tonumber(s[1]) + dt * cap / win)
  end
  l = math.min(cap, l + d)
  redis.call('HSET', KEYS[i], 'l', tostring(l), 't', tostring(now))
  redis.call('PEXPIRE', KEYS[i], math.ceil((cap - l) * win / cap) + 1000)
end
return 'ok'
";

struct Entry {
    state: State,
    capacity: f64,
    window_ms: u64,
}

/// Buckets in this process.
pub struct Local {
    map: Mutex<HashMap<String, Entry>>,
    epoch: Instant,
}

/// Buckets in Redis.
pub struct Shared {
    con: redis::aio::ConnectionManager,
    decide: redis::Script,
    settle: redis::Script,
    timeout: Duration,
    shown: String,
}

pub enum Store {
    Local(Local),
    Redis(Shared),
}

impl Local {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn level(&self, e: Option<&Entry>, now: u64, capacity: f64, window_ms: u64) -> f64 {
        bucket::level_at(e.map(|e| e.state), capacity, window_ms, now)
    }

    fn write(&self, map: &mut HashMap<String, Entry>, key: &str, e: Entry) {
        if map.len() >= MAX_LOCAL_BUCKETS && !map.contains_key(key) {
            let now = self.now_ms();
            map.retain(|_, e| {
                bucket::level_at(Some(e.state), e.capacity, e.window_ms, now) < e.capacity
            });
        }
        map.insert(key.to_string(), e);
    }

    fn decide(&self, slots: &[Slot]) -> Outcome {
        let now = self.now_ms();
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let levels: Vec<f64> = slots
            .iter()
            .map(|s| self.level(map.get(&s.key), now, s.ask.capacity, s.ask.window_ms))
            .collect();
        let asks: Vec<Withdrawal> = slots.iter().map(|s| s.ask.clone()).collect();
        let o = bucket::decide(&asks, &levels);
        if o.admitted {
            for (s, &level) in slots.iter().zip(&o.levels) {
                let e = Entry {
                    state: State { level, at_ms: now },
                    capacity: s.ask.capacity,
                    window_ms: s.ask.window_ms,
                };
                self.write(&mut map, &s.key, e);
            }
        }
        o
    }

    fn settle(&self, deltas: &[(Slot, f64)]) {
        let now = self.now_ms();
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        for (s, d) in deltas {
            let (cap, win) = (s.ask.capacity, s.ask.window_ms);
            let level = bucket::settle(self.level(map.get(&s.key), now, cap, win), *d, cap);
            let e = Entry {
                state: State { level, at_ms: now },
                capacity: cap,
                window_ms: win,
            };
            self.write(&mut map, &s.key, e);
        }
    }
}

fn field<T: std::str::FromStr>(v: &[String], i: usize) -> Result<T, String> {
    v.get(i)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("the budget script answered {v:?}"))
}

impl Shared {
    async fn decide(&self, slots: &[Slot]) -> Result<Outcome, String> {
        let mut inv = self.decide.prepare_invoke();
        for s in slots {
            inv.key(format!("{KEY_PREFIX}{}", s.key))
                .arg(s.ask.capacity)
                .arg(s.ask.window_ms)
                .arg(s.ask.amount)
                .arg(if s.ask.shadow { "1" } else { "0" });
        }
        let mut con = self.con.clone();
        let v: Vec<String> = tokio::time::timeout(self.timeout, inv.invoke_async(&mut con))
            .await
            .map_err(|_| format!("no answer in {} ms", self.timeout.as_millis()))?
            .map_err(|e| e.to_string())?;
        if v.len() != 3 + 2 * slots.len() {
            return Err(format!("the budget script answered {v:?}"));
        }
        let refusing: usize = field(&v, 2)?;
        let mut levels = Vec::with_capacity(slots.len());
        let mut would_refuse = Vec::with_capacity(slots.len());
        for i in 0..slots.len() {
            levels.push(field::<f64>(&v, 3 + 2 * i)?);
            would_refuse.push(v[4 + 2 * i] == "1");
        }
        Ok(Outcome {
            admitted: v[0] == "1",
            wait_ms: field(&v, 1)?,
            refusing: refusing.checked_sub(1),
            levels,
            would_refuse,
        })
    }

    async fn settle(&self, deltas: &[(Slot, f64)]) -> Result<(), String> {
        let mut inv = self.settle.prepare_invoke();
        for (s, d) in deltas {
            inv.key(format!("{KEY_PREFIX}{}", s.key))
                .arg(s.ask.capacity)
                .arg(s.ask.window_ms)
                .arg(*d);
        }
        let mut con = self.con.clone();
        let _: String = tokio::time::timeout(self.timeout, inv.invoke_async(&mut con))
            .await
            .map_err(|_| format!("no answer in {} ms", self.timeout.as_millis()))?
            .map_err(|e| e.to_string())?;
        Ok(())
    }
}

impl Store {
    /// Exact buckets in this process (replicas do not share them).
    pub fn local() -> Store {
        Store::Local(Local {
            map: Mutex::new(HashMap::new()),
            epoch: Instant::now(),
        })
    }

    /// Buckets in the Redis at `url`, connected lazily (a governor starts
    /// while Redis is away and each budget's `on_store_error` applies);
    /// each call gives up after `timeout`.
    ///
    /// # Errors
    /// The URL is not a Redis URL.
    pub fn redis(url: &str, timeout: Duration) -> Result<Store, String> {
        use redis::IntoConnectionInfo;
        // A peer that vanished without a reset (a replaced pod, dropped
        // packets) fails the socket within 2 s, and the manager reconnects;
        // without it a half-open connection times out every decision.
        let tcp = redis::io::tcp::TcpSettings::default()
            .set_nodelay(true)
            .set_user_timeout(Duration::from_secs(2));
        let info = url
            .into_connection_info()
            .map_err(|e| format!("--budget-store {url}: {e}"))?
            .set_tcp_settings(tcp);
        let client = redis::Client::open(info).map_err(|e| format!("--budget-store {url}: {e}"))?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout.max(Duration::from_millis(100))))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let con = client
            .get_connection_manager_lazy(config)
            .map_err(|e| format!("--budget-store {url}: {e}"))?;
        // The address without a password, for logs.
        let info = client.get_connection_info();
        let shown = format!("redis at {}", info.addr());
        Ok(Store::Redis(Shared {
            con,
            decide: redis::Script::new(DECIDE),
            settle: redis::Script::new(SETTLE),
            timeout,
            shown,
        }))
    }

    /// Where the buckets are, for logs and `/admin/state`.
    pub fn describe(&self) -> String {
        match self {
            Store::Local(_) => "in process".into(),
            Store::Redis(s) => s.shown.clone(),
        }
    }

    pub fn is_shared(&self) -> bool {
        matches!(self, Store::Redis(_))
    }

    /// One all-or-nothing decision over `slots`.
    ///
    /// # Errors
    /// The store cannot be reached or answers nonsense.
    pub async fn decide(&self, slots: &[Slot]) -> Result<Outcome, String> {
        match self {
            Store::Local(l) => Ok(l.decide(slots)),
            Store::Redis(r) => r.decide(slots).await,
        }
    }

    /// Settles a decision: each bucket gets its delta back.
    ///
    /// # Errors
    /// The store cannot be reached.
    pub async fn settle(&self, deltas: &[(Slot, f64)]) -> Result<(), String> {
        match self {
            Store::Local(l) => {
                l.settle(deltas);
                Ok(())
            }
            Store::Redis(r) => r.settle(deltas).await,
        }
    }

    /// [`Store::settle`] where it can finish now (in process) without a
    /// runtime in reach.
    pub fn settle_now(&self, deltas: &[(Slot, f64)]) -> bool {
        match self {
            Store::Local(l) => {
                l.settle(deltas);
                true
            }
            Store::Redis(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(key: &str, capacity: f64, amount: f64) -> Slot {
        Slot {
            key: key.into(),
            ask: Withdrawal {
                capacity,
                window_ms: 60_000,
                amount,
                shadow: false,
            },
        }
    }

    #[test]
    fn the_local_store_takes_all_or_nothing_and_settles() {
        let Store::Local(l) = Store::local() else {
            unreachable!()
        };
        let a = [slot("t/a:rpm", 2.0, 1.0), slot("t/a:otpm", 100.0, 60.0)];
        assert!(l.decide(&a).admitted);
        // Output is short (40 left): nothing is taken, not even a request.
        let o = l.decide(&a);
        assert!(!o.admitted);
        assert_eq!(o.refusing, Some(1));
        assert!(o.levels[0] >= 1.0 && o.levels[0] < 1.1, "{o:?}");
        // The first call used 10 of its 60: 50 back, now it fits.
        l.settle(&[(a[1].clone(), 50.0)]);
        let o = l.decide(&a);
        assert!(o.admitted, "{o:?}");
        assert!(o.levels[0] < 0.1, "{o:?}");
        // The request budget is spent: 2 per minute.
        assert!(!l.decide(&a).admitted);
    }
}
