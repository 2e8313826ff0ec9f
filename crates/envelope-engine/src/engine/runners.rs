//! What runs a step's forward pass: the CPU model over its host KV pool,
//! or a model on a GPU ([`crate::cuda::CudaModel`]).

use super::StepRunner;
use crate::error::Result;
use crate::kv_cache::KvPool;
use crate::model::{Model, SeqChunk};
use crate::sampling::DevicePick;

pub(super) struct CpuRunner {
    pub(super) model: Model,
    pub(super) kv: KvPool,
}

impl StepRunner for CpuRunner {
    fn forward(&mut self, chunks: &[SeqChunk]) -> Result<Vec<Vec<f32>>> {
        Ok(match self.model.forward(&mut self.kv, chunks)? {
            Some(l) => l.to_vec2::<f32>()?,
            None => Vec::new(),
        })
    }
}

impl StepRunner for crate::cuda::CudaModel {
    fn forward(&mut self, chunks: &[SeqChunk]) -> Result<Vec<Vec<f32>>> {
        crate::cuda::CudaModel::forward(self, chunks)
    }
    fn describe(&self) -> String {
        crate::cuda::CudaModel::describe(self)
    }
    fn samples_on_device(&self) -> bool {
        true
    }
    fn forward_sample(&mut self, chunks: &[SeqChunk], picks: &[DevicePick]) -> Result<Vec<u32>> {
        crate::cuda::CudaModel::forward_sample(self, chunks, picks)
    }
}
