//! The admin routes: refused to a browser.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admin_posts_from_a_browser_are_refused() {
    let g = start(limits(1000, 10, 4, 4000), |_| {}).await;
    for (k, v) in [
        ("origin", "http://evil.example"),
        ("sec-fetch-site", "cross-site"),
    ] {
        let r = g
            .client
            .post(g.url("/admin/reload"))
            .header(k, v)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403, "{k}");
    }
    // A script on loopback is not refused (here: no profile file to reload).
    let r = g.client.post(g.url("/admin/reload")).send().await.unwrap();
    assert_eq!(r.status(), 404);
}
