//! `envelope plan` on a CPU quickstart profile (the fixture of 542d032's
//! sweep, tests/fixtures/README.md) and the example
//! workloads: the table carries the demand arithmetic, the
//! supply read from the profile, and the replicas per scenario.

use crate::common;

use std::process::{Command, Output};

const PROFILE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/quickstart-profile-542d032.json"
);

fn plan(workload: &str, extra: &[&str]) -> Output {
    let w = format!(
        "{}/bench-configs/workloads/{workload}",
        env!("CARGO_MANIFEST_DIR")
    );
    Command::new(env!("CARGO_BIN_EXE_envelope"))
        .args(["plan", "--workload", &w, "--profile", PROFILE])
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn plan_prints_every_intermediate_on_the_committed_profile() {
    let r = plan("cpu-quickstart.toml", &[]);
    let out = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    for want in [
        "on `q8_0-f32-continuous`",
        "x1.750",
        // chat: 30 runs/min x 1.5 calls x 1.05 retry = 47.25 requests/min, x 80 = 3,780 input tokens/min.
        "model_requests_per_min                 req/min            47.250         61.812",
        "3,780",
        "1,890",
        // Supply: 128x64 (safe 6) for chat, 64x32 (safe 13) for classify, KV from the limits.
        "bucket (input x output)         tokens       128x64        64x32",
        "safe_concurrency_per_replica    slots             6           13",
        "kv_tokens_per_replica           tokens        1,310        1,310",
        "in flight, Little's law (mean x mean)",
        "peak-scenario slots (p95 x p95)",
        "Scenario base",
        "Scenario planned_peak",
        "Scenario failover",
        "Scenario recovery",
        "=> 2 replicas; binding: concurrency_slots; next: kv_tokens",
        "tok/s",
    ] {
        assert!(out.contains(want), "missing `{want}` in\n{out}");
    }
}

#[test]
fn plan_json_and_the_worked_example() {
    let r = plan("worked-example.toml", &["--json"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let v: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap();
    let d = &v["demand"];
    let close = |x: &serde_json::Value, want: f64| {
        let got = x.as_f64().unwrap();
        assert!((got - want).abs() <= 1e-9 * want, "{got} vs {want}");
    };
    close(&d[0]["model_requests_per_min"], 466.56);
    close(&d[0]["input_tokens_per_min"], 3_359_232.0);
    close(&d[0]["output_tokens_per_min"], 559_872.0);
    close(&d[0]["in_flight_littles_law"], 18.0);
    close(&d[0]["peak_scenario_slots"], 24.0);
    close(&d[0]["provisioned_slots"], 42.0);
    close(&d[1]["input_tokens_per_min"], 1_958_880.0);
    close(&d[1]["output_tokens_per_min"], 307_824.0);
    close(&d[2]["model_requests_per_min"], 444.96);
    // 7,900-token prompts on a profile whose largest bucket is 256x32.
    let warnings = v["warnings"].to_string();
    assert!(warnings.contains("no bucket"), "{warnings}");
    assert_eq!(v["scenarios"].as_array().unwrap().len(), 4);
}

#[test]
fn plan_errors_name_the_file_and_field() {
    let dir = std::env::temp_dir().join(format!("envelope-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let w = dir.join("bad.toml");
    std::fs::write(
        &w,
        "[[class]]\nname = \"a\"\nruns_per_min = 1\nmodel_calls_per_run = 1\nretry_amplification = 0.5\n\
         input_tokens_p50 = 1\ninput_tokens_p95 = 1\noutput_tokens_p50 = 1\noutput_tokens_p95 = 1\n",
    )
    .unwrap();
    let r = Command::new(env!("CARGO_BIN_EXE_envelope"))
        .args([
            "plan",
            "--workload",
            w.to_str().unwrap(),
            "--profile",
            PROFILE,
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success());
    assert!(
        err.contains("bad.toml") && err.contains("class[0].retry_amplification"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A workload derived from a recorded trace: its TOML printed, then the
/// plan; with --json the TOML goes to stderr and stdout is the plan.
#[test]
fn plan_derives_its_workload_from_a_trace() {
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/bench-configs/traces/sample-envelope.jsonl"
    );
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_envelope"))
            .args(["plan", "--workload-from", trace, "--profile", PROFILE])
            .args(extra)
            .output()
            .unwrap()
    };
    let r = run(&[]);
    let text = String::from_utf8_lossy(&r.stdout);
    assert!(
        r.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&r.stderr)
    );
    assert!(
        text.starts_with("# derived by `envelope plan --workload-from"),
        "{text}"
    );
    let toml_part = &text[..text.find("envelope plan: workload").expect("then the plan")];
    let w = envelope_profile::workload::Workload::from_toml(toml_part, "derived").unwrap();
    let agent = w.classes.iter().find(|c| c.name == "agent").unwrap();
    assert!(agent.session && agent.model_calls_per_run == 3.0);
    assert!(text.contains("binding: "), "{text}");
    let r = run(&["--json"]);
    assert!(r.status.success());
    let v: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap();
    assert_eq!(v["workload"], "sample-envelope");
    // The agent's sessions: the derived class describes their first calls,
    // and the plan's context growth brings the mean call back to the
    // trace's own mean over every call.
    let calls: Vec<f64> = std::fs::read_to_string(trace)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|r| r["feature"] == "agent")
        .map(|r| r["input_tokens"].as_f64().unwrap())
        .collect();
    let trace_mean = calls.iter().sum::<f64>() / calls.len() as f64;
    assert!(
        agent.input_tokens_mean.unwrap() < 0.9 * trace_mean,
        "{agent:?}"
    );
    let planned = v["demand"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["class"] == "agent")
        .unwrap()["input_tokens_per_request_mean"]
        .as_f64()
        .unwrap();
    assert!(
        (planned - trace_mean).abs() <= 0.05 * trace_mean,
        "planned mean input {planned}, the trace's {trace_mean}"
    );
    assert!(String::from_utf8_lossy(&r.stderr).contains("[[class]]"));
    // --workload and --workload-from exclude each other; one is required.
    let both = Command::new(env!("CARGO_BIN_EXE_envelope"))
        .args([
            "plan",
            "--workload",
            trace,
            "--workload-from",
            trace,
            "--profile",
            PROFILE,
        ])
        .output()
        .unwrap();
    assert!(!both.status.success());
    let bad = run_with_missing_trace();
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("--workload-from"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
}

fn run_with_missing_trace() -> Output {
    Command::new(env!("CARGO_BIN_EXE_envelope"))
        .args([
            "plan",
            "--workload-from",
            "/nonexistent/trace.jsonl",
            "--profile",
            PROFILE,
        ])
        .output()
        .unwrap()
}

/// Plans checked by replay: a profile of SmolLM2 swept here
/// through the http target of `envelope serve` (so supply and replay are
/// the same machine's), the quickstart workload planned on it and replayed
/// at one replica's share: confirmed. The same workload claiming that its
/// requests take 50 ms: the plan's slots are optimistic, and --validate
/// exits 1.
#[test]
fn plan_validate_confirms_a_measured_plan_and_fails_an_optimistic_one() {
    let server = common::Server::start(&[
        "--model",
        &common::smollm2(),
        "--served-model-name",
        "smollm2",
        "--precision",
        "q8_0",
        "--kv-cache-bytes",
        "64MiB",
        "--max-num-seqs",
        "16",
    ]);
    let dir = std::env::temp_dir().join(format!("envelope-plan-validate-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("bench.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"[target]
kind = "http"
model = "smollm2"
base_url = "{}"
vocab_size = 49152
[matrix]
buckets = ["64x32", "128x64"]
concurrency_max = 8
[load]
rounds = 1
min_requests = 4
max_client_gap_ms = 2000
[slo]
ttft_p95_ms = 4000
itl_p95_ms = 400
e2e_p99_ms = 15000
headroom = 0.1
"#,
            server.base
        ),
    )
    .unwrap();
    let out = dir.join("sweep");
    let s = Command::new(env!("CARGO_BIN_EXE_envelope"))
        .args(["sweep", "--config"])
        .arg(&cfg)
        .arg("--out")
        .arg(&out)
        .env("ENVELOPE_LOG", "warn")
        .output()
        .unwrap();
    assert!(s.status.success(), "{}", String::from_utf8_lossy(&s.stderr));
    let profile = out.join("profile.json");
    let validate = |workload: &std::path::Path| {
        Command::new(env!("CARGO_BIN_EXE_envelope"))
            .arg("plan")
            .arg("--workload")
            .arg(workload)
            .arg("--profile")
            .arg(&profile)
            .args(["--validate", "--target", &server.base, "--model", "smollm2"])
            .args(["--vocab-size", "49152", "--seconds", "15"])
            .output()
            .unwrap()
    };
    let quickstart = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("bench-configs/workloads/cpu-quickstart.toml");
    let r = validate(&quickstart);
    let text = String::from_utf8_lossy(&r.stdout);
    assert!(
        r.status.success() && text.contains("plan confirmed"),
        "{text}\n{}",
        String::from_utf8_lossy(&r.stderr)
    );
    assert!(text.contains("| concurrency_slots |") && text.contains("| kv_tokens |"));

    // A recorded trace replayed at one replica's share: its own requests,
    // sessions in order, judged against the plan derived from it.
    let trace = dir.join("trace.jsonl");
    let lines: Vec<String> = (0..60)
        .map(|i| {
            let session = if i % 3 == 0 {
                String::new()
            } else {
                format!(r#","session":"s{}""#, i / 3)
            };
            format!(
                r#"{{"t_s":{},"input_tokens":{},"output_tokens":16,"class":"chat"{session}}}"#,
                i as f64 * 0.25,
                40 + (i % 3) * 8
            )
        })
        .collect();
    std::fs::write(&trace, lines.join("\n")).unwrap();
    let r = Command::new(env!("CARGO_BIN_EXE_envelope"))
        .arg("plan")
        .arg("--workload-from")
        .arg(&trace)
        .arg("--profile")
        .arg(&profile)
        .args(["--validate", "--target", &server.base, "--model", "smollm2"])
        .args(["--vocab-size", "49152", "--seconds", "15"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&r.stdout);
    assert!(
        matches!(r.status.code(), Some(0 | 1)),
        "{text}\n{}",
        String::from_utf8_lossy(&r.stderr)
    );
    let line = text
        .lines()
        .find(|l| l.starts_with("replayed `trace`"))
        .unwrap_or_else(|| panic!("{text}"));
    // 60 requests in 15 s, at one replica's share: the trace once where
    // one replica is planned, 30 where two are. How many depends on what
    // this machine measured (one on the 2-core Xeon, two on the 2-core
    // AMD EPYC of 2026-12-06, with the same build).
    let replicas: f64 = line
        .split(" replicas planned")
        .next()
        .and_then(|t| t.rsplit('(').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    let sent: f64 = line
        .split(": ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    let share = 60.0 / replicas;
    assert!(
        (sent - share).abs() <= 2.0 + 0.05 * share,
        "{line}: {share:.0} expected"
    );
    assert!(
        text.contains("plan confirmed") || text.contains("plan OPTIMISTIC"),
        "{text}"
    );

    let optimistic = dir.join("optimistic.toml");
    let w = std::fs::read_to_string(&quickstart).unwrap().replace(
        "[[class]]\n",
        "[[class]]\ntime_in_system_s_mean = 0.05\ntime_in_system_s_p95 = 0.05\n",
    );
    std::fs::write(&optimistic, w).unwrap();
    let r = validate(&optimistic);
    let text = String::from_utf8_lossy(&r.stdout);
    assert_eq!(r.status.code(), Some(1), "{text}");
    assert!(text.contains("plan OPTIMISTIC"), "{text}");
    let slots = text
        .lines()
        .find(|l| l.starts_with("| concurrency_slots |"))
        .unwrap();
    assert!(slots.contains("OPTIMISTIC"), "{slots}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Model tiers: each tier is planned with its own profile for its share of
/// the requests, from a mix given or measured by the governor's record.
#[test]
fn plan_sizes_each_tier_for_its_share_of_the_requests() {
    let tiers = |mix: &[&str]| {
        let mut args = vec![
            "--tier".to_string(),
            format!("small={PROFILE}"),
            "--tier".to_string(),
            format!("large={PROFILE}"),
            "--json".to_string(),
        ];
        args.extend(mix.iter().map(|s| s.to_string()));
        let w = format!(
            "{}/bench-configs/workloads/cpu-quickstart.toml",
            env!("CARGO_MANIFEST_DIR")
        );
        Command::new(env!("CARGO_BIN_EXE_envelope"))
            .args(["plan", "--workload", &w])
            .args(&args)
            .output()
            .unwrap()
    };
    let chat = |v: &serde_json::Value, tier: &str| {
        let t = v["tiers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["tier"] == tier)
            .unwrap_or_else(|| panic!("no tier {tier}: {v}"));
        t["plan"]["demand"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["class"] == "chat")
            .unwrap()["model_requests_per_min"]
            .as_f64()
            .unwrap()
    };
    let r = tiers(&["--tier-mix", "small=0.8,large=0.25"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let v: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap();
    // 47.25 requests/min: 0.8 of them on small, 0.25 on large (escalations
    // are attempts on both).
    assert!((chat(&v, "small") - 37.8).abs() < 1e-9, "{v}");
    assert!((chat(&v, "large") - 11.8125).abs() < 1e-9, "{v}");
    // The same mix measured by the governor: 3 of 4 attempts per call on
    // small, 1 on large.
    let dir = common::temp_dir("envelope-plan", "tiers");
    let log = dir.join("calls.jsonl");
    std::fs::write(
        &log,
        ["small", "small", "small", "large"]
            .map(|t| {
                format!(
                    r#"{{"t_s":0,"input_tokens":10,"output_tokens":2,"tiers":{{"start_tier":"{t}","tier":"{t}","reason":"default","outcome":"ok","cost":0.0,"tiers_version":"v1"}}}}"#
                )
            })
            .join("\n"),
    )
    .unwrap();
    let r = tiers(&["--tier-mix-from", log.to_str().unwrap()]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let v: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap();
    assert!((chat(&v, "small") - 47.25 * 0.75).abs() < 1e-9, "{v}");
    // A tier with a share and no profile is an error that names it.
    let r = tiers(&["--tier-mix", "small=0.8,medium=0.2"]);
    assert!(!r.status.success());
    assert!(String::from_utf8_lossy(&r.stderr).contains("tier `medium`"));
}
