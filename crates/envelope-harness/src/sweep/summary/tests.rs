use super::*;
use envelope_profile::Profile;

/// A whole answer: TTFT, then `out - 1` gaps of `itl_s`.
fn rec(ttft_s: f64, itl_s: f64, out: u32) -> RequestRecord {
    RequestRecord {
        ttft_s: Some(ttft_s),
        itl_s: vec![itl_s; out.saturating_sub(1) as usize],
        e2e_s: ttft_s + itl_s * out.saturating_sub(1) as f64,
        input_tokens: 64,
        output_tokens: out,
        finish_reason: Some("length".into()),
        ..Default::default()
    }
}

fn run(records: Vec<RequestRecord>, duration_s: f64) -> ProbeRun {
    ProbeRun {
        records,
        duration_s,
        ..Default::default()
    }
}

fn slo() -> Slo {
    Slo {
        ttft_p95_ms: Some(500.0),
        itl_p95_ms: Some(100.0),
        e2e_p99_ms: Some(5_000.0),
        ..Slo::default()
    }
}

#[test]
fn a_probe_is_summarised_from_its_whole_answers() {
    // Four answers of 33 tokens in 2 s, one of them too slow to start for
    // the TTFT SLO, and one failed request.
    let mut records = vec![rec(0.1, 0.02, 33); 3];
    records.push(rec(0.9, 0.02, 33));
    records.push(RequestRecord {
        error: Some("short_output: 3 of 33 tokens".into()),
        output_tokens: 3,
        ..rec(0.1, 0.02, 3)
    });
    let s = summarise(&run(records, 2.0), 4, &slo(), &LoadConfig::default());
    assert_eq!((s.requests, s.errors), (5, 1));
    // The failed request's tokens count for nothing.
    assert!(
        (s.output_tok_per_s - 4.0 * 33.0 / 2.0).abs() < 1e-9,
        "{s:?}"
    );
    assert!(
        (s.decode_tok_per_s - 4.0 * 32.0 / 2.0).abs() < 1e-9,
        "{s:?}"
    );
    assert!((s.request_per_s - 2.0).abs() < 1e-9);
    // Goodput: the three within the TTFT SLO.
    assert!((s.goodput_req_per_s - 1.5).abs() < 1e-9, "{s:?}");
    assert!((s.ttft_ms.p50 - 100.0).abs() < 1.0, "{:?}", s.ttft_ms);
    assert_eq!(s.error_reasons.get("short_output"), Some(&1));
    // One error in five breaks a zero error rate, and the slow start is
    // the p95 of four TTFTs.
    assert_eq!(s.breaches, vec![Constraint::Errors, Constraint::TtftP95]);
}

#[test]
fn a_client_that_idles_makes_the_probe_invalid() {
    let mut r = run(vec![rec(0.1, 0.02, 33); 4], 2.0);
    let load = LoadConfig::default();
    assert!(summarise(&r, 4, &slo(), &load).valid);
    // A worker idle for longer than the gap allowed (and a quarter of a
    // median request) was not keeping the loop closed.
    r.max_client_gap_s = 1.0;
    let s = summarise(&r, 4, &slo(), &load);
    assert!(!s.valid);
    assert_eq!(s.breaches, vec![Constraint::ClientLimited]);
}

#[test]
fn breaches_name_the_kv_cache_first() {
    let mut s = ProbeSummary {
        requests: 10,
        preemptions: Some(2),
        valid: true,
        ..Default::default()
    };
    s.ttft_ms.p95 = 900.0;
    assert_eq!(
        breaches(&s, &slo()),
        vec![
            Constraint::KvCache,
            Constraint::Preemption,
            Constraint::TtftP95
        ]
    );
    // KV use over the SLO's maximum without preempting.
    s.preemptions = Some(0);
    s.ttft_ms.p95 = 10.0;
    s.kv_usage_max = Some(0.99);
    let tight = Slo {
        max_kv_usage: 0.95,
        ..slo()
    };
    assert_eq!(breaches(&s, &tight), vec![Constraint::KvCache]);
    assert!(breaches(&s, &slo()).is_empty());
    // A probe with no requests measured nothing: an error.
    let empty = ProbeSummary {
        valid: true,
        ..Default::default()
    };
    assert_eq!(breaches(&empty, &slo()), vec![Constraint::Errors]);
}

fn probe(concurrency: u32, tok_s: f64) -> ProbeSummary {
    ProbeSummary {
        concurrency,
        output_tok_per_s: tok_s,
        ..Default::default()
    }
}

