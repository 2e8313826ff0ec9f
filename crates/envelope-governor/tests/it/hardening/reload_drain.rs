//! A reload and a drain: tenants applied and guarantees released, the
//! queue refused, streams cut at the timeout.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reload_applies_tenants_and_releases_a_removed_guarantee() {
    // `hold` is guaranteed 3 of 4 sequences it does not use: `other` gets 1.
    let before = tenants(
        "[tenants.hold]\nguaranteed = 0.75\napi_keys = [\"sk-hold\"]\n[tenants.other]\napi_keys = [\"sk-other\"]\n",
    );
    let g = start(limits(1000, 10, 4, 4000), move |s| s.tenants = before).await;
    g.fake.delay_per_token_ms.store(30, Ordering::SeqCst);
    for t in spawn_many(&g, 4, Some("sk-other"), &[]) {
        assert_eq!(t.await.unwrap().0, 200);
    }
    assert_eq!(g.fake.max_seqs_in_flight.load(Ordering::SeqCst), 1);
    // Reloaded without `hold`: `other` may use the whole node.
    let mut s = g.gov.settings().draft();
    s.tenants = tenants("[tenants.other]\napi_keys = [\"sk-other\"]\n");
    g.gov.reload(s.check().unwrap());
    g.fake.max_seqs_in_flight.store(0, Ordering::SeqCst);
    for t in spawn_many(&g, 4, Some("sk-other"), &[]) {
        assert_eq!(t.await.unwrap().0, 200);
    }
    assert_eq!(g.fake.max_seqs_in_flight.load(Ordering::SeqCst), 4);
    // default_burst applies on reload too.
    let mut s = g.gov.settings().draft();
    s.tenants = tenants("default_burst = 0.25\n");
    g.gov.reload(s.check().unwrap());
    g.fake.max_seqs_in_flight.store(0, Ordering::SeqCst);
    for t in spawn_many(&g, 3, None, &[]) {
        assert_eq!(t.await.unwrap().0, 200);
    }
    assert_eq!(g.fake.max_seqs_in_flight.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn drain_refuses_the_queue_cuts_streams_at_the_timeout_and_returns() {
    let (fake, upstream) = fake_upstream().await;
    let (term_tx, term_rx) = tokio::sync::oneshot::channel::<()>();
    let gov_slot: std::sync::Arc<
        std::sync::Mutex<Option<std::sync::Arc<envelope_governor::Governor>>>,
    > = Default::default();
    let slot = gov_slot.clone();
    let shutdown = async move {
        let _ = term_rx.await;
        let gov = slot.lock().unwrap().clone().unwrap();
        gov.drain(Duration::from_millis(500)).await;
    };
    let (g, served) = start_until(
        fake,
        upstream,
        limits(1000, 100, 1, 4000),
        |_| {},
        None,
        shutdown,
    )
    .await;
    *gov_slot.lock().unwrap() = Some(g.gov.clone());
    g.fake.delay_per_token_ms.store(100, Ordering::SeqCst);
    // One stream in flight (10 s if left alone), one request queued.
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 100, "stream": true}),
        )
        .await;
    let mut stream = r.bytes_stream();
    let streamed = tokio::spawn(async move {
        let mut text = String::new();
        while let Some(Ok(b)) = stream.next().await {
            text.push_str(&String::from_utf8_lossy(&b));
        }
        (text, Instant::now())
    });
    let queued = spawn_many(&g, 1, None, &[]);
    g.wait_state(|s| s["queue"]["requests"] == 1).await;
    term_tx.send(()).unwrap();
    // The queued request is refused at once: before the stream in flight
    // is cut at the drain timeout.
    let (s, _) = queued.into_iter().next().unwrap().await.unwrap();
    let refused_at = Instant::now();
    assert_eq!(s, 503);
    // The stream gets an error event at the drain timeout, not its 100
    // tokens.
    let (text, cut_at) = streamed.await.unwrap();
    assert!(
        refused_at < cut_at,
        "the stream ended before the queue was refused"
    );
    assert!(text.contains("\"code\":\"draining\""), "{text}");
    let tokens = text.matches("\"text\"").count();
    assert!(tokens < 100, "{tokens} tokens streamed before the cut");
    // And the server returns (the CLI's process exits then).
    let done = tokio::time::timeout(Duration::from_secs(8), served).await;
    assert!(done.is_ok(), "serve did not return after the drain");
}
