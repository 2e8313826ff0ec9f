//! Whether two profiles can be gated at all: the same node and model apart
//! from precision (fingerprint fields, classified), configurations that ran,
//! the same buckets, quality measured the same way. What differs but does not
//! block is kept as a note.

use super::bucket_name;
use crate::{ConfigResult, Profile};
use serde::Serialize;
use std::collections::BTreeMap;

/// A fingerprint field that differs, and whether it blocks the comparison.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Difference {
    pub field: String,
    pub baseline: serde_json::Value,
    pub candidate: serde_json::Value,
    /// `blocking` (not comparable), `expected` (what the gate is about,
    /// e.g. precision), or `note` (allowed or harmless).
    pub kind: String,
}

fn flatten(prefix: &str, v: &serde_json::Value, out: &mut BTreeMap<String, serde_json::Value>) {
    let join = |k: &str| {
        if prefix.is_empty() {
            k.to_string()
        } else {
            format!("{prefix}.{k}")
        }
    };
    match v {
        serde_json::Value::Object(m) if !m.is_empty() => {
            for (k, x) in m {
                flatten(&join(k), x, out);
            }
        }
        serde_json::Value::Array(a) if !a.is_empty() && prefix.starts_with("node") => {
            for (i, x) in a.iter().enumerate() {
                flatten(&join(&i.to_string()), x, out);
            }
        }
        _ => {
            out.insert(prefix.to_string(), v.clone());
        }
    }
}

/// How a differing fingerprint field counts: the node's hardware identity
/// and the model identity block; precision and KV dtype are expected; the
/// rest (driver, engine flags, RAM) are notes.
fn classify(field: &str, allow: &[String]) -> &'static str {
    if field == "precision" || field == "kv_dtype" {
        return "expected";
    }
    if allow.iter().any(|a| field.starts_with(a.as_str())) {
        return "note";
    }
    let gpu_identity = field.starts_with("node.gpus")
        && (field.ends_with(".name")
            || field.ends_with(".memory_total_bytes")
            || field.ends_with(".mig_enabled")
            || field == "node.gpus");
    let blocking = field.starts_with("model")
        || gpu_identity
        || matches!(
            field,
            "node.source"
                | "node.host.cpu_model"
                | "node.host.logical_cores"
                | "node.host.arch"
                | "engine.name"
        );
    if blocking {
        "blocking"
    } else {
        "note"
    }
}

/// Fields of two fingerprints that differ, classified.
pub fn fingerprint_differences(
    baseline: &serde_json::Value,
    candidate: &serde_json::Value,
    allow: &[String],
) -> Vec<Difference> {
    let (mut a, mut b) = (BTreeMap::new(), BTreeMap::new());
    flatten("", baseline, &mut a);
    flatten("", candidate, &mut b);
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    keys.into_iter()
        .filter_map(|k| {
            let (x, y) = (
                a.get(k).cloned().unwrap_or_default(),
                b.get(k).cloned().unwrap_or_default(),
            );
            (x != y).then(|| Difference {
                kind: classify(k, allow).into(),
                field: k.clone(),
                baseline: x,
                candidate: y,
            })
        })
        .collect()
}

pub(super) fn config<'a>(p: &'a Profile, name: Option<&str>) -> Result<&'a ConfigResult, String> {
    let name = name.unwrap_or(&p.selected);
    let c = p
        .configs
        .iter()
        .find(|c| c.name == name)
        .ok_or_else(|| format!("no configuration `{name}`"))?;
    match &c.error {
        Some(e) => Err(format!("configuration `{name}` failed in its sweep: {e}")),
        None => Ok(c),
    }
}

/// A configuration's cold buckets as (input, output) tokens, sorted (warm
/// buckets measure the server's cache, not the precision or policy gated).
pub(super) fn bucket_keys(c: &ConfigResult) -> Vec<(u32, u32)> {
    let mut k: Vec<_> = c
        .buckets
        .iter()
        .filter(|b| b.is_cold())
        .map(|b| (b.input_tokens, b.output_tokens))
        .collect();
    k.sort();
    k
}

/// Why two configurations (and their profiles) cannot be gated, and the
/// differences that do not block but are said: another backend or batch
/// policy measures other figures.
pub(super) fn check(
    baseline: &Profile,
    candidate: &Profile,
    bc: &ConfigResult,
    cc: &ConfigResult,
) -> (Vec<String>, Vec<Difference>) {
    let (mut unusable, mut notes) = (vec![], vec![]);
    let (bk, ck) = (bucket_keys(bc), bucket_keys(cc));
    if bk != ck {
        let names = |k: &[(u32, u32)]| {
            k.iter()
                .map(|&k| bucket_name(k))
                .collect::<Vec<_>>()
                .join(", ")
        };
        unusable.push(format!(
            "buckets differ: baseline [{}], candidate [{}]",
            names(&bk),
            names(&ck)
        ));
    }
    // The same engine on another backend (cuBLAS or envelope's GEMM
    // kernels, graphs on or off) measures other tok/s: said, not hidden.
    if let (Some(a), Some(b)) = (&bc.backend, &cc.backend) {
        if a != b {
            notes.push(Difference {
                field: "config.backend".into(),
                baseline: a.clone().into(),
                candidate: b.clone().into(),
                kind: "note".into(),
            });
        }
    }
    if bc.batch_policy != cc.batch_policy {
        notes.push(Difference {
            field: "config.batch_policy".into(),
            baseline: bc.batch_policy.clone().into(),
            candidate: cc.batch_policy.clone().into(),
            kind: "note".into(),
        });
    }
    if let (Some(a), Some(b)) = (&baseline.quality, &candidate.quality) {
        if a.reference_precision != b.reference_precision || a.text_set != b.text_set {
            unusable.push(format!(
                "quality measured differently: baseline against {:?} on {}, candidate against {:?} on {}",
                a.reference_precision, a.text_set, b.reference_precision, b.text_set
            ));
        }
    }
    (unusable, notes)
}
