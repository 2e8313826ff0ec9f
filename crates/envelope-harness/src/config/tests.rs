use super::*;

const OK: &str = r#"
[target]
kind = "engine"
model = "dummy:tiny"
kv_cache_bytes = "8MiB"
[matrix]
precisions = ["f32", "q8_0"]
batch_policies = ["continuous", "static"]
buckets = ["64x16", "128x32"]
concurrency_max = 16
[slo]
itl_p95_ms = 500
headroom = 0.25
"#;

/// Without `kv_dtypes`, a CUDA engine gets each precision's activation
/// dtype (what its kernels pair with), the CPU keeps f32; an explicit
/// list wins everywhere.
#[test]
fn kv_dtypes_default_to_the_device() {
    let kv = |text: &str| -> Vec<String> {
        BenchConfig::parse(text, Path::new("d.toml"))
            .unwrap()
            .points
            .iter()
            .map(|p| p.name())
            .collect()
    };
    let gpu = OK
        .replace("kv_cache_bytes", "device = \"cuda\"\nkv_cache_bytes")
        .replace("[\"f32\", \"q8_0\"]", "[\"f32\", \"bf16\", \"fp8\"]")
        .replace("[\"continuous\", \"static\"]", "[\"continuous\"]");
    assert_eq!(
        kv(&gpu),
        [
            "f32-f32-continuous",
            "bf16-bf16-continuous",
            "fp8-bf16-continuous"
        ]
    );
    let cpu = gpu.replace("device = \"cuda\"\n", "");
    assert_eq!(
        kv(&cpu),
        [
            "f32-f32-continuous",
            "bf16-f32-continuous",
            "fp8-f32-continuous"
        ]
    );
    let explicit = gpu.replace("[matrix]", "[matrix]\nkv_dtypes = [\"f16\"]");
    assert_eq!(kv(&explicit)[1], "bf16-f16-continuous");
}

#[test]
fn parses_and_expands_the_matrix() {
    let c = BenchConfig::parse(OK, Path::new("q.toml")).unwrap();
    assert_eq!(c.points.len(), 4);
    assert_eq!(c.points[0].name(), "f32-f32-continuous");
    assert_eq!(c.buckets[1], Bucket::cold(128, 32));
    assert_eq!(c.kv_cache_bytes, 8 << 20);
    assert_eq!(c.slo.itl_p95_ms, Some(500.0));
    assert!(c.slo.zero_preemptions);
}