#[test]
fn the_knee_is_where_doubling_stops_paying() {
    let p = [
        probe(1, 100.0),
        probe(2, 190.0),
        probe(4, 300.0),
        probe(8, 320.0),
    ];
    assert_eq!(knee(&p), Some(4));
    // Probes that breached are not on the curve.
    let mut q = p.to_vec();
    q[3].breaches = vec![Constraint::TtftP95];
    assert_eq!(knee(&q), None);
    // Order does not matter.
    let mut r = p.to_vec();
    r.reverse();
    assert_eq!(knee(&r), Some(4));
}

#[test]
fn a_bucket_binds_on_the_first_breach_above_its_feasible_level() {
    let bucket = Bucket::cold(64, 32);
    let mut over = probe(8, 300.0);
    over.breaches = vec![Constraint::ItlP95, Constraint::Errors];
    let probes = vec![(4, probe(4, 250.0)), (8, over)];
    let mut search = LevelSearch::new(1, 64);
    search.record(4, LevelVerdict::Holds);
    search.record(8, LevelVerdict::Breached);
    let load = LoadConfig::default();
    let b = bucket_result(&load, 0.25, bucket, &search, probes.clone());
    assert_eq!(b.feasible_concurrency, 4);
    assert_eq!(b.safe_concurrency, 3);
    assert_eq!(b.binding_constraint, Constraint::ItlP95);
    assert_eq!(b.at_feasible.as_ref().map(|p| p.concurrency), Some(4));
    assert_eq!(b.probes.len(), 2);
    // Decided breached just above: the feasible level is exact.
    assert_eq!((b.feasible_upper, b.safe_upper), (Some(7.0), Some(5.0)));
    // Never breached up to the search's maximum: the cap binds, and no
    // level above bounds the interval.
    let mut capped = LevelSearch::new(1, 64);
    capped.record(64, LevelVerdict::Holds);
    let b = bucket_result(&load, 0.25, bucket, &capped, vec![(64, probe(64, 900.0))]);
    assert_eq!(b.binding_constraint, Constraint::SearchCap);
    assert_eq!(b.safe_concurrency, 48);
    assert_eq!(b.feasible_upper, None);
}

#[test]
fn a_warm_bucket_is_warm_only_where_the_server_found_its_prefix() {
    let warm = Bucket::parse("512x32@75%").unwrap();
    let mut search = LevelSearch::new(1, 64);
    search.record(4, LevelVerdict::Holds);
    let load = LoadConfig::default();
    let with_hits = |rates: &[(u64, Option<f64>)]| {
        let probes = rates
            .iter()
            .enumerate()
            .map(|(i, (n, h))| {
                let mut p = probe(i as u32 + 1, 100.0);
                p.requests = *n;
                p.prefix_cache_hit_rate = *h;
                (i as u32 + 1, p)
            })
            .collect();
        bucket_result(&load, 0.25, warm, &search, probes)
            .cached_prefix
            .unwrap()
    };
    // Weighted by requests: (10 x 0.3 + 30 x 0.7) / 40 = 0.6, over half of 0.75.
    let held = with_hits(&[(10, Some(0.3)), (30, Some(0.7)), (5, None)]);
    assert_eq!(held.intended_share, 0.75);
    assert!((held.observed_hit_rate.unwrap() - 0.6).abs() < 1e-9);
    assert!(held.held);
    // Under half the intended share: measured, and said to be cold.
    let low = with_hits(&[(20, Some(0.3))]);
    assert!(!low.held && low.observed_hit_rate == Some(0.3));
    // A server that says nothing is never taken as warm.
    let silent = with_hits(&[(20, None)]);
    assert!(!silent.held && silent.observed_hit_rate.is_none());
    // A cold bucket has no prefix to check.
    let cold = bucket_result(&load, 0.25, Bucket::cold(512, 32), &search, vec![]);
    assert!(cold.cached_prefix.is_none() && cold.is_cold());
}

#[test]
fn a_probe_s_hit_rate_comes_from_the_counters_else_the_answers() {
    let rec = |input: u32, cached: Option<u32>| RequestRecord {
        input_tokens: input,
        cached_tokens: cached,
        ..Default::default()
    };
    let mut run = ProbeRun {
        records: vec![rec(100, Some(50)), rec(100, Some(100)), rec(100, None)],
        ..Default::default()
    };
    assert_eq!(hit_rate(&run), Some(0.75));
    run.prefix_cache = Some(crate::record::PrefixCache {
        queries: 400.0,
        hits: 100.0,
    });
    assert_eq!(hit_rate(&run), Some(0.25));
    run.prefix_cache = None;
    run.records = vec![rec(100, None)];
    assert_eq!(hit_rate(&run), None);
}

