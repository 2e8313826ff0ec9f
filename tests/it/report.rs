//! `envelope report` regenerates the reports of a quickstart profile (the
//! fixture of 542d032's sweep) and of every committed profile, and names
//! the file and field of a bad one.

use std::process::Command;

#[test]
fn reports_from_the_committed_profile() {
    let out = std::env::temp_dir().join(format!("envelope-report-{}", std::process::id()));
    let profile = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/quickstart-profile-542d032.json"
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

/// The text of `s` without Markdown's inline marks or HTML tags and
/// entities: what a reader sees of a heading in either report.
fn seen(s: &str) -> String {
    let mut out = String::new();
    let mut in_tag = false;
    for ch in s.chars() {
        match ch {
            '<' => in_tag = true,
            '>' if in_tag => in_tag = false,
            '`' | '*' => {}
            c if !in_tag => out.push(c),
            _ => {}
        }
    }
    out.replace("&amp;", "&")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .trim()
        .to_string()
}

/// Every committed profile's two reports hold the same sections, images
/// and table rows: report.html is report.md rendered, not a second report
/// that can leave a section out.
#[test]
fn every_section_of_report_md_is_in_report_html() {
    let profiles = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("profiles");
    let (mut found, mut dirs) = (vec![], vec![profiles]);
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let path = e.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.file_name().is_some_and(|n| n == "profile.json") {
                found.push(path);
            }
        }
    }
    let mut checked = 0;
    let mut workload_seen = false;
    for path in found {
        let out = std::env::temp_dir().join(format!(
            "envelope-report-sections-{}-{checked}",
            std::process::id()
        ));
        let r = Command::new(env!("CARGO_BIN_EXE_envelope"))
            .args(["report", "--profile", path.to_str().unwrap()])
            .args(["--out", out.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        let md = std::fs::read_to_string(out.join("report.md")).unwrap();
        let html = std::fs::read_to_string(out.join("report.html")).unwrap();
        let md_heads: Vec<String> = md
            .lines()
            .filter_map(|l| l.strip_prefix("## "))
            .map(seen)
            .collect();
        let html_heads: Vec<String> = html
            .split("<h2>")
            .skip(1)
            .map(|h| seen(h.split("</h2>").next().unwrap()))
            .collect();
        assert!(!md_heads.is_empty(), "{}", path.display());
        assert_eq!(md_heads, html_heads, "{}", path.display());
        workload_seen |= md_heads.iter().any(|h| h.starts_with("Workload"));
        // Images (plots, the saturation curve) and table rows, one for one.
        let md_images: Vec<&str> = md
            .split("](")
            .skip(1)
            .zip(md.split("![").skip(1))
            .map(|(src, _)| src.split(')').next().unwrap())
            .filter(|s| s.ends_with(".svg"))
            .collect();
        for src in &md_images {
            assert!(html.contains(&format!("<img src=\"{src}\"")), "{src}");
        }
        let md_rows = md
            .lines()
            .filter(|l| l.starts_with('|') && !l.starts_with("|---"))
            .count();
        assert_eq!(md_rows, html.matches("<tr>").count(), "{}", path.display());
        std::fs::remove_dir_all(&out).ok();
        checked += 1;
    }
    assert!(checked >= 3, "only {checked} committed profiles");
    assert!(workload_seen, "no committed profile has a workload section");
}
