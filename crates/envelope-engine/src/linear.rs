//! Weight matrices in whichever precision they were loaded in. A linear layer
//! takes `[tokens, in]` f32 activations and returns `[tokens, out]` f32, so the
//! model code never branches on precision.

use crate::error::Result;
use crate::precision::Precision;
use crate::qgemm::{QFormat, QMatrix};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use std::sync::Arc;

/// A weight as a source hands it over, before conversion to the precision
/// asked for.
pub enum RawWeight {
    Quant(QTensor),
    Dense(Tensor),
}

impl RawWeight {
    pub fn shape(&self) -> Vec<usize> {
        match self {
            RawWeight::Quant(q) => q.shape().dims().to_vec(),
            RawWeight::Dense(t) => t.dims().to_vec(),
        }
    }

    pub fn to_f32(&self) -> Result<Tensor> {
        Ok(match self {
            RawWeight::Quant(q) => q.dequantize(&Device::Cpu)?,
            RawWeight::Dense(t) => t.to_dtype(DType::F32)?,
        })
    }
}

/// A matrix `[out, in]` in its load precision.
#[derive(Clone)]
pub enum Matrix {
    /// Q4_0 / Q4_1 / Q8_0 blocks, multiplied by our own kernel (`qgemm`).
    Blocks(Arc<QMatrix>),
    /// Other GGUF block formats (k-quants), multiplied by candle.
    Quant(Arc<QTensor>),
    Dense(Tensor),
}

/// Moves a candle `QTensor` into our block matrix when we have a kernel for its format.
fn blocks_or_quant(q: QTensor) -> Result<Matrix> {
    let format = match q.dtype() {
        GgmlDType::Q4_0 => Some(QFormat::Q4_0),
        GgmlDType::Q4_1 => Some(QFormat::Q4_1),
        GgmlDType::Q8_0 => Some(QFormat::Q8_0),
        _ => None,
    };
    if let (Some(f), Ok((n, k))) = (format, q.shape().dims2()) {
        if let Some(m) = QMatrix::new(f, n, k, q.data()?.into_owned()) {
            return Ok(Matrix::Blocks(Arc::new(m)));
        }
    }
    Ok(Matrix::Quant(Arc::new(q)))
}

impl Matrix {
    pub fn convert(raw: RawWeight, precision: Precision) -> Result<Matrix> {
        let dense = |t: Tensor, dt: DType| -> Result<Matrix> {
            Ok(Matrix::Dense(t.to_dtype(dt)?.contiguous()?))
        };
        let quant = |raw: &RawWeight, dt: GgmlDType| -> Result<Matrix> {
            let f = raw.to_f32()?;
            blocks_or_quant(QTensor::quantize(&f, dt)?)
        };
        match precision {
            Precision::AsStored => match raw {
                RawWeight::Quant(q) => match q.dtype() {
                    GgmlDType::F32 => dense(q.dequantize(&Device::Cpu)?, DType::F32),
                    GgmlDType::F16 => dense(q.dequantize(&Device::Cpu)?, DType::F16),
                    GgmlDType::BF16 => dense(q.dequantize(&Device::Cpu)?, DType::BF16),
                    _ => blocks_or_quant(q),
                },
                RawWeight::Dense(t) => Ok(Matrix::Dense(t.contiguous()?)),
            },
            Precision::F32 => dense(raw.to_f32()?, DType::F32),
            Precision::F16 => dense(raw.to_f32()?, DType::F16),
            Precision::Bf16 => dense(raw.to_f32()?, DType::BF16),
            Precision::Q8_0 => quant(&raw, GgmlDType::Q8_0),
            Precision::Q4_0 => quant(&raw, GgmlDType::Q4_0),
            Precision::Fp8 => Err(crate::error::EngineError::InvalidSetting {
                field: "precision",
                message: "fp8 runs on CUDA only (compute capability 8.9 or newer): use --device cuda, or bf16 on the CPU".into(),
            }),
        }
    }

    /// Bytes the weight occupies in memory.
    pub fn bytes(&self) -> usize {
        match self {
            Matrix::Blocks(b) => b.bytes(),
            Matrix::Quant(q) => q.storage_size_in_bytes(),
            Matrix::Dense(t) => t.elem_count() * t.dtype().size_in_bytes(),
        }
    }

    pub fn dims2(&self) -> Result<(usize, usize)> {
        Ok(match self {
            Matrix::Blocks(b) => (b.n, b.k),
            Matrix::Quant(q) => q.shape().dims2()?,
            Matrix::Dense(t) => t.dims2()?,
        })
    }

    /// Short name of the storage format (`q4_1`, `bf16`, ...).
    pub fn format(&self) -> String {
        match self {
            Matrix::Blocks(b) => b.format.name().to_string(),
            Matrix::Quant(q) => format!("{:?}", q.dtype()).to_lowercase(),
            Matrix::Dense(t) => t.dtype().as_str().to_string(),
        }
    }

    /// Rows `ids` of the matrix as f32 `[ids, in]`: the embedding lookup.
    pub fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        let ids_t = Tensor::new(ids, &Device::Cpu)?;
        Ok(match self {
            Matrix::Blocks(b) => {
                let mut out = vec![0f32; ids.len() * b.k];
                for (row, &id) in out.chunks_exact_mut(b.k).zip(ids) {
                    if id as usize >= b.n {
                        return Err(crate::error::EngineError::InvalidRequest {
                            param: "prompt",
                            message: format!("token id {id} is outside the vocabulary ({})", b.n),
                        });
                    }
                    b.dequantize_row(id as usize, row);
                }
                Tensor::from_vec(out, (ids.len(), b.k), &Device::Cpu)?
            }
            Matrix::Quant(q) => q.embedding(&ids_t)?,
            Matrix::Dense(t) => t.index_select(&ids_t, 0)?.to_dtype(DType::F32)?,
        })
    }
}

/// `y = x W^T (+ b)`.
#[derive(Clone)]
pub struct Linear {
    weight: Matrix,
    qmatmul: Option<QMatMul>,
    bias: Option<Tensor>,
}

impl Linear {
    pub fn new(weight: Matrix, bias: Option<Tensor>) -> Linear {
        let qmatmul = match &weight {
            Matrix::Quant(q) => Some(QMatMul::QTensor(q.clone())),
            Matrix::Dense(_) | Matrix::Blocks(_) => None,
        };
        Linear {
            weight,
            qmatmul,
            bias,
        }
    }

    pub fn weight(&self) -> &Matrix {
        &self.weight
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = match (&self.weight, &self.qmatmul) {
            (_, Some(q)) => q.forward(x)?,
            (Matrix::Blocks(b), None) => {
                let (m, _) = x.dims2()?;
                let xs = x.flatten_all()?.to_vec1::<f32>()?;
                Tensor::from_vec(crate::qgemm::matmul(b, &xs, m), (m, b.n), &Device::Cpu)?
            }
            (Matrix::Dense(w), None) => {
                if w.dtype() == DType::F32 {
                    x.matmul(&w.t()?)?
                } else {
                    x.to_dtype(w.dtype())?
                        .matmul(&w.t()?)?
                        .to_dtype(DType::F32)?
                }
            }
            (Matrix::Quant(_), None) => unreachable!("quantised weights always carry a QMatMul"),
        };
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }

    pub fn bytes(&self) -> usize {
        self.weight.bytes() + self.bias.as_ref().map_or(0, |b| b.elem_count() * 4)
    }
}
