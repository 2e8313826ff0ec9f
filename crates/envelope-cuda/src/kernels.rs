//! The kernels, from the `envelope-kernels` crate (the repository's
//! top-level `kernels/`): sources, entry points and committed PTX.

pub use envelope_kernels::{find, KernelSource, HEADERS, KERNELS};
