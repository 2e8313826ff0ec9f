use super::*;
use crate::config::RopeStyle;
use crate::model::{Backend, Norm, Proj};
use crate::precision::KvDtype;
use candle_core::{Device as CDevice, Tensor};

#[test]
fn precisions_map_to_activation_dtypes() {
    assert_eq!(activation_dtype(Precision::F32).unwrap(), DType::F32);
    assert_eq!(activation_dtype(Precision::Fp8).unwrap(), DType::Bf16);
    assert_eq!(activation_dtype(Precision::AsStored).unwrap(), DType::Bf16);
    let e = activation_dtype(Precision::Q4_0).unwrap_err().to_string();
    assert!(e.contains("CPU kernels"), "{e}");
}

#[test]
fn kv_dtype_pairs_follow_the_kernels() {
    assert_eq!(kv_dtype(DType::F32, KvDtype::Bf16).unwrap(), DType::Bf16);
    assert_eq!(kv_dtype(DType::Bf16, KvDtype::Bf16).unwrap(), DType::Bf16);
    let e = kv_dtype(DType::Bf16, KvDtype::F32).unwrap_err().to_string();
    assert!(e.contains("--kv-dtype bf16"), "{e}");
    assert!(kv_dtype(DType::F16, KvDtype::Bf16).is_err());
    // Every accepted pair has kernels.
    for act in [DType::F32, DType::F16, DType::Bf16] {
        for kv in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
            if let Ok(c) = kv_dtype(act, kv) {
                // Decode attention, and the merge of its split.
                for entry in [
                    format!("paged_attention_decode_{}_{}", act.suffix(), c.suffix()),
                    format!("paged_attention_merge_{}", act.suffix()),
                ] {
                    let found = envelope_cuda::kernels::KERNELS
                        .iter()
                        .any(|k| k.entries.contains(&entry.as_str()));
                    assert!(found, "{entry}");
                }
            }
        }
    }
}

/// What `--device auto` falls back to the CPU for.
#[test]
fn what_cannot_run_on_cuda() {
    assert!(check_runs_on_cuda(Precision::Q8_0, None).is_err());
    assert!(check_runs_on_cuda(Precision::Bf16, Some(KvDtype::F32)).is_err());
    assert!(check_runs_on_cuda(Precision::Bf16, None).is_ok());
    assert!(check_runs_on_cuda(Precision::F32, Some(KvDtype::Bf16)).is_ok());
    assert!(check_runs_on_cuda(Precision::Fp8, Some(KvDtype::Bf16)).is_ok());
}

#[test]
fn the_default_kv_dtype_is_always_accepted() {
    for p in Precision::ALL {
        if let Ok(act) = activation_dtype(p) {
            let kv = default_kv_dtype(p);
            assert_eq!(kv_dtype(act, kv).unwrap(), act, "{p}");
        }
    }
}

#[test]
fn step_meta_of_a_mixed_batch() {
    // A 5-token prefill chunk at 0 (blocks 7, 2) and a decode at 9 (blocks 4, 1, 3).
    let (t0, t1) = ([7u32, 2], [4u32, 1, 3]);
    let chunks = [
        SeqChunk {
            tokens: &[1, 2, 3, 4, 5],
            start_pos: 0,
            block_table: &t0,
            want_logits: true,
        },
        SeqChunk {
            tokens: &[9],
            start_pos: 9,
            block_table: &t1,
            want_logits: true,
        },
    ];
    let step = StepBatch::new(&chunks);
    let m = StepMeta::build(&step, 4).unwrap();
    assert_eq!(m.positions, vec![0, 1, 2, 3, 4, 9]);
    assert_eq!(m.slots, vec![28, 29, 30, 31, 8, 3 * 4 + 1]);
    assert_eq!(m.max_blocks_per_seq, 3);
    assert_eq!(m.tables, vec![7, 2, 0, 4, 1, 3]);
    assert_eq!(m.context_lens, vec![5, 10]);
    assert_eq!(m.cu_q_lens, vec![0, 5, 6]);
    assert_eq!(m.max_q_len, 5);
    assert!(!m.is_decode);
    assert_eq!(step.logit_rows, vec![4, 5]);
    // A table too short for its chunk is an error, not a wild write.
    let short = [SeqChunk {
        tokens: &[1, 2],
        start_pos: 3,
        block_table: &t0[..1],
        want_logits: false,
    }];
    assert!(StepMeta::build(&StepBatch::new(&short), 4).is_err());
}

