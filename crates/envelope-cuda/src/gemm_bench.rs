//! GEMM throughput of the two paths, cuBLAS/cuBLASLt and `kernels/gemm.cu`,
//! on the linear layers of Llama 3.1 8B at decode and prefill row counts
//! (`envelope cuda-selftest --gemm-bench`, run by `scripts/device-check.sh`).
//! It says what a machine without cuBLAS gives up, per shape.

use crate::error::Result;
use crate::runtime::{DType, Gpu};
use serde::Serialize;
use std::time::Instant;

/// One linear layer: `y[rows, out] = x[rows, inner] W[out, inner]^T`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct GemmShape {
    pub name: &'static str,
    pub inner: usize,
    pub out: usize,
}

/// Llama 3.1 8B's projections (hidden 4096, 8 KV heads of 128,
/// intermediate 14336, vocabulary 128256).
pub const LLAMA_8B: [GemmShape; 5] = [
    GemmShape {
        name: "q/o",
        inner: 4096,
        out: 4096,
    },
    GemmShape {
        name: "k/v",
        inner: 4096,
        out: 1024,
    },
    GemmShape {
        name: "gate/up",
        inner: 4096,
        out: 14336,
    },
    GemmShape {
        name: "down",
        inner: 14336,
        out: 4096,
    },
    GemmShape {
        name: "lm_head",
        inner: 4096,
        out: 128_256,
    },
];

/// One timed shape, dtype, path and row count.
#[derive(Debug, Clone, Serialize)]
pub struct GemmPoint {
    pub shape: &'static str,
    /// `bf16` or `fp8` (e4m3 operands, bf16 out).
    pub dtype: &'static str,
    /// `cublas` or `kernels`.
    pub path: &'static str,
    pub rows: usize,
    pub inner: usize,
    pub out: usize,
    pub calls: usize,
    pub us_per_call: f64,
    pub tflops: f64,
    /// Weight bytes read per second (what bounds decode).
    pub weight_gb_per_s: f64,
    pub error: Option<String>,
}

impl GemmPoint {
    /// The columns of `gemm-bench.csv`.
    pub const CSV_HEADER: [&'static str; 11] = [
        "shape",
        "dtype",
        "path",
        "rows",
        "inner",
        "out",
        "calls",
        "us_per_call",
        "tflops",
        "weight_gb_per_s",
        "error",
    ];

    pub fn csv_row(&self) -> [String; 11] {
        [
            self.shape.to_string(),
            self.dtype.to_string(),
            self.path.to_string(),
            self.rows.to_string(),
            self.inner.to_string(),
            self.out.to_string(),
            self.calls.to_string(),
            format!("{:.2}", self.us_per_call),
            format!("{:.3}", self.tflops),
            format!("{:.1}", self.weight_gb_per_s),
            self.error.clone().unwrap_or_default(),
        ]
    }

    /// The printed table's header, over [`GemmPoint::line`]s.
    pub fn header_line() -> String {
        format!(
            "{:<8} {:<5} {:<8} {:>5} {:>6} {:>7} {:>11} {:>8} {:>9}",
            "shape", "dtype", "path", "rows", "inner", "out", "us/call", "TFLOP/s", "W GB/s"
        )
    }

    pub fn line(&self) -> String {
        format!(
            "{:<8} {:<5} {:<8} {:>5} {:>6} {:>7} {:>11.1} {:>8.1} {:>9.0}{}",
            self.shape,
            self.dtype,
            self.path,
            self.rows,
            self.inner,
            self.out,
            self.us_per_call,
            self.tflops,
            self.weight_gb_per_s,
            self.error
                .as_deref()
                .map(|e| format!(" ERROR {e}"))
                .unwrap_or_default()
        )
    }
}