#[test]
fn the_kv_tokens_the_governor_may_reserve() {
    let text = include_str!("../../../../../tests/fixtures/quickstart-profile-542d032.json");
    let p = Profile::from_json(text, "profile.json").unwrap();
    let mut c = p.configs[0].clone();
    c.memory.kv_capacity_tokens = 1000;
    assert_eq!(kv_tokens_limit(&c, 0.1), 900);
    // Capacity unknown (a server whose metrics do not say): what the
    // buckets' safe points hold at most.
    c.memory.kv_capacity_tokens = 0;
    let most = c
        .buckets
        .iter()
        .map(|b| b.safe_concurrency as u64 * (b.input_tokens + b.output_tokens) as u64)
        .max()
        .unwrap();
    assert!(most > 0);
    assert_eq!(kv_tokens_limit(&c, 0.1), most);
    c.buckets.clear();
    assert_eq!(kv_tokens_limit(&c, 0.1), 1);
}

#[test]
fn refusals_are_shed_load_not_failures() {
    // A governed target: 18 whole answers and 2 refusals (429 with
    // Retry-After) out of 20.
    let refusal = RequestRecord {
        error: Some("refused: HTTP 429, retry after 1 s".into()),
        retry_after_s: Some(1.0),
        ..Default::default()
    };
    let mut records = vec![rec(0.1, 0.02, 33); 18];
    records.extend([refusal.clone(), refusal]);
    let s = summarise(&run(records, 2.0), 4, &slo(), &LoadConfig::default());
    assert_eq!((s.requests, s.errors, s.refused), (20, 0, 2));
    assert!(s.error_reasons.is_empty(), "{:?}", s.error_reasons);
    // 10% shed: over the default 5% it breaches `shed`, not `errors`.
    assert_eq!(s.breaches, vec![Constraint::Shed]);
    let lenient = Slo {
        max_shed_rate: 0.1,
        ..slo()
    };
    assert!(breaches(&s, &lenient).is_empty());
    // A failure among the admitted ones is still one.
    let mut failed = s.clone();
    failed.errors = 1;
    assert_eq!(breaches(&failed, &lenient), vec![Constraint::Errors]);
}

#[test]
fn no_safe_point_says_why_per_configuration() {
    let probe = |c: u32| ProbeSummary {
        concurrency: c,
        breaches: vec![Constraint::TtftP95],
        ..Default::default()
    };
    let bucket = BucketResult {
        input_tokens: 64,
        output_tokens: 32,
        feasible_concurrency: 0,
        infeasible_concurrency: Some(1),
        safe_concurrency: 0,
        binding_constraint: Constraint::TtftP95,
        knee_concurrency: None,
        at_feasible: None,
        feasible_rate_per_s: None,
        safe_rate_per_s: None,
        feasible_upper: None,
        safe_upper: None,
        cached_prefix: None,
        repeats: vec![],
        probes: vec![probe(1)],
    };
    let config = |name: &str, error: Option<&str>| ConfigResult {
        name: name.into(),
        precision: "q4_1".into(),
        kv_dtype: "f16".into(),
        batch_policy: "continuous".into(),
        max_num_seqs: 4,
        memory: Default::default(),
        backend: None,
        buckets: vec![bucket.clone()],
        error: error.map(str::to_string),
        server_checks: None,
        time_to_ready_s: None,
        workload: None,
        trace: None,
    };
    let why = crate::sweep::why_no_safe_point(&[
        config("a", None),
        config("b", Some("server check failed: HTTP 500")),
    ]);
    assert_eq!(
        why,
        "a: no bucket was safe at any load: 64x32 breached ttft_p95 already at concurrency 1 | b: server check failed: HTTP 500"
    );
}

fn bucket(input_tokens: u32, output_tokens: u32, safe: u32) -> BucketResult {
    BucketResult {
        input_tokens,
        output_tokens,
        feasible_concurrency: safe + 1,
        infeasible_concurrency: None,
        safe_concurrency: safe,
        binding_constraint: Constraint::SearchCap,
        knee_concurrency: None,
        at_feasible: None,
        feasible_rate_per_s: None,
        safe_rate_per_s: None,
        feasible_upper: None,
        safe_upper: None,
        cached_prefix: None,
        probes: vec![],
        repeats: vec![],
    }
}

