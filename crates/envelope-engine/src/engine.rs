//! The engine: a step loop on its own thread that owns the model, the KV
//! pool and the scheduler. Callers submit token ids with sampling
//! parameters and get a channel of events back; dropping the receiver
//! aborts the sequence and frees its blocks at the next step boundary.

use crate::chat::ChatTemplate;
use crate::error::{EngineError, Result};
use crate::kv_cache::{KvGeometry, KvPool};
use crate::load::ModelInfo;
use crate::model::{Model, SeqChunk};
use crate::precision::KvDtype;
use crate::sampling::{DevicePick, Sampler, SamplingParams};
use crate::scheduler::{Plan, Scheduler, SeqId};
use crate::settings::{EngineSettings, KvBudget, Placement};
use crate::tokenizer::{IncrementalDecoder, TextTokenizer};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

mod guard;
mod handle;
mod runners;
mod stats;
pub use handle::{EngineHandle, Generated};
use runners::CpuRunner;
pub use stats::{EngineInfo, EngineMetrics, StepStats, STEP_LOG_LEN};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Stop,
    Length,
    Aborted,
}

impl FinishReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Aborted => "abort",
        }
    }
}

#[derive(Debug, Clone)]
pub enum Event {
    /// One generated token; `text` is what became printable with it (may be
    /// empty while a character or a possible stop string is incomplete).
    Token {
        id: u32,
        text: String,
        at: Instant,
    },
    Done {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        preemptions: u32,
        at: Instant,
    },
    Error(String),
}

pub struct GenerateRequest {
    pub prompt_tokens: Vec<u32>,
    pub params: SamplingParams,
}

struct Sequence {
    tokens: Vec<u32>,
    prompt_len: usize,
    params: SamplingParams,
    sampler: Sampler,
    decoder: IncrementalDecoder,
    text: String,
    emitted: usize,
    preemptions: u32,
    tx: UnboundedSender<Event>,
}

impl Sequence {
    fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }
}

/// Runs a step's forward pass: the CPU model over its host KV pool, or a
/// model on a GPU ([`crate::cuda::CudaModel`]). Everything else in a step
/// (scheduling, blocks, sampling, stop rules) is the engine's, shared.
pub trait StepRunner: Send {
    /// One f32 logits row per chunk that wants logits, in chunk order.
    fn forward(&mut self, chunks: &[SeqChunk]) -> Result<Vec<Vec<f32>>>;

    /// What runs the steps, for reports: `cpu` unless said otherwise.
    fn describe(&self) -> String {
        "cpu".into()
    }

    /// Whether [`StepRunner::forward_sample`] picks tokens where the logits
    /// are (a GPU), saving their `[rows, vocab]` copy to the host.
    fn samples_on_device(&self) -> bool {
        false
    }

    /// One token per chunk that wants logits, picked as `picks[row]` says
    /// (greedy: the largest logit, the lowest index on a tie; else top-p,
    /// see [`DevicePick`]).
    fn forward_sample(&mut self, chunks: &[SeqChunk], picks: &[DevicePick]) -> Result<Vec<u32>> {
        Ok(self
            .forward(chunks)?
            .iter()
            .zip(picks)
            .map(|(l, p)| p.pick(l))
            .collect())
    }
}

/// What a step's forward pass handed back for sampling.
enum Sampled {
    Logits(Vec<Vec<f32>>),
    /// Tokens the runner picked on its device.
    Tokens(Vec<u32>),
}

/// The step machine. Single-threaded; `EngineHandle` runs it on a thread.
pub struct Engine {
    runner: Box<dyn StepRunner>,
    tokenizer: Arc<TextTokenizer>,
    scheduler: Scheduler,
    seqs: HashMap<SeqId, Sequence>,
    next_id: SeqId,
    eos: Vec<u32>,
    pub info: EngineInfo,
    pub metrics: Arc<EngineMetrics>,
    step: u64,
    /// The sequences in the step being run: what a panic in it fails
    /// ([`Engine::step_guarded`]).
    stepping: Vec<SeqId>,
}

/// Host memory the OS reports available (`MemAvailable`), in bytes.
pub fn host_available_bytes() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

