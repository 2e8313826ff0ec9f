//! CUDA graphs for decode steps. A decode step of `n` sequences runs, per
//! layer, about a dozen kernel and GEMM launches plus the metadata uploads;
//! at small batches the launch overhead is a large part of the step. So a
//! decode step is padded to a batch-size bucket (`geometry::graph_buckets`
//! of `max_num_seqs`) and a block-table width class (powers of two), its
//! whole forward pass and token pick are captured once per (bucket, width)
//! into a graph reading fixed device buffers, and every later step of that
//! shape writes its metadata into those buffers and replays the graph.
//!
//! Padding rows repeat the real row with the shortest context (its token,
//! position, block table and context, so their attention costs least) with
//! KV slot -1, which the append kernel skips: they write nothing, and their
//! activations equal that row's, so fp8's per-tensor activation scales
//! (absmax over all rows) are the unpadded step's.
//! Their greedy picks are never read. `StepMeta::padded` is the host side,
//! tested on the CPU against the kernels' references.
//!
//! The first step of a shape runs eagerly on the graph's own buffers (which
//! loads every library kernel it needs, so none loads inside the capture,
//! and gives that step's tokens), then is captured. Anything the capture
//! or a replay cannot take (a library that allocates, an API the capture
//! mode refuses, a failed launch) switches graphs off for the model with a
//! warning, and steps run eagerly. `ENVELOPE_CUDA_GRAPHS=0` switches them
//! off from the start. The first step of every (bucket, width) pays for a
//! capture (a few milliseconds per layer group): `graph_stats` counts them.

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
    /// `None` only while it is being made.
    graph: Option<Graph>,
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
    /// Why graphs cannot be used (the setting, the device, a failure):
    /// `None` while they can.
    pub unusable: Option<String>,
    /// Switched off by the caller (the bench measures both ways).
    pub paused: bool,
    pub stats: GraphStats,
}

impl GraphSet {
    /// Graphs for batches up to `max_num_seqs`, unless
    /// `ENVELOPE_CUDA_GRAPHS=0` or the device cannot capture allocations.
    pub fn new(max_num_seqs: usize, can_capture: bool) -> GraphSet {
        let unusable = match std::env::var("ENVELOPE_CUDA_GRAPHS").as_deref() {
            Ok("0") | Ok("off") | Ok("false") => Some("ENVELOPE_CUDA_GRAPHS=0".to_string()),
            _ if !can_capture => {
                Some("the device has no stream-ordered allocation (memory pools)".to_string())
            }
            _ => None,
        };
        GraphSet {
            buckets: geometry::graph_buckets(max_num_seqs),
            unusable,
            ..GraphSet::default()
        }
    }

    /// Why decode steps run without graphs now (`None`: they use them).
    pub fn off(&self) -> Option<&str> {
        if self.buckets.is_empty() {
            return Some("no KV pool yet");
        }
        match (&self.unusable, self.paused) {
            (Some(why), _) => Some(why),
            (None, true) => Some("switched off"),
            (None, false) => None,
        }
    }

    /// Pauses or resumes graphs; what made them unusable stays.
    pub fn set_enabled(&mut self, on: bool) {
        self.paused = !on;
    }

    /// Gives graphs up for this model: a capture or replay failed.
    fn fail(&mut self, why: String) {
        tracing::warn!("{why}; decode steps run without CUDA graphs");
        self.unusable = Some(why);
        self.graphs.clear();
    }
}

impl StepMeta {
    /// The real row padding rows repeat: the shortest context (the first
    /// such row).
    pub fn pad_row(&self) -> usize {
        (0..self.context_lens.len())
            .min_by_key(|&i| self.context_lens[i])
            .unwrap_or(0)
    }

    /// This decode step's metadata padded to `bucket` rows and block tables
    /// `width` wide: the fixed shape a graph was captured for.
    ///
    /// # Errors
    /// Not a decode step, more rows than the bucket, or a table wider than
    /// `width`.
    pub fn padded(&self, bucket: usize, width: usize) -> Result<StepMeta> {
        // Padding rows copy a real row (so fp8's per-tensor absmax is the
        // unpadded step's) with KV slot -1 (so they write nothing); the row
        // with the shortest context, so their attention costs least.
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
        if n == 0 {
            return Err(bad("an empty step has nothing to pad".into()));
        }
        // Rows n.. repeat the pad row's table, position and context.
        let r = self.pad_row();
        let mut tables = vec![0i32; bucket * width];
        for s in 0..bucket {
            let src = if s < n { s } else { r };
            let row =
                &self.tables[src * self.max_blocks_per_seq..(src + 1) * self.max_blocks_per_seq];
            tables[s * width..s * width + row.len()].copy_from_slice(row);
        }
        let pad = bucket - n;
        let repeat = |v: &[i32]| -> Vec<i32> {
            v.iter()
                .copied()
                .chain(std::iter::repeat_n(v[r], pad))
                .collect()
        };
        Ok(StepMeta {
            positions: self
                .positions
                .iter()
                .copied()
                .chain(std::iter::repeat_n(self.positions[r], pad))
                .collect(),
            slots: self
                .slots
                .iter()
                .copied()
                .chain(std::iter::repeat_n(-1, pad))
                .collect(),
            tables,
            max_blocks_per_seq: width,
            context_lens: repeat(&self.context_lens),
            cu_q_lens: (0..=bucket as i32).collect(),
            max_q_len: 1,
            is_decode: true,
        })
    }
}

