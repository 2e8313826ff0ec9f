//! Host readings from `/proc`: the fallback when there is no GPU, and the
//! host half of every sample (the embedded CPU engine's memory is host RSS).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostSample {
    pub mem_total_bytes: Option<u64>,
    pub mem_available_bytes: Option<u64>,
    /// Resident set size of the watched process (`VmRSS`).
    pub process_rss_bytes: Option<u64>,
    /// Peak resident set size of the watched process (`VmHWM`).
    pub process_peak_rss_bytes: Option<u64>,
    /// The process the RSS figures are for.
    pub pid: u32,
}

fn kib_field(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// Reads memory figures; `pid` defaults to this process.
pub fn sample(pid: Option<u32>) -> HostSample {
    let pid = pid.unwrap_or_else(std::process::id);
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    HostSample {
        mem_total_bytes: kib_field(&meminfo, "MemTotal:"),
        mem_available_bytes: kib_field(&meminfo, "MemAvailable:"),
        process_rss_bytes: kib_field(&status, "VmRSS:"),
        process_peak_rss_bytes: kib_field(&status, "VmHWM:"),
        pid,
    }
}

/// CPU time (user + system) this process has used, in seconds, from
/// `/proc/self/stat` (fields 14 and 15, in clock ticks of 1/100 s, the
/// kernel's USER_HZ on every Linux architecture we run on).
pub fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) may hold spaces: count from the `)` after it.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

/// CPU model name from `/proc/cpuinfo`.
pub fn cpu_model() -> Option<String> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    text.lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}

pub fn logical_cores() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let s = sample(None);
        assert_eq!(s.pid, std::process::id());
        let rss = s.process_rss_bytes.expect("VmRSS on Linux");
        assert!(rss > 1 << 20, "{rss}");
        assert!(s.process_peak_rss_bytes.unwrap() >= rss);
        assert!(s.mem_available_bytes.unwrap() <= s.mem_total_bytes.unwrap());
        assert!(
            sample(Some(u32::MAX)).process_rss_bytes.is_none(),
            "no such process: absent, not zero"
        );
    }

    #[test]
    fn counts_this_process_cpu_time() {
        let before = process_cpu_seconds().expect("/proc/self/stat on Linux");
        let t = std::time::Instant::now();
        let mut x = 0u64;
        while t.elapsed() < std::time::Duration::from_millis(300) {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        let used = process_cpu_seconds().unwrap() - before;
        assert!((0.1..5.0).contains(&used), "{used} s for 0.3 s of spinning");
    }

    #[test]
    fn parses_kib_fields() {
        let t = "MemTotal:       24576000 kB\nMemAvailable:   1000 kB\n";
        assert_eq!(kib_field(t, "MemTotal:"), Some(24_576_000 * 1024));
        assert_eq!(kib_field(t, "MemFree:"), None);
    }
}
