//! A governor's `/metrics` page read as an endpoint picker reads it: the
//! classic Prometheus text format, every series with its labels.

use openmetrics_parser::prometheus::parse_prometheus;
use openmetrics_parser::PrometheusValue;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// One sample: its labels and value.
pub type Series = (BTreeMap<String, String>, f64);

/// A page, by sample name (a counter's `_total` name, a histogram's
/// `_sum` and `_count`).
#[derive(Debug, Default)]
pub struct Scrape {
    pub samples: BTreeMap<String, Vec<Series>>,
    pub content_type: String,
    /// How long the page took to arrive, request sent to body read.
    pub took: Duration,
}

impl Scrape {
    /// Parses `text` in the classic format; panics naming the parse error
    /// (a page a picker could not read is a failure of its own).
    pub fn parse(text: &str) -> Scrape {
        let exp = parse_prometheus(text).unwrap_or_else(|e| panic!("{e:?}:\n{text}"));
        let mut samples: BTreeMap<String, Vec<Series>> = BTreeMap::new();
        for (name, fam) in &exp.families {
            for s in fam.iter_samples() {
                let labels: BTreeMap<String, String> = s
                    .get_labelset()
                    .map(|l| l.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
                    .unwrap_or_default();
                let (sample_name, v) = match &s.value {
                    PrometheusValue::Gauge(n) | PrometheusValue::Unknown(n) => {
                        (name.clone(), n.as_f64())
                    }
                    PrometheusValue::Counter(c) => (name.clone(), c.value.as_f64()),
                    PrometheusValue::Histogram(h) => match &h.sum {
                        Some(sum) => (format!("{name}_sum"), sum.as_f64()),
                        None => continue,
                    },
                    PrometheusValue::Summary(sv) => match &sv.sum {
                        Some(sum) => (format!("{name}_sum"), sum.as_f64()),
                        None => continue,
                    },
                };
                samples.entry(sample_name).or_default().push((labels, v));
            }
        }
        Scrape {
            samples,
            ..Scrape::default()
        }
    }

    /// GETs `base/metrics` with `client` and parses it.
    pub async fn get(client: &reqwest::Client, base: &str) -> Scrape {
        let t0 = Instant::now();
        let resp = client.get(format!("{base}/metrics")).send().await.unwrap();
        let content_type = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let text = resp.text().await.unwrap();
        let took = t0.elapsed();
        Scrape {
            content_type,
            took,
            ..Scrape::parse(&text)
        }
    }

    /// The one sample named `name` without labels; panics when absent.
    pub fn value(&self, name: &str) -> f64 {
        match self.samples.get(name).map(Vec::as_slice) {
            Some([(l, v)]) if l.is_empty() => *v,
            other => panic!("{name}: one unlabelled sample expected, found {other:?}"),
        }
    }
}