/// `[bucket]` token ids (padding repeats row `pad_row`'s, as
/// [`StepMeta::padded`] repeats its metadata) and `[bucket * 3]` pick
/// parameters (padding picks greedily).
pub fn padded_inputs(
    ids: &[u32],
    picks: &[DevicePick],
    bucket: usize,
    pad_row: usize,
) -> (Vec<u32>, Vec<f32>) {
    let mut t = ids.to_vec();
    t.resize(bucket, ids.get(pad_row).copied().unwrap_or(0));
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
        if set.off().is_some()
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
        let (ids, params) = padded_inputs(&step.ids, picks, bucket, meta.pad_row());
        let tokens = match set.graphs.get_mut(&(bucket, width)) {
            Some(g) => match self.replay(g, &ids, &params, &padded) {
                Ok(t) => {
                    set.stats.replayed += 1;
                    t
                }
                Err(e) => {
                    set.fail(format!(
                        "replaying a decode graph ({bucket} x {width}) failed: {e}"
                    ));
                    self.gpu.trim_pool();
                    return Ok(None);
                }
            },
            None => match self.capture(kv, &padded, &ids, &params) {
                Ok((g, t)) => {
                    set.graphs.insert((bucket, width), g);
                    set.stats.captured += 1;
                    t
                }
                Err(e) => {
                    set.fail(format!(
                        "capturing a decode graph ({bucket} x {width}) failed: {e}"
                    ));
                    self.gpu.trim_pool();
                    return Ok(None);
                }
            },
        };
        Ok(Some(tokens[..n].to_vec()))
    }

    /// Writes the step into a graph's buffers, replays it, reads the tokens.
    fn replay(
        &self,
        g: &mut DecodeGraph,
        ids: &[u32],
        params: &[f32],
        padded: &StepMeta,
    ) -> Result<Vec<u32>> {
        write_inputs(&self.gpu, g, ids, params, padded)?;
        g.graph
            .as_ref()
            .ok_or_else(|| EngineError::InvalidSetting {
                field: "cuda graphs",
                message: "a graph that was never captured".into(),
            })?
            .launch()?;
        read_tokens(&self.gpu, &g.tokens)
    }

    /// Makes the graph of a decode step shaped as `padded`: runs the step
    /// eagerly on the graph's own buffers first (its tokens are returned,
    /// and every library kernel it needs is loaded before the capture),
    /// then captures the same work, which does not run.
    fn capture(
        &self,
        kv: &DevKv,
        padded: &StepMeta,
        ids: &[u32],
        params: &[f32],
    ) -> Result<(DecodeGraph, Vec<u32>)> {
        let gpu = &self.gpu;
        let bucket = ids.len();
        let rows: Vec<u32> = (0..bucket as u32).collect();
        let mut g = DecodeGraph {
            graph: None,
            meta: DevMeta {
                ids: gpu.zeros(DType::U32, bucket)?,
                positions: gpu.zeros(DType::U32, bucket)?,
                slots: gpu.zeros(DType::I64, bucket)?,
                tables: gpu.zeros(DType::I32, padded.tables.len())?,
                context_lens: gpu.zeros(DType::I32, bucket)?,
                cu_q_lens: gpu.zeros(DType::I32, bucket + 1)?,
                logit_rows: gpu.upload(DType::U32, &le_bytes(&rows, u32::to_le_bytes))?,
            },
            params: gpu.zeros(DType::F32, bucket * 3)?,
            tokens: gpu.zeros(DType::U32, bucket)?,
        };
        write_inputs(gpu, &mut g, ids, params, padded)?;
        // The shape the backend sees: `bucket` one-token chunks, every row
        // sampled; its metadata comes from the graph's buffers.
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
        let run = || -> Result<()> {
            let mut b = CudaBackend {
                m: self,
                logit_rows: &step.logit_rows,
                kv,
                meta: padded,
                dev: &g.meta,
            };
            let logits = model::forward(&self.config, &mut b, &step)?.ok_or_else(|| {
                EngineError::InvalidSetting {
                    field: "cuda graphs",
                    message: "the step produced no logits".into(),
                }
            })?;
            gpu.sample_into(
                &logits.buf,
                bucket,
                self.config.vocab_size,
                &g.params,
                &g.tokens,
            )?;
            Ok(())
        };
        run()?;
        let tokens = read_tokens(gpu, &g.tokens)?;
        gpu.begin_capture()?;
        // A panic must not leave the stream capturing: caught, the capture
        // is ended below and the panic becomes the error.
        let recorded =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).unwrap_or_else(|_| {
                Err(EngineError::InvalidSetting {
                    field: "cuda graphs",
                    message: "a panic while capturing".into(),
                })
            });
        // Always end the capture, so the stream is usable after a failure.
        let graph = gpu.end_capture();
        recorded?;
        g.graph = Some(graph?);
        Ok((g, tokens))
    }
}

