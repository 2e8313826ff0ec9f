//! The engine on its own thread: the command loop and the handle the
//! server, the harness and the CLI hold.

use super::{Engine, EngineInfo, EngineMetrics, Event, FinishReason, GenerateRequest};
use crate::chat::ChatTemplate;
use crate::error::{EngineError, Result};
use crate::load::LoadedModel;
use crate::settings::{EngineSettings, Placement};
use crate::tokenizer::TextTokenizer;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

enum Command {
    Submit(GenerateRequest, UnboundedSender<Event>),
    Shutdown,
}

/// Takes commands, steps while there is work, sleeps on the channel when idle.
fn run_loop(engine: &mut Engine, rx: mpsc::Receiver<Command>) {
    // false: stop.
    let handle = |engine: &mut Engine, cmd: Command| -> bool {
        match cmd {
            Command::Submit(req, tx) => {
                if let Err(e) = engine.add_request(req, tx.clone()) {
                    let _ = tx.send(Event::Error(e.to_string()));
                }
                true
            }
            Command::Shutdown => false,
        }
    };
    loop {
        if !engine.has_work() {
            match rx.recv() {
                Ok(cmd) => {
                    if !handle(engine, cmd) {
                        return;
                    }
                }
                Err(_) => return,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(cmd) => {
                    if !handle(engine, cmd) {
                        return;
                    }
                }
                Err(mpsc::TryRecvError::Disconnected) => return,
                Err(mpsc::TryRecvError::Empty) => break,
            }
        }
        // Static batching: let requests sent together arrive before the
        // batch forms (TGI waits for its batch in a similar way).
        let wait = Duration::from_millis(engine.info.scheduler.static_batch_wait_ms);
        while !wait.is_zero() && engine.scheduler.forming_static_batch() {
            match rx.recv_timeout(wait) {
                Ok(cmd) => {
                    if !handle(engine, cmd) {
                        return;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => break,
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
        }
        engine.reap_disconnected();
        if engine.has_work() {
            if let Err(e) = engine.step_guarded() {
                tracing::error!("engine step failed: {e}");
            }
        }
    }
}

/// A cloneable handle to an engine running on its own thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    /// The engine thread, joined by [`EngineHandle::shutdown_and_wait`].
    thread: Arc<Mutex<Option<std::thread::JoinHandle<()>>>>,
    pub info: Arc<EngineInfo>,
    pub metrics: Arc<EngineMetrics>,
    pub tokenizer: Arc<TextTokenizer>,
    pub chat_template: Arc<ChatTemplate>,
}

impl EngineHandle {
    pub fn spawn(loaded: LoadedModel, cfg: &EngineSettings) -> Result<EngineHandle> {
        let tokenizer = Arc::new(loaded.tokenizer);
        let engine = Engine::new(loaded.model, tokenizer, loaded.info, cfg)?;
        Self::spawn_engine(engine, Arc::new(loaded.chat_template))
    }

    /// Loads `spec` where `placement` says and runs the engine on its thread.
    pub fn load_and_spawn(
        spec: &str,
        opts: &crate::load::LoadOptions,
        placement: Placement,
        cfg: &EngineSettings,
    ) -> Result<EngineHandle> {
        let (engine, template) = Engine::load(spec, opts, placement, cfg)?;
        Self::spawn_engine(engine, template)
    }

    /// Runs a built engine on its own thread.
    pub fn spawn_engine(
        mut engine: Engine,
        chat_template: Arc<ChatTemplate>,
    ) -> Result<EngineHandle> {
        let tokenizer = engine.tokenizer.clone();
        let info = Arc::new(engine.info.clone());
        let metrics = engine.metrics.clone();
        let (tx, rx) = mpsc::channel::<Command>();
        let thread = std::thread::Builder::new()
            .name("envelope-engine".into())
            .spawn(move || {
                // The loop runs on a worker of its own rayon pool, so each
                // parallel region of a step starts on this thread instead of
                // being handed to the pool and waited for (two context
                // switches per region, hundreds of regions per step):
                // measured 1.6x decode tokens/s on 2 cores.
                match rayon::ThreadPoolBuilder::new()
                    .thread_name(|i| format!("envelope-compute-{i}"))
                    .build()
                {
                    Ok(pool) => pool.install(move || run_loop(&mut engine, rx)),
                    Err(_) => run_loop(&mut engine, rx),
                }
            })
            .map_err(|e| EngineError::InvalidSetting {
                field: "engine",
                message: format!("cannot start the engine thread: {e}"),
            })?;
        Ok(EngineHandle {
            tx,
            thread: Arc::new(Mutex::new(Some(thread))),
            info,
            metrics,
            tokenizer,
            chat_template,
        })
    }

    /// Submits a request. Invalid requests fail here, before queueing.
    pub fn submit(&self, req: GenerateRequest) -> Result<UnboundedReceiver<Event>> {
        Engine::validate(&self.info, req.prompt_tokens.len(), &req.params)?;
        let (tx, rx) = unbounded_channel();
        self.tx
            .send(Command::Submit(req, tx))
            .map_err(|_| EngineError::ShutDown)?;
        Ok(rx)
    }

    /// Generates to completion (blocking): the output ids, the text and the
    /// finish reason. For tests, benchmarks and the CLI.
    pub fn generate_blocking(&self, req: GenerateRequest) -> Result<Generated> {
        let mut rx = self.submit(req)?;
        let mut out = Generated::default();
        while let Some(ev) = rx.blocking_recv() {
            match ev {
                Event::Token { id, text, .. } => {
                    out.tokens.push(id);
                    out.text.push_str(&text);
                }
                Event::Done {
                    reason,
                    preemptions,
                    ..
                } => {
                    out.finish_reason = Some(reason);
                    out.preemptions = preemptions;
                    return Ok(out);
                }
                Event::Error(e) => {
                    return Err(EngineError::InvalidRequest {
                        param: "request",
                        message: e,
                    })
                }
            }
        }
        Err(EngineError::ShutDown)
    }

    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }

    /// Shuts the engine down and waits until its thread has ended, so its
    /// model and KV pool are freed (GPU memory included) when this returns.
    pub fn shutdown_and_wait(&self) {
        self.shutdown();
        let thread = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

#[derive(Debug, Default, Clone)]
pub struct Generated {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish_reason: Option<FinishReason>,
    pub preemptions: u32,
}
