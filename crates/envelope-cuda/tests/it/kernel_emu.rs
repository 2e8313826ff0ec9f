//! The kernels of `kernels/` executed on the CPU emulator (`envelope_cuda::emu`):
//! first the emulator's own primitives (warp shuffles, block barriers, early
//! exits, deadlock detection, f16/bf16/fp8 conversions) against independent
//! Rust implementations, then the whole GPU self-test on the fake CUDA
//! driver: every kernel file compiled by the host C++ compiler, and every
//! case launched through cudarc and the runtime's methods, as on a GPU, with
//! the same tolerances. Needs `c++` (g++; scripts/test.sh installs it).

use envelope_cuda::emu::{EmuArg, Emulator, HostBuf};
use envelope_cuda::geometry::Launch;
use envelope_cuda::kernels::{KernelSource, KERNELS};
use std::path::Path;
use std::process::Command;

const PROBE: &[KernelSource] = &[KernelSource {
    file: "probe.cu",
    source: r#"
#include "common.cuh"
#include <cuda_fp8.h>
// Each thread's value is its global index; out gets the warp's and the
// block's sums.
extern "C" __global__ void sums(float* warp_out, float* block_out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const float v = (float)i;
  warp_out[i] = warp_sum(v);
  block_out[i] = block_sum(v);
}
// Threads past `live` return at once; the rest meet at a barrier and read
// what the others wrote to shared memory.
extern "C" __global__ void early_exit(int* out, int live) {
  __shared__ int s[1024];
  if ((int)threadIdx.x >= live) return;
  s[threadIdx.x] = threadIdx.x * 10;
  __syncthreads();
  out[threadIdx.x] = s[live - 1 - threadIdx.x];
}
// Half of warp 0 waits at a warp barrier, everyone else at the block
// barrier: neither can complete (a hang on a GPU), an error here.
extern "C" __global__ void divergent(int* out) {
  if (threadIdx.x < 16) __syncwarp(); else __syncthreads();
  out[threadIdx.x] = 1;
}
extern "C" __global__ void convert(const float* x, unsigned short* h, unsigned short* b,
                                   unsigned char* f8, float* f8_back, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  h[i] = __float2half_rn(x[i]).x;
  b[i] = __float2bfloat16_rn(x[i]).x;
  f8[i] = __nv_cvt_float_to_fp8(x[i], __NV_SATFINITE, __NV_E4M3);
  f8_back[i] = __half2float(__half(__nv_cvt_fp8_to_halfraw(f8[i], __NV_E4M3)));
}
"#,
    entries: &["sums", "early_exit", "divergent", "convert"],
    ptx: ["", ""],
}];

fn launch(grid: u32, block: u32) -> Launch {
    Launch {
        grid: (grid, 1, 1),
        block: (block, 1, 1),
        shared_bytes: 0,
    }
}

