//! One typed method per kernel of `kernels/`: each checks its buffers,
//! takes the launch geometry from [`crate::geometry`] and passes the
//! argument list of the kernel's signature. The engine calls these, and the
//! GPU self-test ([`crate::selftest`]) checks them against the CPU
//! references, so an argument list that does not match its kernel fails a
//! self-test case.

use super::{drv, shape, Arg, Buf, DType, Fp8Buf, Gpu};
use crate::error::{CudaError, Result};
use crate::geometry::{self, Launch};
use cudarc::driver::{CudaFunction, CudaSlice, PushKernelArg};

impl Gpu {
    fn func(&self, entry: &str) -> Result<&CudaFunction> {
        self.funcs.get(entry).ok_or_else(|| CudaError::Driver {
            call: "cuModuleGetFunction",
            message: format!("no kernel entry {entry}"),
        })
    }

    /// Launches `entry` (asynchronously, on the stream).
    pub fn launch(&self, entry: &str, l: Launch, args: &[Arg]) -> Result<()> {
        let f = self.func(entry)?;
        let mut b = self.stream.launch_builder(f);
        for a in args {
            match a {
                Arg::Buf(s) => b.arg(&s.data),
                Arg::Raw(s) => b.arg(*s),
                Arg::F32s(s) => b.arg(*s),
                Arg::I32(v) => b.arg(v),
                Arg::I64(v) => b.arg(v),
                Arg::U64(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
            };
        }
        // SAFETY: every caller (the methods below and the GEMMs) passes the
        // argument list of the kernel's signature in kernels/, with buffers
        // of the sizes the launch geometry covers; the self-test checks each
        // of those lists on a device or the fake driver.
        unsafe { b.launch(l.to_cudarc()) }.map_err(drv("cuLaunchKernel"))?;
        Ok(())
    }

    /// `out[t] = table[ids[t]]` (also: gathering rows of an activation).
    pub fn embedding(
        &self,
        ids: &Buf,
        table: &Buf,
        out: &Buf,
        n: usize,
        hidden: usize,
    ) -> Result<()> {
        Self::same("embedding", table, out)?;
        Self::need("embedding", out, n * hidden)?;
        self.launch(
            &format!("embedding_{}", out.dtype.suffix()),
            geometry::embedding(n, hidden)?,
            &[
                Arg::Buf(ids),
                Arg::Buf(table),
                Arg::Buf(out),
                Arg::I32(hidden as i32),
            ],
        )
    }

    pub fn rmsnorm(
        &self,
        x: &Buf,
        w: &Buf,
        out: &Buf,
        rows: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<()> {
        Self::same("rmsnorm", x, out)?;
        Self::same("rmsnorm", x, w)?;
        Self::need("rmsnorm", out, rows * hidden)?;
        self.launch(
            &format!("rmsnorm_{}", x.dtype.suffix()),
            geometry::rmsnorm(rows, hidden)?,
            &[
                Arg::Buf(x),
                Arg::Buf(w),
                Arg::Buf(out),
                Arg::I32(hidden as i32),
                Arg::F32(eps),
            ],
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &Buf,
        positions: &Buf,
        inv_freq: &CudaSlice<f32>,
        n: usize,
        heads: usize,
        head_dim: usize,
        interleaved: bool,
    ) -> Result<()> {
        Self::need("rope", x, n * heads * head_dim)?;
        self.launch(
            &format!("rope_{}", x.dtype.suffix()),
            geometry::rope(n, heads, head_dim)?,
            &[
                Arg::Buf(x),
                Arg::Buf(positions),
                Arg::F32s(inv_freq),
                Arg::I32(n as i32),
                Arg::I32(heads as i32),
                Arg::I32(head_dim as i32),
                Arg::I32(interleaved as i32),
            ],
        )
    }

    pub fn silu_mul(&self, gate: &Buf, up: &Buf, out: &Buf, n: usize) -> Result<()> {
        Self::same("silu_mul", gate, up)?;
        Self::need("silu_mul", out, n)?;
        self.launch(
            &format!("silu_mul_{}", out.dtype.suffix()),
            geometry::elementwise("silu_mul", n)?,
            &[
                Arg::Buf(gate),
                Arg::Buf(up),
                Arg::Buf(out),
                Arg::I64(n as i64),
            ],
        )
    }

    /// `x += b` elementwise over `n` elements.
    pub fn add_into(&self, x: &Buf, b: &Buf, n: usize) -> Result<()> {
        Self::same("residual_add", x, b)?;
        Self::need("residual_add", x, n)?;
        self.launch(
            &format!("residual_add_{}", x.dtype.suffix()),
            geometry::elementwise("residual_add", n)?,
            &[Arg::Buf(x), Arg::Buf(b), Arg::Buf(x), Arg::I64(n as i64)],
        )
    }

    /// `x[r, i] += bias[i]` for `rows` rows of `cols`.
    pub fn bias_add(&self, x: &Buf, bias: &Buf, rows: usize, cols: usize) -> Result<()> {
        Self::same("bias_add", x, bias)?;
        self.launch(
            &format!("bias_add_{}", x.dtype.suffix()),
            geometry::elementwise("bias_add", rows * cols)?,
            &[
                Arg::Buf(x),
                Arg::Buf(bias),
                Arg::I64((rows * cols) as i64),
                Arg::I32(cols as i32),
            ],
        )
    }

    /// Writes `n` tokens' K and V rows into their cache slots.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_append(
        &self,
        k: &Buf,
        v: &Buf,
        k_cache: &Buf,
        v_cache: &Buf,
        slots: &Buf,
        n: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        self.launch(
            &format!("kv_append_{}_{}", k.dtype.suffix(), k_cache.dtype.suffix()),
            geometry::kv_append(n, kv_heads, head_dim)?,
            &[
                Arg::Buf(k),
                Arg::Buf(v),
                Arg::Buf(k_cache),
                Arg::Buf(v_cache),
                Arg::Buf(slots),
                Arg::I32((kv_heads * head_dim) as i32),
            ],
        )
    }

    /// Decode attention: one query row per sequence. Split over partitions
    /// of [`geometry::DECODE_PARTITION`] keys, and merged by a second
    /// launch, when [`geometry::decode_partitions`] says so (long tables,
    /// few sequences).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_decode(
        &self,
        out: &Buf,
        q: &Buf,
        k_cache: &Buf,
        v_cache: &Buf,
        tables: &Buf,
        context_lens: &Buf,
        a: AttnDims,
    ) -> Result<()> {
        let parts =
            geometry::decode_partitions(a.num_seqs, a.heads, a.max_blocks_per_seq, a.block_size);
        let bufs = [out, q, k_cache, v_cache, tables, context_lens];
        self.decode_attention(bufs, a, parts, geometry::DECODE_PARTITION)
    }

    /// [`Gpu::paged_decode`] split into partitions of `partition_keys` keys
    /// of the table width, whatever [`geometry::decode_partitions`] would
    /// choose (one partition: unsplit). The self-test checks the split and
    /// the merge this way on tables short enough for the CPU reference.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_decode_split(
        &self,
        out: &Buf,
        q: &Buf,
        k_cache: &Buf,
        v_cache: &Buf,
        tables: &Buf,
        context_lens: &Buf,
        a: AttnDims,
        partition_keys: usize,
    ) -> Result<()> {
        if partition_keys == 0 {
            return Err(shape(
                "paged_attention_decode",
                "partitions of 0 keys".into(),
            ));
        }
        let parts = (a.max_blocks_per_seq * a.block_size)
            .div_ceil(partition_keys)
            .max(1);
        let bufs = [out, q, k_cache, v_cache, tables, context_lens];
        self.decode_attention(bufs, a, parts, partition_keys)
    }

