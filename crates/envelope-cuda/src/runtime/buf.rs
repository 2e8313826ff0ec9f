//! Device buffers of the runtime: element types, untyped buffers tagged
//! with theirs, the host encodings they are uploaded in and read back from,
//! and the [`Gpu`] methods that allocate, fill and copy them.

use super::{drv, shape, Gpu};
use crate::error::Result;
use cudarc::cublas::sys as blas_sys;
use cudarc::cublaslt::sys as lt_sys;
use cudarc::driver::CudaSlice;
use half::{bf16, f16};

/// Element type of a device buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    Bf16,
    /// e4m3fn, with a per-tensor scale held beside it.
    Fp8,
    /// Integer metadata (token ids, positions, block tables).
    U32,
    /// Raw bytes (GGUF blocks before dequantisation).
    U8,
    I32,
    I64,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::U32 | DType::I32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::Fp8 | DType::U8 => 1,
            DType::I64 => 8,
        }
    }

    /// The suffix of kernel entry points (`rmsnorm_bf16`).
    pub fn suffix(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::Fp8 => "fp8",
            DType::U32 => "u32",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::I64 => "i64",
        }
    }

    pub(super) fn blas(self) -> Result<blas_sys::cudaDataType> {
        Ok(match self {
            DType::F32 => blas_sys::cudaDataType::CUDA_R_32F,
            DType::F16 => blas_sys::cudaDataType::CUDA_R_16F,
            DType::Bf16 => blas_sys::cudaDataType::CUDA_R_16BF,
            other => return Err(shape("gemm", format!("no cuBLAS GEMM for {other:?}"))),
        })
    }

    pub(super) fn lt(self) -> lt_sys::cudaDataType {
        match self {
            DType::F32 => lt_sys::cudaDataType::CUDA_R_32F,
            DType::F16 => lt_sys::cudaDataType::CUDA_R_16F,
            DType::Fp8 => lt_sys::cudaDataType::CUDA_R_8F_E4M3,
            _ => lt_sys::cudaDataType::CUDA_R_16BF,
        }
    }
}

/// A typed f32 device slice (RoPE frequencies, fp8 scales).
pub type F32Slice = CudaSlice<f32>;

/// A device buffer of `len` elements of `dtype`.
pub struct Buf {
    pub data: CudaSlice<u8>,
    pub dtype: DType,
    pub len: usize,
}

impl Buf {
    pub fn bytes(&self) -> usize {
        self.len * self.dtype.size()
    }
}

/// An fp8 matrix or activation: e4m3 bytes and the device f32 scale that
/// multiplies them back.
pub struct Fp8Buf {
    pub data: Buf,
    pub scale: CudaSlice<f32>,
}

/// Host bytes of `x` in `dtype` (f32, f16 or bf16; little-endian).
pub fn encode(dtype: DType, x: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F16 => x
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
        DType::Bf16 => x
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        _ => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// f32 values of host bytes in `dtype`.
pub fn decode(dtype: DType, b: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F16 => b
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::Bf16 => b
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::Fp8 => b.iter().map(|&v| crate::fp8::decode(v)).collect(),
        _ => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    }
}

/// Little-endian bytes of plain integers, for metadata uploads.
pub fn le_bytes<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

