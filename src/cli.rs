//! Command-line flags. Every flag has a long name and an environment
//! variable; parsed flags are validated into engine settings in one place.

use anyhow::Result;
use clap::{ArgAction, Args, Parser, Subcommand};
use envelope_engine::{
    BatchPolicy, EngineSettings, KvBudget, KvDtype, LoadOptions, Placement, Precision,
    SchedulerConfig,
};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "envelope",
    version,
    about = "Measure and enforce the safe operating envelope of self-hosted LLM servers"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Serve a model over an OpenAI-compatible HTTP API (embedded engine).
    Serve(ServeArgs),
    /// Measure the embedded engine: prefill and decode tokens/s, single and batched.
    BenchEngine(BenchArgs),
    /// Generate a completion for one prompt and print it.
    Generate(GenerateArgs),
    /// Sweep precision x batch policy x context bucket and write safe operating points as a profile.
    Sweep(SweepArgs),
    /// Write report.md, report.html and plots/*.svg for a profile (next to it, or into --out).
    Report(ReportArgs),
    /// Print the node fingerprint, a live GPU/host sample and, with --server, the server's engine state.
    Probe(ProbeArgs),
    /// Capacity plan: replicas a workload needs on a profile's node, per scenario and constraint.
    Plan(crate::plan::PlanArgs),
    /// Gate a candidate profile against a baseline (exit 0 pass, 1 fail, 2 unusable input, 3 inconclusive).
    Gate(crate::gate::GateArgs),
    /// Perplexity, KL divergence and top-1 agreement of a precision against a reference.
    Quality(crate::quality::QualityArgs),
    /// Govern an OpenAI-compatible server: admit only what a profile's limits allow.
    Govern(Box<crate::govern::GovernArgs>),
    /// GPU self-test for scripts/device-check.sh: device facts, kernel compile and every kernel against its CPU reference; --models: whole dummy models on the GPU against the CPU engine; --bench: GPU tokens/s; --gemm-bench: cuBLAS against the GEMM kernels.
    #[command(hide = true)]
    CudaSelftest(CudaSelftestArgs),
}

#[derive(Args, Debug)]
pub struct CudaSelftestArgs {
    /// Directory for selftest.json (model-check.json with --models,
    /// bench-cuda.json and .csv with --bench).
    #[arg(long)]
    pub out: PathBuf,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub ordinal: usize,
    /// Instead of the kernels: whole-model logits and greedy tokens of
    /// dummy models on the GPU against the CPU engine (model-check.json).
    #[arg(long)]
    pub models: bool,
    /// Instead of the kernels: prefill and decode tokens/s of a model on the
    /// GPU in bf16 and fp8 at batch 1/8/64 and context 1k/8k (bench-cuda.json, .csv).
    #[arg(long)]
    pub bench: bool,
    /// Instead of the kernels: GEMM throughput of cuBLAS against
    /// kernels/gemm.cu on Llama 3.1 8B's layer shapes at 1 to 4096 rows
    /// (gemm-bench.json, .csv).
    #[arg(long)]
    pub gemm_bench: bool,
    /// On the CPU-emulated GPU instead of a device: every kernel file
    /// compiled by the host C++ compiler (c++, or $CXX) against
    /// kernels/emu/emu.h, and a fake CUDA driver (libcuda.so.1)
    /// that runs each launch on them; the command then runs again on that
    /// driver, through the same runtime, cases and tolerances as on a GPU
    /// (with --models, --bench or --gemm-bench: those). No GPU, driver or
    /// NVRTC needed; says nothing of speed.
    #[arg(long)]
    pub emulate: bool,
    /// The model of --bench.
    #[arg(long, default_value = "dummy:llama-3.1-8b")]
    pub bench_model: String,
    /// The batch sizes of --bench (comma-separated).
    #[arg(long, default_value = "1,8,64", value_delimiter = ',')]
    pub bench_batches: Vec<usize>,
    /// The contexts of --bench, in tokens (comma-separated).
    #[arg(long, default_value = "1024,8192", value_delimiter = ',')]
    pub bench_contexts: Vec<usize>,
    /// The models of --models (comma-separated).
    #[arg(
        long,
        default_value = "dummy:smollm2-135m,dummy:llama-3.2-1b",
        value_delimiter = ','
    )]
    pub check_models: Vec<String>,
}

