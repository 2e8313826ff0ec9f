//! A step's metadata, built on the host from its chunks.

use crate::error::Result;
use crate::model::StepBatch;
use envelope_cuda::geometry;

/// Everything a step needs to know on the device, built on the host from
/// the chunks: where each new token's K/V goes, each sequence's block
/// table and context, where its query rows start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepMeta {
    pub positions: Vec<u32>,
    /// Flat cache slot of every new token (`block * block_size + pos % block_size`).
    pub slots: Vec<i64>,
    pub tables: Vec<i32>,
    pub max_blocks_per_seq: usize,
    /// Keys each sequence attends to after this step (`start + len`).
    pub context_lens: Vec<i32>,
    /// `[0, q0, q0 + q1, ...]`.
    pub cu_q_lens: Vec<i32>,
    pub max_q_len: usize,
    pub is_decode: bool,
}

impl StepMeta {
    /// # Errors
    /// A block table that does not cover its chunk.
    pub fn build(step: &StepBatch, block_size: usize) -> Result<StepMeta> {
        let chunks = step.chunks;
        let mut slots = Vec::with_capacity(step.ids.len());
        for c in chunks {
            slots.extend(geometry::slot_mapping(
                c.block_table,
                c.start_pos..c.start_pos + c.tokens.len(),
                block_size,
            )?);
        }
        let ctx: Vec<usize> = chunks
            .iter()
            .map(|c| c.start_pos + c.tokens.len())
            .collect();
        let tables: Vec<&[u32]> = chunks.iter().map(|c| c.block_table).collect();
        let flat = geometry::flatten_block_tables(&tables, &ctx, block_size)?;
        let q_lens: Vec<usize> = chunks.iter().map(|c| c.tokens.len()).collect();
        Ok(StepMeta {
            positions: step.positions.iter().map(|&p| p as u32).collect(),
            slots,
            tables: flat.data,
            max_blocks_per_seq: flat.max_blocks_per_seq,
            context_lens: ctx.iter().map(|&n| n as i32).collect(),
            cu_q_lens: geometry::cu_seqlens(&q_lens),
            max_q_len: q_lens.iter().copied().max().unwrap_or(0),
            is_decode: step.is_decode(),
        })
    }
}
