//! [`Backend`] on the GPU: each model operation as kernels and GEMMs.

use super::{CudaModel, DevKv, DevLinear, DevMatrix, StepMeta};
use crate::config::RopeStyle;
use crate::error::{EngineError, Result};
use crate::model::{Backend, Norm, Proj, StepBatch};
use crate::precision::Precision;
use envelope_cuda::runtime::{le_bytes, AttnDims, Buf, DType, Fp8Buf, Gpu};

pub(super) struct DevMeta {
    pub(super) ids: Buf,
    pub(super) positions: Buf,
    pub(super) slots: Buf,
    pub(super) tables: Buf,
    pub(super) context_lens: Buf,
    pub(super) cu_q_lens: Buf,
    pub(super) logit_rows: Buf,
}

/// Activations on the device: `[rows, cols]`.
pub struct Act {
    pub(super) buf: Buf,
    pub(super) rows: usize,
    pub(super) cols: usize,
}

pub(super) struct CudaBackend<'a> {
    pub(super) m: &'a CudaModel,
    /// The step's logit rows, uploaded as `dev.logit_rows`.
    pub(super) logit_rows: &'a [u32],
    pub(super) kv: &'a DevKv,
    pub(super) meta: &'a StepMeta,
    /// Uploaded for this step, or a decode graph's fixed buffers.
    pub(super) dev: &'a DevMeta,
}

impl CudaBackend<'_> {
    fn gpu(&self) -> &Gpu {
        &self.m.gpu
    }

    fn fp8_input(&self, x: &Act) -> Result<Option<Fp8Buf>> {
        if self.m.precision != Precision::Fp8 {
            return Ok(None);
        }
        let n = x.rows * x.cols;
        let q = self.gpu().fp8_buf(n)?;
        self.gpu().quantize_fp8_into(&x.buf, n, &q)?;
        Ok(Some(q))
    }

    /// `x W^T (+ bias)` into a new activation.
    fn linear(&self, x: &Act, x8: Option<&Fp8Buf>, l: &DevLinear) -> Result<Act> {
        let g = self.gpu();
        let y = g.empty(self.m.act, x.rows * l.out)?;
        match (&l.w, x8) {
            (DevMatrix::Dense(w), _) => g.gemm(&x.buf, w, &y, x.rows, l.inner, l.out, false)?,
            (DevMatrix::Fp8(w), Some(x8)) => g.gemm_fp8(x8, w, &y, x.rows, l.inner, l.out)?,
            (DevMatrix::Fp8(_), None) => {
                return Err(EngineError::InvalidSetting {
                    field: "precision",
                    message: "an fp8 weight met an unquantised activation".into(),
                })
            }
        }
        if let Some(b) = &l.bias {
            g.bias_add(&y, b, x.rows, l.out)?;
        }
        Ok(Act {
            buf: y,
            rows: x.rows,
            cols: l.out,
        })
    }
}

