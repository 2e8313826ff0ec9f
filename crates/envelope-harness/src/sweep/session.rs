//! Opening a configuration's target for load: the embedded engine loaded
//! here, a running server over HTTP, or a server launched per
//! configuration; each checked and measured at rest before the sweep.

use crate::check::check_server;
use crate::config::command::{command_vars, render};
use crate::config::{BenchConfig, EnginePoint, MatrixPoint, Target};
use crate::driver::{EngineDriver, HttpDriver, HttpSettings, PromptFormat};
use crate::launch::{free_port, LaunchedServer};
use crate::record::Driver;
use envelope_engine::{
    Engine, EngineHandle, EngineSettings, KvBudget, LoadOptions, Placement, Precision,
    SchedulerConfig,
};
use envelope_profile::{Constraint, MemoryReport, ServerChecks};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

fn bytes_per_param(p: Precision) -> Option<f64> {
    match p {
        Precision::F32 => Some(4.0),
        Precision::F16 | Precision::Bf16 => Some(2.0),
        Precision::Q8_0 => Some(34.0 / 32.0),
        Precision::Q4_0 => Some(18.0 / 32.0),
        Precision::Fp8 => None,
        Precision::AsStored => None,
    }
}

/// A configuration's server, ready for load.
pub(super) struct Session {
    pub(super) driver: Arc<dyn Driver>,
    pub(super) engine: Option<EngineHandle>,
    pub(super) server: Option<LaunchedServer>,
    pub(super) memory: MemoryReport,
    /// http and launch targets: what one request alone showed of the server.
    pub(super) checks: Option<ServerChecks>,
}

impl Session {
    pub(super) fn close(self) {
        if let Some(e) = &self.engine {
            // Wait: the next point's load must see this one's memory freed.
            e.shutdown_and_wait();
        }
        drop(self.server);
    }

    /// Whether a launched server has died; `Oom` when its log says so.
    pub(super) fn died(&mut self) -> Option<Constraint> {
        let server = self.server.as_mut()?;
        server.exited()?;
        Some(if server.log_says_oom() {
            Constraint::Oom
        } else {
            Constraint::Crash
        })
    }
}

fn open_engine(cfg: &BenchConfig, e: &EnginePoint) -> Result<Session, String> {
    let rss = || envelope_telemetry::host::sample(None).process_rss_bytes;
    let rss_before = rss();
    let placement: Placement = cfg
        .device
        .as_deref()
        .unwrap_or("cpu")
        .parse()
        .map_err(|err| format!("target.device: {err}"))?;
    let ecfg = EngineSettings {
        kv_dtype: e.kv_dtype,
        kv_budget: KvBudget::Bytes(cfg.kv_cache_bytes),
        block_size: cfg.block_size,
        scheduler: SchedulerConfig {
            policy: e.policy,
            max_num_seqs: cfg.max_num_seqs as usize,
            max_num_batched_tokens: cfg.max_num_batched_tokens,
            chunked_prefill: true,
            ..SchedulerConfig::default()
        },
        max_model_len: None,
    };
    let opts = LoadOptions {
        precision: e.precision,
        tokenizer: None,
    };
    let load_failed = |err: envelope_engine::EngineError| format!("load failed: {err}");
    let start_failed = |err: envelope_engine::EngineError| format!("engine start failed: {err}");
    // Host memory is measured around the weights alone (the KV pool comes
    // after); on CUDA the weights are in device memory, reported by NVML.
    let (built, template, resident_after_load_bytes, source) = match placement {
        Placement::Cpu => {
            let loaded = envelope_engine::load(&cfg.model, &opts).map_err(load_failed)?;
            let resident = rss()
                .zip(rss_before)
                .map(|(after, before)| after.saturating_sub(before));
            let template = Arc::new(loaded.chat_template);
            let engine = Engine::new(loaded.model, Arc::new(loaded.tokenizer), loaded.info, &ecfg)
                .map_err(start_failed)?;
            (engine, template, resident, "engine")
        }
        Placement::Cuda { ordinal } => {
            let loaded =
                envelope_engine::load_cuda(&cfg.model, &opts, ordinal).map_err(load_failed)?;
            let template = Arc::new(loaded.chat_template);
            let engine =
                Engine::new_cuda(loaded.model, Arc::new(loaded.tokenizer), loaded.info, &ecfg)
                    .map_err(start_failed)?;
            (engine, template, None, "engine-cuda")
        }
    };
    let params = built.info.model.weights.num_parameters as f64;
    let weight_bytes = built.info.model.weights.total_bytes as u64;
    let weight_bytes_analytic = match e.precision {
        // Layer matrices at 1 byte, embedding and LM head at 2.
        Precision::Fp8 => {
            envelope_engine::cuda::weight_bytes(&built.info.model.config, Precision::Fp8) as u64
        }
        p => bytes_per_param(p).map_or(weight_bytes, |b| (params * b) as u64),
    };
    let engine = EngineHandle::spawn_engine(built, template)
        .map_err(|err| format!("engine start failed: {err}"))?;
    let memory = MemoryReport {
        weight_bytes,
        weight_bytes_analytic,
        kv_bytes_per_token: engine.info.kv_bytes_per_token as u64,
        kv_capacity_tokens: engine.info.kv_capacity_tokens as u64,
        peak_bytes: None,
        resident_after_load_bytes,
        source: Some(source.into()),
    };
    Ok(Session {
        driver: Arc::new(EngineDriver {
            engine: engine.clone(),
        }),
        engine: Some(engine),
        server: None,
        memory,
        checks: None,
    })
}

