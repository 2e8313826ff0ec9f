//! `cargo run --release -p envelope-cuda --example gen_ptx [KERNELS_DIR]`:
//! regenerates `KERNELS_DIR/ptx/` (default: the repository's `kernels/`)
//! with the NVRTC that `ENVELOPE_NVRTC_LIB` names (or the first one found)
//! and the CUDA headers of `ENVELOPE_CUDA_INCLUDE`; `scripts/gen-ptx.sh`
//! sets both to the pinned wheel's. See `envelope_cuda::ptxgen`.

use envelope_cuda::compile::include_dir;
use envelope_cuda::nvrtc::Nvrtc;
use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let kernels = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../kernels")));
    let run = || -> envelope_cuda::Result<()> {
        let nvrtc = Nvrtc::load()?;
        let (ma, mi) = nvrtc.version()?;
        if (ma, mi) != envelope_cuda::embedded::NVRTC {
            eprintln!(
                "warning: NVRTC {ma}.{mi} is not the pinned {}.{}: CI will find the PTX differs",
                envelope_cuda::embedded::NVRTC.0,
                envelope_cuda::embedded::NVRTC.1
            );
        }
        let include = include_dir()?;
        for w in
            envelope_cuda::ptxgen::regenerate(&nvrtc, &include, &kernels, &kernels.join("ptx"))?
        {
            println!("{}: {} bytes", w.path.display(), w.bytes);
        }
        Ok(())
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gen_ptx: {e}");
            ExitCode::FAILURE
        }
    }
}
