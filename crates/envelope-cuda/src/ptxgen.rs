//! Regenerates the embedded PTX (`kernels/ptx/`): every `kernels/*.cu` on
//! disk compiled by NVRTC for each of [`ARCHS`] with the runtime's own
//! options ([`crate::compile::options`]), and `kernels/ptx/SOURCES`, the
//! SHA-256 of each header and source it was made from (what
//! [`crate::embedded::stale`] checks). The sources are read from disk, not
//! from the binary, so a kernel edited or added a moment ago is compiled
//! without a rebuild. `scripts/gen-ptx.sh` runs it with the pinned NVRTC
//! (`cargo run -p envelope-cuda --example gen_ptx`).

use crate::compile::options;
use crate::embedded::{digest, ARCHS};
use crate::error::{CudaError, Result};
use crate::kernels::HEADERS;
use crate::nvrtc::Nvrtc;
use std::path::{Path, PathBuf};

/// One file written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    pub path: PathBuf,
    pub bytes: usize,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> CudaError + '_ {
    move |source| CudaError::File {
        path: path.to_path_buf(),
        source,
    }
}

/// Compiles `kernels_dir/*.cu` (headers: [`HEADERS`]' names, read from
/// `kernels_dir`) into `out_dir/<stem>.<arch>.ptx`, removes PTX of sources
/// that are gone, and writes `out_dir/SOURCES`.
///
/// # Errors
/// A file that cannot be read or written, or a kernel that does not
/// compile (NVRTC's log), before anything in `out_dir` is replaced.
pub fn regenerate(
    nvrtc: &Nvrtc,
    include: &Path,
    kernels_dir: &Path,
    out_dir: &Path,
) -> Result<Vec<Written>> {
    let read = |p: PathBuf| std::fs::read_to_string(&p).map_err(io(&p));
    let headers: Vec<(&str, String)> = HEADERS
        .iter()
        .map(|(name, _)| Ok((*name, read(kernels_dir.join(name))?)))
        .collect::<Result<_>>()?;
    let header_refs: Vec<(&str, &str)> = headers.iter().map(|(n, t)| (*n, t.as_str())).collect();
    let mut sources: Vec<String> = std::fs::read_dir(kernels_dir)
        .map_err(io(kernels_dir))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".cu"))
        .collect();
    sources.sort();
    let (major, minor) = nvrtc.version()?;
    let mut manifest = vec![
        "# The sources kernels/ptx/*.ptx were compiled from (SHA-256), by".to_string(),
        format!("# scripts/gen-ptx.sh with NVRTC {major}.{minor}. Do not edit: rerun the script."),
    ];
    manifest.extend(headers.iter().map(|(n, t)| format!("{n} {}", digest(t))));
    // Everything compiles before anything is written.
    let mut outputs = vec![];
    for name in &sources {
        let text = read(kernels_dir.join(name))?;
        manifest.push(format!("{name} {}", digest(&text)));
        let stem = name.trim_end_matches(".cu");
        for arch in ARCHS {
            let opts = options(arch, include);
            let ptx = nvrtc.compile(name, &text, &header_refs, &opts, arch)?;
            outputs.push((out_dir.join(format!("{stem}.{arch}.ptx")), ptx));
        }
    }
    std::fs::create_dir_all(out_dir).map_err(io(out_dir))?;
    for e in std::fs::read_dir(out_dir).map_err(io(out_dir))?.flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "ptx") && !outputs.iter().any(|(o, _)| *o == p) {
            std::fs::remove_file(&p).map_err(io(&p))?;
        }
    }
    let mut written = vec![];
    for (path, ptx) in &outputs {
        std::fs::write(path, ptx).map_err(io(path))?;
        written.push(Written {
            path: path.clone(),
            bytes: ptx.len(),
        });
    }
    let path = out_dir.join("SOURCES");
    let text = manifest.join("\n") + "\n";
    std::fs::write(&path, &text).map_err(io(&path))?;
    written.push(Written {
        path,
        bytes: text.len(),
    });
    Ok(written)
}
