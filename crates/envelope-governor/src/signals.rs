//! The process signals `envelope govern` answers, for both of its modes
//! (one profile, or model tiers): SIGHUP or a changed file reloads;
//! SIGTERM or Ctrl-C drains and stops.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};
use tokio::signal::unix::{signal, SignalKind};

fn mtime(p: &Path) -> Option<SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

/// Runs `reload` on SIGHUP, and within a second of a change to the
/// modification time of any file `watched` lists (listed again after each
/// reload, which may add or drop files). Never returns. Where no SIGHUP
/// handler can be installed, the files are still watched.
pub async fn reload_on_change<W, R, F>(watched: W, mut reload: R)
where
    W: Fn() -> Vec<PathBuf>,
    R: FnMut() -> F,
    F: Future<Output = ()>,
{
    let stamp = || watched().iter().map(|p| mtime(p)).collect::<Vec<_>>();
    let mut last = stamp();
    let mut hup = match signal(SignalKind::hangup()) {
        Ok(h) => Some(h),
        Err(e) => {
            tracing::warn!("no SIGHUP handler ({e}): reloading on file changes only");
            None
        }
    };
    loop {
        let tick = tokio::time::sleep(Duration::from_secs(1));
        let hupped = match hup.as_mut() {
            Some(h) => tokio::select! { _ = h.recv() => true, _ = tick => false },
            None => {
                tick.await;
                false
            }
        };
        if hupped || stamp() != last {
            reload().await;
            last = stamp();
        }
    }
}

/// Resolves on SIGTERM or Ctrl-C. A handler that cannot be installed
/// never fires (said once, as a warning), rather than stopping the
/// server at once.
pub async fn shutdown_requested() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!("no Ctrl-C handler ({e})");
            std::future::pending::<()>().await;
        }
    };
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {},
                _ = ctrl_c => {},
            }
        }
        Err(e) => {
            tracing::warn!("no SIGTERM handler ({e}): stopping on Ctrl-C only");
            ctrl_c.await;
        }
    }
}
