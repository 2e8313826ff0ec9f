use super::*;
use envelope_profile::trace::{Trace, TraceFormat};

fn chat(system: &str, user: &str) -> bytes::Bytes {
    serde_json::to_vec(&serde_json::json!({
        "model": "m",
        "stream": true,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }))
    .unwrap()
    .into()
}

fn draft(body: bytes::Bytes, input_tokens: u64) -> Draft {
    Draft {
        arrived: Instant::now(),
        arrived_unix_s: 1_764_900_000.25,
        endpoint: Endpoint::Chat,
        body,
        input_tokens,
        session: Some("run-1".into()),
        class: "interactive",
        tenant: "team-a".into(),
        feature: None,
    }
}

fn finished(body: bytes::Bytes) -> Finished {
    Finished {
        draft: draft(body, 900),
        output_tokens: 12,
        status: 200,
        ttft_ms: Some(40.0),
        e2e_ms: 250.0,
        tiers: None,
    }
}

fn prompts(body: &bytes::Bytes) -> Prompts {
    parse_bytes(Endpoint::Chat, body.clone()).unwrap().prompts
}

#[test]
fn shared_prefixes_share_ids_and_the_salt_hides_them() {
    let system = "You are a careful assistant. ".repeat(150); // 4,350 bytes
    let a = chat(&system, "first question");
    let b = chat(&system, "a different question");
    let (ia, per_a) = prefix_blocks(&prompts(&a), 1000, b"salt-1");
    let (ib, _) = prefix_blocks(&prompts(&b), 1000, b"salt-1");
    // Eight whole blocks of 512 bytes hold the system prompt, the same
    // prefix; the ninth holds the user's text.
    let bytes = 4350 + "system".len() + "user".len() + "first question".len() + 4;
    assert_eq!(ia.len(), bytes.div_ceil(512));
    assert_eq!(ia.len(), 9);
    assert_eq!(ia[..8], ib[..8]);
    assert_ne!(ia[8], ib[8]);
    // A block spans its share of the counted tokens: 1000 x 512 / bytes.
    let want = (1000.0 * 512.0 / bytes as f64).round() as u32;
    assert_eq!(per_a, Some(want));
    // Another deployment's salt: no id in common.
    let (other, _) = prefix_blocks(&prompts(&a), 1000, b"salt-2");
    assert!(other.iter().all(|x| !ia.contains(x)));
    // Chained: the same block after a different one has another id.
    let c = chat(&format!("X{}", &system[1..]), "first question");
    let (ic, _) = prefix_blocks(&prompts(&c), 1000, b"salt-1");
    assert!(ic.iter().all(|x| !ia.contains(x)));
    // Token ids are cut in blocks of 128 ids.
    let ids = Prompts::Tokens(vec![(0..1100).collect()]);
    let (it, per) = prefix_blocks(&ids, 1100, b"s");
    assert_eq!((it.len(), per), (9, Some(128)));
    assert_eq!(
        prefix_blocks(&Prompts::Texts(vec![]), 0, b"s"),
        (vec![], None)
    );
}

#[test]
fn lines_are_trace_records_and_rotate_by_size() {
    let dir = std::env::temp_dir().join(format!("envelope-record-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("calls.jsonl");
    let rec = Recorder::start(
        RecordSettings {
            path: path.clone(),
            max_bytes: 4096,
            keep: 100,
            capacity: 1000,
            salt: b"s".to_vec(),
        },
        Counter::default(),
        Counter::default(),
    )
    .unwrap();
    let body = chat("system", "hello");
    for _ in 0..100 {
        rec.record(finished(body.clone()));
    }
    assert!(rec.flush(Duration::from_secs(10)));
    assert_eq!((rec.written(), rec.dropped()), (100, 0));
    drop(rec);
    // Every line in FILE, FILE.1, ... once; each file about the size.
    let mut lines = vec![];
    let mut files = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let p = entry.unwrap().path();
        let text = std::fs::read_to_string(&p).unwrap();
        assert!(
            text.len() < 4096 + 600,
            "{} is {} bytes",
            p.display(),
            text.len()
        );
        lines.extend(text.lines().map(str::to_string));
        files += 1;
    }
    assert!(files > 3, "rotated into {files} files");
    assert_eq!(lines.len(), 100);
    let t = Trace::parse("x", &lines.join("\n"), TraceFormat::Envelope).unwrap();
    let r = &t.requests[0];
    assert_eq!((r.input_tokens, r.output_tokens), (900, 12));
    assert_eq!(r.session.as_deref(), Some("run-1"));
    assert_eq!(r.model.as_deref(), Some("m"));
    assert_eq!(r.stream, Some(true));
    assert_eq!(
        (r.status, r.ttft_ms, r.e2e_ms),
        (Some(200), Some(40.0), Some(250.0))
    );
    assert_eq!(r.prefix_blocks.len(), 1);
    // No prompt text anywhere.
    assert!(lines
        .iter()
        .all(|l| !l.contains("hello") && !l.contains("system")));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_full_channel_drops_and_counts_without_waiting() {
    let (rec, go, done) = Recorder::stalled(4);
    let body = chat("s", "u");
    let t = Instant::now();
    for _ in 0..10 {
        rec.record(finished(body.clone()));
    }
    // Six had no room: dropped at once, counted.
    assert_eq!(rec.dropped(), 6);
    assert!(t.elapsed() < Duration::from_secs(1));
    go.send(()).unwrap();
    assert!(rec.flush(Duration::from_secs(5)));
    drop(rec);
    done.recv_timeout(Duration::from_secs(5)).unwrap();
}

#[test]
fn a_refused_request_offers_its_limit() {
    let f = draft(chat("s", "u"), 30).refused(429, Some(64));
    assert_eq!((f.status, f.output_tokens, f.ttft_ms), (429, 64, None));
    let line = trace_line(&f, b"s");
    assert_eq!(line.output_tokens, 64);
    assert_eq!(line.class.as_deref(), Some("interactive"));
    assert_eq!(line.t_s, 1_764_900_000.25);
}
