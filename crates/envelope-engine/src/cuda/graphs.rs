//! CUDA graphs for decode steps. A decode step of `n` sequences runs, per
//! layer, about a dozen kernel and GEMM launches plus the metadata uploads;
//! at small batches the launch overhead is a large part of the step. So a
//! decode step is padded to a batch-size bucket (`geometry::graph_buckets`
//! of `max_num_seqs`) and a block-table width class (powers of two), its
//! whole forward pass and token pick are captured once per (bucket, width)
//! into a graph reading fixed device buffers, and every later step of that
//! shape writes its metadata into those buffers and replays the graph.
//!
//! Padding rows are inert: token 0 at position 0, KV slot -1 (the append
//! kernel skips it), context length 0 (attention writes zeros), a greedy
//! pick that is never read. `StepMeta::padded` is the host side, tested on
//! the CPU against the kernels' references.
//!
//! Anything the capture cannot take (a library that allocates, an API the
//! capture mode refuses) ends the capture with an error: graphs are then
//! switched off for the model with a warning, and steps run eagerly.
//! `ENVELOPE_CUDA_GRAPHS=0` switches them off from the start.

use super::{CudaBackend, CudaModel, DevKv, DevMeta, StepMeta};
use crate::error::{EngineError, Result};
use crate::model::{self, SeqChunk, StepBatch};
use crate::sampling::DevicePick;
use envelope_cuda::geometry;
use envelope_cuda::runtime::{le_bytes, Buf, DType, Gpu, Graph};
use std::collections::HashMap;

/// Smallest block-table width a graph is captured for.
pub const MIN_TABLE_WIDTH: usize = 16;

/// The table width class of a step whose longest table has `blocks` entries.
pub fn width_class(blocks: usize) -> usize {
    blocks.max(MIN_TABLE_WIDTH).next_power_of_two()
}

/// One (bucket, width) graph and the buffers it reads and writes.
struct DecodeGraph {
    graph: Graph,
    meta: DevMeta,
    /// `[bucket * 3]` f32: temperature, top_p, u per row.
    params: Buf,
    /// `[bucket]` u32: the picked tokens.
    tokens: Buf,
}

/// Counters for the bench and the logs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct GraphStats {
    pub captured: usize,
    pub replayed: usize,
    pub eager_decode_steps: usize,
}

#[derive(Default)]
pub struct GraphSet {
    buckets: Vec<usize>,
    graphs: HashMap<(usize, usize), DecodeGraph>,
    /// Why graphs are off; `None` while they are on.
    pub off: Option<String>,
    pub stats: GraphStats,
}

impl GraphSet {
    /// Graphs for batches up to `max_num_seqs`, unless
    /// `ENVELOPE_CUDA_GRAPHS=0`.
    pub fn new(max_num_seqs: usize) -> GraphSet {
        let off = match std::env::var("ENVELOPE_CUDA_GRAPHS").as_deref() {
            Ok("0") | Ok("off") | Ok("false") => Some("ENVELOPE_CUDA_GRAPHS=0".to_string()),
            _ => None,
        };
        GraphSet {
            buckets: geometry::graph_buckets(max_num_seqs),
            off,
            ..GraphSet::default()
        }
    }

    /// Switches graphs on or off (the bench measures both).
    pub fn set_enabled(&mut self, on: bool) {
        self.off = if on {
            None
        } else {
            Some("switched off".into())
        };
    }
}

impl StepMeta {
    /// This decode step's metadata padded to `bucket` rows and block tables
    /// `width` wide: the fixed shape a graph was captured for.
    ///
    /// # Errors
    /// Not a decode step, more rows than the bucket, or a table wider than
    /// `width`.
    pub fn padded(&self, bucket: usize, width: usize) -> Result<StepMeta> {
        let n = self.context_lens.len();
        let bad = |m: String| EngineError::InvalidSetting {
            field: "cuda graphs",
            message: m,
        };
        if !self.is_decode || self.positions.len() != n {
            return Err(bad(
                "only decode steps (one token per sequence) are padded".into()
            ));
        }
        if n > bucket || self.max_blocks_per_seq > width {
            return Err(bad(format!(
                "{n} rows of {} blocks do not fit a {bucket} x {width} graph",
                self.max_blocks_per_seq
            )));
        }
        let mut tables = vec![0i32; bucket * width];
        for s in 0..n {
            let row = &self.tables[s * self.max_blocks_per_seq..(s + 1) * self.max_blocks_per_seq];
            tables[s * width..s * width + row.len()].copy_from_slice(row);
        }
        let pad = bucket - n;
        Ok(StepMeta {
            positions: self
                .positions
                .iter()
                .copied()
                .chain(std::iter::repeat_n(0, pad))
                .collect(),
            slots: self
                .slots
                .iter()
                .copied()
                .chain(std::iter::repeat_n(-1, pad))
                .collect(),
            tables,
            max_blocks_per_seq: width,
            context_lens: self
                .context_lens
                .iter()
                .copied()
                .chain(std::iter::repeat_n(0, pad))
                .collect(),
            cu_q_lens: (0..=bucket as i32).collect(),
            max_q_len: 1,
            is_decode: true,
        })
    }
}

