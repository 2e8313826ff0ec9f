//! The other two model sources: `dummy:` presets and Hugging Face
//! safetensors directories, and precision conversion at load.

use candle_core::{DType, Tensor};
use envelope_engine::engine::prompt_logits;
use envelope_engine::linear::Matrix;
use envelope_engine::*;
use std::collections::HashMap;

fn generate(m: LoadedModel, prompt: &str, n: usize) -> (Vec<u32>, String) {
    let ids = m.tokenizer.encode(prompt).unwrap();
    let h = EngineHandle::spawn(
        m,
        &EngineSettings {
            kv_budget: KvBudget::Bytes(8 << 20),
            ..Default::default()
        },
    )
    .unwrap();
    let out = h
        .generate_blocking(GenerateRequest {
            prompt_tokens: ids,
            params: SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(n)
            },
        })
        .unwrap();
    (out.tokens, out.text)
}

#[test]
fn dummy_tiny_loads_and_generates_deterministically() {
    let a = load("dummy:tiny", &LoadOptions::default()).unwrap();
    assert_eq!(a.info.tokenizer, "bytes");
    assert_eq!(a.info.weights.formats, vec!["bf16".to_string()]);
    let (ta, _) = generate(a, "hello", 20);
    let (tb, _) = generate(
        load("dummy:tiny", &LoadOptions::default()).unwrap(),
        "hello",
        20,
    );
    let (tc, _) = generate(
        load("dummy:tiny@1", &LoadOptions::default()).unwrap(),
        "hello",
        20,
    );
    assert_eq!(ta.len(), 20);
    assert_eq!(ta, tb, "same seed, same weights, same tokens");
    assert_ne!(ta, tc, "another seed gives other weights");
}

#[test]
fn precision_conversion_reports_exact_weight_bytes() {
    let cfg = config::preset("tiny").unwrap();
    let params = cfg.num_parameters();
    let norms = (2 * cfg.num_layers + 1) * cfg.hidden_size * 4; // norms stay f32
    let matrices = params - (2 * cfg.num_layers + 1) * cfg.hidden_size;
    let bytes = |p: Precision| {
        load(
            "dummy:tiny",
            &LoadOptions {
                precision: p,
                ..Default::default()
            },
        )
        .unwrap()
        .info
        .weights
        .total_bytes
    };
    assert_eq!(bytes(Precision::F32), matrices * 4 + norms);
    assert_eq!(bytes(Precision::F16), matrices * 2 + norms);
    assert_eq!(bytes(Precision::Bf16), matrices * 2 + norms);
    // q8_0: 34 bytes per 32 weights; q4_0: 18 bytes per 32.
    assert_eq!(bytes(Precision::Q8_0), matrices / 32 * 34 + norms);
    assert_eq!(bytes(Precision::Q4_0), matrices / 32 * 18 + norms);
    // fp8: layer matrices one byte per weight plus a 4-byte scale each (7
    // per layer); the tied embedding stays bf16.
    let emb = cfg.vocab_size * cfg.hidden_size;
    assert_eq!(
        bytes(Precision::Fp8),
        (matrices - emb) + 7 * cfg.num_layers * 4 + emb * 2 + norms
    );
    for p in [
        Precision::F16,
        Precision::Q8_0,
        Precision::Q4_0,
        Precision::Fp8,
    ] {
        let (t, _) = generate(
            load(
                "dummy:tiny",
                &LoadOptions {
                    precision: p,
                    ..Default::default()
                },
            )
            .unwrap(),
            "abc",
            5,
        );
        assert_eq!(t.len(), 5, "{p}");
    }
}

/// A byte-level BPE tokenizer.json with no merges: 256 byte symbols + 3 specials.
fn write_tokenizer(path: &std::path::Path) {
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    let mut vocab: tokenizers::models::bpe::Vocab = Default::default();
    for (i, c) in ByteLevel::alphabet().into_iter().enumerate() {
        vocab.insert(c.to_string(), i as u32 + 3);
    }
    vocab.insert("<pad>".into(), 0);
    vocab.insert("<s>".into(), 1);
    vocab.insert("</s>".into(), 2);
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, vec![])
        .build()
        .unwrap();
    let mut t = tokenizers::Tokenizer::new(bpe);
    t.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    t.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::default()));
    t.add_special_tokens(vec![tokenizers::AddedToken::from("</s>", true)])
        .unwrap();
    t.save(path, false).unwrap();
}