impl Engine {
    /// Loads `spec` where `placement` says and builds the engine around it.
    pub fn load(
        spec: &str,
        opts: &crate::load::LoadOptions,
        placement: Placement,
        cfg: &EngineSettings,
    ) -> Result<(Engine, Arc<ChatTemplate>)> {
        match placement {
            Placement::Cpu => {
                let loaded = crate::load::load(spec, opts)?;
                let engine =
                    Engine::new(loaded.model, Arc::new(loaded.tokenizer), loaded.info, cfg)?;
                Ok((engine, Arc::new(loaded.chat_template)))
            }
            Placement::Cuda { ordinal } => {
                let loaded = crate::load::load_cuda(spec, opts, ordinal)?;
                let rt = &loaded.model.gpu.info;
                tracing::info!(
                    "cuda:{ordinal}: {} ({}), kernels: {}, GEMMs: {}",
                    loaded.model.gpu.device.info.name,
                    rt.arch,
                    rt.kernels,
                    rt.gemm
                );
                for why in &rt.fallbacks {
                    tracing::warn!("cuda:{ordinal}: {why}");
                }
                let engine =
                    Engine::new_cuda(loaded.model, Arc::new(loaded.tokenizer), loaded.info, cfg)?;
                Ok((engine, Arc::new(loaded.chat_template)))
            }
        }
    }

    /// What runs the steps now ([`StepRunner::describe`]): on CUDA, with
    /// the graphs captured and replayed so far.
    pub fn runner_now(&self) -> String {
        self.runner.describe()
    }

    /// The engine on a GPU model: the KV pool is sized in device memory.
    pub fn new_cuda(
        mut model: crate::cuda::CudaModel,
        tokenizer: Arc<TextTokenizer>,
        info: ModelInfo,
        cfg: &EngineSettings,
    ) -> Result<Engine> {
        cfg.validate()?;
        let plan = model.allocate_kv(cfg)?;
        let mc = model.config.clone();
        Ok(Self::assemble(
            Box::new(model),
            &mc,
            plan.num_blocks,
            plan.bytes_per_token,
            plan.pool_bytes,
            tokenizer,
            info,
            cfg,
        ))
    }

