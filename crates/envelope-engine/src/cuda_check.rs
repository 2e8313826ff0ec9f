//! The whole-model GPU checks of `scripts/device-check.sh` (through
//! `envelope cuda-selftest --models` and `--bench`):
//!
//! - [`model_check`]: the same `dummy:` model on the CPU engine and on the
//!   GPU (the deterministic dummy weights make them identical without
//!   shipping files): last-token logits of a prompt, compared element by
//!   element, and greedy tokens of both engines for the first steps.
//! - [`bench`]: prefill and decode tokens/s of a model on the GPU at
//!   several batch sizes and context lengths, timed around the forward pass
//!   with greedy tokens picked on the device, as the engine does for greedy
//!   requests (the step ends by copying the tokens to the host, so the GPU
//!   work is in the clock).
//!
//! Neither has run on a GPU at the time of writing (no device was lent);
//! the comparison arithmetic is unit-tested here.

use crate::engine::Engine;
use crate::load::{load, load_cuda, LoadOptions};
use crate::model::SeqChunk;
use crate::precision::{KvDtype, Precision};
use crate::sampling::SamplingParams;
use crate::scheduler::SchedulerConfig;
use crate::settings::{EngineSettings, KvBudget};
use crate::util::synthetic_prompt;
use crate::{Event, GenerateRequest};
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;

/// How close two logit vectors are.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct LogitDiff {
    pub max_abs_diff: f32,
    /// `max_abs_diff / max |cpu logit|`.
    pub rel_to_max: f32,
    pub cosine: f32,
    pub top1_cpu: u32,
    pub top1_gpu: u32,
}

pub fn logit_diff(cpu: &[f32], gpu: &[f32]) -> LogitDiff {
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .fold((0usize, f32::NEG_INFINITY), |b, (i, &x)| {
                if x > b.1 {
                    (i, x)
                } else {
                    b
                }
            })
            .0 as u32
    };
    let mut max_abs = 0f32;
    let (mut dot, mut na, mut nb, mut peak) = (0f64, 0f64, 0f64, 0f32);
    for (&a, &b) in cpu.iter().zip(gpu) {
        let d = (a - b).abs();
        max_abs = max_abs.max(if d.is_nan() { f32::INFINITY } else { d });
        dot += a as f64 * b as f64;
        na += a as f64 * a as f64;
        nb += b as f64 * b as f64;
        peak = peak.max(a.abs());
    }
    if cpu.len() != gpu.len() {
        max_abs = f32::INFINITY;
    }
    LogitDiff {
        max_abs_diff: max_abs,
        rel_to_max: max_abs / peak.max(f32::MIN_POSITIVE),
        cosine: (dot / (na.sqrt() * nb.sqrt()).max(f64::MIN_POSITIVE)) as f32,
        top1_cpu: argmax(cpu),
        top1_gpu: argmax(gpu),
    }
}

/// Pass rules, stated in the output: f32 must match to 2e-3 of the largest
/// logit with identical greedy tokens; 16-bit paths round activations
/// between layers (the CPU keeps them in f32), so they must keep cosine
/// similarity >= 0.99 and the same first greedy token.
pub fn passes(precision: Precision, d: &LogitDiff, greedy_equal: usize, steps: usize) -> bool {
    match precision {
        Precision::F32 => d.rel_to_max <= 2e-3 && greedy_equal == steps,
        _ => d.cosine >= 0.99 && d.top1_cpu == d.top1_gpu && greedy_equal >= 1,
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelCheck {
    pub model: String,
    pub precision: Precision,
    pub kv_dtype: KvDtype,
    pub prompt_tokens: usize,
    pub logits: Option<LogitDiff>,
    pub greedy_cpu: Vec<u32>,
    pub greedy_gpu: Vec<u32>,
    /// Leading greedy tokens that agree.
    pub greedy_equal: usize,
    pub rule: String,
    pub passed: bool,
    pub cpu_seconds: f64,
    pub gpu_seconds: f64,
    /// How the GPU side ran: kernel source (NVRTC or embedded PTX), GEMM
    /// path (cuBLAS or kernels), fallbacks.
    pub runtime: Option<envelope_cuda::runtime::RuntimeInfo>,
    /// Tokens sampled on the device (temperature 1, top-p 0.95, a fixed
    /// sequence of uniforms) over the same steps with the decode steps
    /// replayed from CUDA graphs, and run eagerly: the same kernels on the
    /// same inputs, so they must be equal (a graph replaying stale inputs
    /// is not; greedy tokens of a dummy model often repeat one token and
    /// would not show it).
    pub sampled_graphs: Vec<u32>,
    pub sampled_eager: Vec<u32>,
    /// The CUDA engine after the greedy steps: device, kernels, GEMMs, and
    /// the decode graphs it captured and replayed.
    pub backend: Option<String>,
    pub error: Option<String>,
}

fn engine_settings(kv_dtype: KvDtype, kv_bytes: usize) -> EngineSettings {
    EngineSettings {
        kv_dtype,
        kv_budget: KvBudget::Bytes(kv_bytes),
        block_size: 16,
        scheduler: SchedulerConfig::default(),
        max_model_len: None,
    }
}

fn greedy(engine: &mut Engine, prompt: &[u32], steps: usize) -> crate::Result<Vec<u32>> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    engine.add_request(
        GenerateRequest {
            prompt_tokens: prompt.to_vec(),
            params: SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(steps)
            },
        },
        tx,
    )?;
    while engine.has_work() {
        engine.step()?;
    }
    let mut out = Vec::new();
    while let Ok(ev) = rx.try_recv() {
        if let Event::Token { id, .. } = ev {
            out.push(id);
        }
    }
    Ok(out)
}

