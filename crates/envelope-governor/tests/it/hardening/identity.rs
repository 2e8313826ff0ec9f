//! A client that names another tenant or class, or none: identity is the
//! governor's, from keys and trusted headers.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_named_tenant_counts_for_nothing() {
    // Tenants not listed may hold a quarter of 4 sequences. Made-up names
    // used to be tenants of their own, each with its own quarter.
    let t = tenants("default_burst = 0.25\n");
    let g = start(limits(1000, 10, 4, 4000), move |s| s.tenants = t).await;
    g.fake.delay_per_token_ms.store(30, Ordering::SeqCst);
    let tasks = spawn_many(&g, 3, None, &[("x-envelope-tenant", "made-up-".into())]);
    for t in tasks {
        assert_eq!(t.await.unwrap(), (200, "default".to_string()));
    }
    assert_eq!(g.fake.max_seqs_in_flight.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn configured_api_keys_are_required() {
    let t = tenants("[tenants.alice]\napi_keys = [\"sk-alice\"]\n");
    let g = start(limits(1000, 10, 4, 4000), move |s| s.tenants = t).await;
    let body = json!({"prompt": "a", "max_tokens": 2});
    let url = g.url("/v1/completions");
    for req in [
        g.client.post(&url),
        g.client.post(&url).bearer_auth("sk-mallory"),
        g.client.post(&url).header("x-envelope-tenant", "alice"),
    ] {
        let (s, v) = code(req.json(&body).send().await.unwrap()).await;
        assert_eq!(s, 401, "{v}");
        assert_eq!(v["error"]["code"], "invalid_api_key");
    }
    assert_eq!(g.fake.requests.load(Ordering::SeqCst), 0);
    let r = g
        .client
        .post(&url)
        .bearer_auth("sk-alice")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-envelope-tenant"], "alice");
    assert_eq!(r.headers()["x-envelope-class"], "interactive");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_trusted_front_proxy_names_the_tenant() {
    let t = tenants("trusted_header = \"x-forwarded-tenant\"\n");
    let g = start(limits(1000, 10, 4, 4000), move |s| s.tenants = t).await;
    let body = json!({"prompt": "a", "max_tokens": 2});
    let r = g
        .client
        .post(g.url("/v1/completions"))
        .header("x-forwarded-tenant", "team-7")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-envelope-tenant"], "team-7");
    let r = g
        .client
        .post(g.url("/v1/completions"))
        .header("x-forwarded-tenant", "no spaces allowed")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_uses_only_its_classes() {
    let t = tenants("[tenants.etl]\napi_keys = [\"sk-etl\"]\nclasses = [\"batch\"]\n");
    let g = start(limits(1000, 10, 4, 4000), move |s| s.tenants = t).await;
    let body = json!({"prompt": "a", "max_tokens": 2});
    let (s, v) = code(
        g.client
            .post(g.url("/v1/completions"))
            .bearer_auth("sk-etl")
            .header("x-envelope-class", "interactive")
            .json(&body)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, 403, "{v}");
    let r = g
        .client
        .post(g.url("/v1/completions"))
        .bearer_auth("sk-etl")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-envelope-class"], "batch");
}
