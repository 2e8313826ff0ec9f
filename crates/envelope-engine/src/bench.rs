//! The engine benchmark (`envelope bench-engine`): single-sequence prefill
//! and decode tokens/s and aggregate decode tokens/s at several
//! concurrencies, timed per engine step (the engine runs in the calling
//! thread, so nothing else is in the clock). Decode figures come from the
//! median step time.

use crate::engine::Engine;
use crate::error::EngineError;
use crate::load::LoadOptions;
use crate::settings::EngineSettings;
use crate::util::synthetic_prompt;
use crate::{Event, GenerateRequest, Placement, SamplingParams};
use serde::Serialize;
use std::fmt::Write;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchPlan {
    /// The single sequence's prompt, prefilled in one step.
    pub prompt_tokens: usize,
    /// Tokens decoded by each sequence.
    pub decode_tokens: usize,
    /// The concurrencies of the aggregate decode.
    pub concurrency: Vec<usize>,
    /// The prompt of each sequence of the aggregate decode.
    pub decode_prompt_tokens: usize,
}

/// The machine, as the report states it.
#[derive(Debug, Clone)]
pub struct Machine {
    pub threads: usize,
    pub cpu: String,
}

#[derive(Debug, Serialize)]
pub struct BenchReport {
    pub model: String,
    pub precision: String,
    pub kv_dtype: String,
    /// `cpu` or `cuda:N`.
    pub device: String,
    /// What ran the steps: `cpu`, or the GPU with its kernel source, GEMM
    /// path and CUDA graph use.
    pub backend: String,
    pub weight_bytes: usize,
    pub threads: usize,
    pub cpu: String,
    pub prompt_tokens: usize,
    pub prefill_tok_per_s: f64,
    pub single_decode_tok_per_s: f64,
    pub aggregate: Vec<AggregatePoint>,
}

#[derive(Debug, Serialize)]
pub struct AggregatePoint {
    pub concurrency: usize,
    pub decode_tok_per_s: f64,
    pub per_seq_tok_per_s: f64,
    pub median_step_ms: f64,
}

