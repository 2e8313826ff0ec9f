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

/// An fp8 (e4m3) matrix `[n, k]` with one per-tensor scale: `w ~ code * scale`.
/// On the CPU it is a numerical emulation of the CUDA fp8 path (W8A8:
/// weights and, per call, activations quantised per tensor, exactly as
/// kernels/fp8.cu does), for quality gating of bf16 -> fp8 without a GPU;
/// it dequantises per call and is not a speed path.
#[derive(Debug, Clone)]
pub struct Fp8Matrix {
    pub n: usize,
    pub k: usize,
    pub codes: Vec<u8>,
    pub scale: f32,
}

impl Fp8Matrix {
    pub fn quantize(w: &[f32], n: usize, k: usize) -> Fp8Matrix {
        let (codes, scale) = envelope_cuda::reference::quant_fp8(w);
        Fp8Matrix { n, k, codes, scale }
    }

    fn lut(scale: f32) -> [f32; 256] {
        std::array::from_fn(|b| envelope_cuda::fp8::decode(b as u8) * scale)
    }

    /// `codes * scale` as f32.
    pub fn dequantize(&self) -> Vec<f32> {
        let lut = Self::lut(self.scale);
        self.codes.iter().map(|&b| lut[b as usize]).collect()
    }

    /// `x` after the per-tensor e4m3 round trip the GPU applies to every
    /// fp8 GEMM input.
    pub fn quantize_activations(x: &[f32]) -> Vec<f32> {
        let (codes, scale) = envelope_cuda::reference::quant_fp8(x);
        let lut = Self::lut(scale);
        codes.iter().map(|&b| lut[b as usize]).collect()
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
    /// e4m3 with a per-tensor scale (CPU emulation of the CUDA fp8 path).
    Fp8(Arc<Fp8Matrix>),
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
            return Ok(Matrix::Blocks(Arc::new(m.for_this_cpu())));
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
            Precision::Fp8 => {
                let f = raw.to_f32()?;
                let (n, k) = f.dims2()?;
                let v = f.flatten_all()?.to_vec1::<f32>()?;
                Ok(Matrix::Fp8(Arc::new(Fp8Matrix::quantize(&v, n, k))))
            }
        }
    }

    /// Bytes the weight occupies in memory.
    pub fn bytes(&self) -> usize {
        match self {
            Matrix::Blocks(b) => b.bytes(),
            Matrix::Quant(q) => q.storage_size_in_bytes(),
            Matrix::Dense(t) => t.elem_count() * t.dtype().size_in_bytes(),
            Matrix::Fp8(m) => m.codes.len() + 4,
        }
    }

    pub fn dims2(&self) -> Result<(usize, usize)> {
        Ok(match self {
            Matrix::Blocks(b) => (b.n, b.k),
            Matrix::Quant(q) => q.shape().dims2()?,
            Matrix::Dense(t) => t.dims2()?,
            Matrix::Fp8(m) => (m.n, m.k),
        })
    }

    /// Short name of the storage format (`q4_1`, `bf16`, ...).
    pub fn format(&self) -> String {
        match self {
            Matrix::Blocks(b) => b.format.name().to_string(),
            Matrix::Quant(q) => format!("{:?}", q.dtype()).to_lowercase(),
            Matrix::Dense(t) => t.dtype().as_str().to_string(),
            Matrix::Fp8(_) => "fp8_e4m3".to_string(),
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
            Matrix::Fp8(m) => Tensor::from_vec(m.dequantize(), (m.n, m.k), &Device::Cpu)?
                .index_select(&ids_t, 0)?,
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
            Matrix::Dense(_) | Matrix::Blocks(_) | Matrix::Fp8(_) => None,
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
            (Matrix::Fp8(w), None) => {
                let (m, _) = x.dims2()?;
                let xs = x.flatten_all()?.to_vec1::<f32>()?;
                let xq =
                    Tensor::from_vec(Fp8Matrix::quantize_activations(&xs), (m, w.k), &Device::Cpu)?;
                let wd = Tensor::from_vec(w.dequantize(), (w.n, w.k), &Device::Cpu)?;
                xq.matmul(&wd.t()?)?
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

    /// Each of `ls` on the same `x`. Block-quantised weights (our kernel)
    /// share one quantisation of `x` and one parallel pass
    /// ([`crate::qgemm::matmul_many`]): the same results as one
    /// [`Linear::forward`] each, with fewer thread hand-offs per step.
    pub fn forward_many<const N: usize>(ls: [&Linear; N], x: &Tensor) -> Result<[Tensor; N]> {
        let blocks: Vec<&QMatrix> = ls
            .iter()
            .filter_map(|l| match &l.weight {
                Matrix::Blocks(b) => Some(&**b),
                _ => None,
            })
            .collect();
        if blocks.len() < N || blocks.iter().any(|b| b.k != blocks[0].k) {
            let mut out = Vec::with_capacity(N);
            for l in ls {
                out.push(l.forward(x)?);
            }
            return Ok(out.try_into().unwrap_or_else(|_| unreachable!("N results")));
        }
        let (m, _) = x.dims2()?;
        let xs = x.flatten_all()?.to_vec1::<f32>()?;
        let mut out = Vec::with_capacity(N);
        for ((l, b), y) in ls
            .iter()
            .zip(&blocks)
            .zip(crate::qgemm::matmul_many(&blocks, &xs, m))
        {
            let y = Tensor::from_vec(y, (m, b.n), &Device::Cpu)?;
            out.push(match &l.bias {
                Some(bias) => y.broadcast_add(bias)?,
                None => y,
            });
        }
        Ok(out.try_into().unwrap_or_else(|_| unreachable!("N results")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fp8 linear is x and W each through a per-tensor e4m3 round trip,
    /// then an f32 product: close to the f32 product (e4m3 keeps 3 mantissa
    /// bits), and not equal to it (the emulation does something).
    #[test]
    fn fp8_linear_is_the_w8a8_round_trip() {
        let (m, k, n) = (3, 64, 5);
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 53 % 97) as f32 / 48.0) - 1.0)
            .collect();
        let wt = Tensor::from_vec(w.clone(), (n, k), &Device::Cpu).unwrap();
        let lin = Linear::new(
            Matrix::convert(RawWeight::Dense(wt.clone()), Precision::Fp8).unwrap(),
            None,
        );
        assert_eq!(lin.weight().format(), "fp8_e4m3");
        assert_eq!(lin.bytes(), n * k + 4);
        let xt = Tensor::from_vec(x.clone(), (m, k), &Device::Cpu).unwrap();
        let got = lin
            .forward(&xt)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let exact = xt
            .matmul(&wt.t().unwrap())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let xq = Fp8Matrix::quantize_activations(&x);
        let wq = Fp8Matrix::quantize(&w, n, k).dequantize();
        let mut differs = false;
        for r in 0..m {
            for c in 0..n {
                let want: f32 = (0..k).map(|i| xq[r * k + i] * wq[c * k + i]).sum();
                let g = got[r * n + c];
                assert!((g - want).abs() < 1e-4, "{g} vs {want}");
                let e = exact[r * n + c];
                // Each factor within 1/16 relative: the sum within ~1/8 of sum |x w|.
                let mag: f32 = (0..k).map(|i| (x[r * k + i] * w[c * k + i]).abs()).sum();
                assert!((g - e).abs() <= mag / 8.0, "{g} vs f32 {e}");
                differs |= (g - e).abs() > 1e-6;
            }
        }
        assert!(differs, "the fp8 path must not be the f32 product");
    }
}