    /// The engine on the CPU model: the KV pool is sized in host memory.
    pub fn new(
        model: Model,
        tokenizer: Arc<TextTokenizer>,
        info: ModelInfo,
        cfg: &EngineSettings,
    ) -> Result<Engine> {
        cfg.validate()?;
        let mc = &model.config;
        let bytes_per_token = mc.kv_bytes_per_token(cfg.kv_dtype.elem_bytes());
        let budget = match cfg.kv_budget {
            KvBudget::Bytes(b) => b,
            KvBudget::FractionOfAvailable(f) => {
                let avail = host_available_bytes().ok_or_else(|| EngineError::InvalidSetting {
                    field: "kv_cache_fraction",
                    message: "cannot read MemAvailable from /proc/meminfo; pass --kv-cache-bytes"
                        .into(),
                })?;
                (avail as f64 * f) as usize
            }
        };
        let num_blocks = budget / (bytes_per_token * cfg.block_size);
        if num_blocks == 0 {
            return Err(EngineError::InvalidSetting {
                field: "kv_cache_bytes",
                message: format!(
                    "{budget} bytes hold no block of {} tokens ({} bytes per token)",
                    cfg.block_size, bytes_per_token
                ),
            });
        }
        let geometry = KvGeometry {
            num_layers: mc.num_layers,
            num_blocks,
            block_size: cfg.block_size,
            num_kv_heads: mc.num_kv_heads,
            head_dim: mc.head_dim,
        };
        let kv = KvPool::new(geometry, cfg.kv_dtype);
        let (per_token, pool) = (kv.bytes_per_token(), kv.bytes());
        let mc = mc.clone();
        Ok(Self::assemble(
            Box::new(CpuRunner { model, kv }),
            &mc,
            num_blocks,
            per_token,
            pool,
            tokenizer,
            info,
            cfg,
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        runner: Box<dyn StepRunner>,
        mc: &crate::config::ModelConfig,
        num_blocks: usize,
        kv_bytes_per_token: usize,
        kv_pool_bytes: usize,
        tokenizer: Arc<TextTokenizer>,
        info: ModelInfo,
        cfg: &EngineSettings,
    ) -> Engine {
        let max_model_len = cfg.max_model_len.unwrap_or(mc.max_position_embeddings);
        let metrics = Arc::new(EngineMetrics::default());
        metrics.kv_blocks_total.store(num_blocks, Ordering::Relaxed);
        let info = EngineInfo {
            model: info,
            kv_dtype: cfg.kv_dtype,
            block_size: cfg.block_size,
            kv_blocks_total: num_blocks,
            kv_bytes_per_token,
            kv_pool_bytes,
            kv_capacity_tokens: num_blocks * cfg.block_size,
            max_model_len,
            scheduler: cfg.scheduler.clone(),
            backend: runner.describe(),
        };
        Engine {
            eos: mc.eos_token_ids.clone(),
            scheduler: Scheduler::new(cfg.scheduler.clone(), cfg.block_size, num_blocks),
            runner,
            tokenizer,
            seqs: HashMap::new(),
            next_id: 0,
            info,
            metrics,
            step: 0,
            stepping: Vec::new(),
        }
    }

    /// Checks a request against the model's context and the KV pool.
    pub fn validate(
        info: &EngineInfo,
        prompt_tokens: usize,
        params: &SamplingParams,
    ) -> Result<()> {
        if prompt_tokens == 0 {
            return Err(EngineError::InvalidRequest {
                param: "prompt",
                message: "the prompt is empty".into(),
            });
        }
        if params.max_tokens == 0 {
            return Err(EngineError::InvalidRequest {
                param: "max_tokens",
                message: "must be at least 1".into(),
            });
        }
        if prompt_tokens + params.max_tokens > info.max_model_len {
            return Err(EngineError::ContextLengthExceeded {
                prompt_tokens,
                max_tokens: params.max_tokens,
                max_model_len: info.max_model_len,
            });
        }
        let needed_blocks = (prompt_tokens + params.max_tokens).div_ceil(info.block_size);
        if needed_blocks > info.kv_blocks_total {
            return Err(EngineError::KvPoolTooSmall {
                needed_blocks,
                total_blocks: info.kv_blocks_total,
            });
        }
        Ok(())
    }

    pub fn add_request(
        &mut self,
        req: GenerateRequest,
        tx: UnboundedSender<Event>,
    ) -> Result<SeqId> {
        Engine::validate(&self.info, req.prompt_tokens.len(), &req.params)?;
        let id = self.next_id;
        self.next_id += 1;
        let prompt_len = req.prompt_tokens.len();
        self.scheduler.add(id, prompt_len);
        self.seqs.insert(
            id,
            Sequence {
                tokens: req.prompt_tokens,
                prompt_len,
                sampler: Sampler::new(req.params.seed),
                params: req.params,
                decoder: IncrementalDecoder::default(),
                text: String::new(),
                emitted: 0,
                preemptions: 0,
                tx,
            },
        );
        self.metrics
            .prompt_tokens_total
            .fetch_add(prompt_len as u64, Ordering::Relaxed);
        self.publish();
        Ok(id)
    }

    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
    }

    /// Aborts every sequence whose receiver is gone.
    pub fn reap_disconnected(&mut self) {
        let gone: Vec<SeqId> = self
            .seqs
            .iter()
            .filter(|(_, s)| s.tx.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.scheduler.remove(id);
            self.seqs.remove(&id);
            self.metrics
                .requests_aborted_total
                .fetch_add(1, Ordering::Relaxed);
        }
        self.publish();
    }

    fn publish(&self) {
        let m = &self.metrics;
        m.running
            .store(self.scheduler.num_running(), Ordering::Relaxed);
        m.waiting
            .store(self.scheduler.num_waiting(), Ordering::Relaxed);
        m.kv_blocks_used
            .store(self.scheduler.blocks_used(), Ordering::Relaxed);
        m.preemptions_total
            .store(self.scheduler.preemptions_total(), Ordering::Relaxed);
    }

    /// Runs one scheduling step and forward pass.
    pub fn step(&mut self) -> Result<StepStats> {
        let start = Instant::now();
        self.stepping.clear();
        let plan: Plan = self.scheduler.schedule();
        self.stepping.extend(plan.work.iter().map(|w| w.id));
        for id in &plan.preempted {
            if let Some(s) = self.seqs.get_mut(id) {
                s.preemptions += 1;
            }
        }
        // A runner that samples on its device picks every token itself
        // (greedy, or top-p without top-k) instead of copying [rows, vocab]
        // logits back; each sampled sequence draws its uniform here, in row
        // order.
        let vocab = self.info.model.config.vocab_size;
        let device_sampling = self.runner.samples_on_device();
        let picks: Option<Vec<DevicePick>> = (device_sampling
            && plan
                .work
                .iter()
                .filter(|w| w.samples)
                .all(|w| DevicePick::supports(&self.seqs[&w.id].params, vocab)))
        .then(|| {
            plan.work
                .iter()
                .filter(|w| w.samples)
                .map(|w| {
                    let s = self.seqs.get_mut(&w.id).expect("scheduled sequence exists");
                    s.sampler.device_pick(&s.params)
                })
                .collect()
        });
        let chunks: Vec<SeqChunk> = plan
            .work
            .iter()
            .map(|w| SeqChunk {
                tokens: &self.seqs[&w.id].tokens[w.start..w.start + w.len],
                start_pos: w.start,
                block_table: self.scheduler.block_table(w.id),
                want_logits: w.samples,
            })
            .collect();
        let logits = match &picks {
            Some(p) => self.runner.forward_sample(&chunks, p).map(Sampled::Tokens),
            None => self.runner.forward(&chunks).map(Sampled::Logits),
        };
        drop(chunks);
        // One row (or token) per sampled chunk, or the step fails cleanly
        // instead of indexing past the end on the engine thread.
        let wanted = plan.work.iter().filter(|w| w.samples).count();
        let logits = logits.and_then(|s| {
            let got = match &s {
                Sampled::Logits(r) => r.len(),
                Sampled::Tokens(t) => t.len(),
            };
            if got == wanted {
                Ok(s)
            } else {
                Err(EngineError::InvalidSetting {
                    field: "engine",
                    message: format!("the forward pass returned {got} rows for {wanted} sequences"),
                })
            }
        });
        let sampled = match logits {
            Ok(l) => l,
            Err(e) => {
                // A failed forward pass fails the sequences in it, not the engine.
                for w in &plan.work {
                    if let Some(s) = self.seqs.remove(&w.id) {
                        let _ = s.tx.send(Event::Error(e.to_string()));
                    }
                    self.scheduler.remove(w.id);
                }
                self.publish();
                return Err(e);
            }
        };
        let mut row = 0;
        let now = Instant::now();
        let mut decode_tokens = 0;
        let mut finished = Vec::new();
        for w in &plan.work {
            self.scheduler.advance(w.id, w.len);
            if !w.samples {
                continue;
            }
            let seq = self.seqs.get_mut(&w.id).expect("scheduled sequence exists");
            let tok = match &sampled {
                // A device-sampling runner's step that came back as logits
                // (a top-k request was in it): the other requests still draw
                // as the device does, so a seed gives the same tokens
                // whatever shares the step.
                Sampled::Logits(rows)
                    if device_sampling && DevicePick::supports(&seq.params, vocab) =>
                {
                    seq.sampler.device_pick(&seq.params).pick(&rows[row])
                }
                Sampled::Logits(rows) => seq.sampler.sample(&rows[row], &seq.params),
                Sampled::Tokens(t) => t[row],
            };
            row += 1;
            if w.len == 1 {
                decode_tokens += 1;
            }
            seq.tokens.push(tok);
            self.scheduler.append(w.id);
            self.metrics
                .generation_tokens_total
                .fetch_add(1, Ordering::Relaxed);
            let finish = Self::on_token(
                &self.tokenizer,
                &self.eos,
                self.info.max_model_len,
                seq,
                tok,
                now,
            );
            if let Some(reason) = finish {
                let seq = self.seqs.remove(&w.id).expect("exists");
                self.scheduler.remove(w.id);
                self.metrics
                    .requests_finished_total
                    .fetch_add(1, Ordering::Relaxed);
                finished.push((seq, reason));
            }
        }
        self.step += 1;
        // Publish before telling clients they are done, so a client that
        // reads the metrics after its response sees its blocks freed.
        self.publish();
        for (seq, reason) in finished {
            let _ = seq.tx.send(Event::Done {
                reason,
                prompt_tokens: seq.prompt_len,
                completion_tokens: seq.tokens.len() - seq.prompt_len,
                preemptions: seq.preemptions,
                at: now,
            });
        }
        let stats = StepStats {
            step: self.step,
            prefill_tokens: plan.num_tokens() - decode_tokens,
            decode_tokens,
            step_seconds: start.elapsed().as_secs_f64(),
            running: self.scheduler.num_running(),
            waiting: self.scheduler.num_waiting(),
            kv_blocks_used: self.scheduler.blocks_used(),
            kv_blocks_total: self.scheduler.num_blocks(),
            preemptions: plan.preempted.len(),
        };
        self.metrics.steps_total.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut log) = self.metrics.step_log.lock() {
            if log.len() == STEP_LOG_LEN {
                log.pop_front();
            }
            log.push_back(stats.clone());
        }
        Ok(stats)
    }