#[test]
fn warm_buckets_state_their_cached_share() {
    let warm = Bucket::parse("1024x32@85%").unwrap();
    assert_eq!(
        (warm.input_tokens, warm.output_tokens, warm.cached_percent),
        (1024, 32, 85)
    );
    assert_eq!(warm.prefix_tokens(), 870);
    assert_eq!(warm.cached_share(), Some(0.85));
    assert_eq!(warm.label(), "1024x32@85%");
    let cold = Bucket::parse("1024x32").unwrap();
    assert_eq!(
        (
            cold.cached_percent,
            cold.prefix_tokens(),
            cold.cached_share()
        ),
        (0, 0, None)
    );
    assert_eq!(cold.label(), "1024x32");
    for bad in [
        "1024x32@0%",
        "1024x32@96%",
        "1024x32@85",
        "1024x32@x%",
        "4x1@10%",
        "0x32@50%",
    ] {
        assert!(Bucket::parse(bad).is_err(), "{bad}");
    }
    let c = BenchConfig::parse(
        &OK.replace("\"64x16\"", "\"64x16\", \"64x16@50%\""),
        Path::new("q.toml"),
    )
    .unwrap();
    assert!(c.buckets.contains(&Bucket::parse("64x16@50%").unwrap()));
    // The same bucket twice, and a warm bucket with dataset prompts, are
    // refused with the field named.
    for (text, says) in [
        (
            OK.replace("\"64x16\"", "\"64x16\", \"64x16\""),
            "listed twice",
        ),
        (
            OK.replace("\"64x16\"", "\"64x16@50%\"")
                .replace("[slo]", "[load]\ndataset = \"d.txt\"\n[slo]"),
            "load.dataset",
        ),
    ] {
        let e = BenchConfig::parse(&text, Path::new("q.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("matrix.buckets") && e.contains(says), "{e}");
    }
}

#[test]
fn errors_name_the_file_and_the_field() {
    let cases = [
        (OK.replace("\"q8_0\"", "\"q3\""), "matrix.precisions"),
        (OK.replace("\"64x16\"", "\"64by16\""), "matrix.buckets"),
        (
            OK.replace("concurrency_max = 16", "concurrency_max = 0"),
            "matrix.concurrency_min",
        ),
        (
            OK.replace("headroom = 0.25", "headroom = 1.5"),
            "slo.headroom",
        ),
        (
            OK.replace("kind = \"engine\"", "kind = \"magic\""),
            "target.kind",
        ),
        (OK.replace("\"8MiB\"", "\"lots\""), "target.kv_cache_bytes"),
        (OK.replace("[slo]", "[slo]\nttft_p96_ms = 3"), "ttft_p96_ms"),
        (
            OK.replace("\"static\"", "\"dynamic\""),
            "matrix.batch_policies",
        ),
        (
            OK.replace("kind = \"engine\"", "kind = \"launch\""),
            "target.command",
        ),
        (
            OK.replace("kind = \"engine\"", "kind = \"http\""),
            "target.base_url",
        ),
        (
            OK.replace(
                "kind = \"engine\"",
                "kind = \"http\"\nbase_url = \"http://h\"",
            ),
            "matrix",
        ),
        (
            OK.replace("[slo]", "[load]\nmode = \"burst\"\n[slo]"),
            "load.mode",
        ),
        (
            OK.replace(
                "[slo]",
                "[load]\nmode = \"poisson\"\nrate_min_per_s = 0\n[slo]",
            ),
            "load.rate_min_per_s",
        ),
        (
            OK.replace(
                "kind = \"engine\"",
                "kind = \"engine\"\nprompt_format = \"words\"",
            ),
            "target.prompt_format",
        ),
        (
            OK.replace("[slo]", "[load]\nmax_late_fraction = 2\n[slo]"),
            "load.max_late_fraction",
        ),
        (
            OK.replace("[slo]", "[load]\nmax_client_gap_ms = 0\n[slo]"),
            "load.max_client_gap_ms",
        ),
        (
            OK.replace("[slo]", "[load]\nrepeats = 0\n[slo]"),
            "load.repeats",
        ),
        (
            OK.replace("[slo]", "[load]\nmax_requests = 0\n[slo]"),
            "load.max_requests",
        ),
        (
            OK.replace("headroom = 0.25", "confidence = 1.0"),
            "slo.confidence",
        ),
        (
            OK.replace("headroom = 0.25", "confidence = 0.3"),
            "slo.confidence",
        ),
        (
            format!("{OK}[slo.decision]\np95 = {{ p0 = 0.1, p1 = 0.05 }}\n"),
            "slo.decision.p95",
        ),
    ];
    for (text, field) in cases {
        let e = BenchConfig::parse(&text, Path::new("bench-configs/x.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("bench-configs/x.toml") && e.contains(field),
            "{field}: {e}"
        );
    }
}

#[test]
fn launch_and_http_targets_keep_their_strings_and_poisson_its_rates() {
    let text = OK
        .replace(
            "kind = \"engine\"",
            "kind = \"launch\"\ncommand = \"vllm serve {model} --port {port}\"",
        )
        .replace("\"q8_0\"", "\"fp8\"")
        .replace(
            "[slo]",
            "[load]\nmode = \"poisson\"\nrate_step_per_s = 0.5\n[slo]",
        );
    let c = BenchConfig::parse(&text, Path::new("l.toml")).unwrap();
    assert_eq!(c.points[2].precision, "fp8");
    assert!(c.points.iter().all(|p| p.engine.is_none()));
    assert!(matches!(&c.target, Target::Launch { base_url, .. } if base_url.contains("{port}")));
    assert!(c.load.is_open_loop());
    assert_eq!(c.load.rate_step_per_s, 0.5);
    assert_eq!(c.http.metrics_url.as_deref(), Some("{base_url}/metrics"));
}

/// The committed launch templates for the servers users run: every
/// matrix point renders into that server's own flags.
#[test]
fn launch_templates_map_the_matrix_to_each_servers_flags() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench-configs");
    let command = |file: &str, precision: &str, kv: &str| {
        let c = BenchConfig::load(&dir.join(file)).unwrap();
        let Target::Launch { command, .. } = &c.target else {
            panic!("{file} is not a launch config")
        };
        let p = c
            .points
            .iter()
            .find(|p| p.precision == precision && p.kv_dtype == kv)
            .unwrap_or_else(|| panic!("{file}: no {precision}/{kv} point"));
        let vars = crate::config::command::command_vars(&c, p, 8123).unwrap();
        crate::config::command::render(command, &vars).unwrap()
    };
    let v = command("launch-vllm.toml", "fp8", "fp8");
    for flag in [
        "--quantization fp8",
        "--kv-cache-dtype fp8",
        "--max-num-seqs 256",
        "--kv-cache-memory-bytes 42949672960",
        "--port 8123",
    ] {
        assert!(v.contains(flag), "{flag} not in {v}");
    }
    assert!(!command("launch-vllm.toml", "bf16", "auto").contains("--quantization"));
    let s = command("launch-sglang.toml", "fp8", "fp8");
    for flag in [
        "--quantization fp8",
        "--kv-cache-dtype fp8_e4m3",
        "--max-running-requests 256",
        "--max-total-tokens 262144",
        "--enable-metrics",
    ] {
        assert!(s.contains(flag), "{flag} not in {s}");
    }
    let t = command("launch-tgi.toml", "fp8", "fp8");
    for flag in [
        "--quantize fp8",
        "--kv-cache-dtype fp8_e4m3fn",
        "--max-batch-size 256",
        "--max-batch-total-tokens 262144",
    ] {
        assert!(t.contains(flag), "{flag} not in {t}");
    }
    assert!(!command("launch-tgi.toml", "bf16", "auto").contains("kv-cache-dtype"));
}

#[test]
fn an_unmapped_matrix_value_names_the_field() {
    let text = r#"
[target]
kind = "launch"
model = "m"
command = "server {precision} --port {port}"
[target.values.precision]
bf16 = "--dtype bfloat16"
[matrix]
precisions = ["bf16", "fp8"]
batch_policies = ["continuous"]
buckets = ["8x8"]
"#;
    let e = BenchConfig::parse(text, Path::new("bench-configs/v.toml"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bench-configs/v.toml")
            && e.contains("target.values.precision")
            && e.contains("`fp8`"),
        "{e}"
    );
    // A placeholder the command does not know is caught before launch too.
    let e = BenchConfig::parse(
        &text.replace("{port}", "{prot}").replace(
            "precisions = [\"bf16\", \"fp8\"]",
            "precisions = [\"bf16\"]",
        ),
        Path::new("v.toml"),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("{prot}"), "{e}");
    // The token-sized KV pool placeholder needs target.kv_capacity_tokens.
    let e = BenchConfig::parse(
        &text
            .replace("{port}", "{port} {kv_capacity_tokens}")
            .replace(
                "precisions = [\"bf16\", \"fp8\"]",
                "precisions = [\"bf16\"]",
            ),
        Path::new("v.toml"),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("kv_capacity_tokens"), "{e}");
}

#[test]
fn every_committed_bench_config_parses() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench-configs");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "toml") {
            // Paths in the configs are relative to the repository root,
            // where they are run from; the tests run in the crate.
            let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
            let text = std::fs::read_to_string(&p).unwrap().replace(
                "\"bench-configs/",
                &format!("\"{}/bench-configs/", root.display()),
            );
            BenchConfig::parse(&text, &p).unwrap_or_else(|e| panic!("{e}"));
            n += 1;
        }
    }
    assert!(n >= 4, "{n} configs");
}
