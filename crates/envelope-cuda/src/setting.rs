//! `--device cpu|cuda[:N]|auto`: parsed once into a [`DeviceSetting`], then
//! resolved into the backend that will run ([`select`]): `cuda` opens the
//! device or fails with the reason (no driver, no GPU, library missing);
//! `auto` takes device 0 when it opens and otherwise falls back to the CPU,
//! saying why.

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
}

/// The backend that runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selected {
    /// `note` says why `auto` fell back, when it did.
    Cpu { note: Option<String> },
    /// `device` names the GPU that opened.
    Cuda { ordinal: usize, device: String },
}

/// Resolves the setting: `cpu` at once; `cuda` opens the device or says
/// why it cannot; `auto` tries device 0 and falls back to the CPU.
pub fn select(setting: DeviceSetting) -> Result<Selected, SelectError> {
    select_with(setting, |o| {
        let d = Device::open(o)?;
        // What `runtime::Gpu::open` would refuse before any weight loads:
        // the settings, a kernel source for this GPU and driver.
        crate::embedded::GemmChoice::from_env()?;
        let (cc, driver) = (d.info.compute_capability, &d.info.driver_cuda_version);
        crate::embedded::PtxSource::choose(cc, driver)?;
        Ok(format!(
            "{} (compute capability {}.{})",
            d.info.name, cc.0, cc.1
        ))
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
            Ok(device) => Ok(Selected::Cuda { ordinal, device }),
            Err(reason) => Err(SelectError::Unavailable { ordinal, reason }),
        },
        DeviceSetting::Auto => Ok(match open(0) {
            Ok(device) => Selected::Cuda { ordinal: 0, device },
            Err(e) => Selected::Cpu {
                note: Some(format!(
                    "--device auto: no usable CUDA device ({e}); falling back to the CPU"
                )),
            },
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
    fn cuda_with_a_gpu_selects_it() {
        let s = select_with(DeviceSetting::Cuda { ordinal: 2 }, |o| {
            Ok(format!("NVIDIA H200 #{o}"))
        })
        .unwrap();
        assert_eq!(
            s,
            Selected::Cuda {
                ordinal: 2,
                device: "NVIDIA H200 #2".into()
            }
        );
    }

    #[test]
    fn auto_falls_back_and_says_why() {
        let Selected::Cpu { note } = select_with(DeviceSetting::Auto, missing).unwrap() else {
            panic!("auto without a driver must fall back to the CPU");
        };
        assert!(note.unwrap().contains("libcuda.so"));
        assert!(matches!(
            select_with(DeviceSetting::Auto, |_| Ok("H200".into())).unwrap(),
            Selected::Cuda { ordinal: 0, .. }
        ));
        assert_eq!(
            select_with(DeviceSetting::Cpu, missing).unwrap(),
            Selected::Cpu { note: None }
        );
    }
}
