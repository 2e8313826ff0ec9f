//! Small helpers shared by the CLI, the benchmarks and the harness.

/// A byte size: `1073741824`, `512M` (10^6), `512MiB` (2^20), `1.5GiB`.
pub fn parse_bytes(s: &str) -> Option<usize> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let num: f64 = num.parse().ok()?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "ki" | "kib" => 1024.0,
        "mi" | "mib" => 1024.0 * 1024.0,
        "gi" | "gib" => 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    };
    (num.is_finite() && num >= 0.0).then_some((num * mult) as usize)
}

/// A deterministic prompt of exactly `n` ordinary token ids (no special
/// tokens: ids from 300 up), different for each `salt`.
pub fn synthetic_prompt(n: usize, vocab: usize, salt: u64) -> Vec<u32> {
    let lo = 300.min(vocab as u64 / 2);
    let span = (vocab as u64 - lo).clamp(1, 20_000);
    (0..n as u64)
        .map(|i| (lo + crate::weights::splitmix64(i ^ (salt << 32)) % span) as u32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_bytes("1024"), Some(1024));
        assert_eq!(parse_bytes("512MiB"), Some(512 << 20));
        assert_eq!(parse_bytes("2G"), Some(2_000_000_000));
        assert_eq!(parse_bytes("1.5GiB"), Some(3 << 29));
        assert_eq!(parse_bytes("lots"), None);
        assert_eq!(parse_bytes("5XB"), None);
    }

    #[test]
    fn synthetic_prompts_have_the_exact_length() {
        let p = synthetic_prompt(100, 512, 1);
        assert_eq!(p.len(), 100);
        assert!(p.iter().all(|&t| (256..512).contains(&t)));
        assert_ne!(p, synthetic_prompt(100, 512, 2));
        assert_eq!(p, synthetic_prompt(100, 512, 1));
    }
}