#[test]
fn repeats_keep_every_search_and_the_lower_median_safe_point() {
    let config = |safe: &[u32], peak: u64, error: Option<&str>| ConfigResult {
        name: "c".into(),
        precision: "q4_1".into(),
        kv_dtype: "f32".into(),
        batch_policy: "continuous".into(),
        max_num_seqs: 8,
        memory: envelope_profile::MemoryReport {
            peak_bytes: Some(peak),
            ..Default::default()
        },
        backend: None,
        buckets: safe
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                let mut b = bucket(64 * (i as u32 + 1), 32, s);
                b.probes = vec![probe(s, 10.0 * s as f64)];
                b
            })
            .collect(),
        error: error.map(String::from),
        server_checks: None,
        time_to_ready_s: None,
        workload: None,
        trace: None,
    };
    // One repeat: itself, no repeats listed.
    let one = merge_repeats(vec![vec![config(&[4], 10, None)]]);
    assert_eq!(one, vec![config(&[4], 10, None)]);
    // Three repeats of two buckets: safe points (5, 3, 4) and (2, 2, 6).
    let merged = merge_repeats(vec![
        vec![config(&[5, 2], 10, None)],
        vec![config(&[3, 2], 30, Some("crashed once"))],
        vec![config(&[4, 6], 20, None)],
    ]);
    let c = &merged[0];
    let safe = |b: usize| {
        c.buckets[b]
            .repeats
            .iter()
            .map(|r| r.safe_concurrency)
            .collect::<Vec<_>>()
    };
    assert_eq!(safe(0), [5, 3, 4]);
    assert_eq!(safe(1), [2, 2, 6]);
    // The lower median of each, with its own probes.
    assert_eq!(c.buckets[0].safe_concurrency, 4);
    assert_eq!(c.buckets[0].probes[0].concurrency, 4);
    assert_eq!(c.buckets[1].safe_concurrency, 2);
    assert_eq!(c.buckets[0].repeats[1].probes[0].output_tok_per_s, 30.0);
    assert_eq!(c.memory.peak_bytes, Some(30));
    assert_eq!(c.error.as_deref(), Some("crashed once"));
    // Four repeats: the lower of the two middle ones.
    let merged = merge_repeats((1..=4).map(|s| vec![config(&[s], 1, None)]).collect());
    assert_eq!(merged[0].buckets[0].safe_concurrency, 2);
}

#[test]
fn each_latency_slo_is_checked_on_its_own_samples() {
    // 50 answers of 33 tokens; 2 start over the TTFT limit; every token
    // gap is within the ITL limit; 1 takes over the end-to-end limit.
    let mut records = vec![rec(0.1, 0.02, 33); 47];
    records.push(rec(0.9, 0.02, 33));
    records.push(rec(0.9, 0.02, 33));
    records.push(rec(0.1, 0.2, 33)); // 6.5 s end to end; gaps of 200 ms
    let s = summarise(&run(records, 10.0), 4, &slo(), &LoadConfig::default());
    let by = |c: Constraint| s.slo_checks.iter().find(|x| x.slo == c).unwrap();
    let ttft = by(Constraint::TtftP95);
    assert_eq!((ttft.samples, ttft.over), (50, 2));
    // Clopper-Pearson at 90% one-sided (the binomial sums solved by
    // bisection, by hand): the share over is in [0.0107, 0.1030]; 5% lies
    // inside, so the p95 is undecided.
    assert!((ttft.over_share_upper - 0.1030).abs() < 1e-3, "{ttft:?}");
    assert!((ttft.over_share_lower - 0.0107).abs() < 1e-3, "{ttft:?}");
    assert_eq!(ttft.decision, Decision::Undecided);
    let itl = by(Constraint::ItlP95);
    assert_eq!((itl.samples, itl.over), (50 * 32, 32));
    assert_eq!(itl.decision, Decision::Holds);
    let e2e = by(Constraint::E2eP99);
    assert_eq!((e2e.samples, e2e.over, e2e.percentile), (50, 1, 0.99));
    assert_eq!(e2e.decision, Decision::Undecided);
    // 2 of 50 is under 5% over the TTFT limit, but 1 of 50 is over the
    // p99's 1%: the screen looks breached on e2e alone, and a probe
    // extended to its budget in this state is undecided.
    assert_eq!(s.breaches, vec![Constraint::E2eP99]);
    assert_eq!(decision(&s), Decision::Undecided);
    assert_eq!(level_verdict(&s, false), LevelVerdict::LooksBad);
    assert_eq!(level_verdict(&s, true), LevelVerdict::Undecided);
    let p95s_only = Slo {
        e2e_p99_ms: None,
        ..slo()
    };
    let s2 = summarise(
        &run(s_records_with_two_slow(), 10.0),
        4,
        &p95s_only,
        &LoadConfig::default(),
    );
    assert!(s2.breaches.is_empty(), "{:?}", s2.breaches);
    assert_eq!(level_verdict(&s2, false), LevelVerdict::LooksOk);
    // Without the SLOs it cannot decide, the probe holds.
    let p95s = Slo {
        e2e_p99_ms: None,
        ttft_p95_ms: Some(1000.0),
        ..slo()
    };
    let s = summarise(&run(s_records(), 10.0), 4, &p95s, &LoadConfig::default());
    assert_eq!(decision(&s), Decision::Holds);
    assert_eq!(level_verdict(&s, false), LevelVerdict::Holds);
}