#[derive(Args, Debug)]
pub struct SweepArgs {
    /// The bench config (TOML; see bench-configs/).
    #[arg(long, env = "ENVELOPE_SWEEP_CONFIG")]
    pub config: PathBuf,
    /// Directory for profile.json, requests.csv and probes.csv.
    #[arg(long, env = "ENVELOPE_SWEEP_OUT", default_value = "sweep-out")]
    pub out: PathBuf,
    /// Machine output on stdout: one JSON line per probe as it ends
    /// (`{"event":"probe",...}`), then `{"event":"profile","profile":...}`.
    #[arg(long, env = "ENVELOPE_SWEEP_JSON")]
    pub json: bool,
    /// Compute threads (default: all cores).
    #[arg(long, env = "ENVELOPE_THREADS")]
    pub threads: Option<usize>,
    /// Run the whole search this many times (every configuration once a
    /// repeat, in turn), overriding `load.repeats`; the gate compares the
    /// repeats (docs/gate.md asks for 12 a side).
    #[arg(long, env = "ENVELOPE_SWEEP_REPEATS", value_parser = clap::value_parser!(u32).range(1..))]
    pub repeats: Option<u32>,
}

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// A profile written by `envelope sweep`.
    #[arg(long)]
    pub profile: PathBuf,
    /// Directory for the reports (default: the profile's directory).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Also write the profile, in the current schema, as profile.json in
    /// that directory (an older profile's per-bucket table is rebuilt from
    /// its sweep results where it holds them).
    #[arg(long)]
    pub upgrade: bool,
}

#[derive(Args, Debug)]
pub struct ProbeArgs {
    /// Print JSON instead of text (one object per line with --watch).
    #[arg(long)]
    pub json: bool,
    /// An inference server to read: its base URL or its /metrics URL (vLLM, SGLang, TGI, llama.cpp, envelope).
    #[arg(long, env = "ENVELOPE_PROBE_SERVER")]
    pub server: Option<String>,
    /// Keep sampling every --interval-ms until interrupted (or --count samples).
    #[arg(long)]
    pub watch: bool,
    /// Interval between samples with --watch, in milliseconds.
    #[arg(long, env = "ENVELOPE_PROBE_INTERVAL_MS", default_value_t = 1000)]
    pub interval_ms: u64,
    /// Stop --watch after this many samples.
    #[arg(long)]
    pub count: Option<u64>,
    /// A model to identify (file and SHA-256, directory, or dummy:<preset>[@seed]).
    #[arg(long)]
    pub model: Option<String>,
    /// Process whose memory is reported (default: this one).
    #[arg(long)]
    pub pid: Option<u32>,
}