#[test]
fn hf_safetensors_directory_loads_and_matches_the_same_weights() {
    // Write dummy:tiny's weights (as f32) under Hugging Face names, then load
    // that directory: the forward pass must give the same logits.
    let dummy = load(
        "dummy:tiny",
        &LoadOptions {
            precision: Precision::F32,
            ..Default::default()
        },
    )
    .unwrap();
    let cfg = dummy.model.config.clone();
    let dir = std::env::temp_dir().join(format!("envelope-hf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let dense = |m: &Matrix| match m {
        Matrix::Dense(t) => t.clone(),
        Matrix::Quant(_) | Matrix::Blocks(_) | Matrix::Fp8(_) => panic!("f32 load is dense"),
    };
    let w = &dummy.model.weights;
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    tensors.insert(
        "model.embed_tokens.weight".into(),
        dense(&w.embedding).to_dtype(DType::BF16).unwrap(),
    );
    tensors.insert("model.norm.weight".into(), w.final_norm.clone());
    for (i, l) in w.layers.iter().enumerate() {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        tensors.insert(p("input_layernorm.weight"), l.attn_norm.clone());
        tensors.insert(p("post_attention_layernorm.weight"), l.ffn_norm.clone());
        for (name, lin) in [
            ("self_attn.q_proj", &l.wq),
            ("self_attn.k_proj", &l.wk),
            ("self_attn.v_proj", &l.wv),
            ("self_attn.o_proj", &l.wo),
            ("mlp.gate_proj", &l.w_gate),
            ("mlp.up_proj", &l.w_up),
            ("mlp.down_proj", &l.w_down),
        ] {
            // Stored as bf16 on disk, as most checkpoints are.
            tensors.insert(
                p(&format!("{name}.weight")),
                dense(lin.weight()).to_dtype(DType::BF16).unwrap(),
            );
        }
    }
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    let config = serde_json::json!({
        "model_type": "llama", "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings, "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": true, "bos_token_id": 1, "eos_token_id": 2
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    write_tokenizer(&dir.join("tokenizer.json"));
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::json!({"chat_template": "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]", "bos_token": "<s>", "eos_token": "</s>"}).to_string(),
    )
    .unwrap();

    let hf = load(dir.to_str().unwrap(), &LoadOptions::default()).unwrap();
    assert_eq!(hf.model.config.num_layers, cfg.num_layers);
    assert_eq!(hf.info.tokenizer, "bpe");
    assert!(
        hf.info.weights.formats.contains(&"bf16".to_string()),
        "{:?}",
        hf.info.weights.formats
    );
    let prompt = [40u32, 41, 42, 43, 44];
    let a = prompt_logits(&hf.model, &prompt, KvDtype::F32).unwrap();
    // The dummy model with its matrices rounded to bf16 the same way.
    let dummy_bf16 = load("dummy:tiny", &LoadOptions::default()).unwrap();
    let b = prompt_logits(&dummy_bf16.model, &prompt, KvDtype::F32).unwrap();
    let max = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(max < 1e-5, "max |diff| {max}");
    let chat = hf
        .chat_template
        .render(
            &[ChatMessage {
                role: "user".into(),
                content: "hi".into(),
            }],
            true,
        )
        .unwrap();
    assert_eq!(chat, "[user]hi[assistant]");
    let (toks, _) = generate(hf, "hello", 8);
    assert_eq!(toks.len(), 8);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_sources_give_clear_errors() {
    let err = |spec: &str| {
        load(spec, &LoadOptions::default())
            .err()
            .expect("should fail")
            .to_string()
    };
    assert!(err("dummy:nope").contains("known: tiny"));
    assert!(err("/definitely/not/here.gguf").contains("/definitely/not/here.gguf"));
    let dir = std::env::temp_dir().join(format!("envelope-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), "{\"hidden_size\": 8}").unwrap();
    let e = err(dir.to_str().unwrap());
    assert!(e.contains("config.json"), "{e}");
    let f = dir.join("junk.gguf");
    std::fs::write(&f, b"not a gguf").unwrap();
    assert!(err(f.to_str().unwrap()).contains("junk.gguf"));
    std::fs::remove_dir_all(&dir).ok();
}
