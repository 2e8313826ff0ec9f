//! Host weights and `dummy:` presets into device buffers.

use super::{DevLinear, DevMatrix};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::linear::{Linear, Matrix};
use crate::weights::{self, DummyInit, Role};
use candle_core::{DType as CDType, Device as CDevice, Tensor};
use envelope_cuda::runtime::{le_bytes, Buf, DType, Gpu};

/// Turns host weights and dummy presets into device buffers.
pub(super) struct Uploader<'a> {
    pub(super) gpu: &'a Gpu,
    pub(super) act: DType,
    pub(super) fp8: bool,
}

fn tensor_bytes(t: &Tensor, act: DType) -> Result<Vec<u8>> {
    let t = t.flatten_all()?;
    Ok(match act {
        DType::F16 => le_bytes(
            &t.to_dtype(CDType::F16)?.to_vec1::<half::f16>()?,
            half::f16::to_le_bytes,
        ),
        DType::Bf16 => le_bytes(
            &t.to_dtype(CDType::BF16)?.to_vec1::<half::bf16>()?,
            half::bf16::to_le_bytes,
        ),
        _ => le_bytes(
            &t.to_dtype(CDType::F32)?.to_vec1::<f32>()?,
            f32::to_le_bytes,
        ),
    })
}

impl Uploader<'_> {
    pub(super) fn tensor(&self, t: &Tensor) -> Result<Buf> {
        Ok(self.gpu.upload(self.act, &tensor_bytes(t, self.act)?)?)
    }

    pub(super) fn matrix(&self, m: &Matrix) -> Result<Buf> {
        Ok(match m {
            Matrix::Dense(t) => self.tensor(t)?,
            Matrix::Blocks(q) => {
                let blocks = self.gpu.upload(DType::U8, &q.gguf_bytes())?;
                let out = self.gpu.empty(self.act, q.n * q.k)?;
                self.gpu
                    .dequant(q.format.name(), &blocks, &out, q.n * q.k / 32)?;
                out
            }
            Matrix::Quant(q) => self.tensor(&q.dequantize(&CDevice::Cpu)?)?,
            Matrix::Fp8(m) => self.tensor(&Tensor::from_vec(
                m.dequantize(),
                (m.n, m.k),
                &CDevice::Cpu,
            )?)?,
        })
    }

    /// A layer matrix: dense in the activation dtype, or fp8.
    pub(super) fn linear(
        &self,
        dense: Buf,
        bias: Option<Buf>,
        out: usize,
        inner: usize,
    ) -> Result<DevLinear> {
        let w = if self.fp8 {
            let q = self.gpu.fp8_buf(dense.len)?;
            self.gpu.quantize_fp8_into(&dense, dense.len, &q)?;
            self.gpu.synchronize()?;
            DevMatrix::Fp8(q)
        } else {
            DevMatrix::Dense(dense)
        };
        Ok(DevLinear {
            w,
            bias,
            out,
            inner,
        })
    }

    pub(super) fn host_linear(&self, l: &Linear) -> Result<DevLinear> {
        let (out, inner) = l.weight().dims2()?;
        let dense = self.matrix(l.weight())?;
        let bias = l.bias().map(|b| self.tensor(b)).transpose()?;
        self.linear(dense, bias, out, inner)
    }

    /// A `dummy:` tensor generated on the device.
    pub(super) fn dummy(
        &self,
        cfg: &ModelConfig,
        seed: u64,
        role: Role,
        layer: usize,
    ) -> Result<Option<Buf>> {
        Ok(match weights::dummy_init(cfg, role) {
            DummyInit::Absent => None,
            DummyInit::Ones(n) => Some(self.gpu.upload_f32(self.act, &vec![1.0; n])?),
            DummyInit::Uniform { shape, scale } => {
                let len = shape.iter().product();
                let b = self.gpu.empty(self.act, len)?;
                let key = weights::dummy_key(seed, &weights::hf_name(role, layer));
                self.gpu.dummy_fill(&b, key, scale)?;
                Some(b)
            }
        })
    }

    pub(super) fn dummy_linear(
        &self,
        cfg: &ModelConfig,
        seed: u64,
        (role, bias): (Role, Option<Role>),
        layer: usize,
        shape: (usize, usize),
    ) -> Result<DevLinear> {
        let dense = self
            .dummy(cfg, seed, role, layer)?
            .ok_or_else(|| EngineError::model("dummy", format!("no tensor for {role:?}")))?;
        let bias = match bias {
            Some(r) => self.dummy(cfg, seed, r, layer)?,
            None => None,
        };
        self.linear(dense, bias, shape.0, shape.1)
    }
}