/// Compares `spec` on the CPU and on CUDA device `ordinal` in `precision`.
/// Failures are recorded in the result, not returned.
pub fn model_check(
    spec: &str,
    precision: Precision,
    kv_dtype: KvDtype,
    ordinal: usize,
    prompt_len: usize,
    steps: usize,
) -> ModelCheck {
    let mut r = ModelCheck {
        model: spec.into(),
        precision,
        kv_dtype,
        prompt_tokens: prompt_len,
        logits: None,
        greedy_cpu: vec![],
        greedy_gpu: vec![],
        greedy_equal: 0,
        rule: match precision {
            Precision::F32 => "max |gpu - cpu| <= 2e-3 x max |cpu logit|, all greedy tokens equal",
            _ => "cosine >= 0.99, same top-1, same first greedy token",
        }
        .to_string()
            + "; device-sampled tokens equal with and without CUDA graphs",
        passed: false,
        cpu_seconds: 0.0,
        gpu_seconds: 0.0,
        runtime: None,
        sampled_graphs: vec![],
        sampled_eager: vec![],
        backend: None,
        error: None,
    };
    let res = (|| -> crate::Result<()> {
        let opts = LoadOptions {
            precision,
            tokenizer: None,
        };
        // fp8 on the CPU is the emulation of the same W8A8 arithmetic.
        let cpu_opts = opts.clone();
        let t = Instant::now();
        let cpu = load(spec, &cpu_opts)?;
        let prompt = synthetic_prompt(prompt_len, cpu.model.config.vocab_size, 7);
        let kv_bytes = cpu.model.config.kv_bytes_per_token(kv_dtype.elem_bytes())
            * (prompt_len + steps + 32).next_multiple_of(16);
        let cpu_logits = crate::engine::prompt_logits(&cpu.model, &prompt, kv_dtype)?;
        let mut ce = Engine::new(
            cpu.model,
            Arc::new(cpu.tokenizer),
            cpu.info,
            &engine_settings(kv_dtype, kv_bytes),
        )?;
        r.greedy_cpu = greedy(&mut ce, &prompt, steps)?;
        drop(ce);
        r.cpu_seconds = t.elapsed().as_secs_f64();

        let t = Instant::now();
        let mut gpu = load_cuda(spec, &opts, ordinal)?;
        r.runtime = Some(gpu.model.gpu.info.clone());
        let cfg = engine_settings(kv_dtype, kv_bytes);
        gpu.model.allocate_kv(&cfg)?;
        let blocks: Vec<u32> = (0..prompt_len.div_ceil(16) as u32).collect();
        let rows = gpu.model.forward(&[SeqChunk {
            tokens: &prompt,
            start_pos: 0,
            block_table: &blocks,
            want_logits: true,
        }])?;
        let gpu_logits = rows.into_iter().next().unwrap_or_default();
        let graphs_were_on = gpu.model.graphs_off().is_none();
        r.sampled_graphs = sampled_steps(&mut gpu.model, &prompt, steps, true)?;
        r.sampled_eager = sampled_steps(&mut gpu.model, &prompt, steps, false)?;
        gpu.model.set_graphs(graphs_were_on);
        let mut ge = Engine::new_cuda(gpu.model, Arc::new(gpu.tokenizer), gpu.info, &cfg)?;
        r.greedy_gpu = greedy(&mut ge, &prompt, steps)?;
        r.gpu_seconds = t.elapsed().as_secs_f64();
        r.backend = Some(ge.runner_now());

        let d = logit_diff(&cpu_logits, &gpu_logits);
        r.greedy_equal = r
            .greedy_cpu
            .iter()
            .zip(&r.greedy_gpu)
            .take_while(|(a, b)| a == b)
            .count();
        r.passed =
            passes(precision, &d, r.greedy_equal, steps) && r.sampled_graphs == r.sampled_eager;
        r.logits = Some(d);
        Ok(())
    })();
    if let Err(e) = res {
        r.error = Some(e.to_string());
    }
    r
}

