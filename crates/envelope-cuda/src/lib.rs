//! envelope's CUDA runtime: device discovery, runtime-compiled
//! kernels, GEMMs and the GPU self-test, built and tested without a GPU.
//!
//! - [`device`]: [`Device::open`] finds the driver and the GPU, or returns
//!   a [`CudaError`] that names what is missing. Never a panic: the
//!   libraries are probed with our own `dlopen` first ([`libs`]) and cudarc
//!   calls run under `catch_unwind`.
//! - [`kernels`] and [`compile`]: the `.cu` sources of the repository's
//!   `kernels/`, embedded, compiled at run time by NVRTC ([`nvrtc`]) for the
//!   device's compute capability and cached on disk. [`embedded`]: their
//!   PTX made at development time, for machines with a driver and no CUDA
//!   toolkit, and the choice between the toolkit's parts (NVRTC, cuBLAS)
//!   and the built-in ones (embedded PTX, `kernels/gemm.cu`).
//! - [`geometry`]: launch geometry per kernel, block-table flattening, slot
//!   mappings, CUDA-graph batch buckets. [`fp8`]: e4m3 scales and the
//!   compute-capability gate. [`memory`]: KV pool size from free memory and
//!   a utilisation fraction, or an explicit budget.
//! - [`reference`]: the CPU implementation every kernel is checked against;
//!   [`selftest`] runs that check through [`runtime`]'s methods on a GPU
//!   (`envelope cuda-selftest`), or on the CPU-emulated kernels behind the
//!   fake driver of [`emu`]. [`rng`]: the seeded inputs.
//! - [`setting`]: `--device cpu|cuda[:N]|auto`.
//!
//! # CUDA version
//! cudarc is built with `fallback-dynamic-loading` (no CUDA at build time)
//! and the fixed version feature `cuda-13000`. The GPU machines this project
//! measures on run driver 580 (CUDA 13.0) with the CUDA 13.0 toolkit and
//! CUDA 13 pip wheels (`libcublas.so.13`, `libnvrtc.so.13`). cudarc derives
//! the library names it looks for from the version feature, and with a 12.x
//! feature it would look for `libcublas.so.12`, which those machines do not
//! have. The price: a driver older than CUDA 13.0 (below 580) is not
//! supported; such a machine gets a clear error, not a crash. The NVRTC
//! used for the CI compile check is pinned to 13.0 as well, since PTX from a
//! newer NVRTC does not load on an older driver.
//!
//! [`runtime`] puts it together: an opened device with every kernel loaded,
//! cuBLAS/cuBLASLt GEMMs (or the GEMM kernels) and one method per kernel;
//! `envelope-engine`'s `cuda` module runs the model on it (with CUDA graphs
//! for decode steps). Nothing here has run on a GPU yet.

pub mod compile;
pub mod device;
pub mod embedded;
pub mod emu;
pub mod error;
pub mod fp8;
pub mod gemm_bench;
pub mod geometry;
pub mod kernels;
pub mod libs;
pub mod memory;
pub mod nvrtc;
pub mod outputs;
pub mod ptxgen;
pub mod reference;
pub mod rng;
pub mod runtime;
pub mod selftest;
pub mod setting;

pub use device::{Device, DeviceInfo};
pub use error::{CudaError, Result};
pub use setting::{select, DeviceSetting, SelectError, Selected};
