//! The one error type of the crate. Every way the CUDA stack can be absent
//! (library missing, no driver, no GPU, bad ordinal) is a variant with a
//! message that says what is missing and what to do, never a panic.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// A shared library could not be opened under any candidate name.
    #[error("{library} could not be loaded (tried {tried}): {hint}")]
    LibraryMissing {
        library: &'static str,
        tried: String,
        hint: &'static str,
    },
    /// A driver call returned an error code.
    #[error("CUDA driver call {call} failed: {message}")]
    Driver { call: &'static str, message: String },
    /// The driver loaded but reports no usable GPU.
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    #[error("CUDA device {ordinal} does not exist: the driver reports {count} device(s)")]
    BadOrdinal { ordinal: usize, count: usize },
    /// cudarc panicked (a missing symbol, say): caught and turned into a value.
    #[error("the CUDA bindings panicked in {call}: {message}")]
    Panicked { call: &'static str, message: String },
    #[error("NVRTC failed to compile {kernel} for {arch}:\n{log}")]
    Compile {
        kernel: String,
        arch: String,
        log: String,
    },
    #[error("NVRTC call {call} failed: {message}")]
    Nvrtc { call: &'static str, message: String },
    #[error("no CUDA include directory with cuda_bf16.h (tried {tried}); set ENVELOPE_CUDA_INCLUDE or CUDA_HOME")]
    NoInclude { tried: String },
    #[error("kernel cache {}: {source}", path.display())]
    Cache {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The device or driver cannot run the kernels (too old).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A source or PTX file that cannot be read or written.
    #[error("{}: {source}", path.display())]
    File {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// An environment setting with a value it does not take.
    #[error("{name}={value:?} is not a valid setting: use one of {allowed}")]
    Setting {
        name: String,
        value: String,
        allowed: &'static str,
    },
    /// The CPU kernel emulator could not build or run a kernel.
    #[error("kernel emulator: {0}")]
    Emulator(String),
    #[error("{kernel}: unsupported shape: {reason}")]
    Shape {
        kernel: &'static str,
        reason: String,
    },
}

pub type Result<T> = std::result::Result<T, CudaError>;

/// Runs `f`, turning a panic inside the bindings into [`CudaError::Panicked`].
/// The second guard after probing the libraries ourselves (cudarc panics
/// when a library or symbol is missing).
pub fn guarded<T>(call: &'static str, f: impl FnOnce() -> T) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        let message = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        CudaError::Panicked { call, message }
    })
}
