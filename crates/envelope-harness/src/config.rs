//! `bench-configs/*.toml`: parsed, then validated into settings that cannot
//! be invalid. Every error names the file and the field.

use envelope_engine::{BatchPolicy, KvDtype, Precision};
use envelope_profile::Slo;
use serde::Deserialize;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
#[error("{file}: {message}")]
pub struct ConfigError {
    pub file: String,
    pub message: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetConfig {
    /// `engine` (in process), `http` (a running server) or `launch` (a command per configuration).
    pub kind: String,
    pub model: Option<String>,
    /// Engine KV pool, e.g. `256MiB` (engine and launch targets).
    pub kv_cache_bytes: Option<String>,
    #[serde(default = "default_block_size")]
    pub block_size: usize,
    pub base_url: Option<String>,
    pub command: Option<String>,
}

fn default_block_size() -> usize {
    16
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MatrixConfig {
    pub precisions: Vec<String>,
    #[serde(default = "default_kv")]
    pub kv_dtypes: Vec<String>,
    pub batch_policies: Vec<String>,
    #[serde(default = "default_seqs")]
    pub max_num_seqs: u32,
    #[serde(default = "default_batched")]
    pub max_num_batched_tokens: usize,
    /// `INPUTxOUTPUT` token buckets, e.g. `128x128`.
    pub buckets: Vec<String>,
    #[serde(default = "one")]
    pub concurrency_min: u32,
    pub concurrency_max: u32,
}

fn default_kv() -> Vec<String> {
    vec!["f32".into()]
}
fn default_seqs() -> u32 {
    64
}
fn default_batched() -> usize {
    2048
}
fn one() -> u32 {
    1
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadConfig {
    /// `closed` (fixed concurrency) for now.
    #[serde(default = "closed")]
    pub mode: String,
    /// Requests per probe = max(min_requests, concurrency x rounds).
    #[serde(default = "two")]
    pub rounds: u32,
    #[serde(default = "eight")]
    pub min_requests: u32,
}

fn closed() -> String {
    "closed".into()
}
fn two() -> u32 {
    2
}
fn eight() -> u32 {
    8
}

impl Default for LoadConfig {
    fn default() -> Self {
        LoadConfig {
            mode: closed(),
            rounds: 2,
            min_requests: 8,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    target: TargetConfig,
    matrix: MatrixConfig,
    #[serde(default)]
    load: LoadConfig,
    #[serde(default)]
    slo: Slo,
}

/// One point of the matrix.
#[derive(Debug, Clone, PartialEq)]
pub struct MatrixPoint {
    pub precision: Precision,
    pub kv_dtype: KvDtype,
    pub policy: BatchPolicy,
}

impl MatrixPoint {
    pub fn name(&self) -> String {
        format!("{}-{}-{}", self.precision, self.kv_dtype, self.policy)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bucket {
    pub input_tokens: u32,
    pub output_tokens: u32,
}

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub file: PathBuf,
    pub model: String,
    pub kv_cache_bytes: usize,
    pub block_size: usize,
    pub points: Vec<MatrixPoint>,
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: usize,
    pub buckets: Vec<Bucket>,
    pub concurrency_min: u32,
    pub concurrency_max: u32,
    pub load: LoadConfig,
    pub slo: Slo,
}

pub use envelope_engine::util::parse_bytes;

impl BenchConfig {
    pub fn load(path: &Path) -> Result<BenchConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: path.display().to_string(),
            message: e.to_string(),
        })?;
        BenchConfig::parse(&text, path)
    }

    pub fn parse(text: &str, path: &Path) -> Result<BenchConfig, ConfigError> {
        let err = |m: String| ConfigError {
            file: path.display().to_string(),
            message: m,
        };
        let raw: RawConfig = toml::from_str(text).map_err(|e| err(e.to_string()))?;
        let t = &raw.target;
        match t.kind.as_str() {
            "engine" => {}
            "http" | "launch" => {
                return Err(err(format!(
                    "target.kind `{}` is not implemented yet (engine is)",
                    t.kind
                )));
            }
            other => {
                return Err(err(format!(
                    "target.kind `{other}` is not one of engine, http, launch"
                )))
            }
        }
        let model = t
            .model
            .clone()
            .ok_or_else(|| err("target.model is required for the engine target".into()))?;
        let kv_cache_bytes = match &t.kv_cache_bytes {
            Some(s) => parse_bytes(s)
                .ok_or_else(|| err(format!("target.kv_cache_bytes `{s}` is not a byte size")))?,
            None => 256 << 20,
        };
        if t.block_size == 0 {
            return Err(err("target.block_size must be at least 1".into()));
        }
        let m = &raw.matrix;
        let nonempty = |v: &Vec<String>, f: &str| {
            if v.is_empty() {
                Err(err(format!("matrix.{f} must not be empty")))
            } else {
                Ok(())
            }
        };
        nonempty(&m.precisions, "precisions")?;
        nonempty(&m.kv_dtypes, "kv_dtypes")?;
        nonempty(&m.batch_policies, "batch_policies")?;
        nonempty(&m.buckets, "buckets")?;
        let mut points = vec![];
        for p in &m.precisions {
            let precision: Precision = p
                .parse()
                .map_err(|e| err(format!("matrix.precisions: {e}")))?;
            for k in &m.kv_dtypes {
                let kv_dtype: KvDtype = k
                    .parse()
                    .map_err(|e| err(format!("matrix.kv_dtypes: {e}")))?;
                for b in &m.batch_policies {
                    let policy: BatchPolicy = b
                        .parse()
                        .map_err(|e| err(format!("matrix.batch_policies: {e}")))?;
                    points.push(MatrixPoint {
                        precision,
                        kv_dtype,
                        policy,
                    });
                }
            }
        }
        let buckets = m
            .buckets
            .iter()
            .map(|b| {
                let (i, o) = b
                    .split_once('x')
                    .ok_or_else(|| err(format!("matrix.buckets: `{b}` is not INPUTxOUTPUT")))?;
                let (i, o) = (i.trim().parse::<u32>(), o.trim().parse::<u32>());
                match (i, o) {
                    (Ok(i), Ok(o)) if i > 0 && o > 0 => Ok(Bucket {
                        input_tokens: i,
                        output_tokens: o,
                    }),
                    _ => Err(err(format!(
                        "matrix.buckets: `{b}` needs two positive token counts"
                    ))),
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        if m.concurrency_min == 0 || m.concurrency_max < m.concurrency_min {
            return Err(err(format!(
                "matrix.concurrency_min ({}) must be >= 1 and <= matrix.concurrency_max ({})",
                m.concurrency_min, m.concurrency_max
            )));
        }
        if m.max_num_seqs == 0 || m.max_num_batched_tokens == 0 {
            return Err(err(
                "matrix.max_num_seqs and matrix.max_num_batched_tokens must be at least 1".into(),
            ));
        }
        if raw.load.mode != "closed" {
            return Err(err(format!(
                "load.mode `{}` is not implemented yet (closed is)",
                raw.load.mode
            )));
        }
        if raw.load.rounds == 0 {
            return Err(err("load.rounds must be at least 1".into()));
        }
        let s = &raw.slo;
        if !(0.0..1.0).contains(&s.headroom) {
            return Err(err(format!(
                "slo.headroom must be in [0, 1), got {}",
                s.headroom
            )));
        }
        if !(0.0..=1.0).contains(&s.max_kv_usage) || !(0.0..=1.0).contains(&s.max_error_rate) {
            return Err(err(
                "slo.max_kv_usage and slo.max_error_rate must be in [0, 1]".into(),
            ));
        }
        Ok(BenchConfig {
            file: path.to_path_buf(),
            model,
            kv_cache_bytes,
            block_size: t.block_size,
            points,
            max_num_seqs: m.max_num_seqs,
            max_num_batched_tokens: m.max_num_batched_tokens,
            buckets,
            concurrency_min: m.concurrency_min,
            concurrency_max: m.concurrency_max,
            load: raw.load,
            slo: raw.slo,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: &str = r#"
[target]
kind = "engine"
model = "dummy:tiny"
kv_cache_bytes = "8MiB"
[matrix]
precisions = ["f32", "q8_0"]
batch_policies = ["continuous", "static"]
buckets = ["64x16", "128x32"]
concurrency_max = 16
[slo]
itl_p95_ms = 500
headroom = 0.25
"#;

    #[test]
    fn parses_and_expands_the_matrix() {
        let c = BenchConfig::parse(OK, Path::new("q.toml")).unwrap();
        assert_eq!(c.points.len(), 4);
        assert_eq!(c.points[0].name(), "f32-f32-continuous");
        assert_eq!(
            c.buckets[1],
            Bucket {
                input_tokens: 128,
                output_tokens: 32
            }
        );
        assert_eq!(c.kv_cache_bytes, 8 << 20);
        assert_eq!(c.slo.itl_p95_ms, Some(500.0));
        assert!(c.slo.zero_preemptions);
    }

    #[test]
    fn errors_name_the_file_and_the_field() {
        let cases = [
            (OK.replace("\"q8_0\"", "\"q3\""), "matrix.precisions"),
            (OK.replace("\"64x16\"", "\"64by16\""), "matrix.buckets"),
            (
                OK.replace("concurrency_max = 16", "concurrency_max = 0"),
                "matrix.concurrency_min",
            ),
            (
                OK.replace("headroom = 0.25", "headroom = 1.5"),
                "slo.headroom",
            ),
            (
                OK.replace("kind = \"engine\"", "kind = \"magic\""),
                "target.kind",
            ),
            (OK.replace("\"8MiB\"", "\"lots\""), "target.kv_cache_bytes"),
            (OK.replace("[slo]", "[slo]\nttft_p96_ms = 3"), "ttft_p96_ms"),
            (
                OK.replace("\"static\"", "\"dynamic\""),
                "matrix.batch_policies",
            ),
        ];
        for (text, field) in cases {
            let e = BenchConfig::parse(&text, Path::new("bench-configs/x.toml"))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("bench-configs/x.toml") && e.contains(field),
                "{field}: {e}"
            );
        }
    }
}