/// Writes a padded step into a graph's buffers (ids, metadata, picks).
fn write_inputs(
    gpu: &Gpu,
    g: &mut DecodeGraph,
    ids: &[u32],
    params: &[f32],
    padded: &StepMeta,
) -> Result<()> {
    write_meta(gpu, &mut g.meta, ids, padded)?;
    gpu.write(&mut g.params, &le_bytes(params, f32::to_le_bytes))?;
    Ok(())
}

/// The tokens a graph (or its warm-up) picked.
fn read_tokens(gpu: &Gpu, tokens: &Buf) -> Result<Vec<u32>> {
    let b = gpu.download_bytes(tokens)?;
    Ok(b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
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
        // Padding rows repeat the shortest-context row (row 0 here) and
        // write no KV (slot -1).
        assert_eq!(decode_meta().pad_row(), 0);
        assert_eq!(p.positions, vec![5, 9, 5, 5]);
        assert_eq!(p.slots, vec![37, 9, -1, -1]);
        assert_eq!(p.context_lens, vec![6, 10, 6, 6]);
        assert_eq!(p.cu_q_lens, vec![0, 1, 2, 3, 4]);
        assert_eq!(
            (p.max_blocks_per_seq, p.max_q_len, p.is_decode),
            (16, 1, true)
        );
        assert_eq!(p.tables.len(), 64);
        assert_eq!(&p.tables[..3], &[7, 9, 0]);
        assert_eq!(&p.tables[16..19], &[1, 3, 2]);
        assert_eq!(&p.tables[32..35], &[7, 9, 0]);
        assert_eq!(&p.tables[48..51], &[7, 9, 0]);
        assert!(p.tables[19..32].iter().all(|&b| b == 0));
        // An exact fit is the identity on the real rows.
        let same = decode_meta().padded(2, 3).unwrap();
        assert_eq!(same, decode_meta());
    }

    #[test]
    fn padding_repeats_the_shortest_context() {
        let m = StepMeta {
            context_lens: vec![10, 6],
            positions: vec![9, 5],
            slots: vec![9, 37],
            tables: vec![1, 3, 2, 7, 9, 0],
            ..decode_meta()
        };
        assert_eq!(m.pad_row(), 1);
        let p = m.padded(3, 16).unwrap();
        assert_eq!(p.context_lens, vec![10, 6, 6]);
        assert_eq!(p.positions, vec![9, 5, 5]);
        assert_eq!(p.slots, vec![9, 37, -1]);
        assert_eq!(&p.tables[32..35], &[7, 9, 0]);
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
    fn padded_inputs_repeat_the_first_token_and_pick_greedily() {
        let picks = [DevicePick {
            temperature: 0.7,
            top_p: 0.9,
            u: 0.25,
        }];
        let (ids, params) = padded_inputs(&[42], &picks, 2, 0);
        assert_eq!(ids, vec![42, 42]);
        assert_eq!(padded_inputs(&[7, 42], &picks, 4, 1).0, vec![7, 42, 42, 42]);
        assert_eq!(params, vec![0.7, 0.9, 0.25, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn pausing_does_not_undo_what_made_graphs_unusable() {
        let mut s = GraphSet::new(64, true);
        assert_eq!(s.buckets, vec![1, 2, 4, 8, 16, 32, 64]);
        let env_off = std::env::var("ENVELOPE_CUDA_GRAPHS").is_ok_and(|v| v == "0");
        assert_eq!(s.off().is_none(), !env_off);
        s.set_enabled(false);
        assert!(s.off().is_some());
        s.set_enabled(true);
        assert_eq!(s.off().is_none(), !env_off);
        s.fail("a capture failed".into());
        s.set_enabled(true);
        assert_eq!(s.off(), Some("a capture failed"));
        let no_pools = GraphSet::new(64, false);
        assert!(no_pools.off().is_some());
        assert_eq!(GraphSet::default().off(), Some("no KV pool yet"));
    }
}