/// `steps` tokens sampled on the device after `prompt` (prefill, then one
/// decode step per token, fed back), with graphs on or off.
fn sampled_steps(
    m: &mut crate::cuda::CudaModel,
    prompt: &[u32],
    steps: usize,
    graphs: bool,
) -> crate::Result<Vec<u32>> {
    m.set_graphs(graphs);
    let pick = |i: usize| crate::sampling::DevicePick {
        temperature: 1.0,
        top_p: 0.95,
        u: (i as f32 * 0.618_034 + 0.1) % 1.0,
    };
    let blocks: Vec<u32> = (0..(prompt.len() + steps + 1).div_ceil(16) as u32).collect();
    let mut out = m.forward_sample(
        &[SeqChunk {
            tokens: prompt,
            start_pos: 0,
            block_table: &blocks,
            want_logits: true,
        }],
        &[pick(0)],
    )?;
    for i in 1..steps {
        let t = [out[i - 1]];
        let next = m.forward_sample(
            &[SeqChunk {
                tokens: &t,
                start_pos: prompt.len() + i - 1,
                block_table: &blocks,
                want_logits: true,
            }],
            &[pick(i)],
        )?;
        out.extend(next);
    }
    Ok(out)
}

/// One measured point.
#[derive(Debug, Clone, Serialize)]
pub struct BenchPoint {
    pub model: String,
    pub precision: Precision,
    /// `prefill` or `decode`.
    pub phase: String,
    pub batch: usize,
    pub context: usize,
    pub steps: usize,
    pub seconds: f64,
    pub tok_per_s: f64,
    pub ms_per_step: f64,
    pub note: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchRun {
    pub model: String,
    pub precision: Precision,
    pub weight_bytes: usize,
    /// What the shape implies: 2 bytes per parameter for bf16; for fp8, 1
    /// per layer-matrix parameter and 2 for embedding, LM head and norms.
    pub weight_bytes_analytic: usize,
    /// Device memory the load took (free before - free after, from the caller).
    pub device_bytes_used_by_load: Option<u64>,
    pub load_seconds: f64,
    pub runtime: Option<envelope_cuda::runtime::RuntimeInfo>,
    pub points: Vec<BenchPoint>,
    pub error: Option<String>,
}

/// Prefill and decode tokens/s of `spec` on CUDA device `ordinal`.
/// Decode runs each batch at each context over a KV cache whose earlier
/// positions were not prefilled (zeros): the attention reads as many keys
/// as after a real prefill, without spending minutes filling them.
/// Prefill runs whole prompts of `batch x context` tokens up to
/// `max_prefill_tokens` per step.
#[allow(clippy::too_many_arguments)]
pub fn bench(
    spec: &str,
    precision: Precision,
    kv_dtype: KvDtype,
    ordinal: usize,
    batches: &[usize],
    contexts: &[usize],
    decode_steps: usize,
    max_prefill_tokens: usize,
    device_used: &dyn Fn() -> Option<u64>,
    on_point: &mut dyn FnMut(&BenchPoint),
) -> BenchRun {
    let mut run = BenchRun {
        model: spec.into(),
        precision,
        weight_bytes: 0,
        weight_bytes_analytic: 0,
        device_bytes_used_by_load: None,
        load_seconds: 0.0,
        runtime: None,
        points: vec![],
        error: None,
    };
    let res = (|| -> crate::Result<()> {
        let before = device_used();
        let t = Instant::now();
        let mut m = load_cuda(
            spec,
            &LoadOptions {
                precision,
                tokenizer: None,
            },
            ordinal,
        )?
        .model;
        run.load_seconds = t.elapsed().as_secs_f64();
        run.runtime = Some(m.gpu.info.clone());
        run.device_bytes_used_by_load = device_used().zip(before).map(|(a, b)| a.saturating_sub(b));
        run.weight_bytes = m.report.total_bytes;
        run.weight_bytes_analytic = crate::cuda::weight_bytes(&m.config, precision);
        let bs = 16;
        let max_b = batches.iter().copied().max().unwrap_or(1);
        let max_c = contexts.iter().copied().max().unwrap_or(1);
        let per_seq_blocks = (max_c + decode_steps + 2).div_ceil(bs);
        let c = &m.config;
        let bytes = max_b * per_seq_blocks * bs * c.kv_bytes_per_token(kv_dtype.elem_bytes());
        // The activation reserve must cover the largest step run here.
        let mut ecfg = engine_settings(kv_dtype, bytes);
        ecfg.scheduler.max_num_batched_tokens = max_prefill_tokens.max(max_b);
        ecfg.scheduler.max_num_seqs = max_b;
        m.allocate_kv(&ecfg)?;
        let vocab = m.config.vocab_size;
        let tables: Vec<Vec<u32>> = (0..max_b)
            .map(|s| ((s * per_seq_blocks) as u32..((s + 1) * per_seq_blocks) as u32).collect())
            .collect();
        let point =
            |phase: &str, batch, context, steps, seconds: f64, toks: usize, note| BenchPoint {
                model: spec.into(),
                precision,
                phase: phase.into(),
                batch,
                context,
                steps,
                seconds,
                tok_per_s: toks as f64 / seconds,
                ms_per_step: seconds * 1e3 / steps.max(1) as f64,
                note,
            };
        let mut emit = |q: BenchPoint, points: &mut Vec<BenchPoint>| {
            on_point(&q);
            points.push(q);
        };
        for &ctx in contexts {
            for &b in batches {
                // Prefill: whole prompts in one step.
                if b * ctx <= max_prefill_tokens {
                    let prompts: Vec<Vec<u32>> = (0..b)
                        .map(|s| synthetic_prompt(ctx, vocab, s as u64))
                        .collect();
                    let chunks: Vec<SeqChunk> = (0..b)
                        .map(|s| SeqChunk {
                            tokens: &prompts[s],
                            start_pos: 0,
                            block_table: &tables[s],
                            want_logits: true,
                        })
                        .collect();
                    // Warm-up (cuBLAS heuristics, allocator) for the 1k
                    // prompts; the 8k ones reuse their GEMM shapes (8 x 1k
                    // rows) and would spend seconds in attention to warm up.
                    if ctx <= 2048 {
                        m.forward_greedy(&chunks)?;
                    }
                    let t = Instant::now();
                    m.forward_greedy(&chunks)?;
                    let s = t.elapsed().as_secs_f64();
                    emit(
                        point("prefill", b, ctx, 1, s, b * ctx, None),
                        &mut run.points,
                    );
                } else {
                    emit(
                        point(
                            "prefill",
                            b,
                            ctx,
                            0,
                            f64::NAN,
                            0,
                            Some(format!(
                            "skipped: {} prompt tokens in one step is over {max_prefill_tokens}",
                            b * ctx
                        )),
                        ),
                        &mut run.points,
                    );
                }
                // Decode at context ctx: eagerly, then replaying CUDA graphs.
                let toks: Vec<u32> = synthetic_prompt(b, vocab, 99);
                let step = |m: &mut crate::cuda::CudaModel, i: usize| -> crate::Result<()> {
                    let chunks: Vec<SeqChunk> = (0..b)
                        .map(|s| SeqChunk {
                            tokens: &toks[s..s + 1],
                            start_pos: ctx + i,
                            block_table: &tables[s],
                            want_logits: true,
                        })
                        .collect();
                    m.forward_greedy(&chunks).map(|_| ())
                };
                for graphs in [false, true] {
                    m.set_graphs(graphs);
                    let before = m.graph_stats();
                    // Warm-up (and the capture, with graphs).
                    step(&mut m, 0)?;
                    let t = Instant::now();
                    for i in 1..=decode_steps {
                        step(&mut m, i)?;
                    }
                    let s = t.elapsed().as_secs_f64();
                    let after = m.graph_stats();
                    let mut note =
                        "KV positions before the context were not prefilled (zeros)".to_string();
                    if graphs {
                        note.push_str(&match m.graphs_off() {
                            Some(why) => format!("; graphs off: {why}"),
                            None => format!(
                                "; {} graph replays, {} captures",
                                after.replayed - before.replayed,
                                after.captured - before.captured
                            ),
                        });
                    }
                    emit(
                        point(
                            if graphs { "decode-graphs" } else { "decode" },
                            b,
                            ctx,
                            decode_steps,
                            s,
                            b * decode_steps,
                            Some(note),
                        ),
                        &mut run.points,
                    );
                }
            }
        }
        Ok(())
    })();
    if let Err(e) = res {
        run.error = Some(e.to_string());
    }
    run
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logit_diff_measures_what_it_says() {
        let cpu = [1.0f32, -2.0, 4.0, 0.5];
        let same = logit_diff(&cpu, &cpu);
        assert_eq!(same.max_abs_diff, 0.0);
        assert!((same.cosine - 1.0).abs() < 1e-6);
        assert_eq!((same.top1_cpu, same.top1_gpu), (2, 2));
        let off = logit_diff(&cpu, &[1.0, -2.0, 3.9, 4.5]);
        assert!((off.max_abs_diff - 4.0).abs() < 1e-6);
        assert!((off.rel_to_max - 1.0).abs() < 1e-6);
        assert_eq!(off.top1_gpu, 3);
        assert!(logit_diff(&cpu, &[1.0]).max_abs_diff.is_infinite());
        assert!(logit_diff(&cpu, &[f32::NAN; 4]).max_abs_diff.is_infinite());
    }

    #[test]
    fn pass_rules_per_precision() {
        let good = logit_diff(&[1.0, 2.0, 3.0], &[1.0, 2.0, 3.001]);
        assert!(passes(Precision::F32, &good, 8, 8));
        assert!(
            !passes(Precision::F32, &good, 7, 8),
            "f32 needs every greedy token"
        );
        let loose = logit_diff(&[1.0, 2.0, 3.0], &[1.05, 1.95, 3.05]);
        assert!(!passes(Precision::F32, &loose, 8, 8));
        assert!(passes(Precision::Bf16, &loose, 1, 8));
        let flipped = logit_diff(&[1.0, 2.0, 3.0], &[1.0, 3.1, 3.0]);
        assert!(!passes(Precision::Bf16, &flipped, 1, 8), "top-1 differs");
    }

    #[test]
    fn analytic_bytes_of_llama_8b() {
        let c = crate::config::preset("llama-3.1-8b").unwrap();
        let bf16 = crate::cuda::weight_bytes(&c, Precision::Bf16);
        assert!((bf16 as f64 / 1e9 - 16.06).abs() < 0.05, "{bf16}");
        let fp8 = crate::cuda::weight_bytes(&c, Precision::Fp8);
        // 6.98 B layer parameters at 1 byte + 1.05 B embedding/head at 2.
        assert!((fp8 as f64 / 1e9 - 9.08).abs() < 0.01, "{fp8}");
    }

    /// Without a GPU both checks report the reason instead of failing hard.
    #[test]
    fn without_a_gpu_the_checks_say_why() {
        if envelope_cuda::Device::open(0).is_ok() {
            return;
        }
        let r = model_check("dummy:tiny", Precision::F32, KvDtype::F32, 0, 8, 2);
        assert!(!r.passed);
        assert!(r.error.is_some());
        assert_eq!(r.greedy_cpu.len(), 2, "the CPU half ran");
        let b = bench(
            "dummy:tiny",
            Precision::Bf16,
            KvDtype::Bf16,
            0,
            &[1],
            &[16],
            2,
            64,
            &|| None,
            &mut |_| panic!("no point is measured without a GPU"),
        );
        assert!(b.error.is_some() && b.points.is_empty());
    }
}
