//! Shared by the real-weight tests: where the SmolLM2 GGUF lives.
#![allow(dead_code)]

use std::path::PathBuf;

/// `ENVELOPE_TEST_MODEL`, or `models/SmolLM2-135M-Instruct.Q4_1.gguf` at the
/// workspace root (`scripts/fetch-model.sh` puts it there).
pub fn smollm2_path() -> PathBuf {
    if let Ok(p) = std::env::var("ENVELOPE_TEST_MODEL") {
        return PathBuf::from(p);
    }
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-model.sh first",
        p.display()
    );
    p
}
