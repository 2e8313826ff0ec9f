//! The CI check that needs no GPU: every kernel in `kernels/` compiles to
//! PTX for compute_80 (A100) and compute_90 (H100/H200) through NVRTC, the
//! PTX exports every entry point the crate expects, and it equals the PTX
//! embedded in the binary (`kernels/ptx/`, made by `scripts/gen-ptx.sh` with
//! the same pinned NVRTC) byte for byte.
//!
//! `scripts/test.sh` installs NVRTC and the CUDA headers from PyPI
//! (`scripts/nvrtc-setup.sh`) and sets `ENVELOPE_NVRTC_LIB` and
//! `ENVELOPE_CUDA_INCLUDE`. Without `ENVELOPE_NVRTC_LIB` the test is skipped
//! with a printed reason; with it, any failure (a library that does not
//! load, a missing header, a kernel that does not compile) fails the test.

use envelope_cuda::compile::{include_dir, Compiler};
use envelope_cuda::kernels::KERNELS;
use envelope_cuda::nvrtc::Nvrtc;

#[test]
fn every_kernel_compiles_for_sm80_and_sm90() {
    let Some(lib) = std::env::var_os("ENVELOPE_NVRTC_LIB") else {
        eprintln!(
            "SKIPPED: ENVELOPE_NVRTC_LIB is not set (scripts/test.sh sets it from scripts/nvrtc-setup.sh)"
        );
        return;
    };
    let nvrtc = Nvrtc::load_from(&lib.to_string_lossy())
        .unwrap_or_else(|e| panic!("ENVELOPE_NVRTC_LIB is set but NVRTC does not load: {e}"));
    let include = include_dir().unwrap_or_else(|e| panic!("{e}"));
    // No cache: the check must exercise the compiler every time.
    let compiler = Compiler::with(nvrtc, include, None).unwrap_or_else(|e| panic!("{e}"));
    let (ma, mi) = compiler.nvrtc_version();
    eprintln!("NVRTC {ma}.{mi} from {}", compiler.nvrtc.path);
    let mut failures = Vec::new();
    let same_nvrtc = (ma, mi) == envelope_cuda::embedded::NVRTC;
    for (ai, arch) in envelope_cuda::embedded::ARCHS.iter().enumerate() {
        for k in KERNELS {
            let t = std::time::Instant::now();
            match compiler.compile(k, arch) {
                Ok(c) => {
                    if same_nvrtc && c.ptx != k.ptx[ai] {
                        failures.push(format!(
                            "{} ({arch}): kernels/ptx/ differs from NVRTC's output: run scripts/gen-ptx.sh",
                            k.file
                        ));
                    }
                    for e in k.entries {
                        if !c.ptx.contains(&format!(".entry {e}(")) {
                            failures.push(format!(
                                "{} ({arch}): no entry point {e} in the PTX",
                                k.file
                            ));
                        }
                    }
                    eprintln!(
                        "{arch} {:<22} {:>7} bytes of PTX, {} entries, {:.2}s",
                        k.file,
                        c.ptx.len(),
                        k.entries.len(),
                        t.elapsed().as_secs_f64()
                    );
                }
                Err(e) => failures.push(e.to_string()),
            }
        }
    }
    if !same_nvrtc {
        eprintln!("NVRTC {ma}.{mi} is not the pinned one: the embedded PTX was not compared");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// The on-disk cache: a second compile of the same kernel for the same
/// architecture is read back (same PTX); another architecture is not.
#[test]
fn the_second_compile_comes_from_the_cache() {
    let Some(lib) = std::env::var_os("ENVELOPE_NVRTC_LIB") else {
        eprintln!("SKIPPED: ENVELOPE_NVRTC_LIB is not set");
        return;
    };
    let dir = std::env::temp_dir().join(format!("envelope-kernel-cache-{}", std::process::id()));
    let nvrtc = Nvrtc::load_from(&lib.to_string_lossy()).unwrap_or_else(|e| panic!("{e}"));
    let include = include_dir().unwrap_or_else(|e| panic!("{e}"));
    let c = Compiler::with(nvrtc, include, Some(dir.clone())).unwrap_or_else(|e| panic!("{e}"));
    let k = envelope_cuda::kernels::find("residual_add.cu").unwrap();
    let first = c.compile(k, "compute_80").unwrap();
    let second = c.compile(k, "compute_80").unwrap();
    let other = c.compile(k, "compute_90").unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!first.from_cache && second.from_cache && !other.from_cache);
    assert_eq!(first.ptx, second.ptx);
    assert_eq!(first.key, second.key);
    assert_ne!(first.key, other.key);
}

/// `scripts/gen-ptx.sh`'s generator, run on a copy of `kernels/`: with the
/// pinned NVRTC it writes exactly the committed `kernels/ptx/` (every PTX
/// file and `SOURCES`), and it drops the PTX of a source that is gone.
#[test]
fn the_generator_reproduces_the_committed_ptx() {
    let Some(lib) = std::env::var_os("ENVELOPE_NVRTC_LIB") else {
        eprintln!("SKIPPED: ENVELOPE_NVRTC_LIB is not set");
        return;
    };
    let nvrtc = Nvrtc::load_from(&lib.to_string_lossy()).unwrap_or_else(|e| panic!("{e}"));
    if nvrtc.version().unwrap() != envelope_cuda::embedded::NVRTC {
        eprintln!("SKIPPED: not the pinned NVRTC");
        return;
    }
    let include = include_dir().unwrap_or_else(|e| panic!("{e}"));
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kernels");
    let dir = std::env::temp_dir().join(format!("envelope-gen-ptx-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("ptx")).unwrap();
    for e in std::fs::read_dir(&repo).unwrap().flatten() {
        if e.path().is_file() {
            std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
        }
    }
    // A stale file of a source that no longer exists.
    std::fs::write(dir.join("ptx/gone.compute_80.ptx"), "old").unwrap();
    let written = envelope_cuda::ptxgen::regenerate(&nvrtc, &include, &dir, &dir.join("ptx"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(written.len(), 2 * KERNELS.len() + 1);
    assert!(!dir.join("ptx/gone.compute_80.ptx").exists());
    for w in &written {
        let name = w.path.file_name().unwrap();
        let committed = std::fs::read_to_string(repo.join("ptx").join(name)).unwrap();
        let made = std::fs::read_to_string(&w.path).unwrap();
        assert!(
            made == committed,
            "{}: the generator's output differs from kernels/ptx/",
            name.to_string_lossy()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