/// Times every shape of `shapes` at every row count, in bf16
/// and (where the device has fp8) fp8, on cuBLAS when it is loaded and on
/// the kernels. Each point: two warm-up calls, then calls until 50 ms or 50
/// calls (at least 3), one synchronisation at the end. `on_point` sees each
/// point as soon as it is timed (so a run stopped part-way has printed what
/// it measured).
pub fn run(
    gpu: &Gpu,
    shapes: &[GemmShape],
    rows_list: &[usize],
    mut on_point: impl FnMut(&GemmPoint),
) -> Vec<GemmPoint> {
    let mut points = Vec::new();
    let paths: &[&'static str] = if gpu.has_cublas() {
        &["cublas", "kernels"]
    } else {
        &["kernels"]
    };
    let dtypes: &[&'static str] = if gpu.info.fp8 {
        &["bf16", "fp8"]
    } else {
        &["bf16"]
    };
    for s in shapes {
        for &dtype in dtypes {
            for &rows in rows_list {
                for &path in paths {
                    let mut p = GemmPoint {
                        shape: s.name,
                        dtype,
                        path,
                        rows,
                        inner: s.inner,
                        out: s.out,
                        calls: 0,
                        us_per_call: f64::NAN,
                        tflops: f64::NAN,
                        weight_gb_per_s: f64::NAN,
                        error: None,
                    };
                    if let Err(e) = time_point(gpu, &mut p) {
                        p.error = Some(e.to_string());
                    }
                    on_point(&p);
                    points.push(p);
                }
            }
        }
    }
    points
}

fn time_point(gpu: &Gpu, p: &mut GemmPoint) -> Result<()> {
    let (rows, inner, out) = (p.rows, p.inner, p.out);
    let x = gpu.empty(DType::Bf16, rows * inner)?;
    let w = gpu.empty(DType::Bf16, out * inner)?;
    gpu.dummy_fill(&x, 1, 1.0)?;
    gpu.dummy_fill(&w, 2, 0.02)?;
    let y = gpu.empty(DType::Bf16, rows * out)?;
    let fp8 = if p.dtype == "fp8" {
        let (x8, w8) = (gpu.fp8_buf(rows * inner)?, gpu.fp8_buf(out * inner)?);
        gpu.quantize_fp8_into(&x, rows * inner, &x8)?;
        gpu.quantize_fp8_into(&w, out * inner, &w8)?;
        Some((x8, w8))
    } else {
        None
    };
    let kernels = p.path == "kernels";
    let call = || -> Result<()> {
        match (&fp8, kernels) {
            (None, false) => gpu.gemm(&x, &w, &y, rows, inner, out, false),
            (None, true) => gpu.gemm_kernels(&x, &w, &y, rows, inner, out, false),
            (Some((x8, w8)), false) => gpu.gemm_fp8(x8, w8, &y, rows, inner, out),
            (Some((x8, w8)), true) => gpu.gemm_fp8_kernels(x8, w8, &y, rows, inner, out),
        }
    };
    call()?;
    call()?;
    gpu.synchronize()?;
    let t = Instant::now();
    let mut calls = 0;
    while calls < 3 || (calls < 50 && t.elapsed().as_secs_f64() < 0.05) {
        call()?;
        calls += 1;
        // Bound the queue: the clock only counts what has run.
        if calls % 8 == 0 {
            gpu.synchronize()?;
        }
    }
    gpu.synchronize()?;
    let secs = t.elapsed().as_secs_f64() / calls as f64;
    let weight_bytes = (out * inner) as f64 * if fp8.is_some() { 1.0 } else { 2.0 };
    p.calls = calls;
    p.us_per_call = secs * 1e6;
    p.tflops = 2.0 * (rows * inner * out) as f64 / secs / 1e12;
    p.weight_gb_per_s = weight_bytes / secs / 1e9;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shapes_are_llama_8b_s() {
        let mut distinct: Vec<(usize, usize)> = LLAMA_8B.iter().map(|s| (s.inner, s.out)).collect();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), LLAMA_8B.len());
        // Matrices per layer: q, k, v, o, gate, up, down = 4096 x (4096 * 2
        // + 1024 * 2 + 14336 * 3) = 218.1 M parameters.
        let per_layer: usize = ["q/o", "k/v", "q/o", "k/v", "gate/up", "gate/up", "down"]
            .iter()
            .map(|n| {
                LLAMA_8B
                    .iter()
                    .find(|s| s.name == *n)
                    .map(|s| s.inner * s.out)
                    .unwrap()
            })
            .sum();
        assert_eq!(per_layer, 218_103_808);
    }
}
