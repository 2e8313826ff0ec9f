//! Runs `envelope serve` on a free loopback port for a test and stops it on drop.
#![allow(dead_code)]

pub mod redis;
pub mod scrape;
pub mod tiers;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn smollm2() -> String {
    if let Ok(p) = std::env::var("ENVELOPE_TEST_MODEL") {
        return p;
    }
    let p =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-model.sh first",
        p.display()
    );
    p.display().to_string()
}

/// A series' value (`name` or `name{labels}`) in the Prometheus text at
/// `url`, and the text.
pub async fn sample(url: &str, series: &str) -> (Option<f64>, String) {
    let text = reqwest::get(url).await.unwrap().text().await.unwrap();
    let v = text
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.trim().parse::<f64>().unwrap());
    (v, text)
}

pub struct Server {
    child: Child,
    pub base: String,
}

impl Server {
    pub fn start(args: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_envelope"))
            .arg("serve")
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .env("ENVELOPE_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("envelope binary runs");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(url) = line.strip_prefix("envelope serve listening on ") {
                    let _ = tx.send(url.to_string());
                }
            }
        });
        let base = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("server started within 120 s");
        Server { child, base }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// The value of an unlabelled sample in `/metrics`.
    pub async fn metric(&self, name: &str) -> f64 {
        let (value, text) = sample(&self.url("/metrics"), name).await;
        value.unwrap_or_else(|| panic!("{name} not in /metrics:\n{text}"))
    }

    /// Polls until `f` is true or `timeout` passes.
    pub async fn wait_for<F: Fn(f64) -> bool>(&self, name: &str, timeout: Duration, f: F) -> f64 {
        let start = Instant::now();
        loop {
            let v = self.metric(name).await;
            if f(v) || start.elapsed() > timeout {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `envelope serve`'s app in this process on a free loopback port, on
/// `dummy:tiny` with a KV pool of `kv_bytes`, whose every step also sleeps
/// `ms_per_seq` ms per sequence it computes: a slower, compute-bound
/// server (latency grows with the batch). The server has no such switch;
/// the step runner is wrapped here, as a test of a slow device would.
pub struct SlowServer {
    pub base: String,
    handle: envelope_engine::engine::EngineHandle,
    task: tokio::task::JoinHandle<()>,
}

struct SleepingSteps {
    inner: Box<dyn envelope_engine::engine::StepRunner>,
    ms_per_seq: u64,
}

impl envelope_engine::engine::StepRunner for SleepingSteps {
    fn forward(
        &mut self,
        chunks: &[envelope_engine::model::SeqChunk],
    ) -> envelope_engine::Result<Vec<Vec<f32>>> {
        std::thread::sleep(Duration::from_millis(self.ms_per_seq * chunks.len() as u64));
        self.inner.forward(chunks)
    }
}

impl SlowServer {
    pub async fn start(kv_bytes: usize, max_num_seqs: usize, ms_per_seq: u64) -> SlowServer {
        SlowServer::start_named("", kv_bytes, max_num_seqs, ms_per_seq).await
    }

    /// As [`SlowServer::start`], serving the model as `name` (the model's
    /// own name when empty).
    pub async fn start_named(
        name: &str,
        kv_bytes: usize,
        max_num_seqs: usize,
        ms_per_seq: u64,
    ) -> SlowServer {
        use envelope_engine::engine::{Engine, EngineHandle};
        use envelope_engine::settings::{EngineSettings, KvBudget, Placement};
        let opts = envelope_engine::LoadOptions {
            precision: envelope_engine::Precision::F32,
            tokenizer: None,
        };
        let mut cfg = EngineSettings {
            kv_budget: KvBudget::Bytes(kv_bytes),
            ..EngineSettings::default()
        };
        cfg.scheduler.max_num_seqs = max_num_seqs;
        let (engine, template) = Engine::load("dummy:tiny", &opts, Placement::Cpu, &cfg).unwrap();
        let engine = engine.wrap_runner(|inner| Box::new(SleepingSteps { inner, ms_per_seq }));
        let handle = EngineHandle::spawn_engine(engine, template).unwrap();
        let name = match name {
            "" => handle.info.model.name.clone(),
            n => n.to_string(),
        };
        let state = envelope_server::AppState::new(handle.clone(), name);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, envelope_server::app(state)).await;
        });
        SlowServer { base, handle, task }
    }
}

