//! `envelope quality`: perplexity of a precision on the bundled text set and,
//! against a reference precision, mean KL divergence and top-1 agreement;
//! optionally written into a profile's `quality` section.

use anyhow::{bail, Context, Result};
use clap::Args;
use envelope_engine::{KvDtype, Precision};
use envelope_harness::quality::{measure, QualityOptions};
use envelope_profile::Profile;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct QualityArgs {
    /// Model: a .gguf file, a Hugging Face directory or dummy:<preset>[@seed].
    #[arg(long, env = "ENVELOPE_MODEL")]
    pub model: String,
    /// Precision to measure: as-stored, f32, f16, bf16, q8_0, q4_0, fp8 (emulated on the CPU).
    #[arg(long, env = "ENVELOPE_PRECISION", default_value = "as-stored")]
    pub precision: Precision,
    /// Reference precision for KL divergence and top-1 agreement (`none`: perplexity only).
    #[arg(long, env = "ENVELOPE_QUALITY_REFERENCE", default_value = "f32")]
    pub reference: String,
    /// The text to score.
    #[arg(
        long,
        env = "ENVELOPE_QUALITY_TEXT",
        default_value = "bench-configs/quality/founding-documents.txt"
    )]
    pub text: PathBuf,
    /// Tokens per window (each window starts from an empty cache).
    #[arg(long, env = "ENVELOPE_QUALITY_WINDOW_TOKENS", default_value_t = 256)]
    pub window_tokens: usize,
    /// Score at most this many windows.
    #[arg(long, env = "ENVELOPE_QUALITY_MAX_WINDOWS")]
    pub max_windows: Option<usize>,
    /// KV-cache element type during scoring.
    #[arg(long, env = "ENVELOPE_KV_DTYPE", default_value = "f32")]
    pub kv_dtype: KvDtype,
    /// A tokenizer.json (or .gguf) to use instead of the model's own.
    #[arg(long, env = "ENVELOPE_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// A profile to write the result into (its `quality` section).
    #[arg(long, env = "ENVELOPE_QUALITY_PROFILE")]
    pub profile: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Compute threads (default: all cores).
    #[arg(long, env = "ENVELOPE_THREADS")]
    pub threads: Option<usize>,
}

pub fn run(args: &QualityArgs) -> Result<()> {
    if let Some(n) = args.threads {
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    let reference = match args.reference.as_str() {
        "none" => None,
        r => Some(
            r.parse::<Precision>()
                .with_context(|| format!("--reference {r}"))?,
        ),
    };
    let text_name = args.text.display().to_string();
    let text = std::fs::read_to_string(&args.text)
        .with_context(|| format!("reading --text {text_name}"))?;
    // Read the profile first, so a bad path fails before minutes of scoring.
    let profile = match &args.profile {
        Some(p) => {
            let name = p.display().to_string();
            let t =
                std::fs::read_to_string(p).with_context(|| format!("reading --profile {name}"))?;
            Some(Profile::from_json(&t, &name)?)
        }
        None => None,
    };
    if let Some(p) = &profile {
        let want = std::path::Path::new(&args.model)
            .file_name()
            .map(|f| f.to_string_lossy().to_string());
        let have = p.fingerprint["model"]["name"].as_str();
        if let (Some(w), Some(h)) = (want, have) {
            if w != h {
                bail!("--profile was measured on model `{h}`, not --model `{w}`");
            }
        }
    }
    let opts = QualityOptions {
        window_tokens: args.window_tokens,
        max_windows: args.max_windows,
        kv_dtype: args.kv_dtype,
    };
    let q = measure(
        &args.model,
        args.tokenizer.clone(),
        args.precision,
        reference,
        &text_name,
        &text,
        &opts,
    )?;
    if let (Some(mut p), Some(path)) = (profile, &args.profile) {
        p.quality = Some(q.clone());
        std::fs::write(path, serde_json::to_string_pretty(&p)? + "\n")
            .with_context(|| format!("writing --profile {}", path.display()))?;
        eprintln!("wrote the quality section into {}", path.display());
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&q)?);
    } else {
        print!("{}", q.table());
    }
    Ok(())
}