fn s_records() -> Vec<RequestRecord> {
    vec![rec(0.1, 0.02, 33); 45]
}

fn s_records_with_two_slow() -> Vec<RequestRecord> {
    let mut r = vec![rec(0.1, 0.02, 33); 48];
    r.extend([rec(0.9, 0.02, 33), rec(0.9, 0.02, 33)]);
    r
}

#[test]
fn a_breach_is_decided_as_soon_as_the_sample_shows_it() {
    // 4 of 5 over the TTFT limit: 4 ln 2 - 0.054 = 2.72, past ln 9, a
    // breach by the sequential test.
    let mut records = vec![rec(0.9, 0.02, 33); 4];
    records.push(rec(0.1, 0.02, 33));
    let s = summarise(
        &run(records.clone(), 1.0),
        5,
        &slo(),
        &LoadConfig::default(),
    );
    assert_eq!(s.breaches, vec![Constraint::TtftP95]);
    assert_eq!(decision(&s), Decision::Breached);
    assert_eq!(level_verdict(&s, false), LevelVerdict::Breached);
    let stop = stop_when_decided(&slo(), vec![], 0);
    assert!(stop(&records));
    // One fast answer decides nothing.
    assert!(!stop(&records[4..]));
    // 3 of 4 over is not yet one.
    assert!(!stop(&records[1..]));
    // A limit that is not a percentile is decided outright.
    let mut kv = summarise(
        &run(vec![rec(0.1, 0.02, 33)], 1.0),
        1,
        &slo(),
        &LoadConfig::default(),
    );
    kv.breaches.insert(0, Constraint::KvCache);
    assert_eq!(decision(&kv), Decision::Breached);
}

#[test]
fn a_probe_stops_once_every_slo_holds_counting_the_requests_it_extends() {
    let p95s = Slo {
        e2e_p99_ms: None,
        ..slo()
    };
    let fast = vec![rec(0.1, 0.02, 33); 60];
    let stop = stop_when_decided(&p95s, vec![], 0);
    assert!(!stop(&fast[..40]));
    assert!(stop(&fast[..41]));
    // A screening probe of 60 sends them all: the KV cache is only seen
    // under the whole load.
    let screen = stop_when_decided(&p95s, vec![], 60);
    assert!(!screen(&fast[..59]));
    assert!(screen(&fast));
    // Extending a level's 36 earlier requests: 5 more decide it.
    let stop = stop_when_decided(&p95s, fast[..36].to_vec(), 0);
    assert!(!stop(&fast[..4]));
    assert!(stop(&fast[..5]));
    // With no failure allowed, one failure decides.
    let failed = RequestRecord {
        error: Some("stream_cut: x".into()),
        ..rec(0.1, 0.02, 3)
    };
    assert!(stop(&[failed]));
    // No latency SLO: nothing to decide early.
    let none = Slo {
        max_error_rate: 0.5,
        ..Slo::default()
    };
    assert!(!stop_when_decided(&none, vec![], 0)(&fast));
}

