//! Real-weight tests on SmolLM2-135M-Instruct Q4_1: tokenization against
//! llama.cpp, logits against candle-transformers' quantized_llama, and
//! batched generation against one-at-a-time generation.

use crate::common;

use envelope_engine::*;
use std::sync::OnceLock;

fn loaded() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| {
        load(
            common::smollm2_path().to_str().unwrap(),
            &LoadOptions::default(),
        )
        .unwrap()
    })
}

#[test]
fn tokenization_matches_llama_cpp() {
    let t = &loaded().tokenizer;
    // Ids from llama.cpp (llama_tokenize, add_special=false, parse_special=true) on the same file.
    let cases: &[(&str, &[u32])] = &[
        ("The capital of France is", &[504, 3575, 282, 4649, 314]),
        (
            "Hello, world! 12345 tokens",
            &[19556, 28, 905, 17, 216, 33, 34, 35, 36, 37, 17837],
        ),
        (
            "  leading and   multiple   spaces\n\n\ttabs\r\nend  ",
            &[
                216, 2899, 284, 256, 2701, 256, 5600, 1116, 197, 100, 7366, 201, 198, 486, 256,
            ],
        ),
        (
            "naïve café — 東京 😀 Ünïcödé",
            &[
                3546, 46494, 37366, 1841, 17097, 247, 126, 16736, 122, 40303, 218, 5549, 246, 94,
                25972, 83, 7466, 84, 2756,
            ],
        ),
        (
            "def f(x):\n    return x**2 + 1  # square\n\nprint(f(3))",
            &[
                1604, 275, 24, 104, 727, 472, 1003, 1792, 828, 34, 1232, 216, 33, 216, 907, 5222,
                198, 198, 3272, 24, 86, 24, 35, 1292,
            ],
        ),
        (
            "<|im_start|>user\nHi<|im_end|>\n",
            &[1, 4093, 198, 26843, 2, 198],
        ),
    ];
    for (text, want) in cases {
        assert_eq!(&t.encode(text).unwrap(), want, "{text:?}");
        assert_eq!(&t.decode(want, false).unwrap(), text);
    }
}

#[test]
fn chat_prompt_uses_special_tokens() {
    let m = loaded();
    let prompt = m
        .chat_template
        .render(
            &[ChatMessage {
                role: "user".into(),
                content: "Hi".into(),
            }],
            true,
        )
        .unwrap();
    assert!(
        prompt.contains("<|im_start|>user\nHi<|im_end|>"),
        "{prompt}"
    );
    let ids = m.tokenizer.encode(&prompt).unwrap();
    let im_start = m.tokenizer.token_to_id("<|im_start|>").unwrap();
    assert_eq!(
        ids.iter().filter(|&&i| i == im_start).count(),
        prompt.matches("<|im_start|>").count()
    );
}

fn engine(cfg: EngineSettings) -> EngineHandle {
    let m = load(
        common::smollm2_path().to_str().unwrap(),
        &LoadOptions::default(),
    )
    .unwrap();
    EngineHandle::spawn(m, &cfg).unwrap()
}

const PROMPTS: [&str; 8] = [
    "The capital of France is",
    "Once upon a time, there was a",
    "The largest planet in the solar system is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "My favourite colour is",
    "The first president of the United States was",
    "1, 2, 3, 4,",
];

#[test]
fn batched_greedy_equals_one_at_a_time() {
    let cfg = EngineSettings {
        kv_budget: KvBudget::Bytes(64 << 20),
        ..Default::default()
    };
    let e = engine(cfg);
    let req = |p: &str| GenerateRequest {
        prompt_tokens: e.tokenizer.encode(p).unwrap(),
        params: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(24)
        },
    };
    let alone: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| e.generate_blocking(req(p)).unwrap().tokens)
        .collect();
    // All eight submitted before the engine picks any up: they share steps.
    let rxs: Vec<_> = PROMPTS.iter().map(|p| e.submit(req(p)).unwrap()).collect();
    let together: Vec<Vec<u32>> = rxs
        .into_iter()
        .map(|mut rx| {
            let mut toks = vec![];
            while let Some(ev) = rx.blocking_recv() {
                match ev {
                    Event::Token { id, .. } => toks.push(id),
                    Event::Done { .. } => break,
                    Event::Error(e) => panic!("{e}"),
                }
            }
            toks
        })
        .collect();
    let steps = e.metrics.drain_steps();
    assert!(
        steps.iter().any(|s| s.decode_tokens >= 4),
        "sequences were batched in decode steps"
    );
    for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a.len(), 24);
        assert_eq!(a, b, "prompt {i} ({:?}) differs when batched", PROMPTS[i]);
    }
}

#[test]
fn preemption_under_a_small_kv_budget_keeps_outputs_correct() {
    let mc = loaded().model.config.clone();
    // 12 blocks of 16 tokens: room for ~4 of the 8 sequences at full length.
    let bytes = 12 * 16 * mc.kv_bytes_per_token(4);
    let small = engine(EngineSettings {
        kv_budget: KvBudget::Bytes(bytes),
        ..Default::default()
    });
    let big = engine(EngineSettings {
        kv_budget: KvBudget::Bytes(64 << 20),
        ..Default::default()
    });
    let req = |e: &EngineHandle, p: &str| GenerateRequest {
        prompt_tokens: e.tokenizer.encode(p).unwrap(),
        params: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(32)
        },
    };
    let rxs: Vec<_> = PROMPTS
        .iter()
        .map(|p| small.submit(req(&small, p)).unwrap())
        .collect();
    let mut preempted = 0;
    for (i, mut rx) in rxs.into_iter().enumerate() {
        let mut toks = vec![];
        while let Some(ev) = rx.blocking_recv() {
            match ev {
                Event::Token { id, .. } => toks.push(id),
                Event::Done {
                    preemptions,
                    reason,
                    ..
                } => {
                    preempted += preemptions;
                    assert_eq!(reason, FinishReason::Length);
                    break;
                }
                Event::Error(e) => panic!("{e}"),
            }
        }
        let want = big.generate_blocking(req(&big, PROMPTS[i])).unwrap().tokens;
        assert_eq!(toks, want, "prompt {i} changed by preemption");
    }
    assert!(preempted > 0, "the budget was meant to force preemption");
    assert_eq!(
        small
            .metrics
            .preemptions_total
            .load(std::sync::atomic::Ordering::Relaxed),
        preempted as u64
    );
    assert_eq!(
        small
            .metrics
            .kv_blocks_used
            .load(std::sync::atomic::Ordering::Relaxed),
        0,
        "all blocks freed"
    );
}

#[test]
fn greedy_completion_knows_paris() {
    let e = engine(EngineSettings {
        kv_budget: KvBudget::Bytes(16 << 20),
        ..Default::default()
    });
    let out = e
        .generate_blocking(GenerateRequest {
            prompt_tokens: e.tokenizer.encode("The capital of France is").unwrap(),
            params: SamplingParams::greedy(12),
        })
        .unwrap();
    assert!(out.text.contains("Paris"), "{:?}", out.text);
}