    /// The decode launch over `parts` partitions of `partition_keys` keys,
    /// and the merge when there is more than one.
    fn decode_attention(
        &self,
        [out, q, k_cache, v_cache, tables, context_lens]: [&Buf; 6],
        a: AttnDims,
        parts: usize,
        partition_keys: usize,
    ) -> Result<()> {
        let partials = if parts > 1 {
            Some(self.empty(
                DType::F32,
                geometry::decode_partials_len(a.num_seqs, a.heads, a.head_dim, parts),
            )?)
        } else {
            None
        };
        let mut args = a.with_shape(&[
            Arg::Buf(out),
            Arg::Buf(q),
            Arg::Buf(k_cache),
            Arg::Buf(v_cache),
            Arg::Buf(tables),
            Arg::Buf(context_lens),
        ]);
        // Unsplit, the kernel does not read `partials`: a null pointer.
        args.push(partials.as_ref().map_or(Arg::U64(0), Arg::Buf));
        args.push(Arg::I32(partition_keys as i32));
        self.launch(
            &format!(
                "paged_attention_decode_{}_{}",
                q.dtype.suffix(),
                k_cache.dtype.suffix()
            ),
            geometry::paged_decode(a.num_seqs, a.heads, a.kv_heads, a.head_dim, parts)?,
            &args,
        )?;
        if let Some(p) = &partials {
            self.launch(
                &format!("paged_attention_merge_{}", out.dtype.suffix()),
                geometry::paged_merge(a.num_seqs, a.heads)?,
                &[
                    Arg::Buf(out),
                    Arg::Buf(p),
                    Arg::I32(a.heads as i32),
                    Arg::I32(a.head_dim as i32),
                    Arg::I32(parts as i32),
                ],
            )?;
        }
        Ok(())
    }

