use super::*;
use crate::load::{load, LoadOptions};
use crate::precision::Precision;
use std::sync::atomic::AtomicUsize;
use std::sync::Mutex;

/// A CPU runner that claims device sampling and counts which path the
/// engine takes, recording the picks it was handed.
struct Counting {
    inner: CpuRunner,
    device_calls: Arc<AtomicUsize>,
    logits_calls: Arc<AtomicUsize>,
    picks: Arc<Mutex<Vec<DevicePick>>>,
}

impl StepRunner for Counting {
    fn forward(&mut self, chunks: &[SeqChunk]) -> Result<Vec<Vec<f32>>> {
        self.logits_calls.fetch_add(1, Ordering::Relaxed);
        self.inner.forward(chunks)
    }
    fn samples_on_device(&self) -> bool {
        true
    }
    fn forward_sample(&mut self, chunks: &[SeqChunk], picks: &[DevicePick]) -> Result<Vec<u32>> {
        self.device_calls.fetch_add(1, Ordering::Relaxed);
        self.picks.lock().unwrap().extend_from_slice(picks);
        Ok(self
            .inner
            .forward(chunks)?
            .iter()
            .zip(picks)
            .map(|(l, p)| p.pick(l))
            .collect())
    }
}

fn run(engine: &mut Engine, temperature: f32) -> Vec<u32> {
    run_with(engine, temperature, 0)
}

fn run_with(engine: &mut Engine, temperature: f32, top_k: usize) -> Vec<u32> {
    run_together(engine, &[(temperature, top_k)]).remove(0)
}

/// Requests (temperature, top_k) added together and run to the end:
/// their tokens, in order.
fn run_together(engine: &mut Engine, reqs: &[(f32, usize)]) -> Vec<Vec<u32>> {
    let rxs: Vec<_> = reqs
        .iter()
        .map(|&(temperature, top_k)| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            let params = SamplingParams {
                temperature,
                top_p: 0.9,
                top_k,
                seed: Some(3),
                ignore_eos: true,
                ..SamplingParams::greedy(6)
            };
            engine
                .add_request(
                    GenerateRequest {
                        prompt_tokens: vec![5, 17, 99, 3],
                        params,
                    },
                    tx,
                )
                .unwrap();
            rx
        })
        .collect();
    while engine.has_work() {
        engine.step().unwrap();
    }
    rxs.into_iter()
        .map(|mut rx| {
            let mut out = vec![];
            while let Ok(ev) = rx.try_recv() {
                if let Event::Token { id, .. } = ev {
                    out.push(id);
                }
            }
            out
        })
        .collect()
}

