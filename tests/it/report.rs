//! `envelope report` regenerates the reports of the committed quickstart
//! profile, and names the file and field of a bad one.

use std::process::Command;

#[test]
fn reports_from_the_committed_profile() {
    let out = std::env::temp_dir().join(format!("envelope-report-{}", std::process::id()));
    let profile = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/profiles/cpu-2core-smollm2-135m-q4_1-quickstart/profile.json"
    );
    let r = Command::new(env!("CARGO_BIN_EXE_envelope"))
        .args([
            "report",
            "--profile",
            profile,
            "--out",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(
        md.contains("| q8_0-f32-continuous | 128x64 | 7 | 6 | kv_cache |"),
        "{md}"
    );
    // The governor's table per bucket: 128x64 safe at 6 costs 1/6 of the node.
    assert!(md.contains("| 128x64 | 6 | 1/6 | 1152 |"), "{md}");
    assert!(std::fs::read_to_string(out.join("report.html"))
        .unwrap()
        .contains("<table>"));
    std::fs::remove_dir_all(&out).ok();

    let bad =
        std::env::temp_dir().join(format!("envelope-bad-profile-{}.json", std::process::id()));
    std::fs::write(&bad, r#"{"schema": "envelope.profile/v0"}"#).unwrap();
    let r = Command::new(env!("CARGO_BIN_EXE_envelope"))
        .args(["report", "--profile", bad.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!r.status.success());
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(err.contains(bad.to_str().unwrap()), "{err}");
    std::fs::remove_file(&bad).ok();
}
