//! GPU state through NVML (`nvml-wrapper`, which loads `libnvidia-ml` at run
//! time). Every failure is a value: no driver, no library, or a query the
//! device does not support gives `Err` or an absent field, never a panic.

use serde::{Deserialize, Serialize};

/// Why NVML readings are not available.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[error("NVML unavailable: {0}")]
pub struct NvmlUnavailable(pub String);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct GpuSample {
    pub index: u32,
    pub name: Option<String>,
    pub memory_used_bytes: Option<u64>,
    pub memory_total_bytes: Option<u64>,
    pub memory_free_bytes: Option<u64>,
    pub utilization_gpu_pct: Option<u32>,
    pub utilization_memory_pct: Option<u32>,
    pub power_draw_mw: Option<u32>,
    pub power_limit_mw: Option<u32>,
    pub temperature_c: Option<u32>,
    pub sm_clock_mhz: Option<u32>,
    pub memory_clock_mhz: Option<u32>,
    /// Active clock-throttle reasons, e.g. `SW_POWER_CAP`.
    pub throttle_reasons: Vec<String>,
    /// GPU memory of the watched process, when the driver reports it.
    pub process_memory_bytes: Option<u64>,
}

/// Static facts about one GPU, for the fingerprint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct GpuInfo {
    pub index: u32,
    pub name: Option<String>,
    pub uuid: Option<String>,
    pub memory_total_bytes: Option<u64>,
    pub compute_capability: Option<String>,
    pub power_limit_mw: Option<u32>,
    pub mig_enabled: Option<bool>,
    pub ecc_enabled: Option<bool>,
}

/// An initialised NVML handle.
pub struct Nvml {
    inner: nvml_wrapper::Nvml,
}

impl Nvml {
    /// Loads the NVML library. A missing library or driver is an `Err`; a
    /// panic inside the loader is caught and turned into one too.
    pub fn init() -> Result<Nvml, NvmlUnavailable> {
        if std::env::var_os("ENVELOPE_DISABLE_NVML").is_some() {
            return Err(NvmlUnavailable("disabled by ENVELOPE_DISABLE_NVML".into()));
        }
        match std::panic::catch_unwind(nvml_wrapper::Nvml::init) {
            Ok(Ok(inner)) => Ok(Nvml { inner }),
            Ok(Err(e)) => Err(NvmlUnavailable(e.to_string())),
            Err(_) => Err(NvmlUnavailable("the NVML loader panicked".into())),
        }
    }

    pub fn device_count(&self) -> u32 {
        self.inner.device_count().unwrap_or(0)
    }

    pub fn driver_version(&self) -> Option<String> {
        self.inner.sys_driver_version().ok()
    }

    /// CUDA version the driver supports, e.g. `13.0`.
    pub fn cuda_driver_version(&self) -> Option<String> {
        self.inner
            .sys_cuda_driver_version()
            .ok()
            .map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10))
    }

    pub fn info(&self, index: u32) -> GpuInfo {
        let Ok(d) = self.inner.device_by_index(index) else {
            return GpuInfo {
                index,
                ..Default::default()
            };
        };
        GpuInfo {
            index,
            name: d.name().ok(),
            uuid: d.uuid().ok(),
            memory_total_bytes: d.memory_info().ok().map(|m| m.total),
            compute_capability: d
                .cuda_compute_capability()
                .ok()
                .map(|c| format!("{}.{}", c.major, c.minor)),
            power_limit_mw: d.enforced_power_limit().ok(),
            mig_enabled: d.mig_mode().ok().map(|m| m.current == 1),
            ecc_enabled: d.is_ecc_enabled().ok().map(|e| e.currently_enabled),
        }
    }

    /// One reading of GPU `index`; `pid` selects the process whose memory is reported.
    pub fn sample(&self, index: u32, pid: Option<u32>) -> GpuSample {
        use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
        use nvml_wrapper::enums::device::UsedGpuMemory;
        let Ok(d) = self.inner.device_by_index(index) else {
            return GpuSample {
                index,
                ..Default::default()
            };
        };
        let mem = d.memory_info().ok();
        let util = d.utilization_rates().ok();
        let process_memory_bytes = pid.and_then(|pid| {
            d.running_compute_processes()
                .ok()?
                .into_iter()
                .find(|p| p.pid == pid)
                .and_then(|p| match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => Some(b),
                    UsedGpuMemory::Unavailable => None,
                })
        });
        GpuSample {
            index,
            name: d.name().ok(),
            memory_used_bytes: mem.as_ref().map(|m| m.used),
            memory_total_bytes: mem.as_ref().map(|m| m.total),
            memory_free_bytes: mem.as_ref().map(|m| m.free),
            utilization_gpu_pct: util.as_ref().map(|u| u.gpu),
            utilization_memory_pct: util.as_ref().map(|u| u.memory),
            power_draw_mw: d.power_usage().ok(),
            power_limit_mw: d.enforced_power_limit().ok(),
            temperature_c: d.temperature(TemperatureSensor::Gpu).ok(),
            sm_clock_mhz: d.clock_info(Clock::SM).ok(),
            memory_clock_mhz: d.clock_info(Clock::Memory).ok(),
            throttle_reasons: d
                .current_throttle_reasons()
                .ok()
                .map(|r| r.iter_names().map(|(n, _)| n.to_string()).collect())
                .unwrap_or_default(),
            process_memory_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disabled_nvml_is_an_error_value() {
        std::env::set_var("ENVELOPE_DISABLE_NVML", "1");
        let e = Nvml::init().err().expect("disabled");
        assert!(e.to_string().contains("ENVELOPE_DISABLE_NVML"));
        std::env::remove_var("ENVELOPE_DISABLE_NVML");
        // Without the driver (CI), init fails cleanly; with it, it works. Either way no panic.
        match Nvml::init() {
            Ok(n) => {
                for i in 0..n.device_count() {
                    assert!(n.sample(i, None).memory_total_bytes.is_some());
                }
            }
            Err(e) => assert!(!e.0.is_empty()),
        }
    }
}