    /// Prefill (and mixed) attention over query rows `cu_q_lens`.
    #[allow(clippy::too_many_arguments)]
    pub fn prefill(
        &self,
        out: &Buf,
        q: &Buf,
        k_cache: &Buf,
        v_cache: &Buf,
        tables: &Buf,
        cu_q_lens: &Buf,
        context_lens: &Buf,
        max_q_len: usize,
        a: AttnDims,
    ) -> Result<()> {
        self.launch(
            &format!(
                "prefill_attention_{}_{}",
                q.dtype.suffix(),
                k_cache.dtype.suffix()
            ),
            geometry::prefill(a.num_seqs, max_q_len, a.heads, a.kv_heads, a.head_dim)?,
            &a.with_shape(&[
                Arg::Buf(out),
                Arg::Buf(q),
                Arg::Buf(k_cache),
                Arg::Buf(v_cache),
                Arg::Buf(tables),
                Arg::Buf(cu_q_lens),
                Arg::Buf(context_lens),
            ]),
        )
    }

    /// GGUF blocks (`q4_0`, `q4_1`, `q8_0`) to `out`'s dtype.
    pub fn dequant(&self, format: &str, blocks: &Buf, out: &Buf, n_blocks: usize) -> Result<()> {
        Self::need("dequant", out, n_blocks * 32)?;
        self.launch(
            &format!("dequant_{format}_{}", out.dtype.suffix()),
            geometry::dequant(n_blocks)?,
            &[Arg::Buf(blocks), Arg::Buf(out), Arg::I64(n_blocks as i64)],
        )
    }

    /// Fills `out` with the dummy values of key `key` (see kernels/dummy.cu).
    pub fn dummy_fill(&self, out: &Buf, key: u64, scale: f32) -> Result<()> {
        self.launch(
            &format!("dummy_fill_{}", out.dtype.suffix()),
            geometry::elementwise("dummy_fill", out.len)?,
            &[
                Arg::Buf(out),
                Arg::I64(out.len as i64),
                Arg::U64(key),
                Arg::F32(scale),
            ],
        )
    }

    /// Per-tensor e4m3 quantisation of the first `n` elements of `x` into
    /// `out` (scale written on the device).
    pub fn quantize_fp8_into(&self, x: &Buf, n: usize, out: &Fp8Buf) -> Result<()> {
        // alloc_zeros: the absmax kernel's atomicMax starts from 0.
        let amax = self
            .stream
            .alloc_zeros::<f32>(1)
            .map_err(drv("cuMemAlloc"))?;
        let blocks = n
            .div_ceil(geometry::ELEMENTWISE_THREADS as usize)
            .clamp(1, 1024);
        let l = Launch {
            grid: (blocks as u32, 1, 1),
            block: (geometry::ELEMENTWISE_THREADS, 1, 1),
            shared_bytes: 0,
        };
        let sfx = x.dtype.suffix();
        self.launch(
            &format!("absmax_{sfx}"),
            l,
            &[Arg::Buf(x), Arg::I64(n as i64), Arg::F32s(&amax)],
        )?;
        self.launch(
            &format!("quant_fp8_{sfx}"),
            geometry::elementwise("quant_fp8", n)?,
            &[
                Arg::Buf(x),
                Arg::Buf(&out.data),
                Arg::I64(n as i64),
                Arg::F32s(&amax),
                Arg::F32s(&out.scale),
            ],
        )
    }

