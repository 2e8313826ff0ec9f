use super::*;
use crate::load::open_schedule;
use crate::record::{Driver, RequestRecord, Snapshot};
use envelope_profile::trace::{Trace, TraceFormat};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn load(text: &str) -> TraceLoad {
    TraceLoad {
        trace: Trace::parse("t", text, TraceFormat::Envelope).unwrap(),
        scale_min: 0.5,
        scale_step: 0.5,
        scale_max: 4.0,
        window_s: None,
        collapse_probes: 0,
        collapse_fraction: 0.5,
        recovery_s: 1.0,
    }
}

fn line(t: f64, input: u32, output: u32, extra: &str) -> String {
    format!(r#"{{"t_s":{t},"input_tokens":{input},"output_tokens":{output}{extra}}}"#)
}

fn sample() -> TraceLoad {
    let path = format!(
        "{}/../../bench-configs/traces/sample-envelope.jsonl",
        env!("CARGO_MANIFEST_DIR")
    );
    load(&std::fs::read_to_string(path).unwrap())
}

#[test]
fn sessions_keep_their_order_and_times_are_scaled() {
    let l = sample();
    let period = l.period_s();
    let all = l.sessions(2.0, 0.0, period / 2.0, 1000);
    // Every request once, in 6 sessions of 3 and 18 of 1.
    assert_eq!(all.iter().map(Vec::len).sum::<usize>(), 36);
    assert_eq!(all.iter().filter(|s| s.len() == 3).count(), 6);
    for s in &all {
        assert!(s.windows(2).all(|w| w[0].due_s <= w[1].due_s));
    }
    // Twice as fast: due times are the trace's halved.
    let last = all.iter().flatten().map(|c| c.due_s).fold(0.0, f64::max);
    assert!((last - l.trace.span_s() / 2.0).abs() < 1e-9);
    let c = &all.iter().find(|s| s.len() == 3).unwrap()[0];
    assert_eq!(c.class.as_deref(), Some("interactive"));
    assert_eq!(c.tenant.as_deref(), Some("team-a"));
}

#[test]
fn prompts_have_the_recorded_lengths_and_shared_blocks_share_tokens() {
    let l = sample();
    let all = l.sessions(1.0, 0.0, l.period_s(), 1000);
    let runs: Vec<_> = all.iter().filter(|s| s.len() == 3).collect();
    for c in all.iter().flatten() {
        assert!(c
            .request
            .prompt_tokens
            .iter()
            .all(|&t| (1..1000).contains(&t)));
    }
    // Block 11 (128 tokens) opens every agent call: the same ids each time.
    let first = &runs[0][0].request.prompt_tokens[..128];
    for s in &runs {
        for c in s.iter() {
            assert_eq!(&c.request.prompt_tokens[..128], first);
        }
    }
    // Lengths as recorded.
    let want: Vec<u32> = l.trace.requests.iter().map(|r| r.input_tokens).collect();
    let mut got: Vec<(f64, u32)> = all
        .iter()
        .flatten()
        .map(|c| (c.due_s, c.request.prompt_tokens.len() as u32))
        .collect();
    got.sort_by(|a, b| a.0.total_cmp(&b.0));
    assert_eq!(got.iter().map(|g| g.1).collect::<Vec<_>>(), want);
    // A session without blocks grows from its predecessor's prompt.
    let conv = load(
        &[
            line(0.0, 50, 5, r#","session":"c""#),
            line(1.0, 80, 5, r#","session":"c""#),
            line(2.0, 30, 5, r#","session":"c""#),
        ]
        .join("\n"),
    );
    let s = &conv.sessions(1.0, 0.0, 10.0, 1000)[0];
    let (a, b) = (&s[0].request.prompt_tokens, &s[1].request.prompt_tokens);
    assert_eq!(&b[..50], &a[..]);
    assert_eq!(b.len(), 80);
    assert_eq!(&s[2].request.prompt_tokens[..], &b[..30]);
}

#[test]
fn past_its_end_the_trace_repeats_with_new_tokens() {
    let l = load(&[line(0.0, 20, 2, ""), line(1.0, 20, 2, "")].join("\n"));
    // Period 2 s (span 1 s + one mean gap); 5 s at 1x holds 3 laps' worth.
    assert_eq!(l.period_s(), 2.0);
    let s = l.sessions(1.0, 0.0, 5.0, 1000);
    let due: Vec<f64> = s.iter().map(|c| c[0].due_s).collect();
    assert_eq!(due, vec![0.0, 1.0, 2.0, 3.0, 4.0]);
    assert_ne!(s[0][0].request.prompt_tokens, s[2][0].request.prompt_tokens);
    // From trace time 3 s: the second lap's second request, then the third lap.
    let s = l.sessions(2.0, 3.0, 1.0, 1000);
    let due: Vec<f64> = s.iter().map(|c| c[0].due_s).collect();
    assert_eq!(due, vec![0.0, 0.5]);
}

/// Answers after `ms`, noting when each call was sent.
struct Timed {
    ms: u64,
    sent: Mutex<Vec<(usize, Instant)>>,
}

impl Driver for Timed {
    fn vocab_size(&self) -> usize {
        1000
    }
    fn send(&self, req: &LoadRequest, _t0: Instant, rec: &mut RequestRecord) {
        self.sent
            .lock()
            .unwrap()
            .push((req.prompt_tokens.len(), Instant::now()));
        std::thread::sleep(Duration::from_millis(self.ms));
        rec.output_tokens = req.output_tokens;
        rec.finish_reason = Some("length".into());
    }
    fn snapshot(&self) -> Snapshot {
        Snapshot::default()
    }
}

#[test]
fn replay_keeps_session_order_and_the_due_time_rule() {
    // A session of three 100 ms calls due 10 ms apart: each waits for the
    // one before. Single calls every 20 ms meanwhile are sent on time.
    let mut lines = vec![];
    for k in 0..3 {
        lines.push(line(k as f64 * 0.01, 10 + k, 1, r#","session":"s""#));
    }
    for k in 0..40 {
        lines.push(line(0.005 + k as f64 * 0.02, 100 + k, 1, ""));
    }
    let l = load(&lines.join("\n"));
    let t = Arc::new(Timed {
        ms: 100,
        sent: Mutex::new(vec![]),
    });
    let d: Arc<dyn Driver> = t.clone();
    let sessions = l.sessions(1.0, 0.0, l.trace.span_s() + 0.001, 1000);
    let run = open_schedule(&d, sessions, 0.010, None);
    assert_eq!(run.records.len(), 43);
    let sent = t.sent.lock().unwrap().clone();
    let at = |len: usize| sent.iter().find(|(l, _)| *l == len).unwrap().1;
    // The session's calls in order, each after its predecessor's answer.
    assert!(at(11) >= at(10) + Duration::from_millis(100));
    assert!(at(12) >= at(11) + Duration::from_millis(100));
    // A successor waiting for its predecessor is not late; the rest were
    // sent within 10 ms of their due times.
    assert!(run.late_fraction <= 0.05, "{}", run.late_fraction);
    let mut starts: Vec<(u32, f64)> = run
        .records
        .iter()
        .filter(|r| r.input_tokens >= 100)
        .map(|r| (r.input_tokens, r.start_s))
        .collect();
    starts.sort_by_key(|s| s.0);
    let on_time = starts
        .iter()
        .filter(|(n, s)| (s - (0.005 + (n - 100) as f64 * 0.02)).abs() <= 0.010)
        .count();
    assert!(
        on_time * 100 >= 95 * starts.len(),
        "{on_time} of {}",
        starts.len()
    );
}

#[test]
fn a_stop_rule_ends_the_replay_early() {
    let lines: Vec<String> = (0..50).map(|k| line(k as f64 * 0.01, 10, 1, "")).collect();
    let l = load(&lines.join("\n"));
    let d: Arc<dyn Driver> = Arc::new(Timed {
        ms: 1,
        sent: Mutex::new(vec![]),
    });
    let stop: crate::load::StopWhen = Arc::new(|r: &[RequestRecord]| r.len() >= 5);
    let run = open_schedule(&d, l.sessions(1.0, 0.0, 1.0, 1000), 0.01, Some(stop));
    assert!(run.records.len() < 20, "{}", run.records.len());
}

#[test]
fn a_session_is_in_the_window_it_opens_in_whole() {
    let l = load(
        &[
            line(0.0, 10, 1, ""),
            line(0.9, 20, 1, r#","session":"s""#),
            line(1.5, 30, 1, r#","session":"s""#),
            line(2.0, 40, 1, ""),
        ]
        .join("\n"),
    );
    let first = l.sessions(1.0, 0.0, 1.0, 100);
    let lens: Vec<usize> = first.iter().map(Vec::len).collect();
    assert_eq!(lens, vec![1, 2]);
    // Its second call keeps its own due time, past the window.
    assert_eq!(first[1][1].due_s, 1.5);
    let next = l.sessions(1.0, 1.0, 1.0, 100);
    assert_eq!(next.len(), 0, "the session opened in the window before");
}