#[test]
fn the_requests_a_verdict_needs_follow_the_percentile_and_confidence() {
    let c90 = slo();
    assert_eq!(requests_to_decide(&c90, 32), 108); // the p99
    let p95s = Slo {
        e2e_p99_ms: None,
        ..slo()
    };
    assert_eq!(requests_to_decide(&p95s, 32), 41);
    let itl_only = Slo {
        ttft_p95_ms: None,
        ..p95s.clone()
    };
    // 41 token gaps: two answers of 32 tokens (31 gaps each).
    assert_eq!(requests_to_decide(&itl_only, 32), 2);
    let c99 = Slo {
        confidence: 0.99,
        ..p95s
    };
    // ln 99 / -ln(0.90 / 0.95) = 84.99.
    assert_eq!(requests_to_decide(&c99, 32), 85);
    assert_eq!(requests_to_decide(&Slo::default(), 32), 0);
}

#[test]
fn a_level_may_spend_four_times_what_a_verdict_needs_unless_told() {
    let p95s = Slo {
        e2e_p99_ms: None,
        ..slo()
    };
    let load = LoadConfig::default();
    assert_eq!(max_requests(&load, &p95s, 32), 4 * 41);
    assert_eq!(max_requests(&load, &slo(), 32), 4 * 108);
    let told = LoadConfig {
        max_requests: Some(100),
        ..LoadConfig::default()
    };
    assert_eq!(max_requests(&told, &p95s, 32), 100);
    // Never fewer than a screen sends.
    let few = LoadConfig {
        max_requests: Some(3),
        min_requests: 8,
        ..LoadConfig::default()
    };
    assert_eq!(max_requests(&few, &p95s, 32), 8);
    assert_eq!(
        max_requests(&LoadConfig::default(), &Slo::default(), 32),
        LoadConfig::default().min_requests
    );
}

#[test]
fn the_next_chunk_is_what_would_decide_the_level_if_every_answer_were_fast() {
    let p95s = Slo {
        e2e_p99_ms: None,
        ..slo()
    };
    let fast = vec![rec(0.1, 0.02, 33); 16];
    // 16 clean TTFT samples of the 41 a p95 needs at 90%.
    assert_eq!(requests_to_hold(&fast, &p95s, 33), Some(25));
    // One over the limit: the level holds from the first n where the
    // sequential test says so, and not one request before.
    let mut one_slow = fast.clone();
    one_slow.push(rec(0.9, 0.02, 33));
    let n = requests_to_hold(&one_slow, &p95s, 33).unwrap() as u64 + 17;
    let test = p95s.test(0.95);
    assert_eq!(n, 55);
    assert_eq!(test.decide(1, n), Decision::Holds);
    assert_eq!(test.decide(1, n - 1), Decision::Undecided);
    // Decided already either way: nothing more, or nothing to wait for.
    assert_eq!(
        requests_to_hold(&vec![rec(0.1, 0.02, 33); 45], &p95s, 33),
        Some(0)
    );
    assert_eq!(
        requests_to_hold(&vec![rec(0.9, 0.02, 33); 4], &p95s, 33),
        None
    );
    assert_eq!(requests_to_hold(&fast, &Slo::default(), 33), None);
    // ITL alone counts gaps: 32 a request, 41 needed, 1 request in hand.
    let itl = Slo {
        ttft_p95_ms: None,
        ..p95s
    };
    assert_eq!(requests_to_hold(&fast[..1], &itl, 33), Some(1));
}

#[test]
fn the_warm_up_counts_in_throughput_and_not_in_the_verdict() {
    let p95s = Slo {
        e2e_p99_ms: None,
        ..slo()
    };
    // Eight slow answers while the workers ramped in, then 41 fast ones.
    let mut records = vec![
        RequestRecord {
            warmup: true,
            ..rec(0.9, 0.02, 33)
        };
        8
    ];
    records.extend(vec![rec(0.1, 0.02, 33); 41]);
    let s = summarise(
        &run(records.clone(), 10.0),
        8,
        &p95s,
        &LoadConfig::default(),
    );
    assert_eq!((s.requests, s.warmup_requests), (49, 8));
    assert!((s.request_per_s - 4.9).abs() < 1e-9);
    assert!(s.ttft_ms.max < 200.0, "{:?}", s.ttft_ms);
    assert_eq!(decision(&s), Decision::Holds);
    // The same answers counted as the level's: eight of 49 over, a breach.
    for r in &mut records {
        r.warmup = false;
    }
    let s = summarise(&run(records, 10.0), 8, &p95s, &LoadConfig::default());
    assert_eq!(decision(&s), Decision::Breached);
}
