//! Which precisions and KV dtypes run on CUDA, and the device memory a
//! step's activations take.

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::precision::{KvDtype, Precision};
use envelope_cuda::geometry;
use envelope_cuda::runtime::DType;

/// The activation dtype of a precision on CUDA.
///
/// # Errors
/// `q8_0` and `q4_0` (their GEMMs are CPU kernels).
pub fn activation_dtype(p: Precision) -> Result<DType> {
    Ok(match p {
        Precision::F32 => DType::F32,
        Precision::F16 => DType::F16,
        Precision::Bf16 | Precision::AsStored | Precision::Fp8 => DType::Bf16,
        Precision::Q8_0 | Precision::Q4_0 => {
            return Err(EngineError::InvalidSetting {
                field: "precision",
                message: format!(
                    "{p} GEMMs are CPU kernels; on CUDA use as-stored (GGUF Q4/Q8 blocks are dequantised to bf16 at load), bf16, f16, f32 or fp8"
                ),
            })
        }
    })
}

/// Whether a precision (and a KV dtype, when one is asked for) can run on
/// CUDA at all: `--device auto` falls back to the CPU when not.
///
/// # Errors
/// The reason, as [`activation_dtype`] and [`kv_dtype`] give it.
pub fn check_runs_on_cuda(p: Precision, kv: Option<KvDtype>) -> Result<()> {
    let act = activation_dtype(p)?;
    if let Some(k) = kv {
        kv_dtype(act, k)?;
    }
    Ok(())
}

/// The KV-cache dtype a precision gets on CUDA when none is asked for: the
/// activation dtype.
pub fn default_kv_dtype(p: Precision) -> KvDtype {
    match p {
        Precision::F32 => KvDtype::F32,
        Precision::F16 => KvDtype::F16,
        _ => KvDtype::Bf16,
    }
}

/// The KV-cache dtype on CUDA: the kernels pair f32 activations with any
/// cache dtype, and 16-bit activations with a cache of the same dtype.
///
/// # Errors
/// Any other pairing, naming the `--kv-dtype` to use.
pub fn kv_dtype(act: DType, kv: KvDtype) -> Result<DType> {
    let want = match kv {
        KvDtype::F32 => DType::F32,
        KvDtype::F16 => DType::F16,
        KvDtype::Bf16 => DType::Bf16,
    };
    if act == DType::F32 || act == want {
        return Ok(want);
    }
    Err(EngineError::InvalidSetting {
        field: "kv_dtype",
        message: format!(
            "on CUDA, {} activations need a {} KV cache (got {kv}): pass --kv-dtype {}",
            act.suffix(),
            act.suffix(),
            act.suffix()
        ),
    })
}

/// Device memory kept out of the KV pool for one step's activations: the
/// largest step (`max_tokens` tokens) holds the residual stream, a norm
/// output, Q/K/V, the attention output, gate/up/SiLU rows and an fp8 copy,
/// plus `max_rows` rows of f32 logits and the largest split decode
/// attention's partial records (at most 512 (sequence, head) pairs, one
/// partition per 512 positions of the model's context); 512 MiB more for
/// cuBLAS workspaces and the allocator.
pub fn activation_bytes(c: &ModelConfig, act: DType, max_tokens: usize, max_rows: usize) -> usize {
    let (h, q, kv, f) = (
        c.hidden_size,
        c.num_heads * c.head_dim,
        c.num_kv_heads * c.head_dim,
        c.intermediate_size,
    );
    let per_token = (3 * h + 2 * q + 2 * kv + 3 * f) * act.size() + f.max(h);
    let split_partials = 4 * geometry::decode_partials_len(
        1,
        geometry::DECODE_SPLIT_MAX_BLOCKS,
        c.head_dim,
        c.max_position_embeddings
            .div_ceil(geometry::DECODE_PARTITION)
            .max(1),
    );
    max_tokens * per_token + max_rows * c.vocab_size * 4 + split_partials + (512 << 20)
}

/// The bytes a config's weights take on CUDA in a precision, from its
/// shapes alone (f32: 4 a parameter; fp8: 1, its embeddings, LM head and
/// norms kept at 2; the rest 2): what a sweep records before a load.
pub fn weight_bytes(c: &ModelConfig, p: Precision) -> usize {
    let total = c.num_parameters();
    match p {
        Precision::F32 => total * 4,
        Precision::Fp8 => {
            let emb = c.vocab_size * c.hidden_size;
            let heads = if c.tie_word_embeddings { emb } else { 2 * emb };
            let norms = (2 * c.num_layers + 1) * c.hidden_size;
            let layer_mats = total - heads - norms;
            layer_mats + 2 * (heads + norms)
        }
        _ => total * 2,
    }
}
