//! `load.dataset`: where the probes' prompts come from.

use std::sync::Arc;

/// Where prompts come from.
#[derive(Debug, Clone, Default)]
pub enum Prompts {
    /// Token ids of exactly the bucket's input length.
    #[default]
    Synthetic,
    /// Texts from a dataset file, taken in turn.
    Dataset(Arc<Vec<String>>),
}

impl Prompts {
    /// Reads a dataset: one prompt per line, or JSON lines with a `prompt`
    /// (or `text`) string field. Blank lines are skipped.
    pub fn from_file(path: &std::path::Path) -> Result<Prompts, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut out = vec![];
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            if line.starts_with('{') {
                let v: serde_json::Value = serde_json::from_str(line)
                    .map_err(|e| format!("{}:{}: {e}", path.display(), i + 1))?;
                let p = v
                    .get("prompt")
                    .or_else(|| v.get("text"))
                    .and_then(|p| p.as_str())
                    .ok_or_else(|| {
                        format!(
                            "{}:{}: a JSON line needs a string `prompt` or `text`",
                            path.display(),
                            i + 1
                        )
                    })?;
                out.push(p.to_string());
            } else {
                out.push(line.to_string());
            }
        }
        if out.is_empty() {
            return Err(format!("{}: no prompts", path.display()));
        }
        Ok(Prompts::Dataset(Arc::new(out)))
    }
}
