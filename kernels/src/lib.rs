//! envelope's CUDA kernels as data: the `.cu` sources in this folder (one
//! concern per file) with the entry points each must export (`extern "C"`
//! instantiations per dtype; envelope-cuda's compile check verifies every
//! one is in the PTX), their PTX for compute_80 and compute_90 in `ptx/`
//! (made by `scripts/gen-ptx.sh`, for machines with a driver but no
//! NVRTC), the SHA-256 of each source that PTX was made from, and the
//! headers of the CPU emulator that runs the same sources without a GPU
//! (`emu/`). Everything is embedded with `include_str!` from inside this
//! crate: building needs no CUDA and no build script. envelope-cuda
//! compiles, loads and launches them.

/// One `.cu` file.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// File name in `kernels/`.
    pub file: &'static str,
    pub source: &'static str,
    pub entries: &'static [&'static str],
    /// Its PTX for compute_80 and compute_90 (`ptx/`), made by
    /// `scripts/gen-ptx.sh`, for machines without NVRTC.
    pub ptx: [&'static str; 2],
}

/// Headers the kernels `#include "..."`, handed to NVRTC in memory.
pub const HEADERS: &[(&str, &str)] = &[("common.cuh", include_str!("../common.cuh"))];

macro_rules! k {
    ($stem:literal, [$($e:literal),* $(,)?]) => {
        KernelSource {
            file: concat!($stem, ".cu"),
            source: include_str!(concat!("../", $stem, ".cu")),
            entries: &[$($e),*],
            ptx: [
                include_str!(concat!("../ptx/", $stem, ".compute_80.ptx")),
                include_str!(concat!("../ptx/", $stem, ".compute_90.ptx")),
            ],
        }
    };
}

pub const KERNELS: &[KernelSource] = &[
    k!(
        "embedding",
        ["embedding_f32", "embedding_f16", "embedding_bf16"]
    ),
    k!("rmsnorm", ["rmsnorm_f32", "rmsnorm_f16", "rmsnorm_bf16"]),
    k!("rope", ["rope_f32", "rope_f16", "rope_bf16"]),
    k!(
        "silu_mul",
        ["silu_mul_f32", "silu_mul_f16", "silu_mul_bf16"]
    ),
    k!(
        "residual_add",
        [
            "residual_add_f32",
            "residual_add_f16",
            "residual_add_bf16",
            "bias_add_f32",
            "bias_add_f16",
            "bias_add_bf16"
        ]
    ),
    k!(
        "kv_append",
        [
            "kv_append_f32_f32",
            "kv_append_f32_f16",
            "kv_append_f32_bf16",
            "kv_append_f16_f16",
            "kv_append_bf16_bf16"
        ]
    ),
    k!(
        "paged_attention",
        [
            "paged_attention_decode_f32_f32",
            "paged_attention_decode_f32_f16",
            "paged_attention_decode_f32_bf16",
            "paged_attention_decode_f16_f16",
            "paged_attention_decode_bf16_bf16",
            "paged_attention_merge_f32",
            "paged_attention_merge_f16",
            "paged_attention_merge_bf16"
        ]
    ),
    k!(
        "prefill_attention",
        [
            "prefill_attention_f32_f32",
            "prefill_attention_f32_f16",
            "prefill_attention_f32_bf16",
            "prefill_attention_f16_f16",
            "prefill_attention_bf16_bf16"
        ]
    ),
    k!(
        "dequant",
        [
            "dequant_q4_0_f32",
            "dequant_q4_0_f16",
            "dequant_q4_0_bf16",
            "dequant_q4_1_f32",
            "dequant_q4_1_f16",
            "dequant_q4_1_bf16",
            "dequant_q8_0_f32",
            "dequant_q8_0_f16",
            "dequant_q8_0_bf16"
        ]
    ),
    k!(
        "sampling",
        [
            "argmax_f32",
            "argmax_f16",
            "argmax_bf16",
            "sample_f32",
            "sample_f16",
            "sample_bf16"
        ]
    ),
    k!(
        "gemm",
        [
            "gemm_f32_f32",
            "gemm_f16_f16",
            "gemm_f16_f32",
            "gemm_bf16_bf16",
            "gemm_bf16_f32",
            "gemm_fp8_bf16",
            "gemm_small_f32_f32",
            "gemm_small_f16_f16",
            "gemm_small_f16_f32",
            "gemm_small_bf16_bf16",
            "gemm_small_bf16_f32",
            "gemm_small_fp8_bf16"
        ]
    ),
    k!(
        "dummy",
        ["dummy_fill_f32", "dummy_fill_f16", "dummy_fill_bf16"]
    ),
    k!(
        "fp8",
        [
            "absmax_f32",
            "absmax_f16",
            "absmax_bf16",
            "quant_fp8_f32",
            "quant_fp8_f16",
            "quant_fp8_bf16"
        ]
    ),
];

/// The kernel file named `file` (`rope.cu`).
pub fn find(file: &str) -> Option<&'static KernelSource> {
    KERNELS.iter().find(|k| k.file == file)
}

/// `ptx/SOURCES`: `<file> <sha256>` per line (`#` comments), the sources
/// the committed PTX was made from.
pub const PTX_SOURCES: &str = include_str!("../ptx/SOURCES");

/// The CPU emulator's sources (`emu/`): the emulation header and the CUDA
/// headers it stands in for.
pub const EMU_HEADERS: &[(&str, &str)] = &[
    ("emu.h", include_str!("../emu/emu.h")),
    ("cuda_fp16.h", include_str!("../emu/cuda_fp16.h")),
    ("cuda_bf16.h", include_str!("../emu/cuda_bf16.h")),
    ("cuda_fp8.h", include_str!("../emu/cuda_fp8.h")),
];

/// The emulator's fake CUDA driver (`libcuda.so.1`), in C++.
pub const EMU_DRIVER: &str = include_str!("../emu/fake_cuda.cpp");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_cu_file_here_is_listed() {
        let dir = env!("CARGO_MANIFEST_DIR");
        let mut seen = 0;
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.ends_with(".cu") {
                assert!(find(&name).is_some(), "kernels/{name} is not in KERNELS");
                seen += 1;
            }
        }
        assert_eq!(seen, KERNELS.len());
    }

    #[test]
    fn every_listed_kernel_has_its_ptx_digest() {
        for k in KERNELS {
            assert!(
                PTX_SOURCES
                    .lines()
                    .any(|l| l.split_whitespace().next() == Some(k.file)),
                "{} is not in ptx/SOURCES",
                k.file
            );
        }
    }
}
