//! `envelope gate` and `envelope quality` end to end: exit 0 on pass, 1 on
//! a failed rule, 2 on unusable input, 3 when per-repeat figures cannot
//! tell a change from noise.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const PROFILE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/quickstart-profile-542d032.json"
);

fn envelope(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_envelope"))
        .args(args)
        .output()
        .unwrap()
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("envelope-gate-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn exit_codes_pass_fail_unusable() {
    let dir = tmp("codes");
    let rules = dir.join("rules.toml");
    std::fs::write(
        &rules,
        "rules = [\"safe_concurrency >= 1.0 x baseline\", \"weight_bytes <= 2.0 x baseline\"]\n",
    )
    .unwrap();
    let out = dir.join("out");
    // The fixture quickstart profile holds as-stored (Q4_1) and q8_0
    // configurations of one model on one node: q8_0 has at least as much
    // safe concurrency.
    let gate = |base: &str, cand: &str, candidate: &str, rules: &str| {
        envelope(&[
            "gate",
            "--baseline",
            PROFILE,
            "--candidate",
            candidate,
            "--rules",
            rules,
            "--baseline-config",
            base,
            "--candidate-config",
            cand,
            "--out",
            s(&out),
        ])
    };
    let r = gate(
        "as-stored-f32-continuous",
        "q8_0-f32-continuous",
        PROFILE,
        s(&rules),
    );
    let md = String::from_utf8_lossy(&r.stdout);
    assert_eq!(
        r.status.code(),
        Some(0),
        "{md}\n{}",
        String::from_utf8_lossy(&r.stderr)
    );
    assert!(
        md.contains("# Gate: PASS") && md.contains("## Bucket 128x64"),
        "{md}"
    );
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("gate.json")).unwrap()).unwrap();
    assert_eq!(j["verdict"], "pass");
    assert!(std::fs::read_to_string(out.join("gate.md"))
        .unwrap()
        .contains("PASS"));

    // The other way round: 64x32 safe concurrency 13 -> 11 fails.
    let r = gate(
        "q8_0-f32-continuous",
        "as-stored-f32-continuous",
        PROFILE,
        s(&rules),
    );
    let md = String::from_utf8_lossy(&r.stdout);
    assert_eq!(r.status.code(), Some(1), "{md}");
    assert!(
        md.contains("| `safe_concurrency >= 1.0 x baseline` | 64x32 | 13 | 11 | 13 | one figure a side | **FAIL** |"),
        "{md}"
    );

    // Another model: not comparable.
    let mut other: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(PROFILE).unwrap()).unwrap();
    other["fingerprint"]["model"]["sha256"] = "0000".into();
    let other_path = dir.join("other.json");
    std::fs::write(&other_path, other.to_string()).unwrap();
    let r = gate(
        "as-stored-f32-continuous",
        "q8_0-f32-continuous",
        s(&other_path),
        s(&rules),
    );
    let md = String::from_utf8_lossy(&r.stdout);
    assert_eq!(r.status.code(), Some(2), "{md}");
    assert!(
        md.contains("Not comparable") && md.contains("model.sha256"),
        "{md}"
    );

    // Per-repeat figures: one repeat a side within the noise floor cannot
    // tell a change from drift (exit 3); past it, the rule is decided.
    let decode_rules = dir.join("decode.toml");
    std::fs::write(
        &decode_rules,
        "rules = [\"decode_tok_s >= 0.95 x baseline\"]\n",
    )
    .unwrap();
    let with_repeats = |candidate_decode: f64| {
        let mut p: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(PROFILE).unwrap()).unwrap();
        for c in p["configs"].as_array_mut().unwrap() {
            let decode = match c["name"].as_str() {
                Some("q8_0-f32-continuous") => candidate_decode,
                _ => 100.0,
            };
            for b in c["buckets"].as_array_mut().unwrap() {
                let mut probes = b["probes"].clone();
                for probe in probes.as_array_mut().unwrap() {
                    probe["decode_tok_per_s"] = decode.into();
                }
                b["repeats"] = serde_json::json!([{
                    "feasible_concurrency": b["feasible_concurrency"],
                    "safe_concurrency": b["safe_concurrency"],
                    "probes": probes,
                }]);
            }
        }
        let path = dir.join(format!("repeats-{candidate_decode}.json"));
        std::fs::write(&path, p.to_string()).unwrap();
        path
    };
    for (decode, code, shown) in [(97.0, 3, "INCONCLUSIVE"), (60.0, 1, "FAIL")] {
        let path = with_repeats(decode);
        let r = envelope(&[
            "gate",
            "--baseline",
            s(&path),
            "--candidate",
            s(&path),
            "--rules",
            s(&decode_rules),
            "--baseline-config",
            "as-stored-f32-continuous",
            "--candidate-config",
            "q8_0-f32-continuous",
        ]);
        let md = String::from_utf8_lossy(&r.stdout);
        assert_eq!(r.status.code(), Some(code), "{md}");
        assert!(md.contains(&format!("# Gate: {shown}")), "{md}");
        assert!(md.contains("noise floor, 1 / 1 repeats"), "{md}");
    }

    // Unreadable input and a bad rules file are exit 2, naming the file and field.
    let r = gate("a", "b", s(&dir.join("missing.json")), s(&rules));
    assert_eq!(r.status.code(), Some(2));
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "rules = [\"speed >= 1\"]\n").unwrap();
    let r = gate(
        "as-stored-f32-continuous",
        "q8_0-f32-continuous",
        PROFILE,
        s(&bad),
    );
    assert_eq!(r.status.code(), Some(2));
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(
        err.contains("bad.toml") && err.contains("rules[0]"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn quality_writes_the_profile_section_and_gates_on_it() {
    let dir = tmp("quality");
    let text = dir.join("text.txt");
    std::fs::write(
        &text,
        "Four score and seven years ago our fathers brought forth on this continent, a new \
         nation, conceived in Liberty, and dedicated to the proposition that all men are created equal.",
    )
    .unwrap();
    // Two copies of a profile measured on dummy:tiny (rewritten from the committed one).
    let mut p: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(PROFILE).unwrap()).unwrap();
    p["fingerprint"]["model"] = serde_json::json!({"kind": "dummy", "preset": "tiny", "seed": 0});
    let (a, b) = (dir.join("f32.json"), dir.join("q4_0.json"));
    for path in [&a, &b] {
        std::fs::write(path, p.to_string()).unwrap();
    }
    for (path, precision) in [(&a, "f32"), (&b, "q4_0")] {
        let r = envelope(&[
            "quality",
            "--model",
            "dummy:tiny",
            "--precision",
            precision,
            "--text",
            s(&text),
            "--window-tokens",
            "64",
            "--profile",
            s(path),
            "--json",
        ]);
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        let q: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap();
        assert_eq!(q["reference_precision"], "f32");
        assert!(q["perplexity"].as_f64().unwrap() > 0.0);
    }
    let read = |p: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    let (qa, qb) = (read(&a)["quality"].clone(), read(&b)["quality"].clone());
    assert!(
        qa["kl_divergence_mean"].as_f64().unwrap().abs() < 1e-9,
        "{qa}"
    );
    assert_eq!(qa["top1_agreement"].as_f64(), Some(1.0));
    assert!(qb["kl_divergence_mean"].as_f64().unwrap() > 0.0, "{qb}");
    let rules = dir.join("rules.toml");
    std::fs::write(
        &rules,
        "rules = [\"kl_divergence <= 0.0\", \"top1_agreement >= 1.0\"]\n",
    )
    .unwrap();
    let gate = |base: &Path, cand: &Path| {
        envelope(&[
            "gate",
            "--baseline",
            s(base),
            "--candidate",
            s(cand),
            "--rules",
            s(&rules),
        ])
    };
    assert_eq!(gate(&b, &a).status.code(), Some(0));
    let r = gate(&a, &b);
    assert_eq!(
        r.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&r.stdout)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
