//! `--device cpu|cuda[:N]|auto`: parsed once into a [`DeviceSetting`], then
//! resolved into the backend that will run ([`select`]). Today only the CPU
//! engine exists, so `cuda` fails after a successful device open with an
//! honest "not built yet" and `auto` falls back to the CPU, saying why.

use crate::device::Device;
use crate::error::CudaError;
use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSetting {
    #[default]
    Cpu,
    Cuda {
        ordinal: usize,
    },
    /// CUDA device 0 when usable, else the CPU.
    Auto,
}

impl FromStr for DeviceSetting {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("`{s}` is not a device: use cpu, cuda, cuda:N or auto");
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(DeviceSetting::Cpu),
            "auto" => Ok(DeviceSetting::Auto),
            "cuda" | "gpu" => Ok(DeviceSetting::Cuda { ordinal: 0 }),
            other => match other.strip_prefix("cuda:") {
                Some(n) => n
                    .parse()
                    .map(|ordinal| DeviceSetting::Cuda { ordinal })
                    .map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }
}

impl fmt::Display for DeviceSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSetting::Cpu => f.write_str("cpu"),
            DeviceSetting::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
            DeviceSetting::Auto => f.write_str("auto"),
        }
    }
}

/// Why `--device cuda` cannot run.
#[derive(Debug, thiserror::Error)]
pub enum SelectError {
    #[error("--device cuda:{ordinal}: no usable CUDA device: {reason}")]
    Unavailable { ordinal: usize, reason: CudaError },
    #[error("--device cuda:{ordinal}: opened {device}, but the CUDA model forward is not built yet (issue #7); use --device cpu")]
    ForwardNotBuilt { ordinal: usize, device: String },
}

/// The backend that runs. Only the CPU exists today.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selected {
    /// `note` says why `auto` fell back, when it did.
    Cpu { note: Option<String> },
}

/// Resolves the setting: `cpu` at once; `cuda` opens the device and then
/// refuses (no forward pass yet); `auto` tries device 0 and falls back.
pub fn select(setting: DeviceSetting) -> Result<Selected, SelectError> {
    select_with(setting, |o| {
        Device::open(o).map(|d| {
            format!(
                "{} (compute capability {}.{})",
                d.info.name, d.info.compute_capability.0, d.info.compute_capability.1
            )
        })
    })
}

/// [`select`] with the device opener injected (for tests).
pub fn select_with(
    setting: DeviceSetting,
    open: impl Fn(usize) -> Result<String, CudaError>,
) -> Result<Selected, SelectError> {
    match setting {
        DeviceSetting::Cpu => Ok(Selected::Cpu { note: None }),
        DeviceSetting::Cuda { ordinal } => match open(ordinal) {
            Ok(device) => Err(SelectError::ForwardNotBuilt { ordinal, device }),
            Err(reason) => Err(SelectError::Unavailable { ordinal, reason }),
        },
        DeviceSetting::Auto => Ok(Selected::Cpu {
            note: Some(match open(0) {
                Ok(device) => format!(
                    "--device auto: found {device}, but the CUDA model forward is not built yet (issue #7); falling back to the CPU"
                ),
                Err(e) => format!("--device auto: no usable CUDA device ({e}); falling back to the CPU"),
            }),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form() {
        assert_eq!("cpu".parse(), Ok(DeviceSetting::Cpu));
        assert_eq!("CUDA".parse(), Ok(DeviceSetting::Cuda { ordinal: 0 }));
        assert_eq!("cuda:3".parse(), Ok(DeviceSetting::Cuda { ordinal: 3 }));
        assert_eq!("auto".parse(), Ok(DeviceSetting::Auto));
        for bad in ["cuda:", "cuda:x", "tpu", "cuda:-1", ""] {
            assert!(bad.parse::<DeviceSetting>().is_err(), "{bad}");
        }
        assert_eq!(DeviceSetting::Cuda { ordinal: 2 }.to_string(), "cuda:2");
    }

    fn missing(_: usize) -> Result<String, CudaError> {
        Err(CudaError::LibraryMissing {
            library: "libcuda.so",
            tried: "libcuda.so.1".into(),
            hint: "no driver",
        })
    }

    #[test]
    fn cuda_without_a_gpu_names_the_reason() {
        let e = select_with(DeviceSetting::Cuda { ordinal: 1 }, missing).unwrap_err();
        let m = e.to_string();
        assert!(m.contains("cuda:1") && m.contains("libcuda.so"), "{m}");
    }

    #[test]
    fn cuda_with_a_gpu_says_the_forward_is_not_built() {
        let e = select_with(DeviceSetting::Cuda { ordinal: 0 }, |_| {
            Ok("NVIDIA H200".into())
        })
        .unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("NVIDIA H200") && m.contains("not built yet (issue #7)"),
            "{m}"
        );
    }

    #[test]
    fn auto_falls_back_and_says_why() {
        let Selected::Cpu { note } = select_with(DeviceSetting::Auto, missing).unwrap();
        assert!(note.unwrap().contains("libcuda.so"));
        let Selected::Cpu { note } =
            select_with(DeviceSetting::Auto, |_| Ok("H200".into())).unwrap();
        assert!(note.unwrap().contains("not built yet"));
        assert_eq!(
            select_with(DeviceSetting::Cpu, missing).unwrap(),
            Selected::Cpu { note: None }
        );
    }
}
