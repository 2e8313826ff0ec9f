use super::*;

fn sample(name: &str) -> String {
    format!(
        "{}/../../bench-configs/traces/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn our_sample_reads_with_sessions_prefixes_and_tags() {
    let t = Trace::read(&sample("sample-envelope.jsonl"), None).unwrap();
    assert_eq!(t.name, "sample-envelope");
    assert_eq!(t.requests.len(), 36);
    // Shifted from Unix time to start at 0, sorted.
    assert_eq!(t.requests[0].t_s, 0.0);
    assert!(t.requests.windows(2).all(|w| w[0].t_s <= w[1].t_s));
    assert!(t.span_s() > 5.0 && t.span_s() < 60.0, "{}", t.span_s());
    let sessions = t.sessions();
    assert_eq!(sessions.len(), 6);
    for calls in sessions.values() {
        assert_eq!(calls.len(), 3);
        let first = &t.requests[calls[0]];
        assert_eq!(first.prefix_blocks[0], 11, "the shared system block");
        assert_eq!(first.block_tokens, Some(128));
        assert_eq!(first.tenant.as_deref(), Some("team-a"));
    }
    let batch = t
        .requests
        .iter()
        .filter(|r| r.class.as_deref() == Some("batch"))
        .count();
    assert_eq!(batch, 18);
}

#[test]
fn mooncake_sample_reads_blocks_of_512_in_seconds() {
    let path = sample("sample-mooncake.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(
        TraceFormat::detect(&path, &text),
        Some(TraceFormat::Mooncake)
    );
    let t = Trace::read(&path, None).unwrap();
    assert_eq!(t.requests.len(), 40);
    // The first line is at 255 ms, the second 318 ms: 63 ms apart.
    assert!((t.requests[1].t_s - 0.063).abs() < 1e-9);
    let r = &t.requests[0];
    assert_eq!((r.input_tokens, r.output_tokens), (1325, 133));
    assert_eq!(r.prefix_blocks, vec![1, 2, 1000]);
    assert_eq!(r.block_tokens, Some(MOONCAKE_BLOCK_TOKENS));
    // Every request's blocks cover its prompt: ceil(input / 512) ids.
    for r in &t.requests {
        assert_eq!(r.prefix_blocks.len() as u32, r.input_tokens.div_ceil(512));
    }
}

#[test]
fn burstgpt_sample_reads_tokens_models_and_failures() {
    let t = Trace::read(&sample("sample-burstgpt.csv"), None).unwrap();
    assert_eq!(t.requests.len(), 30);
    let r = &t.requests[0];
    assert_eq!((r.t_s, r.input_tokens, r.output_tokens), (0.0, 1100, 393));
    assert_eq!(r.model.as_deref(), Some("ChatGPT"));
    assert_eq!(r.class.as_deref(), Some("Conversation log"));
    // Row 8 had 0 response tokens: a failure, kept as offered load.
    let failed: Vec<_> = t
        .requests
        .iter()
        .filter(|r| r.status == Some(500))
        .collect();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].output_tokens, 0);
    // Timestamps 8, 9, 12 s: shifted to 0, 1, 4.
    assert_eq!(t.requests[2].t_s, 4.0);
}

