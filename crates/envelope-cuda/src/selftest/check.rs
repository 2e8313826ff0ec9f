//! How a case is judged: per-dtype tolerances, the rounding an upload
//! adds, the comparison with the CPU reference, and the context the case
//! groups record their results in.

use super::CaseResult;
use crate::error::Result;
use crate::rng::Rng;
use crate::runtime::{decode, encode, DType, Gpu};
use serde::Serialize;

/// A tolerance `|gpu - ref| <= atol + rtol * |ref|`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Tol {
    pub atol: f32,
    pub rtol: f32,
}

/// Per dtype: f32 allows accumulation-order and `expf`/`cosf` ulp
/// differences; f16 and bf16 allow one rounding of the output (2^-11 and
/// 2^-8 relative) plus the f32 slack, doubled for reductions. The cases
/// compare in f32, f16 or bf16 only; other dtypes get f32's.
pub fn tolerance(dt: DType) -> Tol {
    match dt {
        DType::F16 => Tol {
            atol: 2e-3,
            rtol: 2e-3,
        },
        DType::Bf16 => Tol {
            atol: 1.6e-2,
            rtol: 1.6e-2,
        },
        _ => Tol {
            atol: 1e-4,
            rtol: 1e-4,
        },
    }
}

/// Rounds values through `dt` (what the GPU sees after upload): the
/// runtime's own host encoding, there and back. f32 (and any dtype without
/// an f32 encoding) is unchanged.
pub fn round(dt: DType, x: &[f32]) -> Vec<f32> {
    match dt {
        DType::F16 | DType::Bf16 => decode(dt, &encode(dt, x)),
        _ => x.to_vec(),
    }
}

/// Largest absolute error, largest error relative to the tolerance (pass
/// when <= 1), and the index of the worst element.
pub fn compare(gpu: &[f32], reference: &[f32], tol: Tol) -> (f32, f32, usize) {
    let mut worst = (0f32, 0f32, 0usize);
    if gpu.len() != reference.len() {
        return (f32::INFINITY, f32::INFINITY, 0);
    }
    for (i, (g, r)) in gpu.iter().zip(reference).enumerate() {
        let err = (g - r).abs();
        let ratio = if err.is_nan() {
            f32::INFINITY
        } else if err == 0.0 {
            0.0
        } else {
            // A zero tolerance (exact cases) makes any difference infinite.
            err / (tol.atol + tol.rtol * r.abs())
        };
        worst.0 = worst.0.max(if err.is_nan() { f32::INFINITY } else { err });
        if ratio > worst.1 {
            worst.1 = ratio;
            worst.2 = i;
        }
    }
    worst
}

/// What the case groups share: the runtime they call, the seeded inputs,
/// and the results so far.
pub(super) struct Cx<'a> {
    pub gpu: &'a Gpu,
    pub rng: Rng,
    pub out: Vec<CaseResult>,
}

impl Cx<'_> {
    /// Records one comparison.
    pub fn check(
        &mut self,
        case: &str,
        entry: &str,
        dt: DType,
        gpu: Result<Vec<f32>>,
        reference: &[f32],
        note: Option<String>,
    ) {
        self.check_tol(case, entry, dt, gpu, reference, note, tolerance(dt));
    }

    /// Token indices and other integers: equal or failed.
    pub fn check_exact(
        &mut self,
        case: &str,
        entry: &str,
        gpu: Result<Vec<f32>>,
        reference: &[f32],
        note: Option<String>,
    ) {
        let exact = Tol {
            atol: 0.0,
            rtol: 0.0,
        };
        self.check_tol(case, entry, DType::F32, gpu, reference, note, exact);
    }

    #[allow(clippy::too_many_arguments)]
    fn check_tol(
        &mut self,
        case: &str,
        entry: &str,
        dt: DType,
        gpu: Result<Vec<f32>>,
        reference: &[f32],
        note: Option<String>,
        tol: Tol,
    ) {
        let res = match gpu {
            Ok(g) => {
                let (abs, ratio, _) = compare(&g, reference, tol);
                CaseResult {
                    case: case.into(),
                    entry: entry.into(),
                    dtype: dt,
                    tolerance: tol,
                    elements: reference.len(),
                    max_abs_err: abs,
                    max_err_over_tol: ratio,
                    passed: ratio <= 1.0,
                    note,
                    error: None,
                }
            }
            Err(e) => CaseResult {
                case: case.into(),
                entry: entry.into(),
                dtype: dt,
                tolerance: tol,
                elements: reference.len(),
                max_abs_err: f32::NAN,
                max_err_over_tol: f32::NAN,
                passed: false,
                note,
                error: Some(e.to_string()),
            },
        };
        self.out.push(res);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_is_the_upload_encoding() {
        let x = [1.0f32, -2.5, 0.1, 3.0e4];
        assert_eq!(round(DType::F32, &x), x.to_vec());
        assert_eq!(
            round(DType::Bf16, &[0.1])[0],
            half::bf16::from_f32(0.1).to_f32()
        );
        assert_eq!(
            round(DType::F16, &[0.1])[0],
            half::f16::from_f32(0.1).to_f32()
        );
    }

    #[test]
    fn compare_uses_the_stated_tolerance() {
        let t = Tol {
            atol: 0.1,
            rtol: 0.0,
        };
        let (abs, ratio, i) = compare(&[1.0, 2.05, 3.0], &[1.0, 2.0, 3.0], t);
        assert!((abs - 0.05).abs() < 1e-6 && ratio < 1.0 && i == 1);
        assert!(compare(&[1.0, 2.5], &[1.0, 2.0], t).1 > 1.0);
        assert!(compare(&[f32::NAN], &[1.0], t).1.is_infinite());
        let exact = Tol {
            atol: 0.0,
            rtol: 0.0,
        };
        assert_eq!(compare(&[5.0, 49_151.0], &[5.0, 49_151.0], exact).1, 0.0);
        assert!(compare(&[5.0, 49_150.0], &[5.0, 49_151.0], exact)
            .1
            .is_infinite());
        assert!(compare(&[1.0], &[1.0, 2.0], t).1.is_infinite());
    }

    #[test]
    fn rounding_the_reference_output_stays_inside_the_tolerance() {
        // One output rounding (what the GPU adds over the f32 reference)
        // must fit each dtype's tolerance, or the self-test could never pass.
        let mut rng = Rng::new(3);
        let x = rng.vec(10_000, 100.0);
        for dt in [DType::F16, DType::Bf16] {
            let (_, ratio, _) = compare(&round(dt, &x), &x, tolerance(dt));
            assert!(ratio <= 1.0, "{dt:?} {ratio}");
        }
    }
}
