//! `envelope govern --record FILE`: one line per finished request, in the
//! trace format of [`envelope_profile::trace`] (no prompt text), for
//! `envelope sweep`'s `[load.trace]` and `envelope plan --workload-from`.
//!
//! Off the request path: a request's end hands a [`Finished`] to a bounded
//! channel with `try_send` and goes on. A writer thread hashes the prompt's
//! blocks, writes the line and rotates the file by size. A full channel
//! drops the record and counts it (`*_records_dropped_total`); it never
//! delays a request. The hashing is on the writer's thread because it
//! reads the whole prompt.
//!
//! Shared prefixes: a prompt of token ids is cut in blocks of
//! [`BLOCK_TOKENS`] ids, a text prompt (the messages' or prompt's text) in
//! blocks of [`BLOCK_BYTES`] bytes: finer than Mooncake's 512 tokens, so
//! a short shared system prompt and a conversation's growth show. Block `i`'s id is the first 8 bytes of
//! SHA-256(salt, id of block `i - 1`, block `i`): equal ids are equal
//! prefixes, and without the salt no guessed text can be checked against
//! them. A text block's `block_tokens` is its share of the counted prompt
//! tokens.

use crate::request::{parse_bytes, Endpoint, Prompts};
use envelope_profile::trace::{TierCall, TraceRequest};
use prometheus_client::metrics::counter::Counter;
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// Prompt tokens per block where the prompt is token ids.
pub const BLOCK_TOKENS: usize = 128;
/// Prompt bytes per block where it is text (about 128 tokens of English).
pub const BLOCK_BYTES: usize = 512;

/// Where and how the record is written.
#[derive(Debug, Clone)]
pub struct RecordSettings {
    pub path: PathBuf,
    /// The file is rotated (to `FILE.1`, the older to `FILE.2` ...) once
    /// it is past this size.
    pub max_bytes: u64,
    /// Rotated files kept.
    pub keep: u32,
    /// Finished requests waiting for the writer; past it they are dropped.
    pub capacity: usize,
    /// The deployment's secret for prefix ids.
    pub salt: Vec<u8>,
}

/// What a request is known to be when it is admitted (or refused after
/// counting): cheap to make, the body shared, not copied.
#[derive(Debug, Clone)]
pub struct Draft {
    pub arrived: Instant,
    pub arrived_unix_s: f64,
    pub endpoint: Endpoint,
    pub body: bytes::Bytes,
    pub input_tokens: u64,
    pub session: Option<String>,
    pub class: &'static str,
    pub tenant: String,
    pub feature: Option<String>,
}

impl Draft {
    /// Finished with no answer: refused or failed with `status`, its
    /// output the client's limit (what it offered to take).
    pub fn refused(self, status: u16, max_tokens: Option<u64>) -> Finished {
        Finished {
            output_tokens: max_tokens.unwrap_or(0),
            status,
            ttft_ms: None,
            e2e_ms: self.arrived.elapsed().as_secs_f64() * 1e3,
            tiers: None,
            draft: self,
        }
    }

    /// The Unix time of `arrived` (the clock read once, now).
    pub fn unix_s_of(arrived: Instant) -> f64 {
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        now - arrived.elapsed().as_secs_f64()
    }
}

/// A finished request: its draft and how it ended.
#[derive(Debug, Clone)]
pub struct Finished {
    pub draft: Draft,
    pub output_tokens: u64,
    pub status: u16,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: f64,
    pub tiers: Option<TierCall>,
}

enum Message {
    Record(Box<Finished>),
    /// Answered once everything sent before it is written and flushed.
    Flush(SyncSender<()>),
}

/// The recorder: the channel's sending end and its counters.
pub struct Recorder {
    tx: SyncSender<Message>,
    written: Counter,
    dropped: Counter,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("written", &self.written.get())
            .field("dropped", &self.dropped.get())
            .finish()
    }
}

impl Recorder {
    /// Opens (appends to) the file and starts the writer; `written` and
    /// `dropped` are the `/metrics` counters it bumps.
    ///
    /// # Errors
    /// The file cannot be opened for appending.
    pub fn start(
        settings: RecordSettings,
        written: Counter,
        dropped: Counter,
    ) -> std::io::Result<Arc<Recorder>> {
        let file = open(&settings.path)?;
        let (tx, rx) = std::sync::mpsc::sync_channel(settings.capacity.max(1));
        let w = written.clone();
        let writer = std::thread::Builder::new()
            .name("envelope-record".into())
            .spawn(move || write_loop(rx, file, &settings, &w))?;
        Ok(Arc::new(Recorder {
            tx,
            written,
            dropped,
            writer: Mutex::new(Some(writer)),
        }))
    }

