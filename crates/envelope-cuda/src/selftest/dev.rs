//! Where the self-test's cases run: a CUDA device (the kernels' PTX loaded
//! on the GPU) or the CPU emulator ([`crate::emu`]). The cases see one
//! interface, so both run exactly the same inputs, launches and checks.

use super::{from_bytes, to_bytes, Dt};
use crate::emu::{EmuArg, Emulator, HostBuf};
use crate::error::{CudaError, Result};
use crate::geometry::Launch;
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, CudaStream, PushKernelArg};
use std::collections::HashMap;
use std::sync::Arc;

/// A buffer of the device the cases run on.
pub(super) enum Mem {
    Dev(CudaSlice<u8>),
    Host(HostBuf),
}

pub(super) enum Arg<'a> {
    Buf(&'a Mem),
    I32(i32),
    I64(i64),
    U64(u64),
    F32(f32),
}

pub(super) enum Gpu {
    Cuda {
        stream: Arc<CudaStream>,
        modules: HashMap<&'static str, Arc<CudaModule>>,
    },
    Emu(Emulator),
}

pub(super) fn drv(call: &'static str) -> impl Fn(cudarc::driver::DriverError) -> CudaError {
    move |e| CudaError::Driver {
        call,
        message: format!("{e:?}"),
    }
}

fn wrong_device() -> CudaError {
    CudaError::Emulator("a buffer of the other device".into())
}

impl Gpu {
    pub(super) fn up(&self, b: &[u8]) -> Result<Mem> {
        match self {
            Gpu::Cuda { stream, .. } => stream
                .clone_htod(b)
                .map(Mem::Dev)
                .map_err(drv("cuMemcpyHtoD")),
            Gpu::Emu(_) => Ok(Mem::Host(HostBuf::from_bytes(b))),
        }
    }
    pub(super) fn upf(&self, dt: Dt, x: &[f32]) -> Result<Mem> {
        self.up(&to_bytes(dt, x))
    }
    pub(super) fn down(&self, m: &Mem) -> Result<Vec<u8>> {
        match (self, m) {
            (Gpu::Cuda { stream, .. }, Mem::Dev(s)) => {
                stream.synchronize().map_err(drv("cuStreamSynchronize"))?;
                stream.clone_dtoh(s).map_err(drv("cuMemcpyDtoH"))
            }
            (Gpu::Emu(_), Mem::Host(h)) => Ok(h.to_vec()),
            _ => Err(wrong_device()),
        }
    }
    pub(super) fn downf(&self, dt: Dt, m: &Mem) -> Result<Vec<f32>> {
        Ok(from_bytes(dt, &self.down(m)?))
    }
    pub(super) fn zeros(&self, bytes: usize) -> Result<Mem> {
        match self {
            Gpu::Cuda { stream, .. } => stream
                .alloc_zeros::<u8>(bytes.max(1))
                .map(Mem::Dev)
                .map_err(drv("cuMemAlloc")),
            Gpu::Emu(_) => Ok(Mem::Host(HostBuf::zeroed(bytes.max(1)))),
        }
    }
    fn func(
        modules: &HashMap<&'static str, Arc<CudaModule>>,
        file: &'static str,
        entry: &str,
    ) -> Result<CudaFunction> {
        let m = modules.get(file).ok_or_else(|| CudaError::Driver {
            call: "module",
            message: format!("{file} did not compile or load"),
        })?;
        m.load_function(entry).map_err(drv("cuModuleGetFunction"))
    }
    /// Runs one kernel to completion.
    pub(super) fn launch(
        &self,
        file: &'static str,
        entry: &str,
        l: Launch,
        args: &[Arg],
    ) -> Result<()> {
        match self {
            Gpu::Cuda { stream, modules } => {
                let f = Self::func(modules, file, entry)?;
                let mut b = stream.launch_builder(&f);
                for a in args {
                    match a {
                        Arg::Buf(Mem::Dev(s)) => b.arg(s),
                        Arg::Buf(Mem::Host(_)) => return Err(wrong_device()),
                        Arg::I32(v) => b.arg(v),
                        Arg::I64(v) => b.arg(v),
                        Arg::F32(v) => b.arg(v),
                        Arg::U64(v) => b.arg(v),
                    };
                }
                // SAFETY: argument lists match the kernels' signatures in kernels/.
                unsafe { b.launch(l.to_cudarc()) }.map_err(drv("cuLaunchKernel"))?;
                stream.synchronize().map_err(drv("kernel execution"))
            }
            Gpu::Emu(e) => {
                let args = args
                    .iter()
                    .map(|a| {
                        Ok(match a {
                            Arg::Buf(Mem::Host(h)) => EmuArg::Ptr(h.addr()),
                            Arg::Buf(Mem::Dev(_)) => return Err(wrong_device()),
                            Arg::I32(v) => EmuArg::I32(*v),
                            Arg::I64(v) => EmuArg::I64(*v),
                            Arg::U64(v) => EmuArg::U64(*v),
                            Arg::F32(v) => EmuArg::F32(*v),
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                e.launch(file, entry, l, &args)
            }
        }
    }
}