    /// The largest logit of each row of `[rows, vocab]` logits (the lowest
    /// index on a tie, as on the CPU) into `out` (u32 `[rows]`), left on
    /// the device.
    pub fn argmax_into(&self, logits: &Buf, rows: usize, vocab: usize, out: &Buf) -> Result<()> {
        Self::need("argmax", logits, rows * vocab)?;
        Self::need("argmax", out, rows)?;
        self.launch(
            &format!("argmax_{}", logits.dtype.suffix()),
            geometry::sampling(rows)?,
            &[Arg::Buf(logits), Arg::Buf(out), Arg::I32(vocab as i32)],
        )
    }

    /// [`Gpu::argmax_into`], the tokens copied back.
    pub fn argmax(&self, logits: &Buf, rows: usize, vocab: usize) -> Result<Vec<u32>> {
        let out = self.zeros(DType::U32, rows)?;
        self.argmax_into(logits, rows, vocab, &out)?;
        Ok(u32s(&self.download_bytes(&out)?))
    }

    /// [`Gpu::sample`] with the parameters already on the device and the
    /// tokens left there (`params`: f32 `[rows * 3]`, `out`: u32 `[rows]`);
    /// nothing is copied, so a graph can capture it.
    pub fn sample_into(
        &self,
        logits: &Buf,
        rows: usize,
        vocab: usize,
        params: &Buf,
        out: &Buf,
    ) -> Result<()> {
        Self::need("sample", logits, rows * vocab)?;
        Self::need("sample", params, rows * 3)?;
        Self::need("sample", out, rows)?;
        self.launch(
            &format!("sample_{}", logits.dtype.suffix()),
            geometry::sampling(rows)?,
            &[
                Arg::Buf(logits),
                Arg::Buf(out),
                Arg::I32(vocab as i32),
                Arg::Buf(params),
            ],
        )
    }

    /// One token per row of `[rows, vocab]` logits, picked per row by
    /// `params[3 row ..] = (temperature, top_p, u)`: greedy (the lowest
    /// index on a tie) when temperature <= 0, else top-p at the uniform u
    /// (`kernels/sampling.cu`).
    pub fn sample(
        &self,
        logits: &Buf,
        rows: usize,
        vocab: usize,
        params: &[f32],
    ) -> Result<Vec<u32>> {
        if params.len() != rows * 3 {
            return Err(shape(
                "sample",
                format!("{} parameters for {rows} rows (3 per row)", params.len()),
            ));
        }
        Self::need("sample", logits, rows * vocab)?;
        let p = self.upload_f32(DType::F32, params)?;
        let out = self.zeros(DType::U32, rows)?;
        self.sample_into(logits, rows, vocab, &p, &out)?;
        Ok(u32s(&self.download_bytes(&out)?))
    }
}

fn u32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Shape of an attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnDims {
    pub num_seqs: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub max_blocks_per_seq: usize,
}

impl AttnDims {
    /// `buffers` followed by the scalar tail both attention kernels take:
    /// `max_blocks_per_seq, num_heads, num_kv_heads, head_dim, block_size,
    /// scale`.
    fn with_shape<'a>(&self, buffers: &[Arg<'a>]) -> Vec<Arg<'a>> {
        let mut v = buffers.to_vec();
        v.extend([
            Arg::I32(self.max_blocks_per_seq as i32),
            Arg::I32(self.heads as i32),
            Arg::I32(self.kv_heads as i32),
            Arg::I32(self.head_dim as i32),
            Arg::I32(self.block_size as i32),
            Arg::F32(1.0 / (self.head_dim as f32).sqrt()),
        ]);
        v
    }
}
