//! EngineState from the Prometheus text of each engine. Fixtures are written
//! from the engines' documented metric names (shared/reference.md), with the
//! labels, histograms and `_created` samples real exporters emit.

use envelope_telemetry::{parse_engine_state, EngineKind, MetricsError};

fn fixture(name: &str) -> String {
    std::fs::read_to_string(format!(
        "{}/tests/fixtures/{name}",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
}

#[test]
fn vllm_v1_with_two_data_parallel_engines() {
    let s = parse_engine_state(&fixture("vllm_v1.txt")).unwrap();
    assert_eq!(s.engine, EngineKind::Vllm);
    assert_eq!(s.running, Some(22.0), "counts are summed over engines");
    assert_eq!(s.waiting, Some(3.0));
    assert_eq!(
        s.kv_usage,
        Some(0.4375),
        "usage is the most loaded engine's"
    );
    assert_eq!(s.preemptions_total, Some(8.0));
    // In cache_config_info's labels: num_gpu_blocks x block_size.
    assert_eq!(s.kv_capacity_tokens, Some(446560.0));
    assert_eq!(s.prompt_tokens_total, Some(223456.0));
    assert_eq!(s.generation_tokens_total, Some(125432.0));
    assert!(s.rejected.is_empty());
    assert!(s.age_ms() < 10_000);
}

#[test]
fn vllm_v0_uses_the_older_kv_name() {
    let s = parse_engine_state(&fixture("vllm_v0.txt")).unwrap();
    assert_eq!(s.kv_usage, Some(0.052));
    assert_eq!(s.running, Some(4.0));
    assert_eq!(s.preemptions_total, Some(0.0), "present and zero is zero");
}

#[test]
fn sglang() {
    let s = parse_engine_state(&fixture("sglang.txt")).unwrap();
    assert_eq!(s.engine, EngineKind::Sglang);
    assert_eq!(
        (s.running, s.waiting, s.kv_usage),
        (Some(8.0), Some(2.0), Some(0.21))
    );
    assert_eq!(
        s.preemptions_total, None,
        "SGLang does not expose preemptions: absent, not zero"
    );
    assert_eq!(s.generation_tokens_total, Some(41000.0));
}

#[test]
fn tgi_kv_usage_is_batch_tokens_over_the_maximum() {
    let s = parse_engine_state(&fixture("tgi.txt")).unwrap();
    assert_eq!(s.engine, EngineKind::Tgi);
    assert_eq!(s.running, Some(16.0));
    assert_eq!(s.waiting, Some(4.0));
    assert_eq!(s.kv_usage, Some(0.25));
    assert_eq!(s.prompt_tokens_total, Some(51200.0));
    assert_eq!(s.generation_tokens_total, Some(12800.0));
    assert_eq!(s.preemptions_total, None);
    assert_eq!(s.kv_capacity_tokens, Some(81920.0));
}

#[test]
fn llama_cpp_with_and_without_the_kv_ratio() {
    let s = parse_engine_state(&fixture("llamacpp.txt")).unwrap();
    assert_eq!(s.engine, EngineKind::LlamaCpp);
    assert_eq!(
        (s.running, s.waiting, s.kv_usage),
        (Some(2.0), Some(1.0), Some(0.125))
    );
    assert_eq!(
        (s.prompt_tokens_total, s.generation_tokens_total),
        (Some(4096.0), Some(2048.0))
    );
    let s = parse_engine_state(&fixture("llamacpp_no_kv.txt")).unwrap();
    assert_eq!(s.kv_usage, None);
    assert_eq!(s.running, Some(2.0));
}

#[test]
fn nan_and_negative_values_are_dropped_and_named() {
    let s = parse_engine_state(&fixture("vllm_bad_values.txt")).unwrap();
    assert_eq!(s.running, Some(2.0));
    assert_eq!(s.waiting, None);
    assert_eq!(s.kv_usage, None);
    assert_eq!(s.generation_tokens_total, Some(1500.0));
    assert_eq!(s.preemptions_total, None, "missing family");
    assert!(
        s.rejected
            .contains(&"vllm:num_requests_waiting".to_string()),
        "{:?}",
        s.rejected
    );
    assert!(s.rejected.contains(&"vllm:kv_cache_usage_perc".to_string()));
}

#[test]
fn not_prometheus_or_unknown_engine_is_an_error() {
    assert!(matches!(
        parse_engine_state(&fixture("not_prometheus.html")),
        Err(MetricsError::NotPrometheus(_))
    ));
    assert!(matches!(
        parse_engine_state(&fixture("node_exporter.txt")),
        Err(MetricsError::UnknownEngine)
    ));
    assert!(matches!(
        parse_engine_state(""),
        Err(MetricsError::UnknownEngine) | Err(MetricsError::NotPrometheus(_))
    ));
}

#[test]
fn envelope_openmetrics_text() {
    // The shape `envelope serve` writes (prometheus-client: OpenMetrics, `# EOF`).
    let text = "# HELP envelope:num_requests_running Sequences in the running batch.\n\
# TYPE envelope:num_requests_running gauge\n\
envelope:num_requests_running 3\n\
# HELP envelope:kv_cache_usage_perc Fraction of KV-cache blocks in use (0..1).\n\
# TYPE envelope:kv_cache_usage_perc gauge\n\
envelope:kv_cache_usage_perc 0.5\n\
# HELP envelope:num_preemptions Sequences preempted (recompute).\n\
# TYPE envelope:num_preemptions counter\n\
envelope:num_preemptions_total 2\n\
# HELP envelope:kv_cache_capacity_tokens Tokens the KV-cache pool holds.\n\
# TYPE envelope:kv_cache_capacity_tokens gauge\n\
envelope:kv_cache_capacity_tokens 1456\n\
# EOF\n";
    let s = parse_engine_state(text).unwrap();
    assert_eq!(s.engine, EngineKind::Envelope);
    assert_eq!(
        (s.running, s.kv_usage, s.preemptions_total),
        (Some(3.0), Some(0.5), Some(2.0))
    );
    assert_eq!(s.waiting, None);
    assert_eq!(s.kv_capacity_tokens, Some(1456.0));
}

#[tokio::test]
async fn unreachable_server_is_an_error_value() {
    let e = envelope_telemetry::fetch_engine_state(
        "http://127.0.0.1:1/metrics",
        std::time::Duration::from_millis(500),
    )
    .await
    .unwrap_err();
    assert!(matches!(e, MetricsError::Unreachable { .. }), "{e}");
    assert!(e.to_string().contains("127.0.0.1:1"));
}

/// An endpoint that answers an error says why in the error: llama.cpp's
/// server started without `--metrics` answers 501 with its hint (the body
/// as llama-server 11434.0.0 sends it).
#[tokio::test]
async fn an_error_answer_carries_what_the_server_said() {
    use std::io::{Read, Write};
    let body = fixture("llama_server_metrics_501.json")
        .trim_end()
        .to_string();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = [0u8; 4096];
        let _ = s.read(&mut buf);
        write!(
            s,
            "HTTP/1.1 501 Not Implemented\r\ncontent-type: application/json; charset=utf-8\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{}",
            body.len(),
            body
        )
        .unwrap();
    });
    let e = envelope_telemetry::fetch_engine_state(
        &format!("http://{addr}/metrics"),
        std::time::Duration::from_secs(5),
    )
    .await
    .unwrap_err();
    server.join().unwrap();
    assert!(matches!(e, MetricsError::Http { status: 501, .. }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("answered HTTP 501: ") && text.contains("--metrics"),
        "{text}"
    );
}
