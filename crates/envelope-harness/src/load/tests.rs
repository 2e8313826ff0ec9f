use super::*;
use crate::record::Snapshot;

#[test]
fn datasets_read_lines_and_json_lines_and_name_bad_lines() {
    let dir = std::env::temp_dir().join(format!("envelope-prompts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("p.jsonl");
    std::fs::write(
        &f,
        "plain prompt\n\n{\"prompt\": \"json prompt\"}\n{\"text\": \"t\"}\n",
    )
    .unwrap();
    match Prompts::from_file(&f).unwrap() {
        Prompts::Dataset(p) => assert_eq!(*p, vec!["plain prompt", "json prompt", "t"]),
        Prompts::Synthetic => panic!("a dataset"),
    }
    std::fs::write(&f, "ok\n{\"messages\": []}\n").unwrap();
    let e = Prompts::from_file(&f).unwrap_err();
    assert!(e.contains("p.jsonl:2") && e.contains("prompt"), "{e}");
    std::fs::write(&f, "\n\n").unwrap();
    assert!(Prompts::from_file(&f).unwrap_err().contains("no prompts"));
    assert!(Prompts::from_file(&dir.join("missing")).is_err());
}

/// Records what it is sent; tokenizes bytes when asked to.
struct Recorder {
    tokenizes: bool,
    seen: Mutex<Vec<LoadRequest>>,
}

impl Driver for Recorder {
    fn vocab_size(&self) -> usize {
        1000
    }
    fn tokenize(&self, text: &str) -> Option<Vec<u32>> {
        self.tokenizes
            .then(|| text.bytes().map(u32::from).collect())
    }
    fn send(&self, req: &LoadRequest, _t0: Instant, rec: &mut RequestRecord) {
        rec.output_tokens = req.output_tokens;
        rec.finish_reason = Some("length".into());
        self.seen.lock().unwrap().push(req.clone());
    }
    fn snapshot(&self) -> Snapshot {
        Snapshot::default()
    }
}

#[test]
fn a_warm_bucket_primes_its_prefix_and_every_prompt_shares_it() {
    let bucket = Bucket::parse("40x2@75%").unwrap();
    assert_eq!(bucket.prefix_tokens(), 30);
    let r = Arc::new(Recorder {
        tokenizes: false,
        seen: Mutex::new(vec![]),
    });
    let d: Arc<dyn Driver> = r.clone();
    let run = closed_loop(&d, &Prompts::Synthetic, bucket, 2, 6, 7, None);
    assert_eq!(run.records.len(), 6, "the priming request is not recorded");
    let seen = r.seen.lock().unwrap();
    // First the prefix alone, one token out; then the probe's six.
    assert_eq!(seen.len(), 7);
    let prefix = shared_prefix(bucket, 1000);
    assert_eq!(seen[0].prompt_tokens, prefix);
    assert_eq!(seen[0].output_tokens, 1);
    let probe = &seen[1..];
    assert!(probe.iter().all(|q| q.prompt_tokens.len() == 40));
    assert!(probe.iter().all(|q| q.prompt_tokens[..30] == prefix[..]));
    // Each keeps its own tail: no two prompts are the same.
    let tails: std::collections::HashSet<_> = probe
        .iter()
        .map(|q| q.prompt_tokens[30..].to_vec())
        .collect();
    assert_eq!(tails.len(), 6);
    drop(seen);
    // A probe with another salt shares the same prefix (it stays
    // cached from one probe to the next); another bucket does not.
    let again = closed_loop(&d, &Prompts::Synthetic, bucket, 1, 1, 99, None);
    assert_eq!(again.records.len(), 1);
    assert_eq!(
        r.seen.lock().unwrap().last().unwrap().prompt_tokens[..30],
        prefix[..]
    );
    let other = shared_prefix(Bucket::parse("40x2@50%").unwrap(), 1000);
    assert_ne!(other[..20], prefix[..20]);
    // A cold bucket sends no priming request, and its prompts share nothing.
    r.seen.lock().unwrap().clear();
    closed_loop(&d, &Prompts::Synthetic, Bucket::cold(40, 2), 2, 4, 7, None);
    let seen = r.seen.lock().unwrap();
    assert_eq!(seen.len(), 4);
    assert!(seen.iter().all(|q| q.output_tokens == 2));
    assert_ne!(seen[0].prompt_tokens[..8], seen[1].prompt_tokens[..8]);
}

#[test]
fn dataset_prompts_reach_the_driver_as_tokens_or_as_text() {
    let data = Prompts::Dataset(Arc::new(vec!["ab".into(), "xyz".into()]));
    let bucket = Bucket::cold(5, 2);
    for tokenizes in [true, false] {
        let r = Arc::new(Recorder {
            tokenizes,
            seen: Mutex::new(vec![]),
        });
        let d: Arc<dyn Driver> = r.clone();
        let run = closed_loop(&d, &data, bucket, 2, 4, 0, None);
        assert_eq!(run.records.len(), 4);
        let mut seen = r.seen.lock().unwrap().clone();
        seen.sort_by_key(|q| (q.prompt_tokens.clone(), q.prompt_text.clone()));
        if tokenizes {
            // Each text twice, its bytes repeated to exactly 5 tokens.
            let ab: Vec<u32> = b"ababa".iter().map(|&b| b as u32).collect();
            let xyz: Vec<u32> = b"xyzxy".iter().map(|&b| b as u32).collect();
            let got: Vec<_> = seen.iter().map(|q| q.prompt_tokens.clone()).collect();
            assert_eq!(got, vec![ab.clone(), ab, xyz.clone(), xyz]);
        } else {
            let got: Vec<_> = seen
                .iter()
                .map(|q| q.prompt_text.clone().unwrap())
                .collect();
            assert_eq!(got, vec!["ab", "ab", "xyz", "xyz"]);
            assert!(seen.iter().all(|q| q.prompt_tokens.is_empty()));
        }
    }
    // Synthetic prompts: exact length, no text.
    let r = Arc::new(Recorder {
        tokenizes: true,
        seen: Mutex::new(vec![]),
    });
    let d: Arc<dyn Driver> = r.clone();
    open_loop(&d, &Prompts::Synthetic, bucket, arrivals(200.0, 3), None);
    let seen = r.seen.lock().unwrap();
    assert_eq!(seen.len(), 3);
    assert!(seen
        .iter()
        .all(|q| q.prompt_tokens.len() == 5 && q.prompt_text.is_none()));
}

#[test]
fn dataset_tokens_are_fitted_to_the_exact_length() {
    assert_eq!(fit_tokens(&[1, 2, 3], 7), vec![1, 2, 3, 1, 2, 3, 1]);
    assert_eq!(fit_tokens(&[1, 2, 3], 2), vec![1, 2]);
    assert!(fit_tokens(&[], 4).is_empty());
}

/// Answers each request after `ms` milliseconds.
struct Slow(u64);

impl Driver for Slow {
    fn vocab_size(&self) -> usize {
        1000
    }
    fn send(&self, req: &LoadRequest, _t0: Instant, rec: &mut RequestRecord) {
        std::thread::sleep(Duration::from_millis(self.0));
        rec.output_tokens = req.output_tokens;
        rec.finish_reason = Some("length".into());
    }
    fn snapshot(&self) -> Snapshot {
        Snapshot::default()
    }
}

#[test]
fn ramped_workers_start_in_turn_and_their_first_requests_are_warm_up() {
    let bucket = Bucket::cold(5, 2);
    let d: Arc<dyn Driver> = Arc::new(Slow(200));
    let workers = Workers {
        count: 4,
        ramp: Duration::from_millis(200),
    };
    assert_eq!(workers.level_reached(), Duration::from_millis(150));
    let run = closed_loop(&d, &Prompts::Synthetic, bucket, workers, 12, 0, None);
    assert_eq!(run.records.len(), 12);
    // Each worker's first request: worker w no sooner than w x 50 ms.
    for w in 0..4u32 {
        let first = run
            .records
            .iter()
            .filter(|r| r.worker == w)
            .map(|r| r.start_s)
            .fold(f64::INFINITY, f64::min);
        assert!(first >= 0.05 * f64::from(w) - 1e-3, "worker {w} at {first}");
    }
    // Sent before the last worker started (150 ms): the first requests
    // of workers 0-2, and no other (each takes 200 ms).
    let warm: Vec<_> = run.records.iter().filter(|r| r.warmup).collect();
    assert_eq!(warm.len(), 3, "{:?}", run.records);
    assert!(warm.iter().all(|r| r.start_s < 0.15 && r.worker < 3));
    assert!(run
        .records
        .iter()
        .filter(|r| !r.warmup)
        .all(|r| r.start_s >= 0.15));
    // Started together (no ramp), nothing is warm-up.
    let burst = closed_loop(&d, &Prompts::Synthetic, bucket, 4, 8, 0, None);
    assert!(burst.records.iter().all(|r| !r.warmup));
}

fn arrivals(rate_per_s: f64, total_requests: u32) -> Arrivals {
    Arrivals {
        rate_per_s,
        total_requests,
        late_after_s: 0.010,
        salt: 1,
    }
}

#[test]
fn a_probe_stops_sending_once_told_and_an_extension_follows_on() {
    let bucket = Bucket::cold(5, 2);
    let r = Arc::new(Recorder {
        tokenizes: false,
        seen: Mutex::new(vec![]),
    });
    let d: Arc<dyn Driver> = r.clone();
    // Stop after 10 answers: two workers send at most one more each
    // (the ones in flight), never the 100 asked.
    let stop: StopWhen = Arc::new(|records: &[RequestRecord]| records.len() >= 10);
    let run = closed_loop(
        &d,
        &Prompts::Synthetic,
        bucket,
        2,
        100,
        0,
        Some(stop.clone()),
    );
    assert!(
        (10..=11).contains(&run.records.len()),
        "{}",
        run.records.len()
    );
    let open = open_loop(
        &d,
        &Prompts::Synthetic,
        bucket,
        arrivals(1000.0, 100),
        Some(stop),
    );
    assert!(open.records.len() < 100, "{}", open.records.len());
    // Without a stop, every request asked for.
    let whole = closed_loop(&d, &Prompts::Synthetic, bucket, 2, 30, 0, None);
    assert_eq!(whole.records.len(), 30);
    // An extension's requests follow on in time, counts add up.
    let (d0, n0) = (run.duration_s, run.records.len());
    let mut later = whole.clone();
    later.preemptions = Some(2);
    later.max_in_flight = 7;
    let joined = run.extended(later);
    assert_eq!(joined.records.len(), n0 + 30);
    assert!((joined.duration_s - d0 - whole.duration_s).abs() < 1e-12);
    assert!(joined.records[n0..].iter().all(|r| r.start_s >= d0));
    assert_eq!((joined.preemptions, joined.max_in_flight), (Some(2), 7));
}
