//! `--device cpu|cuda[:N]|auto` through the binary. On a machine
//! without a GPU (CI), `cuda` exits non-zero naming the reason and `auto`
//! runs on the CPU and says it fell back. On a GPU machine those two tests
//! have nothing to check and say so (scripts/device-check.sh runs the GPU).

use std::process::{Command, Output};

fn envelope(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_envelope"))
        .args(args)
        .env("ENVELOPE_LOG", "info")
        .env_remove("ENVELOPE_DEVICE")
        .output()
        .unwrap()
}

const SMALL_BENCH: &[&str] = &[
    "bench-engine",
    "--model",
    "dummy:tiny",
    "--prompt-tokens",
    "8",
    "--decode-tokens",
    "4",
    "--decode-prompt-tokens",
    "8",
    "--concurrency",
    "1",
    "--kv-cache-bytes",
    "4MiB",
];

/// A GPU is usable here: the no-GPU expectations do not apply.
fn gpu_present() -> bool {
    let present = envelope_cuda::Device::open(0).is_ok();
    if present {
        eprintln!("a CUDA device is present: the no-GPU checks do not apply here");
    }
    present
}

/// The reason `cuda` cannot run here: a missing library or device.
fn names_a_reason(stderr: &str) -> bool {
    [
        "libcuda.so",
        "libnvrtc.so",
        "libcublas",
        "no CUDA device",
        "does not exist",
        "driver call",
    ]
    .iter()
    .any(|r| stderr.contains(r))
}

