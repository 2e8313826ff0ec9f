//! The `launch` target's command template: its placeholders for one matrix
//! point and their rendering. The configuration checks every command renders
//! before anything is launched ([`crate::launch`] starts the servers).

use super::{BenchConfig, MatrixPoint, Target};
use std::collections::BTreeMap;

/// Replaces `{name}` placeholders; an unknown one is an error naming it.
pub fn render(template: &str, vars: &BTreeMap<&str, String>) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        let close = after
            .find('}')
            .ok_or_else(|| format!("unclosed `{{` in `{template}`"))?;
        let name = &after[..close];
        let value = vars.get(name).ok_or_else(|| {
            format!(
                "unknown placeholder `{{{name}}}` (known: {})",
                vars.keys()
                    .map(|k| format!("{{{k}}}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })?;
        out.push_str(value);
        rest = &after[close + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The placeholders of a launch command for one matrix point: `{model}`,
/// `{precision}`, `{kv_dtype}`, `{batch_policy}` (through `target.values`
/// where it has a table for them), `{max_num_seqs}`,
/// `{max_num_batched_tokens}`, `{kv_cache_bytes}`, `{block_size}`, `{port}`
/// and, where `target.kv_capacity_tokens` is set, `{kv_capacity_tokens}`
/// (for servers sized in tokens: SGLang's `--max-total-tokens`, TGI's
/// `--max-batch-total-tokens`).
pub fn command_vars(
    cfg: &BenchConfig,
    point: &MatrixPoint,
    port: u16,
) -> Result<BTreeMap<&'static str, String>, String> {
    let empty = BTreeMap::new();
    let values = match &cfg.target {
        Target::Launch { values, .. } => values,
        _ => &empty,
    };
    if let Some(k) = values
        .keys()
        .find(|k| !["precision", "kv_dtype", "batch_policy"].contains(&k.as_str()))
    {
        return Err(format!(
            "target.values.{k}: only precision, kv_dtype and batch_policy are mapped"
        ));
    }
    let mapped = |axis: &str, v: &str| -> Result<String, String> {
        match values.get(axis) {
            None => Ok(v.to_string()),
            Some(table) => table.get(v).cloned().ok_or_else(|| {
                format!(
                    "target.values.{axis} has no entry for `{v}` (it has {})",
                    table
                        .keys()
                        .map(|k| format!("`{k}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }),
        }
    };
    let mut vars = BTreeMap::new();
    vars.insert("model", cfg.model.clone());
    vars.insert("precision", mapped("precision", &point.precision)?);
    vars.insert("kv_dtype", mapped("kv_dtype", &point.kv_dtype)?);
    vars.insert("batch_policy", mapped("batch_policy", &point.policy)?);
    vars.insert("max_num_seqs", cfg.max_num_seqs.to_string());
    vars.insert(
        "max_num_batched_tokens",
        cfg.max_num_batched_tokens.to_string(),
    );
    vars.insert("kv_cache_bytes", cfg.kv_cache_bytes.to_string());
    vars.insert("block_size", cfg.block_size.to_string());
    vars.insert("port", port.to_string());
    if let Some(t) = cfg.http.kv_capacity_tokens {
        vars.insert("kv_capacity_tokens", t.to_string());
    }
    Ok(vars)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_fill_known_placeholders_and_name_unknown_ones() {
        let mut v = BTreeMap::new();
        v.insert("model", "m.gguf".to_string());
        v.insert("port", "8123".to_string());
        assert_eq!(
            render("serve --model {model} --port {port}", &v).unwrap(),
            "serve --model m.gguf --port 8123"
        );
        let e = render("serve --tp {tensor_parallel}", &v).unwrap_err();
        assert!(
            e.contains("{tensor_parallel}") && e.contains("{model}"),
            "{e}"
        );
        assert!(render("serve {model", &v).is_err());
    }
}