/// The median of `xs` (decode figures use the median step: on a shared
/// machine a burst from a neighbour lands in a few steps, not in all).
fn median(xs: &mut [f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

fn params(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    }
}

fn add(
    engine: &mut Engine,
    prompt: Vec<u32>,
    max_tokens: usize,
) -> Result<UnboundedReceiver<Event>, EngineError> {
    let (tx, rx) = unbounded_channel();
    engine.add_request(
        GenerateRequest {
            prompt_tokens: prompt,
            params: params(max_tokens),
        },
        tx,
    )?;
    Ok(rx)
}

/// Loads `model` with `load` and `cfg` (its batch limits raised to what
/// the plan needs) on `placement` and runs `plan`; `machine` is stated in
/// the report as given.
pub fn run(
    model: &str,
    load: &LoadOptions,
    placement: Placement,
    cfg: EngineSettings,
    plan: &BenchPlan,
    machine: Machine,
) -> Result<BenchReport, EngineError> {
    // Like the engine thread: step on a worker of the compute pool.
    rayon::ThreadPoolBuilder::new()
        .build()
        .map_err(|e| EngineError::InvalidSetting {
            field: "threads",
            message: format!("cannot build the compute pool: {e}"),
        })?
        .install(|| run_in_pool(model, load, placement, cfg, plan, machine))
}

fn run_in_pool(
    model: &str,
    load: &LoadOptions,
    placement: Placement,
    mut cfg: EngineSettings,
    args: &BenchPlan,
    machine: Machine,
) -> Result<BenchReport, EngineError> {
    let max_c = args.concurrency.iter().copied().max().unwrap_or(1);
    cfg.scheduler.max_num_seqs = cfg.scheduler.max_num_seqs.max(max_c);
    cfg.scheduler.max_num_batched_tokens = cfg
        .scheduler
        .max_num_batched_tokens
        .max(args.prompt_tokens)
        .max(max_c * args.decode_prompt_tokens);
    let (mut engine, _) = Engine::load(model, load, placement, &cfg)?;
    let info = engine.info.model.clone();
    let vocab = info.config.vocab_size;

    // Warm-up: pages in the weights and the pool.
    let _w = add(&mut engine, synthetic_prompt(64, vocab, 99), 4)?;
    while engine.has_work() {
        engine.step()?;
    }

    // Single sequence: the first step is the whole prefill, the rest decode.
    let _rx = add(
        &mut engine,
        synthetic_prompt(args.prompt_tokens, vocab, 1),
        args.decode_tokens + 1,
    )?;
    let first = engine.step()?;
    if first.prefill_tokens != args.prompt_tokens {
        return Err(EngineError::InvalidSetting {
            field: "prompt_tokens",
            message: format!(
                "the prefill of {} tokens was split ({} in the first step)",
                args.prompt_tokens, first.prefill_tokens
            ),
        });
    }
    let prefill = args.prompt_tokens as f64 / first.step_seconds;
    let mut steps = Vec::new();
    while engine.has_work() {
        let s = engine.step()?;
        if s.decode_tokens == 1 {
            steps.push(s.step_seconds);
        }
    }
    let single_decode = 1.0 / median(&mut steps);

    let mut aggregate = Vec::new();
    for &c in &args.concurrency {
        let _rxs: Vec<_> = (0..c)
            .map(|i| {
                add(
                    &mut engine,
                    synthetic_prompt(args.decode_prompt_tokens, vocab, 10 + i as u64),
                    args.decode_tokens + 1,
                )
            })
            .collect::<Result<_, _>>()?;
        let mut steps = Vec::new();
        while engine.has_work() {
            let s = engine.step()?;
            // Count steps where the whole batch decodes.
            if s.prefill_tokens == 0 && s.decode_tokens == c {
                steps.push(s.step_seconds);
            }
        }
        let step = median(&mut steps);
        let tps = c as f64 / step;
        aggregate.push(AggregatePoint {
            concurrency: c,
            decode_tok_per_s: tps,
            per_seq_tok_per_s: tps / c as f64,
            median_step_ms: step * 1e3,
        });
    }
    Ok(BenchReport {
        model: info.source.clone(),
        precision: info.weights.formats.join("+"),
        kv_dtype: cfg.kv_dtype.to_string(),
        device: placement.to_string(),
        backend: engine.info.backend.clone(),
        weight_bytes: info.weights.total_bytes,
        threads: machine.threads,
        cpu: machine.cpu,
        prompt_tokens: args.prompt_tokens,
        prefill_tok_per_s: prefill,
        single_decode_tok_per_s: single_decode,
        aggregate,
    })
}

impl BenchReport {
    /// The report as the CLI prints it.
    pub fn table(&self) -> String {
        let r = self;
        let mut o = String::new();
        let _ = writeln!(o, "envelope bench-engine");
        let _ = writeln!(
            o,
            "  model      {} (weights {}, {:.1} MiB)",
            r.model,
            r.precision,
            r.weight_bytes as f64 / 1048576.0
        );
        let _ = writeln!(
            o,
            "  machine    {} x {} threads, KV {}, device {}",
            r.cpu, r.threads, r.kv_dtype, r.device
        );
        if r.backend != "cpu" {
            let _ = writeln!(o, "  backend    {}", r.backend);
        }
        o.push('\n');
        let _ = writeln!(o, "  {:<34} {:>12}", "measurement", "tok/s");
        let _ = writeln!(
            o,
            "  {:<34} {:>12.1}",
            format!("prefill, 1 seq, {} tokens", r.prompt_tokens),
            r.prefill_tok_per_s
        );
        let _ = writeln!(
            o,
            "  {:<34} {:>12.1}",
            "decode, 1 seq", r.single_decode_tok_per_s
        );
        for a in &r.aggregate {
            let _ = writeln!(
                o,
                "  {:<34} {:>12.1}   ({:.1} tok/s per seq, median step {:.1} ms)",
                format!("decode, {} seqs, aggregate", a.concurrency),
                a.decode_tok_per_s,
                a.per_seq_tok_per_s,
                a.median_step_ms
            );
        }
        o
    }
}