#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// Model: a .gguf file, a Hugging Face directory (config.json, *.safetensors,
    /// tokenizer.json) or dummy:<preset>[@seed] (tiny, smollm2-135m, llama-3.2-1b,
    /// llama-3.1-8b, qwen2.5-7b).
    #[arg(long, env = "ENVELOPE_MODEL")]
    pub model: String,
    /// Weight precision after load: as-stored, f32, f16, bf16, q8_0, q4_0,
    /// fp8 (e4m3 W8A8 on CUDA with compute capability 8.9+; a numerical
    /// emulation on the CPU, for quality, not speed).
    #[arg(long, env = "ENVELOPE_PRECISION", default_value = "as-stored")]
    pub precision: Precision,
    /// KV-cache element type: f32, f16, bf16 (default: f32 on the CPU; on
    /// CUDA the activation dtype: bf16, or f16/f32 for those precisions).
    #[arg(long, env = "ENVELOPE_KV_DTYPE")]
    pub kv_dtype: Option<KvDtype>,
    /// KV-cache pool size, in bytes (suffixes K, M, G, KiB, MiB, GiB). Overrides --kv-cache-fraction.
    #[arg(long, env = "ENVELOPE_KV_CACHE_BYTES", value_parser = parse_bytes)]
    pub kv_cache_bytes: Option<usize>,
    /// KV-cache pool as a fraction of the available memory after load (the
    /// host's on the CPU, the GPU's free memory less an activation reserve on CUDA).
    #[arg(long, env = "ENVELOPE_KV_CACHE_FRACTION", default_value_t = 0.2)]
    pub kv_cache_fraction: f64,
    /// Tokens per KV block.
    #[arg(long, env = "ENVELOPE_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: usize,
    /// Batch policy: continuous (admit at every step) or static (fixed batches).
    #[arg(long, env = "ENVELOPE_BATCH_POLICY", default_value = "continuous")]
    pub batch_policy: BatchPolicy,
    /// Most sequences in the running batch.
    #[arg(long, env = "ENVELOPE_MAX_NUM_SEQS", default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Most tokens (prefill + decode) in one step.
    #[arg(long, env = "ENVELOPE_MAX_NUM_BATCHED_TOKENS", default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Split long prompts across steps (true/false).
    #[arg(long, env = "ENVELOPE_CHUNKED_PREFILL", default_value_t = true, action = ArgAction::Set)]
    pub chunked_prefill: bool,
    /// Static batching: wait this long for more requests before a new batch
    /// forms (until none arrives for this long, or the batch is full).
    #[arg(long, env = "ENVELOPE_STATIC_BATCH_WAIT_MS", default_value_t = 5)]
    pub static_batch_wait_ms: u64,
    /// Longest prompt + output accepted (default: the model's context length).
    #[arg(long, env = "ENVELOPE_MAX_MODEL_LEN")]
    pub max_model_len: Option<usize>,
    /// A tokenizer.json (or .gguf) to use instead of the model's own.
    #[arg(long, env = "ENVELOPE_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// Compute threads (default: all cores).
    #[arg(long, env = "ENVELOPE_THREADS")]
    pub threads: Option<usize>,
    /// Where the model runs: cpu, cuda, cuda:N, or auto (CUDA device 0 when
    /// usable, else the CPU, saying why). On CUDA, bf16/f16/fp8 need a KV
    /// cache of the activation dtype (--kv-dtype bf16 or f16); --kv-cache-fraction
    /// is then a fraction of the GPU's free memory after the weights.
    #[arg(long, env = "ENVELOPE_DEVICE", default_value = "cpu")]
    pub device: envelope_cuda::DeviceSetting,
}

impl EngineArgs {
    /// `--device` resolved for this precision and KV dtype (by the engine:
    /// [`envelope_engine::device::resolve`]).
    pub fn placement(&self) -> Result<Placement> {
        Ok(envelope_engine::device::resolve(
            self.device,
            &[(self.precision, self.kv_dtype)],
        )?)
    }

    pub fn load_options(&self) -> LoadOptions {
        LoadOptions {
            precision: self.precision,
            tokenizer: self.tokenizer.clone(),
        }
    }

