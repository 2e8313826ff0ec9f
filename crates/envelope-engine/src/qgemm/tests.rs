use super::*;

fn random_matrix(f: QFormat, n: usize, k: usize, seed: u64) -> QMatrix {
    let bb = f.block_bytes();
    let mut data = vec![0u8; n * k / QK * bb];
    for (i, blk) in data.chunks_exact_mut(bb).enumerate() {
        let h = crate::weights::splitmix64(seed ^ i as u64);
        let d = f16::from_f32(0.01 + (h % 1000) as f32 * 1e-5)
            .to_bits()
            .to_le_bytes();
        blk[..2].copy_from_slice(&d);
        for (j, b) in blk[2..].iter_mut().enumerate() {
            *b = (crate::weights::splitmix64(h ^ j as u64) & 0xFF) as u8;
        }
        if f == QFormat::Q4_1 {
            blk[2..4].copy_from_slice(&f16::from_f32(-0.05).to_bits().to_le_bytes());
        }
    }
    QMatrix::new(f, n, k, data).unwrap()
}

#[test]
fn simd_matches_scalar_and_dequantised_reference() {
    for f in [QFormat::Q4_0, QFormat::Q4_1, QFormat::Q8_0] {
        let (n, k, m) = (37, 96, 2 * ROWS + 3);
        let w = random_matrix(f, n, k, 5);
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919 % 201) as f32 - 100.0) / 50.0)
            .collect();
        let got = matmul(&w, &x, m);
        // Scalar path on the same quantised activations.
        let acts = quantize_rows(&x, k);
        let mut wr = vec![0f32; k];
        for j in 0..n {
            w.dequantize_row(j, &mut wr);
            for i in 0..m {
                let mut res = [0f32; ROWS];
                dot_rows_scalar(f, w.row(j), &acts.tile(i / ROWS * ROWS), &mut res);
                let want = res[i % ROWS];
                let g = got[i * n + j];
                assert!(
                    (g - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "{f:?} simd {g} vs scalar {want}"
                );
                // Against f32 weights and f32 activations: only activation rounding differs.
                let exact: f32 = wr
                    .iter()
                    .zip(&x[i * k..(i + 1) * k])
                    .map(|(a, b)| a * b)
                    .sum();
                let tol = 0.02
                    * wr.iter()
                        .zip(&x[i * k..(i + 1) * k])
                        .map(|(a, b)| (a * b).abs())
                        .sum::<f32>()
                    + 1e-3;
                assert!((g - exact).abs() <= tol, "{f:?} {g} vs exact {exact}");
            }
        }
    }
}

