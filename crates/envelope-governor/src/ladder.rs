//! The live guard's ladder: NORMAL -> SMALL_CONTEXT (tighter caps) ->
//! REJECT_NEW, driven by upstream readings (KV use, preemptions, reachability)
//! and GPU free memory. Worse readings move down at once; better ones move
//! back one step only after several consecutive readings clear the
//! thresholds by a margin (hysteresis, so the state does not flap). A reading
//! that is missing or stale counts as unhealthy, never as idle. Plain data.

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Normal = 0,
    SmallContext = 1,
    RejectNew = 2,
}

impl Level {
    pub fn label(self) -> &'static str {
        match self {
            Level::Normal => "normal",
            Level::SmallContext => "small_context",
            Level::RejectNew => "reject_new",
        }
    }
    fn down(self) -> Level {
        match self {
            Level::RejectNew => Level::SmallContext,
            _ => Level::Normal,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct LadderSettings {
    /// Upstream KV use (0..1) at which caps tighten.
    pub small_kv_usage: f64,
    /// Upstream KV use at which new requests are refused.
    pub reject_kv_usage: f64,
    /// How far below a threshold a reading must be to count towards recovery.
    pub recover_margin: f64,
    /// Consecutive clear readings needed to move one step back up.
    pub recover_readings: u32,
    /// No successful reading for this long: at least SMALL_CONTEXT.
    pub stale_ms: u64,
    /// No successful reading for this long: REJECT_NEW.
    pub reject_stale_ms: u64,
    /// GPU free memory under this: REJECT_NEW (when NVML is present).
    pub min_gpu_free_bytes: Option<u64>,
    /// Caps (context, output, KV budget) are multiplied by this in SMALL_CONTEXT.
    pub small_context_factor: f64,
    /// Upstream failures (unreachable, timeouts, broken streams) since the
    /// previous reading at which caps tighten.
    pub upstream_error_burst: u64,
}

impl Default for LadderSettings {
    fn default() -> Self {
        LadderSettings {
            small_kv_usage: 0.90,
            reject_kv_usage: 0.98,
            recover_margin: 0.10,
            recover_readings: 3,
            stale_ms: 5_000,
            reject_stale_ms: 30_000,
            min_gpu_free_bytes: None,
            small_context_factor: 0.5,
            upstream_error_burst: 3,
        }
    }
}

/// One poll's outcome, already reduced to what the ladder needs.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Reading {
    pub now_ms: u64,
    /// False when the fetch failed (unreachable, HTTP error, unparseable).
    pub ok: bool,
    pub kv_usage: Option<f64>,
    pub preemptions_total: Option<f64>,
    pub gpu_free_bytes: Option<u64>,
    /// Upstream failures the proxy saw since the previous reading.
    pub upstream_errors: u64,
}

#[derive(Debug, Clone)]
pub struct Ladder {
    cfg: LadderSettings,
    level: Level,
    last_ok_ms: Option<u64>,
    started_ms: u64,
    last_preemptions: Option<f64>,
    clear_streak: u32,
    /// Why the last move down happened.
    pub cause: &'static str,
}

impl Ladder {
    pub fn new(cfg: LadderSettings, now_ms: u64) -> Ladder {
        Ladder {
            cfg,
            level: Level::Normal,
            last_ok_ms: None,
            started_ms: now_ms,
            last_preemptions: None,
            clear_streak: 0,
            cause: "start",
        }
    }

    pub fn level(&self) -> Level {
        self.level
    }

    pub fn config(&self) -> &LadderSettings {
        &self.cfg
    }

    /// The level `r` asks for, with thresholds lowered by `margin`.
    fn target(&self, r: &Reading, preempted: bool, margin: f64) -> (Level, &'static str) {
        let since_ok = r
            .now_ms
            .saturating_sub(self.last_ok_ms.unwrap_or(self.started_ms));
        let mut worst = (Level::Normal, "healthy");
        let mut see = |l: Level, why: &'static str| {
            if l > worst.0 {
                worst = (l, why);
            }
        };
        if since_ok >= self.cfg.reject_stale_ms {
            see(Level::RejectNew, "stale_readings");
        } else if !r.ok || since_ok >= self.cfg.stale_ms {
            see(Level::SmallContext, "stale_readings");
        }
        if let Some(kv) = r.kv_usage {
            if kv >= self.cfg.reject_kv_usage - margin {
                see(Level::RejectNew, "kv_usage");
            } else if kv >= self.cfg.small_kv_usage - margin {
                see(Level::SmallContext, "kv_usage");
            }
        }
        if preempted {
            see(Level::SmallContext, "preemptions");
        }
        if r.upstream_errors >= self.cfg.upstream_error_burst.max(1) {
            see(Level::SmallContext, "upstream_errors");
        }
        if let (Some(free), Some(min)) = (r.gpu_free_bytes, self.cfg.min_gpu_free_bytes) {
            let min = (min as f64 * (1.0 + margin)) as u64;
            if free < min {
                see(Level::RejectNew, "gpu_free_memory");
            }
        }
        worst
    }

    /// Feeds one reading; returns the level after it.
    pub fn observe(&mut self, r: Reading) -> Level {
        if r.ok {
            self.last_ok_ms = Some(r.now_ms);
        }
        let preempted = match (self.last_preemptions, r.preemptions_total) {
            (Some(a), Some(b)) => b > a,
            _ => false,
        };
        if r.preemptions_total.is_some() {
            self.last_preemptions = r.preemptions_total;
        }
        let (now, why) = self.target(&r, preempted, 0.0);
        if now > self.level {
            self.level = now;
            self.cause = why;
            self.clear_streak = 0;
            return self.level;
        }
        let (clear, _) = self.target(&r, preempted, self.cfg.recover_margin);
        if clear < self.level {
            self.clear_streak += 1;
            if self.clear_streak >= self.cfg.recover_readings {
                self.level = self.level.down();
                self.clear_streak = 0;
            }
        } else {
            self.clear_streak = 0;
        }
        self.level
    }

    /// Re-evaluates staleness with no new reading (the poller's timer).
    pub fn tick(&mut self, now_ms: u64) -> Level {
        self.observe(Reading {
            now_ms,
            ok: false,
            ..Reading::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(now_ms: u64, kv: f64) -> Reading {
        Reading {
            now_ms,
            ok: true,
            kv_usage: Some(kv),
            preemptions_total: Some(0.0),
            gpu_free_bytes: None,
            upstream_errors: 0,
        }
    }

    fn ladder() -> Ladder {
        Ladder::new(LadderSettings::default(), 0)
    }

    #[test]
    fn moves_down_at_once_and_up_slowly() {
        let mut l = ladder();
        assert_eq!(l.observe(ok(100, 0.5)), Level::Normal);
        assert_eq!(l.observe(ok(200, 0.99)), Level::RejectNew);
        assert_eq!(l.cause, "kv_usage");
        // 0.85 is below 0.98 but not below 0.98 - 0.10: no recovery.
        for t in 0..10 {
            assert_eq!(l.observe(ok(300 + t, 0.89)), Level::RejectNew);
        }
        // Clear readings: three to SMALL_CONTEXT, three more to NORMAL.
        assert_eq!(l.observe(ok(400, 0.5)), Level::RejectNew);
        assert_eq!(l.observe(ok(500, 0.5)), Level::RejectNew);
        assert_eq!(l.observe(ok(600, 0.5)), Level::SmallContext);
        assert_eq!(l.observe(ok(700, 0.5)), Level::SmallContext);
        assert_eq!(l.observe(ok(800, 0.5)), Level::SmallContext);
        assert_eq!(l.observe(ok(900, 0.5)), Level::Normal);
    }

    #[test]
    fn a_bad_reading_resets_the_recovery_streak() {
        let mut l = ladder();
        l.observe(ok(0, 0.92));
        assert_eq!(l.level(), Level::SmallContext);
        l.observe(ok(1, 0.1));
        l.observe(ok(2, 0.1));
        l.observe(ok(3, 0.85)); // inside the margin band: not clear
        l.observe(ok(4, 0.1));
        assert_eq!(l.observe(ok(5, 0.1)), Level::SmallContext);
        assert_eq!(l.observe(ok(6, 0.1)), Level::Normal);
    }

    #[test]
    fn stale_or_failed_readings_are_unhealthy_never_idle() {
        let mut l = ladder();
        l.observe(ok(0, 0.0));
        // A failed fetch: SMALL_CONTEXT at once.
        let failed = Reading {
            now_ms: 100,
            ..Reading::default()
        };
        assert_eq!(l.observe(failed), Level::SmallContext);
        assert_eq!(l.cause, "stale_readings");
        // Still failing past reject_stale_ms: REJECT_NEW.
        assert_eq!(l.tick(29_999), Level::SmallContext);
        assert_eq!(l.tick(30_000), Level::RejectNew);
        // Never having had a reading counts from start.
        let mut l = ladder();
        assert_eq!(l.tick(6_000), Level::SmallContext);
    }

    #[test]
    fn preemptions_tighten_caps() {
        let mut l = ladder();
        let mut r = ok(0, 0.3);
        l.observe(r);
        r.now_ms = 1;
        r.preemptions_total = Some(2.0);
        assert_eq!(l.observe(r), Level::SmallContext);
        assert_eq!(l.cause, "preemptions");
        // Counter unchanged: clear again.
        for t in 2..5 {
            r.now_ms = t;
            l.observe(r);
        }
        assert_eq!(l.level(), Level::Normal);
    }

    #[test]
    fn gpu_free_memory_floor() {
        let cfg = LadderSettings {
            min_gpu_free_bytes: Some(1000),
            ..LadderSettings::default()
        };
        let mut l = Ladder::new(cfg, 0);
        let mut r = ok(0, 0.1);
        r.gpu_free_bytes = Some(999);
        assert_eq!(l.observe(r), Level::RejectNew);
        assert_eq!(l.cause, "gpu_free_memory");
        // 1050 is above the floor but inside the 10% margin: stays.
        r.gpu_free_bytes = Some(1050);
        for t in 1..6 {
            r.now_ms = t;
            assert_eq!(l.observe(r), Level::RejectNew);
        }
        r.gpu_free_bytes = Some(5000);
        for t in 6..12 {
            r.now_ms = t;
            l.observe(r);
        }
        assert_eq!(l.level(), Level::Normal);
    }

    #[test]
    fn bursts_of_upstream_errors_tighten_caps() {
        let mut l = ladder();
        let mut r = ok(0, 0.1);
        r.upstream_errors = 2;
        assert_eq!(l.observe(r), Level::Normal);
        r.upstream_errors = 3;
        assert_eq!(l.observe(r), Level::SmallContext);
        assert_eq!(l.cause, "upstream_errors");
        r.upstream_errors = 0;
        for t in 1..4 {
            r.now_ms = t;
            l.observe(r);
        }
        assert_eq!(l.level(), Level::Normal);
    }

    #[test]
    fn labels() {
        assert_eq!(Level::SmallContext.label(), "small_context");
        assert!(Level::RejectNew > Level::Normal);
    }
}