fn http_driver(cfg: &BenchConfig, base_url: &str) -> Result<HttpDriver, String> {
    let h = &cfg.http;
    HttpDriver::new(HttpSettings {
        base_url: base_url.to_string(),
        model: cfg.model.clone(),
        metrics_url: h
            .metrics_url
            .as_ref()
            .map(|u| u.replace("{base_url}", base_url.trim_end_matches('/'))),
        vocab_size: h.vocab_size,
        prompt_format: if h.text_prompts {
            PromptFormat::Text
        } else {
            PromptFormat::Tokens
        },
        extra_body: h.extra_body.clone(),
        request_timeout: Duration::from_secs(h.request_timeout_s),
    })
}

/// Memory before traffic: the GPU's (NVML) when there is one, else the
/// launched server's RSS.
fn memory_at_rest(pid: Option<u32>, gpu_used_before: Option<u64>) -> MemoryReport {
    let nvml = envelope_telemetry::Nvml::init().ok();
    let gpu_used = nvml
        .as_ref()
        .filter(|n| n.device_count() > 0)
        .and_then(|n| n.sample(0, None).memory_used_bytes);
    let (bytes, source) = match (gpu_used, pid) {
        (Some(u), _) => (Some(u.saturating_sub(gpu_used_before.unwrap_or(0))), "nvml"),
        (None, Some(pid)) => (
            envelope_telemetry::host::sample(Some(pid)).process_rss_bytes,
            "process_rss",
        ),
        (None, None) => (None, "none"),
    };
    // Weights alone cannot be told apart from the server's other memory.
    MemoryReport {
        resident_after_load_bytes: bytes,
        source: Some(source.into()),
        ..Default::default()
    }
}

/// The KV figures a server states of itself (vLLM's `cache_config_info`,
/// TGI's and envelope's gauges): capacity (the configured one first) and
/// bytes a token; 0 (unknown) where it states none.
fn fill_server_kv(cfg: &BenchConfig, driver: &HttpDriver, memory: &mut MemoryReport) {
    let state = driver.metrics();
    let stated = |v: Option<f64>| v.filter(|v| *v > 0.0).map(|v| v.round() as u64);
    memory.kv_capacity_tokens = cfg
        .http
        .kv_capacity_tokens
        .or_else(|| stated(state.as_ref()?.kv_capacity_tokens))
        .unwrap_or(0);
    memory.kv_bytes_per_token =
        stated(state.as_ref().and_then(|s| s.kv_bytes_per_token)).unwrap_or(0);
}

fn open_launch(
    cfg: &BenchConfig,
    point: &MatrixPoint,
    t: (&str, &str, &str, u64),
    log_dir: &Path,
    attempt: u32,
) -> Result<Session, String> {
    let (command, base_url, ready_path, ready_timeout_s) = t;
    let port = free_port().map_err(|e| format!("no free port: {e}"))?;
    let vars = command_vars(cfg, point, port)?;
    let base_url = render(base_url, &vars)?;
    let command = render(command, &vars)?;
    let gpu_before = envelope_telemetry::Nvml::init()
        .ok()
        .filter(|n| n.device_count() > 0)
        .and_then(|n| n.sample(0, None).memory_used_bytes);
    let log = log_dir.join(format!("{}.{attempt}.log", point.name()));
    let mut server = LaunchedServer::start(
        &command,
        &base_url,
        ready_path,
        Duration::from_secs(ready_timeout_s),
        &log,
    )?;
    let mut driver = http_driver(cfg, &base_url)?;
    driver.pid = Some(server.pid());
    let mut memory = memory_at_rest(Some(server.pid()), gpu_before);
    fill_server_kv(cfg, &driver, &mut memory);
    let checks = match check_server(&mut driver, cfg.http.tokenizer.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            server.stop(Duration::from_secs(5));
            return Err(format!("server check failed: {e}"));
        }
    };
    Ok(Session {
        driver: Arc::new(driver),
        engine: None,
        memory,
        server: Some(server),
        checks: Some(checks),
    })
}

pub(super) fn open(
    cfg: &BenchConfig,
    point: &MatrixPoint,
    log_dir: &Path,
    attempt: u32,
) -> Result<Session, String> {
    match &cfg.target {
        Target::Engine => match &point.engine {
            Some(e) => open_engine(cfg, e),
            None => Err("the engine target needs engine settings".into()),
        },
        Target::Http { base_url } => {
            let mut driver = http_driver(cfg, base_url)?;
            let mut memory = memory_at_rest(None, None);
            fill_server_kv(cfg, &driver, &mut memory);
            let checks = check_server(&mut driver, cfg.http.tokenizer.as_deref())
                .map_err(|e| format!("server check failed: {e}"))?;
            Ok(Session {
                driver: Arc::new(driver),
                engine: None,
                server: None,
                memory,
                checks: Some(checks),
            })
        }
        Target::Launch {
            command,
            base_url,
            ready_path,
            ready_timeout_s,
            ..
        } => open_launch(
            cfg,
            point,
            (command, base_url, ready_path, *ready_timeout_s),
            log_dir,
            attempt,
        ),
    }
}