/// Every SIMD path this CPU has, for every tile height: within
/// rounding of the scalar reference, and bit for bit what each
/// (weight row, activation row) pair gives alone.
#[cfg(target_arch = "x86_64")]
#[test]
fn every_simd_path_matches_scalar_for_every_tile_height() {
    let paths: [(&str, bool, DotTile); 2] = [
        (
            "avx2",
            is_x86_feature_detected!("avx2"),
            |f, rows, rb, t, res| unsafe { x86::dot_tile_avx2(f, rows, rb, t, res) },
        ),
        ("vnni", simd() == Simd::Vnni, |f, rows, rb, t, res| unsafe {
            x86::dot_tile_vnni(f, rows, rb, t, res)
        }),
    ];
    // Row i's activations depend on i only, whatever the batch.
    let x_row = |i: usize, k: usize| -> Vec<f32> {
        (0..k)
            .map(|c| (((i * k + c) * 7919 % 251) as f32 - 125.0) / 40.0)
            .collect()
    };
    for f in [QFormat::Q4_0, QFormat::Q4_1, QFormat::Q8_0] {
        let (n, k) = (5, 160);
        let w = random_matrix(f, n, k, 11);
        for (name, present, path) in paths {
            if !present {
                eprintln!("{name}: not on this CPU");
                continue;
            }
            // Each (weight row, activation row) alone: one row, one tile of one.
            let alone = |j: usize, i: usize| {
                let acts = quantize_rows(&x_row(i, k), k);
                let mut r = [[0f32; ROWS]];
                path(f, w.row(j), w.row(j).len(), &acts.tile(0), &mut r);
                r[0][0]
            };
            for h in 1..=ROWS {
                // A full tile, then one of `h` rows.
                let m = ROWS + h;
                let x: Vec<f32> = (0..m).flat_map(|i| x_row(i, k)).collect();
                let acts = quantize_rows(&x, k);
                // Every weight row in one call, as decode makes it.
                let rb = w.row(0).len();
                let all: Vec<Vec<[f32; ROWS]>> = [0, ROWS]
                    .map(|i0| {
                        let mut r = vec![[0f32; ROWS]; n];
                        path(f, &w.data[..n * rb], rb, &acts.tile(i0), &mut r);
                        r
                    })
                    .to_vec();
                for j in 0..n {
                    for (i0, each) in [0, ROWS].into_iter().zip(&all) {
                        let t = acts.tile(i0);
                        let (got, mut want) = (each[j], [0f32; ROWS]);
                        dot_rows_scalar(f, w.row(j), &t, &mut want);
                        for ri in 0..t.h {
                            let (g, e) = (got[ri], want[ri]);
                            assert!(
                                (g - e).abs() <= 1e-4 * e.abs().max(1.0),
                                "{name} {f:?} h={}: {g} vs scalar {e}",
                                t.h
                            );
                            // Bit for bit what the pair gives alone:
                            // batching changes no result.
                            assert_eq!(
                                g.to_bits(),
                                alone(j, i0 + ri).to_bits(),
                                "{name} {f:?} h={} row {j}",
                                t.h
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Matrices in groups: the GGUF bytes and rows come back unchanged,
/// and every product is bit for bit the scalar reference's, for every
/// tile height (the VNNI group kernel where the CPU has it, else the
/// scalar path through the groups).
#[test]
fn grouped_matrices_match_the_scalar_reference_bit_for_bit() {
    for f in [QFormat::Q4_0, QFormat::Q4_1, QFormat::Q8_0] {
        let (n, k) = (2 * groups::GROUP, 160);
        let raw = random_matrix(f, n, k, 23);
        let grouped = random_matrix(f, n, k, 23).grouped();
        assert!(grouped.is_grouped() && !raw.is_grouped());
        assert_ne!(grouped.data, raw.data, "{f:?}: the layout changed");
        assert_eq!(grouped.gguf_bytes(), raw.gguf_bytes(), "{f:?}");
        let (mut a, mut b) = (vec![0f32; k], vec![0f32; k]);
        for j in [0, 1, groups::GROUP - 1, groups::GROUP, n - 1] {
            raw.dequantize_row(j, &mut a);
            grouped.dequantize_row(j, &mut b);
            assert_eq!(a, b, "{f:?} row {j}");
        }
        for m in 1..=2 * ROWS + 1 {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7919 % 251) as f32 - 125.0) / 40.0)
                .collect();
            let got = matmul(&grouped, &x, m);
            let acts = quantize_rows(&x, k);
            for i in 0..m {
                for j in 0..n {
                    let mut want = [0f32; ROWS];
                    dot_rows_scalar(f, raw.row(j), &acts.tile(i / ROWS * ROWS), &mut want);
                    assert_eq!(
                        got[i * n + j].to_bits(),
                        want[i % ROWS].to_bits(),
                        "{f:?} m={m} ({i}, {j}): {} vs {}",
                        got[i * n + j],
                        want[i % ROWS]
                    );
                }
            }
        }
    }
    // Not a whole number of groups: the rows stay as they are.
    assert!(!random_matrix(QFormat::Q4_1, 17, 64, 1)
        .grouped()
        .is_grouped());
}

#[cfg(target_arch = "x86_64")]
type DotTile = fn(QFormat, &[u8], usize, &Tile, &mut [[f32; ROWS]]);

#[test]
fn matches_candle_quantized_matmul() {
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{Device, Module, Tensor};
    // k = 96: candle takes its repacked path (other activation blocks) when k % 256 == 0.
    let (n, k, m) = (64, 96, 5);
    let wf: Vec<f32> = (0..n * k)
        .map(|i| ((i * 7907 % 1009) as f32 - 504.0) / 700.0)
        .collect();
    let xf: Vec<f32> = (0..m * k)
        .map(|i| ((i * 7919 % 201) as f32 - 100.0) / 50.0)
        .collect();
    let wt = Tensor::from_vec(wf, (n, k), &Device::Cpu).unwrap();
    let xt = Tensor::from_vec(xf.clone(), (m, k), &Device::Cpu).unwrap();
    for (dt, f) in [
        (GgmlDType::Q4_0, QFormat::Q4_0),
        (GgmlDType::Q4_1, QFormat::Q4_1),
        (GgmlDType::Q8_0, QFormat::Q8_0),
    ] {
        let q = QTensor::quantize(&wt, dt).unwrap();
        let ours = QMatrix::new(f, n, k, q.data().unwrap().into_owned()).unwrap();
        let want: Vec<f32> = QMatMul::from_qtensor(q)
            .unwrap()
            .forward(&xt)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let got = matmul(&ours, &xf, m);
        for (a, b) in want.iter().zip(&got) {
            assert!(
                (a - b).abs() <= 1e-4 * a.abs().max(1.0),
                "{f:?}: candle {a} vs ours {b}"
            );
        }
    }
}

#[test]
fn many_matrices_in_one_pass_equal_separate_calls() {
    let f = QFormat::Q4_1;
    let k = 96;
    let ws = [
        random_matrix(f, 40, k, 1),
        random_matrix(f, 9, k, 2),
        random_matrix(f, 300, k, 3),
    ];
    for m in [1, 5, 17] {
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 31 % 97) as f32 - 48.0) / 9.0)
            .collect();
        let many = matmul_many(&[&ws[0], &ws[1], &ws[2]], &x, m);
        for (w, got) in ws.iter().zip(&many) {
            assert_eq!(got, &matmul(w, &x, m));
            assert_eq!(got.len(), m * w.n);
        }
    }
}

#[test]
fn matrix_size_is_checked() {
    assert!(QMatrix::new(QFormat::Q4_1, 2, 32, vec![0; 40]).is_some());
    assert!(QMatrix::new(QFormat::Q4_1, 2, 32, vec![0; 39]).is_none());
    assert!(QMatrix::new(QFormat::Q8_0, 1, 33, vec![0; 34]).is_none());
}
