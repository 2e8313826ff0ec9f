//! envelope-cuda's integration tests, one binary: each file below is a module.

mod decode_split;
mod gemm_tiling;
mod kernel_emu;
mod nvrtc_compile;
