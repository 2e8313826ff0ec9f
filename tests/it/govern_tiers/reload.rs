//! The tiers file reloads, refuses bad versions and rolls back; an invalid one stops the start naming its field.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_tiers_file_reloads_refuses_bad_versions_and_rolls_back() {
    let _one = SERIAL.lock().await;
    let (a, b) = (dummy(1, "tiny-a"), dummy(2, "tiny-b"));
    let dir = temp_dir("reload");
    let file = |version: &str, tier: &str| {
        format!(
            r#"
version = "{version}"
order = ["small", "large"]
[tiers.small]
upstreams = [{{ url = "{}", profile = "{}", model = "tiny-a" }}]
[tiers.large]
upstreams = [{{ url = "{}", profile = "{}", model = "tiny-b" }}]
[[rules]]
name = "reports"
tier = "{tier}"
features = ["report"]
"#,
            a.base,
            profile(&dir, "small", 1024, 64, 8).display(),
            b.base,
            profile(&dir, "large", 1024, 64, 8).display(),
        )
    };
    let gov = govern(&dir, &file("v1", "small"));
    let report = [("x-envelope-feature", "report")];
    let r = chat(&gov, ask("hi", 2), &report).await;
    assert_eq!(
        (r.tier(), r.header("x-envelope-tiers-version")),
        ("small", "v1")
    );
    // A model swap: only the mapping changes.
    let path = dir.join("tiers.toml");
    std::fs::write(&path, file("v2", "large")).unwrap();
    let (status, body) = post(&gov, "/admin/tiers/reload").await;
    assert_eq!(
        (status, body["version"].as_str()),
        (200, Some("v2")),
        "{body}"
    );
    let r = chat(&gov, ask("hi", 2), &report).await;
    assert_eq!(
        (r.tier(), r.header("x-envelope-tiers-version")),
        ("large", "v2")
    );
    // An invalid version is refused with the file and field named; v2 stays.
    std::fs::write(&path, file("v3", "huge")).unwrap();
    let (status, body) = post(&gov, "/admin/tiers/reload").await;
    assert_eq!(status, 422, "{body}");
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("tiers.toml") && msg.contains("rules[0].tier"),
        "{msg}"
    );
    let r = chat(&gov, ask("hi", 2), &report).await;
    assert_eq!(
        (r.status, r.header("x-envelope-tiers-version")),
        (200, "v2")
    );
    // Rollback restores v1.
    let (status, body) = post(&gov, "/admin/tiers/rollback").await;
    assert_eq!(
        (status, body["version"].as_str()),
        (200, Some("v1")),
        "{body}"
    );
    let r = chat(&gov, ask("hi", 2), &report).await;
    assert_eq!(
        (r.tier(), r.header("x-envelope-tiers-version")),
        ("small", "v1")
    );
    let (status, _) = post(&gov, "/admin/tiers/rollback").await;
    assert_eq!(status, 422, "nothing before v1");
}

#[test]
fn an_invalid_tiers_file_stops_the_start_naming_the_field() {
    let dir = temp_dir("invalid");
    let path = dir.join("tiers.toml");
    std::fs::write(
        &path,
        "version = \"v1\"\norder = [\"small\"]\n[tiers.small]\nupstreams = []\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_envelope"))
        .args(["govern", "--tiers", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("tiers.toml") && err.contains("tiers.small.upstreams"),
        "{err}"
    );
    let both = std::process::Command::new(env!("CARGO_BIN_EXE_envelope"))
        .args([
            "govern",
            "--tiers",
            path.to_str().unwrap(),
            "--upstream",
            "http://x",
        ])
        .output()
        .unwrap();
    assert!(!both.status.success());
}