fn f32s(b: &HostBuf) -> Vec<f32> {
    b.to_vec()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn probe() -> Emulator {
    let e = Emulator::build_files(PROBE, None).expect("a C++ compiler");
    assert!(e.built.iter().all(|b| b.error.is_none()), "{:?}", e.built);
    e
}

#[test]
fn warp_and_block_reductions_see_every_thread() {
    let e = probe();
    let (blocks, threads) = (3usize, 128usize);
    let n = blocks * threads;
    let (w, b) = (HostBuf::zeroed(n * 4), HostBuf::zeroed(n * 4));
    e.launch(
        "probe.cu",
        "sums",
        launch(blocks as u32, threads as u32),
        &[EmuArg::Ptr(w.addr()), EmuArg::Ptr(b.addr())],
    )
    .unwrap();
    let (w, b) = (f32s(&w), f32s(&b));
    for i in 0..n {
        let warp0 = i / 32 * 32;
        let block0 = i / threads * threads;
        let want_w: usize = (warp0..warp0 + 32).sum();
        let want_b: usize = (block0..block0 + threads).sum();
        assert_eq!(w[i], want_w as f32, "warp sum at {i}");
        assert_eq!(b[i], want_b as f32, "block sum at {i}");
    }
}

#[test]
fn threads_that_return_early_leave_the_barrier() {
    let e = probe();
    let out = HostBuf::zeroed(256 * 4);
    let live = 100;
    e.launch(
        "probe.cu",
        "early_exit",
        launch(1, 256),
        &[EmuArg::Ptr(out.addr()), EmuArg::I32(live)],
    )
    .unwrap();
    let v: Vec<i32> = out
        .to_vec()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    for t in 0..256 {
        let want = if t < live { (live - 1 - t) * 10 } else { 0 };
        assert_eq!(v[t as usize], want, "thread {t}");
    }
}

#[test]
fn divergent_barriers_are_an_error_not_a_hang() {
    let e = probe();
    let out = HostBuf::zeroed(64 * 4);
    let err = e
        .launch(
            "probe.cu",
            "divergent",
            launch(1, 64),
            &[EmuArg::Ptr(out.addr())],
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("deadlock"), "{err}");
    // A kernel the file does not have is named.
    let err = e
        .launch("probe.cu", "nope", launch(1, 32), &[])
        .unwrap_err()
        .to_string();
    assert!(err.contains("no kernel nope"), "{err}");
}

#[test]
fn conversions_round_as_the_cuda_intrinsics() {
    let e = probe();
    // Every f16 and bf16 value, the halfway points between neighbours (ties
    // to even), the e4m3 range with its subnormals, and the edges.
    let mut x: Vec<f32> = Vec::new();
    for bits in 0..=u16::MAX {
        let h = half::f16::from_bits(bits).to_f32();
        let b = half::bf16::from_bits(bits).to_f32();
        x.extend([h, b]);
        let next = half::f16::from_bits(bits.wrapping_add(1)).to_f32();
        if h.is_finite() && next.is_finite() {
            x.push((h as f64 + (next as f64 - h as f64) / 2.0) as f32);
        }
    }
    for i in -4000..4000 {
        x.push(i as f32 * 0.125 + 0.0625);
        x.push(i as f32 * 1e-4);
    }
    x.extend([
        448.0,
        464.0,
        1e9,
        -1e9,
        65520.0,
        65519.0,
        f32::MAX,
        f32::MIN_POSITIVE,
    ]);
    x.retain(|v| !v.is_nan());
    let n = x.len();
    let xb = HostBuf::from_bytes(&x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>());
    let (h, b, f8, back) = (
        HostBuf::zeroed(n * 2),
        HostBuf::zeroed(n * 2),
        HostBuf::zeroed(n),
        HostBuf::zeroed(n * 4),
    );
    e.launch(
        "probe.cu",
        "convert",
        launch(n.div_ceil(256) as u32, 256),
        &[
            EmuArg::Ptr(xb.addr()),
            EmuArg::Ptr(h.addr()),
            EmuArg::Ptr(b.addr()),
            EmuArg::Ptr(f8.addr()),
            EmuArg::Ptr(back.addr()),
            EmuArg::I32(n as i32),
        ],
    )
    .unwrap();
    let u16s = |b: &HostBuf| -> Vec<u16> {
        b.to_vec()
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect()
    };
    let (h, b, f8, back) = (u16s(&h), u16s(&b), f8.to_vec(), f32s(&back));
    for i in 0..n {
        assert_eq!(
            h[i],
            half::f16::from_f32(x[i]).to_bits(),
            "f16 of {:e}",
            x[i]
        );
        assert_eq!(
            b[i],
            half::bf16::from_f32(x[i]).to_bits(),
            "bf16 of {:e}",
            x[i]
        );
        assert_eq!(
            f8[i],
            envelope_cuda::fp8::encode(x[i]),
            "e4m3 of {:e}",
            x[i]
        );
        assert_eq!(
            back[i],
            envelope_cuda::fp8::decode(f8[i]),
            "e4m3 {:#x}",
            f8[i]
        );
    }
}

/// Set in the child process of the test below: the folder its self-test
/// writes `selftest.json` to.
const SELFTEST_CHILD: &str = "ENVELOPE_KERNEL_EMU_SELFTEST_OUT";

/// The acceptance of every kernel without a GPU: the self-test's cases, all
/// of them, pass on the fake CUDA driver (each launch through cudarc and the
/// runtime's typed methods, run on the CPU-emulated kernels), and every
/// entry point is run by one. The driver must be on `LD_LIBRARY_PATH` when
/// the process starts, so the test runs itself again as a child with the
/// emulator's environment; the child runs `selftest::run` and the parent
/// judges its `selftest.json`.
#[test]
fn every_kernel_passes_the_gpu_self_test_on_the_fake_driver() {
    if let Some(out) = std::env::var_os(SELFTEST_CHILD) {
        envelope_cuda::selftest::run(0, Path::new(&out), serde_json::json!({}));
        return;
    }
    let emu = Emulator::build(None).expect("a C++ compiler");
    assert!(
        emu.built.iter().all(|b| b.error.is_none()),
        "{:#?}",
        emu.built
    );
    let out = std::env::temp_dir().join(format!("envelope-kernel-emu-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            // This test's name in the one test binary: its module path
            // less the binary's own name.
            &format!(
                "{}::every_kernel_passes_the_gpu_self_test_on_the_fake_driver",
                module_path!().split_once("::").map_or("", |(_, m)| m)
            ),
            "--nocapture",
        ])
        .envs(emu.env().expect("the fake CUDA driver builds"))
        .env(SELFTEST_CHILD, &out)
        .output()
        .unwrap();
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&child.stdout),
        String::from_utf8_lossy(&child.stderr)
    );
    assert!(child.status.success(), "{}\n{printed}", child.status);
    let text = std::fs::read_to_string(out.join("selftest.json")).expect(&printed);
    let _ = std::fs::remove_dir_all(&out);
    let rep: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(
        rep["device"]["name"]
            .as_str()
            .is_some_and(|n| n.starts_with(envelope_cuda::emu::DEVICE_NAME))
            && rep["emulated"].is_string(),
        "not the fake driver: {}",
        rep["device_error"]
    );
    assert!(rep["kernels_error"].is_null(), "{}", rep["kernels_error"]);
    let compile = rep["compile"].as_array().unwrap();
    assert_eq!(compile.len(), KERNELS.len(), "{compile:#?}");
    assert!(compile.iter().all(|c| c["error"].is_null()), "{compile:#?}");
    let cases = rep["cases"].as_array().unwrap();
    let failed: Vec<String> = cases
        .iter()
        .filter(|c| c["passed"] != true)
        .map(|c| {
            format!(
                "{} {}: err/tol {} {}",
                c["entry"], c["case"], c["max_err_over_tol"], c["error"]
            )
        })
        .collect();
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    let passed = rep["passed"].as_u64().unwrap();
    assert!(rep["failed"] == 0 && passed >= 127, "{passed} passed");
    // Launched inside another entry's case: absmax before quant_fp8, the
    // merge after a split decode.
    let inside = |e: &str| e.starts_with("absmax_") || e.starts_with("paged_attention_merge_");
    for k in KERNELS {
        for e in k.entries {
            assert!(
                inside(e) || cases.iter().any(|c| c["entry"] == *e),
                "no self-test case runs {e}"
            );
        }
    }
}
