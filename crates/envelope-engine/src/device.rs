//! Where the engine runs, decided once: a device setting (`--device`,
//! `target.device`) resolved into a [`Placement`], and the KV dtype that
//! goes with it when none was asked for. The engine owns this policy (which
//! precisions and KV dtypes run on CUDA); the CLI and the harness only
//! parse the setting.

use crate::cuda::{check_runs_on_cuda, default_kv_dtype};
use crate::error::Result;
use crate::precision::{KvDtype, Precision};
use crate::settings::Placement;
/// `--device` / `target.device` as written, parsed once (`cpu`, `cuda`,
/// `cuda:N`, `auto`).
pub use envelope_cuda::DeviceSetting;
use envelope_cuda::{select, Selected};

/// Resolves `setting`: `cpu` at once; `cuda[:N]` opens the device or fails
/// with the reason (no driver, no GPU, library missing); `auto` takes CUDA
/// device 0 when it opens and every `(precision, KV dtype)` in `needs` can
/// run there (not q8_0/q4_0, a KV dtype the kernels pair with the
/// activations), else logs why it fell back to the CPU.
///
/// # Errors
/// `cuda` without a usable device ([`crate::EngineError::Device`]).
pub fn resolve(
    setting: DeviceSetting,
    needs: &[(Precision, Option<KvDtype>)],
) -> Result<Placement> {
    match select(setting)? {
        Selected::Cpu { note } => {
            if let Some(n) = note {
                tracing::warn!("{n}");
            }
            Ok(Placement::Cpu)
        }
        Selected::Cuda { ordinal, device } => {
            if setting == DeviceSetting::Auto {
                if let Some(e) = needs
                    .iter()
                    .find_map(|&(p, kv)| check_runs_on_cuda(p, kv).err())
                {
                    tracing::warn!(
                        "--device auto: found {device}, but {e}; falling back to the CPU"
                    );
                    return Ok(Placement::Cpu);
                }
            }
            tracing::info!("running on CUDA device {ordinal}: {device}");
            Ok(Placement::Cuda { ordinal })
        }
    }
}

/// The KV dtype: the one asked for, else f32 on the CPU and the activation
/// dtype on CUDA (bf16, or f16/f32 for those precisions).
pub fn kv_dtype(placement: Placement, precision: Precision, asked: Option<KvDtype>) -> KvDtype {
    asked.unwrap_or(match placement {
        Placement::Cpu => KvDtype::F32,
        Placement::Cuda { .. } => default_kv_dtype(precision),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_resolves_without_a_driver_and_kv_follows_the_placement() {
        let p = resolve(DeviceSetting::Cpu, &[(Precision::Q8_0, None)]).unwrap();
        assert_eq!(p, Placement::Cpu);
        assert_eq!(kv_dtype(p, Precision::Bf16, None), KvDtype::F32);
        assert_eq!(
            kv_dtype(p, Precision::Bf16, Some(KvDtype::F16)),
            KvDtype::F16
        );
        let gpu = Placement::Cuda { ordinal: 0 };
        assert_eq!(kv_dtype(gpu, Precision::Bf16, None), KvDtype::Bf16);
        assert_eq!(kv_dtype(gpu, Precision::F32, None), KvDtype::F32);
    }
}