/// The CUDA backend's data flow on the CPU: the same [`StepMeta`]
/// (positions, slot mapping, flattened block tables, context lengths,
/// cumulative query lengths) feeding the CPU references of the kernels
/// (`envelope_cuda::reference`: RoPE, KV append, paged attention), run
/// through the shared [`model::forward`] over several steps (a prefill,
/// then a chunked prefill beside a decode, then pure decodes, with
/// scattered blocks) must give the CPU engine's logits. On a GPU the
/// kernels are then checked against these references (cuda-selftest).
#[test]
fn kernel_references_through_step_meta_match_the_cpu_engine() {
    use crate::kv_cache::KvPool;
    use envelope_cuda::reference as r;
    struct RefBackend<'a> {
        m: &'a crate::model::Model,
        meta: StepMeta,
        k: &'a mut Vec<Vec<f32>>,
        v: &'a mut Vec<Vec<f32>>,
        block_size: usize,
    }
    fn t(x: &[f32], rows: usize) -> Tensor {
        Tensor::from_vec(x.to_vec(), (rows, x.len() / rows), &CDevice::Cpu).unwrap()
    }
    fn v(x: &Tensor) -> Vec<f32> {
        x.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }
    impl Backend for RefBackend<'_> {
        type Act = Tensor;
        fn embed(&mut self, step: &StepBatch) -> Result<Tensor> {
            self.m.weights.embedding.rows(&step.ids)
        }
        fn rms_norm(&mut self, x: &Tensor, w: Norm) -> Result<Tensor> {
            let ws = &self.m.weights;
            let w = match w {
                Norm::Attn(l) => &ws.layers[l].attn_norm,
                Norm::Ffn(l) => &ws.layers[l].ffn_norm,
                Norm::Final => &ws.final_norm,
            };
            let eps = self.m.config.rms_norm_eps as f32;
            Ok(t(&r::rmsnorm(&v(x), &v(w), eps), x.dims()[0]))
        }
        fn qkv(&mut self, layer: usize, x: &Tensor) -> Result<[Tensor; 3]> {
            let l = &self.m.weights.layers[layer];
            Ok([l.wq.forward(x)?, l.wk.forward(x)?, l.wv.forward(x)?])
        }
        fn attention(
            &mut self,
            layer: usize,
            step: &StepBatch,
            qkv: [Tensor; 3],
        ) -> Result<Tensor> {
            let c = &self.m.config;
            let n = step.ids.len();
            let (mut q, mut k, vv) = (v(&qkv[0]), v(&qkv[1]), v(&qkv[2]));
            let f = r::inv_freq(c.rope_theta, c.head_dim);
            let il = c.rope_style == RopeStyle::Interleaved;
            r::rope(&mut q, &self.meta.positions, &f, c.num_heads, il);
            r::rope(&mut k, &self.meta.positions, &f, c.num_kv_heads, il);
            let stride = c.num_kv_heads * c.head_dim;
            r::kv_append(
                &k,
                &vv,
                &mut self.k[layer],
                &mut self.v[layer],
                &self.meta.slots,
                stride,
            );
            let out = r::paged_attention(
                &q,
                &self.k[layer],
                &self.v[layer],
                &self.meta.tables,
                &self.meta.cu_q_lens,
                &self.meta.context_lens,
                r::AttnShape {
                    num_heads: c.num_heads,
                    num_kv_heads: c.num_kv_heads,
                    head_dim: c.head_dim,
                    block_size: self.block_size,
                    max_blocks_per_seq: self.meta.max_blocks_per_seq,
                },
            );
            Ok(t(&out, n))
        }
        fn add_projection(
            &mut self,
            layer: usize,
            w: Proj,
            a: &Tensor,
            x: &mut Tensor,
        ) -> Result<()> {
            let l = &self.m.weights.layers[layer];
            let w = if w == Proj::Out { &l.wo } else { &l.w_down };
            let y = v(&w.forward(a)?);
            *x = t(&r::residual_add(&v(x), &y), x.dims()[0]);
            Ok(())
        }
        fn swiglu(&mut self, layer: usize, x: &Tensor) -> Result<Tensor> {
            let l = &self.m.weights.layers[layer];
            let (g, u) = (v(&l.w_gate.forward(x)?), v(&l.w_up.forward(x)?));
            Ok(t(&r::silu_mul(&g, &u), x.dims()[0]))
        }
        fn select_rows(&mut self, x: &Tensor, rows: &[u32]) -> Result<Tensor> {
            Ok(t(&r::embedding(rows, &v(x), x.dims()[1]), rows.len()))
        }
        fn lm_head(&mut self, x: &Tensor) -> Result<Tensor> {
            self.m.weights.lm_head.forward(x)
        }
    }

    let loaded = crate::load::load(
        "dummy:tiny@5",
        &crate::load::LoadOptions {
            precision: Precision::F32,
            tokenizer: None,
        },
    )
    .unwrap();
    let m = &loaded.model;
    let bs = 4;
    let g = KvGeometry {
        num_layers: m.config.num_layers,
        num_blocks: 16,
        block_size: bs,
        num_kv_heads: m.config.num_kv_heads,
        head_dim: m.config.head_dim,
    };
    let mut pool = KvPool::new(g, KvDtype::F32);
    let mut k = vec![vec![0f32; g.layer_elems()]; g.num_layers];
    let mut vc = k.clone();
    let (ta, tb) = ([9u32, 3, 12, 0], [5u32, 14, 1, 7]);
    let a: Vec<u32> = (0..13).map(|i| 20 + i * 7).collect();
    let b: Vec<u32> = (0..9).map(|i| 300 - i * 11).collect();
    // (seq a range, start), (seq b range, start): prefill a; a decodes
    // while b prefills in two chunks; then both decode.
    // (tokens, start position, block table) per chunk.
    type Chunk<'a> = (&'a [u32], usize, &'a [u32]);
    let steps: Vec<Vec<Chunk>> = vec![
        vec![(&a[..10], 0, &ta)],
        vec![(&a[10..11], 10, &ta), (&b[..5], 0, &tb)],
        vec![(&a[11..12], 11, &ta), (&b[5..8], 5, &tb)],
        vec![(&a[12..13], 12, &ta), (&b[8..9], 8, &tb)],
    ];
    for (i, st) in steps.iter().enumerate() {
        let chunks: Vec<SeqChunk> = st
            .iter()
            .map(|&(tokens, start_pos, block_table)| SeqChunk {
                tokens,
                start_pos,
                block_table,
                want_logits: true,
            })
            .collect();
        let want = v(&m.forward(&mut pool, &chunks).unwrap().unwrap());
        let step = StepBatch::new(&chunks);
        let mut rb = RefBackend {
            m,
            meta: StepMeta::build(&step, bs).unwrap(),
            k: &mut k,
            v: &mut vc,
            block_size: bs,
        };
        assert_eq!(rb.meta.is_decode, i == 3);
        let got = v(&model::forward(&m.config, &mut rb, &step).unwrap().unwrap());
        assert_eq!(got.len(), want.len());
        for (j, (x, y)) in got.iter().zip(&want).enumerate() {
            assert!(
                (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                "step {i} logit {j}: {x} vs {y}"
            );
        }
        if rb.meta.is_decode {
            // The same decode step as a CUDA graph runs it: padded to a
            // bucket of 4 rows and 16-wide block tables. Padding rows
            // repeat the shortest-context row (b's, row 1: its token,
            // position and table, as `padded_inputs` repeats its id)
            // and write no KV. Real rows give the same logits, padding
            // rows row 1's, and the cache is unchanged.
            let padded = rb.meta.padded(4, 16).unwrap();
            let r = rb.meta.pad_row();
            assert_eq!(r, 1);
            let mut pchunks = chunks.clone();
            pchunks.extend((0..2).map(|_| chunks[r]));
            let pstep = StepBatch::new(&pchunks);
            let (k_before, v_before) = (k.clone(), vc.clone());
            let mut pb = RefBackend {
                m,
                meta: padded,
                k: &mut k,
                v: &mut vc,
                block_size: bs,
            };
            let pgot = v(&model::forward(&m.config, &mut pb, &pstep).unwrap().unwrap());
            let vocab = m.config.vocab_size;
            assert_eq!(pgot.len(), 4 * vocab);
            for (j, (x, y)) in pgot[..2 * vocab].iter().zip(&want).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                    "padded decode logit {j}: {x} vs {y}"
                );
            }
            let row1 = &want[vocab..2 * vocab];
            for pad in [2, 3] {
                let got = &pgot[pad * vocab..(pad + 1) * vocab];
                for (x, y) in got.iter().zip(row1) {
                    assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "padding row {pad}");
                }
            }
            // The real rows rewrote their own slots with the same values
            // (to rounding: a 4-row GEMM may sum in another order); the
            // padding rows wrote nothing.
            let caches = k.iter().zip(&k_before).chain(vc.iter().zip(&v_before));
            for (layer, (now, was)) in caches.enumerate() {
                let worst = now
                    .iter()
                    .zip(was)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(worst <= 1e-5, "layer {layer}: K moved by {worst}");
            }
        }
    }
}

