//! Latency percentiles through HDR histograms (microsecond resolution).

use envelope_profile::Percentiles;
use hdrhistogram::Histogram;

/// Percentiles of `values_ms`; all zero when empty.
pub fn percentiles(values_ms: &[f64]) -> Percentiles {
    if values_ms.is_empty() {
        return Percentiles::default();
    }
    let mut h =
        Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).expect("static bounds are valid");
    for v in values_ms {
        let us = (v * 1000.0).round().max(1.0) as u64;
        let _ = h.record(us.min(3_600_000_000));
    }
    let q = |p: f64| h.value_at_quantile(p) as f64 / 1000.0;
    Percentiles {
        p50: q(0.50),
        p95: q(0.95),
        p99: q(0.99),
        max: h.max() as f64 / 1000.0,
        mean: values_ms.iter().sum::<f64>() / values_ms.len() as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_a_known_set() {
        let v: Vec<f64> = (1..=100).map(|i| i as f64).collect();
        let p = percentiles(&v);
        assert!((p.p50 - 50.0).abs() < 0.1, "{p:?}");
        assert!((p.p95 - 95.0).abs() < 0.1);
        assert!((p.p99 - 99.0).abs() < 0.1);
        assert!((p.max - 100.0).abs() < 0.1);
        assert!((p.mean - 50.5).abs() < 1e-9);
        assert_eq!(percentiles(&[]), Percentiles::default());
    }
}