    /// Detokenises the new token, applies stop rules and sends the text that
    /// is safe to show. Returns the finish reason if the sequence is done.
    fn on_token(
        tokenizer: &TextTokenizer,
        eos: &[u32],
        max_model_len: usize,
        seq: &mut Sequence,
        tok: u32,
        now: Instant,
    ) -> Option<FinishReason> {
        let p = &seq.params;
        let mut finish = None;
        let is_stop_token =
            (!p.ignore_eos && eos.contains(&tok)) || p.stop_token_ids.contains(&tok);
        if is_stop_token {
            finish = Some(FinishReason::Stop);
        } else {
            let out: Vec<u32> = seq.output().to_vec();
            let delta = seq.decoder.step(tokenizer, &out).unwrap_or_default();
            seq.text.push_str(&delta);
            let max_stop = p.stop.iter().map(|s| s.len()).max().unwrap_or(0);
            if max_stop > 0 {
                let from = seq.emitted.saturating_sub(max_stop);
                let from = (0..=from)
                    .rev()
                    .find(|i| seq.text.is_char_boundary(*i))
                    .unwrap_or(0);
                if let Some(pos) = p
                    .stop
                    .iter()
                    .filter(|s| !s.is_empty())
                    .filter_map(|s| seq.text[from..].find(s.as_str()).map(|i| i + from))
                    .min()
                {
                    seq.text.truncate(pos);
                    finish = Some(FinishReason::Stop);
                }
            }
        }
        if finish.is_none()
            && (seq.output().len() >= p.max_tokens || seq.tokens.len() >= max_model_len)
        {
            finish = Some(FinishReason::Length);
        }
        if finish.is_some() && !is_stop_token {
            // Flush a trailing partial character if the output ends here.
            let out: Vec<u32> = seq.output().to_vec();
            if let Ok(rest) = seq.decoder.flush(tokenizer, &out) {
                if finish == Some(FinishReason::Length) {
                    seq.text.push_str(&rest);
                }
            }
        }
        // Hold back a suffix that could still become a stop string.
        let safe_end = if finish.is_some() {
            seq.text.len()
        } else {
            let held = seq
                .params
                .stop
                .iter()
                .flat_map(|s| {
                    (1..s.len())
                        .filter(|k| s.is_char_boundary(*k))
                        .map(move |k| &s[..k])
                })
                .filter(|pre| seq.text.ends_with(pre))
                .map(|pre| pre.len())
                .max()
                .unwrap_or(0);
            seq.text.len() - held
        };
        let text = if safe_end > seq.emitted {
            seq.text[seq.emitted..safe_end].to_string()
        } else {
            String::new()
        };
        seq.emitted = seq.emitted.max(safe_end);
        let _ = seq.tx.send(Event::Token {
            id: tok,
            text,
            at: now,
        });
        finish
    }
}

