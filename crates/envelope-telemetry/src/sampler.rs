//! A sampler on its own thread: one [`Sample`] every interval (default
//! 100 ms), kept as a time series with running peaks. Each sample names its
//! source (`nvml` or `host`) and carries its own timestamp.

use crate::gpu::{GpuSample, Nvml};
use crate::host::{self, HostSample};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    Nvml,
    Host,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub unix_ms: u64,
    pub source: Source,
    pub gpus: Vec<GpuSample>,
    pub host: HostSample,
}

impl Sample {
    /// Takes one reading: NVML when `nvml` is given, the host always.
    pub fn take(nvml: Option<&Nvml>, pid: Option<u32>) -> Sample {
        let gpus = match nvml {
            Some(n) => (0..n.device_count()).map(|i| n.sample(i, pid)).collect(),
            None => vec![],
        };
        Sample {
            unix_ms: crate::unix_ms(),
            source: if nvml.is_some() {
                Source::Nvml
            } else {
                Source::Host
            },
            gpus,
            host: host::sample(pid),
        }
    }

    /// Milliseconds since this sample was taken.
    pub fn age_ms(&self) -> u64 {
        crate::unix_ms().saturating_sub(self.unix_ms)
    }
}

#[derive(Debug, Clone)]
pub struct SamplerConfig {
    pub interval: Duration,
    /// The process whose memory is watched (default: this one).
    pub pid: Option<u32>,
    /// Oldest samples are dropped past this many.
    pub max_samples: usize,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            interval: Duration::from_millis(100),
            pid: None,
            max_samples: 100_000,
        }
    }
}

/// Highest readings seen (lowest, for available memory).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Peaks {
    /// Per GPU, by index.
    pub gpu_memory_used_bytes: Vec<u64>,
    pub process_gpu_memory_bytes: Option<u64>,
    pub process_rss_bytes: Option<u64>,
    pub min_host_available_bytes: Option<u64>,
}

impl Peaks {
    fn update(&mut self, s: &Sample) {
        for g in &s.gpus {
            let i = g.index as usize;
            if self.gpu_memory_used_bytes.len() <= i {
                self.gpu_memory_used_bytes.resize(i + 1, 0);
            }
            if let Some(u) = g.memory_used_bytes {
                self.gpu_memory_used_bytes[i] = self.gpu_memory_used_bytes[i].max(u);
            }
            if let Some(p) = g.process_memory_bytes {
                self.process_gpu_memory_bytes =
                    Some(self.process_gpu_memory_bytes.unwrap_or(0).max(p));
            }
        }
        if let Some(r) = s.host.process_rss_bytes {
            self.process_rss_bytes = Some(self.process_rss_bytes.unwrap_or(0).max(r));
        }
        if let Some(a) = s.host.mem_available_bytes {
            self.min_host_available_bytes =
                Some(self.min_host_available_bytes.map_or(a, |m| m.min(a)));
        }
    }
}

/// The recorded series.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Series {
    pub samples: Vec<Sample>,
    pub peaks: Peaks,
    /// Why NVML was not used, when it was not.
    pub nvml_unavailable: Option<String>,
    /// Mean wall time of taking one sample, in microseconds.
    pub mean_sample_cost_us: f64,
}

pub struct Sampler {
    stop: Arc<AtomicBool>,
    series: Arc<Mutex<Series>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    pub fn start(cfg: SamplerConfig) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let series = Arc::new(Mutex::new(Series::default()));
        let (st, se) = (stop.clone(), series.clone());
        let handle = std::thread::Builder::new()
            .name("envelope-sampler".into())
            .spawn(move || {
                let nvml = Nvml::init();
                if let Err(e) = &nvml {
                    if let Ok(mut s) = se.lock() {
                        s.nvml_unavailable = Some(e.0.clone());
                    }
                }
                let nvml = nvml.ok();
                let (mut n, mut cost) = (0u64, Duration::ZERO);
                while !st.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    let sample = Sample::take(nvml.as_ref(), cfg.pid);
                    cost += t.elapsed();
                    n += 1;
                    if let Ok(mut s) = se.lock() {
                        s.peaks.update(&sample);
                        if s.samples.len() >= cfg.max_samples {
                            s.samples.remove(0);
                        }
                        s.samples.push(sample);
                        s.mean_sample_cost_us = cost.as_secs_f64() * 1e6 / n as f64;
                    }
                    // Sleep in short slices so stop() returns promptly.
                    let next = t + cfg.interval;
                    while !st.load(Ordering::Relaxed) {
                        let now = Instant::now();
                        if now >= next {
                            break;
                        }
                        std::thread::sleep((next - now).min(Duration::from_millis(20)));
                    }
                }
            })
            .ok();
        Sampler {
            stop,
            series,
            handle,
        }
    }

    /// The newest sample, if any.
    pub fn latest(&self) -> Option<Sample> {
        self.series
            .lock()
            .ok()
            .and_then(|s| s.samples.last().cloned())
    }

    pub fn peaks(&self) -> Peaks {
        self.series
            .lock()
            .map(|s| s.peaks.clone())
            .unwrap_or_default()
    }

    /// Stops the thread and returns everything recorded.
    pub fn stop(mut self) -> Series {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        self.series.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Polls the series until `f` holds or 10 s pass, however slowly the
    /// sampler's thread is scheduled.
    fn wait_until(s: &Sampler, f: impl Fn(&Series) -> bool) {
        let end = Instant::now() + Duration::from_secs(10);
        while !f(&s.series.lock().unwrap()) && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn records_a_series_with_peaks_and_timestamps() {
        let s = Sampler::start(SamplerConfig {
            interval: Duration::from_millis(10),
            ..Default::default()
        });
        // Grow RSS while sampling so the peak has something to catch.
        let ballast: Vec<u8> = std::hint::black_box(vec![1; 64 << 20]);
        // At least 5 samples, one of them taken wholly after the ballast.
        let before = s.series.lock().unwrap().samples.len();
        wait_until(&s, |x| x.samples.len() >= (before + 2).max(5));
        assert!(s.latest().is_some());
        let series = s.stop();
        drop(ballast);
        assert!(
            series.samples.len() >= 5,
            "{} samples",
            series.samples.len()
        );
        assert!(series
            .samples
            .windows(2)
            .all(|w| w[0].unix_ms <= w[1].unix_ms));
        let max_rss = series
            .samples
            .iter()
            .filter_map(|x| x.host.process_rss_bytes)
            .max()
            .unwrap();
        assert_eq!(series.peaks.process_rss_bytes, Some(max_rss));
        assert!(max_rss >= 64 << 20);
        assert!(series.mean_sample_cost_us > 0.0);
        eprintln!(
            "mean cost of one sample: {:.1} us",
            series.mean_sample_cost_us
        );
        for x in &series.samples {
            match x.source {
                Source::Host => assert!(x.gpus.is_empty()),
                Source::Nvml => assert!(series.nvml_unavailable.is_none()),
            }
        }
    }

    #[test]
    fn bounded_series_drops_the_oldest() {
        let s = Sampler::start(SamplerConfig {
            interval: Duration::from_millis(2),
            max_samples: 3,
            pid: None,
        });
        // Full, then until the oldest of those three was dropped.
        wait_until(&s, |x| x.samples.len() >= 3);
        let first = s.series.lock().unwrap().samples[0].unix_ms;
        wait_until(&s, |x| x.samples[0].unix_ms > first);
        let series = s.stop();
        assert_eq!(series.samples.len(), 3);
    }
}