#[test]
fn cuda_exits_nonzero_with_the_reason() {
    if gpu_present() {
        return;
    }
    for (cmd, dev) in [
        (&["bench-engine", "--model", "dummy:tiny"][..], "cuda"),
        (
            &["serve", "--model", "dummy:tiny", "--port", "0"][..],
            "cuda:0",
        ),
        (
            &["generate", "--model", "dummy:tiny", "--prompt", "hi"][..],
            "cuda",
        ),
    ] {
        let mut args = cmd.to_vec();
        args.extend(["--device", dev]);
        let r = envelope(&args);
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(!r.status.success(), "{args:?} succeeded");
        assert!(err.contains("--device cuda:0"), "{args:?}: {err}");
        assert!(names_a_reason(&err), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn auto_runs_on_the_cpu_and_says_it_fell_back() {
    if gpu_present() {
        return;
    }
    let mut args = SMALL_BENCH.to_vec();
    args.extend(["--device", "auto"]);
    let r = envelope(&args);
    let (out, err) = (
        String::from_utf8_lossy(&r.stdout),
        String::from_utf8_lossy(&r.stderr),
    );
    assert!(r.status.success(), "{err}");
    assert!(out.contains("decode"), "{out}");
    assert!(
        err.contains("--device auto") && err.contains("falling back to the CPU"),
        "{err}"
    );
}

#[test]
fn cpu_is_the_default_and_says_nothing_about_cuda() {
    let r = envelope(SMALL_BENCH);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(r.status.success(), "{err}");
    assert!(!err.contains("--device"), "{err}");
    // The report says what ran the steps.
    let mut json = SMALL_BENCH.to_vec();
    json.push("--json");
    let r = envelope(&json);
    let out = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success());
    let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(report["backend"], "cpu", "{out}");
    assert_eq!(report["device"], "cpu", "{out}");
}

#[test]
fn bad_device_values_are_refused_by_name() {
    let r = envelope(&[
        "bench-engine",
        "--model",
        "dummy:tiny",
        "--device",
        "cuda:x",
    ]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success());
    assert!(err.contains("`cuda:x` is not a device"), "{err}");
}

#[test]
fn sweep_reads_target_device() {
    let dir = std::env::temp_dir().join(format!("envelope-device-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = |device: &str, kind: &str| {
        let p = dir.join(format!("{}-{kind}.toml", device.replace(':', "_")));
        std::fs::write(
            &p,
            format!(
                "[target]\nkind = \"{kind}\"\nmodel = \"dummy:tiny\"\nbase_url = \"http://127.0.0.1:9\"\n\
                 device = \"{device}\"\nkv_cache_bytes = \"4MiB\"\n[matrix]\nprecisions = [\"f32\"]\n\
                 batch_policies = [\"continuous\"]\nbuckets = [\"16x4\"]\nconcurrency_max = 1\n\
                 [slo]\nitl_p95_ms = 5000\n"
            ),
        )
        .unwrap();
        p.display().to_string()
    };
    let out = dir.join("out").display().to_string();
    let gpu = gpu_present();
    let r = envelope(&[
        "sweep",
        "--config",
        &config("cuda", "engine"),
        "--out",
        &out,
    ]);
    let err = String::from_utf8_lossy(&r.stderr);
    if !gpu {
        assert!(!r.status.success());
        assert!(
            err.contains("--device cuda:0") && names_a_reason(&err),
            "{err}"
        );
    }
    let r = envelope(&["sweep", "--config", &config("tpu", "engine"), "--out", &out]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(
        !r.status.success() && err.contains("target.device"),
        "{err}"
    );
    let r = envelope(&["sweep", "--config", &config("cuda", "http"), "--out", &out]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(
        !r.status.success() && err.contains("engine target only"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// scripts/device-check.sh itself, on a machine without a GPU: every stage
/// asked for runs, the CUDA ones fail with the reason, `auto` falls back to
/// the CPU, the log is written, and the exit status says "not passed".
#[test]
fn device_check_script_runs_its_stages_and_reports() {
    if gpu_present() {
        return;
    }
    let out = std::env::temp_dir().join(format!("envelope-device-check-{}", std::process::id()));
    let r = Command::new("bash")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/device-check.sh"
        ))
        .arg(&out)
        .arg("kernels,driver-only,gemm,engine")
        .env("ENVELOPE_BIN", env!("CARGO_BIN_EXE_envelope"))
        .env("ENVELOPE_LOG", "warn")
        // engine-auto really runs (on the CPU): no 30 s limit that a slower
        // machine could miss.
        .env("DEVICE_CHECK_STAGE_LIMITS", "off")
        .env_remove("ENVELOPE_DEVICE")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&r.stdout);
    assert_eq!(r.status.code(), Some(1), "{stdout}");
    let log = std::fs::read_to_string(out.join("device-check.log")).unwrap();
    for want in [
        "== kernels:",
        "== kernel-cache:",
        "== driver-only-kernels (no limit): env ENVELOPE_KERNELS=embedded ENVELOPE_GEMM=kernels",
        "== driver-only-models:",
        "== gemm:",
        "== engine-cuda:",
        "== engine-auto:",
        "falling back to the CPU",
        "device-check exit status 1",
    ] {
        assert!(log.contains(want), "missing {want:?} in\n{log}");
    }
    assert!(names_a_reason(&log), "{log}");
    assert!(!log.contains("== models") && !log.contains("== bench"));
    // The stages run in the order asked for, and the closing table lists each.
    let at = |w: &str| log.find(w).unwrap_or_else(|| panic!("no {w:?} in\n{log}"));
    assert!(
        at("== kernels (") < at("== driver-only-kernels (")
            && at("== gemm (") < at("== engine-cuda (")
    );
    assert!(log.contains("engine-auto              exit 0"), "{log}");
    assert!(out.join("selftest.json").is_file());
    assert!(out.join("driver-only/selftest.json").is_file());
    // A stage name the script does not know is refused, not skipped.
    let bad = Command::new("bash")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/device-check.sh"
        ))
        .arg(&out)
        .arg("kernels,benhc")
        .env("ENVELOPE_BIN", env!("CARGO_BIN_EXE_envelope"))
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    let _ = std::fs::remove_dir_all(&out);
}

/// `--bundle` with a budget, as on the lent device machine (which returns 8
/// files): OUT holds the log and one archive of every result; stages run in
/// the order given, and a stage the budget cannot fit is skipped and logged.
#[test]
fn device_check_bundles_its_results_and_keeps_to_its_budget() {
    if gpu_present() {
        return;
    }
    let out = std::env::temp_dir().join(format!("envelope-device-bundle-{}", std::process::id()));
    let check = |stages: &str, budget: &str| {
        let _ = std::fs::remove_dir_all(&out);
        Command::new("bash")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/scripts/device-check.sh"
            ))
            .arg("--bundle")
            .arg(&out)
            .arg(stages)
            .env("ENVELOPE_BIN", env!("CARGO_BIN_EXE_envelope"))
            .env("ENVELOPE_LOG", "warn")
            .env("DEVICE_CHECK_BUDGET", budget)
            .env_remove("ENVELOPE_DEVICE")
            .output()
            .unwrap()
    };
    // A budget that fits both stages: both run, in the order given.
    let r = check("engine,kernels", "600");
    let stdout = String::from_utf8_lossy(&r.stdout);
    assert_eq!(r.status.code(), Some(1), "{stdout}");
    let mut names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["device-check.log", "device-check.tar.gz"]);
    let log = std::fs::read_to_string(out.join("device-check.log")).unwrap();
    assert!(
        log.find("== engine-cuda (").unwrap() < log.find("== kernels (").unwrap(),
        "{log}"
    );
    assert!(log.contains("device-check.tar.gz"), "{log}");
    // Stage limits are on by default, and cut to the budget.
    assert!(log.contains("== engine-cuda (limit 90 s)"), "{log}");
    let list = Command::new("tar")
        .arg("tzf")
        .arg(out.join("device-check.tar.gz"))
        .output()
        .unwrap();
    let list = String::from_utf8_lossy(&list.stdout);
    for want in [
        "./selftest.json",
        "./second-run/selftest.json",
        "./device-check.log",
    ] {
        assert!(list.lines().any(|l| l == want), "{want} not in\n{list}");
    }
    // A budget too small for any stage: each is skipped and logged, and the
    // status says "incomplete" (3), not "passed".
    let r = check("kernels,bench", "5");
    assert_eq!(r.status.code(), Some(3));
    let log = std::fs::read_to_string(out.join("device-check.log")).unwrap();
    assert!(
        log.contains("== kernels: skipped") && log.contains("== bench: skipped"),
        "{log}"
    );
    assert!(!log.contains("cuda-selftest --bench"), "{log}");
    // A budget that is not a number is refused, and so is a stage-limits
    // setting that is neither on nor off.
    assert_eq!(check("kernels", "5m").status.code(), Some(2));
    let r = Command::new("bash")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/device-check.sh"
        ))
        .arg(&out)
        .arg("kernels")
        .env("ENVELOPE_BIN", env!("CARGO_BIN_EXE_envelope"))
        .env("DEVICE_CHECK_STAGE_LIMITS", "none")
        .output()
        .unwrap();
    assert_eq!(r.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&r.stdout).contains("DEVICE_CHECK_STAGE_LIMITS"));
    let _ = std::fs::remove_dir_all(&out);
}