impl Drop for SlowServer {
    fn drop(&mut self) {
        self.task.abort();
        self.handle.shutdown();
    }
}

/// `envelope govern` on a free loopback port in front of `upstream`, its
/// stderr kept in `dir/govern.log` (start-up lines, warnings); stopped on
/// drop.
pub struct Governor {
    pub child: Child,
    pub base: String,
    log: PathBuf,
}

impl Governor {
    pub fn start(dir: &Path, profile: &Path, upstream: &str, extra: &[&str]) -> Governor {
        let mut args = vec![
            "--profile",
            profile.to_str().unwrap(),
            "--upstream",
            upstream,
        ];
        args.extend_from_slice(extra);
        Governor::launch(dir, &args)
    }

    /// `envelope govern` with `args` (besides a free loopback port and
    /// `--on-mismatch ignore`).
    pub fn launch(dir: &Path, args: &[&str]) -> Governor {
        let mut all = args.to_vec();
        all.extend(["--on-mismatch", "ignore"]);
        Governor::launch_as_is(dir, &all)
    }

    /// `envelope govern --profile --upstream` and every other setting at
    /// its default (mismatch handling included), as a new user starts it.
    pub fn start_with_defaults(dir: &Path, profile: &Path, upstream: &str) -> Governor {
        let args = [
            "--profile",
            profile.to_str().unwrap(),
            "--upstream",
            upstream,
        ];
        Governor::launch_as_is(dir, &args)
    }

    /// `envelope govern` with `args` and a free loopback port.
    fn launch_as_is(dir: &Path, args: &[&str]) -> Governor {
        let log = dir.join("govern.log");
        let mut child = Command::new(env!("CARGO_BIN_EXE_envelope"))
            .arg("govern")
            .args(args)
            .args(["--listen", "127.0.0.1:0"])
            .env("ENVELOPE_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("envelope govern runs");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(url) = line.strip_prefix("envelope govern listening on ") {
                    let _ = tx.send(url.to_string());
                }
            }
        });
        let base = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("governor started within 120 s");
        Governor { child, base, log }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// A series' value in the governor's `/metrics` (0 when absent: a
    /// counter never bumped is not written).
    pub async fn metric(&self, series: &str) -> f64 {
        sample(&self.url("/metrics"), series).await.0.unwrap_or(0.0)
    }

    /// The governor's whole `/metrics` page.
    pub async fn metrics_page(&self) -> String {
        let r = reqwest::get(self.url("/metrics")).await.unwrap();
        r.text().await.unwrap()
    }

    /// What the governor wrote to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub async fn state(&self) -> serde_json::Value {
        reqwest::get(self.url("/admin/state"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// Polls `/admin/state` until `f` holds; panics after `timeout`, a hang
    /// guard, not a speed bound.
    pub async fn wait_state<F: Fn(&serde_json::Value) -> bool>(
        &self,
        timeout: Duration,
        f: F,
    ) -> serde_json::Value {
        let start = Instant::now();
        loop {
            let st = self.state().await;
            if f(&st) {
                return st;
            }
            assert!(start.elapsed() < timeout, "state never matched: {st}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok);
    }
}

impl Drop for Governor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fresh directory under the system temp dir for one test.
pub fn temp_dir(prefix: &str, name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("{prefix}-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The lines of `path` once there are at least `n` (a writer off the
/// request path flushes when it goes quiet), or what there is after 20 s.
pub async fn lines_when(path: &Path, n: usize) -> Vec<String> {
    let mut lines = vec![];
    for _ in 0..200 {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        // Whole lines only: a line the writer is still writing is not one.
        let whole = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
        lines = whole.lines().map(str::to_string).collect();
        if lines.len() >= n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    lines
}