/// `[bucket]` token ids and `[bucket * 3]` pick parameters, padded.
pub fn padded_inputs(ids: &[u32], picks: &[DevicePick], bucket: usize) -> (Vec<u32>, Vec<f32>) {
    let mut t = ids.to_vec();
    t.resize(bucket, 0);
    let mut p: Vec<f32> = picks
        .iter()
        .flat_map(|p| [p.temperature, p.top_p, p.u])
        .collect();
    p.resize(bucket * 3, 0.0);
    (t, p)
}

impl CudaModel {
    /// Runs a decode step from a graph: `Ok(None)` when the step is not one
    /// (prefill, a row without a pick, larger than every bucket) or graphs
    /// are off, and the caller runs it eagerly.
    pub(super) fn decode_from_graph(
        &self,
        set: &mut GraphSet,
        chunks: &[SeqChunk],
        picks: &[DevicePick],
    ) -> Result<Option<Vec<u32>>> {
        let Some(kv) = self.kv.as_ref() else {
            return Ok(None);
        };
        let step = StepBatch::new(chunks);
        let n = step.ids.len();
        if set.off.is_some()
            || n == 0
            || !step.is_decode()
            || step.logit_rows.len() != n
            || picks.len() != n
        {
            return Ok(None);
        }
        let Some(bucket) = geometry::bucket_for(n, &set.buckets) else {
            return Ok(None);
        };
        if step
            .ids
            .iter()
            .any(|&t| t as usize >= self.config.vocab_size)
        {
            return Ok(None); // the eager path reports it
        }
        let meta = StepMeta::build(&step, kv.geometry.block_size)?;
        let width = width_class(meta.max_blocks_per_seq);
        let padded = meta.padded(bucket, width)?;
        let g = match set.graphs.entry((bucket, width)) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(slot) => {
                match self.capture(kv, &padded, bucket) {
                    Ok(g) => {
                        set.stats.captured += 1;
                        slot.insert(g)
                    }
                    Err(e) => {
                        let why =
                            format!("capturing a decode graph ({bucket} x {width}) failed: {e}");
                        tracing::warn!("{why}; decode steps run without CUDA graphs");
                        set.off = Some(why);
                        set.graphs.clear();
                        return Ok(None);
                    }
                }
            }
        };
        let gpu = &self.gpu;
        let (ids, params) = padded_inputs(&step.ids, picks, bucket);
        write_meta(gpu, &mut g.meta, &ids, &padded)?;
        gpu.write(&mut g.params, &le_bytes(&params, f32::to_le_bytes))?;
        g.graph.launch()?;
        let b = gpu.download_bytes(&g.tokens)?;
        set.stats.replayed += 1;
        Ok(Some(
            b.chunks_exact(4)
                .take(n)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ))
    }

    /// Captures the forward pass and pick of a `bucket`-row decode step
    /// shaped as `padded`, reading the returned graph's buffers.
    fn capture(&self, kv: &DevKv, padded: &StepMeta, bucket: usize) -> Result<DecodeGraph> {
        let gpu = &self.gpu;
        let meta = DevMeta {
            ids: gpu.zeros(DType::U32, bucket)?,
            positions: gpu.zeros(DType::U32, bucket)?,
            slots: gpu.zeros(DType::I64, bucket)?,
            tables: gpu.zeros(DType::I32, padded.tables.len())?,
            context_lens: gpu.zeros(DType::I32, bucket)?,
            cu_q_lens: gpu.zeros(DType::I32, bucket + 1)?,
            logit_rows: gpu.upload(
                DType::U32,
                &le_bytes(&(0..bucket as u32).collect::<Vec<_>>(), u32::to_le_bytes),
            )?,
        };
        let params = gpu.zeros(DType::F32, bucket * 3)?;
        let tokens = gpu.zeros(DType::U32, bucket)?;
        // The shape the backend sees: `bucket` one-token chunks, every row
        // sampled; its metadata comes from the buffers above.
        let zero = [0u32];
        let chunks: Vec<SeqChunk> = (0..bucket)
            .map(|_| SeqChunk {
                tokens: &zero,
                start_pos: 0,
                block_table: &[],
                want_logits: true,
            })
            .collect();
        let step = StepBatch::new(&chunks);
        gpu.synchronize()?;
        gpu.begin_capture()?;
        let recorded = (|| -> Result<()> {
            let mut b = CudaBackend {
                m: self,
                logit_rows: &step.logit_rows,
                kv,
                meta: padded,
                dev: &meta,
            };
            let logits = model::forward(&self.config, &mut b, &step)?.ok_or_else(|| {
                EngineError::InvalidSetting {
                    field: "cuda graphs",
                    message: "the captured step produced no logits".into(),
                }
            })?;
            gpu.sample_into(
                &logits.buf,
                bucket,
                self.config.vocab_size,
                &params,
                &tokens,
            )?;
            Ok(())
        })();
        // Always end the capture, so the stream is usable after a failure.
        let graph = gpu.end_capture();
        recorded?;
        Ok(DecodeGraph {
            graph: graph?,
            meta,
            params,
            tokens,
        })
    }
}

