//! The one percentile every part of envelope uses: nearest rank, on the
//! values themselves (no histogram buckets), so a p95 in a profile, in the
//! governor's latency guard and in a quality report means the same thing.

use crate::Percentiles;

/// The nearest-rank `q` quantile of `values` (`0 < q <= 1`): the smallest
/// value with at least a fraction `q` of all values at or below it. `None`
/// when `values` is empty. Reorders `values` (a selection, not a sort).
pub fn nearest_rank(values: &mut [f64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let n = values.len();
    let rank = ((q * n as f64).ceil() as usize).clamp(1, n);
    Some(*values.select_nth_unstable_by(rank - 1, f64::total_cmp).1)
}

impl Percentiles {
    /// p50, p95, p99 (nearest rank), max and mean of `values`; all zero
    /// when empty.
    pub fn of(values: &[f64]) -> Percentiles {
        if values.is_empty() {
            return Percentiles::default();
        }
        let mut v = values.to_vec();
        let mut q = |p| nearest_rank(&mut v, p).unwrap_or(0.0);
        Percentiles {
            p50: q(0.50),
            p95: q(0.95),
            p99: q(0.99),
            max: q(1.0),
            mean: values.iter().sum::<f64>() / values.len() as f64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_of_known_sets() {
        let mut v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(nearest_rank(&mut v, 0.95), Some(95.0));
        assert_eq!(nearest_rank(&mut v, 0.5), Some(50.0));
        assert_eq!(nearest_rank(&mut v, 0.05), Some(5.0));
        assert_eq!(nearest_rank(&mut v, 1.0), Some(100.0));
        // Few values: the rank rounds up, never below the first.
        assert_eq!(nearest_rank(&mut [3.0, 1.0, 2.0], 0.95), Some(3.0));
        assert_eq!(nearest_rank(&mut [3.0, 1.0, 2.0], 0.01), Some(1.0));
        assert_eq!(nearest_rank(&mut [7.0], 0.5), Some(7.0));
        assert_eq!(nearest_rank(&mut [], 0.5), None);
    }

    #[test]
    fn percentiles_of_a_known_set() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let p = Percentiles::of(&v);
        assert_eq!((p.p50, p.p95, p.p99, p.max), (50.0, 95.0, 99.0, 100.0));
        assert!((p.mean - 50.5).abs() < 1e-9);
        assert_eq!(Percentiles::of(&[]), Percentiles::default());
    }
}