#[test]
fn bad_records_name_the_line_and_field() {
    let e = Trace::parse(
        "x",
        "{\"t_s\": 1, \"input_tokens\": 3}\n",
        TraceFormat::Envelope,
    )
    .unwrap_err();
    assert!(e.contains("line 1") && e.contains("output_tokens"), "{e}");
    let e = Trace::parse(
        "x",
        "{\"t_s\": 0, \"input_tokens\": 3, \"output_tokens\": 1}\n\n{\"t_s\": 1, \"input_tokens\": 3, \"output_tokens\": 1, \"prompt\": \"hi\"}\n",
        TraceFormat::Envelope,
    )
    .unwrap_err();
    assert!(e.contains("line 3") && e.contains("prompt"), "{e}");
    let e = Trace::parse(
        "x",
        "Timestamp,Request tokens,Response tokens\n1,10,2\n2,ten,2\n",
        TraceFormat::BurstGpt,
    )
    .unwrap_err();
    assert!(e.contains("line 3") && e.contains("Request tokens"), "{e}");
    let e = Trace::parse("x", "Timestamp,Model\n1,a\n", TraceFormat::BurstGpt).unwrap_err();
    assert!(e.contains("Request tokens"), "{e}");
    let e = Trace::parse(
        "x",
        "{\"t_s\": 0, \"input_tokens\": 3, \"output_tokens\": 1, \"prefix_blocks\": [1]}\n",
        TraceFormat::Envelope,
    )
    .unwrap_err();
    assert!(e.contains("block_tokens"), "{e}");
    assert!(Trace::parse("x", "\n", TraceFormat::Envelope)
        .unwrap_err()
        .contains("no requests"));
    let dir = std::env::temp_dir().join(format!("envelope-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("t.jsonl");
    std::fs::write(&f, "{\"a\": 1}\n").unwrap();
    let e = Trace::read(f.to_str().unwrap(), None).unwrap_err();
    assert!(e.contains("t.jsonl") && e.contains("name it"), "{e}");
    assert!(TraceFormat::parse("sharegpt").is_err());
}

#[test]
fn a_last_record_still_being_written_is_left_out() {
    let whole = std::fs::read_to_string(sample("sample-envelope.jsonl")).unwrap();
    let lines: Vec<&str> = whole.lines().collect();
    let two = format!("{}\n{}\n", lines[0], lines[1]);
    let third = lines[2];
    // The governor had written half of the third line when it was read.
    let cut = format!("{two}{}", &third[..third.len() / 2]);
    let t = Trace::parse("live", &cut, TraceFormat::Envelope).unwrap();
    assert_eq!(t.requests.len(), 2);
    // With its newline after it, the same cut line is a bad record.
    let e = Trace::parse("bad", &format!("{cut}\n"), TraceFormat::Envelope).unwrap_err();
    assert!(e.starts_with("line 3: "), "{e}");
    // A malformed last line (not cut short) is an error too.
    let e = Trace::parse(
        "bad",
        &format!("{two}{{\"t_s\": x}}"),
        TraceFormat::Envelope,
    )
    .unwrap_err();
    assert!(e.starts_with("line 3: "), "{e}");
    // A cut line followed by whole ones is an error, not a gap.
    let e = Trace::parse(
        "bad",
        &format!("{}\n{two}", &third[..third.len() / 2]),
        TraceFormat::Envelope,
    )
    .unwrap_err();
    assert!(e.starts_with("line 1: "), "{e}");
}

#[test]
fn a_record_round_trips_and_the_committed_schema_is_current() {
    let mut r = TraceRequest::new(1.5, 10, 2);
    r.session = Some("s".into());
    r.tiers = Some(TierCall {
        start_tier: "small".into(),
        tier: "large".into(),
        reason: "default".into(),
        outcome: "ok".into(),
        fallback_from: None,
        escalated: Some("json".into()),
        cost: 0.25,
        tiers_version: "v1".into(),
        prices_version: None,
    });
    let line = serde_json::to_string(&r).unwrap();
    assert!(!line.contains("prefix_blocks"), "empty fields are left out");
    let back: TraceRequest = serde_json::from_str(&line).unwrap();
    assert_eq!(back, r);
    crate::schema::tests::assert_committed_schema("trace.schema.json", &json_schema());
}

#[test]
fn a_workload_is_derived_from_our_sample() {
    let t = Trace::read(&sample("sample-envelope.jsonl"), None).unwrap();
    let w = workload_from_trace(&t);
    assert_eq!(w.name, "sample-envelope");
    let names: Vec<&str> = w.classes.iter().map(|c| c.name.as_str()).collect();
    // By feature: the agent runs and the summaries.
    assert_eq!(names, ["agent", "summarise"]);
    let (agent, batch) = (&w.classes[0], &w.classes[1]);
    // 18 single calls and 6 runs of 3 over the trace's length.
    let n = t.requests.len() as f64;
    let length = t.span_s() * n / (n - 1.0);
    assert!((batch.runs_per_min - 18.0 * 60.0 / length).abs() < 1e-3);
    assert!((agent.runs_per_min - 6.0 * 60.0 / length).abs() < 1e-3);
    assert_eq!(
        (batch.model_calls_per_run, agent.model_calls_per_run),
        (1.0, 3.0)
    );
    assert!(!batch.session && agent.session);
    // Each call grows by 60 tokens over its predecessor's prompt (24 of
    // them its output): 36 tool-result tokens.
    assert_eq!(agent.tool_result_tokens, 36);
    // The shared block 11 (128 tokens) opens every run.
    assert_eq!(agent.system_prompt_tokens, 128);
    assert_eq!(batch.system_prompt_tokens, 0);
    assert_eq!(
        (agent.output_tokens_p50, agent.output_tokens_p95),
        (24.0, 24.0)
    );
    assert!(agent
        .runs_per_min_p95
        .is_none_or(|p| p >= agent.runs_per_min));
    // The TOML reads back as the same workload.
    let text = workload_toml(&w);
    let back = crate::workload::Workload::from_toml(&text, "derived.toml").unwrap();
    assert_eq!(back, w);
}

#[test]
fn bursts_raise_the_p95_rate() {
    // 100 requests in the first second of a 100 s trace, one a second after.
    let mut reqs: Vec<TraceRequest> = (0..100)
        .map(|i| TraceRequest::new(i as f64 * 0.01, 10, 2))
        .collect();
    reqs.extend((1..100).map(|i| TraceRequest::new(i as f64, 10, 2)));
    let t = Trace::new("burst", reqs).unwrap();
    let c = &workload_from_trace(&t).classes[0];
    assert_eq!(c.name, "default");
    let p95 = c.runs_per_min_p95.unwrap();
    assert!(p95 > 2.0 * c.runs_per_min, "{p95} vs {}", c.runs_per_min);
}