/// A private KV pool just large enough for `n_tokens` of one sequence, and
/// its block table: for scoring a text outside the scheduler.
pub fn scratch_cache(model: &Model, n_tokens: usize, kv_dtype: KvDtype) -> (KvPool, Vec<u32>) {
    let block_size = 16;
    let blocks = n_tokens.div_ceil(block_size);
    let g = KvGeometry {
        num_layers: model.config.num_layers,
        num_blocks: blocks,
        block_size,
        num_kv_heads: model.config.num_kv_heads,
        head_dim: model.config.head_dim,
    };
    (KvPool::new(g, kv_dtype), (0..blocks as u32).collect())
}

/// Logits of the last prompt token from a fresh cache: for comparisons
/// with reference implementations.
pub fn prompt_logits(model: &Model, tokens: &[u32], kv_dtype: KvDtype) -> Result<Vec<f32>> {
    let (mut kv, table) = scratch_cache(model, tokens.len(), kv_dtype);
    let chunk = SeqChunk {
        tokens,
        start_pos: 0,
        block_table: &table,
        want_logits: true,
    };
    let logits = model
        .forward(&mut kv, &[chunk])?
        .ok_or_else(|| EngineError::InvalidRequest {
            param: "prompt",
            message: "the prompt is empty".into(),
        })?;
    Ok(logits.squeeze(0)?.to_vec1::<f32>()?)
}

#[cfg(test)]
mod tests;
