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
    /// Each family's `# TYPE` (`Gauge`, `Counter`, ..., `Unknown` when none).
    pub types: BTreeMap<String, String>,
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
        let mut types = BTreeMap::new();
        for (name, fam) in &exp.families {
            types.insert(name.clone(), format!("{:?}", fam.family_type));
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
            types,
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

/// A metric spec as llm-d's endpoint picker parses one
/// (`deploy/schemas/vendor/llm-d-router/spec.go`): `name` or
/// `name{label=value,label="value"}`.
pub fn parse_spec(spec: &str) -> Result<(String, BTreeMap<String, String>), String> {
    let spec = spec.trim();
    let (name, block) = match spec.split_once('{') {
        None => (spec, ""),
        Some((n, rest)) => (
            n.trim(),
            rest.strip_suffix('}')
                .ok_or_else(|| format!("{spec}: no closing brace"))?,
        ),
    };
    let name_ok = |s: &str, colon: bool| {
        let mut b = s.bytes();
        b.next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == b'_' || (colon && c == b':'))
            && s.bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'_' || (colon && c == b':'))
    };
    if !name_ok(name, true) {
        return Err(format!("{spec}: not a metric name"));
    }
    let mut labels = BTreeMap::new();
    for pair in block.split(',').filter(|p| !p.trim().is_empty()) {
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| format!("{spec}: {pair} is not label=value"))?;
        let k = k.trim();
        if !name_ok(k, false) {
            return Err(format!("{spec}: {k} is not a label name"));
        }
        labels.insert(k.to_string(), v.trim().trim_matches('"').to_string());
    }
    Ok((name.to_string(), labels))
}

impl Scrape {
    /// The value the picker reads for `spec`: the first series of the
    /// family whose labels include the spec's (without timestamps, the
    /// newest is the first), and the family's type (the picker reads a
    /// gauge's or counter's value, 0 for any other).
    pub fn select(&self, spec: &str) -> Result<(f64, String), String> {
        let (name, want) = parse_spec(spec)?;
        let series = self
            .samples
            .get(&name)
            .ok_or_else(|| format!("{spec}: family {name} not in the page"))?;
        let kind = self.types.get(&name).cloned().unwrap_or_default();
        series
            .iter()
            .find(|(labels, _)| want.iter().all(|(k, v)| labels.get(k) == Some(v)))
            .map(|(_, v)| (*v, kind))
            .ok_or_else(|| format!("{spec}: no series of {name} has labels {want:?}"))
    }
}
