//! The `launch` target: start a server per configuration from a command
//! template, wait until it answers, capture its log, notice when it dies,
//! and stop it (SIGTERM to its process group, SIGKILL after a grace period).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A free loopback port (bound, then released for the server to take).
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

pub struct LaunchedServer {
    child: Child,
    pub command: String,
    pub log_path: PathBuf,
    pub base_url: String,
    /// From the start of the command to its first 2xx on the ready path:
    /// the server's cold start (provisioning lead time, less the node's).
    pub time_to_ready: Duration,
}

impl LaunchedServer {
    /// Starts `command` under `sh -c` in its own process group, stdout and
    /// stderr to `log_path`, and waits until `GET {base_url}{ready_path}`
    /// answers 2xx. A server that exits first, or is not ready in time, is
    /// an error carrying the end of its log.
    pub fn start(
        command: &str,
        base_url: &str,
        ready_path: &str,
        ready_timeout: Duration,
        log_path: &Path,
    ) -> Result<LaunchedServer, String> {
        if let Some(dir) = log_path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        let log =
            std::fs::File::create(log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
        let log2 = log.try_clone().map_err(|e| e.to_string())?;
        use std::os::unix::process::CommandExt;
        let started = Instant::now();
        let child = Command::new("sh")
            .arg("-c")
            .arg(format!("exec {command}"))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .process_group(0)
            .spawn()
            .map_err(|e| format!("cannot start `{command}`: {e}"))?;
        let mut server = LaunchedServer {
            child,
            command: command.to_string(),
            log_path: log_path.to_path_buf(),
            base_url: base_url.trim_end_matches('/').to_string(),
            time_to_ready: Duration::ZERO,
        };
        let client = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| e.to_string())?;
        let url = format!("{}{ready_path}", server.base_url);
        let deadline = Instant::now() + ready_timeout;
        loop {
            if let Some(status) = server.exited() {
                let tail = server.log_tail(20);
                return Err(format!(
                    "`{command}` exited ({status}) before it was ready; log {}:\n{tail}",
                    log_path.display()
                ));
            }
            if client
                .get(&url)
                .send()
                .is_ok_and(|r| r.status().is_success())
            {
                server.time_to_ready = started.elapsed();
                return Ok(server);
            }
            if Instant::now() > deadline {
                let tail = server.log_tail(20);
                server.stop(Duration::from_secs(5));
                return Err(format!(
                    "`{command}` was not ready at {url} within {} s; log {}:\n{tail}",
                    ready_timeout.as_secs(),
                    log_path.display()
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status, once the server has died.
    pub fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(s)) => Some(s.to_string()),
            Ok(None) => None,
            Err(e) => Some(format!("wait failed: {e}")),
        }
    }

    /// The last `n` lines of the server's log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log_path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Whether the log says the server ran out of memory.
    pub fn log_says_oom(&self) -> bool {
        let t = self.log_tail(200).to_ascii_lowercase();
        [
            "out of memory",
            "outofmemory",
            "oom",
            "cuda_error_out_of_memory",
        ]
        .iter()
        .any(|k| t.contains(k))
    }

    /// SIGTERM to the process group, then SIGKILL after `grace`.
    pub fn stop(&mut self, grace: Duration) {
        if self.exited().is_some() {
            return;
        }
        let pgid = self.child.id() as i32;
        // SAFETY: kill(2) on a process group we created; no memory is touched.
        unsafe { libc::kill(-pgid, libc::SIGTERM) };
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if self.exited().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // SAFETY: as above.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

impl Drop for LaunchedServer {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_that_dies_before_ready_is_an_error_with_its_log() {
        let dir = std::env::temp_dir().join(format!("envelope-launch-{}", std::process::id()));
        let port = free_port().unwrap();
        let e = LaunchedServer::start(
            "echo starting; echo 'CUDA out of memory' >&2; exit 3",
            &format!("http://127.0.0.1:{port}"),
            "/health",
            Duration::from_secs(10),
            &dir.join("dies.log"),
        )
        .err()
        .unwrap();
        assert!(e.contains("exited") && e.contains("out of memory"), "{e}");
    }

    #[test]
    fn a_server_that_never_answers_times_out_and_is_stopped() {
        let dir = std::env::temp_dir().join(format!("envelope-launch-{}", std::process::id()));
        let port = free_port().unwrap();
        let t0 = Instant::now();
        let e = LaunchedServer::start(
            "sleep 30",
            &format!("http://127.0.0.1:{port}"),
            "/health",
            Duration::from_secs(1),
            &dir.join("sleeps.log"),
        )
        .err()
        .unwrap();
        assert!(e.contains("not ready"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(20));
    }
}