/// With a runner that samples on its device, greedy and top-p steps go
/// through it (greedy: the host sampler's tokens; top-p: one seeded
/// draw per token, reproducible), and only a top-k request gets logits.
#[test]
fn steps_sample_on_the_runners_device_unless_top_k() {
    let opts = LoadOptions {
        precision: Precision::F32,
        tokenizer: None,
    };
    let cfg = EngineSettings {
        kv_budget: KvBudget::Bytes(1 << 20),
        ..EngineSettings::default()
    };
    let plain = load("dummy:tiny@9", &opts).unwrap();
    let mut host = Engine::new(plain.model, Arc::new(plain.tokenizer), plain.info, &cfg).unwrap();
    let want = run(&mut host, 0.0);

    let l = load("dummy:tiny@9", &opts).unwrap();
    let (device_calls, logits_calls) =
        (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let picks = Arc::new(Mutex::new(Vec::new()));
    let mc = l.model.config.clone();
    let g = KvGeometry {
        num_layers: mc.num_layers,
        num_blocks: host.info.kv_blocks_total,
        block_size: cfg.block_size,
        num_kv_heads: mc.num_kv_heads,
        head_dim: mc.head_dim,
    };
    let kv = KvPool::new(g, cfg.kv_dtype);
    let (bpt, bytes) = (kv.bytes_per_token(), kv.bytes());
    let runner = Counting {
        inner: CpuRunner { model: l.model, kv },
        device_calls: device_calls.clone(),
        logits_calls: logits_calls.clone(),
        picks: picks.clone(),
    };
    let mut dev = Engine::assemble(
        Box::new(runner),
        &mc,
        g.num_blocks,
        bpt,
        bytes,
        Arc::new(l.tokenizer),
        l.info,
        &cfg,
    );
    assert_eq!(run(&mut dev, 0.0), want);
    assert!(device_calls.load(Ordering::Relaxed) >= 6);
    assert!(picks
        .lock()
        .unwrap()
        .iter()
        .all(|p| *p == DevicePick::GREEDY));
    assert_eq!(logits_calls.load(Ordering::Relaxed), 0);

    // top-p on the device: one uniform draw per token from the
    // sequence's seeded generator, so the same seed gives the same
    // completion; no logits come back.
    picks.lock().unwrap().clear();
    let a = run(&mut dev, 1.0);
    let drawn: Vec<DevicePick> = std::mem::take(&mut *picks.lock().unwrap());
    assert_eq!(a.len(), 6);
    assert_eq!(drawn.len(), 6);
    assert!(drawn
        .iter()
        .all(|p| p.temperature == 1.0 && p.top_p == 0.9 && (0.0..1.0).contains(&p.u)));
    assert!(drawn.windows(2).any(|w| w[0].u != w[1].u));
    assert_eq!(run(&mut dev, 1.0), a);
    assert_eq!(logits_calls.load(Ordering::Relaxed), 0);

    // top-k is a host cut: that request's steps copy logits.
    assert_eq!(run_with(&mut dev, 1.0, 2).len(), 6);
    let host_steps = logits_calls.load(Ordering::Relaxed);
    assert!(host_steps >= 6, "top-k sampling needs logits");
    // A top-p request sharing those steps with a top-k one still draws
    // as the device does: its seed gives the tokens it gave alone. (A
    // high temperature spreads the nucleus, so the host's sort-order
    // draw would pick other tokens.)
    let alone = run_with(&mut dev, 8.0, 0);
    let both = run_together(&mut dev, &[(8.0, 0), (8.0, 2)]);
    assert!(logits_calls.load(Ordering::Relaxed) > host_steps);
    assert_eq!(both[0], alone);
}

/// A runner that panics on any step holding `poison` (as a bug in a kernel
/// wrapper or an `expect` would), and otherwise runs the CPU model.
struct Poisoned {
    inner: Box<dyn StepRunner>,
    poison: u32,
}

impl StepRunner for Poisoned {
    fn forward(&mut self, chunks: &[SeqChunk]) -> Result<Vec<Vec<f32>>> {
        if chunks.iter().any(|c| c.tokens.contains(&self.poison)) {
            panic!("poisoned step");
        }
        self.inner.forward(chunks)
    }
}

/// A step that panics fails its own requests with an error event, frees
/// their blocks, counts the panic, and the engine thread serves the next
/// request; before the boundary the panic ended the thread and every later
/// request got `ShutDown`.
#[test]
fn a_panicking_step_fails_its_requests_and_the_engine_goes_on() {
    let opts = LoadOptions {
        precision: Precision::F32,
        tokenizer: None,
    };
    let cfg = EngineSettings {
        kv_budget: KvBudget::Bytes(1 << 20),
        ..EngineSettings::default()
    };
    let (engine, template) = Engine::load("dummy:tiny@4", &opts, Placement::Cpu, &cfg).unwrap();
    let engine = engine.wrap_runner(|inner| Box::new(Poisoned { inner, poison: 511 }));
    let handle = EngineHandle::spawn_engine(engine, template).unwrap();
    let req = |prompt: Vec<u32>| GenerateRequest {
        prompt_tokens: prompt,
        params: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(4)
        },
    };
    let bad = handle.generate_blocking(req(vec![3, 511, 7]));
    let msg = bad.expect_err("the poisoned request fails").to_string();
    assert!(msg.contains("poisoned step"), "{msg}");
    assert_eq!(handle.metrics.step_panics_total.load(Ordering::Relaxed), 1);
    for _ in 0..2 {
        let good = handle.generate_blocking(req(vec![3, 5, 7])).unwrap();
        assert_eq!(good.tokens.len(), 4);
    }
    // After the thread has stopped, nothing of the failed step holds a block.
    handle.shutdown_and_wait();
    assert_eq!(handle.metrics.kv_blocks_used.load(Ordering::Relaxed), 0);
}