    /// The flags as the engine's settings, checked by the engine's own
    /// [`EngineSettings::validate`] before any model is loaded.
    pub fn engine_settings(&self, placement: Placement) -> Result<EngineSettings> {
        let cfg = EngineSettings {
            kv_dtype: envelope_engine::device::kv_dtype(placement, self.precision, self.kv_dtype),
            kv_budget: match self.kv_cache_bytes {
                Some(b) => KvBudget::Bytes(b),
                None => KvBudget::FractionOfAvailable(self.kv_cache_fraction),
            },
            block_size: self.block_size,
            scheduler: SchedulerConfig {
                policy: self.batch_policy,
                max_num_seqs: self.max_num_seqs,
                max_num_batched_tokens: self.max_num_batched_tokens,
                chunked_prefill: self.chunked_prefill,
                static_batch_wait_ms: self.static_batch_wait_ms,
            },
            max_model_len: self.max_model_len,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Sizes the compute thread pools; must run before any pool starts.
    pub fn apply_threads(&self) {
        if let Some(n) = self.threads {
            std::env::set_var("RAYON_NUM_THREADS", n.to_string());
        }
    }
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address to listen on.
    #[arg(long, env = "ENVELOPE_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one; the chosen port is logged).
    #[arg(long, env = "ENVELOPE_PORT", default_value_t = 8000)]
    pub port: u16,
    /// Model id clients use (default: the model file's name).
    #[arg(long, env = "ENVELOPE_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Prompt length for the prefill measurement, in tokens.
    #[arg(long, env = "ENVELOPE_BENCH_PROMPT_TOKENS", default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens decoded per sequence.
    #[arg(long, env = "ENVELOPE_BENCH_DECODE_TOKENS", default_value_t = 64)]
    pub decode_tokens: usize,
    /// Concurrent sequences for the aggregate decode measurement (comma-separated).
    #[arg(
        long,
        env = "ENVELOPE_BENCH_CONCURRENCY",
        default_value = "1,4,16",
        value_delimiter = ','
    )]
    pub concurrency: Vec<usize>,
    /// Prompt length of each sequence in the aggregate decode runs.
    #[arg(
        long,
        env = "ENVELOPE_BENCH_DECODE_PROMPT_TOKENS",
        default_value_t = 32
    )]
    pub decode_prompt_tokens: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// The prompt (completion style; add --chat to apply the chat template).
    #[arg(long)]
    pub prompt: String,
    #[arg(long)]
    pub chat: bool,
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long)]
    pub seed: Option<u64>,
}

/// `1048576`, `512M`, `512MiB`, `2G`, `1.5GiB`.
pub fn parse_bytes(s: &str) -> std::result::Result<usize, String> {
    envelope_engine::util::parse_bytes(s)
        .ok_or_else(|| format!("`{s}` is not a byte size (e.g. 1073741824, 512MiB, 2G)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_bytes("1024").unwrap(), 1024);
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("2G").unwrap(), 2_000_000_000);
        assert_eq!(parse_bytes("1.5GiB").unwrap(), 3 << 29);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("5XB").is_err());
    }

    #[test]
    fn flags_parse_into_settings() {
        let cli = Cli::try_parse_from([
            "envelope",
            "serve",
            "--model",
            "dummy:tiny",
            "--batch-policy",
            "static",
            "--chunked-prefill",
            "false",
            "--kv-cache-bytes",
            "64MiB",
            "--precision",
            "q8_0",
        ])
        .unwrap();
        let Command::Serve(s) = cli.command else {
            panic!()
        };
        let c = s.engine.engine_settings(Placement::Cpu).unwrap();
        assert_eq!(c.scheduler.policy, BatchPolicy::Static);
        assert!(!c.scheduler.chunked_prefill);
        assert_eq!(c.kv_budget, KvBudget::Bytes(64 << 20));
        assert_eq!(s.engine.precision, Precision::Q8_0);
        assert!(
            Cli::try_parse_from(["envelope", "serve", "--model", "x", "--precision", "q3"])
                .is_err()
        );
    }

    /// Settings the engine would refuse are refused before a model loads,
    /// by the engine's own check, naming the setting.
    #[test]
    fn invalid_settings_are_the_engines_errors() {
        for (flag, value, field) in [
            ("--kv-cache-fraction", "1.5", "kv_cache_fraction"),
            ("--max-num-seqs", "0", "max_num_seqs"),
            ("--block-size", "0", "block_size"),
        ] {
            let cli =
                Cli::try_parse_from(["envelope", "serve", "--model", "dummy:tiny", flag, value])
                    .unwrap();
            let Command::Serve(s) = cli.command else {
                panic!()
            };
            let e = s.engine.engine_settings(Placement::Cpu).unwrap_err();
            assert!(e.to_string().contains(field), "{flag}: {e}");
        }
    }
}
