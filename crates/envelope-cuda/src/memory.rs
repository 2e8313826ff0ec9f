//! Sizing the GPU KV pool ("from NVML free memory and a
//! utilisation fraction, or an explicit byte budget"), as vLLM's
//! `gpu_memory_utilization` does: the process may grow the device's total
//! use to `utilization x total`; what others already use, the weights and
//! the activation workspace come off that, and the rest is KV blocks.

use crate::error::{CudaError, Result};

/// Memory facts at the moment of sizing, after the weights are loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryState {
    pub total_bytes: usize,
    pub free_bytes: usize,
    /// Kept free for activations, cuBLAS workspaces and CUDA graphs.
    pub workspace_bytes: usize,
}

fn err(reason: String) -> CudaError {
    CudaError::Shape {
        kernel: "KV pool",
        reason,
    }
}

/// The free bytes a pool may take: free memory less the workspace.
pub fn available_bytes(m: MemoryState) -> usize {
    m.free_bytes.saturating_sub(m.workspace_bytes)
}

/// A pool of exactly `bytes` (the engine's `KvBudget::Bytes`).
///
/// # Errors
/// When it does not fit beside the workspace; the message gives every
/// figure in bytes.
pub fn exact_pool_bytes(bytes: usize, m: MemoryState) -> Result<usize> {
    let available = available_bytes(m);
    if bytes <= available {
        return Ok(bytes);
    }
    Err(err(format!(
        "{bytes} bytes asked, {available} available ({} free - {} workspace)",
        m.free_bytes, m.workspace_bytes
    )))
}

/// The pool that grows the device's total use to `utilization` (0, 1] of
/// its memory, as vLLM's `gpu_memory_utilization`.
///
/// # Errors
/// When `utilization` is outside (0, 1] or leaves nothing for the pool.
pub fn utilization_pool_bytes(utilization: f64, m: MemoryState) -> Result<usize> {
    let u = utilization;
    if !(u > 0.0 && u <= 1.0) {
        return Err(err(format!("utilization {u} is outside (0, 1]")));
    }
    let target = (m.total_bytes as f64 * u) as usize;
    let used = m.total_bytes - m.free_bytes.min(m.total_bytes);
    // The workspace counts against the target like any other use.
    let pool = target
        .saturating_sub(used + m.workspace_bytes)
        .min(available_bytes(m));
    if pool == 0 {
        return Err(err(format!(
            "utilization {u} of {} bytes leaves nothing: {used} bytes already used, {} workspace",
            m.total_bytes, m.workspace_bytes
        )));
    }
    Ok(pool)
}

/// Whole blocks that fit in `pool_bytes`.
pub fn kv_blocks(pool_bytes: usize, bytes_per_block: usize) -> usize {
    pool_bytes.checked_div(bytes_per_block).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    const GIB: usize = 1 << 30;

    #[test]
    fn utilization_counts_what_is_already_used() {
        // 140 GiB card, 20 GiB used (weights and others), 2 GiB workspace:
        // 0.9 x 140 = 126 GiB target, minus 20 used and 2 workspace = 104
        // GiB, capped by 120 free - 2 workspace = 118.
        let m = MemoryState {
            total_bytes: 140 * GIB,
            free_bytes: 120 * GIB,
            workspace_bytes: 2 * GIB,
        };
        assert_eq!(utilization_pool_bytes(0.9, m).unwrap(), 104 * GIB);
        // At 1.0 the free memory minus workspace binds.
        assert_eq!(utilization_pool_bytes(1.0, m).unwrap(), 118 * GIB);
        // Using less than is already used leaves nothing.
        assert!(utilization_pool_bytes(0.1, m).is_err());
        assert!(utilization_pool_bytes(0.0, m).is_err());
        assert!(utilization_pool_bytes(1.5, m).is_err());
    }

    #[test]
    fn explicit_bytes_must_fit() {
        let m = MemoryState {
            total_bytes: 80 * GIB,
            free_bytes: 10 * GIB,
            workspace_bytes: GIB,
        };
        assert_eq!(exact_pool_bytes(9 * GIB, m).unwrap(), 9 * GIB);
        let e = exact_pool_bytes(9 * GIB + 1, m).unwrap_err();
        assert!(e.to_string().contains("available"), "{e}");
    }

    #[test]
    fn blocks_round_down() {
        assert_eq!(kv_blocks(1000, 300), 3);
        assert_eq!(kv_blocks(1000, 0), 0);
    }
}