impl Backend for CudaBackend<'_> {
    type Act = Act;

    fn embed(&mut self, step: &StepBatch) -> Result<Act> {
        let (n, h) = (step.ids.len(), self.m.config.hidden_size);
        let out = self.gpu().empty(self.m.act, n * h)?;
        self.gpu()
            .embedding(&self.dev.ids, &self.m.embedding, &out, n, h)?;
        Ok(Act {
            buf: out,
            rows: n,
            cols: h,
        })
    }

    fn rms_norm(&mut self, x: &Act, w: Norm) -> Result<Act> {
        let w = match w {
            Norm::Attn(l) => &self.m.layers[l].attn_norm,
            Norm::Ffn(l) => &self.m.layers[l].ffn_norm,
            Norm::Final => &self.m.final_norm,
        };
        let out = self.gpu().empty(self.m.act, x.rows * x.cols)?;
        let eps = self.m.config.rms_norm_eps as f32;
        self.gpu().rmsnorm(&x.buf, w, &out, x.rows, x.cols, eps)?;
        Ok(Act {
            buf: out,
            rows: x.rows,
            cols: x.cols,
        })
    }

    fn qkv(&mut self, layer: usize, x: &Act) -> Result<[Act; 3]> {
        let l = &self.m.layers[layer];
        let x8 = self.fp8_input(x)?;
        Ok([
            self.linear(x, x8.as_ref(), &l.q)?,
            self.linear(x, x8.as_ref(), &l.k)?,
            self.linear(x, x8.as_ref(), &l.v)?,
        ])
    }

    fn attention(&mut self, layer: usize, step: &StepBatch, qkv: [Act; 3]) -> Result<Act> {
        let c = &self.m.config;
        let g = self.gpu();
        let [q, k, v] = qkv;
        let n = step.ids.len();
        let interleaved = c.rope_style == RopeStyle::Interleaved;
        g.rope(
            &q.buf,
            &self.dev.positions,
            &self.m.inv_freq,
            n,
            c.num_heads,
            c.head_dim,
            interleaved,
        )?;
        g.rope(
            &k.buf,
            &self.dev.positions,
            &self.m.inv_freq,
            n,
            c.num_kv_heads,
            c.head_dim,
            interleaved,
        )?;
        let (kc, vc) = (&self.kv.k[layer], &self.kv.v[layer]);
        g.kv_append(
            &k.buf,
            &v.buf,
            kc,
            vc,
            &self.dev.slots,
            n,
            c.num_kv_heads,
            c.head_dim,
        )?;
        let out = g.empty(self.m.act, n * c.num_heads * c.head_dim)?;
        let dims = AttnDims {
            num_seqs: step.chunks.len(),
            heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size: self.kv.geometry.block_size,
            max_blocks_per_seq: self.meta.max_blocks_per_seq,
        };
        if self.meta.is_decode {
            g.paged_decode(
                &out,
                &q.buf,
                kc,
                vc,
                &self.dev.tables,
                &self.dev.context_lens,
                dims,
            )?;
        } else {
            g.prefill(
                &out,
                &q.buf,
                kc,
                vc,
                &self.dev.tables,
                &self.dev.cu_q_lens,
                &self.dev.context_lens,
                self.meta.max_q_len,
                dims,
            )?;
        }
        Ok(Act {
            buf: out,
            rows: n,
            cols: c.num_heads * c.head_dim,
        })
    }

    fn add_projection(&mut self, layer: usize, w: Proj, a: &Act, x: &mut Act) -> Result<()> {
        let l = &self.m.layers[layer];
        let lin = match w {
            Proj::Out => &l.o,
            Proj::Down => &l.down,
        };
        match &lin.w {
            // The residual add fused into the GEMM (beta = 1).
            DevMatrix::Dense(w) => self
                .gpu()
                .gemm(&a.buf, w, &x.buf, a.rows, lin.inner, lin.out, true)?,
            DevMatrix::Fp8(_) => {
                let a8 = self.fp8_input(a)?;
                let y = self.linear(a, a8.as_ref(), lin)?;
                self.gpu().add_into(&x.buf, &y.buf, x.rows * x.cols)?;
            }
        }
        Ok(())
    }

    fn swiglu(&mut self, layer: usize, x: &Act) -> Result<Act> {
        let l = &self.m.layers[layer];
        let x8 = self.fp8_input(x)?;
        let gate = self.linear(x, x8.as_ref(), &l.gate)?;
        let up = self.linear(x, x8.as_ref(), &l.up)?;
        let n = gate.rows * gate.cols;
        self.gpu().silu_mul(&gate.buf, &up.buf, &gate.buf, n)?;
        Ok(gate)
    }

    fn select_rows(&mut self, x: &Act, rows: &[u32]) -> Result<Act> {
        let g = self.gpu();
        // The step's logit rows went up with the rest of the metadata.
        let uploaded;
        let ids = if rows == self.logit_rows {
            &self.dev.logit_rows
        } else {
            uploaded = g.upload(DType::U32, &le_bytes(rows, u32::to_le_bytes))?;
            &uploaded
        };
        let out = g.empty(self.m.act, rows.len() * x.cols)?;
        g.embedding(ids, &x.buf, &out, rows.len(), x.cols)?;
        Ok(Act {
            buf: out,
            rows: rows.len(),
            cols: x.cols,
        })
    }

    fn lm_head(&mut self, x: &Act) -> Result<Act> {
        let vocab = self.m.config.vocab_size;
        let w = match &self.m.lm_head {
            Some(DevLinear {
                w: DevMatrix::Dense(w),
                ..
            }) => w,
            Some(_) => {
                return Err(EngineError::InvalidSetting {
                    field: "precision",
                    message: "the LM head is kept dense".into(),
                })
            }
            None => &self.m.embedding,
        };
        let out = self.gpu().empty(DType::F32, x.rows * vocab)?;
        self.gpu()
            .gemm(&x.buf, w, &out, x.rows, x.cols, vocab, false)?;
        Ok(Act {
            buf: out,
            rows: x.rows,
            cols: vocab,
        })
    }
}