    /// [`Recorder::start`] with `settings` where there are some (`--record`
    /// given), logged.
    ///
    /// # Errors
    /// The file cannot be opened for appending.
    pub fn start_if(
        settings: Option<RecordSettings>,
        written: &Counter,
        dropped: &Counter,
    ) -> Result<Option<Arc<Recorder>>, crate::error::StartError> {
        let Some(rs) = settings else {
            return Ok(None);
        };
        let path = rs.path.display().to_string();
        let r = Recorder::start(rs, written.clone(), dropped.clone())
            .map_err(|e| crate::error::StartError::Invalid(format!("--record {path}: {e}")))?;
        tracing::info!("recording finished requests to {path}");
        Ok(Some(r))
    }

    /// Hands `f` to the writer, or drops and counts it when the channel
    /// is full. Never waits.
    pub fn record(&self, f: Finished) {
        match self.tx.try_send(Message::Record(Box::new(f))) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.dropped.inc();
            }
        }
    }

    /// Waits (up to `timeout`) until everything recorded before is written
    /// and flushed; false when it was not in time.
    pub fn flush(&self, timeout: Duration) -> bool {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let deadline = Instant::now() + timeout;
        let mut msg = Message::Flush(tx);
        loop {
            match self.tx.try_send(msg) {
                Ok(()) => break,
                Err(TrySendError::Full(m)) if Instant::now() < deadline => {
                    msg = m;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(_) => return false,
            }
        }
        rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .is_ok()
    }

    pub fn written(&self) -> u64 {
        self.written.get()
    }

    pub fn dropped(&self) -> u64 {
        self.dropped.get()
    }

    /// A recorder whose writer is stalled until the returned sender is
    /// dropped or sent to: for tests of a full channel.
    #[cfg(test)]
    pub(crate) fn stalled(capacity: usize) -> (Arc<Recorder>, SyncSender<()>, Receiver<()>) {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Message>(capacity);
        let (go_tx, go_rx) = std::sync::mpsc::sync_channel::<()>(1);
        let (done_tx, done_rx) = std::sync::mpsc::sync_channel::<()>(1);
        let writer = std::thread::spawn(move || {
            let _ = go_rx.recv();
            while let Ok(m) = rx.recv() {
                if let Message::Flush(t) = m {
                    let _ = t.send(());
                }
            }
            let _ = done_tx.send(());
        });
        let r = Recorder {
            tx,
            written: Counter::default(),
            dropped: Counter::default(),
            writer: Mutex::new(Some(writer)),
        };
        (Arc::new(r), go_tx, done_rx)
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        // The writer ends when the last sender is gone; it has then
        // written and flushed everything.
        let handle = self.writer.lock().unwrap_or_else(|e| e.into_inner()).take();
        let (tx, _) = std::sync::mpsc::sync_channel(0);
        drop(std::mem::replace(&mut self.tx, tx));
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

fn open(path: &Path) -> std::io::Result<std::io::BufWriter<std::fs::File>> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    Ok(std::io::BufWriter::with_capacity(1 << 16, f))
}

/// `FILE` -> `FILE.1` -> `FILE.2` ..., the oldest past `keep` removed.
fn rotate(path: &Path, keep: u32) -> std::io::Result<()> {
    let numbered = |i: u32| {
        let mut p = path.as_os_str().to_owned();
        p.push(format!(".{i}"));
        PathBuf::from(p)
    };
    if keep == 0 {
        return std::fs::remove_file(path);
    }
    let _ = std::fs::remove_file(numbered(keep));
    for i in (1..keep).rev() {
        let _ = std::fs::rename(numbered(i), numbered(i + 1));
    }
    std::fs::rename(path, numbered(1))
}

fn write_loop(
    rx: Receiver<Message>,
    mut out: std::io::BufWriter<std::fs::File>,
    s: &RecordSettings,
    written: &Counter,
) {
    let mut size = out.get_ref().metadata().map_or(0, |m| m.len());
    let mut line = Vec::with_capacity(512);
    let mut failed = false;
    loop {
        // Flush when the channel goes quiet, so a reader sees whole lines
        // soon and a busy writer does not flush every line.
        let m = match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(m) => m,
            Err(RecvTimeoutError::Timeout) => {
                let _ = out.flush();
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => break,
        };
        let f = match m {
            Message::Record(f) => f,
            Message::Flush(done) => {
                let _ = out.flush();
                let _ = done.send(());
                continue;
            }
        };
        line.clear();
        if serde_json::to_writer(&mut line, &trace_line(&f, &s.salt)).is_err() {
            continue;
        }
        line.push(b'\n');
        match out.write_all(&line) {
            Ok(()) => {
                written.inc();
                size += line.len() as u64;
                failed = false;
            }
            Err(e) => {
                if !failed {
                    tracing::error!("--record {}: {e}; records are lost", s.path.display());
                }
                failed = true;
            }
        }
        if size >= s.max_bytes {
            let _ = out.flush();
            let reopened = rotate(&s.path, s.keep).and_then(|()| open(&s.path));
            match reopened {
                Ok(o) => {
                    out = o;
                    size = 0;
                }
                Err(e) => tracing::error!("--record {}: rotating: {e}", s.path.display()),
            }
        }
    }
    let _ = out.flush();
}

/// The trace record of a finished request (its prefix ids hashed now).
pub fn trace_line(f: &Finished, salt: &[u8]) -> TraceRequest {
    let d = &f.draft;
    let mut r = TraceRequest::new(
        (d.arrived_unix_s * 1e3).round() / 1e3,
        d.input_tokens.min(u64::from(u32::MAX)) as u32,
        f.output_tokens.min(u64::from(u32::MAX)) as u32,
    );
    let parsed = parse_bytes(d.endpoint, d.body.clone()).ok();
    if let Some(p) = &parsed {
        (r.prefix_blocks, r.block_tokens) = prefix_blocks(&p.prompts, d.input_tokens, salt);
        r.model = p
            .body()
            .get("model")
            .and_then(|m| m.as_str())
            .map(str::to_string);
        r.stream = Some(p.stream);
    }
    r.session = d.session.clone();
    r.class = Some(d.class.to_string());
    r.tenant = Some(d.tenant.clone());
    r.feature = d.feature.clone();
    r.status = Some(f.status);
    r.ttft_ms = f.ttft_ms.map(|v| (v * 1e3).round() / 1e3);
    r.e2e_ms = Some((f.e2e_ms * 1e3).round() / 1e3);
    r.tiers = f.tiers.clone();
    r
}

/// Chained, salted block ids of the first prompt (a request of several
/// prompts is recorded by its first), and the tokens a block spans.
pub fn prefix_blocks(prompts: &Prompts, input_tokens: u64, salt: &[u8]) -> (Vec<u64>, Option<u32>) {
    let tokens_per_block = matches!(prompts, Prompts::Tokens(_)).then_some(BLOCK_TOKENS as u32);
    let block = match tokens_per_block {
        Some(t) => t as usize * 4,
        None => BLOCK_BYTES,
    };
    let Some(bytes) = prompts.group_bytes().into_iter().next() else {
        return (vec![], None);
    };
    if bytes.is_empty() {
        return (vec![], None);
    }
    let mut ids = Vec::with_capacity(bytes.len().div_ceil(block));
    let mut prev = [0u8; 8];
    for chunk in bytes.chunks(block) {
        let mut h = Sha256::new();
        h.update((salt.len() as u64).to_le_bytes());
        h.update(salt);
        h.update(prev);
        h.update(chunk);
        let d = h.finalize();
        prev.copy_from_slice(&d[..8]);
        ids.push(u64::from_le_bytes(prev));
    }
    // A text block spans its share of the counted tokens.
    let per_block = tokens_per_block.unwrap_or_else(|| {
        let share = input_tokens as f64 * block as f64 / bytes.len() as f64;
        (share.round() as u32).max(1)
    });
    (ids, Some(per_block))
}

/// The salt from `ENVELOPE_RECORD_SALT`, else a random one for this run
/// (prefix ids then match only within it).
pub fn salt_from_env() -> Vec<u8> {
    match std::env::var("ENVELOPE_RECORD_SALT") {
        Ok(s) if !s.is_empty() => s.into_bytes(),
        _ => {
            tracing::warn!("--record: ENVELOPE_RECORD_SALT is not set; prefix ids are salted with a random value and match only within this run");
            let v: [u8; 16] = rand::random();
            v.to_vec()
        }
    }
}

#[cfg(test)]
mod tests;
