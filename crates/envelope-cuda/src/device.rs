//! Device discovery: [`Device::open`] finds the driver, then the GPU, and
//! says exactly which of them is missing. The libraries
//! are probed with our own `dlopen` first (cudarc panics on a missing
//! library) and every cudarc call runs under [`guarded`] as a second guard.

use crate::error::{guarded, CudaError, Result};
use crate::libs::{probe, CudaLib};
use cudarc::driver::{sys, CudaContext, DriverError};
use serde::Serialize;
use std::sync::Arc;

/// Where each library was found.
#[derive(Debug, Clone, Serialize)]
pub struct Libraries {
    pub driver: String,
    /// `None` when not used (the embedded PTX, the GEMM kernels).
    pub nvrtc: Option<String>,
    pub cublas: Option<String>,
}

/// Facts about an opened device.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_memory_bytes: usize,
    pub free_memory_bytes: usize,
    pub multiprocessors: i32,
    /// The driver's CUDA version as `major.minor` (13.0 for driver 580).
    pub driver_cuda_version: String,
    pub libraries: Libraries,
}

/// An opened CUDA device: a context bound to it, and its facts.
pub struct Device {
    pub info: DeviceInfo,
    pub ctx: Arc<CudaContext>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.info.fmt(f)
    }
}

fn driver_err(call: &'static str) -> impl Fn(DriverError) -> CudaError {
    move |e| CudaError::Driver {
        call,
        message: format!("{e:?}"),
    }
}

impl Device {
    /// Opens device `ordinal`. Needs only the driver: NVRTC and cuBLAS are
    /// optional ([`crate::embedded`]), and [`crate::runtime::Gpu::open`]
    /// records them in [`DeviceInfo::libraries`] when it uses them.
    ///
    /// # Errors
    /// [`CudaError::LibraryMissing`] (naming `libcuda.so`),
    /// [`CudaError::NoDevice`], [`CudaError::BadOrdinal`],
    /// [`CudaError::Driver`], [`CudaError::Panicked`].
    pub fn open(ordinal: usize) -> Result<Device> {
        let driver = probe(CudaLib::Driver)?;
        Self::open_with(
            ordinal,
            Libraries {
                driver,
                nvrtc: None,
                cublas: None,
            },
        )
    }

    fn open_with(ordinal: usize, libraries: Libraries) -> Result<Device> {
        let count = match guarded("cuDeviceGetCount", CudaContext::device_count)? {
            Ok(n) => n.max(0) as usize,
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => 0,
            Err(e) => {
                return Err(CudaError::Driver {
                    call: "cuInit/cuDeviceGetCount",
                    message: format!("{e:?} (is the NVIDIA kernel module loaded?)"),
                })
            }
        };
        if count == 0 {
            return Err(CudaError::NoDevice(
                "the driver is installed but reports no GPU".into(),
            ));
        }
        if ordinal >= count {
            return Err(CudaError::BadOrdinal { ordinal, count });
        }
        let ctx = guarded("cuDevicePrimaryCtxRetain", || CudaContext::new(ordinal))?
            .map_err(driver_err("cuDevicePrimaryCtxRetain"))?;
        let info = guarded("device queries", || -> Result<DeviceInfo> {
            let (free, total) = ctx.mem_get_info().map_err(driver_err("cuMemGetInfo"))?;
            let mut version = 0i32;
            // SAFETY: the driver writes one int.
            unsafe { sys::cuDriverGetVersion(&mut version) }
                .result()
                .map_err(driver_err("cuDriverGetVersion"))?;
            Ok(DeviceInfo {
                ordinal,
                name: ctx.name().map_err(driver_err("cuDeviceGetName"))?,
                compute_capability: ctx
                    .compute_capability()
                    .map_err(driver_err("cuDeviceGetAttribute"))?,
                total_memory_bytes: total,
                free_memory_bytes: free,
                multiprocessors: ctx
                    .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                    .map_err(driver_err("cuDeviceGetAttribute"))?,
                driver_cuda_version: format!("{}.{}", version / 1000, version % 1000 / 10),
                libraries,
            })
        })??;
        Ok(Device { info, ctx })
    }

    /// The NVRTC architecture option for this device (`compute_90`).
    pub fn arch(&self) -> String {
        let (ma, mi) = self.info.compute_capability;
        format!("compute_{ma}{mi}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without the driver (CI, this development machine),
    /// opening a device is an `Err` naming the missing library, not a panic.
    #[test]
    fn open_without_a_driver_is_an_error_not_a_panic() {
        let r = std::panic::catch_unwind(|| Device::open(0).map(|d| d.info.name));
        let r = r.expect("Device::open panicked");
        match r {
            Ok(name) => eprintln!("a GPU is present here ({name}); nothing to check"),
            Err(e) => {
                let m = e.to_string();
                eprintln!("{m}");
                if crate::libs::probe(CudaLib::Driver).is_err() {
                    assert!(m.contains("libcuda.so"), "{m}");
                    assert!(matches!(e, CudaError::LibraryMissing { .. }));
                }
            }
        }
    }

    #[test]
    fn bad_ordinal_is_typed() {
        if let Err(e) = Device::open(10_000) {
            let ok = matches!(
                e,
                CudaError::BadOrdinal { .. }
                    | CudaError::LibraryMissing { .. }
                    | CudaError::NoDevice(_)
                    | CudaError::Driver { .. }
            );
            assert!(ok, "{e}");
        } else {
            panic!("device 10000 opened");
        }
    }
}