/// Writes a padded step's metadata into a graph's buffers.
fn write_meta(gpu: &Gpu, dev: &mut DevMeta, ids: &[u32], m: &StepMeta) -> Result<()> {
    gpu.write(&mut dev.ids, &le_bytes(ids, u32::to_le_bytes))?;
    gpu.write(
        &mut dev.positions,
        &le_bytes(&m.positions, u32::to_le_bytes),
    )?;
    gpu.write(&mut dev.slots, &le_bytes(&m.slots, i64::to_le_bytes))?;
    gpu.write(&mut dev.tables, &le_bytes(&m.tables, i32::to_le_bytes))?;
    gpu.write(
        &mut dev.context_lens,
        &le_bytes(&m.context_lens, i32::to_le_bytes),
    )?;
    gpu.write(
        &mut dev.cu_q_lens,
        &le_bytes(&m.cu_q_lens, i32::to_le_bytes),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_meta() -> StepMeta {
        // Two sequences decoding at positions 5 and 9, tables 2 and 3 wide
        // (flattened to 3), block size 4.
        StepMeta {
            positions: vec![5, 9],
            slots: vec![9 * 4 + 1, 2 * 4 + 1],
            tables: vec![7, 9, 0, 1, 3, 2],
            max_blocks_per_seq: 3,
            context_lens: vec![6, 10],
            cu_q_lens: vec![0, 1, 2],
            max_q_len: 1,
            is_decode: true,
        }
    }

    #[test]
    fn padding_keeps_the_real_rows_and_makes_the_rest_inert() {
        let p = decode_meta().padded(4, 16).unwrap();
        assert_eq!(p.positions, vec![5, 9, 0, 0]);
        assert_eq!(p.slots, vec![37, 9, -1, -1]);
        assert_eq!(p.context_lens, vec![6, 10, 0, 0]);
        assert_eq!(p.cu_q_lens, vec![0, 1, 2, 3, 4]);
        assert_eq!(
            (p.max_blocks_per_seq, p.max_q_len, p.is_decode),
            (16, 1, true)
        );
        assert_eq!(p.tables.len(), 64);
        assert_eq!(&p.tables[..3], &[7, 9, 0]);
        assert_eq!(&p.tables[16..19], &[1, 3, 2]);
        assert!(p.tables[19..32]
            .iter()
            .chain(&p.tables[32..])
            .all(|&b| b == 0));
        // An exact fit is the identity on the real rows.
        let same = decode_meta().padded(2, 3).unwrap();
        assert_eq!(same, decode_meta());
    }

    #[test]
    fn what_does_not_fit_a_graph_is_refused() {
        let m = decode_meta();
        assert!(m.padded(1, 16).is_err(), "more rows than the bucket");
        assert!(m.padded(4, 2).is_err(), "tables wider than the class");
        let prefill = StepMeta {
            is_decode: false,
            ..decode_meta()
        };
        assert!(prefill.padded(4, 16).is_err());
    }

    #[test]
    fn width_classes_are_powers_of_two_from_16() {
        assert_eq!(width_class(1), 16);
        assert_eq!(width_class(16), 16);
        assert_eq!(width_class(17), 32);
        assert_eq!(width_class(513), 1024);
    }

    #[test]
    fn padded_inputs_are_greedy_token_zero() {
        let picks = [DevicePick {
            temperature: 0.7,
            top_p: 0.9,
            u: 0.25,
        }];
        let (ids, params) = padded_inputs(&[42], &picks, 2);
        assert_eq!(ids, vec![42, 0]);
        assert_eq!(params, vec![0.7, 0.9, 0.25, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn graphs_can_be_switched_off() {
        let mut s = GraphSet::new(64);
        assert_eq!(s.buckets, vec![1, 2, 4, 8, 16, 32, 64]);
        s.set_enabled(false);
        assert!(s.off.is_some());
        s.set_enabled(true);
        assert!(s.off.is_none() || std::env::var("ENVELOPE_CUDA_GRAPHS").is_ok());
    }
}