#[test]
fn activation_reserve_grows_with_the_step() {
    let c = crate::config::preset("llama-3.1-8b").unwrap();
    let small = activation_bytes(&c, DType::Bf16, 1, 1);
    let big = activation_bytes(&c, DType::Bf16, 8192, 256);
    assert!(small >= 512 << 20);
    // 8192 tokens x (3h + 2q + 2kv + 3f) x 2 bytes alone is over 1 GiB.
    assert!(big - small > 1 << 30, "{big}");
    // The split decode's records: 512 pairs x 256 partitions (128k
    // positions) x 130 f32.
    let mut short = c.clone();
    short.max_position_embeddings = 512;
    assert_eq!(
        small - activation_bytes(&short, DType::Bf16, 1, 1),
        512 * 255 * 130 * 4
    );
}

/// Without a GPU, loading on CUDA is an error that names the cause.
#[test]
fn loading_without_a_gpu_is_an_error() {
    let src = ModelSource::parse("dummy:tiny").unwrap();
    let cfg = crate::config::preset("tiny").unwrap();
    match CudaModel::load(&src, &cfg, Precision::Bf16, 0) {
        Ok(m) => eprintln!("a GPU is present: {}", m.gpu.device.info.name),
        Err(e) => {
            let m = e.to_string();
            if envelope_cuda::libs::probe(envelope_cuda::libs::CudaLib::Driver).is_err() {
                assert!(m.contains("libcuda.so"), "{m}");
            }
        }
    }
}