/// A kernel argument.
#[derive(Clone, Copy)]
pub enum Arg<'a> {
    Buf(&'a Buf),
    Raw(&'a CudaSlice<u8>),
    F32s(&'a CudaSlice<f32>),
    I32(i32),
    I64(i64),
    U64(u64),
    F32(f32),
}

impl Gpu {
    /// A zero-filled buffer.
    pub fn zeros(&self, dtype: DType, len: usize) -> Result<Buf> {
        let data = self
            .stream
            .alloc_zeros::<u8>((len * dtype.size()).max(1))
            .map_err(drv("cuMemAlloc"))?;
        Ok(Buf { data, dtype, len })
    }

    /// An uninitialised buffer, for outputs a kernel writes whole.
    pub fn empty(&self, dtype: DType, len: usize) -> Result<Buf> {
        // SAFETY: u8 has no invalid bit patterns, and every caller passes
        // the buffer to a kernel or GEMM that writes all `len` elements
        // before anything reads them.
        let data = unsafe { self.stream.alloc::<u8>((len * dtype.size()).max(1)) }
            .map_err(drv("cuMemAlloc"))?;
        Ok(Buf { data, dtype, len })
    }

    /// A buffer holding `bytes` (already in `dtype`'s encoding).
    pub fn upload(&self, dtype: DType, bytes: &[u8]) -> Result<Buf> {
        if !bytes.len().is_multiple_of(dtype.size()) {
            return Err(shape(
                "upload",
                format!("{} bytes are not whole {dtype:?} elements", bytes.len()),
            ));
        }
        let data = if bytes.is_empty() {
            self.stream.alloc_zeros::<u8>(1)
        } else {
            self.stream.clone_htod(bytes)
        }
        .map_err(drv("cuMemcpyHtoD"))?;
        Ok(Buf {
            data,
            dtype,
            len: bytes.len() / dtype.size(),
        })
    }

    pub fn upload_f32(&self, dtype: DType, x: &[f32]) -> Result<Buf> {
        self.upload(dtype, &encode(dtype, x))
    }

    pub fn upload_f32_slice(&self, x: &[f32]) -> Result<CudaSlice<f32>> {
        self.stream.clone_htod(x).map_err(drv("cuMemcpyHtoD"))
    }

    /// Waits for the stream, then copies `b` back as f32.
    pub fn download(&self, b: &Buf) -> Result<Vec<f32>> {
        let bytes = self.download_bytes(b)?;
        Ok(decode(b.dtype, &bytes))
    }

    pub fn download_bytes(&self, b: &Buf) -> Result<Vec<u8>> {
        self.synchronize()?;
        let mut v = self
            .stream
            .clone_dtoh(&b.data)
            .map_err(drv("cuMemcpyDtoH"))?;
        v.truncate(b.bytes());
        Ok(v)
    }

    /// Waits for the stream, then copies a typed f32 slice back (an fp8
    /// scale, RoPE frequencies).
    pub fn download_f32_slice(&self, s: &CudaSlice<f32>) -> Result<Vec<f32>> {
        self.synchronize()?;
        self.stream.clone_dtoh(s).map_err(drv("cuMemcpyDtoH"))
    }

    pub fn fp8_buf(&self, len: usize) -> Result<Fp8Buf> {
        Ok(Fp8Buf {
            data: self.zeros(DType::Fp8, len)?,
            scale: self
                .stream
                .alloc_zeros::<f32>(1)
                .map_err(drv("cuMemAlloc"))?,
        })
    }

    /// Copies `bytes` into the start of `dst` (a decode graph's fixed
    /// buffers), on the stream.
    pub fn write(&self, dst: &mut Buf, bytes: &[u8]) -> Result<()> {
        if bytes.len() > dst.bytes() {
            return Err(shape(
                "write",
                format!("{} bytes into a buffer of {}", bytes.len(), dst.bytes()),
            ));
        }
        if bytes.is_empty() {
            return Ok(());
        }
        let mut view = dst.data.slice_mut(0..bytes.len());
        self.stream
            .memcpy_htod(bytes, &mut view)
            .map_err(drv("cuMemcpyHtoD"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_encodings_round_trip() {
        let x = [0.5f32, -1.25, 3.0];
        for dt in [DType::F32, DType::F16, DType::Bf16] {
            assert_eq!(decode(dt, &encode(dt, &x)), x.to_vec());
        }
        assert_eq!(decode(DType::Fp8, &[crate::fp8::encode(1.5)]), vec![1.5]);
        assert_eq!(
            le_bytes(&[1u32, 2], u32::to_le_bytes),
            vec![1, 0, 0, 0, 2, 0, 0, 0]
        );
    }
}
